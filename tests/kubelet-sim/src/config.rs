//! Command-line configuration of the simulator (clap derive) and parsing of
//! the `--pod ns/name[/uid]=c1,c2` specifications.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;

/// A faithful kubelet HTTP API simulator for Tether's tests.
#[derive(Debug, Clone, Parser)]
#[command(name = "kubelet-sim", version, about)]
pub struct Cli {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:10350")]
    pub listen: SocketAddr,
    /// Serve HTTPS with this PEM certificate chain (requires --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this PEM CA bundle (TLS only).
    #[arg(long, requires = "tls_cert")]
    pub client_ca: Option<PathBuf>,
    /// Node name; sent in `X-Kubelet-Sim-Node` on every response.
    #[arg(long, default_value = "edge-1")]
    pub node_name: String,
    /// A fake pod: `ns/name[/uid]=container1,container2` (repeatable).
    #[arg(long = "pod", value_parser = parse_pod_spec)]
    pub pods: Vec<PodSpec>,
    /// Directory of container logs `<ns>_<pod>_<container>.log` (and
    /// `.previous.log`); also served under /logs/.
    #[arg(long, default_value = "/tmp/kubelet-sim-logs")]
    pub log_dir: PathBuf,
    /// Working directory of exec'd and attached processes (default: a
    /// per-container directory under `<log-dir>/.work/`).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

/// One configured fake pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub containers: Vec<String>,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
}

/// Parse `ns/name[/uid]=c1,c2`.
pub fn parse_pod_spec(s: &str) -> Result<PodSpec> {
    let (path, containers) = s
        .split_once('=')
        .context("expected ns/name[/uid]=container1,container2")?;
    let parts: Vec<&str> = path.split('/').collect();
    let (namespace, name, uid) = match parts.as_slice() {
        [ns, name] => (*ns, *name, None),
        [ns, name, uid] => (*ns, *name, Some(*uid)),
        _ => bail!("expected ns/name[/uid] before '=', got {path:?}"),
    };
    if !valid_name(namespace) || !valid_name(name) {
        bail!("invalid namespace or pod name in {path:?}");
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
    let uid = match uid {
        Some(u) if valid_name(u) => u.to_string(),
        Some(u) => bail!("invalid uid {u:?}"),
        None => made_up_uid(namespace, name),
    };
    Ok(PodSpec {
        namespace: namespace.to_string(),
        name: name.to_string(),
        uid,
        containers,
    })
}

/// A deterministic UUID-shaped uid derived from `ns/name` (FNV-1a based).
pub fn made_up_uid(namespace: &str, name: &str) -> String {
    let mut h1: u64 = 0xcbf2_9ce4_8422_2325;
    let mut h2: u64 = 0x8422_2325_cbf2_9ce4;
    for b in namespace.bytes().chain([b'/']).chain(name.bytes()) {
        h1 = (h1 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        h2 = (h2 ^ u64::from(b))
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(7);
    }
    let hex = format!("{h1:016x}{h2:016x}");
    format!(
        "{}-{}-4{}-8{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        &hex[17..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_specs() {
        let p = parse_pod_spec("default/p1=c1,c2").expect("parse");
        assert_eq!(p.namespace, "default");
        assert_eq!(p.name, "p1");
        assert_eq!(p.containers, vec!["c1", "c2"]);
        assert_eq!(p.uid, made_up_uid("default", "p1"));
        assert_eq!(p.uid.len(), 36);
        let p = parse_pod_spec("kube-system/x/abc-123=c").expect("parse");
        assert_eq!(p.uid, "abc-123");
        assert!(parse_pod_spec("default/p1").is_err());
        assert!(parse_pod_spec("p1=c").is_err());
        assert!(parse_pod_spec("a/b/c/d=c").is_err());
        assert!(parse_pod_spec("a/b=").is_err());
        assert!(parse_pod_spec("a/b=../x").is_err());
    }
}
