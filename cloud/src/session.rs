//! One edge's session as this replica sees it: the logical streams this
//! replica *owns* (their apiserver connection arrived here) and how to reach
//! the edge from here.
//!
//! A [`Session`] is created by a hello whose resume token names a state of the
//! edge the cloud has no session for (see [`admission`](crate::admission)), by
//! a hello whose resume ticket names a session this replica did not know
//! (the edge moved here from another replica), or by a request for an edge a
//! peer holds (this replica then owns streams of a session it does not hold).
//! Its [`Link`] says how the edge is reached now: over the edge's own
//! connection to this replica, relayed through the peer that holds it (the
//! holder only splices QUIC streams, see [`relay`](crate::relay)), or not at
//! all for now. Each stream has a task that attaches it to whatever the link
//! is (opening a QUIC stream there and exchanging `Attach`) and, when that
//! transport dies, waits for the next link: both ends replay what the other
//! has not delivered, wherever the edge went. When the session ends (grace
//! expired, edge restarted, this replica shutting down) every stream it owns
//! is reset with a clear reason.
//!
//! Stream ids are unique across the replicas that own streams of one session:
//! the high 32 bits are this process's random owner tag ([`owner_tag`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use tether_proto::copies::{self, CopyLink, CopySink, Fate, ReceivedCopy, Via};
use tether_proto::frame::ResetCode;
use tether_proto::io::{drive, PeerAttach, ResumableIo, SharedStream};
use tether_proto::route::StreamKind;
use tether_proto::stream::{StreamLimits, StreamState};
use tether_proto::token::SessionId;
use tether_proto::{Limits, StreamId};
use tracing::{debug, info, warn, Instrument};

use crate::admission::{Claim, Gate, Superseded, Verdict};
use crate::latest::Latest;
use crate::peer::ReplicaId;

/// This process's owner tag: the high 32 bits of every stream id it assigns,
/// drawn at random once (never 0), so streams several replicas own in one
/// session of an edge do not collide (two replicas drawing the same tag is a
/// 1-in-2^32 chance per pair; the edge then refuses the second stream as a
/// re-attach below what it acknowledged, an error for that stream only).
pub fn owner_tag() -> u32 {
    static TAG: OnceLock<u32> = OnceLock::new();
    *TAG.get_or_init(|| loop {
        let t: u32 = rand::random();
        if t != 0 {
            break t;
        }
    })
}

/// How this replica reaches a session's edge.
#[derive(Clone)]
pub enum Link {
    /// The edge's own connection to this replica, generation `gen`.
    Connected {
        epoch: u64,
        gen: u64,
        conn: quinn::Connection,
        /// Datagram copies of interactive writes on `conn`, when enabled.
        copies: Option<Arc<CopyLink>>,
    },
    /// Through `replica`, which holds the edge's connection of generation
    /// `gen`; `conn` is the peer link this replica dialled to it, `copies`
    /// that link's copy path (relayed copies of interactive writes).
    Relayed {
        epoch: u64,
        gen: u64,
        replica: ReplicaId,
        conn: quinn::Connection,
        copies: Arc<CopyLink>,
    },
    /// Not reachable now: streams wait for a resume (here or anywhere)
    /// until the grace period ends. `held`: the edge's last connection was
    /// to this replica.
    Disconnected {
        epoch: u64,
        gen: u64,
        since: Instant,
        held: bool,
    },
    /// Over: streams were reset with this reason.
    Ended(String),
}

impl Link {
    fn epoch(&self) -> u64 {
        match self {
            Link::Connected { epoch, .. }
            | Link::Relayed { epoch, .. }
            | Link::Disconnected { epoch, .. } => *epoch,
            Link::Ended(_) => u64::MAX,
        }
    }
}

/// [`Session::splicing`]: while it lives, the edge's copies of one spliced
/// stream go to its owner.
pub struct Splicing {
    session: Arc<Session>,
    id: StreamId,
    owner: Arc<CopyLink>,
}

impl Drop for Splicing {
    fn drop(&mut self) {
        let mut book = self.session.book();
        // A newer splice of the same stream (its owner re-attached it here
        // before this one noticed its end) keeps its entry.
        if book
            .splices
            .get(&self.id)
            .is_some_and(|o| Arc::ptr_eq(o, &self.owner))
        {
            book.splices.remove(&self.id);
        }
    }
}

/// Why a stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("edge {node} has {open} open streams, the limit (--max-streams-per-edge)")]
    TooManyStreams { node: String, open: usize },
    #[error("edge {node}'s session has ended: {reason}")]
    Ended { node: String, reason: String },
}

/// Why a committed connection was not attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(transparent)]
    Superseded(#[from] Superseded),
    #[error("the session has ended: {0}")]
    Ended(String),
}

/// Mutable bookkeeping of a session.
struct Book {
    gate: Gate,
    addresses: Vec<String>,
    connected_since: SystemTime,
    /// Streams of other replicas this one splices to the edge (it holds
    /// the edge's connection), by id: the peer link to each one's owner,
    /// where the edge's copies of its writes go ([`Session::splicing`]).
    splices: HashMap<StreamId, Arc<CopyLink>>,
}

/// One edge node's session.
pub struct Session {
    pub node: String,
    pub id: SessionId,
    /// The cloud's limits with the wire bounds (frame, data payload, head)
    /// agreed with the edge, as they were when the session was made (for a
    /// session owned through a peer, within what that peer agreed): what
    /// this session's streams use, request and response heads included.
    limits: Limits,
    /// (A [`Latest`], not a `watch` channel: one session per edge.)
    link: Latest<Link>,
    book: Mutex<Book>,
    streams: Mutex<HashMap<StreamId, Arc<SharedStream>>>,
    next_stream: AtomicU64,
    next_epoch: AtomicU64,
    /// The newest generation of the edge's connections this replica knows of.
    gen: AtomicU64,
    /// How long a relay splice may take to open, and how long a new stream
    /// waits for its first transport ([`Timeouts`]).
    timeouts: Mutex<Timeouts>,
}

/// The waits of a session's streams on a peer.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Opening a splice through the replica holding the edge (`--peer-timeout`).
    pub relay: Duration,
    /// A new stream that has no transport to the edge within this is reset
    /// (the apiserver gets a 502 naming the reason), rather than waiting for
    /// the edge to come back the way an established stream does
    /// (`--route-wait`).
    pub first_attach: Duration,
    /// A re-attach on a live link: the edge's QUIC stream for it and its
    /// `Attach` answer must come within this (`--grace`, the time a stream
    /// waits for its edge anyway), or the stream is reset. Not
    /// `first_attach`: a link that came back slowly may take seconds to
    /// answer every re-attach, and resetting a stream the edge holds loses
    /// the session.
    pub reattach: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            relay: Duration::from_secs(10),
            first_attach: Duration::from_secs(10),
            reattach: Duration::from_secs(300),
        }
    }
}

impl Session {
    /// A new session for the edge state `claim` names, not yet attached to
    /// a connection.
    pub fn new(
        node: String,
        addresses: Vec<String>,
        limits: Limits,
        claim: &Claim,
    ) -> Result<Arc<Session>, rand::rand_core::OsError> {
        Ok(Self::build(
            node,
            SessionId::generate()?,
            0,
            addresses,
            limits,
            claim,
        ))
    }

    /// The session `id` an edge resumes here with a ticket of generation
    /// `gen` (it was held by another replica, or this one forgot it).
    pub fn resumed(
        node: String,
        id: SessionId,
        gen: u64,
        addresses: Vec<String>,
        limits: Limits,
        claim: &Claim,
    ) -> Arc<Session> {
        Self::build(node, id, gen, addresses, limits, claim)
    }

    /// A session this replica only owns streams of: `replica` holds the
    /// edge's connection of generation `gen`.
    pub fn relayed(
        node: String,
        id: SessionId,
        limits: Limits,
        gen: u64,
        replica: ReplicaId,
        conn: quinn::Connection,
        copies: Arc<CopyLink>,
    ) -> Arc<Session> {
        // Nobody joins a relayed session by token (its gate is set when the
        // edge resumes here with a ticket): an all-zero token never matches
        // a drawn one by chance of 2^-128.
        let claim = Claim {
            token: tether_proto::token::ResumeToken([0; 16]),
            instance: 0,
            attempt: 0,
        };
        let s = Self::build(node, id, 0, Vec::new(), limits, &claim);
        s.relay_to(replica, conn, copies, gen);
        s
    }

    fn build(
        node: String,
        id: SessionId,
        gen: u64,
        addresses: Vec<String>,
        limits: Limits,
        claim: &Claim,
    ) -> Arc<Session> {
        let link = Latest::new(Link::Disconnected {
            epoch: 0,
            gen,
            since: Instant::now(),
            held: true,
        });
        Arc::new(Session {
            node,
            id,
            limits,
            link,
            book: Mutex::new(Book {
                gate: Gate::new(claim),
                addresses,
                connected_since: SystemTime::now(),
                splices: HashMap::new(),
            }),
            streams: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            next_epoch: AtomicU64::new(1),
            gen: AtomicU64::new(gen),
            timeouts: Mutex::new(Timeouts::default()),
        })
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The open stream `id`, for a datagram copy of its bytes.
    pub fn stream(&self, id: StreamId) -> Option<Arc<SharedStream>> {
        self.streams().get(&id).cloned()
    }

    /// A copy the edge sent on its connection to this replica: applied to
    /// the stream here, or, for a stream this replica splices for another
    /// one, passed to its owner as a relayed copy.
    pub fn copy_from_edge(&self, copy: ReceivedCopy) -> Fate {
        if copy.via.is_some() {
            // Relayed copies travel between replicas only.
            return Fate::Unused;
        }
        if let Some(s) = self.stream(copy.stream) {
            return copies::apply(Some(s), &copy);
        }
        let Some(owner) = self.book().splices.get(&copy.stream).cloned() else {
            return Fate::Unused;
        };
        if owner.send_relayed(&self.via(), copy.stream, copy.offset, &copy.payload) {
            Fate::Relayed
        } else {
            Fate::Unused
        }
    }

    /// What this session's relayed copies name.
    fn via(&self) -> Via {
        Via {
            node: self.node.clone(),
            session: self.id.0,
        }
    }

    /// The copy path of the edge's connection to this replica, if it is
    /// connected here (where a holder sends the copies owners relay to it).
    pub fn edge_copies(&self) -> Option<Arc<CopyLink>> {
        match &*self.link.borrow() {
            Link::Connected { copies, .. } => copies.clone(),
            _ => None,
        }
    }

    /// This replica splices stream `id` of another replica's to the edge,
    /// `owner` being the peer link that replica opened it on: the edge's
    /// copies of the stream go there until the returned guard drops.
    pub fn splicing(self: &Arc<Self>, id: StreamId, owner: Arc<CopyLink>) -> Splicing {
        self.book().splices.insert(id, owner.clone());
        Splicing {
            session: self.clone(),
            id,
            owner,
        }
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, HashMap<StreamId, Arc<SharedStream>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the waits of this session's streams on a peer.
    pub fn set_timeouts(&self, t: Timeouts) {
        *self.timeouts.lock().unwrap_or_else(|p| p.into_inner()) = t;
    }

    fn timeouts(&self) -> Timeouts {
        *self.timeouts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The verdict on a hello for this session: an ended session is joined
    /// by nobody.
    pub fn judge(&self, claim: &Claim) -> Verdict {
        if self.is_ended() {
            return Verdict::NewSession;
        }
        self.book().gate.judge(claim)
    }

    /// The edge resumed this session here with a ticket: its hellos are
    /// judged by `claim`'s state and attempt order from now on.
    pub fn set_gate(&self, claim: &Claim) {
        self.book().gate = Gate::new(claim);
    }

    pub fn addresses(&self) -> Vec<String> {
        self.book().addresses.clone()
    }

    pub fn set_addresses(&self, a: Vec<String>) {
        self.book().addresses = a;
    }

    pub fn connected_since(&self) -> SystemTime {
        self.book().connected_since
    }

    /// The wire bounds this session's streams use (agreed with the edge).
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The newest generation of the edge's connections known here.
    pub fn gen(&self) -> u64 {
        self.gen.load(Ordering::Relaxed)
    }

    /// Ids of the open streams this replica owns.
    pub fn stream_ids(&self) -> Vec<StreamId> {
        let mut v: Vec<_> = self.streams().keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn open_streams(&self) -> usize {
        self.streams().len()
    }

    pub fn link(&self) -> Link {
        self.link.borrow().clone()
    }

    pub fn is_ended(&self) -> bool {
        matches!(*self.link.borrow(), Link::Ended(_))
    }

    /// Whether this replica holds the edge (connected, or its last
    /// connection was here and it is within its grace period).
    pub fn is_held(&self) -> bool {
        matches!(
            *self.link.borrow(),
            Link::Connected { .. } | Link::Disconnected { held: true, .. }
        )
    }

    /// The live connection, if any.
    pub fn connection(&self) -> Option<quinn::Connection> {
        match &*self.link.borrow() {
            Link::Connected { conn, .. } => Some(conn.clone()),
            _ => None,
        }
    }

    /// The replica the edge is relayed through now, if any.
    pub fn relayed_via(&self) -> Option<ReplicaId> {
        match &*self.link.borrow() {
            Link::Relayed { replica, .. } => Some(replica.clone()),
            _ => None,
        }
    }

    fn epoch(&self) -> u64 {
        self.next_epoch.fetch_add(1, Ordering::Relaxed)
    }

    /// Attaches the connection the edge committed to (`claim`'s) as
    /// generation `gen`. Streams waiting for a link re-attach to it; a
    /// previous live connection is closed. Refused, leaving everything as it
    /// was, when the session has ended (it was replaced or expired meanwhile),
    /// a newer connection of the edge is attached here, or a newer generation
    /// is known (the edge connected to another replica since).
    pub fn attach_connection(
        &self,
        conn: quinn::Connection,
        copies: Option<Arc<CopyLink>>,
        claim: &Claim,
        gen: u64,
    ) -> Result<(), AttachError> {
        let mut book = self.book();
        book.gate.may_commit(claim)?;
        let mut ended = None;
        let mut old = None;
        let mut stale = false;
        // Check and replace in one step: `end` may run concurrently.
        self.link.send_if_modified(|l| {
            if let Link::Ended(reason) = l {
                ended = Some(reason.clone());
                return false;
            }
            if gen <= self.gen.load(Ordering::Relaxed) {
                stale = true;
                return false;
            }
            self.gen.store(gen, Ordering::Relaxed);
            let epoch = self.next_epoch.fetch_add(1, Ordering::Relaxed);
            old = Some(std::mem::replace(
                l,
                Link::Connected {
                    epoch,
                    gen,
                    conn,
                    copies,
                },
            ));
            true
        });
        if let Some(reason) = ended {
            return Err(AttachError::Ended(reason));
        }
        if stale {
            return Err(AttachError::Superseded(Superseded));
        }
        book.gate.commit(claim)?;
        book.connected_since = SystemTime::now();
        drop(book);
        if let Some(Link::Connected { conn: old, .. }) = old {
            old.close(
                tether_proto::handshake::close_code::REPLACED.into(),
                b"replaced by a newer connection",
            );
        }
        Ok(())
    }

    /// The edge's connection of generation `gen` is held by peer `replica`
    /// (reached over `conn`): streams re-attach through it. Ignored unless
    /// `gen` is newer than what is known here (or the same, when the relay to
    /// it had been lost); a live connection of this replica's (older) is
    /// closed. Returns true if the link changed.
    pub fn relay_to(
        &self,
        replica: ReplicaId,
        conn: quinn::Connection,
        copies: Arc<CopyLink>,
        gen: u64,
    ) -> bool {
        let mut old = None;
        let changed = self.link.send_if_modified(|l| {
            if matches!(l, Link::Ended(_)) {
                return false;
            }
            // The same generation again is taken only to come back from a
            // lost relay (the peer link healed, the holder still has the edge).
            let current = self.gen.load(Ordering::Relaxed);
            let lost_relay = matches!(l, Link::Disconnected { held: false, .. });
            if gen < current || (gen == current && !lost_relay) {
                return false;
            }
            self.gen.store(gen, Ordering::Relaxed);
            let epoch = self.next_epoch.fetch_add(1, Ordering::Relaxed);
            old = Some(std::mem::replace(
                l,
                Link::Relayed {
                    epoch,
                    gen,
                    replica: replica.clone(),
                    conn,
                    copies,
                },
            ));
            true
        });
        if let Some(Link::Connected { conn: old, .. }) = old {
            info!(node = %self.node, session = %self.id, replica = %replica.name, "a newer connection of this edge is attached at another replica; closing ours");
            old.close(
                tether_proto::handshake::close_code::REPLACED.into(),
                b"a newer connection of this edge is attached at another replica",
            );
        }
        changed
    }

    /// The peer link to `replica` is gone, or it no longer has the edge
    /// attached: if the edge was relayed through it, it is unreachable now.
    /// Returns the new epoch if the link changed (the caller starts the grace
    /// timer).
    pub fn relay_lost(&self, replica_instance: u64) -> Option<u64> {
        let mut epoch = None;
        self.link.send_if_modified(|l| match l {
            Link::Relayed { replica, gen, .. } if replica.instance == replica_instance => {
                let e = self.next_epoch.fetch_add(1, Ordering::Relaxed);
                *l = Link::Disconnected {
                    epoch: e,
                    gen: *gen,
                    since: Instant::now(),
                    held: false,
                };
                epoch = Some(e);
                true
            }
            _ => false,
        });
        epoch
    }

    /// The connection of generation `gen` died. Returns the new epoch if it
    /// was the current one (the session now waits for a resume).
    pub fn connection_lost(&self, gen: u64) -> Option<u64> {
        let mut epoch = None;
        self.link.send_if_modified(|l| match l {
            Link::Connected { gen: g, .. } if *g == gen => {
                let e = self.epoch();
                *l = Link::Disconnected {
                    epoch: e,
                    gen,
                    since: Instant::now(),
                    held: true,
                };
                epoch = Some(e);
                true
            }
            _ => false,
        });
        epoch
    }

    /// Whether the link is still the disconnected one of `epoch` (nothing
    /// resumed since).
    pub fn still_disconnected(&self, epoch: u64) -> bool {
        matches!(&*self.link.borrow(), Link::Disconnected { epoch: e, .. } if *e == epoch)
    }

    /// Ends the session: every stream is reset with `reason`, the connection
    /// (if any) is closed.
    pub fn end(&self, code: ResetCode, reason: &str) {
        let old = self.link.send_replace(Link::Ended(reason.to_string()));
        if let Link::Connected { conn, .. } = old {
            // The edge tells a shutdown (spread the reconnect) from a replaced
            // or expired session by the code.
            let close = match code {
                ResetCode::Shutdown => tether_proto::handshake::close_code::SHUTDOWN,
                _ => tether_proto::handshake::close_code::REPLACED,
            };
            conn.close(close.into(), reason.as_bytes());
        }
        let streams: Vec<_> = self.streams().drain().map(|(_, s)| s).collect();
        if !streams.is_empty() {
            info!(node = %self.node, session = %self.id, streams = streams.len(), %reason, "ending session's streams");
        }
        for s in streams {
            s.reset(code, reason);
        }
    }

    /// Opens a new logical stream to the edge. The returned handle is usable
    /// at once; bytes flow when the edge is reachable (here or through the
    /// peer that holds it).
    pub fn open_stream(
        self: &Arc<Self>,
        kind: StreamKind,
    ) -> Result<(StreamId, ResumableIo), OpenError> {
        if let Link::Ended(reason) = &*self.link.borrow() {
            return Err(OpenError::Ended {
                node: self.node.clone(),
                reason: reason.clone(),
            });
        }
        let n = self.next_stream.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff;
        let id = (u64::from(owner_tag()) << 32) | n;
        let shared = SharedStream::new(StreamState::new(id, StreamLimits::from(&self.limits)));
        {
            let mut streams = self.streams();
            if streams.len() >= self.limits.max_streams_per_edge as usize {
                return Err(OpenError::TooManyStreams {
                    node: self.node.clone(),
                    open: streams.len(),
                });
            }
            streams.insert(id, shared.clone());
        }
        let span = tracing::info_span!("stream", node = %self.node, stream = %format_args!("{id:x}"), kind = kind.as_str());
        tokio::spawn(self.clone().run_stream(id, shared.clone()).instrument(span));
        Ok((id, ResumableIo::new(shared)))
    }

    /// Attaches a stream to each link in turn until it is done, reset, or
    /// the session ends.
    async fn run_stream(self: Arc<Self>, id: StreamId, shared: Arc<SharedStream>) {
        let mut seen = self.link.version();
        let mut last_epoch = 0u64;
        // The first transport of a new stream needs no round trip: the request
        // head follows our Attach at once (see `PeerAttach::Fresh`).
        let mut peer = PeerAttach::Fresh;
        let max_frame = self.limits.max_frame_bytes as usize;
        let timeouts = self.timeouts();
        let first_deadline = tokio::time::Instant::now() + timeouts.first_attach;
        let mut last_error = String::from("the edge is not connected to any replica");
        loop {
            // A new stream that never reached the edge is answered now (502)
            // rather than kept waiting: the request can be sent again.
            if matches!(peer, PeerAttach::Fresh) && tokio::time::Instant::now() >= first_deadline {
                let why = format!(
                    "edge {} could not be reached within {:?} (--route-wait): {last_error}",
                    self.node, timeouts.first_attach
                );
                info!(%why, "giving up on a new stream");
                shared.reset(ResetCode::SessionLost, why);
                break;
            }
            // Wait for a link newer than the one that failed us.
            let link = loop {
                let link = self.link.borrow_and_update(&mut seen).clone();
                match link {
                    Link::Ended(_) => break None,
                    l @ (Link::Connected { .. } | Link::Relayed { .. })
                        if l.epoch() > last_epoch =>
                    {
                        break Some(l)
                    }
                    _ => {}
                }
                if shared.is_done() {
                    break None;
                }
                let fresh = matches!(peer, PeerAttach::Fresh);
                tokio::select! {
                    () = self.link.changed(seen) => {}
                    _ = shared.wait_done() => break None,
                    _ = tokio::time::sleep_until(first_deadline), if fresh => break Some(Link::Disconnected {
                        epoch: last_epoch,
                        gen: 0,
                        since: Instant::now(),
                        held: false,
                    }),
                }
            };
            let Some(link) = link else { break };
            if matches!(link, Link::Disconnected { .. }) {
                // The first-attach deadline passed while waiting.
                continue;
            }
            last_epoch = link.epoch();
            let fresh = matches!(peer, PeerAttach::Fresh);
            // A re-attach is answered within `--grace` (below), its QUIC
            // stream included.
            let reattach_by = tokio::time::Instant::now() + timeouts.reattach;
            let opened = match &link {
                // Opening waits for the edge's stream credit: an edge that
                // grants none holds the stream (and its place among
                // `--max-streams-per-edge`) only until the stream ends, or
                // until its deadline.
                Link::Connected { conn, .. } => tokio::select! {
                    opened = conn.open_bi() => {
                        opened.map_err(|e| format!("opening a QUIC stream to the edge: {e}"))
                    }
                    _ = shared.wait_done() => break,
                    _ = shared.wait_reset(), if fresh => {
                        // Reset here (the apiserver's request was answered
                        // or gone) before the edge heard of it: nothing to
                        // tell the edge.
                        shared.with_state(|s| s.abandon());
                        break;
                    }
                    () = tokio::time::sleep_until(first_deadline), if fresh => Err(
                        "the edge granted no QUIC stream for it (every stream it allows is open)"
                            .to_string(),
                    ),
                    () = tokio::time::sleep_until(reattach_by), if !fresh => {
                        self.unanswered_reattach(&shared, timeouts.reattach, "granted no QUIC stream");
                        break;
                    }
                },
                Link::Relayed { replica, conn, .. } => {
                    let header = crate::relay::SpliceHeader {
                        node: self.node.clone(),
                        session: self.id.0,
                        stream: id,
                    };
                    match crate::relay::splice_open(conn, &replica.name, &header, timeouts.relay)
                        .await
                    {
                        Ok(Ok(pair)) => Ok(pair),
                        Ok(Err(crate::relay::Answer::Ended(m))) => {
                            // The holder has another session of this edge:
                            // the edge lost this one's state.
                            warn!(%m, "the edge's session is gone at its holder; ending the stream");
                            shared.reset(ResetCode::SessionLost, m);
                            break;
                        }
                        Ok(Err(a)) => Err(format!("replica {}: {a:?}", replica.name)),
                        Err(e) => Err(format!("replica {}: {e}", replica.name)),
                    }
                }
                _ => continue,
            };
            let (send, recv) = match opened {
                Ok(s) => s,
                Err(e) => {
                    debug!(error = %e, "no transport to the edge; waiting for the next link");
                    last_error = e;
                    continue;
                }
            };
            let attach = std::mem::replace(&mut peer, PeerAttach::Read);
            // On the edge's own connection copies go as datagrams there;
            // through a holder as relayed copies on the peer link, which the
            // holder sends on to the edge.
            let copies = match &link {
                Link::Connected {
                    copies: Some(c), ..
                } => Some(c.clone() as Arc<dyn CopySink>),
                Link::Relayed { copies, .. } => Some(copies.relayed(self.via())),
                _ => None,
            };
            let driven = drive(shared.clone(), recv, send, attach, max_frame, copies);
            tokio::pin!(driven);
            // The edge's `Attach` answering a re-attach comes within the
            // same deadline; once attached, the transport's own end rules.
            let unanswered = async {
                tokio::time::sleep_until(reattach_by).await;
                if shared.with_state(|s| s.is_attached()) {
                    std::future::pending::<()>().await;
                }
            };
            let driven = tokio::select! {
                r = &mut driven => r,
                () = unanswered, if !fresh => {
                    self.unanswered_reattach(&shared, timeouts.reattach, "sent no Attach");
                    break;
                }
            };
            match driven {
                Ok(()) => break,
                Err(e) => {
                    if shared.is_done() {
                        break;
                    }
                    // The stream stays; a pending reset goes out on the next
                    // transport, data is replayed there.
                    debug!(error = %e, "stream detached; waiting for the edge to resume");
                }
            }
        }
        self.streams().remove(&id);
        // (The reason is copied out: the link's lock is not held while the
        // stream is reset.)
        let ended = match &*self.link.borrow() {
            Link::Ended(reason) => Some(reason.clone()),
            _ => None,
        };
        if let Some(reason) = ended {
            shared.reset(ResetCode::SessionLost, reason);
        }
        debug!("stream closed");
    }

    /// A stream the edge knows did not get its re-attach answered by the
    /// edge within `within` (`--grace`): it is reset and its slot freed.
    /// (Nothing can tell the edge: it has no transport for the stream.)
    fn unanswered_reattach(&self, shared: &SharedStream, within: Duration, what: &str) {
        let why = format!(
            "edge {} {what} for the stream's re-attach within {within:?} (--grace)",
            self.node
        );
        warn!(%why, "giving up on a stream");
        shared.reset(ResetCode::SessionLost, why);
        shared.with_state(|s| s.abandon());
    }
}

/// Sessions for the crate's tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// The claim of the tests' edges.
    pub fn claim() -> Claim {
        Claim {
            token: tether_proto::token::ResumeToken([1; 16]),
            instance: 1,
            attempt: 1,
        }
    }

    /// A new session of `node`, held here, with no connection yet.
    pub fn session(node: &str) -> Arc<Session> {
        Session::new(node.into(), vec![], Limits::default(), &claim())
            .expect("a session of the tests' claim")
    }
}

#[cfg(test)]
mod tests {
    use super::testing::session;
    use super::*;
    use tether_proto::copies::{CopyCounters, CopySettings};

    /// A peer link's copy path at this end (`owner`), answered by a copy path at
    /// the other end that reports every copy it receives; returns once the
    /// other end heard the hello (copies can go).
    async fn owner_link() -> (
        Arc<CopyLink>,
        tokio::sync::mpsc::UnboundedReceiver<ReceivedCopy>,
        Vec<quinn::Endpoint>,
    ) {
        let (a, b, endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let here = CopyLink::new(a, CopySettings::default(), CopyCounters::default());
        let there = CopyLink::new(b, CopySettings::default(), CopyCounters::default());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let h = here.clone();
        tokio::spawn(async move { h.serve(|_| Fate::Unused, "owner").await });
        tokio::spawn(async move {
            there
                .announce_and_serve(
                    move |c| {
                        let _ = tx.send(c);
                        Fate::Used
                    },
                    "holder",
                )
                .await
        });
        let via = Via {
            node: "probe".into(),
            session: 0,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut rx = rx;
        // The hello is in once a probe copy goes; drain it.
        while !here.send_relayed(&via, 0, 0, b"?") {
            assert!(tokio::time::Instant::now() < deadline, "no hello in 5 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        rx.recv().await.unwrap();
        (here, rx, endpoints)
    }

    /// Waits (at most 10 s) until `s` owns no stream.
    async fn slots_freed(s: &Session) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while s.open_streams() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the stream still holds its slot after 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// An edge that grants the cloud no QUIC stream holds a new stream only
    /// until the stream is reset here (the apiserver was answered 504, or
    /// left) or until `--route-wait`, which resets it naming the cause: its
    /// place among `--max-streams-per-edge` is freed either way.
    #[tokio::test]
    async fn a_new_stream_the_edge_grants_no_quic_stream_frees_its_slot() {
        let mut t = quinn::TransportConfig::default();
        t.max_concurrent_bidi_streams(0u32.into());
        let (conn, _edge, _endpoints) = tether_proto::testing::quic_pair_with(Arc::new(t))
            .await
            .unwrap();
        let s = session("edge-1");
        s.set_timeouts(Timeouts {
            relay: Duration::from_secs(60),
            first_attach: Duration::from_secs(60),
            reattach: Duration::from_secs(60),
        });
        s.attach_connection(conn, None, &testing::claim(), 1)
            .unwrap();

        // Reset here, as the forwarder does on its 504.
        let (_, io) = s.open_stream(StreamKind::Logs).unwrap();
        assert_eq!(s.open_streams(), 1);
        io.shared()
            .reset(ResetCode::Cancelled, "no response head in time");
        slots_freed(&s).await;

        // Not reset here: the first-attach deadline ends it.
        s.set_timeouts(Timeouts {
            relay: Duration::from_secs(60),
            first_attach: Duration::from_millis(300),
            reattach: Duration::from_secs(60),
        });
        let (_, io) = s.open_stream(StreamKind::Logs).unwrap();
        slots_freed(&s).await;
        let (code, why) = io.shared().wait_reset().await;
        assert_eq!(code, ResetCode::SessionLost);
        assert!(
            why.contains("--route-wait") && why.contains("granted no QUIC stream"),
            "{why}"
        );
    }

    /// A stream the edge knows, re-attached on the edge's new connection,
    /// whose `Attach` the edge never answers, is reset after `--grace`
    /// and frees its slot (it used to wait for the answer for as long as the
    /// connection lived).
    #[tokio::test]
    async fn a_re_attach_the_edge_never_answers_is_reset_and_frees_its_slot() {
        let (first, edge_first, _e1) = tether_proto::testing::quic_pair().await.unwrap();
        let (second, edge_second, _e2) = tether_proto::testing::quic_pair().await.unwrap();
        let s = session("edge-1");
        s.set_timeouts(Timeouts {
            relay: Duration::from_secs(60),
            first_attach: Duration::from_secs(60),
            reattach: Duration::from_millis(300),
        });
        let claim = testing::claim();
        s.attach_connection(first, None, &claim, 1).unwrap();
        let (_, io) = s.open_stream(StreamKind::Logs).unwrap();
        // The stream reached the edge (its Attach went out on a new QUIC
        // stream), then the edge's connection dies.
        let wait = Duration::from_secs(10);
        let _held = tokio::time::timeout(wait, edge_first.accept_bi())
            .await
            .unwrap()
            .unwrap();
        edge_first.close(0u32.into(), b"gone");
        // The edge is back on a new connection, takes the stream's QUIC
        // stream, and never answers it.
        let again = Claim {
            attempt: claim.attempt + 1,
            ..claim
        };
        s.attach_connection(second, None, &again, 2).unwrap();
        let _silent = tokio::time::timeout(wait, edge_second.accept_bi())
            .await
            .unwrap()
            .unwrap();
        slots_freed(&s).await;
        let (code, why) = io.shared().wait_reset().await;
        assert_eq!(code, ResetCode::SessionLost);
        assert!(
            why.contains("--grace") && why.contains("sent no Attach"),
            "{why}"
        );
    }

    fn copy(stream: StreamId, via: Option<Via>) -> ReceivedCopy {
        ReceivedCopy {
            stream,
            offset: 0,
            payload: bytes::Bytes::from_static(b"k"),
            via,
        }
    }

    /// The edge's copy of a stream this replica splices for another goes to that
    /// stream's owner as a relayed copy naming the node and session, while the
    /// splice lasts; a newer splice of the same stream keeps its owner when the
    /// older one ends; copies of unknown streams, or already relayed ones, are
    /// unused.
    #[tokio::test]
    async fn the_edges_copies_of_a_spliced_stream_go_to_its_owner_while_spliced() {
        let s = session("edge-1");
        let (first, mut first_rx, _e1) = owner_link().await;
        let (second, mut second_rx, _e2) = owner_link().await;
        let wait = Duration::from_secs(5);
        assert_eq!(s.copy_from_edge(copy(7, None)), Fate::Unused);

        let older = s.splicing(7, first);
        assert_eq!(s.copy_from_edge(copy(7, None)), Fate::Relayed);
        let c = tokio::time::timeout(wait, first_rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.stream, 7);
        assert_eq!(
            c.via,
            Some(Via {
                node: "edge-1".into(),
                session: s.id.0
            })
        );
        assert_eq!(s.copy_from_edge(copy(8, None)), Fate::Unused);
        let relayed = Some(Via {
            node: "edge-1".into(),
            session: s.id.0,
        });
        assert_eq!(s.copy_from_edge(copy(7, relayed)), Fate::Unused);

        // The owner re-attached the stream here before the old splice ended.
        let newer = s.splicing(7, second);
        drop(older);
        assert_eq!(s.copy_from_edge(copy(7, None)), Fate::Relayed);
        let c = tokio::time::timeout(wait, second_rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.stream, 7);
        drop(newer);
        assert_eq!(s.copy_from_edge(copy(7, None)), Fate::Unused);
        assert!(
            first_rx.try_recv().is_err(),
            "nothing more to the first owner"
        );
    }
}
