//! Datagram copies of small interactive writes.
//!
//! A keystroke in `kubectl exec` is one small `Data` frame. When the packet
//! carrying it is lost, QUIC resends it only once it has declared the packet
//! lost — at least one round trip later, more on a quiet connection — and the
//! echo waits that long. So a small write on an interactive stream (an
//! upgraded exec, attach or port-forward) is also sent once more as a QUIC
//! datagram, which the receiver applies by offset
//! ([`StreamState::on_copy`](crate::stream::StreamState::on_copy)); whichever
//! copy arrives first delivers the bytes and the other is a duplicate.
//!
//! This module owns the datagram's wire format, the decision whether one
//! connection may send copies ([`CopyLink`]) and the loop that applies the
//! copies a connection receives. Which writes are copied is the transmit
//! loop's ([`crate::io`]): a batch that is one small `Data` frame of a stream
//! marked interactive, within a per-stream rate.
//!
//! A copy is padded to the largest datagram the path takes, so QUIC cannot
//! put the stream frame with the same bytes into the same packet: the two
//! travel in different packets and one loss cannot take both. That makes a
//! copied write cost one full packet more on the wire; the size and rate
//! bounds ([`CopySettings`]) keep bulk transfers and chatty streams out.
//! The copy is queued only after its frame was written and the connection's
//! driver had its turn ([`crate::io`]'s transmit loop), so the two do not
//! leave in one segmentation-offload batch (one `sendmsg`) either: a Linux
//! host on the way that drops a whole batch before segmenting it (a queue
//! discipline, a forwarding rule) would take both at once.
//!
//! The edge says that it reads copies with a one-byte `hello` datagram when
//! its connection starts; the cloud answers `heard`. Each end sends copies
//! only to a peer it heard from (a `hello`, a `heard` or a copy), so a peer
//! without this module never gets datagrams it would leave queued.
//! Datagrams are unreliable: an unanswered `hello` is sent again 1, 3, 7 and
//! 15 s after the first by default, then no more (a cloud that never answers does not
//! read copies); the edge sets the tries and the first wait of its hello
//! (`--copy-hello-tries`, `--copy-hello-resend`), the cloud those of its peer
//! links' hellos (`--peer-copy-hello-tries`, `--peer-copy-hello-resend`,
//! [`CopySettings`]).
//!
//! **Relayed streams.** A stream whose apiserver connection reached another
//! cloud replica than the one holding the edge's connection (the owner and
//! the holder: the cloud's `relay` module) is spliced through the holder, which
//! keeps no stream state and so cannot apply a copy itself. Its copies cross
//! the peer link between the two replicas as *relayed* copies, which name
//! the edge's node and session besides the stream ([`Via`]): the owner sends
//! them to the holder, which sends each on as an ordinary copy on the edge's
//! connection; the edge's copies of such a stream go the other way. The peer
//! link runs the same `hello` / `heard` exchange (the dialling owner asks),
//! so a replica of an older version gets no datagrams it would leave queued.
//! Relayed copies are not padded: the peer link is a data centre's, and what
//! padding is for is the edge's link, where the holder pads them.
//!
//! Format: a kind byte (`0` hello, `1` copy, `2` heard, `3` relayed copy);
//! for a copy the stream id, the offset and the payload length as LEB128
//! varints, the payload, and zero padding; a relayed copy puts the session
//! (a varint) and the node name (its length as a varint, then its UTF-8
//! bytes, at most [`MAX_NODE`]) before the same fields. Datagrams of other
//! kinds are ignored.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use prometheus_client::metrics::counter::Counter;

use crate::frame::StreamId;
use crate::io::SharedStream;

const HELLO: u8 = 0;
const COPY: u8 = 1;
const HEARD: u8 = 2;
const RELAYED: u8 = 3;
/// Longest node name in a relayed copy (a DNS subdomain name).
pub const MAX_NODE: usize = 253;
/// Longest LEB128 encoding of a `u64`.
const VARINT_MAX: usize = 10;
/// A copy's bytes besides its payload (kind and three varints).
pub const COPY_OVERHEAD: usize = 1 + 3 * VARINT_MAX;

/// Bounds of interactive copies, from configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySettings {
    /// Largest write copied, bytes; 0 sends no copies.
    pub max_payload: usize,
    /// Copies one stream may send per second; writes beyond go only once.
    pub per_sec: u32,
    /// Sends of an unanswered `hello`, the first one included (at least 1).
    pub hello_tries: u32,
    /// Wait before the first resend of an unanswered `hello`; doubled after each.
    pub hello_resend: Duration,
}

impl Default for CopySettings {
    fn default() -> Self {
        CopySettings {
            max_payload: 256,
            per_sec: 200,
            hello_tries: 5,
            hello_resend: Duration::from_secs(1),
        }
    }
}

/// Counters of the copies one binary sends and receives (registered in its
/// `metrics` module).
#[derive(Clone, Default, Debug)]
pub struct CopyCounters {
    /// Copies sent.
    pub sent: Counter,
    /// Copies received that delivered bytes before their stream frame did.
    pub used: Counter,
    /// Copies received that were not needed or could not be applied (the
    /// frame came first, an earlier frame was missing, no such stream here).
    pub unused: Counter,
    /// Copies received for a relayed stream and passed on (the cloud replica
    /// holding the edge's connection, between the edge and the stream's
    /// owner); registered by [`CopyCounters::register_relayed`].
    pub relayed: Counter,
}

impl CopyCounters {
    /// Registers the counters in a binary's (prefixed) registry.
    pub fn register(&self, r: &mut prometheus_client::registry::Registry) {
        r.register(
            "interactive_copies_sent",
            "Datagram copies of small interactive writes sent",
            self.sent.clone(),
        );
        r.register(
            "interactive_copies_used",
            "Datagram copies received that delivered bytes before their stream frame (a loss or delay they bridged)",
            self.used.clone(),
        );
        r.register(
            "interactive_copies_unused",
            "Datagram copies received that were not needed (the frame came first) or could not be applied",
            self.unused.clone(),
        );
    }

    /// Registers [`CopyCounters::relayed`] (the cloud's: only a replica
    /// passes copies on).
    pub fn register_relayed(&self, r: &mut prometheus_client::registry::Registry) {
        r.register(
            "interactive_copies_relayed",
            "Datagram copies of a relayed stream passed on between the edge and the replica owning the stream",
            self.relayed.clone(),
        );
    }
}

/// Whose stream a relayed copy belongs to: the edge's node and its session
/// (a stream id is unique only within a session).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Via {
    pub node: String,
    pub session: u64,
}

/// A copy of `payload` at `offset` of `stream`; `via` for a relayed copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedCopy {
    pub stream: StreamId,
    pub offset: u64,
    pub payload: Bytes,
    pub via: Option<Via>,
}

/// What becomes of a received datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// The peer reads copies and asks to hear back.
    Hello,
    /// The peer heard our `hello` (and reads copies).
    Heard,
    /// A copy (or a relayed copy).
    Copy(ReceivedCopy),
}

/// What the receiver made of a copy (counted in [`CopyCounters`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// It delivered bytes before their stream frame did.
    Used,
    /// Not needed, or not applicable (no such stream here).
    Unused,
    /// Passed on for a relayed stream.
    Relayed,
}

/// Applies `copy` to `stream` (the receiver's stream of that id, if any).
pub fn apply(stream: Option<Arc<SharedStream>>, copy: &ReceivedCopy) -> Fate {
    if stream.is_some_and(|s| s.on_copy(copy.offset, &copy.payload) > 0) {
        Fate::Used
    } else {
        Fate::Unused
    }
}

/// Why a datagram is not a copy (logged at debug; never fatal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("empty datagram")]
    Empty,
    #[error("datagram of unknown kind {0}")]
    UnknownKind(u8),
    #[error("truncated copy")]
    Truncated,
    #[error("varint longer than 64 bits")]
    BadVarint,
    #[error("relayed copy with a node name that is too long or not UTF-8")]
    BadNode,
}

fn put_varint(out: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

fn get_varint(buf: &[u8], at: &mut usize) -> Result<u64, CopyError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*at).ok_or(CopyError::Truncated)?;
        *at += 1;
        let bits = u64::from(b & 0x7f);
        if shift == 63 && bits > 1 {
            return Err(CopyError::BadVarint);
        }
        v |= bits << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(CopyError::BadVarint)
}

/// The `hello` datagram.
pub fn hello() -> Bytes {
    Bytes::from_static(&[HELLO])
}

/// The answer to a `hello`.
pub fn heard() -> Bytes {
    Bytes::from_static(&[HEARD])
}

/// A copy of `payload` at `offset` of `stream`, zero-padded to `pad_to` bytes
/// (no padding if the copy is already that long).
pub fn encode_copy(stream: StreamId, offset: u64, payload: &[u8], pad_to: usize) -> Bytes {
    let mut out = BytesMut::with_capacity(pad_to.max(COPY_OVERHEAD + payload.len()));
    out.put_u8(COPY);
    put_varint(&mut out, stream);
    put_varint(&mut out, offset);
    put_varint(&mut out, payload.len() as u64);
    out.put_slice(payload);
    if out.len() < pad_to {
        out.resize(pad_to, 0);
    }
    out.freeze()
}

/// Bytes of a relayed copy besides its payload, for `via`.
fn relayed_overhead(via: &Via) -> usize {
    COPY_OVERHEAD + 2 * VARINT_MAX + via.node.len()
}

/// A relayed copy of `payload` at `offset` of `stream` of `via` (not padded).
pub fn encode_relayed(via: &Via, stream: StreamId, offset: u64, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(relayed_overhead(via) + payload.len());
    out.put_u8(RELAYED);
    put_varint(&mut out, via.session);
    put_varint(&mut out, via.node.len() as u64);
    out.put_slice(via.node.as_bytes());
    put_varint(&mut out, stream);
    put_varint(&mut out, offset);
    put_varint(&mut out, payload.len() as u64);
    out.put_slice(payload);
    out.freeze()
}

/// `len` bytes at `at` of `datagram`, or why not; moves `at` past them.
fn take(datagram: &Bytes, at: &mut usize, len: u64) -> Result<Bytes, CopyError> {
    let end = usize::try_from(len)
        .ok()
        .and_then(|l| at.checked_add(l))
        .filter(|e| *e <= datagram.len())
        .ok_or(CopyError::Truncated)?;
    let b = datagram.slice(*at..end);
    *at = end;
    Ok(b)
}

/// Decodes a received datagram (padding after a copy's payload is ignored).
pub fn decode(datagram: &Bytes) -> Result<Received, CopyError> {
    let mut at = 1;
    let via = match datagram.first() {
        None => return Err(CopyError::Empty),
        Some(&HELLO) => return Ok(Received::Hello),
        Some(&HEARD) => return Ok(Received::Heard),
        Some(&COPY) => None,
        Some(&RELAYED) => {
            let session = get_varint(datagram, &mut at)?;
            let len = get_varint(datagram, &mut at)?;
            if len > MAX_NODE as u64 {
                return Err(CopyError::BadNode);
            }
            let node = take(datagram, &mut at, len)?;
            let node = std::str::from_utf8(&node).map_err(|_| CopyError::BadNode)?;
            Some(Via {
                node: node.to_string(),
                session,
            })
        }
        Some(&k) => return Err(CopyError::UnknownKind(k)),
    };
    let stream = get_varint(datagram, &mut at)?;
    let offset = get_varint(datagram, &mut at)?;
    let len = get_varint(datagram, &mut at)?;
    let payload = take(datagram, &mut at, len)?;
    Ok(Received::Copy(ReceivedCopy {
        stream,
        offset,
        payload,
        via,
    }))
}

/// Where the transmit loop sends copies: one connection's datagrams (a trait
/// so tests can capture them).
pub trait CopySink: Send + Sync {
    /// The bounds copies are sent within.
    fn settings(&self) -> CopySettings;
    /// Sends a copy now if the connection can (the peer reads copies, the
    /// datagram fits); returns whether it went.
    fn send_copy(&self, stream: StreamId, offset: u64, payload: &[u8]) -> bool;
}

/// One QUIC connection's copies, both ways.
#[derive(Debug)]
pub struct CopyLink {
    conn: quinn::Connection,
    settings: CopySettings,
    counters: CopyCounters,
    /// The peer announced that it reads copies.
    peer_reads: AtomicBool,
}

impl CopyLink {
    /// The copy path of `conn`. No copy is sent until the peer's `hello`,
    /// `heard` or first copy arrives ([`CopyLink::announce_and_serve`],
    /// [`CopyLink::serve`]).
    pub fn new(
        conn: quinn::Connection,
        settings: CopySettings,
        counters: CopyCounters,
    ) -> Arc<Self> {
        Arc::new(CopyLink {
            conn,
            settings,
            counters,
            peer_reads: AtomicBool::new(false),
        })
    }

    /// The asking side (the edge; a cloud replica on the peer links it
    /// dialled): announces that this end reads copies (a `hello`, resent
    /// until answered, [`CopySettings::hello_tries`] times at most, after
    /// [`CopySettings::hello_resend`], then twice that, …), then hands every copy the
    /// peer sends to `apply`, until the connection ends. `who` names the peer
    /// in log lines.
    pub async fn announce_and_serve(&self, apply: impl Fn(ReceivedCopy) -> Fate, who: &str) {
        // Not an error if a send fails: datagrams are then unsupported or
        // disabled, and no copies go either way.
        let _ = self.conn.send_datagram(hello());
        let mut tries = 1;
        let mut wait = self.settings.hello_resend;
        // A resend beyond the clock's range (a huge configured wait, or
        // doubled too often) is never due: `None`, no more resends.
        let mut resend_at = tokio::time::Instant::now().checked_add(wait);
        // Whether the peer heard our hello (its `heard`, or a copy: it sends
        // those only after hearing us).
        let mut heard_back = false;
        loop {
            let due = resend_at.filter(|_| !heard_back && tries < self.settings.hello_tries);
            tokio::select! {
                d = self.conn.read_datagram() => match d {
                    Ok(d) => heard_back |= self.on_datagram(&d, &apply, who),
                    Err(_) => return,
                },
                () = async { tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)).await }, if due.is_some() => {
                    let _ = self.conn.send_datagram(hello());
                    tries += 1;
                    wait = wait.saturating_mul(2);
                    resend_at = resend_at.and_then(|at| at.checked_add(wait));
                }
            }
        }
    }

    /// The answering side (the cloud; a replica on the peer links dialled
    /// to it): answers the peer's `hello` and hands its copies to `apply`
    /// (as [`CopyLink::announce_and_serve`] without announcing: one end
    /// asking is enough, and the cloud holds no timer per edge for it).
    pub async fn serve(&self, apply: impl Fn(ReceivedCopy) -> Fate, who: &str) {
        while let Ok(d) = self.conn.read_datagram().await {
            self.on_datagram(&d, &apply, who);
        }
    }

    /// Handles one received datagram; returns whether it shows that the
    /// peer heard our `hello`.
    fn on_datagram(
        &self,
        datagram: &Bytes,
        apply: &impl Fn(ReceivedCopy) -> Fate,
        who: &str,
    ) -> bool {
        match decode(datagram) {
            Ok(Received::Hello) => {
                self.peer_reads.store(true, Ordering::Relaxed);
                let _ = self.conn.send_datagram(heard());
                false
            }
            Ok(Received::Heard) => {
                self.peer_reads.store(true, Ordering::Relaxed);
                true
            }
            Ok(Received::Copy(copy)) => {
                self.peer_reads.store(true, Ordering::Relaxed);
                match apply(copy) {
                    Fate::Used => self.counters.used.inc(),
                    Fate::Unused => self.counters.unused.inc(),
                    Fate::Relayed => self.counters.relayed.inc(),
                };
                true
            }
            Err(e) => {
                tracing::debug!(peer = who, error = %e, len = datagram.len(), "ignoring a datagram");
                false
            }
        }
    }

    /// Sends a datagram of `overhead + len` bytes at most, made by `make`
    /// from the largest datagram the connection takes now, if the peer reads
    /// copies and it fits; returns whether it went.
    fn send(&self, len: usize, overhead: usize, make: impl FnOnce(usize) -> Bytes) -> bool {
        if !self.peer_reads.load(Ordering::Relaxed) || len > self.settings.max_payload {
            return false;
        }
        let Some(max) = self.conn.max_datagram_size() else {
            return false;
        };
        if overhead + len > max {
            return false;
        }
        match self.conn.send_datagram(make(max)) {
            Ok(()) => {
                self.counters.sent.inc();
                true
            }
            Err(_) => false,
        }
    }

    /// Sends a relayed copy (on a peer link between cloud replicas) if the
    /// peer reads copies and it fits; returns whether it went.
    pub fn send_relayed(&self, via: &Via, stream: StreamId, offset: u64, payload: &[u8]) -> bool {
        self.send(payload.len(), relayed_overhead(via), |_| {
            encode_relayed(via, stream, offset, payload)
        })
    }

    /// A sink for one relayed stream's copies: each goes as a relayed copy
    /// of `via` on this (peer) link.
    pub fn relayed(self: &Arc<Self>, via: Via) -> Arc<dyn CopySink> {
        Arc::new(RelayedSink {
            link: self.clone(),
            via,
        })
    }
}

/// [`CopyLink::relayed`].
struct RelayedSink {
    link: Arc<CopyLink>,
    via: Via,
}

impl CopySink for RelayedSink {
    fn settings(&self) -> CopySettings {
        self.link.settings
    }

    fn send_copy(&self, stream: StreamId, offset: u64, payload: &[u8]) -> bool {
        self.link.send_relayed(&self.via, stream, offset, payload)
    }
}

impl CopySink for CopyLink {
    fn settings(&self) -> CopySettings {
        self.settings
    }

    fn send_copy(&self, stream: StreamId, offset: u64, payload: &[u8]) -> bool {
        self.send(payload.len(), COPY_OVERHEAD, |max| {
            encode_copy(stream, offset, payload, max)
        })
    }
}

/// One stream's copy budget: at most [`CopySettings::per_sec`] copies in any
/// one-second window.
#[derive(Debug, Default)]
pub struct CopyBudget {
    window: Option<std::time::Instant>,
    used: u32,
}

impl CopyBudget {
    /// Takes one copy from the budget if `per_sec` allows it at `now`.
    pub fn take(&mut self, per_sec: u32, now: std::time::Instant) -> bool {
        match self.window {
            Some(start) if now.duration_since(start) < Duration::from_secs(1) => {}
            _ => {
                self.window = Some(now);
                self.used = 0;
            }
        }
        if self.used < per_sec {
            self.used += 1;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_round_trips_with_and_without_padding() {
        for pad in [0, 40, 1200] {
            let d = encode_copy(7, 300, b"hello", pad);
            assert!(d.len() >= pad);
            assert_eq!(
                decode(&d),
                Ok(Received::Copy(ReceivedCopy {
                    stream: 7,
                    offset: 300,
                    payload: Bytes::from_static(b"hello"),
                    via: None,
                }))
            );
        }
        let big = encode_copy(u64::MAX, u64::MAX - 1, &[9; 300], 0);
        assert!(big.len() <= COPY_OVERHEAD + 300);
        assert!(
            matches!(decode(&big), Ok(Received::Copy(ReceivedCopy { stream: u64::MAX, offset, payload, via: None })) if offset == u64::MAX - 1 && payload.len() == 300)
        );
        assert_eq!(decode(&hello()), Ok(Received::Hello));
        assert_eq!(decode(&heard()), Ok(Received::Heard));
    }

    #[test]
    fn a_relayed_copy_round_trips_with_its_node_and_session() {
        let via = Via {
            node: "edge-7.example".into(),
            session: u64::MAX,
        };
        let d = encode_relayed(&via, 0x1234_0000_0009, 42, b"keys");
        assert!(d.len() <= relayed_overhead(&via) + 4);
        assert_eq!(
            decode(&d),
            Ok(Received::Copy(ReceivedCopy {
                stream: 0x1234_0000_0009,
                offset: 42,
                payload: Bytes::from_static(b"keys"),
                via: Some(via.clone()),
            }))
        );
        // The longest node name a relayed copy carries, and one byte more.
        let longest = Via {
            node: "n".repeat(MAX_NODE),
            session: 1,
        };
        assert!(matches!(
            decode(&encode_relayed(&longest, 1, 0, b"x")),
            Ok(Received::Copy(ReceivedCopy { via: Some(v), .. })) if v == longest
        ));
        let too_long = Via {
            node: "n".repeat(MAX_NODE + 1),
            session: 1,
        };
        assert_eq!(
            decode(&encode_relayed(&too_long, 1, 0, b"x")),
            Err(CopyError::BadNode)
        );
    }

    #[test]
    fn garbage_datagrams_are_errors_not_panics() {
        assert_eq!(decode(&Bytes::new()), Err(CopyError::Empty));
        assert_eq!(
            decode(&Bytes::from_static(b"x")),
            Err(CopyError::UnknownKind(b'x'))
        );
        // A length beyond the datagram.
        let mut d = BytesMut::new();
        d.put_u8(COPY);
        put_varint(&mut d, 1);
        put_varint(&mut d, 0);
        put_varint(&mut d, 50);
        d.put_slice(b"short");
        assert_eq!(decode(&d.freeze()), Err(CopyError::Truncated));
        // A length near u64::MAX must not overflow.
        let mut d = BytesMut::new();
        d.put_u8(COPY);
        put_varint(&mut d, 1);
        put_varint(&mut d, 0);
        put_varint(&mut d, u64::MAX);
        assert_eq!(decode(&d.freeze()), Err(CopyError::Truncated));
        // Varints that never end or exceed 64 bits.
        assert_eq!(
            decode(&Bytes::from_static(&[COPY, 0xff, 0xff])),
            Err(CopyError::Truncated)
        );
        let mut long = vec![COPY];
        long.extend([0xff; 9]);
        long.push(0x7f);
        assert_eq!(decode(&Bytes::from(long)), Err(CopyError::BadVarint));
        let mut long = vec![COPY];
        long.extend([0x80; 12]);
        assert_eq!(decode(&Bytes::from(long)), Err(CopyError::BadVarint));
        // Relayed copies: a node name beyond the datagram, one that is not
        // UTF-8, a copy cut short after the node.
        assert_eq!(
            decode(&Bytes::from_static(&[RELAYED, 1, 9, b'a'])),
            Err(CopyError::Truncated)
        );
        assert_eq!(
            decode(&Bytes::from_static(&[RELAYED, 1, 2, 0xff, 0xfe, 1, 0, 0])),
            Err(CopyError::BadNode)
        );
        assert_eq!(
            decode(&Bytes::from_static(&[RELAYED, 1, 1, b'a', 1, 0, 5, b'x'])),
            Err(CopyError::Truncated)
        );
        assert_eq!(
            decode(&Bytes::from_static(&[RELAYED, 1])),
            Err(CopyError::Truncated)
        );
    }

    /// Both ends run their copy path: after the hello and its answer, a copy goes and is
    /// applied to the named stream once; a copy that cannot apply, or names
    /// no stream, is counted as unused.
    #[tokio::test]
    async fn copies_flow_once_both_ends_said_hello() {
        use crate::stream::{StreamLimits, StreamState};
        let (a, b, _endpoints) = crate::testing::quic_pair().await.unwrap();
        let limits = StreamLimits {
            replay_bytes: 1024,
            recv_bytes: 1024,
            max_payload: 1024,
        };
        let target = SharedStream::new(StreamState::new(9, limits));
        target.with_state(|s| s.attach(0, false)).unwrap();
        let la = CopyLink::new(a, CopySettings::default(), CopyCounters::default());
        let counters = CopyCounters::default();
        let lb = CopyLink::new(b, CopySettings::default(), counters.clone());
        let (la2, lb2, t2) = (la.clone(), lb.clone(), target.clone());
        tokio::spawn(async move { la2.announce_and_serve(|_| Fate::Unused, "b").await });
        tokio::spawn(async move {
            lb2.serve(move |c| apply((c.stream == 9).then(|| t2.clone()), &c), "a")
                .await
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !la.send_copy(9, 0, b"hi") {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no hello from b within 5 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Too big for the settings: not sent.
        assert!(!la.send_copy(9, 2, &[0; 300]));
        assert!(la.send_copy(9, 5, b"gap"));
        assert!(la.send_copy(77, 0, b"nobody"));
        while counters.used.get() + counters.unused.get() < 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "copies not all received"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(counters.used.get(), 1);
        assert_eq!(counters.unused.get(), 2);
        assert_eq!(target.with_state(|s| s.offsets().2), 2);
        assert!(lb.send_copy(3, 0, b"back"), "b heard a's hello too");
    }

    /// A peer that reads datagrams but never answers (no copy path) gets no
    /// copies; the hello is sent again on its schedule, a bounded number of
    /// times.
    #[tokio::test]
    async fn no_copies_to_a_peer_that_never_answers() {
        let (a, b, _endpoints) = crate::testing::quic_pair().await.unwrap();
        let la = CopyLink::new(a, CopySettings::default(), CopyCounters::default());
        let la2 = la.clone();
        tokio::spawn(async move { la2.announce_and_serve(|_| Fate::Unused, "b").await });
        let mut hellos = 0;
        let until = tokio::time::Instant::now() + Duration::from_millis(3500);
        while let Ok(Ok(d)) = tokio::time::timeout_at(until, b.read_datagram()).await {
            assert_eq!(decode(&d), Ok(Received::Hello));
            hellos += 1;
        }
        // Sent at 0, 1 and 3 s (the next at 7 s).
        assert!((2..=3).contains(&hellos), "{hellos} hellos in 3.5 s");
        assert!(!la.send_copy(1, 0, b"x"));
    }

    /// The tries and the first wait come from the settings (the edge's
    /// `--copy-hello-tries`, `--copy-hello-resend`, the cloud's
    /// `--peer-copy-hello-tries`, `--peer-copy-hello-resend`): with 3 tries
    /// 50 ms apart, doubling, an unanswered hello goes at 0, 50 and 150 ms
    /// and never again.
    #[tokio::test]
    async fn an_unanswered_hello_is_sent_its_configured_tries() {
        let (a, b, _endpoints) = crate::testing::quic_pair().await.unwrap();
        let settings = CopySettings {
            hello_tries: 3,
            hello_resend: Duration::from_millis(50),
            ..CopySettings::default()
        };
        let la = CopyLink::new(a, settings, CopyCounters::default());
        let la2 = la.clone();
        tokio::spawn(async move { la2.announce_and_serve(|_| Fate::Unused, "b").await });
        let mut hellos = 0;
        // Well past the third (150 ms); a fourth would go at 350 ms.
        let until = tokio::time::Instant::now() + Duration::from_millis(1500);
        while let Ok(Ok(d)) = tokio::time::timeout_at(until, b.read_datagram()).await {
            assert_eq!(decode(&d), Ok(Received::Hello));
            hellos += 1;
        }
        assert_eq!(
            hellos, 3,
            "{hellos} hellos in 1.5 s with 3 tries 50 ms apart"
        );
        assert!(!la.send_copy(1, 0, b"x"));
    }

    /// The largest settings do not overflow the resend's clock: one hello
    /// goes, the next is never due, and the copy path keeps serving.
    #[tokio::test]
    async fn the_largest_hello_settings_do_not_overflow() {
        let (a, b, _endpoints) = crate::testing::quic_pair().await.unwrap();
        for resend in [Duration::MAX, Duration::from_secs(u64::MAX / 4)] {
            let settings = CopySettings {
                hello_tries: u32::MAX,
                hello_resend: resend,
                ..CopySettings::default()
            };
            let la = CopyLink::new(a.clone(), settings, CopyCounters::default());
            let serving =
                tokio::spawn(async move { la.announce_and_serve(|_| Fate::Unused, "b").await });
            let d = tokio::time::timeout(Duration::from_secs(5), b.read_datagram())
                .await
                .expect("no hello within 5 s")
                .unwrap();
            assert_eq!(decode(&d), Ok(Received::Hello));
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(!serving.is_finished(), "the copy path ended (a panic?)");
            serving.abort();
        }
        // Doubling a wait many times saturates instead of panicking.
        let settings = CopySettings {
            hello_tries: 200,
            hello_resend: Duration::from_nanos(1),
            ..CopySettings::default()
        };
        let la = CopyLink::new(a, settings, CopyCounters::default());
        let serving =
            tokio::spawn(async move { la.announce_and_serve(|_| Fate::Unused, "b").await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!serving.is_finished(), "the copy path ended (a panic?)");
        serving.abort();
    }

    /// A peer link's relayed copies: the sink of one relayed stream sends
    /// relayed copies of its node and session once the link's hello was
    /// answered (within the settings' size bound), the receiver
    /// hands them to its `apply` with where they belong and counts what it
    /// made of them; copies the other way go too.
    #[tokio::test]
    async fn relayed_copies_carry_their_node_and_session_both_ways() {
        let (a, b, _endpoints) = crate::testing::quic_pair().await.unwrap();
        let owner = CopyLink::new(a, CopySettings::default(), CopyCounters::default());
        let counters = CopyCounters::default();
        let holder = CopyLink::new(b, CopySettings::default(), counters.clone());
        let (got_tx, mut got_rx) = tokio::sync::mpsc::unbounded_channel();
        let (back_tx, mut back_rx) = tokio::sync::mpsc::unbounded_channel();
        let owner2 = owner.clone();
        tokio::spawn(async move {
            owner2
                .announce_and_serve(
                    move |c| {
                        let _ = back_tx.send(c);
                        Fate::Used
                    },
                    "holder",
                )
                .await
        });
        let holder2 = holder.clone();
        tokio::spawn(async move {
            holder2
                .serve(
                    move |c| {
                        let fate = if c.stream == 5 {
                            Fate::Relayed
                        } else {
                            Fate::Unused
                        };
                        let _ = got_tx.send((c, fate));
                        fate
                    },
                    "owner",
                )
                .await
        });
        let via = Via {
            node: "edge-1".into(),
            session: 77,
        };
        let sink = owner.relayed(via.clone());
        assert_eq!(sink.settings(), CopySettings::default());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !sink.send_copy(5, 10, b"ls\n") {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the holder never answered the hello"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!sink.send_copy(5, 13, &[0; 300]), "beyond max_payload");
        assert!(sink.send_copy(6, 0, b"other"));
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let (c, fate) = tokio::time::timeout_at(deadline, got_rx.recv())
                .await
                .expect("relayed copies within 5 s")
                .unwrap();
            assert_eq!(c.via.as_ref(), Some(&via));
            seen.push((c.stream, c.offset, c.payload, fate));
        }
        assert_eq!(
            seen,
            vec![
                (5, 10, Bytes::from_static(b"ls\n"), Fate::Relayed),
                (6, 0, Bytes::from_static(b"other"), Fate::Unused),
            ]
        );
        assert_eq!((counters.relayed.get(), counters.unused.get()), (1, 1));
        // The other way: the holder passes the edge's copy to the owner.
        assert!(holder.send_relayed(&via, 5, 3, b"echo"));
        let c = tokio::time::timeout_at(deadline, back_rx.recv())
            .await
            .expect("a relayed copy back within 5 s")
            .unwrap();
        assert_eq!((c.stream, c.offset, &c.payload[..]), (5, 3, &b"echo"[..]));
        assert_eq!(c.via, Some(via));
    }

    #[test]
    fn a_stream_copies_at_most_per_sec_writes_a_second() {
        let mut b = CopyBudget::default();
        let t0 = std::time::Instant::now();
        assert!((0..3).all(|_| b.take(3, t0)));
        assert!(!b.take(3, t0 + Duration::from_millis(999)));
        assert!(b.take(3, t0 + Duration::from_secs(1)));
        let mut none = CopyBudget::default();
        assert!(!none.take(0, t0));
    }
}
