//! The logical streams of the edge's session, which survive reconnections.
//!
//! The replica that owns a logical stream (the one the apiserver's connection
//! arrived on) opens a QUIC stream for it — on this edge's connection, or
//! spliced through the replica this edge is connected to — and sends `Attach`
//! first. [`EdgeStreams::accept`] reads it and either re-attaches a stream
//! this edge already holds (a resume: both ends replay from each other's
//! delivered offset), starts a new one (a new id, nothing delivered yet), or
//! answers with a reset when the stream is unknown (this edge restarted, or
//! the stream already ended).
//!
//! No replica knows every stream of the session (each owns its own), so a
//! welcome does not list them. Instead a stream whose transport broke is
//! ended when no owner re-attaches it within the grace period, and at once
//! when the replica splicing it says its owner is gone
//! ([`stream_code::OWNER_GONE`]): no slot outlives its owner. A stream that
//! was done when its transport broke waits the grace period too (its owner
//! may still need the final ack), then is forgotten without a reset.
//!
//! A transport's failure acts only on the attach it carried: when the owner
//! has re-attached the stream meanwhile (a relay splice broke and the owner
//! moved the stream to a new one in the same flight), the old transport's
//! failure neither arms the grace timer nor ends the stream. A stream has at
//! most one grace timer, however often it detaches: a detach moves the
//! deadline and the timer sleeps on to the latest. Each acts on its own
//! stream only: once a session is lost the next one's ids start over, so a
//! late failure, end or timer of the old session's stream may find its id
//! naming the new session's.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use tether_proto::copies::CopySink;
use tether_proto::frame::ResetCode;
use tether_proto::handshake::stream_code;
use tether_proto::io::{drive, write_frame, FrameReader, PeerAttach, ResumableIo, SharedStream};
use tether_proto::stream::{StreamLimits, StreamState};
use tether_proto::{Frame, Limits, StreamId};
use tracing::{debug, info, warn, Instrument};

use crate::forward::Forward;

/// A live stream and the task currently driving it over a transport.
struct Live {
    shared: Arc<SharedStream>,
    driver: Option<tokio::task::AbortHandle>,
    /// Counts the transports attached so far: a transport's failure acts on
    /// the stream only while its attach is still the latest.
    attaches: u64,
    /// While detached: when the stream is ended unless re-attached, a grace
    /// period after its latest detach. A re-attach clears it.
    expires: Option<Instant>,
    /// Whether the stream's grace timer (one task at most) is running: a
    /// detach while it runs only moves `expires`, and the timer sleeps on.
    timer: bool,
}

#[derive(Default)]
struct Table {
    live: HashMap<StreamId, Live>,
    /// Ids of streams that ended this session, so a late re-attach of one
    /// (say, by a replica that did not see it end) is refused rather than
    /// mistaken for a new stream: that would replay its request against the
    /// kubelet, running an `exec` twice. The newest
    /// `--ended-streams-remembered` are kept, oldest forgotten first.
    ended: HashSet<StreamId>,
    ended_order: VecDeque<StreamId>,
}

impl Table {
    /// Ends live stream `id` at once: aborts its driver and ends it
    /// ([`Table::end`]). Returns the stream, to reset outside the lock.
    fn end_live(&mut self, id: StreamId, remember: usize) -> Option<Arc<SharedStream>> {
        let mut live = self.live.remove(&id)?;
        if let Some(d) = live.driver.take() {
            d.abort();
        }
        self.end(id, remember);
        Some(live.shared)
    }

    /// Ends `id`, remembering at most `remember` ended ids.
    fn end(&mut self, id: StreamId, remember: usize) {
        self.live.remove(&id);
        if self.ended.insert(id) {
            self.ended_order.push_back(id);
            if self.ended_order.len() > remember {
                if let Some(old) = self.ended_order.pop_front() {
                    self.ended.remove(&old);
                }
            }
        }
    }
}

/// The streams of the current session.
pub struct EdgeStreams {
    streams: Mutex<Table>,
    /// How long a detached stream waits for its owner, ms.
    grace_ms: std::sync::atomic::AtomicU64,
    /// Our limits, agreed with the cloud's once welcomed ([`Limits::agree`]):
    /// new streams' frames, buffers and heads (handed to the forwarder).
    limits: Mutex<Limits>,
    forward: Arc<Forward>,
    /// Ended stream ids remembered (`--ended-streams-remembered`).
    remember_ended: usize,
    node: String,
    metrics: crate::metrics::EdgeMetrics,
}

impl EdgeStreams {
    /// The stream table of `node`, remembering `remember_ended` ended ids.
    pub fn new(
        node: String,
        limits: Limits,
        forward: Arc<Forward>,
        remember_ended: usize,
        metrics: crate::metrics::EdgeMetrics,
    ) -> Arc<Self> {
        Arc::new(EdgeStreams {
            streams: Mutex::new(Table::default()),
            grace_ms: std::sync::atomic::AtomicU64::new(300_000),
            limits: Mutex::new(limits),
            forward,
            remember_ended,
            node,
            metrics,
        })
    }

    fn map(&self) -> std::sync::MutexGuard<'_, Table> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.map().live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every stream (the session is gone): resets them with `reason`.
    pub fn end_all(&self, reason: &str) {
        let all: Vec<_> = {
            let mut t = self.map();
            let all = t.live.drain().map(|(_, l)| l.shared).collect();
            *t = Table::default();
            all
        };
        if !all.is_empty() {
            warn!(node = %self.node, streams = all.len(), %reason, "ending streams");
        }
        for s in all {
            s.reset(ResetCode::SessionLost, reason);
        }
    }

    /// A new session began (welcomed by a cloud that did not resume ours:
    /// another replica, or a restarted cloud): its stream ids start over, so
    /// forget which ids of the old session ended, or the new session's
    /// first streams would be refused as "ended".
    pub fn new_session(&self) {
        let mut t = self.map();
        t.ended.clear();
        t.ended_order.clear();
    }

    /// The wire bounds new transports use.
    fn limits(&self) -> Limits {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The wire bounds agreed with the cloud's (ours and the welcome's,
    /// [`Limits::agree`]): frames, payloads and heads this edge sends are
    /// ones the cloud accepts.
    pub fn set_agreed_limits(&self, agreed: Limits) {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner()) = agreed;
    }

    /// Sets how long a detached stream waits for its owner (the welcome's
    /// grace period).
    pub fn set_grace(&self, grace: Duration) {
        self.grace_ms.store(
            grace.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Resets `shared`, stream `id`, which was just ended, with `why`.
    fn reset_ended(&self, id: StreamId, shared: Arc<SharedStream>, code: ResetCode, why: String) {
        info!(node = %self.node, stream = %format_args!("{id:x}"), %why, "ending the stream");
        shared.reset(code, why);
        self.metrics.streams_open.set(self.len() as i64);
    }

    /// After the transport of attach number `attach` of `shared` (stream
    /// `id`) broke: ends the stream if no owner re-attaches it within the
    /// grace period. Nothing to do if another attach (or, the session lost
    /// and the id reused, another stream) holds `id` now.
    fn expire_detached(self: &Arc<Self>, id: StreamId, shared: &Arc<SharedStream>, attach: u64) {
        let grace = Duration::from_millis(self.grace_ms.load(std::sync::atomic::Ordering::Relaxed));
        let deadline = Instant::now() + grace;
        {
            let mut t = self.map();
            let Some(live) = t.live.get_mut(&id) else {
                return;
            };
            if !Arc::ptr_eq(&live.shared, shared) || live.attaches != attach {
                return;
            }
            live.expires = Some(deadline);
            if std::mem::replace(&mut live.timer, true) {
                // Its running timer finds the new deadline and sleeps on.
                return;
            }
        }
        let timer = self
            .clone()
            .grace_timer(id, Arc::downgrade(shared), deadline, grace);
        tokio::spawn(timer);
    }

    /// The one grace timer of `stream` (id `id`): sleeps until `deadline`,
    /// then on to the stream's latest deadline while a detach moved it, and
    /// ends the stream if it is still detached: reset, or, done already,
    /// only forgotten (remembered as ended). Stops when the stream was
    /// re-attached, ended, or `id` is now another stream's.
    async fn grace_timer(
        self: Arc<Self>,
        id: StreamId,
        stream: Weak<SharedStream>,
        mut deadline: Instant,
        grace: Duration,
    ) {
        loop {
            tokio::time::sleep_until(deadline).await;
            let ended = {
                let mut t = self.map();
                let Some(live) = t.live.get_mut(&id) else {
                    return;
                };
                if !std::ptr::eq(Arc::as_ptr(&live.shared), stream.as_ptr()) {
                    return;
                }
                match live.expires {
                    Some(later) if later > deadline => {
                        deadline = later;
                        continue;
                    }
                    Some(_) => {
                        // A done stream (nothing left to deliver) waited only
                        // for an owner that may still need the final ack: it
                        // leaves the table too, or its slot counted against
                        // --max-streams-per-edge for the rest of the session.
                        let done = live.shared.is_done();
                        t.end_live(id, self.remember_ended).map(|s| (s, done))
                    }
                    // Re-attached.
                    None => {
                        live.timer = false;
                        return;
                    }
                }
            };
            match ended {
                Some((_, true)) => {
                    debug!(node = %self.node, stream = id, "a done stream no cloud replica re-attached within the grace period; forgetting it");
                    self.metrics.streams_open.set(self.len() as i64);
                }
                Some((shared, false)) => {
                    let why = format!(
                        "no cloud replica re-attached stream {id:x} of edge {} within the grace period ({grace:?})",
                        self.node
                    );
                    self.reset_ended(id, shared, ResetCode::SessionLost, why);
                }
                None => {}
            }
            return;
        }
    }

    /// The open stream `id`, for a datagram copy of its bytes.
    pub fn stream(&self, id: StreamId) -> Option<Arc<SharedStream>> {
        self.map().live.get(&id).map(|l| l.shared.clone())
    }

    /// Takes a QUIC stream the cloud opened: a new logical stream or a
    /// re-attach of one held here. `copies` is the connection's datagram
    /// copy path, if it has one.
    pub async fn accept(
        self: Arc<Self>,
        send: quinn::SendStream,
        mut recv: quinn::RecvStream,
        copies: Option<Arc<dyn CopySink>>,
    ) {
        let limits = self.limits();
        let max = limits.max_frame_bytes as usize;
        let mut reader = FrameReader::new(max);
        // The attach comes first on every stream the cloud opens (the
        // request head right behind it): bounded like the head.
        let wait = self.forward.head_timeout;
        let first = tokio::time::timeout(wait, reader.next(&mut recv)).await;
        let (id, delivered, fin_received) = match first {
            Ok(Ok(Some(Frame::Attach {
                stream,
                delivered,
                fin_received,
            }))) => (stream, delivered, fin_received),
            Ok(Ok(Some(other))) => {
                warn!(node = %self.node, frame = other.kind(), "stream did not start with attach; dropping it");
                return;
            }
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                warn!(node = %self.node, error = %e, "bad first frame on a stream");
                return;
            }
            Err(_) => {
                warn!(node = %self.node, ?wait, "no attach within --request-head-timeout; dropping the stream");
                return;
            }
        };
        // Known: a resume. Unknown, never ended and nothing delivered: new.
        // Otherwise the cloud re-attaches a stream this edge no longer holds.
        // Looked up and, if new, taken under one lock: two attaches of one
        // new id racing on two threads make one stream, the later attach a
        // re-attach of it, not two forwarders (the request run twice against
        // the kubelet) with the first stream's entry overwritten.
        let found = {
            let mut t = self.map();
            let held = t.live.len();
            match t.live.get(&id) {
                Some(live) => Found::Held(live.shared.clone()),
                None if delivered != 0 || fin_received || t.ended.contains(&id) => Found::Unknown,
                // Detached streams count too: they hold their slot until
                // re-attached or expired, and QUIC's stream credit (the
                // other bound) does not see them.
                None if held >= limits.max_streams_per_edge as usize => Found::Full(held),
                None => {
                    let shared =
                        SharedStream::new(StreamState::new(id, StreamLimits::from(&limits)));
                    t.live.insert(
                        id,
                        Live {
                            shared: shared.clone(),
                            driver: None,
                            attaches: 0,
                            expires: None,
                            timer: false,
                        },
                    );
                    Found::New(shared)
                }
            }
        };
        let shared = match found {
            Found::Held(s) => {
                debug!(node = %self.node, stream = id, delivered, "re-attaching stream");
                s
            }
            Found::New(shared) => {
                let io = ResumableIo::new(shared.clone()).with_counters(self.metrics.bytes.clone());
                self.metrics.streams_total.inc();
                self.metrics.streams_open.set(self.len() as i64);
                let span = tracing::info_span!("stream", node = %self.node, stream = id);
                // The forwarder reads and writes heads within the agreed
                // bounds too, not the edge's own.
                tokio::spawn(self.forward.clone().run(io, limits).instrument(span));
                shared
            }
            Found::Full(held) => {
                warn!(node = %self.node, stream = id, held, max = limits.max_streams_per_edge, "refusing a new stream: the edge holds --max-streams-per-edge streams (open or waiting for a re-attach)");
                let why = format!(
                    "edge {} holds {held} streams, its --max-streams-per-edge ({})",
                    self.node, limits.max_streams_per_edge
                );
                refuse(send, id, ResetCode::LimitExceeded, why, max).await;
                return;
            }
            Found::Unknown => {
                info!(node = %self.node, stream = id, "cloud re-attached a stream this edge does not hold; resetting it");
                let why = format!(
                    "edge {} does not hold stream {id} (it restarted or the stream ended)",
                    self.node
                );
                refuse(send, id, ResetCode::UnknownStream, why, max).await;
                return;
            }
        };
        let peer = PeerAttach::Known {
            delivered,
            fin_received,
        };
        // Frames the reader already buffered past the attach are replayed by
        // chaining its buffer in front of the QUIC stream.
        let recv = reader.into_prefixed(recv);
        // One driver per stream: a re-attach replaces (aborts) a driver still
        // blocked on the dead connection. Checked, counted and spawned under
        // one lock, so a stream ended since the lookup gets no driver and its
        // owner is answered with a reset.
        let attached = {
            let mut t = self.map();
            match t.live.get_mut(&id) {
                Some(live) if Arc::ptr_eq(&live.shared, &shared) => {
                    live.attaches += 1;
                    live.expires = None;
                    let task = tokio::spawn(drive(shared.clone(), recv, send, peer, max, copies));
                    if let Some(old) = live.driver.replace(task.abort_handle()) {
                        old.abort();
                    }
                    // This transport's attach number: its failure acts on
                    // the stream only while no newer attach took it over.
                    Ok((task, live.attaches))
                }
                // Ended meanwhile (session reset, grace passed, owner gone;
                // its id may be a new session's stream by now).
                _ => Err(send),
            }
        };
        let (task, attach) = match attached {
            Ok(a) => a,
            Err(send) => {
                info!(node = %self.node, stream = id, "the stream ended while the cloud attached it; resetting it");
                let why = format!(
                    "edge {} does not hold stream {id} (it ended while the cloud attached it)",
                    self.node
                );
                refuse(send, id, ResetCode::UnknownStream, why, max).await;
                return;
            }
        };
        let result = match task.await {
            Ok(r) => r,
            Err(_) => return, // replaced by a newer attach
        };
        match result {
            Ok(()) => {
                {
                    // Unless the session was lost meanwhile: its id may be
                    // a new session's stream's by now.
                    let mut t = self.map();
                    if t.live
                        .get(&id)
                        .is_some_and(|l| Arc::ptr_eq(&l.shared, &shared))
                    {
                        t.end(id, self.remember_ended);
                    }
                }
                self.metrics.streams_open.set(self.len() as i64);
                debug!(node = %self.node, stream = id, "stream done");
            }
            Err(e) if owner_gone(&e) => {
                let ended = {
                    let mut t = self.map();
                    let ours = t
                        .live
                        .get(&id)
                        .is_some_and(|l| Arc::ptr_eq(&l.shared, &shared) && l.attaches == attach);
                    if ours {
                        t.end_live(id, self.remember_ended)
                    } else {
                        None
                    }
                };
                match ended {
                    Some(shared) => {
                        let why = format!(
                            "the cloud replica that owned stream {id:x} of edge {} is gone",
                            self.node
                        );
                        self.reset_ended(id, shared, ResetCode::SessionLost, why);
                    }
                    None => {
                        debug!(node = %self.node, stream = id, "an older transport of the stream reports its owner gone; a newer attach holds the stream, which goes on")
                    }
                }
            }
            Err(e) => {
                debug!(node = %self.node, stream = id, error = %e, "stream detached; waiting for a resume");
                self.expire_detached(id, &shared, attach);
            }
        }
    }
}

/// What an attach found in the stream table.
enum Found {
    /// A stream held here: a re-attach.
    Held(Arc<SharedStream>),
    /// A new stream, just entered in the table.
    New(Arc<SharedStream>),
    /// A new stream, refused: the table holds this many, its limit.
    Full(usize),
    /// Neither held nor new (ended, or this edge restarted): refused.
    Unknown,
}

/// Answers a stream the edge does not take: an attach (nothing delivered),
/// then a reset with `code` and `why`, and the end of the QUIC stream. Best
/// effort: the cloud may be gone already.
async fn refuse(
    mut send: quinn::SendStream,
    id: StreamId,
    code: ResetCode,
    why: String,
    max: usize,
) {
    let attach = Frame::Attach {
        stream: id,
        delivered: 0,
        fin_received: false,
    };
    let _ = write_frame(&mut send, &attach, max).await;
    let reset = Frame::Reset {
        stream: id,
        code,
        message: why,
    };
    let _ = write_frame(&mut send, &reset, max).await;
    let _ = send.finish();
}

/// Whether a transport failure is the splicing replica saying the stream's
/// owner is gone.
fn owner_gone(e: &tether_proto::io::TransportError) -> bool {
    let tether_proto::io::TransportError::Io(io) = e else {
        return false;
    };
    matches!(
        io.get_ref().and_then(|i| i.downcast_ref::<quinn::ReadError>()),
        Some(quinn::ReadError::Reset(code)) if *code == quinn::VarInt::from_u32(stream_code::OWNER_GONE)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reset(code: u32) -> tether_proto::io::TransportError {
        let e: std::io::Error = quinn::ReadError::Reset(quinn::VarInt::from_u32(code)).into();
        tether_proto::io::TransportError::Io(e)
    }

    /// Only the splicing replica's "owner gone" ends a stream at once; any other
    /// transport failure (the connection died, the owner only detached) waits for
    /// a re-attach.
    #[test]
    fn only_owner_gone_ends_a_stream_at_once() {
        assert!(owner_gone(&reset(stream_code::OWNER_GONE)));
        assert!(!owner_gone(&reset(stream_code::DETACHED)));
        assert!(!owner_gone(&reset(0)));
        assert!(!owner_gone(&tether_proto::io::TransportError::Closed));
        let lost: std::io::Error =
            quinn::ReadError::ConnectionLost(quinn::ConnectionError::TimedOut).into();
        assert!(!owner_gone(&tether_proto::io::TransportError::Io(lost)));
    }

    /// The edge's stream table for node `edge-t`, its forwarder pointed at a
    /// kubelet address no test dials (no request head is ever sent).
    fn edge_streams(limits: Limits, head_timeout: Duration) -> Arc<EdgeStreams> {
        edge_streams_to("127.0.0.1:9", limits, head_timeout, 4096)
    }

    /// As [`edge_streams`], remembering `remember_ended` ended stream ids.
    fn edge_streams_remembering(
        limits: Limits,
        head_timeout: Duration,
        remember_ended: usize,
    ) -> Arc<EdgeStreams> {
        edge_streams_to("127.0.0.1:9", limits, head_timeout, remember_ended)
    }

    /// [`edge_streams`] with its forwarder pointed at the kubelet at `addr`,
    /// remembering `remember_ended` ended stream ids.
    fn edge_streams_to(
        addr: &str,
        limits: Limits,
        head_timeout: Duration,
        remember_ended: usize,
    ) -> Arc<EdgeStreams> {
        let forward = Arc::new(Forward {
            target: crate::kubelet::testing::plain_target(addr, Duration::from_secs(2)),
            head_timeout,
        });
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = crate::metrics::EdgeMetrics::register(&mut registry);
        EdgeStreams::new("edge-t".into(), limits, forward, remember_ended, metrics)
    }

    /// The edge's side: every stream the cloud opens on `edge` goes to
    /// `streams`, until the connection ends.
    fn accept_all(
        streams: &Arc<EdgeStreams>,
        edge: quinn::Connection,
    ) -> tokio::task::JoinHandle<()> {
        let streams = streams.clone();
        tokio::spawn(async move {
            while let Ok((s, r)) = edge.accept_bi().await {
                tokio::spawn(streams.clone().accept(s, r, None));
            }
        })
    }

    /// As [`accept_all`], handing over each stream's `accept` task, in the
    /// order the streams came, so a test can wait until the edge is done
    /// with a transport (its driver ended and the failure handled).
    fn accept_each(
        streams: &Arc<EdgeStreams>,
        edge: quinn::Connection,
    ) -> (
        tokio::task::JoinHandle<()>,
        tokio::sync::mpsc::UnboundedReceiver<tokio::task::JoinHandle<()>>,
    ) {
        let (accepted_tx, accepted) = tokio::sync::mpsc::unbounded_channel();
        let streams = streams.clone();
        let acceptor = tokio::spawn(async move {
            while let Ok((s, r)) = edge.accept_bi().await {
                let _ = accepted_tx.send(tokio::spawn(streams.clone().accept(s, r, None)));
            }
        });
        (acceptor, accepted)
    }

    /// The cloud's side of a stream: opens one on `cloud`, attaches it as
    /// `id` with nothing delivered, and reads the edge's attach back.
    async fn attach_from_zero(
        cloud: &quinn::Connection,
        id: StreamId,
        max: usize,
    ) -> (quinn::SendStream, quinn::RecvStream, FrameReader) {
        let (mut send, mut recv) = cloud.open_bi().await.unwrap();
        let attach = Frame::Attach {
            stream: id,
            delivered: 0,
            fin_received: false,
        };
        write_frame(&mut send, &attach, max).await.unwrap();
        let mut reader = FrameReader::new(max);
        let first = tokio::time::timeout(Duration::from_secs(10), reader.next(&mut recv))
            .await
            .expect("the edge's attach within 10 s")
            .unwrap();
        assert!(
            matches!(first, Some(Frame::Attach { stream, .. }) if stream == id),
            "{first:?}"
        );
        (send, recv, reader)
    }

    /// Breaks a transport as the replica holding a splice does when the
    /// splice breaks: it resets both halves of the edge's end with `code`
    /// ([`stream_code`]).
    fn break_transport(send: &mut quinn::SendStream, recv: &mut quinn::RecvStream, code: u32) {
        send.reset(quinn::VarInt::from_u32(code)).unwrap();
        recv.stop(quinn::VarInt::from_u32(code)).unwrap();
    }

    /// The forwarder reads and writes heads within the bounds the stream
    /// table agreed with the cloud ([`EdgeStreams::set_agreed_limits`]), not
    /// the edge's own: it used its own `--max-head-bytes`, so a kubelet
    /// response head within the edge's bound but over the cloud's went out
    /// and the cloud refused it as a bad head. Now the edge resets the stream
    /// with `LimitExceeded`, naming the agreed bound.
    #[tokio::test]
    async fn new_streams_use_the_head_bound_agreed_with_the_cloud() {
        const AGREED: u32 = 4096;
        let ours = Limits::default();
        let agreed = Limits {
            max_head_bytes: AGREED,
            ..ours
        };
        let max = ours.max_frame_bytes as usize;
        // 6 KB: over the agreed bound, far under the edge's own 256 KiB.
        let kubelet = crate::kubelet::testing::answering_kubelet(
            crate::kubelet::testing::big_head_response(6000),
        )
        .await;
        let streams = edge_streams_to(&kubelet, ours, Duration::from_secs(30), 4096);
        streams.set_agreed_limits(agreed);
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let acceptor = accept_all(&streams, edge);
        // The cloud attaches stream 1 and sends its request head.
        let (mut send, mut recv) = cloud.open_bi().await.unwrap();
        let head = tether_proto::head::encode_head(
            &tether_proto::head::RequestHead {
                method: "GET".into(),
                path_and_query: "/containerLogs/default/p1/c".into(),
                headers: vec![],
                has_body: false,
            },
            AGREED as usize,
        )
        .unwrap();
        for f in [
            Frame::Attach {
                stream: 1,
                delivered: 0,
                fin_received: false,
            },
            Frame::Data {
                stream: 1,
                offset: 0,
                payload: head.into(),
            },
        ] {
            write_frame(&mut send, &f, max).await.unwrap();
        }
        // The edge answers with its attach, then a reset: no head is sent.
        let mut reader = FrameReader::new(max);
        let (code, message) = loop {
            let f = tokio::time::timeout(Duration::from_secs(10), reader.next(&mut recv))
                .await
                .expect("the edge's frames within 10 s")
                .unwrap();
            match f {
                Some(Frame::Reset { code, message, .. }) => break (code, message),
                Some(Frame::Attach { .. } | Frame::Ack { .. }) => continue,
                other => panic!("expected the edge's reset, got {other:?}"),
            }
        };
        assert_eq!(code, ResetCode::LimitExceeded, "{message}");
        assert!(
            message.contains(&format!(
                "--max-head-bytes, the smaller of the edge's and the cloud's: {AGREED} bytes"
            )),
            "{message}"
        );
        acceptor.abort();
    }

    /// A stream the cloud opens and whose attach never comes (here: one
    /// byte of a frame, then nothing) is dropped after
    /// `--request-head-timeout`, not held for a fixed 30 s.
    #[tokio::test]
    async fn a_stream_whose_attach_never_comes_is_dropped_after_the_head_timeout() {
        const TIMEOUT: Duration = Duration::from_millis(500);
        let limits = Limits::default();
        let streams = edge_streams(limits, TIMEOUT);
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (mut send, _recv) = cloud.open_bi().await.unwrap();
        // Part of a frame's length prefix: the stream exists, no frame does.
        send.write_all(&[0x00]).await.unwrap();
        let (s, r) = tokio::time::timeout(Duration::from_secs(10), edge.accept_bi())
            .await
            .expect("the edge sees the stream")
            .unwrap();
        let started = tokio::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(10), streams.clone().accept(s, r, None))
            .await
            .expect("a stream without its attach is dropped within 10 s, not after 30");
        assert!(started.elapsed() >= TIMEOUT, "{:?}", started.elapsed());
        assert_eq!(streams.len(), 0);
    }

    /// Item 5 of the control-stream audit: a new stream was added to the
    /// table without a count, and a detached stream (waiting for its owner,
    /// no QUIC stream open) did not count against QUIC's stream credit, so
    /// a cloud that opened and detached streams grew the table without
    /// bound. Streams held, attached or detached, now count against
    /// `--max-streams-per-edge`: one more is refused with `LimitExceeded`.
    #[tokio::test]
    async fn streams_over_the_limit_are_refused_counting_detached_ones() {
        let limits = Limits {
            max_streams_per_edge: 2,
            ..Limits::default()
        };
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (acceptor, mut accepted) = accept_each(&streams, edge);
        // The cloud opens a stream and attaches it as new.
        let open = |id: StreamId| attach_from_zero(&cloud, id, max);
        let (_send1, _recv1, _) = open(1).await;
        let (mut send2, mut recv2, _) = open(2).await;
        let _first = accepted.recv().await.unwrap();
        let second = accepted.recv().await.unwrap();
        // Stream 2's transport breaks (the owner only detached it): the
        // edge keeps it for the grace period.
        break_transport(&mut send2, &mut recv2, stream_code::DETACHED);
        tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .expect("the edge noticed the detach")
            .unwrap();
        assert_eq!(streams.len(), 2, "the detached stream is still held");

        // A third is over the limit: attach, then a reset saying why.
        let (_send3, mut recv3, mut reader) = open(3).await;
        let reset = tokio::time::timeout(Duration::from_secs(10), reader.next(&mut recv3))
            .await
            .expect("the edge's answer to stream 3 within 10 s")
            .unwrap();
        let Some(Frame::Reset {
            stream,
            code,
            message,
        }) = reset
        else {
            panic!("stream 3 was not refused: {reset:?}");
        };
        assert_eq!((stream, code), (3, ResetCode::LimitExceeded), "{message}");
        assert!(message.contains("--max-streams-per-edge (2)"), "{message}");
        assert_eq!(streams.len(), 2);
        assert!(streams.stream(3).is_none());
        acceptor.abort();
    }

    /// Issue 14 item 5: a stream whose transport broke, and that no cloud replica
    /// re-attaches, is ended (reset) once the grace period has passed — not before,
    /// and not never (a leaked slot).
    #[tokio::test]
    async fn a_detached_stream_no_one_reattaches_ends_after_the_grace() {
        const GRACE: Duration = Duration::from_millis(800);
        let limits = Limits::default();
        let streams = edge_streams(limits, Duration::from_secs(30));
        streams.set_grace(GRACE);

        // (the cloud's side, the edge's side)
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        // The cloud opens stream 5 and attaches it as new.
        let (mut send, _recv) = cloud.open_bi().await.unwrap();
        let attach = Frame::Attach {
            stream: 5,
            delivered: 0,
            fin_received: false,
        };
        write_frame(&mut send, &attach, limits.max_frame_bytes as usize)
            .await
            .unwrap();
        let (esend, erecv) = tokio::time::timeout(Duration::from_secs(5), edge.accept_bi())
            .await
            .unwrap()
            .unwrap();
        let accepting = tokio::spawn(streams.clone().accept(esend, erecv, None));
        // Wait (bounded) until the edge drives it over this transport.
        let shared = {
            let start = std::time::Instant::now();
            loop {
                let attached = streams
                    .map()
                    .live
                    .get(&5)
                    .filter(|l| l.attaches == 1)
                    .map(|l| l.shared.clone());
                if let Some(s) = attached {
                    break s;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "stream 5 never attached"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };

        // The transport breaks; no replica re-attaches the stream.
        cloud.close(quinn::VarInt::from_u32(0), b"gone");
        let broke = std::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(5), accepting)
            .await
            .expect("the edge noticed the broken transport")
            .unwrap();

        // Within the grace period: still held, waiting for its owner.
        tokio::time::sleep(GRACE / 2).await;
        assert_eq!(streams.len(), 1, "ended before the grace period passed");
        assert!(
            shared.with_state(|s| s.reset_reason().is_none()),
            "reset before the grace period passed"
        );

        // After it: ended and reset.
        let ended = loop {
            if streams.is_empty() {
                break broke.elapsed();
            }
            assert!(
                broke.elapsed() < GRACE + Duration::from_secs(5),
                "stream 5 still held {:?} after its transport broke (grace {GRACE:?})",
                broke.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(
            ended >= GRACE,
            "ended after {ended:?}, before the grace {GRACE:?}"
        );
        let (code, message) = shared
            .with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())))
            .expect("the expired stream was reset");
        assert_eq!(code, ResetCode::SessionLost, "{message}");
        assert!(message.contains("grace period"), "{message}");
        // A late re-attach of it is refused, not taken for a new stream.
        assert!(streams.map().ended.contains(&5));
    }

    /// `--ended-streams-remembered` (was a fixed 4,096): past it the oldest
    /// ended id is forgotten. A re-attach of a remembered one is refused as
    /// unknown; one of a forgotten id (nothing delivered) is taken for a new
    /// stream, which is what the memory is there to prevent.
    #[tokio::test]
    async fn ended_streams_past_the_configured_count_are_forgotten_oldest_first() {
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams_remembering(limits, Duration::from_secs(60), 2);
        for id in 1..=3 {
            streams.map().end(id, streams.remember_ended);
        }
        {
            let t = streams.map();
            assert!(!t.ended.contains(&1), "the oldest is still remembered");
            assert!(t.ended.contains(&2) && t.ended.contains(&3));
            assert_eq!(t.ended_order.len(), 2);
        }
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let acceptor = accept_all(&streams, edge);
        // The cloud re-attaches `id` as if nothing had been delivered; the
        // edge's second frame, if any within 2 s, is read.
        let reattach = |id: StreamId| {
            let cloud = cloud.clone();
            async move {
                let (send, mut recv, mut reader) = attach_from_zero(&cloud, id, max).await;
                let second = tokio::time::timeout(Duration::from_secs(2), reader.next(&mut recv))
                    .await
                    .ok()
                    .and_then(|f| f.ok().flatten());
                (send, second)
            }
        };
        let (_s3, answer) = reattach(3).await;
        assert!(
            matches!(
                answer,
                Some(Frame::Reset {
                    stream: 3,
                    code: ResetCode::UnknownStream,
                    ..
                })
            ),
            "a remembered ended stream was not refused: {answer:?}"
        );
        assert!(streams.stream(3).is_none());
        let (_s1, answer) = reattach(1).await;
        assert!(
            !matches!(answer, Some(Frame::Reset { .. })),
            "a forgotten stream was refused: {answer:?}"
        );
        assert!(
            streams.stream(1).is_some(),
            "a forgotten id was not taken as new"
        );
        acceptor.abort();
    }

    /// The owner moves streams 1..=10 to a new transport in the same flight
    /// as their old transport fails with `code`: a relay splice broke, the
    /// holder resets the edge's end, and the owner re-attaches through a new
    /// splice (cloud/src/relay.rs). On one thread the edge takes each
    /// re-attach before it handles the old driver's failure. Returns what
    /// went wrong, four grace periods later, with each stream that did not
    /// survive on its new transport.
    async fn streams_lost_to_their_old_transports_failure(code: u32) -> Vec<String> {
        const GRACE: Duration = Duration::from_millis(400);
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        streams.set_grace(GRACE);
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let acceptor = accept_all(&streams, edge);
        let mut lost = Vec::new();
        let mut moved = Vec::new();
        for id in 1..=10 {
            let (mut send1, mut recv1, _) = attach_from_zero(&cloud, id, max).await;
            let shared = streams.stream(id).expect("the new stream is held");
            // The re-attach is queued first, then the old transport breaks:
            // one flight.
            let (mut send2, mut recv2) = cloud.open_bi().await.unwrap();
            let attach = Frame::Attach {
                stream: id,
                delivered: 0,
                fin_received: false,
            };
            let attach = tether_proto::frame::encode_to_bytes(&attach, max).unwrap();
            send2.write_chunk(attach).await.unwrap();
            break_transport(&mut send1, &mut recv1, code);
            // The edge answers the re-attach: its new driver runs.
            let mut reader = FrameReader::new(max);
            let answer = tokio::time::timeout(Duration::from_secs(10), reader.next(&mut recv2))
                .await
                .expect("the edge's answer to the re-attach within 10 s");
            if !matches!(answer, Ok(Some(Frame::Attach { stream, .. })) if stream == id) {
                lost.push(format!(
                    "stream {id}: the re-attach was answered {answer:?}"
                ));
            }
            moved.push((id, shared, send2, recv2));
        }
        tokio::time::sleep(GRACE * 4).await;
        for (id, shared, ..) in &moved {
            let held = streams.stream(*id);
            if !held.is_some_and(|h| Arc::ptr_eq(&h, shared)) {
                lost.push(format!("stream {id} is no longer held"));
            }
            if let Some((code, why)) =
                shared.with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())))
            {
                lost.push(format!("stream {id} was reset: {code:?} {why}"));
            }
        }
        acceptor.abort();
        lost
    }

    /// Audit of the edge's stream table, defect A: the task that awaited a
    /// stream's old driver armed the grace timer with the attach count it
    /// read when the failure was handled, which a re-attach had already
    /// bumped: the grace period later the timer aborted the new, healthy
    /// driver and reset the stream ("no cloud replica re-attached stream …
    /// within the grace period"): an exec or `logs -f` died 5 min after a
    /// relay splice broke. A failure now acts only on its own attach.
    #[tokio::test]
    async fn a_detach_racing_the_owners_reattach_does_not_expire_the_new_attach() {
        let lost = streams_lost_to_their_old_transports_failure(stream_code::DETACHED).await;
        assert!(lost.is_empty(), "{lost:#?}");
    }

    /// As above, with the splicing replica's "owner gone": the old
    /// transport's failure ended the stream at once, though a newer attach
    /// had taken it over.
    #[tokio::test]
    async fn an_owner_gone_racing_the_owners_reattach_does_not_end_the_new_attach() {
        let lost = streams_lost_to_their_old_transports_failure(stream_code::OWNER_GONE).await;
        assert!(lost.is_empty(), "{lost:#?}");
    }

    /// The cloud attaches stream `id` (new or held) on a new transport, then
    /// the transport breaks ([`stream_code::DETACHED`]); returns when the
    /// edge has handled the detach (its `accept` task, the next from
    /// [`accept_each`]'s `accepted`, ended), with the time the transport
    /// broke.
    async fn attach_and_detach(
        cloud: &quinn::Connection,
        id: StreamId,
        max: usize,
        accepted: &mut tokio::sync::mpsc::UnboundedReceiver<tokio::task::JoinHandle<()>>,
    ) -> std::time::Instant {
        let (mut send, mut recv, _) = attach_from_zero(cloud, id, max).await;
        let detached = std::time::Instant::now();
        break_transport(&mut send, &mut recv, stream_code::DETACHED);
        let accepting = tokio::time::timeout(Duration::from_secs(10), accepted.recv())
            .await
            .expect("the edge took the stream within 10 s")
            .expect("the acceptor runs");
        tokio::time::timeout(Duration::from_secs(10), accepting)
            .await
            .expect("the edge handled the detach within 10 s")
            .unwrap();
        detached
    }

    /// Audit of the edge's stream table, defect B: every detach spawned its
    /// own grace-timer task, sleeping for the whole grace period (5 min by
    /// default, the cloud's welcome sets it), so a stream detached over and
    /// over grew the edge's tasks by one a detach, whatever
    /// --max-streams-per-edge. A stream now has at most one timer.
    #[tokio::test]
    async fn a_stream_detached_over_and_over_holds_one_grace_timer() {
        const DETACHES: usize = 100;
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        streams.set_grace(Duration::from_secs(300));
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (acceptor, mut accepted) = accept_each(&streams, edge);
        let runtime = tokio::runtime::Handle::current().metrics();
        let mut after_the_first = 0;
        for detach in 0..=DETACHES {
            attach_and_detach(&cloud, 7, max, &mut accepted).await;
            if detach == 0 {
                after_the_first = runtime.num_alive_tasks();
            }
        }
        assert_eq!(streams.len(), 1, "the detached stream is held");
        let tasks = runtime.num_alive_tasks();
        assert!(
            tasks <= after_the_first + 2,
            "tasks alive after one detach {after_the_first}, after {DETACHES} more {tasks}"
        );
        acceptor.abort();
    }

    /// A re-attach stops the grace timer its stream's detach armed: the
    /// stream, attached again, outlives the grace period.
    #[tokio::test]
    async fn a_reattached_stream_outlives_the_grace_timer_its_detach_armed() {
        const GRACE: Duration = Duration::from_millis(400);
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        streams.set_grace(GRACE);
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (acceptor, mut accepted) = accept_each(&streams, edge);
        attach_and_detach(&cloud, 5, max, &mut accepted).await;
        let shared = streams.stream(5).expect("the detached stream is held");
        let (_send, _recv, _) = attach_from_zero(&cloud, 5, max).await;
        tokio::time::sleep(GRACE * 4).await;
        assert!(
            streams.stream(5).is_some_and(|s| Arc::ptr_eq(&s, &shared)),
            "the re-attached stream is no longer held"
        );
        let reset = shared.with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())));
        assert_eq!(reset, None, "the re-attached stream was reset");
        acceptor.abort();
    }

    /// A stream's one grace timer honours its latest detach: detached,
    /// re-attached and detached again, the stream is ended a grace period
    /// after the second detach, not the first (the timer the first armed
    /// finds the later deadline and sleeps on).
    #[tokio::test]
    async fn a_stream_detached_again_ends_a_grace_period_after_its_latest_detach() {
        const GRACE: Duration = Duration::from_secs(2);
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        streams.set_grace(GRACE);
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (acceptor, mut accepted) = accept_each(&streams, edge);
        attach_and_detach(&cloud, 7, max, &mut accepted).await;
        let shared = streams.stream(7).expect("the detached stream is held");
        tokio::time::sleep(GRACE / 4).await;
        let latest = attach_and_detach(&cloud, 7, max, &mut accepted).await;
        assert!(
            streams.stream(7).is_some_and(|s| Arc::ptr_eq(&s, &shared)),
            "the stream was not re-attached (ended before a quarter of its grace period?)"
        );
        let ended = loop {
            if streams.is_empty() {
                break latest.elapsed();
            }
            assert!(
                latest.elapsed() < GRACE * 10,
                "the stream is still held {:?} after its latest detach (grace {GRACE:?})",
                latest.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(
            ended >= GRACE,
            "ended {ended:?} after its latest detach, within the grace period {GRACE:?}"
        );
        let (code, message) = shared
            .with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())))
            .expect("the expired stream was reset");
        assert_eq!(code, ResetCode::SessionLost, "{message}");
        assert!(message.contains("grace period"), "{message}");
        acceptor.abort();
    }

    /// A grace timer acts on its own stream only. Stream 5 waited for a
    /// re-attach when the session was lost (say, the cloud restarted and
    /// refused the resume); the new session's ids start over, and its
    /// stream 5, attached once like the old one, was ended by the old
    /// stream's timer a grace period after the old detach.
    #[tokio::test]
    async fn a_grace_timer_of_the_last_session_leaves_the_new_sessions_stream_of_that_id_alone() {
        const GRACE: Duration = Duration::from_millis(400);
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        streams.set_grace(GRACE);
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (acceptor, mut accepted) = accept_each(&streams, edge);
        attach_and_detach(&cloud, 5, max, &mut accepted).await;
        streams.end_all("the session is gone");
        streams.new_session();
        let (_send, _recv, _) = attach_from_zero(&cloud, 5, max).await;
        let shared = streams
            .stream(5)
            .expect("the new session's stream 5 is held");
        tokio::time::sleep(GRACE * 4).await;
        assert!(
            streams.stream(5).is_some_and(|s| Arc::ptr_eq(&s, &shared)),
            "the new session's stream 5 is no longer held"
        );
        let reset = shared.with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())));
        assert_eq!(reset, None, "the new session's stream 5 was reset");
        acceptor.abort();
    }

    /// A stream of the lost session that ends after the session was lost
    /// ends itself only: its id, reused by the new session, is neither
    /// taken from the new session's stream nor remembered as ended (which
    /// refused the new session's stream as unknown).
    #[tokio::test]
    async fn an_old_sessions_stream_ending_late_leaves_its_id_to_the_new_session() {
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (acceptor, mut accepted) = accept_each(&streams, edge);
        let (_send1, _recv1, _) = attach_from_zero(&cloud, 5, max).await;
        let old = tokio::time::timeout(Duration::from_secs(10), accepted.recv())
            .await
            .expect("the edge took the stream within 10 s")
            .expect("the acceptor runs");
        streams.end_all("the session is gone");
        streams.new_session();
        // The old stream's driver sends its reset and is done.
        tokio::time::timeout(Duration::from_secs(10), old)
            .await
            .expect("the old stream's driver ended within 10 s")
            .unwrap();
        let (_send2, mut recv2, mut reader) = attach_from_zero(&cloud, 5, max).await;
        let second = tokio::time::timeout(Duration::from_secs(1), reader.next(&mut recv2))
            .await
            .ok()
            .and_then(|f| f.ok().flatten());
        assert!(
            !matches!(second, Some(Frame::Reset { .. })),
            "the new session's stream 5 was refused: {second:?}"
        );
        assert!(
            streams.stream(5).is_some(),
            "the new session's stream 5 is not held"
        );
        acceptor.abort();
    }

    /// The owner's request and the edge's response on the streams of
    /// [`done_detached`].
    const REQUEST: &[u8] = b"request";
    const RESPONSE: &[u8] = b"response!";

    /// Stream `id` as the edge holds it when its transport broke once the
    /// stream was done: the edge's state and an owner's exchanged
    /// [`REQUEST`], [`RESPONSE`], both ends and both final acks, then the
    /// transport went (detached). It is entered in `streams` as held by
    /// attach 1, and the edge handles the failure of that attach as
    /// `accept` does ([`EdgeStreams::expire_detached`]).
    fn done_detached(streams: &Arc<EdgeStreams>, id: StreamId) -> Arc<SharedStream> {
        let limits = StreamLimits::from(&streams.limits());
        let edge = SharedStream::new(StreamState::new(id, limits));
        let mut owner = StreamState::new(id, limits);
        owner.attach(0, false).unwrap();
        edge.with_state(|s| s.attach(0, false)).unwrap();
        assert_eq!(owner.write(REQUEST), REQUEST.len());
        owner.finish();
        edge.with_state(|s| {
            assert_eq!(s.write(RESPONSE), RESPONSE.len());
            s.finish();
        });
        let read_all = |s: &mut StreamState| {
            while let tether_proto::stream::ReadOutcome::Data(_) = s.read(usize::MAX) {}
        };
        for _ in 0..16 {
            read_all(&mut owner);
            edge.with_state(read_all);
            let to_owner: Vec<Frame> =
                edge.with_state(|s| std::iter::from_fn(|| s.poll_transmit()).collect());
            for f in to_owner {
                owner.on_frame(f).unwrap();
            }
            while let Some(f) = owner.poll_transmit() {
                edge.with_state(|s| s.on_frame(f)).unwrap();
            }
            if edge.is_done() && owner.is_done() {
                break;
            }
        }
        assert!(
            edge.is_done() && owner.is_done(),
            "the exchange did not finish"
        );
        edge.with_state(|s| s.detach());
        streams.map().live.insert(
            id,
            Live {
                shared: edge.clone(),
                driver: None,
                attaches: 1,
                expires: None,
                timer: false,
            },
        );
        streams.metrics.streams_open.set(streams.len() as i64);
        streams.expire_detached(id, &edge, 1);
        assert!(streams.map().live.get(&id).is_some_and(|l| l.timer));
        edge
    }

    /// The cloud opens a stream and attaches `id` with `delivered` and
    /// `fin_received`; returns every frame the edge sends on it up to its
    /// end (within 10 s), and the cloud's send half (kept open).
    async fn attach_at(
        cloud: &quinn::Connection,
        id: StreamId,
        delivered: u64,
        fin_received: bool,
        max: usize,
    ) -> (quinn::SendStream, Vec<Frame>) {
        let (mut send, mut recv) = cloud.open_bi().await.unwrap();
        let attach = Frame::Attach {
            stream: id,
            delivered,
            fin_received,
        };
        write_frame(&mut send, &attach, max).await.unwrap();
        let mut reader = FrameReader::new(max);
        let mut frames = Vec::new();
        loop {
            let next = tokio::time::timeout(Duration::from_secs(10), reader.next(&mut recv)).await;
            match next {
                Ok(Ok(Some(f))) => frames.push(f),
                Ok(Ok(None)) => break,
                other => panic!(
                    "the edge's frames up to its end within 10 s: {other:?} after {frames:?}"
                ),
            }
        }
        (send, frames)
    }

    /// Audit of the edge's stream table, slot defect 1: a detached stream
    /// that was done when its grace period passed was left in the table
    /// (the timer only stopped), so it held one of --max-streams-per-edge
    /// for the rest of the session; enough of them and the edge refused
    /// every new stream with LimitExceeded. It now leaves the table after
    /// the grace, unreset, remembered as ended: a late re-attach is refused
    /// as unknown, and its slot takes a new stream.
    #[tokio::test]
    async fn a_done_stream_no_one_reattaches_leaves_the_table_after_the_grace() {
        const GRACE: Duration = Duration::from_millis(300);
        let limits = Limits {
            max_streams_per_edge: 1,
            ..Limits::default()
        };
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        streams.set_grace(GRACE);
        let shared = done_detached(&streams, 5);
        assert_eq!(streams.metrics.streams_open.get(), 1);
        let detached = std::time::Instant::now();
        while !streams.is_empty() {
            assert!(
                detached.elapsed() < GRACE + Duration::from_secs(5),
                "the done stream is still held {:?} after its transport broke (grace {GRACE:?})",
                detached.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(detached.elapsed() >= GRACE, "{:?}", detached.elapsed());
        assert_eq!(streams.metrics.streams_open.get(), 0, "streams_open");
        let reset = shared.with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())));
        assert_eq!(reset, None, "the done stream was reset");
        assert!(shared.is_done());

        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let acceptor = accept_all(&streams, edge);
        // A late re-attach (the owner never got the final ack) is refused.
        let (_send, frames) = attach_at(&cloud, 5, RESPONSE.len() as u64, true, max).await;
        let refused = frames.iter().find_map(|f| match f {
            Frame::Reset {
                stream: 5,
                code,
                message,
            } => Some((*code, message.clone())),
            _ => None,
        });
        let Some((code, message)) = refused else {
            panic!("the late re-attach was not refused: {frames:?}");
        };
        assert_eq!(code, ResetCode::UnknownStream, "{message}");
        assert!(
            message.contains("edge-t") && message.contains("stream 5"),
            "{message}"
        );
        assert!(streams.stream(5).is_none());
        // Its slot is free: a new stream is taken, not refused as over
        // --max-streams-per-edge (1).
        let (_send6, _recv6, _) = attach_from_zero(&cloud, 6, max).await;
        assert!(streams.stream(6).is_some(), "the new stream was refused");
        acceptor.abort();
    }

    /// A done stream re-attached within the grace (its owner lost the
    /// final ack with the connection) is not refused: the edge answers with
    /// its attach and the final ack, and the stream then ends, unreset.
    #[tokio::test]
    async fn a_done_stream_reattached_within_the_grace_gets_its_final_ack() {
        let limits = Limits::default();
        let max = limits.max_frame_bytes as usize;
        let streams = edge_streams(limits, Duration::from_secs(60));
        streams.set_grace(Duration::from_secs(300));
        let shared = done_detached(&streams, 5);
        let (cloud, edge, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let acceptor = accept_all(&streams, edge);
        let (_send, frames) = attach_at(&cloud, 5, RESPONSE.len() as u64, true, max).await;
        assert!(
            !frames.iter().any(|f| matches!(f, Frame::Reset { .. })),
            "the re-attach within the grace was refused: {frames:?}"
        );
        assert!(
            frames.iter().any(|f| matches!(
                f,
                Frame::Ack { stream: 5, delivered, fin_received: true } if *delivered == REQUEST.len() as u64
            )),
            "no final ack: {frames:?}"
        );
        let start = std::time::Instant::now();
        while !streams.is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the done stream is still held after its final ack"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(streams.map().ended.contains(&5));
        let reset = shared.with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())));
        assert_eq!(reset, None, "the done stream was reset");
        acceptor.abort();
    }
}
