//! A private containerd for tests and the demo: its own config, root, state, runc root
//! and socket under one directory; the CRI plugin with host-network pods (no CNI) and a
//! sandbox image built here from Debian's static busybox (no registry is reachable).
//!
//! [`Containerd::start`] builds the OCI images (`tether.local/busybox:1` for containers,
//! `tether.local/pause:1` as sandbox image), starts containerd, waits for its socket and
//! imports the images with containerd's own `ctr images import`. [`Containerd::stop`]
//! removes every task and container left in its `k8s.io` namespace, stops containerd,
//! unmounts whatever is still mounted under its directory and deletes the directory.
//! A missing or unusable containerd is an error that says why; nothing is skipped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::process::Command;

use crate::process::{Proc, SpawnOptions};
use crate::sha256_hex;

/// The container image every CRI pod runs.
pub const IMAGE: &str = "tether.local/busybox:1";
/// The sandbox ("pause") image.
pub const PAUSE_IMAGE: &str = "tether.local/pause:1";
/// The static busybox the images are made of (Debian `busybox-static`).
pub const BUSYBOX: &str = "/bin/busybox";
/// Bound on containerd creating its socket, and on each `ctr` call.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running private containerd.
pub struct Containerd {
    pub dir: PathBuf,
    pub socket: PathBuf,
    proc: Option<Proc>,
}

fn config(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Inside a container we may not lower oom_score_adj below our own (the pause
  # container asks for -998).
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_tls_streaming = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{d}/cni/bin"
    conf_dir = "{d}/cni/conf"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{d}/runc"
"#
    )
}

async fn run(cmd: &mut Command, what: &str) -> Result<Vec<u8>> {
    let out = tokio::time::timeout(START_TIMEOUT, cmd.output())
        .await
        .with_context(|| format!("{what}: timed out after {START_TIMEOUT:?}"))?
        .with_context(|| format!("{what}: cannot run"))?;
    if !out.status.success() {
        bail!(
            "{what}: {} — {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// Builds an OCI image layout tarball holding the busybox and pause images.
pub async fn build_images(work: &Path) -> Result<PathBuf> {
    let rootfs = work.join("rootfs");
    for d in ["bin", "tmp", "etc", "proc", "dev", "sys"] {
        std::fs::create_dir_all(rootfs.join(d))
            .with_context(|| format!("creating {}", rootfs.join(d).display()))?;
    }
    if !Path::new(BUSYBOX).is_file() {
        bail!("{BUSYBOX} is missing: install Debian's busybox-static (scripts/setup.sh)");
    }
    std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).context("copying busybox")?;
    let list = run(
        Command::new(rootfs.join("bin/busybox")).arg("--list"),
        "busybox --list",
    )
    .await?;
    for applet in String::from_utf8_lossy(&list).lines() {
        if applet != "busybox" && !applet.is_empty() {
            let link = rootfs.join("bin").join(applet);
            if !link.exists() {
                std::os::unix::fs::symlink("busybox", &link)
                    .with_context(|| format!("linking {}", link.display()))?;
            }
        }
    }
    // Files the runtime bind-mounts over must exist in a read-only root.
    for (f, content) in [
        ("etc/resolv.conf", ""),
        ("etc/hosts", "127.0.0.1 localhost\n"),
        ("etc/hostname", ""),
        ("etc/passwd", "root:x:0:0:root:/tmp:/bin/sh\n"),
        ("etc/group", "root:x:0:\n"),
    ] {
        std::fs::write(rootfs.join(f), content).with_context(|| format!("writing {f}"))?;
    }
    let layer = work.join("layer.tar");
    run(
        Command::new("tar")
            .args([
                "--sort=name",
                "--mtime=@0",
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "-C",
            ])
            .arg(&rootfs)
            .arg("-cf")
            .arg(&layer)
            .arg("."),
        "tar of the image layer",
    )
    .await?;
    let oci = work.join("oci");
    let blobs = oci.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).context("creating the OCI layout")?;
    let blob = |data: &[u8]| -> Result<(String, usize)> {
        let d = sha256_hex(data);
        std::fs::write(blobs.join(&d), data).context("writing a blob")?;
        Ok((format!("sha256:{d}"), data.len()))
    };
    let layer_bytes = std::fs::read(&layer).context("reading the layer")?;
    let (layer_digest, layer_size) = blob(&layer_bytes)?;
    let mut manifests = Vec::new();
    for (name, entrypoint, cmd) in [
        (
            IMAGE,
            serde_json::Value::Null,
            serde_json::json!(["/bin/sh"]),
        ),
        (
            PAUSE_IMAGE,
            serde_json::json!(["/bin/sleep"]),
            serde_json::json!(["2147483647"]),
        ),
    ] {
        let config = serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Entrypoint": entrypoint, "Cmd": cmd, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        });
        let (cd, cs) = blob(config.to_string().as_bytes())?;
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
        });
        let (md, ms) = blob(manifest.to_string().as_bytes())?;
        let tag = name.rsplit(':').next().unwrap_or("latest");
        manifests.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
        }));
    }
    std::fs::write(
        oci.join("index.json"),
        serde_json::json!({"schemaVersion": 2, "manifests": manifests}).to_string(),
    )
    .context("writing index.json")?;
    std::fs::write(oci.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
        .context("writing oci-layout")?;
    let tarball = work.join("images.tar");
    run(
        Command::new("tar")
            .arg("-C")
            .arg(&oci)
            .arg("-cf")
            .arg(&tarball)
            .arg("."),
        "tar of the OCI layout",
    )
    .await?;
    Ok(tarball)
}

impl Containerd {
    /// Starts a private containerd under `dir` (created) with the images imported.
    pub async fn start(dir: &Path, log_dir: &Path) -> Result<Containerd> {
        Self::start_with(dir, log_dir, SpawnOptions::default()).await
    }

    /// [`Containerd::start`] with the process spawned per `opts` (the demo puts it in its
    /// own process group so that a terminal's Ctrl-C does not stop it before its pods).
    pub async fn start_with(dir: &Path, log_dir: &Path, opts: SpawnOptions) -> Result<Containerd> {
        let dir = std::path::absolute(dir).context("absolute containerd dir")?;
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for tool in ["containerd", "ctr", "runc"] {
            if which(tool).is_none() {
                bail!("`{tool}` is not installed: run scripts/setup.sh (Debian containerd, runc)");
            }
        }
        let images = build_images(&dir.join("image-build")).await?;
        let cfg = dir.join("config.toml");
        std::fs::write(&cfg, config(&dir)).context("writing containerd config")?;
        let socket = dir.join("containerd.sock");
        let mut cmd = Command::new("containerd");
        cmd.arg("--config").arg(&cfg);
        let proc = Proc::spawn("containerd", cmd, log_dir, opts)?;
        let mut me = Containerd {
            dir: dir.clone(),
            socket: socket.clone(),
            proc: Some(proc),
        };
        let start = Instant::now();
        while !socket.exists() {
            if let Some(p) = me.proc.as_mut() {
                if let Some(s) = p.exited() {
                    bail!("containerd exited ({s}): {}", p.stderr_tail(15));
                }
            }
            if start.elapsed() > START_TIMEOUT {
                bail!(
                    "containerd did not create {} within {START_TIMEOUT:?}",
                    socket.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let plugins = run(me.ctr().args(["plugins", "ls"]), "ctr plugins ls").await?;
        let cri_ok = String::from_utf8_lossy(&plugins).lines().any(|l| {
            l.contains("io.containerd.grpc.v1")
                && l.contains(" cri ")
                && l.trim_end().ends_with("ok")
        });
        if !cri_ok {
            bail!(
                "containerd's CRI plugin is not loaded:\n{}",
                String::from_utf8_lossy(&plugins)
            );
        }
        run(
            me.ctr().args(["images", "import"]).arg(&images),
            "ctr images import",
        )
        .await?;
        Ok(me)
    }

    /// `ctr` against this containerd, namespace `k8s.io`.
    pub fn ctr(&self) -> Command {
        let mut c = Command::new("ctr");
        c.arg("-a").arg(&self.socket).args(["-n", "k8s.io"]);
        c
    }

    /// Removes every task and container left, stops containerd, unmounts and deletes
    /// its directory. Returns what it had to clean up (empty when nothing was left).
    pub async fn stop(mut self) -> Result<Vec<String>> {
        let mut leftovers = Vec::new();
        if let Ok(ids) = run(
            self.ctr().args(["containers", "ls", "-q"]),
            "ctr containers ls",
        )
        .await
        {
            for id in String::from_utf8_lossy(&ids).split_whitespace() {
                leftovers.push(format!("container {id}"));
                let _ = run(self.ctr().args(["tasks", "rm", "-f", id]), "ctr tasks rm").await;
                let _ = run(
                    self.ctr().args(["containers", "rm", id]),
                    "ctr containers rm",
                )
                .await;
            }
        }
        if let Some(mut p) = self.proc.take() {
            p.terminate(Duration::from_secs(5)).await;
        }
        // Whatever is still mounted below our directory (deepest first).
        let prefix = self.dir.display().to_string();
        let mut mounts: Vec<String> = std::fs::read_to_string("/proc/self/mounts")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
            .filter(|m| m.starts_with(&prefix))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            leftovers.push(format!("mount {m}"));
            let _ = run(Command::new("umount").arg("-l").arg(&m), "umount").await;
        }
        std::fs::remove_dir_all(&self.dir)
            .with_context(|| format!("removing {}", self.dir.display()))?;
        Ok(leftovers)
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(tool))
            .find(|f| f.is_file())
    })
}
