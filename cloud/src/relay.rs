//! The relay: a logical stream's QUIC stream spliced through the replica
//! that holds the edge's connection (the *holder*) for the replica that owns
//! the stream (the *owner*: the apiserver's connection arrived there).
//!
//! The owner keeps the stream's whole state (offsets, replay buffer) and runs
//! the resumable stream protocol end to end with the edge; the holder keeps
//! nothing but the splice. The owner opens one bidirectional QUIC stream on
//! the peer link it dialled to the holder and writes a [`SpliceHeader`]
//! (magic, node, session, stream id); the holder answers one [`Answer`]:
//! `Open` — it opened a QUIC stream on the edge's connection and from then on
//! copies bytes both ways untouched, QUIC flow control on both links giving
//! backpressure end to end — or `NotHere` / `Ended` with a message.
//!
//! **Datagram copies.** The holder cannot apply a copy of an interactive
//! write (it keeps no stream state), so a relayed stream's copies cross the
//! peer link as relayed copies ([`tether_proto::copies`]): the owner's go
//! to the holder, which sends them on to the edge on the edge's connection
//! ([`Registry::copy_to_edge`]); while it splices a stream the holder sends
//! the edge's copies of it back to the owner on the link the owner opened
//! the splice on ([`crate::session::Session::splicing`]).
//!
//! **Never relayed twice, by construction.** The holder splices only to edges
//! connected to *itself* ([`crate::registry::Registry::local_session`]),
//! never to what it learnt about other replicas.
//!
//! When the splice breaks the holder tells each side what happened, as QUIC
//! stream error codes: the edge's end is reset with
//! [`stream_code::DETACHED`] when the owner is still there (only this
//! transport broke: the owner re-attaches the stream wherever the edge is) and
//! [`stream_code::OWNER_GONE`] when the peer link to the owner died (nobody
//! will re-attach it: the edge ends the stream at once); the owner's end is
//! reset with `DETACHED` when the edge's connection died, and the owner waits
//! for the edge to come back (here or anywhere).
//!
//! **The owner leaving ends the splice**, however the edge reads. A write to
//! the edge waits for the edge's flow-control credit only while the owner is
//! there: an edge that stops reading (a pod that does not read its stdin, or
//! an edge that never reads) does not hold the splice, its task and the
//! owner's peer-link stream past the owner. When the owner's peer link is
//! lost the edge's end is reset at once (`OWNER_GONE`; `DETACHED` when this
//! replica closed the link as it exits). When the owner stopped reading, the
//! edge gets `--peer-timeout` to take the owner's last bytes, then its end is
//! reset `DETACHED` and the owner's stream is let go. When the edge had
//! finished its own direction and the owner received all of it, the owner
//! is done with the edge: the edge is cut the same way once a write to it
//! waits `--peer-timeout` without the edge taking a byte (a slow edge that
//! reads is not cut).

use std::io;
use std::time::Duration;

use futures_util::FutureExt;
use tether_proto::copies::CopyLink;
use tether_proto::handshake::stream_code;
use tether_proto::ops::ByteCounters;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::watch;
use tracing::{debug, info, Instrument};

use crate::metrics::CloudMetrics;
use crate::registry::Registry;

/// First bytes of a relay stream.
pub const RELAY_MAGIC: &[u8; 4] = b"TPR2";
/// Longest node name in a relay header (a DNS subdomain name).
const MAX_NODE: usize = 253;
/// Longest message in an answer.
const MAX_MESSAGE: usize = 1024;
/// Largest chunk the holder's splice takes from one stream at a time.
const PIPE_CHUNK: usize = 64 * 1024;

/// What the owner asks the holder for: a QUIC stream to `node`'s edge, for
/// stream `stream` of session `session`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpliceHeader {
    pub node: String,
    pub session: u64,
    pub stream: u64,
}

/// Why a relay header or answer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("not a relay stream")]
    BadMagic,
    #[error("node name of {0} bytes (at most {MAX_NODE})")]
    NodeTooLong(usize),
    #[error("a name or message that is not UTF-8")]
    NotUtf8,
    #[error("unknown answer {0}")]
    BadAnswer(u8),
    #[error("message of {0} bytes (at most {MAX_MESSAGE})")]
    MessageTooLong(usize),
    #[error("peer link: {0}")]
    Io(#[from] io::Error),
    #[error("opening a stream on the peer link: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("replica {replica} did not answer within {timeout:?} (--peer-timeout)")]
    Timeout { replica: String, timeout: Duration },
    #[error(
        "no stream to replica {replica} within {timeout:?} (--peer-timeout): every stream \
         it allows on the peer link is open (its --peer-max-streams)"
    )]
    NoStreamCredit { replica: String, timeout: Duration },
}

impl SpliceHeader {
    /// The header's bytes: magic, name length (u16 BE), name, session (u64
    /// BE), stream (u64 BE).
    pub fn encode(&self) -> Vec<u8> {
        let name = &self.node.as_bytes()[..self.node.len().min(MAX_NODE)];
        let mut v = Vec::with_capacity(22 + name.len());
        v.extend_from_slice(RELAY_MAGIC);
        v.extend_from_slice(&(name.len() as u16).to_be_bytes());
        v.extend_from_slice(name);
        v.extend_from_slice(&self.session.to_be_bytes());
        v.extend_from_slice(&self.stream.to_be_bytes());
        v
    }

    /// Reads a header whose magic has already been read.
    pub async fn read_after_magic<R: AsyncRead + Unpin>(r: &mut R) -> Result<Self, RelayError> {
        let len = r.read_u16().await? as usize;
        if len > MAX_NODE {
            return Err(RelayError::NodeTooLong(len));
        }
        let mut name = vec![0u8; len];
        r.read_exact(&mut name).await?;
        let node = String::from_utf8(name).map_err(|_| RelayError::NotUtf8)?;
        let session = r.read_u64().await?;
        let stream = r.read_u64().await?;
        Ok(SpliceHeader {
            node,
            session,
            stream,
        })
    }
}

/// The holder's answer to a splice header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The stream to the edge is open: bytes follow.
    Open,
    /// The edge is not connected to this replica (now).
    NotHere(String),
    /// The edge is connected here in another session: the one named is gone.
    Ended(String),
}

impl Answer {
    /// Status byte, then (not for `Open`) a u16 BE length and the message.
    pub fn encode(&self) -> Vec<u8> {
        let (code, msg) = match self {
            Answer::Open => return vec![0],
            Answer::NotHere(m) => (1, m),
            Answer::Ended(m) => (3, m),
        };
        let mut m = msg.as_bytes();
        if m.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !msg.is_char_boundary(end) {
                end -= 1;
            }
            m = &m[..end];
        }
        let mut v = vec![code];
        v.extend_from_slice(&(m.len() as u16).to_be_bytes());
        v.extend_from_slice(m);
        v
    }

    /// Reads one answer.
    pub async fn read<R: AsyncRead + Unpin>(r: &mut R) -> Result<Self, RelayError> {
        let code = r.read_u8().await?;
        if code == 0 {
            return Ok(Answer::Open);
        }
        if code != 1 && code != 3 {
            return Err(RelayError::BadAnswer(code));
        }
        let len = r.read_u16().await? as usize;
        if len > MAX_MESSAGE {
            return Err(RelayError::MessageTooLong(len));
        }
        let mut m = vec![0u8; len];
        r.read_exact(&mut m).await?;
        let m = String::from_utf8(m).map_err(|_| RelayError::NotUtf8)?;
        Ok(match code {
            1 => Answer::NotHere(m),
            _ => Answer::Ended(m),
        })
    }
}

/// Owner side: asks the holder on `conn` for a splice to the edge. Bounded by
/// `timeout` up to the answer; on `Open` the returned QUIC stream pair is the
/// stream's transport to the edge.
pub async fn splice_open(
    conn: &quinn::Connection,
    replica: &str,
    header: &SpliceHeader,
    timeout: Duration,
) -> Result<Result<(quinn::SendStream, quinn::RecvStream), Answer>, RelayError> {
    let start = tokio::time::Instant::now();
    // Waiting for the stream itself is waiting for the holder's stream credit:
    // told apart from a holder that does not answer.
    let (mut send, mut recv) = tokio::time::timeout(timeout, conn.open_bi())
        .await
        .map_err(|_| RelayError::NoStreamCredit {
            replica: replica.to_string(),
            timeout,
        })??;
    let attempt = async {
        send.write_all(&header.encode())
            .await
            .map_err(io::Error::from)?;
        Ok::<_, RelayError>(match Answer::read(&mut recv).await? {
            Answer::Open => Ok((send, recv)),
            other => Err(other),
        })
    };
    tokio::time::timeout_at(start + timeout, attempt)
        .await
        .map_err(|_| RelayError::Timeout {
            replica: replica.to_string(),
            timeout,
        })?
}

/// Holder side: serves one splice stream whose magic has been read, to this
/// replica's **own** edge connections only.
pub async fn serve(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    registry: std::sync::Arc<Registry>,
    metrics: CloudMetrics,
    owner_copies: std::sync::Arc<CopyLink>,
    peer: String,
    timeout: Duration,
) {
    let header =
        match tokio::time::timeout(timeout, SpliceHeader::read_after_magic(&mut recv)).await {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => {
                info!(%peer, error = %e, "refusing a bad relay stream from a peer");
                let _ = send.reset(stream_code::DETACHED.into());
                return;
            }
            Err(_) => {
                info!(%peer, ?timeout, "no relay header in time");
                let _ = send.reset(stream_code::DETACHED.into());
                return;
            }
        };
    let span = tracing::info_span!("splice", %peer, node = %header.node.escape_debug(), stream = %format_args!("{:x}", header.stream));
    async move {
        let refuse = |a: Answer, why: &'static str| {
            metrics.relay_refused(why);
            a.encode()
        };
        let session = registry.local_session(&header.node);
        let conn = match &session {
            Some(s) if s.id.0 != header.session => {
                let a = refuse(
                    Answer::Ended(format!(
                        "edge {} is connected to replica in another session (it restarted or lost its state)",
                        header.node
                    )),
                    "ended",
                );
                send_refusal(&mut send, &a, timeout).await;
                return;
            }
            Some(s) => s.connection(),
            None => None,
        };
        let Some(conn) = conn else {
            debug!("splice for an edge not connected here");
            let a = refuse(
                Answer::NotHere(format!(
                    "edge {} is not connected to this replica",
                    header.node
                )),
                "not_here",
            );
            send_refusal(&mut send, &a, timeout).await;
            return;
        };
        // Waiting for the edge's stream credit, within what the owner waits
        // for the answer: past it the owner has given up, and the peer-link
        // stream (one of its `--peer-max-streams`) is let go.
        let opened = match tokio::time::timeout(timeout, conn.open_bi()).await {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => Err(format!("edge {}'s connection: {e}", header.node)),
            Err(_) => {
                info!(?timeout, "the edge granted no stream for a splice in time");
                Err(format!(
                    "edge {} granted no QUIC stream within {timeout:?} (--peer-timeout)",
                    header.node
                ))
            }
        };
        let (edge_send, edge_recv) = match opened {
            Ok(p) => p,
            Err(m) => {
                let a = refuse(Answer::NotHere(m), "not_here");
                send_refusal(&mut send, &a, timeout).await;
                return;
            }
        };
        match tokio::time::timeout(timeout, send.write_all(&Answer::Open.encode())).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                let _ = send.reset(stream_code::DETACHED.into());
                return;
            }
        }
        metrics
            .relayed_streams
            .get_or_create(&crate::metrics::RoleLabel { role: "holder" })
            .inc();
        // The edge's copies of this stream go to its owner while it is spliced.
        let _copies = session.map(|s| s.splicing(header.stream, owner_copies));
        splice(
            (recv, send),
            (edge_recv, edge_send),
            metrics.relayed_bytes.clone(),
            timeout,
        )
        .await;
    }
    .instrument(span)
    .await
}

/// Writes a refusal and ends the stream, within `timeout`: an owner that
/// gave up reads nothing more, and the stream is let go either way.
async fn send_refusal(send: &mut quinn::SendStream, answer: &[u8], timeout: Duration) {
    match tokio::time::timeout(timeout, send.write_all(answer)).await {
        Ok(Ok(())) => {
            let _ = send.finish();
        }
        Ok(Err(_)) => {}
        Err(_) => {
            let _ = send.reset(stream_code::DETACHED.into());
        }
    }
}

/// How the owner left, as the edge→owner direction saw it on the owner's
/// stream; the owner→edge direction cuts the edge's end accordingly
/// ([`OwnerWatch`]).
#[derive(Debug, Clone)]
enum OwnerLeft {
    /// Still there, as far as this splice knows.
    Here,
    /// The owner stopped reading: it lives and let the stream go. The edge
    /// gets `grace` to take its last bytes (a `Reset` and its reason).
    Stopped,
    /// The edge had finished its direction and the owner has received all
    /// of it (it acknowledged the end): nothing more is coming for the owner
    /// and it ends its own side by itself. The edge gets `grace` to take the
    /// owner's last bytes, renewed by every byte it takes: a slow edge is not
    /// cut, one that takes nothing is.
    Received,
    /// The owner's peer link was lost (or closed by this replica as it
    /// exits): nobody takes the edge's bytes or re-attaches the stream
    /// through this splice, and the edge is told at once.
    LinkLost(quinn::ConnectionError),
}

impl OwnerLeft {
    /// What the owner's stream being stopped (`stopped()` on our send end)
    /// says; `finished`: we had finished that end (the edge finished).
    fn from_stopped(
        why: Result<Option<quinn::VarInt>, quinn::StoppedError>,
        finished: bool,
    ) -> Self {
        match why {
            Err(quinn::StoppedError::ConnectionLost(e)) => OwnerLeft::LinkLost(e),
            // Finished by us, and every byte of it acknowledged by the owner.
            Ok(None) if finished => OwnerLeft::Received,
            _ => OwnerLeft::Stopped,
        }
    }
}

/// When the owner→edge direction cuts the edge's end: watches the owner
/// leaving ([`OwnerLeft`]) and times the edge's grace.
struct OwnerWatch {
    left: watch::Receiver<OwnerLeft>,
    /// Until the owner left, or the other direction ended without seeing it.
    watching: bool,
    /// Whether the grace runs only while a write waits, renewed by each
    /// byte the edge takes (`Received`), or from the owner's leaving on.
    stall_only: bool,
    /// The grace's end, once the owner left (none in the common case).
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    grace: Duration,
}

impl OwnerWatch {
    fn new(left: watch::Receiver<OwnerLeft>, grace: Duration) -> Self {
        OwnerWatch {
            left,
            watching: true,
            stall_only: false,
            deadline: None,
            grace,
        }
    }

    /// A write to the edge is about to wait for its credit: when the grace
    /// counts the edge's stall, it starts (again) now.
    fn writing(&mut self) {
        if self.stall_only {
            if let Some(d) = self.deadline.as_mut() {
                d.as_mut().reset(tokio::time::Instant::now() + self.grace);
            }
        }
    }

    /// Completes when the edge's end is to be cut: at once when the owner's
    /// link is lost (with the error), `grace` after the owner stopped
    /// reading, and `grace` into a write (`writing`) that the edge takes
    /// nothing of once it finished and the owner received it all. Never
    /// when the other direction ended without seeing the owner leave (the
    /// edge's end failed). Cancel safe.
    async fn cut(&mut self, writing: bool) -> Option<quinn::ConnectionError> {
        loop {
            let timed = self.deadline.is_some() && (writing || !self.stall_only);
            tokio::select! {
                changed = self.left.changed(), if self.watching => {
                    if changed.is_err() {
                        self.watching = false;
                        continue;
                    }
                    let left = self.left.borrow_and_update().clone();
                    match left {
                        OwnerLeft::Here => {}
                        OwnerLeft::LinkLost(e) => return Some(e),
                        OwnerLeft::Stopped | OwnerLeft::Received => {
                            self.watching = false;
                            self.stall_only = matches!(left, OwnerLeft::Received);
                            self.deadline = Some(Box::pin(tokio::time::sleep(self.grace)));
                        }
                    }
                }
                () = expired(&mut self.deadline), if timed => return None,
                else => std::future::pending::<()>().await,
            }
        }
    }
}

/// Completes when `deadline` is set and has passed.
async fn expired(deadline: &mut Option<std::pin::Pin<Box<tokio::time::Sleep>>>) {
    match deadline {
        Some(d) => d.await,
        None => std::future::pending().await,
    }
}

/// Copies the owner's bytes to the edge until the owner finishes, then
/// finishes the edge's end; a failed read from the owner resets the edge's
/// end, a failed write to the edge stops the owner's, and when the edge
/// stops reading the owner's end gets `grace` ([`end_after_stop`]).
///
/// A write waits for the edge's flow-control credit for as long as the edge
/// takes to read (a pod that reads its stdin slowly is not cut), but not
/// past the owner ([`OwnerWatch`], told by the other direction): once the
/// owner's link is lost the edge is cut at once; once the owner stopped
/// reading the edge gets `grace` to take the owner's last bytes (a `Reset`
/// and its reason); once the edge finished its own direction and the owner
/// received all of it, the edge gets `grace` for each stretch of a write in
/// which it takes nothing. Then it is cut ([`cut_edge`]). Before, an edge
/// that never read kept this task, the bytes it had taken and the owner's
/// stream until the edge's connection closed, one of the peer link's
/// `--peer-max-streams` with each.
async fn owner_to_edge(
    mut from: quinn::RecvStream,
    mut to: quinn::SendStream,
    counter: prometheus_client::metrics::counter::Counter,
    owner_left: watch::Receiver<OwnerLeft>,
    grace: Duration,
) {
    let mut owner = OwnerWatch::new(owner_left, grace);
    let edge_stopped = to.stopped();
    tokio::pin!(edge_stopped);
    let mut watch_stop = true;
    // quinn's own received chunks pass on as they are: no copy, and no buffer
    // of the splice's own for as long as the stream lives (two 64 KiB buffers
    // per relayed stream before, most of them idle: a `logs -f`, a shell).
    loop {
        let read = tokio::select! {
            read = from.read_chunk(PIPE_CHUNK, true) => read,
            why = &mut edge_stopped, if watch_stop => {
                if why.is_err() {
                    // The edge's connection is going: the write below fails.
                    watch_stop = false;
                    continue;
                }
                debug!(?why, "the edge stopped reading; ending this direction");
                return end_after_stop(from, to, grace).await;
            }
            lost = owner.cut(false) => return cut_edge(from, to, lost.as_ref()),
        };
        let chunk = match read {
            Ok(Some(chunk)) => chunk,
            Ok(None) => {
                let _ = to.finish();
                return;
            }
            Err(e) => {
                let code = match &e {
                    quinn::ReadError::ConnectionLost(c) => edge_code_after_owner_link(c),
                    _ => stream_code::DETACHED,
                };
                debug!(error = %e, code, "splice broke; resetting the edge's end");
                let _ = to.reset(code.into());
                return;
            }
        };
        let n = chunk.bytes.len() as u64;
        // Only the owner's watch, not the owner's stream, is watched while
        // the write waits: quinn's `received_reset` would leave its waker
        // behind on a stream whose bytes are all buffered (a leak, and a
        // debug assertion when the stream is then read to its end). The
        // chunk goes in as much of it as the edge's credit allows at a time
        // (no copy), so that each byte the edge takes is seen.
        let mut rest = [chunk.bytes];
        while !rest[0].is_empty() {
            owner.writing();
            let written = tokio::select! {
                written = to.write_chunks(&mut rest) => written,
                lost = owner.cut(true) => return cut_edge(from, to, lost.as_ref()),
            };
            if written.is_err() {
                let _ = from.stop(stream_code::DETACHED.into());
                return;
            }
        }
        counter.inc_by(n);
    }
}

/// What the edge's end is reset with when the owner's link is lost: the
/// owner is gone (nobody will re-attach the stream) unless this replica
/// closed the link itself, which happens only as it exits (its edges then
/// lose their connections too and the owners re-attach elsewhere).
fn edge_code_after_owner_link(e: &quinn::ConnectionError) -> u32 {
    if matches!(e, quinn::ConnectionError::LocallyClosed) {
        stream_code::DETACHED
    } else {
        stream_code::OWNER_GONE
    }
}

/// The owner left: its link was lost (`lost`: cut at once), or the edge did
/// not take its last bytes within the grace. The edge's end is reset
/// (`DETACHED`: the owner lives and the stream is the edge's to resume;
/// `OWNER_GONE` when the owner's link was lost), and the owner's stream is
/// let go so that the peer link counts it closed: a reset the owner sent is
/// read (quinn frees a reset stream and announces its credit when the reset
/// is read; stopped instead, the stream is freed without a word to the owner
/// and its credit waits for the owner's next packet), anything else is
/// stopped.
fn cut_edge(
    mut from: quinn::RecvStream,
    mut to: quinn::SendStream,
    lost: Option<&quinn::ConnectionError>,
) {
    let code = match lost {
        // Nothing to let go on a lost link.
        Some(e) => edge_code_after_owner_link(e),
        None => match from.received_reset().now_or_never() {
            Some(Ok(Some(_))) => stream_code::DETACHED,
            Some(Err(quinn::ResetError::ConnectionLost(e))) => edge_code_after_owner_link(&e),
            // Not reset (the pending check's waker goes with the stop).
            _ => {
                let _ = from.stop(stream_code::DETACHED.into());
                stream_code::DETACHED
            }
        },
    };
    debug!(
        code,
        lost = lost.is_some(),
        "the owner left; cutting the edge's end"
    );
    let _ = to.reset(code.into());
}

/// The reader of `to` stopped it (or the owner's link was lost under it):
/// `to` is let go at once, without waiting for `from` to send again, and
/// `from` is given `grace` to end on its own before it is stopped: its
/// sender has the other direction's last bytes to read first (a reset and
/// its reason), which a stop arriving at once could beat.
async fn end_after_stop(mut from: quinn::RecvStream, to: quinn::SendStream, grace: Duration) {
    drop(to);
    let drained = tokio::time::timeout(grace, async {
        while let Ok(Some(_)) = from.read_chunk(PIPE_CHUNK, true).await {}
    })
    .await;
    if drained.is_err() {
        let _ = from.stop(stream_code::DETACHED.into());
    }
}

/// Copies the edge's bytes to the owner until the edge finishes, then
/// finishes the owner's end; a failed read from the edge resets the owner's
/// end `DETACHED` (the edge's connection died: the owner waits for it to
/// come back), a failed write to the owner stops the edge's.
///
/// When the owner stops reading or its peer link is lost, the owner has
/// left: the other direction is told how (`owner_left`), and the owner's end
/// is let go at once, without waiting for the edge to send again: an owner
/// whose client left stops reading, while the edge may stay silent for as
/// long as the pod writes nothing (a `logs -f`), and until then the splice
/// held one of the peer link's streams. The edge's end then gets `grace`
/// to end on its own ([`end_after_stop`]; for a link lost the other
/// direction has told it `OWNER_GONE`).
///
/// Once the edge finished, the owner's end is still watched for as long as
/// the other direction runs: the owner stopping it, receiving all of it
/// ([`OwnerLeft::Received`]) or its link being lost is told the same way.
/// Before, this direction ended with the edge's finish and the other was
/// never told: an edge that finished and then never read kept the splice,
/// the bytes it had taken and the owner's stream (one of the peer link's
/// `--peer-max-streams`) past the owner, until its connection closed.
async fn edge_to_owner(
    mut from: quinn::RecvStream,
    mut to: quinn::SendStream,
    counter: prometheus_client::metrics::counter::Counter,
    owner_left: watch::Sender<OwnerLeft>,
    grace: Duration,
) {
    let stopped = to.stopped();
    tokio::pin!(stopped);
    loop {
        let read = tokio::select! {
            read = from.read_chunk(PIPE_CHUNK, true) => read,
            why = &mut stopped => {
                debug!(?why, "the owner left; ending this direction");
                owner_left.send_replace(OwnerLeft::from_stopped(why, false));
                return end_after_stop(from, to, grace).await;
            }
        };
        match read {
            Ok(Some(chunk)) => {
                let n = chunk.bytes.len();
                if let Err(e) = to.write_chunk(chunk.bytes).await {
                    owner_left.send_replace(match e {
                        quinn::WriteError::ConnectionLost(e) => OwnerLeft::LinkLost(e),
                        _ => OwnerLeft::Stopped,
                    });
                    let _ = from.stop(stream_code::DETACHED.into());
                    return;
                }
                counter.inc_by(n as u64);
            }
            Ok(None) => {
                let _ = to.finish();
                // Bounded by the other direction: it ends when the owner
                // finishes, the edge stops, or the edge is cut.
                let why = tokio::select! {
                    why = &mut stopped => why,
                    () = owner_left.closed() => return,
                };
                debug!(?why, "the edge had finished; the owner's end is done");
                owner_left.send_replace(OwnerLeft::from_stopped(why, true));
                return;
            }
            Err(e) => {
                debug!(error = %e, "splice broke; resetting the owner's end");
                let _ = to.reset(stream_code::DETACHED.into());
                return;
            }
        }
    }
}

/// Copies both ways between the owner's relay stream and the edge's QUIC
/// stream until both directions end.
async fn splice(
    (owner_recv, owner_send): (quinn::RecvStream, quinn::SendStream),
    (edge_recv, edge_send): (quinn::RecvStream, quinn::SendStream),
    counters: ByteCounters,
    grace: Duration,
) {
    let (left, owner_left) = watch::channel(OwnerLeft::Here);
    tokio::join!(
        owner_to_edge(
            owner_recv,
            edge_send,
            counters.sent.clone(),
            owner_left,
            grace
        ),
        edge_to_owner(
            edge_recv,
            owner_send,
            counters.received.clone(),
            left,
            grace
        ),
    );
    debug!("splice ended");
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_proto::ops::ByteCounters;

    #[tokio::test]
    async fn header_and_answer_round_trip_and_garbage_is_refused() {
        let h = SpliceHeader {
            node: "edge-1".into(),
            session: 7,
            stream: (9 << 32) | 3,
        };
        let b = h.encode();
        assert_eq!(&b[..4], RELAY_MAGIC);
        let got = SpliceHeader::read_after_magic(&mut &b[4..]).await.unwrap();
        assert_eq!(got, h);
        let mut long = Vec::new();
        long.extend_from_slice(&1000u16.to_be_bytes());
        assert!(matches!(
            SpliceHeader::read_after_magic(&mut &long[..]).await,
            Err(RelayError::NodeTooLong(1000))
        ));
        assert!(SpliceHeader::read_after_magic(&mut &b[4..12])
            .await
            .is_err());

        for a in [
            Answer::Open,
            Answer::NotHere("edge-1 is not here".into()),
            Answer::Ended(String::new()),
        ] {
            let e = a.encode();
            assert_eq!(Answer::read(&mut &e[..]).await.unwrap(), a);
        }
        assert!(matches!(
            Answer::read(&mut &[9u8][..]).await,
            Err(RelayError::BadAnswer(9))
        ));
        let huge = Answer::NotHere("é".repeat(2000)).encode();
        assert!(matches!(
            Answer::read(&mut &huge[..]).await,
            Ok(Answer::NotHere(m)) if m.len() <= MAX_MESSAGE
        ));
    }

    /// A holder whose streams are all in use and one that does not answer end
    /// a splice open apart, each within the bound and naming its cause.
    #[tokio::test]
    async fn a_peer_link_without_stream_credit_is_told_apart_from_a_silent_holder() {
        let mut t = quinn::TransportConfig::default();
        t.max_concurrent_bidi_streams(2u32.into());
        let (owner, holder, _endpoints) =
            tether_proto::testing::quic_pair_with(std::sync::Arc::new(t))
                .await
                .unwrap();
        let header = SpliceHeader {
            node: "edge-1".into(),
            session: 1,
            stream: 1,
        };
        let bound = Duration::from_millis(300);
        // The holder accepts but never answers: the open has its stream, then no answer.
        let silent = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok(pair) = holder.accept_bi().await {
                kept.push(pair);
            }
        });
        let t0 = tokio::time::Instant::now();
        let e = splice_open(&owner, "r0", &header, bound).await.unwrap_err();
        assert!(matches!(e, RelayError::Timeout { .. }), "{e}");
        assert!(t0.elapsed() < bound * 3, "{:?}", t0.elapsed());
        // A second stream uses the last credit; the third waits for credit.
        let _held = owner.open_bi().await.unwrap();
        let t0 = tokio::time::Instant::now();
        let e = splice_open(&owner, "r0", &header, bound).await.unwrap_err();
        assert!(matches!(e, RelayError::NoStreamCredit { .. }), "{e}");
        assert!(e.to_string().contains("--peer-max-streams"), "{e}");
        assert!(
            t0.elapsed() >= bound && t0.elapsed() < bound * 3,
            "{:?}",
            t0.elapsed()
        );
        silent.abort();
    }

    /// A holder whose edge grants no QUIC stream answers the owner within
    /// `--peer-timeout`, naming it, and lets the peer link's stream go (it
    /// used to wait for the edge's credit for as long as the connection
    /// lived, holding one of the owner's `--peer-max-streams`).
    #[tokio::test]
    async fn a_holder_whose_edge_grants_no_stream_answers_in_time_and_frees_the_peer_stream() {
        use tether_proto::copies::{CopyCounters, CopySettings};
        let mut none = quinn::TransportConfig::default();
        none.max_concurrent_bidi_streams(0u32.into());
        let (to_edge, _edge, _e1) =
            tether_proto::testing::quic_pair_with(std::sync::Arc::new(none))
                .await
                .unwrap();
        let session = crate::session::testing::session("edge-1");
        session
            .attach_connection(to_edge, None, &crate::session::testing::claim(), 1)
            .unwrap();
        let registry = std::sync::Arc::new(Registry::new(Duration::from_secs(60)));
        registry.insert(session.clone());
        let metrics = CloudMetrics::register(&mut prometheus_client::registry::Registry::default());
        let mut one = quinn::TransportConfig::default();
        one.max_concurrent_bidi_streams(1u32.into());
        let (owner, holder, _e2) = tether_proto::testing::quic_pair_with(std::sync::Arc::new(one))
            .await
            .unwrap();
        let bound = Duration::from_millis(300);
        let serving = tokio::spawn(async move {
            let (send, mut recv) = holder.accept_bi().await.unwrap();
            let mut magic = [0u8; 4];
            recv.read_exact(&mut magic).await.unwrap();
            assert_eq!(&magic, RELAY_MAGIC);
            let copies = CopyLink::new(
                holder.clone(),
                CopySettings::default(),
                CopyCounters::default(),
            );
            serve(send, recv, registry, metrics, copies, "r0".into(), bound).await;
            holder
        });
        let header = SpliceHeader {
            node: "edge-1".into(),
            session: session.id.0,
            stream: 1,
        };
        let wait = Duration::from_secs(10);
        let got = splice_open(&owner, "r0", &header, wait).await.unwrap();
        assert!(
            matches!(&got, Err(Answer::NotHere(m)) if m.contains("--peer-timeout")),
            "{:?}",
            got.map(|_| ())
        );
        let _holder = tokio::time::timeout(wait, serving)
            .await
            .expect("the holder let the splice go")
            .unwrap();
        let next = tokio::time::timeout(wait, owner.open_bi()).await;
        assert!(matches!(next, Ok(Ok(_))), "no stream credit back: {next:?}");
    }

    /// A splice under test: the owner's end of a peer link that allows one
    /// stream at a time, both ends of the spliced stream (the edge's already
    /// accepted, none of it read), and the holder's splice task.
    struct Spliced {
        owner: quinn::Connection,
        owner_stream: (quinn::SendStream, quinn::RecvStream),
        edge_stream: (quinn::SendStream, quinn::RecvStream),
        splicing: tokio::task::JoinHandle<()>,
        /// The holder's ends of both links, the edge's connection, the endpoints.
        _links: (
            quinn::Connection,
            quinn::Connection,
            quinn::Connection,
            Vec<quinn::Endpoint>,
        ),
    }

    /// The owner opens a stream and writes `first` (not empty: the edge sees
    /// the stream with its first bytes); the holder splices it, with `grace`,
    /// to a stream on an edge connection with `edge` as its transport.
    async fn spliced(edge: quinn::TransportConfig, first: &[u8], grace: Duration) -> Spliced {
        let mut peer_link = quinn::TransportConfig::default();
        peer_link.max_concurrent_bidi_streams(1u32.into());
        let (owner, holder, mut endpoints) =
            tether_proto::testing::quic_pair_with(std::sync::Arc::new(peer_link))
                .await
                .unwrap();
        let (to_edge, edge, more) =
            tether_proto::testing::quic_pair_with(std::sync::Arc::new(edge))
                .await
                .unwrap();
        endpoints.extend(more);
        let (mut os, or) = owner.open_bi().await.unwrap();
        os.write_all(first).await.unwrap();
        let (hs, hr) = holder.accept_bi().await.unwrap();
        let (es, er) = to_edge.open_bi().await.unwrap();
        let splicing = tokio::spawn(splice((hr, hs), (er, es), ByteCounters::default(), grace));
        let edge_stream = edge.accept_bi().await.unwrap();
        Spliced {
            owner,
            owner_stream: (os, or),
            edge_stream,
            splicing,
            _links: (holder, to_edge, edge, endpoints),
        }
    }

    /// An edge connection that grants 1 KiB of window per stream: one that
    /// never reads holds the holder's writes to it after 1 KiB.
    fn one_kib_window() -> quinn::TransportConfig {
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(1024u32.into());
        t
    }

    /// What the edge's end was reset with, waited for within `bound`.
    async fn edge_told(edge_recv: &mut quinn::RecvStream, bound: Duration) -> Option<u32> {
        match tokio::time::timeout(bound, edge_recv.received_reset()).await {
            Ok(Ok(Some(code))) => u32::try_from(code.into_inner()).ok(),
            other => panic!("the edge's end was not reset within {bound:?}: {other:?}"),
        }
    }

    /// When the owner lets a spliced stream go, the holder lets the owner's
    /// stream go at once, though the edge has nothing to send: the owner gets
    /// the peer link's stream credit back; the edge, silent past the grace,
    /// is told both ways.
    #[tokio::test]
    async fn a_splice_ends_when_the_owner_leaves_and_gives_its_stream_credit_back() {
        let mut one = quinn::TransportConfig::default();
        one.max_concurrent_bidi_streams(1u32.into());
        let bound = Duration::from_secs(5);
        let grace = Duration::from_millis(300);
        let Spliced {
            owner,
            owner_stream: (os, mut or),
            edge_stream: (mut edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one, b"hello", grace).await;
        let mut got = [0u8; 5];
        edge_recv.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        edge_send.write_all(b"world").await.unwrap();
        or.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"world");
        // The owner goes away without finishing (its client left); the edge,
        // which has not heard yet, still holds its end. The owner's stream is
        // let go at once: its credit is back before the edge's grace ends.
        drop((os, or));
        let next = tokio::time::timeout(grace, owner.open_bi()).await;
        assert!(matches!(next, Ok(Ok(_))), "no stream credit back: {next:?}");
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
        // The edge is told its stream is gone both ways.
        let rest = tokio::time::timeout(bound, edge_recv.read_to_end(1024)).await;
        assert!(matches!(rest, Ok(Ok(_))), "{rest:?}");
        let stopped = tokio::time::timeout(bound, edge_send.stopped()).await;
        assert!(matches!(stopped, Ok(Ok(Some(_)))), "{stopped:?}");
    }

    /// When the edge stops reading (its stream ended), the owner's stream is
    /// stopped though the owner has nothing more to send: after the grace,
    /// with `DETACHED`, and the splice ends.
    #[tokio::test]
    async fn a_splice_ends_when_the_edge_stops_reading_and_the_owner_is_silent() {
        let bound = Duration::from_secs(5);
        let Spliced {
            owner: _owner,
            owner_stream: (os, _or),
            edge_stream: (edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(
            quinn::TransportConfig::default(),
            b"hello",
            Duration::from_millis(300),
        )
        .await;
        let mut got = [0u8; 5];
        edge_recv.read_exact(&mut got).await.unwrap();
        drop((edge_send, edge_recv));
        let told = tokio::time::timeout(bound, os.stopped()).await;
        assert!(
            matches!(told, Ok(Ok(Some(code))) if code == stream_code::DETACHED.into()),
            "{told:?}"
        );
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
    }

    /// An edge that takes none of the owner's bytes does not keep the splice
    /// once the owner lets the stream go (finished, its reader stopped): the
    /// edge gets the grace to take the rest, then its end is reset `DETACHED`
    /// (the owner lives: a relay lost, the stream resumable) and the owner's
    /// stream is let go, its credit back. The write to the edge used to wait
    /// for as long as the edge's connection lived, holding one of the peer
    /// link's streams (no credit after 5 s, the splice never ending).
    #[tokio::test]
    async fn a_splice_to_an_edge_that_reads_nothing_ends_when_the_owner_leaves() {
        let grace = Duration::from_millis(300);
        let bound = Duration::from_secs(5);
        let Spliced {
            owner,
            owner_stream,
            edge_stream: (_edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &[7u8; 256 * 1024], grace).await;
        // The holder is now waiting for the edge's window.
        tokio::time::sleep(grace).await;
        drop(owner_stream);
        let next = tokio::time::timeout(bound, owner.open_bi()).await;
        assert!(matches!(next, Ok(Ok(_))), "no stream credit back: {next:?}");
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
        assert_eq!(
            edge_told(&mut edge_recv, bound).await,
            Some(stream_code::DETACHED)
        );
    }

    /// The same edge, and an owner that resets its stream before letting it
    /// go: the holder reads the reset while it waits for the edge, so the
    /// peer link counts the stream closed and hands its credit back at once
    /// (stopped instead, quinn frees a reset stream without a word to the
    /// owner: its credit waited for the owner's next packet); the edge's end
    /// is reset `DETACHED`, as when the reset is read between two writes.
    #[tokio::test]
    async fn a_splice_to_an_edge_that_reads_nothing_ends_when_the_owner_resets() {
        let grace = Duration::from_millis(300);
        let bound = Duration::from_secs(5);
        let Spliced {
            owner,
            owner_stream: (mut os, or),
            edge_stream: (_edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &[7u8; 256 * 1024], grace).await;
        tokio::time::sleep(grace).await;
        os.reset(0u32.into()).unwrap();
        drop((os, or));
        let next = tokio::time::timeout(bound, owner.open_bi()).await;
        assert!(matches!(next, Ok(Ok(_))), "no stream credit back: {next:?}");
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
        assert_eq!(
            edge_told(&mut edge_recv, bound).await,
            Some(stream_code::DETACHED)
        );
    }

    /// The same edge, and the owner's peer link dies: the edge is told
    /// `OWNER_GONE` at once (nobody will re-attach the stream), not only
    /// when it next reads nor once the grace has passed (the grace is for an
    /// owner that left cleanly: it is long here, and the edge is told well
    /// within it), and the splice ends once the edge lets its end go (as an
    /// edge told `OWNER_GONE` does).
    #[tokio::test]
    async fn a_splice_to_an_edge_that_reads_nothing_tells_it_when_the_owners_link_dies() {
        let grace = Duration::from_secs(30);
        let bound = Duration::from_secs(5);
        let Spliced {
            owner,
            owner_stream: _owner_stream,
            edge_stream: (edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &[7u8; 256 * 1024], grace).await;
        // The holder is now waiting for the edge's window.
        tokio::time::sleep(Duration::from_millis(300)).await;
        owner.close(0u32.into(), b"owner replica gone");
        assert_eq!(
            edge_told(&mut edge_recv, bound).await,
            Some(stream_code::OWNER_GONE)
        );
        drop(edge_send);
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
    }

    /// The same, with the owner's link closed by this replica (it exits):
    /// the edge's end is reset at once too, `DETACHED` (the owner lives and
    /// re-attaches the stream elsewhere).
    #[tokio::test]
    async fn a_splice_to_an_edge_that_reads_nothing_is_detached_at_once_when_its_holder_closes_the_link(
    ) {
        let grace = Duration::from_secs(30);
        let bound = Duration::from_secs(5);
        let Spliced {
            owner: _owner,
            owner_stream: _owner_stream,
            edge_stream: (edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &[7u8; 256 * 1024], grace).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        _links.0.close(0u32.into(), b"this replica exits");
        assert_eq!(
            edge_told(&mut edge_recv, bound).await,
            Some(stream_code::DETACHED)
        );
        drop(edge_send);
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
    }

    /// An edge that finished its own direction and then reads nothing does
    /// not keep the splice once the owner is done too (it received the
    /// edge's end and finished its own): the edge gets the grace to take the
    /// rest, then its end is reset `DETACHED` and the owner's stream is let
    /// go, its credit back. With the edge's finish the splice used to stop
    /// watching the owner, and the write to the edge waited for as long as
    /// the edge's connection lived, holding one of the peer link's streams.
    #[tokio::test]
    async fn a_splice_to_an_edge_that_finished_and_reads_nothing_ends_when_the_owner_is_done() {
        let grace = Duration::from_millis(300);
        let bound = Duration::from_secs(5);
        let Spliced {
            owner,
            owner_stream: (mut os, mut or),
            edge_stream: (mut edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &[7u8; 256 * 1024], grace).await;
        edge_send.write_all(b"bye").await.unwrap();
        edge_send.finish().unwrap();
        let got = tokio::time::timeout(bound, or.read_to_end(16)).await;
        assert!(matches!(got, Ok(Ok(ref b)) if b == b"bye"), "{got:?}");
        os.finish().unwrap();
        drop((os, or));
        let next = tokio::time::timeout(bound, owner.open_bi()).await;
        assert!(matches!(next, Ok(Ok(_))), "no stream credit back: {next:?}");
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
        assert_eq!(
            edge_told(&mut edge_recv, bound).await,
            Some(stream_code::DETACHED)
        );
    }

    /// An owner that writes and finishes at once, to an edge that reads at
    /// its own pace through a small window (the owner's bytes and its end
    /// are all buffered at the holder while it writes): every byte and the
    /// end arrive, and the splice ends cleanly. (Watching the owner's stream
    /// for a reset while a write waits failed here: quinn kept that watch's
    /// waker on a stream whose bytes were all buffered, and panicked in a
    /// debug assertion once it was read to its end.)
    #[tokio::test]
    async fn an_owner_that_finished_at_once_is_read_to_its_end_through_a_small_window() {
        let bound = Duration::from_secs(30);
        let sent: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 253) as u8).collect();
        let Spliced {
            owner: _owner,
            owner_stream: (mut os, _or),
            edge_stream: (edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &sent, Duration::from_millis(200)).await;
        os.finish().unwrap();
        let got = tokio::time::timeout(bound, edge_recv.read_to_end(sent.len()))
            .await
            .expect("the edge read everything in time")
            .unwrap();
        assert!(got == sent, "the edge got other bytes");
        drop(edge_send);
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
    }

    /// An edge that reads, however slowly, is never cut while the owner
    /// stays: the grace starts only once the owner has left. Reading 256 KiB
    /// 1 KiB at a time with a pause between reads takes several graces; every
    /// byte arrives, and the owner's finish ends the edge's stream cleanly.
    #[tokio::test]
    async fn a_slow_edge_is_not_cut_while_the_owner_stays() {
        let grace = Duration::from_millis(200);
        let bound = Duration::from_secs(30);
        let sent: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8).collect();
        let Spliced {
            owner: _owner,
            owner_stream: (mut os, mut or),
            edge_stream: (mut edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &sent, grace).await;
        let t0 = tokio::time::Instant::now();
        let mut got = Vec::with_capacity(sent.len());
        tokio::time::timeout(bound, async {
            while got.len() < sent.len() {
                let chunk = edge_recv.read_chunk(1024, true).await.unwrap().unwrap();
                got.extend_from_slice(&chunk.bytes);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the edge read everything in time");
        assert!(t0.elapsed() > grace * 4, "{:?}", t0.elapsed());
        assert!(got == sent, "the edge got other bytes");
        os.finish().unwrap();
        let end = tokio::time::timeout(bound, edge_recv.read_to_end(0)).await;
        assert!(
            matches!(end, Ok(Ok(ref rest)) if rest.is_empty()),
            "{end:?}"
        );
        edge_send.finish().unwrap();
        let end = tokio::time::timeout(bound, or.read_to_end(0)).await;
        assert!(
            matches!(end, Ok(Ok(ref rest)) if rest.is_empty()),
            "{end:?}"
        );
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
    }

    /// The same slow edge, having finished its own direction first (the
    /// owner received all of it), is not cut either while the owner stays:
    /// the grace then counts only a write the edge takes nothing of, and
    /// each of its reads renews it. Reading takes several graces; every byte
    /// arrives, and the owner's finish ends the edge's stream cleanly.
    #[tokio::test]
    async fn a_slow_edge_that_finished_is_not_cut_while_the_owner_stays() {
        let grace = Duration::from_millis(500);
        let bound = Duration::from_secs(30);
        let sent: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 247) as u8).collect();
        let Spliced {
            owner: _owner,
            owner_stream: (mut os, mut or),
            edge_stream: (mut edge_send, mut edge_recv),
            splicing,
            _links,
        } = spliced(one_kib_window(), &sent, grace).await;
        edge_send.finish().unwrap();
        let end = tokio::time::timeout(bound, or.read_to_end(0)).await;
        assert!(
            matches!(end, Ok(Ok(ref rest)) if rest.is_empty()),
            "{end:?}"
        );
        let t0 = tokio::time::Instant::now();
        let mut got = Vec::with_capacity(sent.len());
        tokio::time::timeout(bound, async {
            while got.len() < sent.len() {
                let chunk = edge_recv.read_chunk(1024, true).await.unwrap().unwrap();
                got.extend_from_slice(&chunk.bytes);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the edge read everything in time");
        assert!(t0.elapsed() > grace * 4, "{:?}", t0.elapsed());
        assert!(got == sent, "the edge got other bytes");
        os.finish().unwrap();
        let end = tokio::time::timeout(bound, edge_recv.read_to_end(0)).await;
        assert!(
            matches!(end, Ok(Ok(ref rest)) if rest.is_empty()),
            "{end:?}"
        );
        tokio::time::timeout(bound, splicing)
            .await
            .expect("the splice ended")
            .unwrap();
    }
}

#[cfg(test)]
mod link_tests {
    use std::time::Duration;

    use tether_proto::Limits;

    use crate::peer::PeerLink;
    use crate::registry::{Holder, Registry};
    use crate::routes::{EdgeRecord, Update};
    use crate::session::testing::session;

    fn record(node: &str, pods: &[&str], attached: bool, since_ms: u64) -> EdgeRecord {
        EdgeRecord {
            node: node.into(),
            session: "s".into(),
            attached,
            since_ms,
            sid: 7,
            gen: since_ms,
            limits: Limits::default(),
            pods: pods
                .iter()
                .map(|p| ("default".to_string(), p.to_string()))
                .collect(),
            addresses: vec![],
        }
    }

    #[tokio::test]
    async fn routes_learnt_from_peers_share_the_indices_and_prefer_a_live_holder() {
        let (c1, _s1, _e1) = tether_proto::testing::quic_pair().await.unwrap();
        let (c2, _s2, _e2) = tether_proto::testing::quic_pair().await.unwrap();
        let (a, b) = (PeerLink::for_test("a", c1), PeerLink::for_test("b", c2));
        let r = Registry::new(Duration::from_secs(60));
        // A pod claimed by edges held on two different replicas: 409, as on one.
        r.apply_remote(
            &a,
            Update::Upsert(vec![record("edge-1", &["dup", "p1"], true, 1)]),
        );
        r.apply_remote(
            &b,
            Update::Upsert(vec![record("edge-2", &["dup"], true, 1)]),
        );
        assert!(matches!(
            r.route_pod("default", "dup"),
            Err(crate::registry::RouteError::AmbiguousPod { .. })
        ));
        // ... and a local edge claiming it too.
        let local = session("edge-3");
        r.insert(local.clone());
        r.report_pods(
            &local,
            vec![tether_proto::handshake::PodRef {
                namespace: "default".into(),
                name: "p1".into(),
                uid: String::new(),
            }],
        );
        assert!(matches!(
            r.route_pod("default", "p1"),
            Err(crate::registry::RouteError::AmbiguousPod { .. })
        ));
        assert!(matches!(
            r.route_pod("default", "nope"),
            Err(crate::registry::RouteError::UnknownPod { .. })
        ));
        // The same node on two peers (it moved): the attached holder wins,
        // the newest if both are.
        r.apply_remote(
            &b,
            Update::Upsert(vec![record("edge-1", &["p9"], false, 5)]),
        );
        let who = |r: &Registry| match r.route_node(None, Some("edge-1"), None).unwrap().holder {
            Holder::Remote { replica, .. } => replica.name,
            Holder::Local(_) => "local".into(),
        };
        assert_eq!(who(&r), "a");
        r.apply_remote(&b, Update::Upsert(vec![record("edge-1", &["p9"], true, 5)]));
        assert_eq!(who(&r), "b");
        // A detached local session loses to a live remote holder of the node.
        r.apply_remote(&a, Update::Upsert(vec![record("edge-3", &[], true, 9)]));
        assert!(matches!(
            r.route_node(None, Some("edge-3"), None).unwrap().holder,
            Holder::Remote { .. }
        ));
        // Both "live": the newer attach wins, here or there (an edge killed
        // without a word still looks attached to its old holder).
        let (c3, _s3, _e3) = tether_proto::testing::quic_pair().await.unwrap();
        let live = session("edge-4");
        let claim = crate::session::testing::claim();
        let attached_ms = tether_proto::ticket::unix_ms();
        live.attach_connection(c3, None, &claim, attached_ms)
            .unwrap();
        r.insert(live.clone());
        r.apply_remote(
            &a,
            Update::Upsert(vec![record("edge-4", &[], true, attached_ms - 1000)]),
        );
        assert!(matches!(
            r.route_node(None, Some("edge-4"), None).unwrap().holder,
            Holder::Local(_)
        ));
        r.apply_remote(
            &a,
            Update::Upsert(vec![record("edge-4", &[], true, attached_ms + 1000)]),
        );
        assert!(matches!(
            r.route_node(None, Some("edge-4"), None).unwrap().holder,
            Holder::Remote { .. }
        ));
        // Everything learnt from a peer goes with it; counts stay right.
        r.drop_remote(b.replica.instance);
        assert_eq!(who(&r), "a");
        assert!(
            r.route_pod("default", "dup").is_ok(),
            "edge-1 alone claims it now"
        );
        r.apply_remote(&a, Update::Remove(vec!["edge-1".into()]));
        // Held nowhere now: its pods are "edge not connected" (502), not unknown.
        assert!(matches!(
            r.route_pod("default", "dup"),
            Err(crate::registry::RouteError::PodNodeGone { .. })
        ));
        assert_eq!(r.remote_len(), 2, "edge-3 and edge-4 from a");
    }
}
