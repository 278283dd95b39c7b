//! A whole test cluster on loopback, every part a real process:
//!
//! - one `kubelet-sim` per node, running that node's fake pods, logs in its own directory;
//! - [`Mode::Tunnel`] (the default): `tether-cloud`, and one `tether-edge` per node that
//!   dials it over QUIC and replays streams against its node's kubelet-sim; the
//!   apiserver's kubelet connections all go to the cloud's kubelet API (`--kubelet-dial`,
//!   like the DNAT of a real deployment), and node addresses are the node names, so SNI
//!   and `Host` carry them where kube-apiserver would;
//! - [`Mode::Direct`] (`TETHER_E2E_MODE=direct`): no tunnel; the kubelet simulators serve
//!   HTTPS themselves and the apiserver dials each at its own address. This is the
//!   baseline that tells fixture problems from tunnel problems;
//! - `apiserver-sim`, with the pods and nodes above, writing the kubeconfig kubectl uses.
//!   It starts before the cloud, which watches its pods and nodes with that kubeconfig
//!   (`--apiserver-kubeconfig`) and routes by them, as deployed (never by what an edge
//!   reports); the cloud's kubelet API ports are chosen first, so that apiserver-sim
//!   can be told where to dial them.
//!
//! With [`ClusterSpec::cri_runtime`], each node's kubelet is instead a `cri-kubelet` whose
//! pods are containers of that containerd (several nodes and clusters may share one
//! containerd: their pods' uids carry the cluster's tag, and each stand-in reports only
//! its own pods). Every container of a node sees the node's share directory at `/share`,
//! where a FIFO per container (`/share/NS_POD_CONTAINER`) can feed its main process;
//! [`Cluster::append_log`] writes there and waits until containerd has logged the lines.
//!
//! With [`ClusterSpec::replicas`] above one, the cloud is that many `tether-cloud`
//! replicas linked over the peer listener (a static `--peers` list on loopback); node
//! *i*'s edge dials replica *i* mod N, and apiserver-sim dials the replicas' kubelet
//! APIs in turn, one per connection (`--kubelet-dial A,B,C`, like kube-proxy's DNAT),
//! so every request lands on each replica in turn: served locally or relayed.
//!
//! [`Cluster::start`] returns once every process announced itself and every pod answers
//! through the kubelet API the apiserver dials (from the node that runs it), all
//! bounded in time. Processes die with the [`Cluster`]; [`Cluster::shutdown`] stops them
//! politely in order.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tokio::process::Command;

use crate::bins;
use crate::pki::{self, Pki};
use crate::ports;
use crate::probe::KubeletClient;
use crate::process::{Proc, SpawnOptions};

/// Bound on a process printing its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound on every pod becoming reachable through the kubelet API.
const ROUTABLE_TIMEOUT: Duration = Duration::from_secs(20);
/// Grace between SIGTERM and SIGKILL at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// The kubelet port in node addresses (KubeEdge's edgecore port).
pub const KUBELET_PORT: u16 = 10350;

/// How the apiserver reaches the kubelets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Through tether-cloud and tether-edge.
    Tunnel,
    /// Straight to each kubelet-sim (no Tether).
    Direct,
}

impl Mode {
    /// `TETHER_E2E_MODE` = `tunnel` (default) or `direct`.
    pub fn from_env() -> Result<Mode> {
        match std::env::var("TETHER_E2E_MODE").as_deref() {
            Err(_) | Ok("") | Ok("tunnel") => Ok(Mode::Tunnel),
            Ok("direct") => Ok(Mode::Direct),
            Ok(other) => bail!("TETHER_E2E_MODE={other:?}: expected `tunnel` or `direct`"),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Tunnel => "tunnel (apiserver-sim → tether-cloud → tether-edge → kubelet-sim)",
            Mode::Direct => "direct (apiserver-sim → kubelet-sim, no tunnel)",
        })
    }
}

/// A fake pod.
#[derive(Debug, Clone)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub containers: Vec<String>,
}

impl PodSpec {
    /// A pod `namespace/name` with `containers`.
    pub fn new(namespace: &str, name: &str, containers: &[&str]) -> Self {
        PodSpec {
            namespace: namespace.to_string(),
            name: name.to_string(),
            containers: containers.iter().map(|c| c.to_string()).collect(),
        }
    }
}

/// A node and the pods its kubelet runs.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub name: String,
    pub pods: Vec<PodSpec>,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub mode: Mode,
    pub nodes: Vec<NodeSpec>,
    /// Pods the apiserver believes run on a node (by name) whose kubelet does not run
    /// them: requests for them must fail, never reach another kubelet.
    pub phantom_pods: Vec<(String, PodSpec)>,
    /// Pods a node's kubelet (by name) runs, so that its edge reports them, while the
    /// apiserver places them on another node: the cloud routes them by the apiserver,
    /// to that other node, and refuses (and counts) the edge's claim.
    pub impostor_pods: Vec<(String, PodSpec)>,
    /// Start every process in its own process group (see [`SpawnOptions`]).
    pub own_process_groups: bool,
    /// Mint the certificates with the `tether-certs` tool (as an operator
    /// would) instead of the library.
    pub certs_via_cli: bool,
    /// Run the pods as containers of this containerd (its CRI socket) with the
    /// CRI-backed kubelet stand-in (`cri-kubelet`) instead of kubelet-sim.
    pub cri_runtime: Option<PathBuf>,
    /// The shell script every CRI container runs (`$CONTAINER`, `$POD_NAME`,
    /// `$POD_NAMESPACE`, `$NODE_NAME` are set); `None`: cri-kubelet's default.
    pub cri_script: Option<String>,
    /// How many cloud replicas (tunnel mode; 0 and 1 both mean one, without peers).
    pub replicas: usize,
    /// More flags for every cloud replica (after the harness's own, so they win).
    pub cloud_args: Vec<String>,
    /// More flags for every edge (after the harness's own, so they win).
    pub edge_args: Vec<String>,
}

impl ClusterSpec {
    /// `nodes` behind `replicas` cloud replicas (tunnel mode), kubelet-sim, every
    /// other option off.
    pub fn tunnel(nodes: Vec<NodeSpec>, replicas: usize) -> ClusterSpec {
        ClusterSpec {
            mode: Mode::Tunnel,
            nodes,
            phantom_pods: Vec::new(),
            impostor_pods: Vec::new(),
            own_process_groups: false,
            certs_via_cli: false,
            cri_runtime: None,
            cri_script: None,
            replicas,
            cloud_args: Vec::new(),
            edge_args: Vec::new(),
        }
    }
}

/// A response whose body is still arriving ([`Cluster::kubelet_open_via`]).
pub struct OpenReply {
    /// The status line's code.
    pub status: u16,
    /// Status line, headers and the body bytes read so far (a refusal's whole message).
    pub text: String,
    /// The connection, after what `text` holds.
    pub io: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
}

/// Reads `io` until what it gave contains `marker`; returns all of it. Fails
/// when `io` ends first or more than `max` bytes came without it. Not bounded
/// in time: the caller bounds it.
pub async fn read_until<R: tokio::io::AsyncRead + Unpin>(
    io: &mut R,
    marker: &[u8],
    max: usize,
) -> Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(marker.len()).any(|w| w == marker) {
        let n = io.read(&mut buf).await?;
        if n == 0 || got.len() > max {
            bail!(
                "ended or {} bytes without {:?}: {:?}",
                got.len(),
                String::from_utf8_lossy(marker),
                String::from_utf8_lossy(&got)
            );
        }
        got.extend_from_slice(&buf[..n]);
    }
    Ok(got)
}

/// `TETHER_E2E_REPLICAS` (default 1): how many cloud replicas a suite's cluster runs.
pub fn replicas_from_env() -> Result<usize> {
    match std::env::var("TETHER_E2E_REPLICAS").as_deref() {
        Err(_) | Ok("") => Ok(1),
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (1..=5).contains(&n) => Ok(n),
            _ => bail!("TETHER_E2E_REPLICAS={v:?}: expected 1 to 5"),
        },
    }
}

/// `TETHER_E2E_KUBELET` = `sim` (default: kubelet-sim) or `cri` (cri-kubelet on a
/// private containerd): which kubelet a suite's nodes run.
pub fn cri_from_env() -> Result<bool> {
    match std::env::var("TETHER_E2E_KUBELET").as_deref() {
        Err(_) | Ok("") | Ok("sim") => Ok(false),
        Ok("cri") => Ok(true),
        Ok(other) => bail!("TETHER_E2E_KUBELET={other:?}: expected `sim` or `cri`"),
    }
}

/// How apiserver-sim carries exec/attach requested over WebSocket:
/// `TETHER_E2E_APISERVER_STREAMS` = `translate` (default, kube-apiserver ≥1.30's
/// behaviour: SPDY towards the kubelet) or `passthrough` (the WebSocket upgrade spliced
/// through untouched).
pub fn apiserver_streams_from_env() -> Result<&'static str> {
    match std::env::var("TETHER_E2E_APISERVER_STREAMS").as_deref() {
        Err(_) | Ok("") | Ok("translate") => Ok("translate"),
        Ok("passthrough") => Ok("passthrough"),
        Ok(other) => {
            bail!("TETHER_E2E_APISERVER_STREAMS={other:?}: expected `translate` or `passthrough`")
        }
    }
}

/// A node of a running cluster.
pub struct RunningNode {
    pub name: String,
    pub pods: Vec<PodSpec>,
    /// Where its kubelet-sim listens.
    pub kubelet_addr: SocketAddr,
    /// Its kubelet-sim's container log directory (with cri-kubelet: the root of the
    /// CRI log directories).
    pub log_dir: PathBuf,
    /// With cri-kubelet: the pods' uids and the share directory.
    pub cri: Option<CriNode>,
    kubelet: Proc,
    edge: Option<Proc>,
}

/// What the harness knows of a cri-kubelet node.
#[derive(Debug, Clone)]
pub struct CriNode {
    /// Host directory mounted at `/share` in every container of the node.
    pub share_dir: PathBuf,
    /// The uid each pod was given (`namespace/name` → uid).
    pub uids: std::collections::HashMap<String, String>,
}

impl CriNode {
    /// The FIFO feeding the main process of `ns/pod/container`, on the host.
    pub fn feed(&self, ns: &str, pod: &str, container: &str) -> PathBuf {
        self.share_dir.join(format!("{ns}_{pod}_{container}"))
    }
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{} has a NUL byte", path.display()))?;
    // SAFETY: `c` is a valid NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o666) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mkfifo {}", path.display()));
    }
    Ok(())
}

/// Writes all of `data` to the FIFO at `path` once its reader is there (bounded).
async fn write_fifo(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut f = loop {
        // Non-blocking: fails with ENXIO while nothing reads the FIFO yet.
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
        {
            Ok(f) => break f,
            Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(libc::ENXIO) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        }
    };
    let mut rest = data;
    while !rest.is_empty() {
        match f.write(rest) {
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("writing {}", path.display())),
        }
    }
    Ok(())
}

/// Lines in the file at `path` (0 if missing).
fn count_lines(path: &Path) -> usize {
    std::fs::read(path)
        .map(|b| b.iter().filter(|&&c| c == b'\n').count())
        .unwrap_or(0)
}

/// The tunnel's cloud end.
pub struct RunningCloud {
    pub tunnel_addr: SocketAddr,
    pub kubelet_api_addr: SocketAddr,
    /// Its operations listener (`/metrics`, `/status`).
    pub metrics_addr: SocketAddr,
    proc: Proc,
}

impl RunningCloud {
    /// The replica's process name.
    pub fn name(&self) -> &str {
        self.proc.name()
    }

    /// `GET /metrics` (or another path) of its operations listener.
    pub async fn ops_get(&self, path: &str) -> Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let fetch = async {
            let mut tcp = tokio::net::TcpStream::connect(self.metrics_addr).await?;
            tcp.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
                .await?;
            let mut text = String::new();
            tcp.read_to_string(&mut text).await?;
            Ok::<_, std::io::Error>(text)
        };
        let text = tokio::time::timeout(Duration::from_secs(5), fetch)
            .await
            .with_context(|| format!("GET {path} of {}: no answer in 5 s", self.name()))?
            .with_context(|| format!("GET {path} of {}", self.name()))?;
        Ok(text)
    }
}

/// The value of the first Prometheus sample of `series` (its name and labels) in `text`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.trim().split(' ').next()?.parse().ok())
    })
}

/// A running cluster.
pub struct Cluster {
    pub mode: Mode,
    pub dir: PathBuf,
    pub pki: Pki,
    pub kubeconfig: PathBuf,
    /// `https://127.0.0.1:PORT` of apiserver-sim.
    pub apiserver_url: String,
    pub nodes: Vec<RunningNode>,
    /// The first (or only) cloud replica.
    pub cloud: Option<RunningCloud>,
    /// The other replicas, with [`ClusterSpec::replicas`] above one.
    pub more_clouds: Vec<RunningCloud>,
    /// apiserver-sim's `--stream-translation` (see [`apiserver_streams_from_env`]).
    pub apiserver_streams: &'static str,
    apiserver: Proc,
    client: KubeletClient,
}

fn spawn_options(spec: &ClusterSpec) -> SpawnOptions {
    SpawnOptions {
        stdin: false,
        own_process_group: spec.own_process_groups,
    }
}

/// A command for one of the cluster's processes: plain-text logs (no ANSI colours), at
/// the level `TETHER_E2E_LOG` names (a `RUST_LOG` filter), if set; operations listeners
/// on ephemeral ports.
fn command(program: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("NO_COLOR", "1")
        // tether-cloud and tether-edge serve /metrics on fixed default ports; several
        // clusters on one machine need ephemeral ones. (An environment variable, unlike
        // a flag, is harmless to binaries that do not know it.)
        .env("TETHER_METRICS_LISTEN", "127.0.0.1:0");
    if let Some(filter) = std::env::var_os("TETHER_E2E_LOG") {
        cmd.env("RUST_LOG", filter);
    }
    cmd
}

fn parse_addr(token: &str, what: &str) -> Result<SocketAddr> {
    token
        .parse()
        .with_context(|| format!("{what}: {token:?} is not an IP:PORT"))
}

/// The value of `key=` among the whitespace-separated tokens of `line`.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|t| t.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
}

fn pod_arg(p: &PodSpec) -> String {
    format!("{}/{}={}", p.namespace, p.name, p.containers.join(","))
}

fn api_pod_arg(node: &str, p: &PodSpec) -> String {
    format!(
        "{}/{}={node}:{}",
        p.namespace,
        p.name,
        p.containers.join(",")
    )
}

impl Cluster {
    /// Starts everything in `spec` under `dir` (created; certificates, logs, kubeconfig
    /// and kubectl homes go there).
    pub async fn start(spec: &ClusterSpec, dir: &Path) -> Result<Cluster> {
        let kubelet_bin = match spec.cri_runtime {
            Some(_) => bins::binary(bins::CRI_KUBELET)?,
            None => bins::binary(bins::KUBELET_SIM)?,
        };
        let apiserver_bin = bins::binary(bins::APISERVER_SIM)?;
        let (cloud_bin, edge_bin) = match spec.mode {
            Mode::Tunnel => (
                Some(bins::binary(bins::CLOUD)?),
                Some(bins::binary(bins::EDGE)?),
            ),
            Mode::Direct => (None, None),
        };
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let logs = dir.join("process-logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let names: Vec<&str> = spec.nodes.iter().map(|n| n.name.as_str()).collect();
        let pki = if spec.certs_via_cli {
            pki::mint_with_cli(&dir.join("pki"), &names)?
        } else {
            pki::mint(&dir.join("pki"), &names)?
        };
        let client = KubeletClient::new(
            &pki.tether_ca_pem,
            &pki.apiserver_client.cert_pem,
            &pki.apiserver_client.key_pem,
        )?;
        let opts = spawn_options(spec);

        // Kubelet simulators.
        let mut starting = Vec::new();
        for node in &spec.nodes {
            let node_dir = dir.join("nodes").join(&node.name);
            let log_dir = node_dir.join("logs");
            let tmp = node_dir.join("tmp");
            for d in [&log_dir, &tmp] {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            }
            let impostors: Vec<&PodSpec> = spec
                .impostor_pods
                .iter()
                .filter(|(n, _)| *n == node.name)
                .map(|(_, p)| p)
                .collect();
            for p in node.pods.iter().chain(impostors.iter().copied()) {
                for c in &p.containers {
                    let f = log_dir.join(format!("{}_{}_{c}.log", p.namespace, p.name));
                    if !f.exists() {
                        std::fs::write(&f, b"")
                            .with_context(|| format!("creating {}", f.display()))?;
                    }
                }
            }
            if let Some(sock) = &spec.cri_runtime {
                if spec.mode == Mode::Direct {
                    bail!("the CRI-backed kubelet serves plain HTTP: tunnel mode only");
                }
                let share_dir = node_dir.join("share");
                std::fs::create_dir_all(&share_dir)
                    .with_context(|| format!("creating {}", share_dir.display()))?;
                // Pod uids unique to this cluster, as several may share one containerd.
                let tag = &crate::sha256_hex(dir.display().to_string().as_bytes())[..10];
                let mut cri = CriNode {
                    share_dir,
                    uids: Default::default(),
                };
                let mut cmd = command(&kubelet_bin);
                cmd.arg("--listen")
                    .arg("127.0.0.1:0")
                    .arg("--node-name")
                    .arg(&node.name)
                    .arg("--runtime-endpoint")
                    .arg(sock)
                    .arg("--log-root")
                    .arg(&log_dir)
                    .arg("--share-dir")
                    .arg(&cri.share_dir);
                if let Some(script) = &spec.cri_script {
                    cmd.arg("--script").arg(script);
                }
                // A pod of this cri-kubelet: its containers' stdin feeds and its flag.
                let mut add_pod = |p: &PodSpec, uid: &str| -> Result<()> {
                    for c in &p.containers {
                        mkfifo(&cri.feed(&p.namespace, &p.name, c))?;
                    }
                    cmd.arg("--pod").arg(format!(
                        "{}/{}/{uid}={}",
                        p.namespace,
                        p.name,
                        p.containers.join(",")
                    ));
                    Ok(())
                };
                let mut uids = Vec::new();
                for p in &node.pods {
                    let uid = format!("{}-{}-{tag}", p.namespace, p.name);
                    add_pod(p, &uid)?;
                    uids.push((format!("{}/{}", p.namespace, p.name), uid));
                }
                for p in &impostors {
                    // Its own uid: the pod it claims may run on the same containerd.
                    add_pod(
                        p,
                        &format!("{}-{}-{}-{tag}", p.namespace, p.name, node.name),
                    )?;
                }
                cri.uids.extend(uids);
                let proc = Proc::spawn(&format!("cri-kubelet-{}", node.name), cmd, &logs, opts)?;
                starting.push((node, log_dir, Some(cri), proc));
                continue;
            }
            let mut cmd = command(&kubelet_bin);
            cmd.arg("--listen")
                .arg("127.0.0.1:0")
                .arg("--node-name")
                .arg(&node.name)
                .arg("--log-dir")
                .arg(&log_dir)
                // Containers' working directories live under TMPDIR: keep them here.
                .env("TMPDIR", &tmp);
            for p in node.pods.iter().chain(impostors.iter().copied()) {
                cmd.arg("--pod").arg(pod_arg(p));
            }
            if spec.mode == Mode::Direct {
                let tls = &pki.kubelets[&node.name];
                cmd.arg("--tls-cert")
                    .arg(&tls.cert)
                    .arg("--tls-key")
                    .arg(&tls.key)
                    .arg("--client-ca")
                    .arg(&pki.apiserver_client_ca);
            }
            let proc = Proc::spawn(&format!("kubelet-sim-{}", node.name), cmd, &logs, opts)?;
            starting.push((node, log_dir, None, proc));
        }
        let mut nodes = Vec::new();
        for (node, log_dir, cri, mut proc) in starting {
            let line = proc
                .wait_line("its listening line", READY_TIMEOUT, |l| {
                    l.starts_with("kubelet-sim listening on ")
                        || l.starts_with("cri-kubelet listening on ")
                })
                .await?;
            let url = line
                .split_whitespace()
                .nth(3)
                .with_context(|| format!("no address in {line:?}"))?;
            let addr = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"))
                .with_context(|| format!("no URL in {line:?}"))?;
            nodes.push(RunningNode {
                name: node.name.clone(),
                pods: node.pods.clone(),
                kubelet_addr: parse_addr(addr, "kubelet-sim address")?,
                log_dir,
                cri,
                kubelet: proc,
                edge: None,
            });
        }

        // The apiserver stand-in, first: the cloud watches its pods and nodes
        // (`--apiserver-kubeconfig`) and routes by them, as deployed. It dials the
        // cloud replicas' kubelet APIs at ports chosen here, which the replicas then
        // listen on.
        let tunnel = cloud_bin.is_some();
        let replicas = if tunnel { spec.replicas.max(1) } else { 0 };
        let kubelet_listens = (0..replicas)
            .map(|_| ports::free_loopback(ports::Proto::Tcp))
            .collect::<Result<Vec<_>>>()?;
        let kubeconfig = dir.join("kubeconfig");
        let apiserver_streams = apiserver_streams_from_env()?;
        let mut cmd = command(&apiserver_bin);
        cmd.arg("--stream-translation")
            .arg(apiserver_streams)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--write-kubeconfig")
            .arg(&kubeconfig)
            .arg("--kubelet-client-cert")
            .arg(&pki.apiserver_client.cert)
            .arg("--kubelet-client-key")
            .arg(&pki.apiserver_client.key)
            // Verify the kubelet serving certificate (the cloud's, in tunnel mode) against
            // the node's address, as kube-apiserver does with
            // --kubelet-certificate-authority.
            .arg("--kubelet-ca")
            .arg(&pki.tether_ca);
        for node in &nodes {
            let address = match tunnel {
                true => format!("{}:{KUBELET_PORT}", node.name),
                false => node.kubelet_addr.to_string(),
            };
            cmd.arg("--node").arg(format!("{}={address}", node.name));
            for p in &node.pods {
                cmd.arg("--pod").arg(api_pod_arg(&node.name, p));
            }
        }
        for (node, p) in &spec.phantom_pods {
            cmd.arg("--pod").arg(api_pod_arg(node, p));
        }
        if tunnel {
            let all = kubelet_listens
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(",");
            cmd.arg("--kubelet-dial").arg(all);
        }
        let mut apiserver = Proc::spawn("apiserver-sim", cmd, &logs, opts)?;
        let apiserver_url = wait_kubeconfig(&kubeconfig, &mut apiserver).await?;

        // The tunnel.
        let mut clouds: Vec<RunningCloud> = Vec::new();
        if let (Some(cloud_bin), Some(edge_bin)) = (cloud_bin, edge_bin) {
            let n = replicas;
            let peering = if n > 1 {
                let peers = pki::mint_peers(&dir.join("pki").join("peers"))?;
                let listens = (0..n)
                    .map(|_| ports::free_loopback(ports::Proto::Udp))
                    .collect::<Result<Vec<_>>>()?;
                Some((peers, listens))
            } else {
                None
            };
            let mut starting = Vec::new();
            for i in 0..n {
                let mut cmd = command(&cloud_bin);
                cmd.arg("--tunnel-listen")
                    .arg("127.0.0.1:0")
                    .arg("--kubelet-listen")
                    .arg(kubelet_listens[i].to_string())
                    // Routes by apiserver-sim's pods and nodes, as deployed: not by
                    // what the edges report.
                    .args(pki.cloud_cert_flags())
                    .arg("--apiserver-kubeconfig")
                    .arg(&kubeconfig);
                let name = if n > 1 {
                    format!("tether-cloud-{i}")
                } else {
                    "tether-cloud".to_string()
                };
                if let Some((peers, listens)) = &peering {
                    let list = listens
                        .iter()
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(",");
                    cmd.arg("--replica-name")
                        .arg(&name)
                        .arg("--peer-listen")
                        .arg(listens[i].to_string())
                        .arg("--peers")
                        .arg(list)
                        .arg("--peer-resolve-interval")
                        .arg("1s")
                        // No load balancer to wait for here: the harness stops
                        // the replicas within its STOP_GRACE (the delay is
                        // tested in tests/tests/rolling.rs and replica_bed.rs).
                        .args(["--shutdown-delay", "0s"])
                        .args(peers.flags());
                }
                cmd.args(&spec.cloud_args);
                starting.push(Proc::spawn(&name, cmd, &logs, opts)?);
            }
            for mut proc in starting {
                let line = proc
                    .wait_line("`tether-cloud ready …`", READY_TIMEOUT, |l| {
                        l.starts_with("tether-cloud ready")
                    })
                    .await?;
                let tunnel_addr = parse_addr(
                    field(&line, "tunnel").with_context(|| format!("no tunnel= in {line:?}"))?,
                    "cloud tunnel address",
                )?;
                let kubelet_api_addr = parse_addr(
                    field(&line, "kubelet-api")
                        .with_context(|| format!("no kubelet-api= in {line:?}"))?,
                    "cloud kubelet-api address",
                )?;
                let metrics_addr = parse_addr(
                    field(&line, "metrics").with_context(|| format!("no metrics= in {line:?}"))?,
                    "cloud metrics address",
                )?;
                clouds.push(RunningCloud {
                    tunnel_addr,
                    kubelet_api_addr,
                    metrics_addr,
                    proc,
                });
            }
            for (i, node) in nodes.iter_mut().enumerate() {
                let tunnel_addr = clouds[i % clouds.len()].tunnel_addr;
                let tls = &pki.edges[&node.name];
                let mut cmd = command(&edge_bin);
                cmd.arg("--cloud")
                    .arg(tunnel_addr.to_string())
                    .arg("--server-name")
                    .arg(pki::CLOUD_SERVER_NAME)
                    .arg("--ca")
                    .arg(&pki.tether_ca)
                    .arg("--cert")
                    .arg(&tls.cert)
                    .arg("--key")
                    .arg(&tls.key)
                    .arg("--kubelet-url")
                    .arg(format!("http://{}", node.kubelet_addr))
                    .arg("--pods-refresh")
                    .arg("1s")
                    .args(&spec.edge_args);
                node.edge = Some(Proc::spawn(
                    &format!("tether-edge-{}", node.name),
                    cmd,
                    &logs,
                    opts,
                )?);
            }
            for node in &mut nodes {
                let name = node.name.clone();
                if let Some(edge) = node.edge.as_mut() {
                    let prefix = format!("tether-edge connected node={name} ");
                    edge.wait_line(&format!("`{}…`", prefix), READY_TIMEOUT, |l| {
                        l.starts_with(&prefix)
                    })
                    .await?;
                }
            }
        }
        let mut clouds = clouds.into_iter();
        let cloud = clouds.next();
        let more_clouds: Vec<RunningCloud> = clouds.collect();

        let cluster = Cluster {
            mode: spec.mode,
            dir: dir.to_path_buf(),
            pki,
            kubeconfig,
            apiserver_url,
            nodes,
            cloud,
            more_clouds,
            apiserver_streams,
            apiserver,
            client,
        };
        cluster.wait_routable().await?;
        Ok(cluster)
    }

    /// The kubelet API the apiserver dials for `node`: the cloud, or the node's kubelet.
    pub fn kubelet_api_for(&self, node: &str) -> Result<SocketAddr> {
        match &self.cloud {
            Some(c) => Ok(c.kubelet_api_addr),
            None => Ok(self.node(node)?.kubelet_addr),
        }
    }

    /// The running node called `name`.
    pub fn node(&self, name: &str) -> Result<&RunningNode> {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .with_context(|| format!("no node {name} in this cluster"))
    }

    /// The container log file the kubelet serves for `ns/pod/container` on `node`:
    /// kubelet-sim's plain file, or the CRI log file containerd writes.
    pub fn log_path(&self, node: &str, ns: &str, pod: &str, container: &str) -> Result<PathBuf> {
        let n = self.node(node)?;
        match &n.cri {
            None => Ok(n.log_dir.join(format!("{ns}_{pod}_{container}.log"))),
            Some(cri) => {
                let uid = cri
                    .uids
                    .get(&format!("{ns}/{pod}"))
                    .with_context(|| format!("no pod {ns}/{pod} on {node}"))?;
                Ok(n.log_dir
                    .join(format!("{ns}_{pod}_{uid}"))
                    .join(container)
                    .join("0.log"))
            }
        }
    }

    /// Appends `text` to what the container `ns/pod/container` on `node` has logged:
    /// with kubelet-sim, to its log file; with cri-kubelet, through the FIFO its main
    /// process copies to its stdout (the container must run `cat` of
    /// `/share/NS_POD_CONTAINER`), then waits (bounded) until containerd has logged
    /// every complete line of it.
    pub async fn append_log(
        &self,
        node: &str,
        ns: &str,
        pod: &str,
        container: &str,
        text: &str,
    ) -> Result<()> {
        let path = self.log_path(node, ns, pod, container)?;
        let Some(cri) = &self.node(node)?.cri else {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            return f
                .write_all(text.as_bytes())
                .with_context(|| format!("appending to {}", path.display()));
        };
        let before = count_lines(&path);
        let want = before + text.matches('\n').count();
        write_fifo(&cri.feed(ns, pod, container), text.as_bytes()).await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = count_lines(&path);
            if n >= want {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "containerd logged {} of {} lines written to {ns}/{pod}/{container} within 10 s ({})",
                    n - before,
                    want - before,
                    path.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// With cri-kubelet: every upgrade containerd's streaming server answered, as the
    /// stand-ins logged them, shortened to `METHOD /verb -> status headers`, in order.
    pub fn cri_negotiated(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for n in self.nodes.iter().filter(|n| n.cri.is_some()) {
            let log = n.kubelet.log_path();
            let text = std::fs::read_to_string(log)
                .with_context(|| format!("reading {}", log.display()))?;
            out.extend(
                text.lines()
                    .filter_map(|l| l.split("cri-kubelet: upgrade ").nth(1))
                    .map(|l| {
                        let words: Vec<&str> = l.split_whitespace().collect();
                        let verb = words
                            .get(1)
                            .and_then(|p| p.split('/').nth(1))
                            .unwrap_or("?");
                        let rest = words.get(2..).map(|w| w.join(" ")).unwrap_or_default();
                        format!("{} /{verb} {rest}", words.first().unwrap_or(&"?"))
                    }),
            );
        }
        Ok(out)
    }

    /// The HTTPS client with the apiserver's kubelet-client certificate.
    pub fn kubelet_client(&self) -> &KubeletClient {
        &self.client
    }

    /// `GET path` as the apiserver would send it for `node`: to the cloud (or the
    /// kubelet), TLS server name = the node's name (SNI) in tunnel mode, `Host` = the
    /// node's address.
    pub async fn kubelet_get(&self, node: &str, path: &str) -> Result<crate::probe::Reply> {
        self.kubelet_get_via(self.kubelet_api_for(node)?, node, path)
            .await
    }

    /// Every address the apiserver may reach `node`'s kubelet API at: each cloud
    /// replica's, or the node's kubelet.
    pub fn kubelet_apis_for(&self, node: &str) -> Result<Vec<SocketAddr>> {
        match &self.cloud {
            Some(c) => Ok(std::iter::once(c)
                .chain(self.more_clouds.iter())
                .map(|c| c.kubelet_api_addr)
                .collect()),
            None => Ok(vec![self.node(node)?.kubelet_addr]),
        }
    }

    /// [`Cluster::kubelet_get`] through the kubelet API at `addr`.
    pub async fn kubelet_get_via(
        &self,
        addr: SocketAddr,
        node: &str,
        path: &str,
    ) -> Result<crate::probe::Reply> {
        let (server_name, host) = match self.mode {
            Mode::Tunnel => (node.to_string(), format!("{node}:{KUBELET_PORT}")),
            Mode::Direct => ("127.0.0.1".to_string(), addr.to_string()),
        };
        self.client.get(addr, &server_name, &host, path).await
    }

    /// `GET path` for `node` through the kubelet API at `addr` (as
    /// [`Cluster::kubelet_get_via`]), returned once the response head arrived with
    /// the connection still open: for a response that streams, such as `logs -f`.
    /// A non-2xx answer's body is read for up to a second into [`OpenReply::text`].
    /// Bounded by `limit`.
    pub async fn kubelet_open_via(
        &self,
        addr: SocketAddr,
        node: &str,
        path: &str,
        limit: Duration,
    ) -> Result<OpenReply> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (server_name, host) = match self.mode {
            Mode::Tunnel => (node.to_string(), format!("{node}:{KUBELET_PORT}")),
            Mode::Direct => ("127.0.0.1".to_string(), addr.to_string()),
        };
        let open = async {
            let mut io = self.client.connect_from(None, addr, &server_name).await?;
            io.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
                .await
                .context("writing the request")?;
            let mut got = read_until(&mut io, b"\r\n\r\n", 64 << 10)
                .await
                .context("reading the response head")?;
            let status = std::str::from_utf8(&got)
                .ok()
                .and_then(|t| t.split_whitespace().nth(1))
                .and_then(|c| c.parse::<u16>().ok())
                .with_context(|| {
                    format!("bad status line in {:?}", String::from_utf8_lossy(&got))
                })?;
            if !(200..300).contains(&status) {
                let mut buf = [0u8; 1024];
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    while let Ok(n @ 1..) = io.read(&mut buf).await {
                        got.extend_from_slice(&buf[..n]);
                    }
                })
                .await;
            }
            Ok::<_, anyhow::Error>(OpenReply {
                status,
                text: String::from_utf8_lossy(&got).into_owned(),
                io,
            })
        };
        tokio::time::timeout(limit, open)
            .await
            .map_err(|_| anyhow!("GET {path} on {addr}: no response head within {limit:?}"))?
            .with_context(|| format!("GET {path} on {addr}"))
    }

    /// Waits until every pod's first container answers a log request through the kubelet
    /// API, from its own node's kubelet (`X-Kubelet-Sim-Node`). In tunnel mode this is
    /// when the cloud has the edges' pod lists — every replica, with several.
    async fn wait_routable(&self) -> Result<()> {
        let start = Instant::now();
        for node in &self.nodes {
            for pod in &node.pods {
                let Some(c) = pod.containers.first() else {
                    continue;
                };
                let path = format!(
                    "/containerLogs/{}/{}/{c}?limitBytes=1",
                    pod.namespace, pod.name
                );
                for addr in self.kubelet_apis_for(&node.name)? {
                    loop {
                        let last = match self.kubelet_get_via(addr, &node.name, &path).await {
                            Ok(r)
                                if r.status.is_success()
                                    && r.node() == Some(node.name.as_str()) =>
                            {
                                break
                            }
                            Ok(r) => format!(
                                "{} from node {:?}: {}",
                                r.status,
                                r.node(),
                                String::from_utf8_lossy(&r.body).trim()
                            ),
                            Err(e) => format!("{e:#}"),
                        };
                        if start.elapsed() > ROUTABLE_TIMEOUT {
                            bail!(
                                "pod {}/{} on {} not reachable through the kubelet API within \
                             {ROUTABLE_TIMEOUT:?}; last answer to GET {path}: {last}\n{}",
                                pod.namespace,
                                pod.name,
                                node.name,
                                self.diagnostics(15)
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
        Ok(())
    }

    /// Every process's name, pid and stderr log path.
    pub fn processes(&self) -> Vec<(String, Option<u32>, PathBuf)> {
        self.procs()
            .into_iter()
            .map(|p| (p.name().to_string(), p.pid(), p.log_path().to_path_buf()))
            .collect()
    }

    fn procs(&self) -> Vec<&Proc> {
        let mut v = vec![&self.apiserver];
        for n in &self.nodes {
            if let Some(e) = &n.edge {
                v.push(e);
            }
        }
        for c in self.cloud.iter().chain(self.more_clouds.iter()) {
            v.push(&c.proc);
        }
        for n in &self.nodes {
            v.push(&n.kubelet);
        }
        v
    }

    /// What the kubelet side of each exec/attach upgrade negotiated so far, from
    /// apiserver-sim's log: (`translated …` or `passed through …`, count), sorted.
    pub fn kubelet_stream_protocols(&self) -> Result<Vec<(String, usize)>> {
        let text = std::fs::read_to_string(self.apiserver.log_path())
            .with_context(|| format!("reading {}", self.apiserver.log_path().display()))?;
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for line in text.lines() {
            let Some((head, proto)) = line.split_once(" kubelet negotiated ") else {
                continue;
            };
            if !(head.contains("/exec/") || head.contains("/attach/")) {
                continue;
            }
            let key = match head.split_once(": client ") {
                Some((_, client)) if head.starts_with("apiserver-sim: translating") => format!(
                    "translated: client {}, kubelet {proto}",
                    client.trim_end_matches(',')
                ),
                _ => format!("passed through: kubelet {proto}"),
            };
            *counts.entry(key).or_default() += 1;
        }
        Ok(counts.into_iter().collect())
    }

    /// The last `lines` lines of every process's stderr log, for failure reports.
    pub fn diagnostics(&self, lines: usize) -> String {
        let mut s = String::new();
        for p in self.procs() {
            s.push_str(&format!(
                "--- {} ({}) ---\n{}\n",
                p.name(),
                p.log_path().display(),
                p.stderr_tail(lines)
            ));
        }
        s
    }

    /// Processes that have exited although the cluster is still up.
    pub fn exited(&mut self) -> Vec<String> {
        let mut dead = Vec::new();
        let mut check = |p: &mut Proc| {
            if let Some(status) = p.exited() {
                dead.push(format!("{} exited: {status}", p.name()));
            }
        };
        check(&mut self.apiserver);
        for c in self.cloud.iter_mut().chain(self.more_clouds.iter_mut()) {
            check(&mut c.proc);
        }
        for n in &mut self.nodes {
            check(&mut n.kubelet);
            if let Some(e) = n.edge.as_mut() {
                check(e);
            }
        }
        dead
    }

    /// Stops every process in order (apiserver, edges, cloud, kubelets): SIGTERM, then
    /// SIGKILL after a grace period. Returns one line per process.
    pub async fn shutdown(mut self) -> Vec<String> {
        let mut report = Vec::new();
        let mut stop = |name: String, status: Option<std::process::ExitStatus>| {
            report.push(match status {
                Some(s) => format!("{name}: stopped ({s})"),
                None => format!("{name}: killed after {STOP_GRACE:?}"),
            });
        };
        let s = self.apiserver.terminate(STOP_GRACE).await;
        stop(self.apiserver.name().to_string(), s);
        for n in &mut self.nodes {
            if let Some(e) = n.edge.as_mut() {
                let s = e.terminate(STOP_GRACE).await;
                stop(e.name().to_string(), s);
            }
        }
        for c in self.cloud.iter_mut().chain(self.more_clouds.iter_mut()) {
            let s = c.proc.terminate(STOP_GRACE).await;
            stop(c.proc.name().to_string(), s);
        }
        for n in &mut self.nodes {
            let s = n.kubelet.terminate(STOP_GRACE).await;
            stop(n.kubelet.name().to_string(), s);
        }
        report
    }
}

/// Waits for apiserver-sim's kubeconfig and returns its server URL.
/// Waits (bounded) for `apiserver-sim --write-kubeconfig path` to write it; returns its server URL.
pub async fn wait_kubeconfig(path: &Path, apiserver: &mut Proc) -> Result<String> {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            let server = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("server:"))
                .map(|v| v.trim().trim_matches('"').to_string())
                .ok_or_else(|| anyhow!("no server: in {}", path.display()))?;
            return Ok(server);
        }
        if let Some(status) = apiserver.exited() {
            bail!(
                "apiserver-sim exited ({status}) before writing its kubeconfig; stderr:\n{}",
                apiserver.stderr_tail(30)
            );
        }
        if start.elapsed() > READY_TIMEOUT {
            bail!(
                "apiserver-sim wrote no kubeconfig within {READY_TIMEOUT:?}; stderr:\n{}",
                apiserver.stderr_tail(30)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_line_fields() {
        let l = "tether-cloud ready tunnel=127.0.0.1:4433 kubelet-api=127.0.0.1:10003";
        assert_eq!(field(l, "tunnel"), Some("127.0.0.1:4433"));
        assert_eq!(field(l, "kubelet-api"), Some("127.0.0.1:10003"));
        assert_eq!(field(l, "nothing"), None);
        let p = PodSpec::new("default", "p1", &["c1", "c2"]);
        assert_eq!(pod_arg(&p), "default/p1=c1,c2");
        assert_eq!(api_pod_arg("edge-1", &p), "default/p1=edge-1:c1,c2");
    }
}
