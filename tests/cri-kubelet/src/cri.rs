//! The CRI client: a tonic channel over containerd's unix socket, running the configured
//! pods (sandbox with host network, one container per name), looking containers up and
//! reading their statistics.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::config::PodSpec;

/// A connected CRI runtime service.
#[derive(Clone)]
pub struct Runtime {
    client: RuntimeServiceClient<Channel>,
    timeout: Duration,
}

/// A running pod: its sandbox and its containers (name → id, log path).
#[derive(Debug, Clone)]
pub struct RunningPod {
    pub spec: PodSpec,
    pub sandbox_id: String,
    pub log_dir: PathBuf,
    pub containers: HashMap<String, String>,
}

fn with_timeout<T>(t: Duration, mut r: tonic::Request<T>) -> tonic::Request<T> {
    r.set_timeout(t);
    r
}

impl Runtime {
    /// Connect to the CRI at the unix socket `path`, and check that it answers `Version`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Runtime> {
        let path = path.to_path_buf();
        let shown = path.display().to_string();
        // The URI is required by tonic but unused: the connector dials the socket.
        let channel = Endpoint::try_from("http://[::1]:1")
            .context("CRI endpoint")?
            .connect_timeout(timeout)
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let p = path.clone();
                async move {
                    let s = tokio::net::UnixStream::connect(p).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(s))
                }
            }))
            .await
            .with_context(|| format!("connecting to the CRI at {shown}"))?;
        let mut rt = Runtime {
            client: RuntimeServiceClient::new(channel),
            timeout,
        };
        let v = rt
            .client
            .version(with_timeout(
                timeout,
                tonic::Request::new(cri::VersionRequest::default()),
            ))
            .await
            .with_context(|| format!("CRI Version at {shown}"))?
            .into_inner();
        tracing::info!(
            runtime = %v.runtime_name,
            version = %v.runtime_version,
            api = %v.runtime_api_version,
            "connected to the CRI"
        );
        Ok(rt)
    }

    fn req<T>(&self, t: T) -> tonic::Request<T> {
        with_timeout(self.timeout, tonic::Request::new(t))
    }

    /// Run one pod: a host-network sandbox and its containers, started.
    pub async fn run_pod(
        &mut self,
        spec: &PodSpec,
        node: &str,
        log_root: &Path,
        image: &str,
        script: &str,
        share_dir: Option<&Path>,
    ) -> Result<RunningPod> {
        let log_dir = log_root.join(format!("{}_{}_{}", spec.namespace, spec.name, spec.uid));
        std::fs::create_dir_all(&log_dir)
            .with_context(|| format!("creating {}", log_dir.display()))?;
        let sandbox_config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: spec.name.clone(),
                uid: spec.uid.clone(),
                namespace: spec.namespace.clone(),
                attempt: 0,
            }),
            // Host-network pods keep the node's hostname (no private UTS namespace).
            hostname: String::new(),
            log_directory: log_dir.display().to_string(),
            labels: HashMap::from([
                ("io.kubernetes.pod.name".into(), spec.name.clone()),
                ("io.kubernetes.pod.namespace".into(), spec.namespace.clone()),
                ("io.kubernetes.pod.uid".into(), spec.uid.clone()),
                ("tether.node".into(), node.to_string()),
            ]),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        pid: cri::NamespaceMode::Pod as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let sandbox_id = self
            .client
            .run_pod_sandbox(self.req(cri::RunPodSandboxRequest {
                config: Some(sandbox_config.clone()),
                ..Default::default()
            }))
            .await
            .with_context(|| format!("RunPodSandbox {}/{}", spec.namespace, spec.name))?
            .into_inner()
            .pod_sandbox_id;
        match self
            .start_containers(
                spec,
                node,
                &sandbox_id,
                &sandbox_config,
                image,
                script,
                share_dir,
            )
            .await
        {
            Ok(containers) => Ok(RunningPod {
                spec: spec.clone(),
                sandbox_id,
                log_dir,
                containers,
            }),
            Err(e) => {
                if let Err(e2) = self.remove_pod(&sandbox_id).await {
                    tracing::warn!("removing half-made pod {}: {e2:#}", spec.name);
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_containers(
        &mut self,
        spec: &PodSpec,
        node: &str,
        sandbox_id: &str,
        sandbox_config: &cri::PodSandboxConfig,
        image: &str,
        script: &str,
        share_dir: Option<&Path>,
    ) -> Result<HashMap<String, String>> {
        let mut containers = HashMap::new();
        let mounts: Vec<cri::Mount> = share_dir
            .map(|d| cri::Mount {
                container_path: "/share".into(),
                host_path: d.display().to_string(),
                ..Default::default()
            })
            .into_iter()
            .collect();
        for c in &spec.containers {
            let env = |key: &str, value: &str| cri::KeyValue {
                key: key.into(),
                value: value.into(),
            };
            let config = cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: c.clone(),
                    attempt: 0,
                }),
                image: Some(cri::ImageSpec {
                    image: image.to_string(),
                    ..Default::default()
                }),
                command: vec!["/bin/sh".into(), "-c".into(), script.to_string()],
                // What a pod spec would pass with the downward API (spec.nodeName,
                // metadata.name, metadata.namespace), and the container's name.
                envs: vec![
                    env("CONTAINER", c),
                    env("HOME", "/tmp"),
                    env("NODE_NAME", node),
                    env("POD_NAME", &spec.name),
                    env("POD_NAMESPACE", &spec.namespace),
                ],
                mounts: mounts.clone(),
                working_dir: "/tmp".into(),
                log_path: format!("{c}/0.log"),
                stdin: true,
                labels: HashMap::from([("io.kubernetes.container.name".into(), c.clone())]),
                ..Default::default()
            };
            let id = self
                .client
                .create_container(self.req(cri::CreateContainerRequest {
                    pod_sandbox_id: sandbox_id.to_string(),
                    config: Some(config),
                    sandbox_config: Some(sandbox_config.clone()),
                }))
                .await
                .with_context(|| format!("CreateContainer {c} in {}", spec.name))?
                .into_inner()
                .container_id;
            self.client
                .start_container(self.req(cri::StartContainerRequest {
                    container_id: id.clone(),
                }))
                .await
                .with_context(|| format!("StartContainer {c} in {}", spec.name))?;
            containers.insert(c.clone(), id);
        }
        Ok(containers)
    }

    /// Stop and remove a pod's sandbox (and with it its containers).
    pub async fn remove_pod(&mut self, sandbox_id: &str) -> Result<()> {
        self.client
            .stop_pod_sandbox(self.req(cri::StopPodSandboxRequest {
                pod_sandbox_id: sandbox_id.into(),
            }))
            .await
            .with_context(|| format!("StopPodSandbox {sandbox_id}"))?;
        self.client
            .remove_pod_sandbox(self.req(cri::RemovePodSandboxRequest {
                pod_sandbox_id: sandbox_id.into(),
            }))
            .await
            .with_context(|| format!("RemovePodSandbox {sandbox_id}"))?;
        Ok(())
    }

    /// CRI Exec: the streaming URL for a command in a container.
    pub async fn exec_url(
        &mut self,
        container_id: &str,
        cmd: Vec<String>,
        io: StreamFlags,
    ) -> Result<String> {
        if cmd.is_empty() {
            bail!("no command given");
        }
        Ok(self
            .client
            .exec(self.req(cri::ExecRequest {
                container_id: container_id.into(),
                cmd,
                tty: io.tty,
                stdin: io.stdin,
                stdout: io.stdout,
                stderr: io.stderr,
            }))
            .await
            .context("CRI Exec")?
            .into_inner()
            .url)
    }

    /// CRI Attach: the streaming URL for a container's main process.
    pub async fn attach_url(&mut self, container_id: &str, io: StreamFlags) -> Result<String> {
        Ok(self
            .client
            .attach(self.req(cri::AttachRequest {
                container_id: container_id.into(),
                tty: io.tty,
                stdin: io.stdin,
                stdout: io.stdout,
                stderr: io.stderr,
            }))
            .await
            .context("CRI Attach")?
            .into_inner()
            .url)
    }

    /// CRI PortForward: the streaming URL for a pod sandbox.
    pub async fn port_forward_url(&mut self, sandbox_id: &str) -> Result<String> {
        Ok(self
            .client
            .port_forward(self.req(cri::PortForwardRequest {
                pod_sandbox_id: sandbox_id.into(),
                port: Vec::new(),
            }))
            .await
            .context("CRI PortForward")?
            .into_inner()
            .url)
    }

    /// The CRI's sandboxes and containers, for `/pods`.
    pub async fn list(&mut self) -> Result<(Vec<cri::PodSandbox>, Vec<cri::Container>)> {
        let sandboxes = self
            .client
            .list_pod_sandbox(self.req(cri::ListPodSandboxRequest::default()))
            .await
            .context("CRI ListPodSandbox")?
            .into_inner()
            .items;
        let containers = self
            .client
            .list_containers(self.req(cri::ListContainersRequest::default()))
            .await
            .context("CRI ListContainers")?
            .into_inner()
            .containers;
        Ok((sandboxes, containers))
    }
}

impl Runtime {
    /// CRI ListContainerStats: every container's CPU, memory and writable-layer usage.
    pub async fn container_stats(&mut self) -> Result<Vec<cri::ContainerStats>> {
        Ok(self
            .client
            .list_container_stats(self.req(cri::ListContainerStatsRequest::default()))
            .await
            .context("CRI ListContainerStats")?
            .into_inner()
            .stats)
    }
}

/// Which streams an exec or attach asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamFlags {
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}
