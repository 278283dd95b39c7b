//! The certificates of one test cluster, minted with `tether-certs` and written as PEM
//! files into the cluster's run directory (keys with mode 0600).
//!
//! Two authorities, as in a real deployment:
//! - the **Tether CA** signs the cloud's tunnel certificate (the edges pin this CA), the
//!   cloud's kubelet-API serving certificate, every edge's node certificate, and — in
//!   direct mode only — the kubelet simulators' serving certificates;
//! - the **apiserver client CA** signs the apiserver's kubelet-client certificate; the
//!   cloud (`--apiserver-client-ca`) and, in direct mode, the kubelet simulators
//!   (`--client-ca`) trust only it.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use tether_certs::{Ca, CertKey};

/// Validity of every test certificate.
const VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// The DNS name in the cloud's tunnel certificate (edges pass it as `--server-name`).
pub const CLOUD_SERVER_NAME: &str = "tether-cloud";

/// A certificate and key written to disk.
#[derive(Debug, Clone)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Every certificate of a cluster.
#[derive(Debug, Clone)]
pub struct Pki {
    /// The Tether CA certificate (file).
    pub tether_ca: PathBuf,
    pub tether_ca_pem: String,
    /// The apiserver client CA certificate (file).
    pub apiserver_client_ca: PathBuf,
    /// The cloud's QUIC tunnel certificate.
    pub cloud_tunnel: Pair,
    /// The cloud's kubelet-API serving certificate (SANs: every node name, localhost,
    /// 127.0.0.1, ::1).
    pub cloud_kubelet: Pair,
    /// The apiserver's kubelet-client certificate.
    pub apiserver_client: Pair,
    /// Per node: its edge certificate.
    pub edges: BTreeMap<String, Pair>,
    /// Per node: a kubelet serving certificate (direct mode).
    pub kubelets: BTreeMap<String, Pair>,
}

fn write_file(path: &Path, text: &str, mode: u32) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn write_pair(dir: &Path, name: &str, ck: CertKey) -> Result<Pair> {
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    write_file(&cert, &ck.cert_pem, 0o644)?;
    write_file(&key, &ck.key_pem, 0o600)?;
    Ok(Pair {
        cert,
        key,
        cert_pem: ck.cert_pem,
        key_pem: ck.key_pem,
    })
}

/// Where [`mint`] keeps the apiserver client CA's key (for [`issue_client`]).
const CLIENT_CA_KEY: &str = "apiserver-client-ca.key";

/// A CA [`mint`] wrote into `dir`, from its certificate and key files.
fn ca_from_files(dir: &Path, cert: &str, key: &str) -> Result<Ca> {
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    Ok(Ca::from_pem(
        &read(&dir.join(cert))?,
        &read(&dir.join(key))?,
    )?)
}

/// Issues another client certificate from the apiserver client CA of a set
/// [`mint`]ed into `dir` — on kubeadm that CA signs every user's and node's
/// certificate too, so tests use this for callers that are not the apiserver.
/// Written as `dir/<file_name>.crt` and `.key`.
pub fn issue_client(dir: &Path, file_name: &str, common_name: &str, orgs: &[&str]) -> Result<Pair> {
    let ca = ca_from_files(dir, "apiserver-client-ca.crt", CLIENT_CA_KEY)
        .context("loading the apiserver client CA")?;
    let ck = ca
        .issue_client(common_name, orgs, VALIDITY)
        .with_context(|| format!("minting a client certificate for {common_name}"))?;
    write_pair(dir, file_name, ck)
}

/// Where [`mint`] keeps the Tether CA's key (for [`issue_edge`]).
const TETHER_CA_KEY: &str = "tether-ca.key";

/// Issues another edge certificate for `node`, valid for `valid_for`, from
/// the Tether CA of a set [`mint`]ed into `dir`; written as
/// `dir/<file_name>.crt` and `.key`.
pub fn issue_edge(
    dir: &Path,
    file_name: &str,
    node: &str,
    valid_for: std::time::Duration,
) -> Result<Pair> {
    let ca = ca_from_files(dir, "tether-ca.crt", TETHER_CA_KEY).context("loading the Tether CA")?;
    let ck = ca
        .issue_edge(node, valid_for)
        .with_context(|| format!("minting an edge certificate for {node}"))?;
    write_pair(dir, file_name, ck)
}

impl Pki {
    /// This set with `client` as the apiserver's client certificate (a
    /// [`crate`] client built from it presents `client` instead).
    pub fn with_apiserver_client(&self, client: Pair) -> Pki {
        Pki {
            apiserver_client: client,
            ..self.clone()
        }
    }

    /// The certificate flags of `tether-cloud` for this set, with the opt-in to route by
    /// edge reports (`--insecure-trust-edge-reports`), for clouds that have no apiserver
    /// to watch.
    pub fn cloud_flags(&self) -> Vec<std::ffi::OsString> {
        let mut v = self.cloud_cert_flags();
        v.push("--insecure-trust-edge-reports".into());
        v
    }

    /// The certificate flags of `tether-cloud` for this set alone: a cloud started with
    /// them needs `--apiserver-kubeconfig` to route.
    pub fn cloud_cert_flags(&self) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = Vec::new();
        for (flag, path) in [
            ("--tunnel-cert", &self.cloud_tunnel.cert),
            ("--tunnel-key", &self.cloud_tunnel.key),
            ("--edge-ca", &self.tether_ca),
            ("--kubelet-cert", &self.cloud_kubelet.cert),
            ("--kubelet-key", &self.cloud_kubelet.key),
            ("--apiserver-client-ca", &self.apiserver_client_ca),
        ] {
            v.push(flag.into());
            v.push(path.into());
        }
        v
    }

    /// The certificate flags of `tether-edge` for `node` of this set: the cloud's server
    /// name and CA, the node's certificate and key. `None` for a node not minted.
    pub fn edge_flags(&self, node: &str) -> Option<Vec<std::ffi::OsString>> {
        let pair = self.edges.get(node)?;
        let mut v: Vec<std::ffi::OsString> = vec!["--server-name".into(), CLOUD_SERVER_NAME.into()];
        for (flag, path) in [
            ("--ca", &self.tether_ca),
            ("--cert", &pair.cert),
            ("--key", &pair.key),
        ] {
            v.push(flag.into());
            v.push(path.into());
        }
        Some(v)
    }
}

/// Mints the certificates for `nodes` into `dir` (created if needed).
pub fn mint(dir: &Path, nodes: &[&str]) -> Result<Pki> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let loopback = [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ];
    let ca = Ca::new("tether-test-ca", VALIDITY).context("minting the Tether CA")?;
    let client_ca =
        Ca::new("apiserver-client-ca", VALIDITY).context("minting the apiserver client CA")?;

    let tether_ca = dir.join("tether-ca.crt");
    write_file(&tether_ca, &ca.cert_pem, 0o644)?;
    let apiserver_client_ca = dir.join("apiserver-client-ca.crt");
    write_file(&apiserver_client_ca, &client_ca.cert_pem, 0o644)?;
    write_file(&dir.join(CLIENT_CA_KEY), &client_ca.key_pem(), 0o600)?;
    write_file(&dir.join(TETHER_CA_KEY), &ca.key_pem(), 0o600)?;

    let cloud_tunnel = write_pair(
        dir,
        "cloud-tunnel",
        ca.issue_server(&[CLOUD_SERVER_NAME, "localhost"], &loopback, VALIDITY)
            .context("minting the cloud tunnel certificate")?,
    )?;
    let mut kubelet_names: Vec<&str> = nodes.to_vec();
    kubelet_names.push("localhost");
    let cloud_kubelet = write_pair(
        dir,
        "cloud-kubelet",
        ca.issue_server(&kubelet_names, &loopback, VALIDITY)
            .context("minting the cloud kubelet-API certificate")?,
    )?;
    let apiserver_client = write_pair(
        dir,
        "apiserver-kubelet-client",
        client_ca
            .issue_client(
                "kube-apiserver-kubelet-client",
                &["system:masters"],
                VALIDITY,
            )
            .context("minting the apiserver kubelet-client certificate")?,
    )?;
    let mut edges = BTreeMap::new();
    let mut kubelets = BTreeMap::new();
    for node in nodes {
        let edge = ca
            .issue_edge(node, VALIDITY)
            .with_context(|| format!("minting the edge certificate of {node}"))?;
        edges.insert(
            node.to_string(),
            write_pair(dir, &format!("edge-{node}"), edge)?,
        );
        let kubelet = ca
            .issue_server(&[node, "localhost"], &loopback, VALIDITY)
            .with_context(|| format!("minting the kubelet certificate of {node}"))?;
        kubelets.insert(
            node.to_string(),
            write_pair(dir, &format!("kubelet-{node}"), kubelet)?,
        );
    }
    Ok(Pki {
        tether_ca,
        tether_ca_pem: ca.cert_pem.clone(),
        apiserver_client_ca,
        cloud_tunnel,
        cloud_kubelet,
        apiserver_client,
        edges,
        kubelets,
    })
}

/// The peer certificates of a set of cloud replicas (see `tether-cloud
/// --peer-*`), from a peer CA of their own, and two that must be refused.
#[derive(Debug, Clone)]
pub struct PeerPki {
    /// The peer CA certificate (file).
    pub ca: PathBuf,
    /// The peer certificate all replicas share.
    pub peer: Pair,
    /// An edge certificate signed by the peer CA: the right CA, not a peer.
    pub edge_signed_by_peer_ca: Pair,
    /// A well-formed peer certificate from a CA the replicas do not trust.
    pub foreign_peer: Pair,
}

impl PeerPki {
    /// The peer flags of `tether-cloud` with the shared peer certificate.
    pub fn flags(&self) -> Vec<std::ffi::OsString> {
        self.flags_with(&self.peer)
    }

    /// The peer flags with `pair` as this replica's certificate.
    pub fn flags_with(&self, pair: &Pair) -> Vec<std::ffi::OsString> {
        vec![
            "--peer-cert".into(),
            pair.cert.clone().into(),
            "--peer-key".into(),
            pair.key.clone().into(),
            "--peer-ca".into(),
            self.ca.clone().into(),
        ]
    }
}

/// Mints a [`PeerPki`] into `dir` (created if needed).
pub fn mint_peers(dir: &Path) -> Result<PeerPki> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let ca = Ca::new("tether-peer-test-ca", VALIDITY).context("minting the peer CA")?;
    let other = Ca::new("some-other-ca", VALIDITY).context("minting another CA")?;
    let ca_path = dir.join("peer-ca.crt");
    write_file(&ca_path, &ca.cert_pem, 0o644)?;
    Ok(PeerPki {
        ca: ca_path,
        peer: write_pair(dir, "peer", ca.issue_peer(VALIDITY)?)?,
        edge_signed_by_peer_ca: write_pair(
            dir,
            "peer-ca-edge",
            ca.issue_edge("edge-1", VALIDITY)?,
        )?,
        foreign_peer: write_pair(dir, "foreign-peer", other.issue_peer(VALIDITY)?)?,
    })
}

/// Mints the same set with the `tether-certs` command-line tool, as an
/// operator would (the demo does this): a Tether CA under `dir/tether`, an
/// apiserver client CA under `dir/apiserver`.
pub fn mint_with_cli(dir: &Path, nodes: &[&str]) -> Result<Pki> {
    let bin = crate::bins::binary("tether-certs")?;
    let tether = dir.join("tether");
    let client = dir.join("apiserver");
    let run = |pki_dir: &Path, args: &[&str]| -> Result<()> {
        let out = std::process::Command::new(&bin)
            .arg("--dir")
            .arg(pki_dir)
            .args(args)
            .output()
            .with_context(|| format!("running tether-certs {args:?}"))?;
        if !out.status.success() {
            anyhow::bail!(
                "tether-certs {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    };
    run(
        &tether,
        &["ca", "create", "--cn", "tether-demo-ca", "--validity", "1d"],
    )?;
    run(
        &client,
        &[
            "ca",
            "create",
            "--cn",
            "apiserver-client-ca",
            "--validity",
            "1d",
        ],
    )?;
    let loopback = ["--ip", "127.0.0.1", "--ip", "::1", "--dns", "localhost"];
    let mut args = vec![
        "issue",
        "cloud-tunnel",
        "--dns",
        CLOUD_SERVER_NAME,
        "--validity",
        "1d",
    ];
    args.extend(loopback);
    run(&tether, &args)?;
    let mut args = vec!["issue", "cloud-kubelet", "--validity", "1d"];
    for n in nodes {
        args.extend(["--dns", n]);
    }
    args.extend(loopback);
    run(&tether, &args)?;
    run(&client, &["issue", "apiserver-client", "--validity", "1d"])?;
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let pair = |cert: PathBuf, key: PathBuf| -> Result<Pair> {
        Ok(Pair {
            cert_pem: read(&cert)?,
            key_pem: read(&key)?,
            cert,
            key,
        })
    };
    let mut edges = BTreeMap::new();
    let mut kubelets = BTreeMap::new();
    for n in nodes {
        run(&tether, &["issue", "edge", "--node", n, "--validity", "1d"])?;
        edges.insert(
            n.to_string(),
            pair(
                tether.join(format!("{n}.crt")),
                tether.join(format!("{n}.key")),
            )?,
        );
        let (cert, key) = (
            tether.join(format!("kubelet-{n}.crt")),
            tether.join(format!("kubelet-{n}.key")),
        );
        let (c, k) = (
            cert.to_string_lossy().into_owned(),
            key.to_string_lossy().into_owned(),
        );
        let mut args = vec![
            "issue",
            "cloud-kubelet",
            "--dns",
            n,
            "--cert",
            &c,
            "--key",
            &k,
            "--validity",
            "1d",
        ];
        args.extend(loopback);
        run(&tether, &args)?;
        kubelets.insert(n.to_string(), pair(cert, key)?);
    }
    Ok(Pki {
        tether_ca: tether.join("ca.crt"),
        tether_ca_pem: read(&tether.join("ca.crt"))?,
        apiserver_client_ca: client.join("ca.crt"),
        cloud_tunnel: pair(tether.join("tunnel.crt"), tether.join("tunnel.key"))?,
        cloud_kubelet: pair(tether.join("kubelet.crt"), tether.join("kubelet.key"))?,
        apiserver_client: pair(
            client.join("apiserver-client.crt"),
            client.join("apiserver-client.key"),
        )?,
        edges,
        kubelets,
    })
}

/// A kubeconfig for `server` (a URL) that authenticates with a bearer token
/// and, for `https`, skips verifying the server (for apiservers that never
/// answer, where only the cloud's bounds are under test).
pub fn token_kubeconfig(server: &str) -> String {
    let skip = if server.starts_with("https://") {
        "\n    insecure-skip-tls-verify: true"
    } else {
        ""
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}{skip}\n\
         users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    \
         cluster: c\n    user: u\ncurrent-context: x\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn mints_every_file_with_private_keys() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = mint(dir.path(), &["edge-1", "edge-2"]).expect("mint");
        assert_eq!(
            pki.edges.keys().collect::<Vec<_>>(),
            vec!["edge-1", "edge-2"]
        );
        for pair in [&pki.cloud_tunnel, &pki.cloud_kubelet, &pki.edges["edge-2"]] {
            assert!(pair.cert.is_file());
            let mode = std::fs::metadata(&pair.key)
                .expect("key")
                .permissions()
                .mode();
            assert_eq!(
                mode & 0o077,
                0,
                "{} is readable by others",
                pair.key.display()
            );
        }
        let der = tether_certs::pem::certs_from_pem(&pki.edges["edge-1"].cert_pem, "edge")
            .expect("parse");
        assert_eq!(
            tether_certs::node_name_from_cert(&der[0]).expect("node"),
            "edge-1"
        );
    }
}
