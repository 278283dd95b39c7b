//! `tether-demo`: Tether end to end on loopback with a real kubectl, in one command
//! (`scripts/demo.sh` builds the workspace and runs this).
//!
//! It mints every certificate, starts a private containerd and the CRI-backed kubelet
//! stand-in (`cri-kubelet`) when containerd can run here (else, saying why, the kubelet
//! simulator) running pod `default/hello`
//! on node `edge-1`, the apiserver stand-in whose kubelet connections all go to the
//! cloud, `tether-cloud` (routing by the stand-in's pods and nodes, as deployed) and a
//! `tether-edge` for `edge-1`; writes a kubeconfig; runs
//! `kubectl exec` and `kubectl logs` through the tunnel and prints what they printed;
//! then keeps everything running and says how to use kubectl against it. Ctrl-C (or
//! SIGTERM/SIGHUP) stops every process in order and removes the run directory.
//!
//! kubectl: `$KUBECTL`, else `/usr/lib/google-cloud-sdk/bin/kubectl.1.33`, else `kubectl`
//! on `PATH`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tether_tests::cluster::{Cluster, ClusterSpec, Mode, NodeSpec, PodSpec};
use tether_tests::containerd::Containerd;
use tether_tests::kubectl::{self, Kubectl, KubectlBin};
use tether_tests::process::SpawnOptions;
use tokio::signal::unix::{signal, SignalKind};

const NODE: &str = "edge-1";
const POD: &str = "hello";
const CONTAINER: &str = "app";

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tether-demo: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(demo()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tether-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The kubectl the demo uses.
async fn find_kubectl() -> Result<KubectlBin> {
    let path = match std::env::var_os("KUBECTL") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ if Path::new(kubectl::KUBECTL_133).is_file() => PathBuf::from(kubectl::KUBECTL_133),
        _ => std::env::var_os("PATH")
            .and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join("kubectl"))
                    .find(|p| p.is_file())
            })
            .context(
                "no kubectl found: install kubectl, or set KUBECTL=/path/to/kubectl \
                 (tried $KUBECTL, /usr/lib/google-cloud-sdk/bin/kubectl.1.33, PATH)",
            )?,
    };
    if !path.is_file() {
        bail!("KUBECTL={} does not exist", path.display());
    }
    let version = kubectl::client_version(&path).await?;
    Ok(KubectlBin { path, version })
}

fn spec(cri_runtime: Option<PathBuf>) -> ClusterSpec {
    ClusterSpec {
        mode: Mode::Tunnel,
        nodes: vec![NodeSpec {
            name: NODE.into(),
            pods: vec![PodSpec::new("default", POD, &[CONTAINER])],
        }],
        phantom_pods: Vec::new(),
        impostor_pods: Vec::new(),
        own_process_groups: true,
        certs_via_cli: true,
        cri_runtime,
        cri_script: None,
        replicas: 1,
        cloud_args: Vec::new(),
        edge_args: Vec::new(),
    }
}

/// A private containerd when it can run here; else why not.
async fn try_containerd(dir: &Path) -> std::result::Result<Containerd, String> {
    let logs = dir.join("process-logs-containerd");
    std::fs::create_dir_all(&logs).map_err(|e| format!("creating {}: {e}", logs.display()))?;
    let opts = SpawnOptions {
        stdin: false,
        own_process_group: true,
    };
    Containerd::start_with(&dir.join("containerd"), &logs, opts)
        .await
        .map_err(|e| format!("{e:#}"))
}

/// Runs `kubectl args` and prints it like a terminal session would.
async fn show(k: &Kubectl, shown: &str, args: &[&str]) -> Result<()> {
    println!("$ kubectl {shown}");
    let out = k
        .run(args, None, Duration::from_secs(30))
        .await
        .with_context(|| format!("kubectl {shown}"))?;
    print!("{}", out.stdout_text());
    if out.code != Some(0) {
        bail!(
            "kubectl {shown} exited with {:?}: {}",
            out.code,
            out.stderr.trim()
        );
    }
    Ok(())
}

async fn demo() -> Result<ExitCode> {
    let bin = find_kubectl().await?;
    let root = tempfile::Builder::new()
        .prefix("tether-demo-")
        .tempdir()
        .context("creating the run directory")?;
    let dir = root.path().to_path_buf();
    println!(
        "Tether demo: everything on loopback; certificates, kubeconfig and logs in {}",
        dir.display()
    );
    let ctd = match try_containerd(&dir).await {
        Ok(c) => {
            println!(
                "  containerd      private instance, socket {}",
                c.socket.display()
            );
            Some(c)
        }
        Err(why) => {
            println!("  containerd cannot run here, so the pods are kubelet-sim's: {why}");
            None
        }
    };
    let kubelet_name = if ctd.is_some() {
        "cri-kubelet"
    } else {
        "kubelet-sim"
    };
    let mut cluster =
        match Cluster::start(&spec(ctd.as_ref().map(|c| c.socket.clone())), &dir).await {
            Ok(c) => c,
            Err(e) => {
                if let Some(c) = ctd {
                    let _ = c.stop().await;
                }
                let kept = root.keep();
                bail!(
                    "{e:#}\n(run directory kept for inspection: {})",
                    kept.display()
                );
            }
        };
    let log = cluster.log_path(NODE, "default", POD, CONTAINER)?;
    if ctd.is_none() {
        std::fs::write(
            &log,
            "hello from the container's log\nthis line travelled through tether-cloud and tether-edge\n\
             the kubelet here is kubelet-sim, the apiserver apiserver-sim\n",
        )
        .with_context(|| format!("writing {}", log.display()))?;
    }

    let node = cluster.node(NODE)?;
    if let Some(cloud) = &cluster.cloud {
        println!(
            "  tether-cloud    tunnel (QUIC) {}   kubelet API (HTTPS) {}   routes by apiserver-sim's pods and nodes",
            cloud.tunnel_addr, cloud.kubelet_api_addr
        );
    }
    println!(
        "  tether-edge     node {NODE}, replays streams to http://{}",
        node.kubelet_addr
    );
    println!(
        "  {kubelet_name:<15} node {NODE} at {}, pod default/{POD} (container {CONTAINER})",
        node.kubelet_addr
    );
    println!(
        "  apiserver-sim   {}  (dials every kubelet at tether-cloud)",
        cluster.apiserver_url
    );
    println!("  kubectl         {} ({})", bin.path.display(), bin.version);
    println!();

    let k = Kubectl::new(bin.clone(), &cluster.kubeconfig, &dir.join("kubectl-home"))?;
    let shown = show(
        &k,
        "exec hello -- sh -c 'echo \"hello from pod $HOSTNAME\"; uname -sm'",
        &[
            "exec",
            POD,
            "--",
            "sh",
            "-c",
            "echo \"hello from pod $HOSTNAME\"; uname -sm",
        ],
    )
    .await;
    let shown = match shown {
        Ok(()) => show(&k, "logs hello", &["logs", POD]).await,
        Err(e) => Err(e),
    };
    if let Err(e) = shown {
        eprintln!("tether-demo: {e:#}\n{}", cluster.diagnostics(20));
        for line in cluster.shutdown().await {
            eprintln!("  {line}");
        }
        if let Some(c) = ctd {
            if let Err(e) = c.stop().await {
                eprintln!("  containerd: {e:#}");
            }
        }
        let kept = root.keep();
        eprintln!("(run directory kept for inspection: {})", kept.display());
        return Ok(ExitCode::FAILURE);
    }

    let kc = bin.path.display();
    println!();
    println!("Tether demo is running. From another terminal:");
    println!("  export KUBECONFIG={}", cluster.kubeconfig.display());
    println!("  {kc} exec -it {POD} -- sh");
    if ctd.is_some() {
        println!("  {kc} logs -f {POD}        # then, elsewhere: {kc} attach -i {POD}  (the container runs cat)");
    } else {
        println!(
            "  {kc} logs -f {POD}        # then: echo more >> {}",
            log.display()
        );
        println!("  {kc} get --raw /api/v1/nodes/{NODE}/proxy/stats/summary");
    }
    println!(
        "Process logs: {}. Press Ctrl-C to stop everything.",
        dir.join("process-logs").display()
    );

    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut hup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let code = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break ExitCode::SUCCESS,
            _ = term.recv() => break ExitCode::SUCCESS,
            _ = hup.recv() => break ExitCode::SUCCESS,
            _ = tick.tick() => {
                let dead = cluster.exited();
                if !dead.is_empty() {
                    eprintln!("tether-demo: {}\n{}", dead.join("; "), cluster.diagnostics(20));
                    break ExitCode::FAILURE;
                }
            }
        }
    };
    println!();
    println!("Stopping…");
    for line in cluster.shutdown().await {
        println!("  {line}");
    }
    if let Some(c) = ctd {
        match c.stop().await {
            Ok(left) if left.is_empty() => println!("  containerd: stopped"),
            Ok(left) => println!("  containerd: stopped; removed what was left: {left:?}"),
            Err(e) => println!("  containerd: {e:#}"),
        }
    }
    if code == ExitCode::SUCCESS {
        drop(root);
        println!("Stopped; {} removed.", dir.display());
    } else {
        let kept = root.keep();
        println!("Stopped; logs kept in {}.", kept.display());
    }
    Ok(code)
}
