//! Command-line configuration (clap derive) and the `--pod ns/name[/uid]=c1,c2` specs.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;

/// A kubelet stand-in whose pods are containerd CRI sandboxes.
#[derive(Debug, Clone, Parser)]
#[command(name = "cri-kubelet", version, about)]
pub struct Cli {
    /// Address of the kubelet API (plain HTTP).
    #[arg(long, default_value = "127.0.0.1:10350")]
    pub listen: SocketAddr,
    /// The CRI runtime endpoint (containerd's unix socket).
    #[arg(long)]
    pub runtime_endpoint: PathBuf,
    /// Node name.
    #[arg(long, default_value = "edge-1")]
    pub node_name: String,
    /// A pod to run: `ns/name[/uid]=container1,container2` (repeatable).
    #[arg(long = "pod", value_parser = parse_pod_spec)]
    pub pods: Vec<PodSpec>,
    /// Image of every container (must already be in the runtime's image store).
    #[arg(long, default_value = "tether.local/busybox:1")]
    pub image: String,
    /// Shell script every container runs (`sh -c`); `$CONTAINER` names the container.
    #[arg(
        long,
        default_value = "echo \"container $CONTAINER started\"; exec cat"
    )]
    pub script: String,
    /// Root of the pods' CRI log directories.
    #[arg(long)]
    pub log_root: PathBuf,
    /// A host directory bind-mounted read-write at `/share` in every container (the
    /// tests keep FIFOs there that feed the containers' main processes).
    #[arg(long)]
    pub share_dir: Option<PathBuf>,
    /// Bound on each CRI call.
    #[arg(long, default_value = "30")]
    pub cri_timeout_secs: u64,
    /// Remove the pods (stop and remove sandboxes) when terminated by SIGTERM/SIGINT.
    #[arg(long, default_value_t = true)]
    pub cleanup: bool,
}

/// One pod to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub containers: Vec<String>,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

/// Parse `ns/name[/uid]=c1,c2`.
pub fn parse_pod_spec(s: &str) -> Result<PodSpec> {
    let (path, containers) = s
        .split_once('=')
        .context("expected ns/name[/uid]=container1,container2")?;
    let parts: Vec<&str> = path.split('/').collect();
    let (namespace, name, uid) = match parts.as_slice() {
        [ns, name] => (*ns, *name, format!("{ns}-{name}-uid")),
        [ns, name, uid] => (*ns, *name, uid.to_string()),
        _ => bail!("expected ns/name[/uid] before '=', got {path:?}"),
    };
    if !valid_name(namespace) || !valid_name(name) || !valid_name(&uid) {
        bail!("invalid namespace, pod name or uid in {path:?}");
    }
    let containers: Vec<String> = containers
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect();
    if containers.is_empty() || !containers.iter().all(|c| valid_name(c)) {
        bail!("need at least one valid container name in {s:?}");
    }
    Ok(PodSpec {
        namespace: namespace.into(),
        name: name.into(),
        uid,
        containers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_specs() {
        let p = parse_pod_spec("default/p1=c1,c2").unwrap();
        assert_eq!(p.containers, vec!["c1", "c2"]);
        assert_eq!(p.uid, "default-p1-uid");
        assert_eq!(parse_pod_spec("a/b/u1=c").unwrap().uid, "u1");
        assert!(parse_pod_spec("default/p1").is_err());
        assert!(parse_pod_spec("a/b=../x").is_err());
        assert!(parse_pod_spec("a/b/c/d=c").is_err());
    }
}
