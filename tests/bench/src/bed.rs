//! A test bed: one emulated link and every peer on it.
//!
//! The kubelet stand-in, `tether-edge`, the `ssh -R` client and the rathole client run
//! in the link's edge namespace; `tether-cloud`, `sshd`, the rathole server and the
//! client playing the apiserver in its cloud namespace. Every peer therefore crosses the
//! same emulated link, TCP and UDP alike. Dropping the bed kills the processes and
//! deletes the namespaces (the link's router also does that if this process dies).

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use linkemu::{Impairment, Link, LinkOptions};
use tether_tests::netns::{API, TUNNEL_PORT};
use tether_tests::pki::{self, Pki};
use tether_tests::process::{Proc, SpawnOptions};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::kubelet::Kubelet;

/// A byte stream to a peer's kubelet endpoint.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A connection.
pub type Conn = Box<dyn Io>;
/// Opens a connection through a peer.
pub type Dial = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Conn>> + Send>> + Send + Sync>;

/// Tether's name in the tables.
pub const TETHER: &str = "tether";

/// One way (or none) from the client to the kubelet stand-in.
#[derive(Clone)]
pub struct Peer {
    pub name: &'static str,
    /// `None`: not available on this machine, with the reason.
    pub dial: std::result::Result<Dial, String>,
}

/// Where `ssh -R` and rathole expose the kubelet inside the cloud namespace.
const SSH_PORT: u16 = 18080;
const RATHOLE_PORT: u16 = 18081;

/// Everything of one link.
pub struct Bed {
    pub link: Arc<Link>,
    pub dir: tempfile::TempDir,
    pub kubelet: Kubelet,
    pub cloud: Proc,
    pub edge: Proc,
    /// sshd, ssh -R, rathole server and client (by [`Proc::name`]).
    pub others: Vec<Proc>,
    pub peers: Vec<Peer>,
    /// With [`BedOptions::path_mtu`]: what it drops.
    pub black_hole: Option<tether_tests::netns::BlackHole>,
}

/// What a bed runs.
#[derive(Clone, Default)]
pub struct BedOptions {
    /// Extra `tether-edge` flags.
    pub edge_args: Vec<String>,
    /// Extra `tether-cloud` flags.
    pub cloud_args: Vec<String>,
    /// Start only Tether (and direct), not ssh -R and rathole (the soak).
    pub tether_only: bool,
    /// Put the edge behind a NAT whose idle bindings (UDP and TCP) expire
    /// after this long, and configure ssh's ServerAliveInterval and rathole's
    /// heartbeat and TCP keep-alive to hold it (each 5 s below it);
    /// tether-edge learns it by itself (its adaptive keep-alive, default
    /// bounds) unless `edge_args` say otherwise (the cellular-data scenario).
    pub nat_binding: Option<Duration>,
    /// A smaller MTU inside the network that sends no ICMP (a black hole, as
    /// on some carriers' tunnels): IP packets over this many bytes crossing
    /// the edge's link are dropped; TCP's MSS is clamped to fit, as carriers
    /// do ([`tether_tests::netns::BlackHole`]).
    pub path_mtu: Option<u32>,
}

/// A TCP connection made inside the cloud namespace.
fn ns_tcp(link: &Arc<Link>, addr: SocketAddr) -> Dial {
    let link = link.clone();
    Arc::new(move || {
        let link = link.clone();
        Box::pin(async move {
            let std = tokio::task::spawn_blocking(move || {
                link.in_cloud(move || {
                    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                })
            })
            .await??
            .with_context(|| format!("connecting to {addr}"))?;
            std.set_nodelay(true)?;
            std.set_nonblocking(true)?;
            Ok(Box::new(tokio::net::TcpStream::from_std(std)?) as Conn)
        })
    })
}

fn tls_config(pki: &Pki) -> Result<rustls::ClientConfig> {
    // The apiserver's side: Go's crypto/tls prefers AES-128-GCM on AES
    // hardware, as Tether's provider does.
    let provider = tether_proto::tls::provider();
    let mut roots = rustls::RootCertStore::empty();
    for c in tether_certs::pem::certs_from_pem(&pki.tether_ca_pem, "ca")? {
        roots.add(c)?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(
            tether_certs::pem::certs_from_pem(&pki.apiserver_client.cert_pem, "client")?,
            tether_certs::pem::key_from_pem(&pki.apiserver_client.key_pem, "client")?,
        )?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The kubelet stand-in's TLS: its serving certificate, the apiserver's client
/// certificate required (as a kubelet with `--client-ca-file`).
fn kubelet_tls(pki: &Pki) -> Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let pair = pki.kubelets.get("edge-1").context("kubelet certificate")?;
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read_to_string(&pki.apiserver_client_ca)?;
    for c in tether_certs::pem::certs_from_pem(&ca, "client ca")? {
        roots.add(c)?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            tether_certs::pem::certs_from_pem(&std::fs::read_to_string(&pair.cert)?, "kubelet")?,
            tether_certs::pem::key_from_pem(&std::fs::read_to_string(&pair.key)?, "kubelet")?,
        )?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// `dial`, then TLS to the kubelet (named `edge-1`) with the apiserver's client
/// certificate: what the apiserver does through an `ssh -R` or rathole tunnel.
fn kubelet_over(dial: Dial, pki: &Pki) -> Result<Dial> {
    let tls = tokio_rustls::TlsConnector::from(Arc::new(tls_config(pki)?));
    Ok(Arc::new(move || {
        let (dial, tls) = (dial.clone(), tls.clone());
        Box::pin(async move {
            let io = dial().await?;
            let name = rustls::pki_types::ServerName::try_from("edge-1")?;
            Ok(Box::new(tls.connect(name, io).await?) as Conn)
        })
    }))
}

/// HTTPS with the apiserver's client certificate to the cloud's kubelet API.
fn tether_dial(link: &Arc<Link>, pki: &Pki) -> Result<Dial> {
    let tcp = ns_tcp(link, API.parse()?);
    let tls = tokio_rustls::TlsConnector::from(Arc::new(tls_config(pki)?));
    Ok(Arc::new(move || {
        let (tcp, tls) = (tcp.clone(), tls.clone());
        Box::pin(async move {
            let io = tcp().await?;
            let name = rustls::pki_types::ServerName::IpAddress(
                std::net::IpAddr::from([127, 0, 0, 1]).into(),
            );
            Ok(Box::new(tls.connect(name, io).await?) as Conn)
        })
    }))
}

/// The rathole binary: `$RATHOLE`, `<workspace>/target/bench-tools/bin`, or `$PATH`.
/// The keep-alive interval that holds a NAT binding of `binding`: 5 s below it.
pub fn keepalive_for(binding: Duration) -> Duration {
    binding
        .saturating_sub(Duration::from_secs(5))
        .max(Duration::from_secs(1))
}

/// The `tether-edge` binary the beds run: `$TETHER_EDGE_BIN` (scripts/bench.sh
/// sets it to the `edge` profile build, the binary as shipped), else the one next
/// to the other workspace binaries.
pub fn edge_bin() -> Result<PathBuf> {
    match std::env::var_os("TETHER_EDGE_BIN") {
        Some(p) => {
            let p = PathBuf::from(p);
            if !p.is_file() {
                bail!("TETHER_EDGE_BIN={} is not a file", p.display());
            }
            Ok(p)
        }
        None => tether_tests::bins::binary("tether-edge"),
    }
}

pub fn rathole_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RATHOLE") {
        return Some(PathBuf::from(p));
    }
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-tools/bin/rathole");
    if local.is_file() {
        return Some(local);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("rathole"))
        .find(|p| p.is_file())
}

fn sshd_bin() -> Option<&'static str> {
    ["/usr/sbin/sshd", "/usr/bin/sshd"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

fn run_ok(cmd: &mut std::process::Command, what: &str) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Waits until `dial` connects and answers `GET /healthz` (bounded).
async fn wait_up(name: &str, dial: &Dial, limit: Duration, log: &Path) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let last = match tokio::time::timeout(
            Duration::from_secs(5),
            crate::measure::get(dial, "/healthz"),
        )
        .await
        {
            Ok(Ok(200)) => return Ok(()),
            Ok(Ok(s)) => format!("status {s}"),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => "timed out".to_string(),
        };
        if Instant::now() > deadline {
            bail!(
                "{name} never came up within {limit:?} (last: {last}); log tail:\n{}",
                tether_tests::process::tail_of_file(log, 20)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The kubelet as a tunnel exposes it on `port` in the cloud namespace, once it
/// answers (TLS through the tunnel, as the apiserver would).
async fn exposed(link: &Arc<Link>, port: u16, pki: &Pki, name: &str, log: &Path) -> Result<Dial> {
    let dial = kubelet_over(ns_tcp(link, SocketAddr::from(([127, 0, 0, 1], port))), pki)?;
    wait_up(name, &dial, Duration::from_secs(20), log).await?;
    Ok(dial)
}

impl Bed {
    /// Creates the link and starts every peer on it; returns when all answer.
    pub async fn start(imp: Impairment, opts: BedOptions) -> Result<Bed> {
        let mut link_opts = LinkOptions::new().with_impairment(imp);
        if let Some(b) = opts.nat_binding {
            link_opts = link_opts.with_nat_binding(b);
        }
        let link = Arc::new(Link::create(link_opts)?);
        let black_hole = opts
            .path_mtu
            .map(|mtu| tether_tests::netns::BlackHole::install(&link, mtu))
            .transpose()?;
        let dir = tempfile::tempdir()?;
        let d = dir.path().to_path_buf();
        let pki = pki::mint(&d, &["edge-1"])?;
        let listener = link.in_edge(|| std::net::TcpListener::bind("0.0.0.0:0"))??;
        let kubelet = Kubelet::start(listener, Some(kubelet_tls(&pki)?))?;
        let kport = kubelet.port;
        let cloud_ip = link.cloud_ip();

        // Tether.
        let cmd = tether_tests::netns::cloud_cmd(&link, &pki, &opts.cloud_args, "info")?;
        let mut cloud = Proc::spawn("tether-cloud", cmd, &d, SpawnOptions::default())?;
        cloud
            .wait_line("tether-cloud ready", Duration::from_secs(20), |l| {
                l.starts_with("tether-cloud ready")
            })
            .await?;
        let mut cmd = link.exec_in_edge(edge_bin()?);
        cmd.arg("--cloud")
            .arg(format!("{cloud_ip}:{TUNNEL_PORT}"))
            .args(pki.edge_flags("edge-1").context("edge-1 certificate")?)
            .args(["--kubelet-url", &format!("https://127.0.0.1:{kport}")])
            .arg("--kubelet-ca")
            .arg(&pki.tether_ca)
            .arg("--kubelet-client-cert")
            .arg(&pki.apiserver_client.cert)
            .arg("--kubelet-client-key")
            .arg(&pki.apiserver_client.key)
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(["--announce-address", "edge-1.invalid"])
            .args(&opts.edge_args)
            .env("TETHER_LOG", "info")
            .env("RUST_BACKTRACE", "0");
        let mut edge = Proc::spawn(
            "tether-edge",
            tokio::process::Command::from(cmd),
            &d,
            SpawnOptions::default(),
        )?;
        edge.wait_connected("the edge's connected line", Duration::from_secs(30))
            .await?;
        let tether = tether_dial(&link, &pki)?;
        // Routable once the edge's pod report arrived.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = tokio::time::timeout(
                Duration::from_secs(5),
                crate::measure::get(&tether, "/containerLogs/default/bulk/c?limitBytes=1"),
            )
            .await;
            if matches!(s, Ok(Ok(200))) {
                break;
            }
            if Instant::now() > deadline {
                bail!("tether never routed the pod: {s:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        let mut others = Vec::new();
        let mut peers = vec![Peer {
            name: "direct",
            dial: Ok(kubelet_over(
                ns_tcp(&link, SocketAddr::from((link.edge_ip(), kport))),
                &pki,
            )?),
        }];
        if !opts.tether_only {
            peers.push(Peer {
                name: "ssh -R",
                dial: match Self::start_ssh(&link, &d, kport, &pki, &mut others, opts.nat_binding)
                    .await
                {
                    Ok(dial) => Ok(dial),
                    Err(e) => Err(format!("{e:#}")),
                },
            });
            peers.push(Peer {
                name: "rathole",
                dial: match Self::start_rathole(
                    &link,
                    &d,
                    kport,
                    &pki,
                    &mut others,
                    opts.nat_binding,
                )
                .await
                {
                    Ok(dial) => Ok(dial),
                    Err(e) => Err(format!("{e:#}")),
                },
            });
        }
        peers.push(Peer {
            name: TETHER,
            dial: Ok(tether),
        });
        Ok(Bed {
            link,
            dir,
            kubelet,
            cloud,
            edge,
            others,
            peers,
            black_hole,
        })
    }

    /// sshd in the cloud namespace, `ssh -N -R` from the edge namespace: every
    /// session to the forwarded port rides the one TCP connection of the ssh client.
    async fn start_ssh(
        link: &Arc<Link>,
        d: &Path,
        kport: u16,
        pki: &Pki,
        procs: &mut Vec<Proc>,
        nat_binding: Option<Duration>,
    ) -> Result<Dial> {
        let sshd =
            sshd_bin().context("sshd not installed (scripts/bench.sh installs openssh-server)")?;
        std::fs::create_dir_all("/run/sshd")?;
        for k in ["ssh_host_key", "ssh_client_key"] {
            run_ok(
                std::process::Command::new("ssh-keygen")
                    .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                    .arg(d.join(k)),
                "ssh-keygen",
            )?;
        }
        std::fs::copy(d.join("ssh_client_key.pub"), d.join("authorized_keys"))?;
        let cloud_ip = link.cloud_ip();
        std::fs::write(
            d.join("sshd_config"),
            format!(
                "Port 2222\nListenAddress {cloud_ip}\nHostKey {}\nAuthorizedKeysFile {}\n\
                 PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n\
                 AllowTcpForwarding yes\nPidFile {}\nLogLevel ERROR\n",
                d.join("ssh_host_key").display(),
                d.join("authorized_keys").display(),
                d.join("sshd.pid").display()
            ),
        )?;
        let mut cmd = link.exec_in_cloud(sshd);
        cmd.args(["-D", "-e", "-f"]).arg(d.join("sshd_config"));
        procs.push(Proc::spawn(
            "sshd",
            tokio::process::Command::from(cmd),
            d,
            SpawnOptions::default(),
        )?);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut cmd = link.exec_in_edge("ssh");
        cmd.args([
            "-N",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
        ])
        .args(["-o", "ExitOnForwardFailure=yes", "-o", "BatchMode=yes"])
        // The usual keep-alive of a reverse tunnel: dead after 3 × 5 s
        // unanswered (or just often enough for the NAT binding).
        .args([
            "-o".to_string(),
            format!(
                "ServerAliveInterval={}",
                nat_binding.map_or(5, |b| keepalive_for(b).as_secs())
            ),
            "-o".to_string(),
            "ServerAliveCountMax=3".to_string(),
        ])
        .args(["-p", "2222", "-i"])
        .arg(d.join("ssh_client_key"))
        .arg("-R")
        .arg(format!("127.0.0.1:{SSH_PORT}:127.0.0.1:{kport}"))
        .arg(format!("root@{cloud_ip}"));
        procs.push(Proc::spawn(
            "ssh-R",
            tokio::process::Command::from(cmd),
            d,
            SpawnOptions::default(),
        )?);
        exposed(link, SSH_PORT, pki, "ssh -R", &d.join("ssh-R.log")).await
    }

    /// rathole server in the cloud namespace, client in the edge namespace (TCP
    /// transport: a control connection plus a data connection per session).
    async fn start_rathole(
        link: &Arc<Link>,
        d: &Path,
        kport: u16,
        pki: &Pki,
        procs: &mut Vec<Proc>,
        nat_binding: Option<Duration>,
    ) -> Result<Dial> {
        let bin = rathole_bin().context(
            "rathole not installed (scripts/bench.sh installs it into target/bench-tools; RATHOLE=path overrides)",
        )?;
        let cloud_ip = link.cloud_ip();
        // rathole's heartbeat (server → client) and the TCP keep-alive of its
        // connections, tuned to the NAT binding when one is given.
        let (server_extra, client_extra) = match nat_binding {
            Some(b) => {
                let k = keepalive_for(b).as_secs();
                (
                    format!("heartbeat_interval = {k}\n"),
                    format!(
                        "heartbeat_timeout = {}\n\n[client.transport]\ntype = \"tcp\"\n\n[client.transport.tcp]\nkeepalive_secs = {k}\n",
                        3 * k
                    ),
                )
            }
            None => (String::new(), String::new()),
        };
        std::fs::write(
            d.join("rathole-server.toml"),
            format!(
                "[server]\nbind_addr = \"{cloud_ip}:2333\"\ndefault_token = \"tether-bench\"\n{server_extra}\n\
                 [server.services.kubelet]\nbind_addr = \"127.0.0.1:{RATHOLE_PORT}\"\n"
            ),
        )?;
        std::fs::write(
            d.join("rathole-client.toml"),
            format!(
                "[client]\nremote_addr = \"{cloud_ip}:2333\"\ndefault_token = \"tether-bench\"\n{client_extra}\n\
                 [client.services.kubelet]\nlocal_addr = \"127.0.0.1:{kport}\"\n"
            ),
        )?;
        // The server in the cloud namespace, then the client in the edge's.
        for (mut cmd, mode) in [
            (link.exec_in_cloud(&bin), "server"),
            (link.exec_in_edge(&bin), "client"),
        ] {
            cmd.arg(format!("--{mode}"))
                .arg(d.join(format!("rathole-{mode}.toml")))
                .env("RUST_LOG", "warn");
            procs.push(Proc::spawn(
                &format!("rathole-{mode}"),
                tokio::process::Command::from(cmd),
                d,
                SpawnOptions::default(),
            )?);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        exposed(
            link,
            RATHOLE_PORT,
            pki,
            "rathole",
            &d.join("rathole-client.log"),
        )
        .await
    }
}
