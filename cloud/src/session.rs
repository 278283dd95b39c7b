//! One edge's session: the logical streams that outlive any QUIC connection.
//!
//! A [`Session`] is created by a hello whose resume token names a state of the
//! edge the cloud has no session for (see [`admission`](crate::admission)).
//! It holds the edge's current connection (if any), its admission [`Gate`]
//! (the token and the newest attached attempt), and every open logical
//! stream. Each stream has a task that attaches
//! it to the current connection (opening a QUIC stream, exchanging `Attach`)
//! and, when that connection dies, waits for the next one: a resume re-attaches
//! every stream and both ends replay what the other has not delivered. When
//! the session ends (grace expired, edge restarted, cloud shutting down) every
//! stream is reset with a clear reason.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use tether_proto::frame::ResetCode;
use tether_proto::io::{drive, PeerAttach, ResumableIo, SharedStream};
use tether_proto::route::StreamKind;
use tether_proto::stream::{StreamLimits, StreamState};
use tether_proto::token::SessionId;
use tether_proto::{Limits, StreamId};
use tokio::sync::watch;
use tracing::{debug, info, warn, Instrument};

use crate::admission::{Claim, Gate, Superseded, Verdict};

/// The session's link to its edge.
#[derive(Clone)]
pub enum Link {
    /// Attached to a live connection; `gen` increases with every connection.
    Connected { gen: u64, conn: quinn::Connection },
    /// The last connection died; streams wait for a resume until the grace
    /// period ends.
    Disconnected { gen: u64, since: Instant },
    /// Over: streams were reset with this reason.
    Ended(String),
}

/// Why a stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("edge {node} has {open} open streams, the limit (--max-streams-per-edge)")]
    TooManyStreams { node: String, open: usize },
    #[error("edge {node}'s session has ended: {reason}")]
    Ended { node: String, reason: String },
    /// This replica is draining and told the edge to move: its next streams
    /// go through whichever replica the edge reaches next.
    #[error("edge {node} is moving to another replica (this one is draining)")]
    Moving { node: String },
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
}

/// One edge node's session.
pub struct Session {
    pub node: String,
    pub id: SessionId,
    /// The cloud's limits (what this session's streams use).
    limits: Limits,
    link: watch::Sender<Link>,
    book: Mutex<Book>,
    streams: Mutex<HashMap<StreamId, Arc<SharedStream>>>,
    next_stream: AtomicU64,
    next_gen: AtomicU64,
    /// Set once the edge is told to move (drain): no new stream starts here.
    moving: std::sync::atomic::AtomicBool,
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
        let (link, _) = watch::channel(Link::Disconnected {
            gen: 0,
            since: Instant::now(),
        });
        Ok(Arc::new(Session {
            node,
            id: SessionId::generate()?,
            limits,
            link,
            book: Mutex::new(Book {
                gate: Gate::new(claim),
                addresses,
                connected_since: SystemTime::now(),
            }),
            streams: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            next_gen: AtomicU64::new(1),
            moving: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, HashMap<StreamId, Arc<SharedStream>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The verdict on a hello for this session: an ended session is joined
    /// by nobody.
    pub fn judge(&self, claim: &Claim) -> Verdict {
        if self.is_ended() {
            return Verdict::NewSession;
        }
        self.book().gate.judge(claim)
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

    /// Ids of the open streams.
    pub fn stream_ids(&self) -> Vec<StreamId> {
        let mut v: Vec<_> = self.streams().keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// If no stream is open, marks the session as moving — from then on
    /// [`Session::open_stream`] refuses with [`OpenError::Moving`] — and
    /// returns true. Atomic with stream opening, so no stream can start
    /// between the check and the edge being told to move.
    pub fn try_begin_move(&self) -> bool {
        let streams = self.streams();
        if !streams.is_empty() {
            return false;
        }
        self.moving.store(true, Ordering::Relaxed);
        true
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

    /// The live connection, if any.
    pub fn connection(&self) -> Option<quinn::Connection> {
        match &*self.link.borrow() {
            Link::Connected { conn, .. } => Some(conn.clone()),
            _ => None,
        }
    }

    /// Attaches the connection the edge committed to (`claim`'s); returns
    /// its generation. Streams waiting for a connection re-attach to it; a
    /// previous live connection is closed. Refused, leaving everything as it
    /// was, when the session has ended (it was replaced or expired meanwhile)
    /// or a newer connection of the edge is attached already.
    pub fn attach_connection(
        &self,
        conn: quinn::Connection,
        claim: &Claim,
    ) -> Result<u64, AttachError> {
        let mut book = self.book();
        book.gate.may_commit(claim)?;
        let gen = self.next_gen.fetch_add(1, Ordering::Relaxed);
        let mut ended = None;
        let mut old = None;
        // Check and replace in one step: `end` may run concurrently.
        self.link.send_if_modified(|l| {
            if let Link::Ended(reason) = l {
                ended = Some(reason.clone());
                return false;
            }
            old = Some(std::mem::replace(l, Link::Connected { gen, conn }));
            true
        });
        if let Some(reason) = ended {
            return Err(AttachError::Ended(reason));
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
        Ok(gen)
    }

    /// The connection of generation `gen` died. Returns true if it was the
    /// current one (the session is now waiting for a resume).
    pub fn connection_lost(&self, gen: u64) -> bool {
        self.link.send_if_modified(|l| match l {
            Link::Connected { gen: g, .. } if *g == gen => {
                *l = Link::Disconnected {
                    gen,
                    since: Instant::now(),
                };
                true
            }
            _ => false,
        })
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
    /// at once; bytes flow when a connection is attached.
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
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let shared = SharedStream::new(StreamState::new(id, StreamLimits::from(&self.limits)));
        {
            let mut streams = self.streams();
            if self.moving.load(Ordering::Relaxed) {
                return Err(OpenError::Moving {
                    node: self.node.clone(),
                });
            }
            if streams.len() >= self.limits.max_streams_per_edge as usize {
                return Err(OpenError::TooManyStreams {
                    node: self.node.clone(),
                    open: streams.len(),
                });
            }
            streams.insert(id, shared.clone());
        }
        let span =
            tracing::info_span!("stream", node = %self.node, stream = id, kind = kind.as_str());
        tokio::spawn(self.clone().run_stream(id, shared.clone()).instrument(span));
        Ok((id, ResumableIo::new(shared)))
    }

    /// Attaches a stream to each connection in turn until it is done, reset,
    /// or the session ends.
    async fn run_stream(self: Arc<Self>, id: StreamId, shared: Arc<SharedStream>) {
        let mut rx = self.link.subscribe();
        let mut last_gen = 0u64;
        // The first transport of a new stream needs no round trip: the request
        // head follows our Attach at once (see `PeerAttach::Fresh`).
        let mut peer = PeerAttach::Fresh;
        let max_frame = self.limits.max_frame_bytes as usize;
        loop {
            // Wait for a connection newer than the one that failed us.
            let conn = loop {
                let link = rx.borrow_and_update().clone();
                match link {
                    Link::Connected { gen, conn } if gen > last_gen => break Some((gen, conn)),
                    Link::Ended(_) => break None,
                    _ => {}
                }
                if shared.is_done() {
                    break None;
                }
                tokio::select! {
                    r = rx.changed() => if r.is_err() { break None },
                    _ = shared.wait_done() => break None,
                }
            };
            let Some((gen, conn)) = conn else { break };
            last_gen = gen;
            let (send, recv) = match conn.open_bi().await {
                Ok(s) => s,
                Err(e) => {
                    debug!(error = %e, "opening a QUIC stream failed; waiting for the next connection");
                    continue;
                }
            };
            let attach = std::mem::replace(&mut peer, PeerAttach::Read);
            match drive(shared.clone(), recv, send, attach, max_frame).await {
                Ok(()) => break,
                Err(e) => {
                    if shared.is_done() {
                        break;
                    }
                    // The stream stays; a pending reset goes out on the next
                    // connection, data is replayed there.
                    debug!(error = %e, "stream detached; waiting for the edge to resume");
                }
            }
        }
        self.streams().remove(&id);
        if let Link::Ended(reason) = &*self.link.borrow() {
            shared.reset(ResetCode::SessionLost, reason.clone());
        }
        debug!("stream closed");
    }

    /// Logs and resets one stream that the edge refused to re-attach.
    pub fn drop_stream(&self, id: StreamId, why: &str) {
        if let Some(s) = self.streams().remove(&id) {
            warn!(node = %self.node, stream = id, %why, "dropping stream");
            s.reset(ResetCode::UnknownStream, why);
        }
    }
}
