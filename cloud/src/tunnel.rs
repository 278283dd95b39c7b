//! The QUIC listener edges dial: authentication, hello/welcome, resume,
//! pod reports, and what happens when a connection dies.
//!
//! An edge connection is admitted only with a client certificate signed by
//! the edge CA; the node name is taken from that certificate and must equal
//! the hello's. The hello's claim (resume token, attempt order) decides by
//! the rules of [`admission`](crate::admission): it joins the node's session
//! (its streams resume), starts a new one that ends the old (the edge lost its
//! state), or is refused as superseded. The session is attached to the
//! connection only when the edge commits to it after the welcome. When a
//! connection dies its session waits `grace` for a resume, then ends.
//!
//! Every write to an edge on its control stream is bounded in time: the
//! welcome and refusals by `--handshake-timeout`, every frame after the
//! welcome (resume tickets, renewal answers, migration nudges) by
//! `--control-write-timeout` ([`ControlOut`]). An edge that grants no stream
//! credit for them is closed rather than left holding its control loop.
//!
//! Misbehaviour of one edge (bad hello, bad frames, garbage datagrams, a
//! control stream it stops reading) closes that connection only.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tether_proto::copies::CopyLink;
use tether_proto::frame::ResetCode;
use tether_proto::handshake::{
    close_code, negotiate_version, Hello, Refusal, RefusalCode, Welcome,
};
use tether_proto::io::{write_frame, FrameReader};
use tether_proto::ticket::{next_generation, unix_ms, Ticket, TicketKey};
use tether_proto::Frame;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn, Instrument};

use crate::admission::Claim;
use crate::backlog::{Backlog, Offer};
use crate::config::{CloudConfig, PodReportLimits};
use crate::gate::{Gate, Verdict};
use crate::metrics::CloudMetrics;
use crate::registry::{Admitted, Registry};
use crate::session::Session;

/// Bound on the length of one announced address (a DNS name's; the number
/// of addresses is `--max-announced-addresses`).
const MAX_ADDRESS_LEN: usize = 253;
/// Bound on pods in one report: the protocol's, which edges cut their
/// reports to.
const MAX_PODS: usize = tether_proto::limits::MAX_POD_REPORT;

/// The key of the connection-ID generator every replica shares, derived from
/// the reset key (a different HMAC input, so neither reveals the other).
pub fn cid_key(reset_key: &ring::hmac::Key) -> u64 {
    let tag = ring::hmac::sign(reset_key, b"tether connection-id generator key");
    let mut k = [0u8; 8];
    k.copy_from_slice(&tag.as_ref()[..8]);
    u64::from_le_bytes(k)
}

/// The key of `--reset-key-file` (see [`reset_key`]), if set, read once at
/// start-up: the stateless resets, the connection IDs, the TLS session
/// tickets ([`bind`]) and the resume tickets ([`serve`]) all derive their
/// keys from it.
pub fn shared_key(cfg: &CloudConfig) -> anyhow::Result<Option<Arc<ring::hmac::Key>>> {
    let Some(path) = &cfg.reset_key_file else {
        return Ok(None);
    };
    let key = reset_key(path)?;
    info!(file = %path.display(), "stateless resets with the shared key: any replica resets an edge connection it does not know");
    Ok(Some(key))
}

/// Binds the QUIC endpoint, with `shared` ([`shared_key`]) for its
/// stateless resets, connection IDs and TLS session tickets when given; its
/// socket tells `moves` of packets from sources it does not know (see
/// [`crate::migration`]).
pub fn bind(
    cfg: &CloudConfig,
    shared: Option<Arc<ring::hmac::Key>>,
    moves: &Arc<crate::migration::Watcher>,
    metrics: &CloudMetrics,
) -> anyhow::Result<quinn::Endpoint> {
    let sc = crate::tls::quic_server_config(cfg, &cfg.quic, metrics, shared.as_deref())?;
    let endpoint_config = endpoint_config(shared, cfg.reset_interval)?;
    let (socket, buffers) = tether_proto::quic::bind_udp(cfg.tunnel_listen, cfg.quic.udp_buffer)
        .with_context(|| format!("binding UDP {}", cfg.tunnel_listen))?;
    match buffers.shortfall(cfg.quic.udp_buffer) {
        Some(why) => warn!(
            listen = %cfg.tunnel_listen,
            "{why}; short of buffer, this socket drops datagrams when a fleet dials back \
             after a restart, and an edge that loses one waits out a retransmission timer \
             the storm stretched to seconds"
        ),
        None => info!(
            listen = %cfg.tunnel_listen,
            receive = buffers.receive,
            send = buffers.send,
            "tunnel UDP socket buffers"
        ),
    }
    let runtime = quinn::default_runtime().context("no async runtime for QUIC")?;
    let socket = runtime
        .wrap_udp_socket(socket)
        .with_context(|| format!("registering UDP {}", cfg.tunnel_listen))?;
    let socket = Arc::new(crate::migration::Observed::new(socket, moves.clone()));
    quinn::Endpoint::new_with_abstract_socket(endpoint_config, Some(sc), socket, runtime)
        .context("creating the QUIC endpoint")
}

/// The edge listener's endpoint settings: the stateless-reset key and the
/// connection-ID generator (shared by all replicas when `shared`, the key of
/// `--reset-key-file`, is given, else random), and the least interval between
/// two resets.
pub fn endpoint_config(
    shared: Option<Arc<ring::hmac::Key>>,
    reset_interval: Duration,
) -> anyhow::Result<quinn::EndpointConfig> {
    let mut c = match shared {
        Some(key) => {
            let cids = cid_key(&key);
            let mut c = quinn::EndpointConfig::new(key);
            c.cid_generator(move || {
                Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cids))
            });
            c
        }
        None => {
            info!("no --reset-key-file: stateless resets only come from this process; after a crash, edges notice only at their idle timeout");
            quinn::EndpointConfig::default()
        }
    };
    c.min_reset_interval(reset_interval);
    Ok(c)
}

/// Least key material a reset-key file must hold.
pub const MIN_RESET_KEY_BYTES: usize = 32;

/// The stateless-reset key from `path`, shared by every replica.
///
/// quinn derives the reset token of each connection ID it issues as
/// HMAC-SHA256(key, CID) (`quinn_proto::ResetToken::new`) and gives it to the
/// edge (transport parameters, `NEW_CONNECTION_ID`). What was checked in
/// quinn-proto 0.11 (`Endpoint::handle` / `stateless_reset`): an endpoint
/// answers a datagram with a stateless reset only when it is a
/// **short-header** packet whose destination CID (parsed at this endpoint's
/// CID length, 8 bytes by default on every replica) belongs to no connection
/// it knows; long-header packets other than Initials are dropped, and an
/// Initial with no server config is answered with a reset the client cannot
/// use yet. The reset is never larger than the inciting datagram: datagrams
/// of 21 bytes or fewer get none (an edge's keep-alive PING is larger). At
/// most one reset leaves per `min_reset_interval` per endpoint: quinn's
/// default of 20 ms (50 resets a second) would make the edges of a crashed
/// replica that held thousands wait their turn for longer than the idle
/// timeout, so it is `--reset-interval` here (1 ms by default). The edge matches the reset by its last 16 bytes against the
/// token of the CID it used, for the remote address it sent to (so the reset
/// must come back from the service address, which DNAT's reverse
/// translation ensures), and its connection fails with
/// `ConnectionError::Reset`. A replica with another key sends a reset too,
/// but with a token the edge does not know: it is ignored, and the edge
/// notices only at its idle timeout. Hence one key for all replicas.
///
/// One more condition decides it, and it is easy to miss: before resetting,
/// the endpoint asks its connection-ID generator to `validate` the CID, and
/// quinn's default generator (`HashedConnectionIdGenerator`) signs its CIDs
/// with a random key per endpoint, so a replica drops the CIDs another replica
/// issued ("dropping packet with invalid CID") and sends no reset at all. The
/// replicas therefore also share the generator's key, derived from the same
/// file by [`cid_key`].
///
/// The file's bytes, with surrounding white space removed, are the key; fewer
/// than [`MIN_RESET_KEY_BYTES`] are refused.
pub fn reset_key(path: &std::path::Path) -> anyhow::Result<Arc<ring::hmac::Key>> {
    let raw = std::fs::read(path)
        .with_context(|| format!("reading --reset-key-file {}", path.display()))?;
    let material = raw.trim_ascii();
    if material.len() < MIN_RESET_KEY_BYTES {
        anyhow::bail!(
            "--reset-key-file {}: {} bytes of key material, at least {MIN_RESET_KEY_BYTES} are needed (make one with `tether-certs reset-key --out FILE`)",
            path.display(),
            material.len()
        );
    }
    Ok(Arc::new(ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        material,
    )))
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How an admitted Initial starts its handshake.
enum Start {
    /// With this handshake slot.
    Now(
        Box<quinn::Incoming>,
        tokio::sync::OwnedSemaphorePermit,
        Live,
    ),
    /// Its source's entry in the waiting line.
    Waiting,
}

type Line = std::sync::Mutex<Backlog<quinn::Incoming>>;

fn lock(line: &Line) -> std::sync::MutexGuard<'_, Backlog<quinn::Incoming>> {
    line.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts a connection from its source while it lives (see
/// [`Backlog::is_served`]).
struct Live {
    line: Arc<Line>,
    source: std::net::SocketAddr,
}

impl Live {
    /// Counts it; the caller holds the line's lock.
    fn start(
        line: &Arc<Line>,
        b: &mut Backlog<quinn::Incoming>,
        source: std::net::SocketAddr,
    ) -> Live {
        b.started(source);
        Live {
            line: line.clone(),
            source,
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        lock(&self.line).ended(self.source);
    }
}

/// Waits in the line for a handshake slot, first come first served, until
/// the newest Initial of `source` has waited `wait`: that Initial and its
/// slot, or why it was dropped (a metrics reason).
async fn wait_in_line(
    line: &Arc<Line>,
    slots: Arc<Semaphore>,
    source: std::net::SocketAddr,
    wait: Duration,
) -> Result<(quinn::Incoming, tokio::sync::OwnedSemaphorePermit, Live), &'static str> {
    // One acquire for the whole wait keeps the entry's place in the line.
    let acquire = slots.acquire_owned();
    tokio::pin!(acquire);
    loop {
        let since = lock(line).since(source).ok_or("handshake_backlog")?;
        let deadline = tokio::time::Instant::from_std(since + wait);
        match tokio::time::timeout_at(deadline, &mut acquire).await {
            Ok(Ok(slot)) => {
                let mut b = lock(line);
                let incoming = b.take(source).ok_or("handshake_backlog")?;
                if b.is_served(source) {
                    // Another attempt of this edge got through meanwhile.
                    incoming.ignore();
                    return Err("duplicate_attempt");
                }
                let live = Live::start(line, &mut b, source);
                return Ok((incoming, slot, live));
            }
            Ok(Err(_)) => {
                // The semaphore is never closed; drop the Initial if it was.
                if let Some(i) = lock(line).take(source) {
                    i.ignore();
                }
                return Err("handshake_backlog");
            }
            Err(_) => {
                let mut b = lock(line);
                // A newer Initial of the source came meanwhile: it waits on.
                if b.since(source)
                    .is_some_and(|s| s + wait > std::time::Instant::now())
                {
                    continue;
                }
                if let Some(i) = b.take(source) {
                    i.ignore();
                }
                return Err("handshake_backlog");
            }
        }
    }
}

/// Accepts edge connections until the endpoint closes; `moves` is the
/// migration watcher the endpoint's socket reports to (see [`bind`]);
/// resume tickets are keyed from `shared` ([`shared_key`]) when given.
pub async fn serve(
    endpoint: quinn::Endpoint,
    cfg: Arc<CloudConfig>,
    registry: Arc<Registry>,
    metrics: CloudMetrics,
    draining: Arc<std::sync::atomic::AtomicBool>,
    moves: Arc<crate::migration::Watcher>,
    shared: Option<Arc<ring::hmac::Key>>,
) -> anyhow::Result<()> {
    // Shared by every edge's task (a clone of each metric handle per edge
    // would cost every connected edge a few hundred bytes).
    let metrics = Arc::new(metrics);
    let slots = Arc::new(Semaphore::new(cfg.max_edges));
    let handshakes = Arc::new(Semaphore::new(cfg.max_pending_handshakes));
    let backlog: Arc<Line> = Arc::new(std::sync::Mutex::new(Backlog::new(
        cfg.max_waiting_handshakes,
    )));
    let join = match &cfg.join {
        Some(j) => {
            let store = tether_certs::JoinStore::open(&j.store)
                .with_context(|| format!("opening the join-token store {}", j.store.display()))?
                .with_lock_wait(j.store_lock_wait);
            let read = |p: &std::path::Path| {
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
            };
            let ca = tether_certs::Ca::from_pem(&read(&j.ca_cert)?, &read(&j.ca_key)?)
                .context("loading the join CA")?;
            info!(store = %j.store.display(), "edge joins enabled");
            let store = Arc::new(store);
            Some(Arc::new(JoinCtx {
                revocations: crate::revocation::Revocations::new(store.clone()),
                store,
                ca: Arc::new(ca),
                waits: j.waits,
                max_message_bytes: j.max_message_bytes,
                validity: j.validity,
                renewal_min_interval: j.renewal_min_interval,
                renewals: std::sync::Mutex::new(RenewalLimiter::new(j.renewal_min_interval)),
            }))
        }
        None => None,
    };
    let tickets = Arc::new(match &shared {
        Some(key) => TicketKey::derive(key),
        None => {
            if cfg.peer.is_some() {
                warn!("no --reset-key-file: resume tickets are signed with a key of this replica only, so an edge can resume its streams only on the replica that issued its ticket");
            }
            TicketKey::random().context("drawing the resume-ticket key")?
        }
    });
    let mut gate = Gate::new(
        cfg.handshakes_per_source,
        cfg.max_pending_handshakes,
        cfg.handshake_rate_sources,
    );
    // One sweep notices every edge's migration (no timer per edge).
    let _sweeps = AbortOnDrop(tokio::spawn(moves.clone().run(cfg.migration_sweeps)));
    while let Some(incoming) = endpoint.accept().await {
        if draining.load(std::sync::atomic::Ordering::Relaxed) {
            // Refused at once (CONNECTION_REFUSED in the Initial's answer):
            // the edge ends its round and dials again from a new source
            // port, which the load balancer sends to a ready replica.
            debug!(remote = %incoming.remote_address(), "refusing an edge connection: this replica is draining");
            metrics.refuse_edge("draining");
            incoming.refuse();
            continue;
        }
        let remote = incoming.remote_address();
        let in_progress = cfg.max_pending_handshakes - handshakes.available_permits();
        if in_progress >= cfg.max_pending_handshakes {
            // Every slot busy: another attempt of an edge this replica is
            // already serving (connected or in handshake) is dropped before
            // it costs a Retry (see crate::backlog). One of a waiting edge
            // goes on (through a Retry) and takes its entry's place below: a
            // fresh attempt in the line instead of one the edge may give up.
            // (Dropping those too left the line serving attempts the edges
            // had abandoned: 14.1–16.5 s and ~10,800 handshakes for a storm of
            // 10,000 edges, against 13.5–14.0 s and ~10,000 now.) One that
            // got a connection after this check is dropped at its turn in
            // the line (`wait_in_line`).
            if lock(&backlog).is_served(remote) {
                metrics.refuse_edge("duplicate_attempt");
                incoming.ignore();
                continue;
            }
        }
        match gate.check(
            remote.ip(),
            incoming.remote_address_validated(),
            in_progress,
            std::time::Instant::now(),
        ) {
            Verdict::Admit => {}
            Verdict::Retry => {
                // Stateless: a spoofed source never answers it, a real edge
                // comes back validated one round trip later.
                metrics.refuse_edge("retry");
                if incoming.may_retry() {
                    let _ = incoming.retry();
                } else {
                    incoming.ignore();
                }
                continue;
            }
            Verdict::SourceLimited => {
                debug!(%remote, limit = cfg.handshakes_per_source, "dropping an edge's Initial: --handshakes-per-source reached");
                metrics.refuse_edge("source_rate");
                incoming.ignore();
                continue;
            }
        }
        // A handshake slot now, or a place in the waiting line (first come,
        // first served, one per source: see crate::backlog). quinn holds a
        // waiting Initial and buffers the edge's retransmissions of it, so
        // the slot freed by one handshake goes to the next edge at once.
        // (Dropping over the limit made each edge's QUIC back off
        // exponentially, 1 s, 2 s, 4 s…, so after a restart the cloud sat
        // idle between bursts; queueing every attempt made it serve one edge
        // several times while others timed out behind it; refusing makes
        // every edge start a new connection at once: a retry storm.)
        let start = match handshakes.clone().try_acquire_owned() {
            Ok(slot) => {
                let live = Live::start(&backlog, &mut lock(&backlog), remote);
                Start::Now(Box::new(incoming), slot, live)
            }
            Err(_) => match lock(&backlog).offer(remote, incoming, std::time::Instant::now()) {
                Offer::Queued => {
                    debug!(%remote, limit = cfg.max_pending_handshakes, "an edge's Initial waits for a handshake slot");
                    Start::Waiting
                }
                Offer::Replaced(older) => {
                    debug!(%remote, "a newer Initial of a waiting edge takes its place in the line");
                    metrics.refuse_edge("replaced_waiting");
                    older.ignore();
                    continue;
                }
                Offer::Full(incoming) => {
                    debug!(%remote, limit = cfg.max_waiting_handshakes, "dropping an edge's Initial: --max-waiting-handshakes reached");
                    metrics.refuse_edge("waiting_full");
                    incoming.ignore();
                    continue;
                }
            },
        };
        let handshakes = handshakes.clone();
        let slots = slots.clone();
        let backlog = backlog.clone();
        let cfg = cfg.clone();
        let registry = registry.clone();
        let metrics = metrics.clone();
        let join = join.clone();
        let draining = draining.clone();
        let tickets = tickets.clone();
        let moves = moves.clone();
        tokio::spawn(
            async move {
                let (incoming, pending, _live) = match start {
                    Start::Now(incoming, slot, live) => (incoming, slot, live),
                    Start::Waiting => {
                        let wait = cfg.handshake_timeout / 2;
                        match Box::pin(wait_in_line(&backlog, handshakes, remote, wait)).await {
                            Ok((incoming, slot, live)) => (Box::new(incoming), slot, live),
                            Err(reason) => {
                                debug!(%remote, limit = cfg.max_pending_handshakes, ?wait, reason, "dropping an edge's waiting Initial");
                                metrics.refuse_edge(reason);
                                return;
                            }
                        }
                    }
                };
                let Ok(permit) = slots.try_acquire_owned() else {
                    warn!(%remote, limit = cfg.max_edges, "refusing edge connection: --max-edges reached");
                    metrics.refuse_edge("max_edges");
                    incoming.refuse();
                    return;
                };
                // Its packets after the handshake, before it is watched, ask
                // for no migration sweep.
                moves.note_handshake(remote);
                // Two phases, each in a box of its own: this task (one per
                // edge, for as long as it stays connected) holds only the box
                // of the phase it is in, so the handshake's state (the hello,
                // the refusal paths) is freed once the edge is attached, and
                // the attached phase is only as large as its own state. (One
                // future for both: 2,633 bytes per connected edge, most of it
                // layout room for states the edge had left behind.)
                match Box::pin(attach(
                    incoming, pending, &cfg, &registry, &metrics, join, &draining, &tickets,
                ))
                .await
                {
                    Ok(Some(a)) => {
                        Box::pin(serve_attached(a, &cfg, &registry, &metrics, &tickets, &moves))
                            .await
                    }
                    Ok(None) => {}
                    Err(e) => warn!(error = format!("{e:#}"), "edge connection failed"),
                }
                drop(permit);
            }
            .instrument(tracing::info_span!("edge", %remote, node = tracing::field::Empty)),
        );
    }
    Ok(())
}

/// How long `leaf` was issued for (notAfter − notBefore − the backdate).
fn cert_lifetime(leaf: &rustls::pki_types::CertificateDer<'_>) -> Option<Duration> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    let v = cert.validity();
    let secs = v.not_after.timestamp()
        - v.not_before.timestamp()
        - tether_certs::mint::NOT_BEFORE_BACKDATE.as_secs() as i64;
    u64::try_from(secs).ok().map(Duration::from_secs)
}

/// Whether an edge's presented certificate, `presented` long, calls for a
/// warning: renewals are for the shorter of it and `--join-cert-validity`
/// (`validity`), and when the presented one is the shorter and so short
/// that its renewal is due again within `--renewal-min-interval`
/// ([`crate::config::renewal_shortfall`]), those renewals are refused and
/// the certificate may expire. Its lifetime and the shortfall, or `None`
/// (not shorter: the start-up warning,
/// [`JoinConfig::renewal_warning`](crate::config::JoinConfig::renewal_warning),
/// covers `validity`).
fn presented_shortfall(
    presented: Option<Duration>,
    validity: Duration,
    min_interval: Duration,
) -> Option<(Duration, crate::config::RenewalShortfall)> {
    let lifetime = presented.filter(|&l| l < validity)?;
    crate::config::renewal_shortfall(lifetime, min_interval).map(|s| (lifetime, s))
}

/// The edge's leaf certificate.
fn leaf_of(conn: &quinn::Connection) -> anyhow::Result<rustls::pki_types::CertificateDer<'static>> {
    let identity = conn
        .peer_identity()
        .context("edge presented no certificate")?;
    let chain = identity
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .map_err(|_| anyhow::anyhow!("unexpected peer identity type"))?;
    chain
        .first()
        .cloned()
        .context("edge certificate chain is empty")
}

fn node_of(conn: &quinn::Connection) -> anyhow::Result<String> {
    let leaf = leaf_of(conn)?;
    tether_certs::node_name_from_cert(&leaf)
        .context("reading the node name from the edge certificate")
}

/// Refuses an edge on its control stream. Boxed inside: [`attach`]'s
/// future stays the size of its common path, not of this rare one's.
async fn refuse(
    send: &mut quinn::SendStream,
    conn: &quinn::Connection,
    code: RefusalCode,
    message: String,
    (max, within): (usize, Duration),
) {
    Box::pin(refuse_now(send, conn, code, message, max, within)).await
}

/// Writes the refusal within `within` (`--handshake-timeout`: an edge that
/// grants no stream credit does not hold its `--max-edges` slot), then closes
/// the connection, whether the refusal left or not.
async fn refuse_now(
    send: &mut quinn::SendStream,
    conn: &quinn::Connection,
    code: RefusalCode,
    message: String,
    max: usize,
    within: Duration,
) {
    if code == RefusalCode::Superseded {
        info!(?code, ?message, "refusing an obsolete connection attempt");
    } else {
        warn!(?code, ?message, "refusing edge");
    }
    let refusal = Frame::Refused(Refusal {
        code,
        message: message.clone(),
    });
    match tokio::time::timeout(within, write_frame(send, &refusal, max)).await {
        Ok(_) => {
            let _ = send.finish();
            // Give the refusal a moment to leave before closing.
            let _ = tokio::time::timeout(Duration::from_millis(500), send.stopped()).await;
        }
        Err(_) => {
            info!(
                ?within,
                "the edge took no refusal within --handshake-timeout; closing"
            );
        }
    }
    conn.close(close_code::REFUSED.into(), message.as_bytes());
}

/// The pod reports of one connection: a token bucket over them
/// (`--pod-reports-per-sec`, `--pod-report-burst`) and their size
/// (`--max-pods-per-report`). An edge reports on change, at most once per
/// its `--pods-refresh`; far more is abuse that would re-index the registry.
struct ReportRate {
    tokens: f64,
    at: std::time::Instant,
    limits: PodReportLimits,
    /// Whether a report over `--max-pods-per-report` was warned about on
    /// this connection (the edge sends the same list again on every change).
    cut_warned: bool,
}

impl ReportRate {
    fn new(now: std::time::Instant, limits: PodReportLimits) -> Self {
        ReportRate {
            tokens: f64::from(limits.burst),
            at: now,
            limits,
            cut_warned: false,
        }
    }

    fn allow(&mut self, now: std::time::Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens =
            (self.tokens + dt * f64::from(self.limits.per_sec)).min(f64::from(self.limits.burst));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Cuts `pods` to `--max-pods-per-report`, warning once per connection.
    fn cut(&mut self, node: &str, pods: &mut Vec<tether_proto::handshake::PodRef>) {
        let max = self.limits.max_pods;
        if pods.len() <= max {
            return;
        }
        if !std::mem::replace(&mut self.cut_warned, true) {
            warn!(
                node = %node,
                pods = pods.len(),
                max_pods_per_report = max,
                "a pod report lists more pods than --max-pods-per-report: keeping the first {max} \
                 (edges sort them by namespace and name); without an apiserver the rest get 404. \
                 Warned once per connection"
            );
        } else {
            debug!(node = %node, pods = pods.len(), max_pods_per_report = max, "pod report cut");
        }
        pods.truncate(max);
    }
}

/// What joins need, loaded once.
struct JoinCtx {
    store: Arc<tether_certs::JoinStore>,
    /// The store's certificate revocations, checked at every handshake.
    revocations: crate::revocation::Revocations,
    ca: Arc<tether_certs::Ca>,
    /// Waits on a joining edge (`--join-request-timeout` and the others).
    waits: crate::join::JoinWaits,
    /// Largest join request read (`--join-max-message-bytes`).
    max_message_bytes: usize,
    validity: Duration,
    /// `--renewal-min-interval` (the limiter's; also what a presented
    /// certificate's lifetime is checked against, [`presented_shortfall`]).
    renewal_min_interval: Duration,
    /// When each node last had a certificate renewed, and what it got.
    renewals: std::sync::Mutex<RenewalLimiter>,
}

/// At most one new certificate per node per `--renewal-min-interval` (an
/// edge asks at two thirds of its certificate's life; anything more often
/// is a misbehaving, or stolen-key, edge minting certificates). A request
/// repeated within the interval for the same key is one whose answer was
/// lost (the link dropped between request and answer): it gets the
/// certificate already issued, and nothing new is minted. Bounded memory:
/// entries older than the interval are forgotten at each new certificate.
struct RenewalLimiter {
    interval: Duration,
    last: std::collections::HashMap<String, LastRenewal>,
}

/// A node's last renewal within the interval.
struct LastRenewal {
    at: std::time::Instant,
    /// The public key its CSR asked to have certified.
    key: Vec<u8>,
    /// The certificate issued for it (PEM) and its serial; `None` when
    /// signing failed.
    issued: Option<(String, String)>,
}

/// What to do with a renewal request.
#[derive(Debug, PartialEq, Eq)]
enum RenewalDecision {
    /// Sign a new certificate (counted; record it with [`RenewalLimiter::issued`]).
    Sign,
    /// The key of the last renewal, within the interval: answer with the
    /// certificate issued for it (PEM, serial).
    Repeat(String, String),
    /// Another key within the interval: refuse; the edge may ask again after this.
    TooSoon(Duration),
}

impl RenewalLimiter {
    fn new(interval: Duration) -> Self {
        RenewalLimiter {
            interval,
            last: std::collections::HashMap::new(),
        }
    }

    /// What to do with `node`'s request for `key` now; a `Sign` is counted.
    fn decide(&mut self, node: &str, key: &[u8], now: std::time::Instant) -> RenewalDecision {
        if let Some(last) = self.last.get(node) {
            let since = now.saturating_duration_since(last.at);
            if since < self.interval {
                return match &last.issued {
                    Some((pem, serial)) if last.key == key => {
                        RenewalDecision::Repeat(pem.clone(), serial.clone())
                    }
                    _ => RenewalDecision::TooSoon(self.interval - since),
                };
            }
        }
        // Only renewals within the interval are kept (each with its
        // certificate): a sweep per new certificate, which is rare.
        let interval = self.interval;
        self.last
            .retain(|_, l| now.saturating_duration_since(l.at) < interval);
        self.last.insert(
            node.to_string(),
            LastRenewal {
                at: now,
                key: key.to_vec(),
                issued: None,
            },
        );
        RenewalDecision::Sign
    }

    /// Records the certificate signed after `decide` said `Sign` for `key`.
    fn issued(&mut self, node: &str, key: &[u8], cert_pem: &str, serial: &str) {
        if let Some(last) = self.last.get_mut(node).filter(|l| l.key == key) {
            last.issued = Some((cert_pem.to_string(), serial.to_string()));
        }
    }
}

/// The answer to `node`'s renewal request `csr_pem`: a new certificate
/// valid for `valid_for`, the one already issued for the same key within
/// the interval, or the reason for a refusal. The limiter stays locked
/// while signing (rare, and under a millisecond), so two connections of
/// one node asking at once get one certificate.
fn renewal_answer(
    limiter: &std::sync::Mutex<RenewalLimiter>,
    ca: &tether_certs::Ca,
    node: &str,
    csr_pem: &str,
    valid_for: Duration,
    now: std::time::Instant,
) -> Result<String, String> {
    let key = tether_certs::csr_public_key(csr_pem).map_err(|e| {
        warn!(node, error = %e, "refusing certificate renewal");
        e.to_string()
    })?;
    let mut limiter = limiter.lock().unwrap_or_else(|p| p.into_inner());
    match limiter.decide(node, &key, now) {
        RenewalDecision::Repeat(cert_pem, serial) => {
            info!(
                node,
                %serial,
                "answering a repeated renewal request with the certificate already issued"
            );
            Ok(cert_pem)
        }
        RenewalDecision::TooSoon(wait) => {
            warn!(
                node,
                "refusing certificate renewal: renewed less than {:?} ago (--renewal-min-interval)",
                limiter.interval
            );
            Err(tether_proto::frame::renewal_too_soon(wait))
        }
        RenewalDecision::Sign => match tether_certs::sign_edge_csr(ca, csr_pem, node, valid_for) {
            Ok(issued) => {
                info!(node, serial = %issued.serial, "renewed the edge's certificate");
                limiter.issued(node, &key, &issued.cert_pem, &issued.serial);
                Ok(issued.cert_pem)
            }
            Err(e) => {
                warn!(node, error = %e, "refusing certificate renewal");
                Err(e.to_string())
            }
        },
    }
}

fn alpn_of(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?
        .downcast::<quinn::crypto::rustls::HandshakeData>()
        .ok()?
        .protocol
}

/// An edge connection attached to its session: what [`serve_attached`] needs
/// from the handshake.
struct Attached {
    conn: quinn::Connection,
    node: String,
    session: Arc<Session>,
    gen: u64,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    reader: FrameReader,
    resume: tether_proto::token::ResumeToken,
    copies: Arc<CopyLink>,
    join: Option<Arc<JoinCtx>>,
}

/// One edge connection's handshake, hello, welcome and commit, up to the
/// attach (then [`serve_attached`]): `None` when the connection was refused
/// or abandoned (said and logged here). `pending` counts it among the
/// handshakes in progress until its QUIC/TLS handshake is done.
#[allow(clippy::too_many_arguments)]
async fn attach(
    incoming: Box<quinn::Incoming>,
    pending: tokio::sync::OwnedSemaphorePermit,
    cfg: &CloudConfig,
    registry: &Arc<Registry>,
    metrics: &CloudMetrics,
    join: Option<Arc<JoinCtx>>,
    draining: &std::sync::atomic::AtomicBool,
    tickets: &Arc<TicketKey>,
) -> anyhow::Result<Option<Box<Attached>>> {
    let max = cfg.limits.max_frame_bytes as usize;
    let conn = Box::pin(tokio::time::timeout(cfg.handshake_timeout, *incoming))
        .await
        .map_err(|_| anyhow::anyhow!("no QUIC handshake within --handshake-timeout"))?
        .context("QUIC/TLS handshake")?;
    // The expensive part (TLS) is done: the next edge may start.
    drop(pending);
    if alpn_of(&conn).as_deref() == Some(tether_certs::ALPN_JOIN) {
        let Some(j) = join else {
            conn.close(close_code::REFUSED.into(), b"joins are not enabled");
            anyhow::bail!("join attempt, but joins are not enabled (--join-store)");
        };
        return Box::pin(crate::join::serve_join(
            conn,
            j.store.clone(),
            j.ca.clone(),
            j.validity,
            j.waits,
            j.max_message_bytes,
        ))
        .await
        .map(|()| None);
    }
    let handshake = async {
        let node = match node_of(&conn) {
            Ok(n) => n,
            Err(e) => {
                conn.close(
                    close_code::REFUSED.into(),
                    b"a valid edge certificate is required",
                );
                return Err(e);
            }
        };
        let leaf = leaf_of(&conn).ok();
        // A resumed TLS session names the certificate its ticket sealed,
        // perhaps days ago: it must still be valid.
        if let Some(why) = leaf.as_ref().and_then(|leaf| {
            crate::session_tickets::lapsed(leaf, crate::session_tickets::unix_now())
        }) {
            metrics.refuse_edge("certificate_lapsed");
            conn.close(close_code::REFUSED.into(), b"certificate not valid now");
            anyhow::bail!("refusing node {node}: {why}");
        }
        if let (Some(j), Some(leaf)) = (&join, leaf) {
            if let Err(why) = j.revocations.check(&leaf, &node) {
                metrics.refuse_edge("revoked");
                conn.close(close_code::REFUSED.into(), b"certificate revoked");
                anyhow::bail!("refusing node {node}: {why}");
            }
        }
        let (send, mut recv) = conn
            .accept_bi()
            .await
            .context("waiting for the control stream")?;
        let mut reader = FrameReader::new(max);
        let hello = match reader.next(&mut recv).await.context("reading the hello")? {
            Some(Frame::Hello(h)) => h,
            Some(other) => anyhow::bail!("expected a hello, got a {} frame", other.kind()),
            None => anyhow::bail!("control stream closed before the hello"),
        };
        Ok::<_, anyhow::Error>((conn, node, send, recv, reader, hello))
    };
    {
        let (conn, node, mut send, recv, reader, hello) =
            Box::pin(tokio::time::timeout(cfg.handshake_timeout, handshake))
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "no hello within --handshake-timeout ({:?})",
                        cfg.handshake_timeout
                    )
                })??;
        tracing::Span::current().record("node", node.as_str());
        let bounds = (max, cfg.handshake_timeout);
        if let Some(why) = check_hello(&hello, &node, cfg.max_announced_addresses) {
            let code = if hello.node != node {
                RefusalCode::NodeMismatch
            } else {
                RefusalCode::BadHello
            };
            refuse(
                &mut send,
                &conn,
                code,
                format!("node {node}: {why}"),
                bounds,
            )
            .await;
            return Ok(None);
        }
        let Some(version) = negotiate_version(&hello.versions) else {
            refuse(
                &mut send,
                &conn,
                RefusalCode::Version,
                format!("no common protocol version in {:?}", hello.versions),
                bounds,
            )
            .await;
            return Ok(None);
        };
        if draining.load(std::sync::atomic::Ordering::Relaxed) {
            // Its handshake began before the drain: refused all the same (the
            // edge ends its round and dials again from a new source port).
            metrics.refuse_edge("draining");
            refuse(
                &mut send,
                &conn,
                RefusalCode::Shutdown,
                format!("node {node}: this replica is draining; connect to another"),
                bounds,
            )
            .await;
            return Ok(None);
        }
        let claim = Claim::of(&hello);
        // A ticket that does not verify is refused, and the hello with it: the
        // edge's live session (wherever it is) is not touched, and the edge
        // starts over with a new state.
        let ticket = match &hello.ticket {
            Some(t) => match tickets.verify(t, &node, &hello.resume, unix_ms()) {
                Ok(()) => Some(t),
                Err(e) => {
                    metrics.refuse_edge("ticket");
                    refuse(
                        &mut send,
                        &conn,
                        RefusalCode::Ticket,
                        format!("node {node}: resume ticket refused: {e}"),
                        bounds,
                    )
                    .await;
                    return Ok(None);
                }
            },
            None => None,
        };
        let (session, resumed) = match admit(registry, cfg, &node, &hello, &claim, ticket)? {
            Ok(v) => v,
            Err((code, why)) => {
                if code == RefusalCode::Ticket {
                    metrics.refuse_edge("ticket");
                }
                refuse(
                    &mut send,
                    &conn,
                    code,
                    format!("node {node}: {why}"),
                    bounds,
                )
                .await;
                return Ok(None);
            }
        };
        // A new session expires by itself if this attempt never attaches.
        let mut unattached = Unattached {
            registry: registry.clone(),
            session: session.clone(),
            grace: cfg.grace,
            armed: !resumed,
        };
        let gen = next_generation(session.gen().max(ticket.map_or(0, |t| t.gen)), unix_ms());
        let welcome = Welcome {
            version,
            session: session.id,
            resumed,
            gen,
            ticket: issue_ticket(
                tickets,
                &session,
                gen,
                &hello,
                ticket_validity(cfg.grace, cfg.quic.idle_timeout),
            ),
            grace_ms: cfg.grace.as_millis() as u64,
            limits: cfg.limits,
        };
        // The hello's time is up: the welcome gets `--handshake-timeout` of
        // its own, so an edge that grants no stream credit does not hold its
        // `--max-edges` slot.
        match Box::pin(tokio::time::timeout(
            cfg.handshake_timeout,
            write_frame(&mut send, &Frame::Welcome(welcome), max),
        ))
        .await
        {
            Ok(r) => r.context("sending the welcome")?,
            Err(_) => {
                conn.close(close_code::REPLACED.into(), b"welcome not taken in time");
                anyhow::bail!(
                    "node {node} took no welcome within --handshake-timeout ({:?})",
                    cfg.handshake_timeout
                );
            }
        }
        debug!(node = %node, session = %session.id, resumed, attempt = claim.attempt, "welcome sent; waiting for the edge to commit");
        // Nothing is attached until the edge commits to this connection: an
        // attempt it abandoned (it took another welcome, or gave up) is dropped
        // here and leaves the session untouched.
        let mut reader = reader;
        let mut recv = recv;
        match Box::pin(tokio::time::timeout(
            cfg.handshake_timeout,
            reader.next(&mut recv),
        ))
        .await
        {
            Ok(Ok(Some(Frame::Commit { session: id }))) if id == session.id => {}
            Ok(Ok(Some(Frame::Commit { session: id }))) => {
                conn.close(close_code::PROTOCOL.into(), b"commit names another session");
                anyhow::bail!(
                    "node {node} committed to session {id}, but was welcomed into {}",
                    session.id
                );
            }
            Ok(Ok(Some(other))) => {
                conn.close(close_code::PROTOCOL.into(), b"expected a commit");
                anyhow::bail!(
                    "node {node}: expected a commit, got a {} frame",
                    other.kind()
                );
            }
            Ok(Ok(None)) | Ok(Err(_)) => {
                debug!(node = %node, attempt = claim.attempt, "the edge abandoned this attempt before committing");
                return Ok(None);
            }
            Err(_) => {
                conn.close(close_code::REPLACED.into(), b"no commit in time");
                debug!(node = %node, attempt = claim.attempt, "no commit within --handshake-timeout; dropping this attempt");
                return Ok(None);
            }
        }
        let copies = CopyLink::new(conn.clone(), cfg.quic.copies, metrics.copies.clone());
        match session.attach_connection(conn.clone(), Some(copies.clone()), &claim, gen) {
            Ok(()) => {
                unattached.disarm();
                registry.hold(&session)
            }
            Err(e) => {
                info!(node = %node, session = %session.id, attempt = claim.attempt, error = %e, "not attaching a committed connection");
                conn.close(close_code::REPLACED.into(), e.to_string().as_bytes());
                return Ok(None);
            }
        }
        info!(
            node = %node,
            session = %session.id,
            resumed,
            gen,
            attempt = claim.attempt,
            streams = session.open_streams(),
            remote = %conn.remote_address(),
            addresses = ?hello.addresses,
            "edge connected"
        );
        metrics.edges_connected.inc();
        if draining.load(std::sync::atomic::Ordering::Relaxed) {
            // Committed while the drain began (after the drain's list of edges
            // was taken): move it at once.
            info!(node = %node, "draining: telling the edge to move (it attached as the drain began)");
            conn.close(
                close_code::MOVE.into(),
                b"this replica is draining: reconnect to another",
            );
            metrics.edges_moved.inc();
        }
        // Counted only now: the edge took this welcome and committed to it.
        if resumed {
            metrics.resumes.inc();
        }
        metrics.sessions.set(registry.len() as i64);
        // Peers learn the edge is attached here (and requests waiting for it go on).
        registry.touch_node(&session.node);
        // Boxed: moved as a pointer, and no room for it in the edge's task.
        Ok(Some(Box::new(Attached {
            conn,
            node,
            session,
            gen,
            send,
            recv,
            reader,
            resume: hello.resume,
            copies,
            join,
        })))
    }
}

/// The attached edge, until its connection ends: the control stream, its
/// migrations, the copies it sends; then the session is kept for a resume
/// (or ended, when the edge shut down). `a` comes boxed: an async fn keeps
/// room for its arguments for as long as it runs, even once they are moved
/// out.
async fn serve_attached(
    a: Box<Attached>,
    cfg: &CloudConfig,
    registry: &Arc<Registry>,
    metrics: &CloudMetrics,
    tickets: &Arc<TicketKey>,
    moves: &Arc<crate::migration::Watcher>,
) {
    let Attached {
        conn,
        node,
        session,
        gen,
        send,
        recv,
        reader,
        resume,
        copies,
        join,
    } = {
        // Moved out and the box freed here, not when this function ends.
        let a = a;
        *a
    };
    let max = cfg.limits.max_frame_bytes as usize;
    // A renewal never outlives the presented certificate's own lifetime:
    // a short-lived certificate stays short-lived.
    let renew_for = join.as_ref().map(|j| {
        let presented = leaf_of(&conn).ok().and_then(|leaf| cert_lifetime(&leaf));
        // Once per connection: a lifetime so short that the edge's renewals
        // will be refused is said here, naming the node, not left to show as
        // refusals and then an expired certificate.
        if let Some((lifetime, short)) =
            presented_shortfall(presented, j.validity, j.renewal_min_interval)
        {
            warn!(
                node = %node,
                ?lifetime,
                renewal_min_interval = ?j.renewal_min_interval,
                due = ?short.due,
                least_validity = ?short.least,
                "the edge's certificate is too short-lived to renew: renewed for its own lifetime, \
                 it is due again within --renewal-min-interval, so its renewals are refused and it \
                 may expire, cutting the node off; issue it for at least least_validity"
            );
        }
        presented.map_or(j.validity, |l| l.min(j.validity))
    });
    let tickets_for_control = TicketIssuer {
        key: tickets.clone(),
        gen,
        state: resume,
        valid: ticket_validity(cfg.grace, cfg.quic.idle_timeout),
        every: ticket_refresh(cfg.grace),
    };
    // The control stream's sending side, shared with the migration watcher
    // (which answers a NAT rebinding with a frame, see `watch_migration`).
    let out = ControlOut {
        send: Arc::new(tokio::sync::Mutex::new(send)),
        max,
        within: cfg.control_write_timeout,
    };
    let edge_keeps_alive = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let control = std::pin::pin!(control_loop(
        registry.clone(),
        session.clone(),
        recv,
        reader,
        out.clone(),
        edge_keeps_alive.clone(),
        Renewal {
            join,
            renew_for,
            conn: conn.clone(),
            metrics,
        },
        tickets_for_control,
        cfg.pod_reports,
    ));
    let migrations = std::pin::pin!(watch_migration(
        moves.watch(&conn),
        conn.remote_address(),
        &node,
        metrics,
        (&out, &edge_keeps_alive),
    ));
    // Copies the edge sends, for this connection's life (a clone of the
    // session, so the session itself is free once the connection ends).
    let copy_session = session.clone();
    let copies_in = std::pin::pin!(copies.serve(move |c| copy_session.copy_from_edge(c), &node));
    tokio::select! {
        // Ends only when a nudge found the control stream stalled.
        within = migrations => {
            close_stalled(&conn, &node, within);
            conn.closed().await;
        }
        // Ends only when the connection does.
        () = copies_in => {
            debug!(node = %node, reason = ?conn.close_reason(), "edge connection closed");
        }
        r = control => {
            // A control stream that fails because the connection closed is
            // not a protocol error: keep the peer's close reason.
            if let (Err(e), None) = (r, conn.close_reason()) {
                match e.downcast_ref::<ControlWriteError>() {
                    Some(ControlWriteError::Stalled(within)) => {
                        close_stalled(&conn, &node, *within)
                    }
                    _ => {
                        warn!(node = %node, error = format!("{e:#}"), "control stream failed; closing the connection");
                        conn.close(close_code::PROTOCOL.into(), b"control stream protocol error");
                    }
                }
            }
            conn.closed().await;
        }
        reason = conn.closed() => {
            debug!(node = %node, %reason, "edge connection closed");
        }
    }
    metrics.edges_connected.dec();
    let edge_shut_down = matches!(
        conn.close_reason(),
        Some(quinn::ConnectionError::ApplicationClosed(ref c)) if c.error_code == quinn::VarInt::from_u32(close_code::SHUTDOWN)
    );
    let lost = session.connection_lost(gen);
    if edge_shut_down && lost.is_some() {
        // A clean edge shutdown: nothing will resume these streams.
        info!(node = %node, session = %session.id, "edge shut down; ending its session");
        registry.remove(&session);
        session.end(ResetCode::Shutdown, &format!("edge {node} shut down"));
        metrics.sessions.set(registry.len() as i64);
    } else if let Some(epoch) = lost {
        registry.touch_node(&session.node);
        info!(node = %node, session = %session.id, reason = %conn.close_reason().map(|r| r.to_string()).unwrap_or_default(), grace = ?cfg.grace, streams = session.open_streams(), "edge disconnected; keeping its streams for a resume");
        expire_unless_resumed(registry.clone(), session, epoch, cfg.grace);
    }
}

/// Logs each time the edge's address changes under a live connection (QUIC
/// migration: the connection and its streams carry on), as the shared sweep
/// of [`crate::migration`] notices it.
///
/// A new address is often a NAT rebinding after the edge's binding expired
/// (the edge's adaptive keep-alive probes for that): packets the cloud sent
/// meanwhile went to the dead binding and wait for QUIC's retransmission
/// timer, which has backed off for as long as the binding was dead. A frame
/// sent now on the new path is acknowledged at once, and that
/// acknowledgement makes QUIC declare the earlier packets lost and resend
/// them — a stream opened while the binding was dead starts within an RTT of
/// the edge's next keep-alive instead of at the next backed-off timer. Only
/// to edges that send keep-alive frames themselves (they know the frame).
///
/// Returns only when a nudge did not leave within `--control-write-timeout`
/// (returned; the caller closes the connection).
async fn watch_migration(
    mut watch: crate::migration::Watch,
    mut last: std::net::SocketAddr,
    node: &str,
    metrics: &CloudMetrics,
    (out, edge_keeps_alive): (&ControlOut, &std::sync::atomic::AtomicBool),
) -> Duration {
    loop {
        let now = watch.moved().await;
        if now != last {
            info!(node, from = %last, to = %now, "edge migrated to a new address");
            metrics.migrations.inc();
            last = now;
            if edge_keeps_alive.load(std::sync::atomic::Ordering::Relaxed) {
                // Boxed: only the wait for a migration stays in every edge's task.
                match Box::pin(out.send(Frame::KeepAlive)).await {
                    Ok(()) => {}
                    Err(ControlWriteError::Stalled(within)) => return within,
                    Err(e) => debug!(node, error = %e, "cannot nudge the edge after its migration"),
                }
            }
        }
    }
}

/// Why `hello` (on a connection whose certificate names `node`) is refused,
/// if it is: another node's name, more than `max_addresses` addresses
/// (`--max-announced-addresses`), an empty or overlong address, limits out
/// of bounds.
fn check_hello(hello: &Hello, node: &str, max_addresses: usize) -> Option<String> {
    if hello.node != node {
        return Some(format!(
            "hello names node {:?} but the certificate is for {node:?}",
            hello.node
        ));
    }
    if hello.addresses.len() > max_addresses {
        return Some(format!(
            "{} addresses announced, at most {max_addresses} (--max-announced-addresses)",
            hello.addresses.len()
        ));
    }
    if hello
        .addresses
        .iter()
        .any(|a| a.is_empty() || a.len() > MAX_ADDRESS_LEN)
    {
        return Some("an announced address is empty or too long".into());
    }
    if let Err(e) = hello.limits.validate() {
        return Some(format!("edge limits: {e}"));
    }
    None
}

/// Finds or creates the node's session for this hello (see
/// [`crate::admission`]): `Ok((session, resumed))`, or the refusal (an
/// attempt older than the connection attached now, a stale ticket). A new
/// session (`resumed` false) ends the node's previous ones; the caller
/// holds an [`Unattached`] until a connection is attached to it.
#[allow(clippy::type_complexity)]
fn admit(
    registry: &Arc<Registry>,
    cfg: &CloudConfig,
    node: &str,
    hello: &Hello,
    claim: &Claim,
    ticket: Option<&Ticket>,
) -> anyhow::Result<Result<(Arc<Session>, bool), (RefusalCode, String)>> {
    let admitted = registry
        .admit(
            node,
            claim,
            hello.addresses.clone(),
            ticket,
            // Made without addresses: the registry sets the hello's as it
            // installs the session, and vets them there once.
            |resume| match resume {
                Some((id, gen)) => Ok(Session::resumed(
                    node.to_string(),
                    id,
                    gen,
                    Vec::new(),
                    cfg.limits.agree(&hello.limits),
                    claim,
                )),
                None => Session::new(
                    node.to_string(),
                    Vec::new(),
                    cfg.limits.agree(&hello.limits),
                    claim,
                ),
            },
        )
        .context("generating session secrets")?;
    let end_replaced = |replaced: Vec<Arc<Session>>, new: &Arc<Session>| {
        for old in replaced {
            info!(node, old_session = %old.id, new_session = %new.id, instance = claim.instance, attempt = claim.attempt, "a session replaces the node's previous one here (the edge restarted, discarded its streams, or resumed another)");
            old.end(
                ResetCode::SessionLost,
                &format!("edge {node} started a new session (it restarted or lost its state)"),
            );
        }
    };
    match admitted {
        Admitted::Joined(s) => Ok(Ok((s, true))),
        Admitted::Superseded => Ok(Err((
            RefusalCode::Superseded,
            "a newer connection of this edge is attached".into(),
        ))),
        Admitted::StaleTicket(why) => {
            warn!(node, %why, "refusing a stale resume ticket; the live session is untouched");
            Ok(Err((
                RefusalCode::Superseded,
                format!("stale resume ticket: {why}"),
            )))
        }
        Admitted::Resumed { session, replaced } => {
            end_replaced(replaced, &session);
            info!(node, session = %session.id, owned_streams = session.open_streams(), "the edge resumes its session here with a ticket");
            Ok(Ok((session, true)))
        }
        Admitted::New { session, replaced } => {
            end_replaced(replaced, &session);
            Ok(Ok((session, false)))
        }
    }
}

/// How long a connected edge's ticket lives before it is refreshed: half the
/// grace period, between 1 s and 60 s. An edge that sends keep-alive frames
/// gets the fresh ticket in answer to its first keep-alive after that, in the
/// packet that acknowledges it: an idle edge on a metered link pays no packet
/// and no wake-up of its own for tickets (a timer every 60 s cost it about
/// 290 KiB a day, as much as its keep-alives). Other edges get one every
/// refresh period.
fn ticket_refresh(grace: Duration) -> Duration {
    (grace / 2).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// How long a ticket is valid from its issue: the grace period after the
/// next refresh would have come at the latest — the refresh period, then the
/// edge's next keep-alive, which comes within QUIC's idle timeout or the
/// connection is dead. So a ticket always outlives its connection by at
/// least the grace period.
fn ticket_validity(grace: Duration, idle_timeout: Duration) -> Duration {
    grace + ticket_refresh(grace) + idle_timeout
}

/// Whether a ticket issued at `issued` is due for a refresh at `now`.
fn ticket_due(issued: std::time::Instant, now: std::time::Instant, every: Duration) -> bool {
    now.saturating_duration_since(issued) >= every
}

/// A ticket for `session` at generation `gen`, valid for `valid` from now
/// ([`ticket_validity`]).
fn issue_ticket(
    key: &TicketKey,
    session: &Session,
    gen: u64,
    hello: &Hello,
    valid: Duration,
) -> Ticket {
    key.issue(
        &session.node,
        session.id,
        gen,
        unix_ms() + valid.as_millis() as u64,
        &hello.resume,
    )
}

/// What the control loop needs to refresh the edge's ticket.
struct TicketIssuer {
    key: Arc<TicketKey>,
    gen: u64,
    state: tether_proto::token::ResumeToken,
    /// [`ticket_validity`].
    valid: Duration,
    /// [`ticket_refresh`].
    every: Duration,
}

impl TicketIssuer {
    fn next(&self, session: &Session) -> Ticket {
        self.key.issue(
            &session.node,
            session.id,
            self.gen,
            unix_ms() + self.valid.as_millis() as u64,
            &self.state,
        )
    }
}

/// A new session no connection is attached to yet (`armed`; a resumed one
/// is not): when dropped armed (the attempt was refused, abandoned or failed
/// before its attach) the session expires after `grace` unless a connection
/// attached meanwhile (epoch 0: never attached). Not a timer per new
/// session: with 10,000 edges coming back after a restart, that was 10,000
/// tasks of 356 bytes sleeping for the whole grace period (5 minutes by
/// default) for nothing.
struct Unattached {
    registry: Arc<Registry>,
    session: Arc<Session>,
    grace: Duration,
    armed: bool,
}

impl Unattached {
    /// The session is attached: nothing to expire.
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Unattached {
    fn drop(&mut self) {
        // (No runtime: the process is shutting down, and the session with it.)
        if self.armed && tokio::runtime::Handle::try_current().is_ok() {
            expire_unless_resumed(self.registry.clone(), self.session.clone(), 0, self.grace);
        }
    }
}

/// Ends `session` after `grace` unless its link changed since the
/// disconnection of `epoch` (a resume here, or the edge moved elsewhere and
/// this replica relays to it).
fn expire_unless_resumed(
    registry: Arc<Registry>,
    session: Arc<Session>,
    epoch: u64,
    grace: Duration,
) {
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        if session.still_disconnected(epoch) {
            let reason = format!(
                "edge {} did not come back within the grace period ({grace:?})",
                session.node
            );
            warn!(node = %session.node, session = %session.id, "{reason}; ending its streams");
            registry.remove(&session);
            session.end(ResetCode::SessionLost, &reason);
        }
    });
}

/// What the control loop needs to answer `RenewCert`.
struct Renewal<'a> {
    join: Option<Arc<JoinCtx>>,
    /// How long a renewed certificate may live (never longer than the presented one).
    renew_for: Option<Duration>,
    /// The edge's connection: closed when its certificate turns out revoked.
    conn: quinn::Connection,
    metrics: &'a CloudMetrics,
}

/// Serves the control stream: pod reports, certificate renewals, keep-alive
/// frames in; fresh resume tickets out. Not an `async fn`: one of these runs
/// per connected edge, and an `async fn` would keep a second copy of its
/// arguments in its future.
// Clippy would turn it back into an `async fn`.
#[allow(clippy::too_many_arguments, clippy::manual_async_fn)]
fn control_loop<'a>(
    registry: Arc<Registry>,
    session: Arc<Session>,
    mut recv: quinn::RecvStream,
    mut reader: FrameReader,
    out: ControlOut,
    edge_keeps_alive: Arc<std::sync::atomic::AtomicBool>,
    renewal: Renewal<'a>,
    tickets: TicketIssuer,
    pod_reports: PodReportLimits,
) -> impl std::future::Future<Output = anyhow::Result<()>> + 'a {
    async move {
        let mut reports = ReportRate::new(std::time::Instant::now(), pod_reports);
        // The welcome's ticket was issued just before.
        let mut issued = std::time::Instant::now();
        // Only for edges that send no keep-alive frames (see `ticket_refresh`).
        let mut refresh =
            tokio::time::interval_at(tokio::time::Instant::now() + tickets.every, tickets.every);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // What the frame or the tick asks for, decided without waiting:
            // the frame is gone before anything below waits (held across an
            // await, it would be room in every connected edge's task).
            let keeps_alive = edge_keeps_alive.load(std::sync::atomic::Ordering::Relaxed);
            let then = tokio::select! {
                f = reader.next(&mut recv) => match f? {
                    Some(frame) => on_control_frame(frame, &registry, &session, &mut reports, &edge_keeps_alive)?,
                    None => return Ok(()),
                },
                _ = refresh.tick(), if !keeps_alive => Then::Ticket,
            };
            // Boxed: rare, and only the wait above stays in the loop.
            match then {
                Then::Nothing => {}
                Then::KeptAlive
                    if !ticket_due(issued, std::time::Instant::now(), tickets.every) => {}
                Then::Ticket | Then::KeptAlive => {
                    issued = std::time::Instant::now();
                    Box::pin(out.send(Frame::Ticket(tickets.next(&session)))).await?
                }
                Then::Renew(csr_pem) => {
                    if Box::pin(renew(&renewal, &session, &out, csr_pem)).await? {
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// What the control loop does after a frame or a tick.
enum Then {
    Nothing,
    /// The edge sent a keep-alive: a due ticket goes with its acknowledgement.
    KeptAlive,
    /// Send a fresh resume ticket.
    Ticket,
    /// Answer a certificate renewal (the CSR in PEM).
    Renew(String),
}

/// Handles one control-stream frame that needs no waiting; `Err` closes the
/// connection (a protocol violation or abuse).
fn on_control_frame(
    frame: Frame,
    registry: &Registry,
    session: &Arc<Session>,
    reports: &mut ReportRate,
    edge_keeps_alive: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Then> {
    match frame {
        Frame::RenewCert { csr_pem } => return Ok(Then::Renew(csr_pem)),
        Frame::PodReport(mut report) => {
            if report.pods.len() > MAX_PODS {
                anyhow::bail!(
                    "pod report of {} pods exceeds {MAX_PODS}",
                    report.pods.len()
                );
            }
            if !reports.allow(std::time::Instant::now()) {
                anyhow::bail!(
                    "pod reports faster than {}/s (burst {}; --pod-reports-per-sec, --pod-report-burst): closing the connection",
                    reports.limits.per_sec,
                    reports.limits.burst
                );
            }
            reports.cut(&session.node, &mut report.pods);
            debug!(node = %session.node, pods = report.pods.len(), "pod report");
            registry.report_pods(session, report.pods);
        }
        Frame::GoAway { reason } => {
            info!(node = %session.node, ?reason, "edge is going away")
        }
        // The edge's adaptive keep-alive: QUIC acknowledges it; the edge
        // knows the frame, so it may get one after a migration, and its
        // tickets are refreshed in answer to it.
        Frame::KeepAlive => {
            edge_keeps_alive.store(true, std::sync::atomic::Ordering::Relaxed);
            return Ok(Then::KeptAlive);
        }
        other => anyhow::bail!("unexpected {} frame on the control stream", other.kind()),
    }
    Ok(Then::Nothing)
}

/// Answers a `RenewCert`: `Ok(true)` when the presented certificate turned
/// out revoked and the connection is closed. Boxed by its caller: rare, and
/// its state would otherwise sit in every connected edge's control loop.
async fn renew(
    renewal: &Renewal<'_>,
    session: &Session,
    out: &ControlOut,
    csr_pem: String,
) -> anyhow::Result<bool> {
    if let Some(why) = renewal
        .join
        .as_ref()
        .and_then(|j| revoked(j, &renewal.conn, &session.node))
    {
        // Revoked since this connection's handshake: no new certificate,
        // and the connection ends now (its next handshake is refused too).
        warn!(node = %session.node, reason = %why, "refusing certificate renewal: the presented certificate is revoked; closing the connection");
        renewal.metrics.refuse_edge("revoked");
        let refusal = out
            .send(Frame::RenewedCert {
                result: Err(format!("certificate revoked: {why}")),
            })
            .await;
        // An edge that grants no stream credit does not stay connected.
        match refusal {
            Ok(()) => out.finish().await,
            Err(ControlWriteError::Stalled(within)) => {
                info!(node = %session.node, ?within, "the revoked edge took no refusal within --control-write-timeout; closing");
            }
            Err(ControlWriteError::Transport(_)) => {}
        }
        renewal
            .conn
            .close(close_code::REFUSED.into(), b"certificate revoked");
        return Ok(true);
    }
    // The node is the session's (from its certificate), never the CSR's say-so.
    let result = match &renewal.join {
        None => Err(
            "certificate renewal is not enabled on this cloud (--join-ca-cert/--join-ca-key)"
                .to_string(),
        ),
        Some(j) => renewal_answer(
            &j.renewals,
            &j.ca,
            &session.node,
            &csr_pem,
            renewal.renew_for.unwrap_or(j.validity),
            std::time::Instant::now(),
        ),
    };
    out.send(Frame::RenewedCert { result }).await?;
    Ok(false)
}

/// The sending side of an attached edge's control stream, shared by the
/// control loop and the migration watch: every frame written to the edge
/// after the welcome goes through [`ControlOut::send`], bounded by
/// `--control-write-timeout`.
#[derive(Clone)]
struct ControlOut {
    send: Arc<tokio::sync::Mutex<quinn::SendStream>>,
    /// The agreed frame bound (`--max-frame-bytes`).
    max: usize,
    /// `--control-write-timeout`.
    within: Duration,
}

/// Why a control frame did not reach an attached edge's control stream.
#[derive(Debug, thiserror::Error)]
enum ControlWriteError {
    /// The edge granted no stream credit (or the connection no room) for
    /// the frame within `--control-write-timeout`: the stream is stuck
    /// mid-frame, so the connection must close.
    #[error(
        "no control frame taken within --control-write-timeout ({0:?}): \
         the edge grants no stream credit on its control stream"
    )]
    Stalled(Duration),
    #[error("writing on the control stream: {0}")]
    Transport(#[from] tether_proto::io::TransportError),
}

impl ControlOut {
    /// Writes `frame`, waiting for the other writer and for the edge's
    /// stream credit at most `--control-write-timeout` in all. The frame is
    /// taken by value: a caller that boxes this holds it in the box, not
    /// across its own await.
    async fn send(&self, frame: Frame) -> Result<(), ControlWriteError> {
        let write = async {
            let mut send = self.send.lock().await;
            write_frame(&mut *send, &frame, self.max).await
        };
        match tokio::time::timeout(self.within, write).await {
            Ok(written) => Ok(written?),
            Err(_) => Err(ControlWriteError::Stalled(self.within)),
        }
    }

    /// Ends the stream after a last frame, waiting for the other writer at
    /// most `--control-write-timeout`.
    async fn finish(&self) {
        if let Ok(mut send) = tokio::time::timeout(self.within, self.send.lock()).await {
            let _ = send.finish();
        }
    }
}

/// Closes an edge connection whose control stream took no frame within
/// `--control-write-timeout` (its control loop or migration watch gave up on
/// a write); the edge reconnects and resumes its session.
fn close_stalled(conn: &quinn::Connection, node: &str, within: Duration) {
    warn!(node, ?within, "the edge took no control frame within --control-write-timeout (it grants no stream credit on its control stream); closing its connection, it reconnects and resumes its streams");
    conn.close(
        close_code::PROTOCOL.into(),
        b"control frame not taken in time",
    );
}

/// Why the certificate `conn` presented is revoked, if it is.
fn revoked(join: &JoinCtx, conn: &quinn::Connection, node: &str) -> Option<String> {
    match leaf_of(conn) {
        Ok(leaf) => join.revocations.check(&leaf, node).err(),
        Err(e) => Some(format!("{e:#}")),
    }
}

#[cfg(test)]
mod ticket_tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_ticket_outlives_its_connection_by_the_grace_period() {
        // The defaults: grace 5 min, QUIC idle timeout 150 s.
        let (grace, idle) = (Duration::from_secs(300), Duration::from_secs(150));
        let every = ticket_refresh(grace);
        assert_eq!(every, Duration::from_secs(60));
        // Issued at 0 and due at 60 s; the edge's next keep-alive, which
        // takes the fresh one, comes within the idle timeout (say at
        // 60 + 149 s) or the connection is dead. Should the link die just
        // before it, the edge still holds this ticket, which must last the
        // grace period beyond that.
        let valid = ticket_validity(grace, idle);
        assert!(valid >= every + idle + grace, "{valid:?}");
        let t0 = Instant::now();
        assert!(!ticket_due(t0, t0 + Duration::from_secs(59), every));
        assert!(ticket_due(t0, t0 + every, every));
        // A clock that went backwards is no refresh.
        assert!(!ticket_due(t0 + every, t0, every));
        // Short grace periods refresh at least every second.
        assert_eq!(
            ticket_refresh(Duration::from_millis(500)),
            Duration::from_secs(1)
        );
        assert_eq!(ticket_refresh(Duration::from_secs(3600)), every);
    }
}

#[cfg(test)]
mod renewal_tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_reset_key_file_needs_32_bytes_of_key_material() {
        use quinn::crypto::HmacKey;
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short.key");
        // 31 bytes plus a newline (white space does not count).
        std::fs::write(&short, format!("{}\n", "a".repeat(31))).unwrap();
        let e = format!("{:#}", reset_key(&short).err().unwrap());
        assert!(e.contains("short.key") && e.contains("31 bytes"), "{e}");
        let missing = format!("{:#}", reset_key(&dir.path().join("nope")).err().unwrap());
        assert!(missing.contains("nope"), "{missing}");
        // The same file makes the same key on every replica: equal tokens.
        let good = dir.path().join("reset.key");
        std::fs::write(&good, format!("{}\n", "ab".repeat(32))).unwrap();
        let (a, b) = (reset_key(&good).unwrap(), reset_key(&good).unwrap());
        let (mut ta, mut tb) = ([0u8; 32], [0u8; 32]);
        a.sign(b"cid-1234", &mut ta);
        b.sign(b"cid-1234", &mut tb);
        assert_eq!(ta, tb);
        // And the same connection-ID generator: B validates A's CIDs.
        use quinn::ConnectionIdGenerator;
        let mut gen_a = quinn_proto::HashedConnectionIdGenerator::from_key(cid_key(&a));
        let gen_b = quinn_proto::HashedConnectionIdGenerator::from_key(cid_key(&b));
        let cid = gen_a.generate_cid();
        assert!(gen_b.validate(&cid).is_ok());
        let other = quinn_proto::HashedConnectionIdGenerator::from_key(cid_key(
            &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[7u8; 32]),
        ));
        assert!(
            other.validate(&cid).is_err(),
            "another key's replica drops it"
        );
    }

    /// Sends short-header packets whose connection IDs carry the replicas'
    /// signature but belong to no connection, one every 2 ms for `n`
    /// packets (unless `!signed`: random ones), to an endpoint with
    /// `--reset-interval` `interval`; returns how many stateless resets came back.
    async fn resets_for(interval: Duration, n: usize, signed: bool) -> usize {
        use quinn::ConnectionIdGenerator;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("reset.key");
        std::fs::write(&file, "ab".repeat(32)).unwrap();
        let cfg = endpoint_config(Some(reset_key(&file).unwrap()), interval).unwrap();
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let server = sock.local_addr().unwrap();
        let _ep = quinn::Endpoint::new(cfg, None, sock, quinn::default_runtime().unwrap()).unwrap();
        let mut cids =
            quinn_proto::HashedConnectionIdGenerator::from_key(cid_key(&reset_key(&file).unwrap()));
        let client = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let got = Arc::new(AtomicUsize::new(0));
        let (c, g) = (client.clone(), got.clone());
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            while c.recv(&mut buf).await.is_ok() {
                g.fetch_add(1, Ordering::Relaxed);
            }
        });
        for i in 0..n {
            let mut pkt = vec![0x40 | (i as u8 & 0x3f)];
            if signed {
                pkt.extend_from_slice(&cids.generate_cid());
            } else {
                pkt.extend_from_slice(
                    &(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes(),
                );
            }
            pkt.extend_from_slice(&[i as u8; 40]);
            client.send_to(&pkt, server).await.unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        reader.abort();
        got.load(Ordering::Relaxed)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_reset_interval_bounds_the_rate_of_stateless_resets() {
        // quinn's default (20 ms): about one reset per 10 packets here.
        let slow = resets_for(Duration::from_millis(20), 150, true).await;
        // --reset-interval's default (1 ms): about one per packet.
        let fast = resets_for(Duration::from_millis(1), 150, true).await;
        // Connection IDs without the replicas' signature draw none at all.
        let unsigned = resets_for(Duration::from_millis(1), 50, false).await;
        eprintln!(
            "150 packets, one per ~2-3 ms: {slow} resets at 20 ms, {fast} at 1 ms; {unsigned} for unsigned CIDs"
        );
        assert_eq!(unsigned, 0);
        assert!(slow >= 1, "an unknown but well-signed CID draws a reset");
        assert!(slow <= 40, "{slow} resets at 20 ms for ~150 packets");
        assert!(
            fast >= 60 && fast >= 3 * slow,
            "{fast} resets at 1 ms vs {slow} at 20 ms"
        );
    }

    /// A new session whose attempt never attaches expires after the grace
    /// period (the guard dropped on the way out does it); one that attached
    /// (the guard disarmed) does not.
    #[tokio::test]
    async fn a_new_session_expires_only_if_its_attempt_never_attaches() {
        let claim = crate::session::testing::claim();
        let registry = Arc::new(Registry::new(Duration::from_secs(60)));
        let admit = |node: &str| match registry
            .admit(node, &claim, vec![], None, |_| {
                Session::new(node.into(), vec![], tether_proto::Limits::default(), &claim)
            })
            .unwrap()
        {
            crate::registry::Admitted::New { session, .. } => session,
            _ => panic!("expected a new session"),
        };
        let grace = Duration::from_millis(100);
        let (abandoned, attached) = (admit("a"), admit("b"));
        drop(Unattached {
            registry: registry.clone(),
            session: abandoned.clone(),
            grace,
            armed: true,
        });
        Unattached {
            registry: registry.clone(),
            session: attached.clone(),
            grace,
            armed: true,
        }
        .disarm();
        // Not at once: the grace period first.
        assert!(!abandoned.is_ended());
        tokio::time::sleep(grace * 4).await;
        assert!(abandoned.is_ended(), "the abandoned session expired");
        assert!(registry.get("a").is_none(), "and left the registry");
        assert!(!attached.is_ended(), "a disarmed guard expires nothing");
        assert!(registry.get("b").is_some());
    }

    const REPORTS: PodReportLimits = PodReportLimits {
        per_sec: 10,
        burst: 20,
        max_pods: 10_000,
    };

    #[test]
    fn pod_reports_are_rate_limited() {
        let t = Instant::now();
        let mut r = ReportRate::new(t, REPORTS);
        for _ in 0..20 {
            assert!(r.allow(t));
        }
        assert!(!r.allow(t), "the 21st report at once is refused");
        assert!(r.allow(t + Duration::from_millis(100)));
        assert!(!r.allow(t + Duration::from_millis(100)));
        // A normal edge (one report a second) is never limited.
        let mut r = ReportRate::new(t, REPORTS);
        for i in 0..100 {
            assert!(r.allow(t + Duration::from_secs(i)));
        }
        // --pod-reports-per-sec 2, --pod-report-burst 3.
        let mut r = ReportRate::new(
            t,
            PodReportLimits {
                per_sec: 2,
                burst: 3,
                ..REPORTS
            },
        );
        assert!((0..3).all(|_| r.allow(t)));
        assert!(!r.allow(t), "the 4th at once");
        assert!(!r.allow(t + Duration::from_millis(400)));
        assert!(r.allow(t + Duration::from_millis(500)));
    }

    /// `--max-pods-per-report`: a report over it keeps its first pods, and
    /// is warned about once per connection, naming the node and the flag.
    #[test]
    fn a_pod_report_over_max_pods_per_report_keeps_its_first_pods() {
        let pod = |i: usize| tether_proto::handshake::PodRef {
            namespace: "default".into(),
            name: format!("p{i:03}"),
            uid: String::new(),
        };
        let mut r = ReportRate::new(
            Instant::now(),
            PodReportLimits {
                max_pods: 100,
                ..REPORTS
            },
        );
        let mut at = (0..100).map(pod).collect::<Vec<_>>();
        let ((), warnings) = crate::testlog::warnings(|| r.cut("edge-1", &mut at));
        assert_eq!((at.len(), warnings.len()), (100, 0));
        let mut all = Vec::new();
        for _ in 0..3 {
            let mut over = (0..250).map(pod).collect::<Vec<_>>();
            let ((), w) = crate::testlog::warnings(|| r.cut("edge-1", &mut over));
            assert_eq!(over, (0..100).map(pod).collect::<Vec<_>>());
            all.extend(w);
        }
        assert_eq!(all.len(), 1, "{all:?}");
        assert!(
            all[0].contains("node=edge-1") && all[0].contains("--max-pods-per-report"),
            "{all:?}"
        );
    }

    #[test]
    fn a_renewal_never_outlives_the_presented_certificate() {
        let ca = tether_certs::Ca::new("ca", Duration::from_secs(86400)).unwrap();
        let short = ca.issue_edge("edge-1", Duration::from_secs(3600)).unwrap();
        let leaf = tether_certs::pem::certs_from_pem(&short.cert_pem, "c")
            .unwrap()
            .remove(0);
        let life = cert_lifetime(&leaf).unwrap();
        assert!(
            (3599..=3601).contains(&life.as_secs()),
            "{life:?}: the issued lifetime, backdate excluded"
        );
        // The renewal's validity is the shorter of the two.
        let renew_for = life.min(Duration::from_secs(720 * 3600));
        let csr = tether_certs::make_edge_csr("edge-1").unwrap();
        let issued = tether_certs::sign_edge_csr(&ca, &csr.csr_pem, "edge-1", renew_for).unwrap();
        let renewed = tether_certs::pem::certs_from_pem(&issued.cert_pem, "c")
            .unwrap()
            .remove(0);
        assert!(cert_lifetime(&renewed).unwrap() <= life + Duration::from_secs(1));
    }

    /// The per-connection warning's decision: a presented certificate
    /// shorter than `--join-cert-validity` whose renewal (for its own
    /// lifetime) is due again within `--renewal-min-interval` is warned
    /// about, with its lifetime and the least validity that is renewable;
    /// a renewable one is not, nor one not shorter than the validity (the
    /// start-up warning's), nor one whose lifetime is unknown.
    #[test]
    fn a_presented_certificate_too_short_lived_to_renew_calls_for_a_warning() {
        let s = Duration::from_secs;
        let month = s(720 * 3600);
        let ca = tether_certs::Ca::new("ca", s(86400)).unwrap();
        let hour = ca.issue_edge("edge-1", s(3600)).unwrap();
        let leaf = tether_certs::pem::certs_from_pem(&hour.cert_pem, "c")
            .unwrap()
            .remove(0);
        let presented = cert_lifetime(&leaf);
        let (lifetime, short) = presented_shortfall(presented, month, s(3600)).unwrap();
        assert!((3599..=3601).contains(&lifetime.as_secs()), "{lifetime:?}");
        assert!(short.due < s(3600), "{short:?}");
        assert_eq!(short.least, s(5550), "{short:?}");
        // Renewable within the default interval, or a longer one.
        assert_eq!(presented_shortfall(presented, month, s(600)), None);
        assert_eq!(presented_shortfall(Some(s(7200)), month, s(3600)), None);
        // Not shorter than --join-cert-validity, or unknown.
        assert_eq!(presented_shortfall(Some(s(3600)), s(3600), s(3600)), None);
        assert_eq!(presented_shortfall(Some(s(7200)), s(1000), s(3600)), None);
        assert_eq!(presented_shortfall(None, month, s(3600)), None);
    }

    /// `--renewal-min-interval` (was a fixed 600 s), set to 90 s: one new
    /// certificate per node within it; the same key asking again within it
    /// (its answer was lost) gets that certificate again, another key is
    /// refused; after it, a new certificate. Other nodes are not affected.
    #[test]
    fn a_node_gets_one_certificate_per_interval_and_its_repeats_get_it_again() {
        let interval = crate::config::test_config(&[
            "--join-store=s.json",
            "--join-ca-cert=ca.crt",
            "--join-ca-key=ca.key",
            "--renewal-min-interval=90s",
        ])
        .unwrap()
        .join
        .unwrap()
        .renewal_min_interval;
        assert_eq!(interval, Duration::from_secs(90));
        let limiter = std::sync::Mutex::new(RenewalLimiter::new(interval));
        let ca = tether_certs::Ca::new("renewal CA", Duration::from_secs(86400)).unwrap();
        let day = Duration::from_secs(86400);
        let t = Instant::now();
        let answer = |csr: &str, node: &str, after: u64| {
            renewal_answer(
                &limiter,
                &ca,
                node,
                csr,
                day,
                t + Duration::from_secs(after),
            )
        };
        let (req, other) = (
            tether_certs::make_edge_csr("edge-1").unwrap(),
            tether_certs::make_edge_csr("edge-1").unwrap(),
        );
        let first = answer(&req.csr_pem, "edge-1", 0).unwrap();
        let leaf = tether_certs::pem::certs_from_pem(&first, "c")
            .unwrap()
            .remove(0);
        assert!(tether_certs::certifies_key(&leaf, &req.public_key));
        // The same key within the interval: the same certificate, to the end.
        assert_eq!(answer(&req.csr_pem, "edge-1", 1).unwrap(), first);
        assert_eq!(answer(&req.csr_pem, "edge-1", 89).unwrap(), first);
        // Another key within it: refused, with the time left.
        let e = answer(&other.csr_pem, "edge-1", 30).unwrap_err();
        assert_eq!(e, "renewed too recently; try again in 60s");
        // A fraction of a second left counts as a whole one.
        let e = renewal_answer(
            &limiter,
            &ca,
            "edge-1",
            &other.csr_pem,
            day,
            t + Duration::from_millis(89_500),
        )
        .unwrap_err();
        assert_eq!(e, "renewed too recently; try again in 1s");
        // Other nodes are not affected.
        let req2 = tether_certs::make_edge_csr("edge-2").unwrap();
        assert!(answer(&req2.csr_pem, "edge-2", 1).is_ok());
        // After the interval, a new certificate, even for the same key.
        let later = answer(&req.csr_pem, "edge-1", 90).unwrap();
        assert_ne!(later, first);
        // Nonsense is refused without counting.
        assert!(answer("not a csr", "edge-3", 0).is_err());
        assert!(answer(
            &tether_certs::make_edge_csr("edge-3").unwrap().csr_pem,
            "edge-3",
            0
        )
        .is_ok());
    }

    #[test]
    fn a_failed_signing_counts_and_answers_no_repeat() {
        let mut l = RenewalLimiter::new(Duration::from_secs(600));
        let t = Instant::now();
        assert_eq!(l.decide("edge-1", b"k1", t), RenewalDecision::Sign);
        // Nothing recorded (the signing failed): the same key is refused,
        // as is another one.
        assert_eq!(
            l.decide("edge-1", b"k1", t + Duration::from_secs(1)),
            RenewalDecision::TooSoon(Duration::from_secs(599))
        );
        l.issued("edge-1", b"k2", "pem", "01");
        assert_eq!(
            l.decide("edge-1", b"k2", t + Duration::from_secs(1)),
            RenewalDecision::TooSoon(Duration::from_secs(599))
        );
    }

    /// The table holds only renewals within the interval, each with its
    /// certificate: older ones go at the next new certificate.
    #[test]
    fn only_renewals_within_the_interval_are_remembered() {
        let mut l = RenewalLimiter::new(Duration::from_secs(600));
        let t = Instant::now();
        for (i, node) in ["edge-1", "edge-2", "edge-3"].into_iter().enumerate() {
            let at = t + Duration::from_secs(i as u64 * 300);
            assert_eq!(l.decide(node, b"k", at), RenewalDecision::Sign);
            l.issued(node, b"k", "pem", "01");
        }
        // At 600 s edge-1's entry (0 s) is gone; edge-2's (300 s) is not.
        assert_eq!(l.last.len(), 2);
        assert!(!l.last.contains_key("edge-1"));
        assert_eq!(
            l.decide("edge-4", b"k", t + Duration::from_secs(1200)),
            RenewalDecision::Sign
        );
        assert_eq!(l.last.len(), 1);
    }
}

#[cfg(test)]
mod hello_tests {
    use super::*;

    fn hello_announcing(n: usize) -> Hello {
        Hello {
            versions: vec![tether_proto::handshake::PROTOCOL_VERSION],
            node: "edge-1".into(),
            addresses: (0..n).map(|i| format!("10.0.0.{i}")).collect(),
            resume: tether_proto::token::ResumeToken([1; 16]),
            instance: 1,
            attempt: 1,
            limits: tether_proto::Limits::default(),
            ticket: None,
        }
    }

    /// `--max-announced-addresses`: a hello at the bound passes; one more
    /// address is refused with a reason naming the bound and the flag.
    #[test]
    fn a_hello_announces_at_most_max_announced_addresses() {
        assert_eq!(check_hello(&hello_announcing(3), "edge-1", 3), None);
        let why = check_hello(&hello_announcing(4), "edge-1", 3).expect("refused");
        assert_eq!(
            why,
            "4 addresses announced, at most 3 (--max-announced-addresses)"
        );
        // The default still takes what an edge announces at most.
        assert_eq!(check_hello(&hello_announcing(64), "edge-1", 64), None);
    }
}

#[cfg(test)]
mod admit_tests {
    use super::*;
    use crate::authority::Authority;
    use crate::metrics::KindLabel;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use tether_proto::token::SessionId;

    /// A hello of edge-b announcing its own address and edge-a's (the
    /// apiserver gives 10.0.0.1 to edge-a): one refused address.
    fn hello(attempt: u64, ticket: Option<Ticket>) -> Hello {
        Hello {
            versions: vec![tether_proto::handshake::PROTOCOL_VERSION],
            node: "edge-b".into(),
            addresses: vec!["10.0.0.2".into(), "10.0.0.1".into()],
            resume: tether_proto::token::ResumeToken([1; 16]),
            instance: 1,
            attempt,
            limits: tether_proto::Limits::default(),
            ticket,
        }
    }

    fn ticket(session: u64, gen: u64) -> Ticket {
        Ticket {
            node: "edge-b".into(),
            session: SessionId(session),
            gen,
            expires_ms: u64::MAX,
            mac: [0; 32],
        }
    }

    /// A registry that has the apiserver's word on both nodes' addresses,
    /// and the counter its refused claims go to.
    fn registry() -> (Arc<Registry>, Family<KindLabel, Counter>) {
        let auth = Arc::new(Authority::new());
        auth.set_node("edge-a", Some(vec!["10.0.0.1".into()]));
        auth.set_node("edge-b", Some(vec!["10.0.0.2".into()]));
        let refused = Family::default();
        let r = Registry::with_authority(Duration::from_secs(60), Some(auth), refused.clone());
        (Arc::new(r), refused)
    }

    fn counted(refused: &Family<KindLabel, Counter>) -> u64 {
        refused.get_or_create(&KindLabel { kind: "address" }).get()
    }

    /// One hello through `admit`: whether it resumed, and how many refused
    /// addresses it added to the counter.
    fn admit_one(
        r: &Arc<Registry>,
        refused: &Family<KindLabel, Counter>,
        hello: &Hello,
    ) -> (bool, u64) {
        let cfg = crate::config::test_config(&[]).unwrap();
        let before = counted(refused);
        let claim = Claim::of(hello);
        let (session, resumed) = admit(r, &cfg, "edge-b", hello, &claim, hello.ticket.as_ref())
            .unwrap()
            .unwrap_or_else(|(_, why)| panic!("refused: {why}"));
        // The refused address is not indexed; the edge's own is.
        assert_eq!(session.addresses(), hello.addresses);
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.2")).unwrap().node,
            "edge-b"
        );
        assert!(r.route_node(None, None, Some("10.0.0.1")).is_err());
        (resumed, counted(refused) - before)
    }

    /// A hello announcing another node's address has it refused and counted
    /// once, whichever way it is admitted. Before, a resume with a ticket
    /// was counted twice: the session was installed with the hello's
    /// addresses (vetted), then given them again (vetted again); and a
    /// session resumed here that had been held here before counted its old
    /// hello's addresses again besides.
    #[tokio::test]
    async fn a_hellos_refused_address_is_counted_once_on_every_path() {
        // A new session, then a later attempt of the same state joining it.
        let (r, refused) = registry();
        assert_eq!(admit_one(&r, &refused, &hello(1, None)), (false, 1));
        assert_eq!(admit_one(&r, &refused, &hello(2, None)), (true, 1));

        // A ticket resumes on a replica that never had the session.
        let (r, refused) = registry();
        assert_eq!(
            admit_one(&r, &refused, &hello(1, Some(ticket(7, 100)))),
            (true, 1)
        );

        // A session held here (its hello counted once), then taken over by
        // replica b (a newer generation there: only owned here now), then
        // resumed here again with a ticket.
        let (r, refused) = registry();
        let cfg = crate::config::test_config(&[]).unwrap();
        let first = hello(1, None);
        let s = Session::resumed(
            "edge-b".into(),
            SessionId(7),
            0,
            first.addresses.clone(),
            cfg.limits.agree(&first.limits),
            &Claim::of(&first),
        );
        r.insert(s.clone());
        assert_eq!(counted(&refused), 1);
        let (c1, _s1, _e1) = tether_proto::testing::quic_pair().await.unwrap();
        let peer = crate::peer::PeerLink::for_test("b", c1);
        let record = crate::routes::EdgeRecord {
            node: "edge-b".into(),
            session: format!("{:016x}", 7),
            attached: true,
            since_ms: 100,
            sid: 7,
            gen: 100,
            limits: tether_proto::Limits::default(),
            pods: vec![],
            addresses: vec![],
        };
        r.apply_remote(&peer, crate::routes::Update::Upsert(vec![record]));
        assert!(r.get("edge-b").is_none() && s.relayed_via().is_some());
        assert_eq!(
            admit_one(&r, &refused, &hello(2, Some(ticket(7, 100)))),
            (true, 1)
        );
        assert!(Arc::ptr_eq(&r.get("edge-b").unwrap(), &s));
    }
}
