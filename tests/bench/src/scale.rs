//! Scenario 5, scale: `n` idle edges held by one `tether-cloud`.
//!
//! The edges are simulated in this process by a load generator that makes real QUIC
//! connections with real edge certificates (one per node, signed by the cloud's edge
//! CA) and speaks the edge's side of the handshake (the control stream's hello, then
//! the welcome) exactly as `tether-edge` does, with the edge's transport settings
//! (keep-alive 20 s: where the edge's adaptive keep-alive starts; idle timeout
//! 150 s), each from its own UDP socket, four to a loopback address
//! (127.1.x.y: the cloud admits `--handshakes-per-source` handshakes a second
//! from one address, and real edges come from their own). The generator then
//! holds each connection idle; when it closes, it reconnects as the edge does
//! with its defaults (but from the same source port): a jittered 100 ms – 1 s
//! backoff,
//! and overlapping handshake attempts (a new one every second while older ones wait,
//! at most 2, each bounded by 10 s), so a lost Initial does not wait out QUIC's
//! exponential retransmission timer; after the cloud shut down, it first waits a
//! random part of `--reconnect-spread` (5 s).
//!
//! Measured: time to connect all; the cloud's RSS per edge and idle CPU; after a
//! cloud restart (SIGTERM, `--shutdown-grace 1s`, a new process on the same port), the
//! time until every edge has a welcome again. The cloud runs as deployed, with the
//! replicas' shared `--reset-key-file`, so the new process opens the TLS session
//! tickets the old one gave the edges (each simulated edge keeps its own, as
//! tether-edge does): the bench prints how many handshakes of the reconnect resumed.
//! Everything runs on loopback.
//!
//! The RSS per edge is taken twice: 3 s after the last edge connected, and again
//! once every edge has sent [`KEEPALIVES_TO_STEADY`] of tether-edge's keep-alive
//! frames, what a default edge sends in its first quarter of an hour to hour (one
//! every 20 s to 110 s, as its adaptive keep-alive settles). quinn hands
//! every datagram a connection receives to the connection's task through a tokio
//! channel that allocates its slots 32 at a time and keeps a spent block for reuse
//! (~7 KiB each): a connection that has received more than 32 datagrams, which
//! every edge's has after that time (or its first session), holds two for as long
//! as it lives. The
//! second figure is what an idle edge costs for hours.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::Rng;
use tether_certs::Ca;
use tether_proto::handshake::{close_code, Hello, ALPN_TUNNEL, PROTOCOL_VERSION};
use tether_proto::io::{write_frame, FrameReader};
use tether_proto::Frame;
use tether_tests::process::{Proc, SpawnOptions};

use crate::procs::{cpu_ticks, ticks_per_sec};
use crate::table::{Cell, Table};
use crate::Report;

pub(crate) const VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// The cloud's certificate files in `dir`.
pub(crate) struct CloudFiles {
    pub(crate) args: Vec<std::ffi::OsString>,
}

fn write(dir: &std::path::Path, name: &str, pem: &str) -> Result<std::path::PathBuf> {
    let p = dir.join(name);
    std::fs::write(&p, pem).with_context(|| format!("writing {}", p.display()))?;
    Ok(p)
}

pub(crate) fn cloud_files(dir: &std::path::Path, ca: &Ca) -> Result<CloudFiles> {
    let lo = [std::net::IpAddr::from([127, 0, 0, 1])];
    let tunnel = ca.issue_server(&[tether_tests::pki::CLOUD_SERVER_NAME], &lo, VALIDITY)?;
    let kubelet = ca.issue_server(&["localhost"], &lo, VALIDITY)?;
    let client_ca = Ca::new("apiserver-client-ca", VALIDITY)?;
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    for (flag, name, pem) in [
        ("--tunnel-cert", "tunnel.crt", &tunnel.cert_pem),
        ("--tunnel-key", "tunnel.key", &tunnel.key_pem),
        ("--edge-ca", "ca.crt", &ca.cert_pem),
        ("--kubelet-cert", "kubelet.crt", &kubelet.cert_pem),
        ("--kubelet-key", "kubelet.key", &kubelet.key_pem),
        (
            "--apiserver-client-ca",
            "client-ca.crt",
            &client_ca.cert_pem,
        ),
    ] {
        args.push(flag.into());
        args.push(write(dir, name, pem)?.into());
    }
    // No apiserver here: route by the edges' reports.
    args.push("--insecure-trust-edge-reports".into());
    Ok(CloudFiles { args })
}

async fn start_cloud(
    dir: &std::path::Path,
    files: &CloudFiles,
    port: u16,
    n: usize,
) -> Result<(Proc, u16, std::net::SocketAddr)> {
    let mut cmd = tokio::process::Command::new(tether_tests::bins::binary("tether-cloud")?);
    cmd.args(["--tunnel-listen", &format!("127.0.0.1:{port}")])
        .args([
            "--kubelet-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--shutdown-grace", "1s"])
        // The default --max-edges (20,000) unless the scenario needs more.
        .args(if n + 100 > 20_000 {
            vec!["--max-edges".to_string(), (n + 100).to_string()]
        } else {
            Vec::new()
        })
        .args(&files.args)
        .env("TETHER_LOG", "warn")
        .env("RUST_BACKTRACE", "0");
    let mut p = Proc::spawn("tether-cloud-scale", cmd, dir, SpawnOptions::default())?;
    let ready = p
        .wait_line("tether-cloud ready", Duration::from_secs(20), |l| {
            l.starts_with("tether-cloud ready")
        })
        .await?;
    let port = ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("tunnel="))
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .map(|a| a.port())
        .with_context(|| format!("no tunnel= in {ready:?}"))?;
    let metrics = ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metrics="))
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .with_context(|| format!("no metrics= in {ready:?}"))?;
    Ok((p, port, metrics))
}

/// The cloud's refused-edge counters by reason (what slowed a reconnect storm).
async fn refusals(metrics: std::net::SocketAddr) -> String {
    match crate::measure::metrics_text(metrics).await {
        Some(body) => body
            .lines()
            .filter(|l| {
                l.starts_with("tether_cloud_edges_refused")
                    || l.starts_with("tether_cloud_edge_tls_handshakes_total")
            })
            .collect::<Vec<_>>()
            .join(", "),
        None => "(metrics unavailable)".into(),
    }
}

/// The largest frame a simulated edge writes or reads: tether-edge's default
/// `--max-frame-bytes`.
fn max_frame() -> usize {
    tether_proto::Limits::default().max_frame_bytes as usize
}

/// tether-edge's QUIC defaults (`--keep-alive 20s`, `--idle-timeout 150s`):
/// quinn's keep-alive at the interval where the edge's adaptive keep-alive
/// starts. On a link whose NAT holds the binding (loopback has none) a real
/// edge then lengthens it up to 110 s, so this is the most a default edge sends.
fn edge_quic() -> tether_proto::quic::QuicSettings {
    tether_proto::quic::QuicSettings {
        keep_alive: Duration::from_secs(20),
        idle_timeout: Duration::from_secs(150),
        ..tether_proto::quic::QuicSettings::default()
    }
}

pub(crate) fn client_config(ca: &Ca, node: &str) -> Result<quinn::ClientConfig> {
    client_config_with(ca, node, edge_quic())
}

/// [`client_config`] with other transport settings.
pub(crate) fn client_config_with(
    ca: &Ca,
    node: &str,
    quic: tether_proto::quic::QuicSettings,
) -> Result<quinn::ClientConfig> {
    let ck = ca.issue_edge(node, VALIDITY)?;
    let mut roots = rustls::RootCertStore::empty();
    for c in tether_certs::pem::certs_from_pem(&ca.cert_pem, "ca")? {
        roots.add(c)?;
    }
    // tether-edge's provider (AES-128-GCM first).
    let mut tls = rustls::ClientConfig::builder_with_provider(tether_proto::tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_client_auth_cert(
            tether_certs::pem::certs_from_pem(&ck.cert_pem, "edge")?,
            tether_certs::pem::key_from_pem(&ck.key_pem, "edge")?,
        )?;
    tls.alpn_protocols = vec![ALPN_TUNNEL.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut c = quinn::ClientConfig::new(Arc::new(crypto));
    c.transport_config(quic.transport_arc().map_err(anyhow::Error::msg)?);
    Ok(c)
}

/// Simulated edges per source address (a few edges behind one site's NAT).
/// The cloud admits `--handshakes-per-source` (20) handshakes a second from
/// one address; real edges come from their own addresses, so the simulated
/// ones do too (loopback has all of 127.0.0.0/8).
pub(crate) const EDGES_PER_SOURCE: usize = 4;

/// Client endpoints for `n` simulated edges, edge `i` on `eps[i]`: each edge
/// its own UDP socket, as each tether-edge has (the cloud's waiting line
/// tells edges apart by source address and port), [`EDGES_PER_SOURCE`] of
/// them on each loopback address (127.1.x.y).
pub(crate) fn endpoints_for(n: usize) -> Result<Vec<quinn::Endpoint>> {
    (0..n.max(1))
        .map(|e| {
            let i = u32::try_from(e / EDGES_PER_SOURCE).context("too many endpoints")?;
            endpoint(std::net::Ipv4Addr::from(
                0x7f01_0000 + (i / 250) * 256 + i % 250 + 1,
            ))
        })
        .collect()
}

fn socket(ip: std::net::IpAddr) -> Result<std::net::UdpSocket> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address((ip, 0).into()),
        socket2::Type::DGRAM,
        None,
    )?;
    s.set_recv_buffer_size(1 << 20)?;
    s.set_send_buffer_size(1 << 20)?;
    s.bind(&std::net::SocketAddr::from((ip, 0)).into())
        .with_context(|| format!("binding a client endpoint to {ip}"))?;
    Ok(s.into())
}

/// A simulated edge's socket without receive offload. quinn sizes an
/// endpoint's receive buffer for a batch of coalesced datagrams (~3 MiB of
/// address space, about 1 MiB of it touched); one endpoint per edge made the
/// load generator itself hold 11 GiB for 10,000 edges (and fail to spawn the
/// next cloud). With GRO off and one datagram per receive slot it is ~46 KiB.
#[derive(Debug)]
struct NoGro(Arc<dyn quinn::AsyncUdpSocket>);

impl quinn::AsyncUdpSocket for NoGro {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.0.clone().create_io_poller()
    }
    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.0.try_send(transmit)
    }
    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.0.poll_recv(cx, bufs, meta)
    }
    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.0.local_addr()
    }
    fn max_transmit_segments(&self) -> usize {
        self.0.max_transmit_segments()
    }
    fn max_receive_segments(&self) -> usize {
        1
    }
    fn may_fragment(&self) -> bool {
        self.0.may_fragment()
    }
}

pub(crate) fn endpoint(ip: std::net::Ipv4Addr) -> Result<quinn::Endpoint> {
    use std::os::fd::AsRawFd;
    let runtime = quinn::default_runtime().context("no async runtime for QUIC")?;
    let sock = socket(ip.into())?;
    let fd = sock.as_raw_fd();
    let wrapped = runtime.wrap_udp_socket(sock)?;
    // quinn-udp turned receive offload on; the buffer below holds single datagrams.
    let off: libc::c_int = 0;
    // SAFETY: `fd` is the open socket `wrapped` owns; the option value is a c_int.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_UDP,
            libc::UDP_GRO,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        bail!("turning UDP_GRO off: {}", std::io::Error::last_os_error());
    }
    Ok(quinn::Endpoint::new_with_abstract_socket(
        quinn::EndpointConfig::default(),
        None,
        Arc::new(NoGro(wrapped)),
        runtime,
    )?)
}

/// tether-edge's defaults: attempts in flight, a new attempt every, each bounded by.
const MAX_IN_FLIGHT: usize = 2;
const NEW_ATTEMPT_EVERY: Duration = Duration::from_secs(1);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const RECONNECT_SPREAD: Duration = Duration::from_secs(5);

/// Keep-alive frames each simulated edge sends before the steady-state RSS is
/// taken: with its handshake's datagrams, past the 32 of the first block of
/// quinn's per-connection event channel. (A default tether-edge sends one every
/// 20 s to 110 s: a quarter of an hour to about an hour.)
pub(crate) const KEEPALIVES_TO_STEADY: u32 = 40;

/// Between one simulated edge's keep-alive frames, so that each is a datagram
/// of its own (10,000 edges: ~40,000 a second at the cloud).
const KEEPALIVE_SPACING: Duration = Duration::from_millis(250);

/// Keep-alive frames the simulated edges have sent (the steady-state warm-up).
static KEEPALIVES: AtomicUsize = AtomicUsize::new(0);

/// Once `warm` changes while this connection is held, sends
/// [`KEEPALIVES_TO_STEADY`] keep-alive frames on its control stream, as
/// tether-edge does over its first minutes; then, or if the sender is gone,
/// waits forever.
async fn keep_alives(send: &mut quinn::SendStream, warm: &mut tokio::sync::watch::Receiver<u64>) {
    if warm.changed().await.is_ok() {
        let offset = rand::rng().random_range(0..KEEPALIVE_SPACING.as_millis() as u64);
        tokio::time::sleep(Duration::from_millis(offset)).await;
        for _ in 0..KEEPALIVES_TO_STEADY {
            if write_frame(send, &Frame::KeepAlive, max_frame())
                .await
                .is_err()
            {
                break;
            }
            KEEPALIVES.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(KEEPALIVE_SPACING).await;
        }
    }
    std::future::pending().await
}

/// What a simulated edge says in its hellos: its state's token, its
/// process id and its attempt counter, as tether-edge does.
struct EdgeState {
    token: tether_proto::token::ResumeToken,
    instance: u64,
    attempts: std::sync::atomic::AtomicU64,
}

/// Connection attempts the simulated edges started, and QUIC handshakes
/// they completed (a reconnect storm's waste is the difference between the
/// latter and the edges).
static ATTEMPTS: AtomicUsize = AtomicUsize::new(0);
static HANDSHAKES: AtomicUsize = AtomicUsize::new(0);

/// One handshake: QUIC + TLS, hello, welcome; the connection, its control
/// stream and the welcome's session (not yet committed).
async fn handshake(
    ep: quinn::Endpoint,
    cfg: quinn::ClientConfig,
    node: String,
    addr: std::net::SocketAddr,
    state: Arc<EdgeState>,
) -> Result<(
    quinn::Connection,
    quinn::SendStream,
    quinn::RecvStream,
    tether_proto::token::SessionId,
)> {
    ATTEMPTS.fetch_add(1, Ordering::Relaxed);
    let conn = ep
        .connect_with(cfg, addr, tether_tests::pki::CLOUD_SERVER_NAME)?
        .await?;
    HANDSHAKES.fetch_add(1, Ordering::Relaxed);
    let (mut send, mut recv) = conn.open_bi().await?;
    let hello = Hello {
        versions: vec![PROTOCOL_VERSION],
        node,
        addresses: Vec::new(),
        resume: state.token,
        instance: state.instance,
        attempt: state.attempts.fetch_add(1, Ordering::Relaxed) + 1,
        limits: Default::default(),
        // Simulated edges resume by their token on the replica they left.
        ticket: None,
    };
    let max = max_frame();
    write_frame(&mut send, &Frame::Hello(hello), max).await?;
    match FrameReader::new(max).next(&mut recv).await? {
        Some(Frame::Welcome(w)) => Ok((conn, send, recv, w.session)),
        other => bail!("expected a welcome, got {:?}", other.map(|f| f.kind())),
    }
}

/// Overlapping attempts until one is welcomed and committed to (or all time out).
async fn establish(
    ep: &quinn::Endpoint,
    cfg: &quinn::ClientConfig,
    node: &str,
    addr: std::net::SocketAddr,
    state: &Arc<EdgeState>,
) -> Option<(quinn::Connection, quinn::SendStream, quinn::RecvStream)> {
    let mut attempts = tokio::task::JoinSet::new();
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    loop {
        if attempts.len() < MAX_IN_FLIGHT && tokio::time::Instant::now() < deadline {
            let (ep, cfg, node) = (ep.clone(), cfg.clone(), node.to_string());
            attempts.spawn(tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                handshake(ep, cfg, node, addr, state.clone()),
            ));
        }
        if attempts.is_empty() {
            return None;
        }
        tokio::select! {
            done = attempts.join_next() => match done {
                Some(Ok(Ok(Ok((conn, mut send, recv, session))))) => {
                    // Commit to the first welcome, as the edge does.
                    let commit = Frame::Commit { session };
                    return match write_frame(&mut send, &commit, max_frame()).await {
                        Ok(()) => Some((conn, send, recv)),
                        Err(_) => None,
                    };
                }
                // A definite refusal ends the round, as on the edge.
                Some(Ok(Ok(Err(_)))) => return None,
                _ => {}
            },
            _ = tokio::time::sleep(NEW_ATTEMPT_EVERY) => {}
        }
    }
}

/// One simulated edge: welcomed, hold the connection; again when it closes.
/// With several addresses (replicas behind a load balancer) it starts at the
/// first and moves to the next one after every lost connection. When `warm`
/// changes, the connection held then sends its keep-alive frames
/// ([`keep_alives`]); a connection made later does not.
pub(crate) async fn edge(
    ep: quinn::Endpoint,
    cfg: quinn::ClientConfig,
    node: String,
    addrs: Vec<std::net::SocketAddr>,
    welcomes: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    mut warm: tokio::sync::watch::Receiver<u64>,
) {
    let mut turn = 0usize;
    let mut delay = Duration::from_millis(100);
    let state = Arc::new(EdgeState {
        token: tether_proto::token::ResumeToken(rand::random()),
        instance: rand::random(),
        attempts: std::sync::atomic::AtomicU64::new(0),
    });
    while !stop.load(Ordering::Relaxed) {
        let Some(&addr) = addrs.get(turn % addrs.len().max(1)) else {
            return;
        };
        turn += 1;
        if let Some((conn, mut send, recv)) = establish(&ep, &cfg, &node, addr, &state).await {
            welcomes.fetch_add(1, Ordering::Relaxed);
            // A warm-up asked for before this connection is not its own.
            warm.borrow_and_update();
            delay = Duration::from_millis(100);
            // Answer the cloud's datagram hello as the edge does (and take
            // copies, though nothing here writes).
            let copies = tether_proto::copies::CopyLink::new(
                conn.clone(),
                Default::default(),
                Default::default(),
            );
            let closed = tokio::select! {
                closed = conn.closed() => closed,
                () = copies.announce_and_serve(|_| tether_proto::copies::Fate::Unused, "cloud") => conn.closed().await,
                () = keep_alives(&mut send, &mut warm) => conn.closed().await,
            };
            drop((send, recv));
            // The edge's --reconnect-spread after a cloud shutdown.
            if let quinn::ConnectionError::ApplicationClosed(c) = closed {
                if c.error_code == quinn::VarInt::from_u32(close_code::SHUTDOWN) {
                    let ms = rand::rng().random_range(0..=RECONNECT_SPREAD.as_millis() as u64);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
            }
        }
        let ms = rand::rng().random_range(delay.as_millis() as u64 / 2..=delay.as_millis() as u64);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

pub(crate) async fn wait_count(c: &AtomicUsize, n: usize, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if c.load(Ordering::Relaxed) >= n {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Runs the scenario with `n` edges and appends its table.
pub async fn run(r: &mut Report, n: usize, idle_window: Duration) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let ca = Ca::new("tether-scale-ca", VALIDITY)?;
    let mut files = cloud_files(dir.path(), &ca)?;
    // The replicas' shared secret, as deploy/ mounts it (tether-certs reset-key).
    let secret: [u8; 32] = rand::random();
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    files.args.push("--reset-key-file".into());
    files
        .args
        .push(write(dir.path(), "reset.key", &hex)?.into());
    let t_mint = Instant::now();
    let mut cfgs = Vec::with_capacity(n);
    for i in 0..n {
        cfgs.push(client_config(&ca, &format!("edge-{i}"))?);
    }
    eprintln!(
        "tether-bench: minted {n} edge certificates in {:.1} s",
        t_mint.elapsed().as_secs_f64()
    );
    let (mut cloud, port, _) = start_cloud(dir.path(), &files, 0, n).await?;
    let pid = cloud.pid().context("cloud pid")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss0 = crate::footprint::status_kb(pid, "VmRSS:")?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let endpoints = endpoints_for(n)?;
    let welcomes = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (warm_tx, warm) = tokio::sync::watch::channel(0u64);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (i, cfg) in cfgs.into_iter().enumerate() {
        tasks.push(tokio::spawn(edge(
            endpoints[i % endpoints.len()].clone(),
            cfg,
            format!("edge-{i}"),
            vec![addr],
            welcomes.clone(),
            stop.clone(),
            warm.clone(),
        )));
        // Pace the dial-in a little: 1,000 handshakes/s is about what 2 shared cores do.
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    }
    let connect_all = wait_count(&welcomes, n, Duration::from_secs(120))
        .await
        .map(|_| t0.elapsed());
    let result: Result<Vec<(String, Cell)>> = async {
        let Some(connect_all) = connect_all else {
            bail!(
                "only {} of {n} edges connected within 120 s",
                welcomes.load(Ordering::Relaxed)
            );
        };
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss1 = crate::footprint::status_kb(pid, "VmRSS:")?;
        // Steady state: every edge's keep-alives of its first minutes.
        let k0 = KEEPALIVES.load(Ordering::Relaxed);
        let t_warm = Instant::now();
        warm_tx.send_replace(1);
        let wanted = n * KEEPALIVES_TO_STEADY as usize;
        let warmed = wait_count(&KEEPALIVES, k0 + wanted, Duration::from_secs(120)).await;
        eprintln!(
            "tether-bench: scale {n}: {} keep-alive frames sent in {:.1} s for the steady state ({wanted} wanted)",
            KEEPALIVES.load(Ordering::Relaxed) - k0,
            t_warm.elapsed().as_secs_f64(),
        );
        // Both steady-state rows say why when the warm-up did not finish.
        let not_warmed = warmed.is_none().then(|| {
            format!(
                "not measured: {} of {wanted} keep-alives sent within 120 s",
                KEEPALIVES.load(Ordering::Relaxed) - k0,
            )
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss_steady = crate::footprint::status_kb(pid, "VmRSS:")?;
        let c0 = cpu_ticks(pid)?;
        tokio::time::sleep(idle_window).await;
        let c1 = cpu_ticks(pid)?;
        let hz = ticks_per_sec();
        let cpu_pct = (c1 - c0) as f64 / hz / idle_window.as_secs_f64() * 100.0;
        // Restart: SIGTERM, a new process on the same port, all back.
        let before = welcomes.load(Ordering::Relaxed);
        let t_term = Instant::now();
        cloud.terminate(Duration::from_secs(10)).await;
        let t_exit = Instant::now();
        let (new_cloud, _, metrics) = start_cloud(dir.path(), &files, port, n).await?;
        cloud = new_cloud;
        let t_ready = Instant::now();
        eprintln!(
            "tether-bench: scale {n}: the old cloud exited {:.2} s after its SIGTERM; the new one was ready {:.2} s after it was started",
            (t_exit - t_term).as_secs_f64(),
            (t_ready - t_exit).as_secs_f64(),
        );
        let new_pid = cloud.pid().context("cloud pid")?;
        let (cloud_c0, self_c0) = (cpu_ticks(new_pid)?, cpu_ticks(std::process::id())?);
        let (a0, h0) = (ATTEMPTS.load(Ordering::Relaxed), HANDSHAKES.load(Ordering::Relaxed));
        let progress = {
            let welcomes = welcomes.clone();
            tokio::spawn(async move {
                // Each sample with its own time: on 2 loaded cores a 1 s
                // sleep ends late (about 1.3 s in a storm), so counting
                // samples as seconds understated when the last edges came.
                let mut line = Vec::new();
                let mut tick = tokio::time::interval_at(
                    tokio::time::Instant::from_std(t_ready) + Duration::from_secs(1),
                    Duration::from_secs(1),
                );
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                for _ in 0..120 {
                    tick.tick().await;
                    let w = welcomes.load(Ordering::Relaxed) - before;
                    line.push(format!("{:.1}s {w}", t_ready.elapsed().as_secs_f64()));
                    if w >= n {
                        break;
                    }
                }
                eprintln!("tether-bench: scale {n}: welcomed since the new cloud was ready, about once a second: {}", line.join(", "));
            })
        };
        let back = wait_count(&welcomes, before + n, Duration::from_secs(120)).await;
        let _ = progress.await;
        let (cloud_c1, self_c1) = (cpu_ticks(new_pid)?, cpu_ticks(std::process::id())?);
        eprintln!(
            "tether-bench: scale {n}: during the reconnect: CPU of the new cloud {:.1} s, of the simulated edges {:.1} s; {} attempts, {} QUIC handshakes",
            (cloud_c1 - cloud_c0) as f64 / hz,
            (self_c1 - self_c0) as f64 / hz,
            ATTEMPTS.load(Ordering::Relaxed) - a0,
            HANDSHAKES.load(Ordering::Relaxed) - h0,
        );
        eprintln!(
            "tether-bench: scale {n}: the new cloud's TLS handshakes (full, resumed) and refusals during the reconnect: {}",
            refusals(metrics).await
        );
        let mut rows = vec![
            (
                format!("connect all {n}: first dial → last welcome (s, dials paced ≤ 1,250/s)"),
                Cell::Num(connect_all.as_secs_f64()),
            ),
            (
                "cloud RSS idle, before edges (MiB)".into(),
                Cell::Num(rss0 as f64 / 1024.0),
            ),
            (
                format!("cloud RSS with {n} idle edges (MiB)"),
                Cell::Num(rss1 as f64 / 1024.0),
            ),
            (
                "RSS per edge, 3 s after the last connected (KiB)".into(),
                Cell::Num((rss1.saturating_sub(rss0)) as f64 / n as f64),
            ),
            (
                format!(
                    "cloud RSS with {n} idle edges, steady state: after {KEEPALIVES_TO_STEADY} keep-alives each (MiB)"
                ),
                match &not_warmed {
                    None => Cell::Num(rss_steady as f64 / 1024.0),
                    Some(why) => Cell::text(why.clone()),
                },
            ),
            (
                "RSS per idle edge, steady state (KiB)".into(),
                match &not_warmed {
                    None => Cell::Num((rss_steady.saturating_sub(rss0)) as f64 / n as f64),
                    Some(why) => Cell::text(why.clone()),
                },
            ),
            (
                format!(
                    "cloud CPU, {n} idle edges (% of one core, over {} s)",
                    idle_window.as_secs()
                ),
                Cell::Num(cpu_pct),
            ),
        ];
        match back {
            Some(d) => {
                rows.push((
                    "after a cloud restart: new cloud ready → all welcomed (s)".into(),
                    Cell::Num(d.as_secs_f64()),
                ));
                rows.push((
                    "after a cloud restart: SIGTERM → all welcomed (s)".into(),
                    Cell::Num((t_ready - t_term + d).as_secs_f64()),
                ));
            }
            None => rows.push((
                "after a cloud restart: all welcomed".into(),
                Cell::text(format!(
                    "no: {} of {n} within 120 s",
                    welcomes.load(Ordering::Relaxed) - before
                )),
            )),
        }
        Ok(rows)
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in &tasks {
        t.abort();
    }
    for ep in &endpoints {
        ep.close(0u32.into(), b"bench done");
    }
    cloud.terminate(Duration::from_secs(5)).await;
    let rows = result?;
    let mut t = Table::new(&["figure", "value"], 1);
    for (k, v) in rows {
        t.row(&k, vec![v]);
    }
    r.push(&format!(
        "\n### Scale: {n} idle edges on one tether-cloud ({} build, loopback)\n\n\
         Simulated edges: real QUIC + mTLS connections, one certificate per node, the edge's hello and transport settings. \
         No peer ratio: ssh -R and rathole have no multi-tenant server in this harness.\n\n",
        if cfg!(debug_assertions) { "debug" } else { "release" }
    ));
    r.push(&t.render());
    Ok(())
}
