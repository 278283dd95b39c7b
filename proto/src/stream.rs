//! The sans-IO state machine of one resumable logical stream.
//!
//! A logical stream is a reliable bidirectional byte pipe between the cloud and
//! the edge that survives the QUIC connection under it. This module owns its
//! bookkeeping and nothing else: no sockets, no clocks, no tasks. The tokio
//! adapter ([`crate::io`]) feeds it frames and local reads/writes and asks it
//! what to transmit, the way `quinn` drives `quinn-proto`.
//!
//! Offsets, per direction, all cumulative byte counts since the stream began:
//!
//! ```text
//! sender:    acked ≤ sent ≤ written        replay buffer = [acked, written)
//! receiver:  delivered ≤ received          receive queue = [delivered, received)
//! ```
//!
//! `delivered` means handed to the local side (read by the application);
//! acknowledgements carry it, so a byte leaves the sender's replay buffer only
//! once the far side has really taken it. When the transport dies, both ends
//! [`detach`](StreamState::detach); on a new transport each sends an
//! [`Attach`](Frame::Attach) with its `delivered` and, on receiving the peer's,
//! rewinds `sent` to the peer's `delivered` and transmits again from there. So
//! every byte arrives exactly once and in order, whatever was in flight when
//! the link died. The replay buffer is bounded ([`StreamLimits::replay_bytes`]):
//! when full, [`write_room`](StreamState::write_room) is zero and the adapter
//! stops reading its source — backpressure, not memory growth.
//!
//! The end of a direction ([`Frame::End`]) counts as acknowledged only when an
//! `Ack` says `fin_received`, so a half-close is never lost across a resume
//! either.

use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};

use crate::frame::{Frame, ResetCode, StreamId};

/// Payloads shorter than this are copied into one buffer instead of being
/// queued as their own chunk.
const COALESCE_BELOW: usize = 4096;
/// What one queued chunk costs besides its bytes (the `Bytes` handle, the
/// queue slot, the allocation's header), counted against the receive bound.
const CHUNK_OVERHEAD: usize = 64;
/// Bytes delivered between two acknowledgements while the local reader is
/// behind (see `StreamState::note_delivered`).
const ACK_EVERY: u64 = 64 * 1024;
/// Largest allocation the replay buffer makes at once.
const REPLAY_CHUNK: usize = 64 * 1024;

/// Buffer bounds of one stream (from [`crate::Limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Cap of unacknowledged bytes we keep for replay.
    pub replay_bytes: usize,
    /// Cap of received bytes not yet read locally.
    pub recv_bytes: usize,
    /// Largest payload of one `Data` frame we send.
    pub max_payload: usize,
}

impl From<&crate::Limits> for StreamLimits {
    fn from(l: &crate::Limits) -> Self {
        StreamLimits {
            replay_bytes: l.replay_buffer_bytes as usize,
            recv_bytes: l.recv_buffer_bytes as usize,
            max_payload: l.max_data_payload as usize,
        }
    }
}

/// A violation of the stream protocol by the peer (or a lost peer state).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    #[error("data at offset {got} leaves a gap after offset {expected}")]
    Gap { expected: u64, got: u64 },
    #[error("data at offset {offset} with {len} bytes overflows the stream offset")]
    OffsetOverflow { offset: u64, len: usize },
    #[error("data beyond the announced end at offset {end}")]
    DataAfterEnd { end: u64 },
    #[error("acknowledgement of offset {acked} beyond the {written} bytes written")]
    AckBeyondWritten { acked: u64, written: u64 },
    #[error("end acknowledged before it was sent")]
    FinAckedEarly,
    #[error("end moved from offset {was} to {now}")]
    EndMoved { was: u64, now: u64 },
    #[error("peer resumed at offset {peer} but had acknowledged {acked}: it lost state")]
    PeerLostState { peer: u64, acked: u64 },
    #[error("frame for stream {got} on stream {expected}")]
    WrongStream { expected: StreamId, got: StreamId },
    #[error("unexpected {0} frame on a logical stream")]
    Unexpected(&'static str),
    #[error("peer attached a new stream at offset {delivered} (fin {fin_received}); a new stream starts at 0")]
    FreshAttachMismatch { delivered: u64, fin_received: bool },
    #[error("the stream was attached before; it cannot start as new")]
    NotFresh,
    #[error("expected the peer's attach first, got {0}")]
    AttachExpected(&'static str),
}

/// What a local read gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Bytes, now counted as delivered.
    Data(Bytes),
    /// The peer's direction ended and everything was delivered.
    Eof,
    /// The stream was reset (by either side).
    Reset(ResetCode, String),
    /// Nothing yet.
    Pending,
}

/// Who reset the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ResetState {
    code: ResetCode,
    message: String,
    /// `true` if we reset it and must tell the peer.
    local: bool,
    sent: bool,
}

/// The complete state of one logical stream at one end.
#[derive(Debug)]
pub struct StreamState {
    id: StreamId,
    limits: StreamLimits,
    // Our direction.
    replay: Replay,
    acked: u64,
    sent: u64,
    written: u64,
    fin: bool,
    fin_sent: bool,
    fin_acked: bool,
    // The peer's direction.
    recv: VecDeque<Bytes>,
    /// Small payloads copied together, after everything in `recv`: a peer
    /// sending tiny frames costs its bytes, not an allocation each.
    recv_tail: BytesMut,
    delivered: u64,
    received: u64,
    peer_end: Option<u64>,
    ack_due: bool,
    /// `delivered` as of the last `Ack` sent.
    ack_sent: u64,
    fin_ack_sent: bool,
    // The local reader is gone: incoming data is counted as delivered and
    // dropped, so the peer can still finish cleanly.
    discard_incoming: bool,
    /// Bytes transmitted again after re-attaches (for metrics).
    replayed: u64,
    // Life cycle.
    attached: bool,
    /// Some transport was ever attached.
    ever_attached: bool,
    /// Attached as new ([`attach_fresh`](StreamState::attach_fresh)): the
    /// peer's `Attach` is still to come as its first frame.
    awaiting_peer_attach: bool,
    reset: Option<ResetState>,
}

impl StreamState {
    /// A new stream, not yet attached to a transport.
    pub fn new(id: StreamId, limits: StreamLimits) -> Self {
        StreamState {
            id,
            limits,
            replay: Replay::default(),
            acked: 0,
            sent: 0,
            written: 0,
            fin: false,
            fin_sent: false,
            fin_acked: false,
            recv: VecDeque::new(),
            recv_tail: BytesMut::new(),
            delivered: 0,
            received: 0,
            peer_end: None,
            ack_due: false,
            ack_sent: 0,
            fin_ack_sent: false,
            discard_incoming: false,
            replayed: 0,
            attached: false,
            ever_attached: false,
            awaiting_peer_attach: false,
            reset: None,
        }
    }

    pub fn id(&self) -> StreamId {
        self.id
    }

    /// Bytes the local side may write now (0 when the replay buffer is full,
    /// the direction is finished, or the stream is reset).
    pub fn write_room(&self) -> usize {
        if self.fin || self.reset.is_some() {
            return 0;
        }
        self.limits.replay_bytes.saturating_sub(self.replay.len())
    }

    /// Takes up to [`write_room`](Self::write_room) bytes of `data`; returns how many.
    pub fn write(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(self.write_room());
        self.replay.extend(&data[..n]);
        self.written += n as u64;
        n
    }

    /// Ends our direction after the bytes written so far.
    pub fn finish(&mut self) {
        if self.reset.is_none() {
            self.fin = true;
        }
    }

    /// Whether the local side has finished writing.
    pub fn is_finished(&self) -> bool {
        self.fin
    }

    /// Aborts the stream in both directions; the peer is told on the next
    /// transmit. A second reset, or a reset after the peer's, changes nothing.
    pub fn reset(&mut self, code: ResetCode, message: impl Into<String>) {
        if self.reset.is_none() {
            self.reset = Some(ResetState {
                code,
                message: message.into(),
                local: true,
                sent: false,
            });
        }
    }

    /// The peer lost this stream (it re-attached below what it had
    /// acknowledged): our reset was told to it outside the state machine and
    /// nothing can ever be re-attached, so the stream is over (done) instead
    /// of waiting for a transport on which to send the reset.
    pub fn abandon(&mut self) {
        if let Some(r) = &mut self.reset {
            r.sent = true;
        }
    }

    /// The reset, if any: code and message.
    pub fn reset_reason(&self) -> Option<(ResetCode, &str)> {
        self.reset.as_ref().map(|r| (r.code, r.message.as_str()))
    }

    /// Received bytes not yet read locally.
    pub fn recv_buffered(&self) -> usize {
        (self.received - self.delivered) as usize
    }

    /// Memory the receive queue holds, as counted against
    /// [`StreamLimits::recv_bytes`]: the bytes plus a fixed cost per chunk.
    pub fn recv_memory(&self) -> usize {
        self.recv_buffered() + self.recv.len() * CHUNK_OVERHEAD
    }

    /// Whether the receive queue has room for more data from the transport.
    pub fn recv_has_room(&self) -> bool {
        self.recv_memory() < self.limits.recv_bytes
    }

    /// Bytes kept for replay (written, not yet acknowledged).
    pub fn replay_buffered(&self) -> usize {
        self.replay.len()
    }

    /// The local reader is gone for good: drop what was received and count all
    /// further data as delivered, so the peer's direction can still end
    /// cleanly (used when the application finished its own direction and no
    /// longer cares about the peer's).
    pub fn discard_incoming(&mut self) {
        self.discard_incoming = true;
        self.drop_received();
    }

    fn drop_received(&mut self) {
        if self.received > self.delivered {
            self.recv.clear();
            self.recv_tail = BytesMut::new();
            self.delivered = self.received;
            self.ack_due = true;
        }
        if self.fin_received() && !self.fin_ack_sent {
            self.ack_due = true;
        }
    }

    /// Reads up to `max` delivered bytes.
    pub fn read(&mut self, max: usize) -> ReadOutcome {
        if let Some(r) = &self.reset {
            return ReadOutcome::Reset(r.code, r.message.clone());
        }
        if let Some(front) = self.recv.front_mut() {
            let chunk = if front.len() <= max {
                self.recv.pop_front().unwrap_or_default()
            } else {
                front.split_to(max)
            };
            self.delivered += chunk.len() as u64;
            self.note_delivered();
            return ReadOutcome::Data(chunk);
        }
        if !self.recv_tail.is_empty() && max > 0 {
            let n = max.min(self.recv_tail.len());
            let chunk = self.recv_tail.split_to(n).freeze();
            if self.recv_tail.is_empty() {
                // Give the allocation back rather than keep it for later.
                self.recv_tail = BytesMut::new();
            }
            self.delivered += n as u64;
            self.note_delivered();
            return ReadOutcome::Data(chunk);
        }
        if self.peer_end == Some(self.delivered) {
            if !self.fin_ack_sent {
                self.ack_due = true;
            }
            return ReadOutcome::Eof;
        }
        ReadOutcome::Pending
    }

    /// Acknowledgement cadence: an `Ack` once the local reader has caught up
    /// with everything received (so a sender waiting on its replay buffer,
    /// and every interactive exchange, is acknowledged at once), and otherwise
    /// every [`ACK_EVERY`] bytes delivered rather than after every read.
    fn note_delivered(&mut self) {
        if self.delivered == self.received || self.delivered - self.ack_sent >= ACK_EVERY {
            self.ack_due = true;
        }
    }

    fn fin_received(&self) -> bool {
        self.peer_end == Some(self.delivered)
    }

    /// Drops acknowledged bytes from the replay buffer.
    fn apply_ack(&mut self, delivered: u64, fin_received: bool) -> Result<(), StreamError> {
        if delivered > self.written {
            return Err(StreamError::AckBeyondWritten {
                acked: delivered,
                written: self.written,
            });
        }
        if fin_received && (!self.fin || delivered != self.written) {
            return Err(StreamError::FinAckedEarly);
        }
        if delivered > self.acked {
            let n = (delivered - self.acked) as usize;
            self.replay.drain(n);
            self.acked = delivered;
        }
        if self.sent < self.acked {
            self.sent = self.acked;
        }
        if fin_received {
            self.fin_acked = true;
        }
        Ok(())
    }

    /// A copy of the peer's bytes `[offset, offset + payload.len())` that came
    /// another way than the stream's own frames (a datagram, see
    /// [`crate::copies`]): taken only where it continues what was received,
    /// so the `Data` frame carrying the same bytes is a duplicate when it
    /// arrives. Anything else — a gap (an earlier frame is still missing), bytes
    /// already received, past the announced end, a reset stream, a full receive
    /// queue — is dropped: a copy is never needed, so it is never an error.
    /// Returns how many bytes it added.
    pub fn on_copy(&mut self, offset: u64, payload: &[u8]) -> usize {
        if self.reset.is_some() || offset > self.received {
            return 0;
        }
        let Some(end) = offset.checked_add(payload.len() as u64) else {
            return 0;
        };
        if end <= self.received || self.peer_end.is_some_and(|e| end > e) {
            return 0;
        }
        let fresh = &payload[(self.received - offset) as usize..];
        if self.recv_memory() + fresh.len() > self.limits.recv_bytes {
            return 0;
        }
        self.recv_tail.extend_from_slice(fresh);
        self.received = end;
        if self.discard_incoming {
            self.drop_received();
        }
        fresh.len()
    }

    /// Handles a stream frame from the peer (anything but `Attach`, except the
    /// peer's first `Attach` after [`attach_fresh`](StreamState::attach_fresh)).
    pub fn on_frame(&mut self, frame: Frame) -> Result<(), StreamError> {
        if let Some(id) = frame.stream_id() {
            if id != self.id {
                return Err(StreamError::WrongStream {
                    expected: self.id,
                    got: id,
                });
            }
        }
        if self.awaiting_peer_attach {
            let Frame::Attach {
                delivered,
                fin_received,
                ..
            } = frame
            else {
                return Err(StreamError::AttachExpected(frame.kind()));
            };
            // The peer sends its Attach before anything else on this transport,
            // so on a new stream it cannot have delivered a byte yet.
            if delivered != 0 || fin_received {
                return Err(StreamError::FreshAttachMismatch {
                    delivered,
                    fin_received,
                });
            }
            self.awaiting_peer_attach = false;
            return Ok(());
        }
        match frame {
            Frame::Data {
                offset, payload, ..
            } => {
                if self.reset.is_some() {
                    return Ok(());
                }
                let end = offset.checked_add(payload.len() as u64).ok_or(
                    StreamError::OffsetOverflow {
                        offset,
                        len: payload.len(),
                    },
                )?;
                if offset > self.received {
                    return Err(StreamError::Gap {
                        expected: self.received,
                        got: offset,
                    });
                }
                if let Some(e) = self.peer_end {
                    if end > e {
                        return Err(StreamError::DataAfterEnd { end: e });
                    }
                }
                if end > self.received {
                    let skip = (self.received - offset) as usize;
                    let fresh = &payload[skip..];
                    if fresh.len() < COALESCE_BELOW {
                        self.recv_tail.extend_from_slice(fresh);
                    } else {
                        if !self.recv_tail.is_empty() {
                            let tail = std::mem::take(&mut self.recv_tail);
                            self.recv.push_back(tail.freeze());
                        }
                        self.recv.push_back(payload.slice(skip..));
                    }
                    self.received = end;
                }
                if self.discard_incoming {
                    self.drop_received();
                }
                Ok(())
            }
            Frame::Ack {
                delivered,
                fin_received,
                ..
            } => self.apply_ack(delivered, fin_received),
            Frame::End { offset, .. } => {
                if offset < self.received {
                    return Err(StreamError::DataAfterEnd { end: offset });
                }
                if let Some(was) = self.peer_end {
                    if was != offset {
                        return Err(StreamError::EndMoved { was, now: offset });
                    }
                }
                self.peer_end = Some(offset);
                if self.discard_incoming {
                    self.drop_received();
                }
                if self.fin_received() {
                    self.ack_due = true;
                }
                Ok(())
            }
            Frame::Reset { code, message, .. } => {
                if self.reset.is_none() {
                    self.reset = Some(ResetState {
                        code,
                        message,
                        local: false,
                        sent: true,
                    });
                }
                Ok(())
            }
            other => Err(StreamError::Unexpected(other.kind())),
        }
    }

    /// The `Attach` frame to send first on a new transport.
    pub fn attach_frame(&self) -> Frame {
        Frame::Attach {
            stream: self.id,
            delivered: self.delivered,
            fin_received: self.fin_received(),
        }
    }

    /// The transport under this stream is gone; stop transmitting.
    pub fn detach(&mut self) {
        self.attached = false;
        self.awaiting_peer_attach = false;
    }

    /// Attaches a stream that has never been attached, without waiting for
    /// the peer's `Attach`: a new stream's peer has delivered nothing, so
    /// transmitting can start at once (saving a round trip on every stream
    /// open). The peer's `Attach` must then be its first frame and say offset 0
    /// ([`on_frame`](StreamState::on_frame) checks it). Re-attaches after a
    /// lost transport go through [`attach`](StreamState::attach).
    pub fn attach_fresh(&mut self) -> Result<(), StreamError> {
        if self.ever_attached {
            return Err(StreamError::NotFresh);
        }
        self.attached = true;
        self.ever_attached = true;
        self.awaiting_peer_attach = true;
        Ok(())
    }

    /// Bytes transmitted again after re-attaches, in total.
    pub fn replayed(&self) -> u64 {
        self.replayed
    }

    /// Whether a transport is attached.
    pub fn is_attached(&self) -> bool {
        self.attached
    }

    /// The peer's `Attach` arrived on a new transport: resume transmitting
    /// from what it has delivered.
    pub fn attach(
        &mut self,
        peer_delivered: u64,
        peer_fin_received: bool,
    ) -> Result<(), StreamError> {
        if peer_delivered < self.acked {
            return Err(StreamError::PeerLostState {
                peer: peer_delivered,
                acked: self.acked,
            });
        }
        // Bytes transmitted on the lost transport that the peer never
        // delivered: they go out again now.
        self.replayed += self.sent.saturating_sub(peer_delivered);
        self.apply_ack(peer_delivered, peer_fin_received)?;
        self.sent = peer_delivered;
        self.fin_sent = self.fin_acked;
        // Our `delivered` travelled in our own Attach; an ack is due if the fin
        // state must be re-confirmed, or if one fell due since that Attach was
        // made (the application reads on while the peer's Attach is under way:
        // the peer knows only the older `delivered`, and nothing it replays
        // now is new, so no later read would send one).
        self.fin_ack_sent = false;
        self.ack_due = self.ack_due || self.fin_received();
        if let Some(r) = &mut self.reset {
            r.sent = !r.local;
        }
        self.attached = true;
        self.ever_attached = true;
        self.awaiting_peer_attach = false;
        Ok(())
    }

    /// The next frame to transmit on the attached transport, if any.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        if !self.attached {
            return None;
        }
        if let Some(r) = &mut self.reset {
            if r.local && !r.sent {
                r.sent = true;
                return Some(Frame::Reset {
                    stream: self.id,
                    code: r.code,
                    message: r.message.clone(),
                });
            }
            return None;
        }
        if self.ack_due {
            self.ack_due = false;
            let fin_received = self.fin_received();
            if fin_received {
                self.fin_ack_sent = true;
            }
            self.ack_sent = self.delivered;
            return Some(Frame::Ack {
                stream: self.id,
                delivered: self.delivered,
                fin_received,
            });
        }
        if self.sent < self.written {
            let start = (self.sent - self.acked) as usize;
            let len = ((self.written - self.sent) as usize).min(self.limits.max_payload);
            let payload = self.replay.slice(start, len);
            if !payload.is_empty() {
                let offset = self.sent;
                self.sent += payload.len() as u64;
                return Some(Frame::Data {
                    stream: self.id,
                    offset,
                    payload,
                });
            }
        }
        if self.fin && !self.fin_sent {
            self.fin_sent = true;
            return Some(Frame::End {
                stream: self.id,
                offset: self.written,
            });
        }
        None
    }

    /// Both directions are over and the peer knows it: the stream can be
    /// forgotten once this is true and the last transmit went out.
    pub fn is_done(&self) -> bool {
        match &self.reset {
            Some(r) => !r.local || r.sent,
            None => self.fin_acked && self.fin_received() && self.fin_ack_sent && !self.ack_due,
        }
    }

    /// Offsets for logs and tests: (written, acked, received, delivered).
    pub fn offsets(&self) -> (u64, u64, u64, u64) {
        (self.written, self.acked, self.received, self.delivered)
    }
}

/// Our written bytes from `acked` on, kept until the peer has delivered them.
///
/// Frozen chunks first, then the bytes written since the last transmit
/// (`tail`). A `Data` frame's payload is a slice of a chunk, so transmitting
/// (and replaying) copies nothing, and the QUIC send buffer holds the same
/// memory rather than a second copy. A write copies its bytes once, into
/// `tail`; acknowledged chunks are dropped, and a drained buffer gives its
/// allocation back (an idle stream keeps nothing).
#[derive(Debug, Default)]
struct Replay {
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    frozen: usize,
    tail: BytesMut,
}

impl Replay {
    fn len(&self) -> usize {
        self.frozen + self.tail.len()
    }

    fn extend(&mut self, data: &[u8]) {
        if self.tail.capacity() - self.tail.len() < data.len() {
            // Allocations grow with what is buffered: an interactive stream
            // allocates a few bytes per keystroke, a bulk stream 64 KiB at a time.
            let want = (self.len() + data.len()).min(REPLAY_CHUNK);
            self.tail.reserve(data.len().max(want));
        }
        self.tail.extend_from_slice(data);
    }

    /// Up to `max` bytes starting `start` bytes after `acked`, without copying.
    /// `start` must be below [`len`](Self::len).
    fn slice(&mut self, start: usize, max: usize) -> Bytes {
        if start >= self.frozen && !self.tail.is_empty() {
            let t = self.tail.split().freeze();
            self.frozen += t.len();
            self.chunks.push_back(t);
        }
        let mut off = start;
        for c in &self.chunks {
            if off < c.len() {
                let n = (c.len() - off).min(max);
                return c.slice(off..off + n);
            }
            off -= c.len();
        }
        Bytes::new()
    }

    /// Drops the first `n` bytes (acknowledged by the peer).
    fn drain(&mut self, mut n: usize) {
        while n > 0 {
            if let Some(front) = self.chunks.front_mut() {
                if front.len() <= n {
                    n -= front.len();
                    self.frozen -= front.len();
                    self.chunks.pop_front();
                } else {
                    front.advance(n);
                    self.frozen -= n;
                    n = 0;
                }
            } else {
                let k = n.min(self.tail.len());
                self.tail.advance(k);
                n -= k;
                if k == 0 {
                    break;
                }
            }
        }
        if self.chunks.is_empty() && self.tail.is_empty() {
            self.tail = BytesMut::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const L: StreamLimits = StreamLimits {
        replay_bytes: 64,
        recv_bytes: 64,
        max_payload: 16,
    };

    fn pair() -> (StreamState, StreamState) {
        let mut a = StreamState::new(1, L);
        let mut b = StreamState::new(1, L);
        a.attach(0, false).unwrap();
        b.attach(0, false).unwrap();
        (a, b)
    }

    /// An Attach frame's (delivered, fin_received).
    fn offsets(f: Frame) -> (u64, bool) {
        match f {
            Frame::Attach {
                delivered,
                fin_received,
                ..
            } => (delivered, fin_received),
            other => panic!("not an attach: {other:?}"),
        }
    }

    fn pump(from: &mut StreamState, to: &mut StreamState) {
        while let Some(f) = from.poll_transmit() {
            to.on_frame(f).unwrap();
        }
    }

    fn read_all(s: &mut StreamState) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        loop {
            match s.read(usize::MAX) {
                ReadOutcome::Data(b) => out.extend_from_slice(&b),
                ReadOutcome::Eof => return (out, true),
                _ => return (out, false),
            }
        }
    }

    #[test]
    fn a_copy_continuing_the_received_bytes_is_taken_and_its_frame_then_a_duplicate() {
        let (mut a, mut b) = pair();
        assert_eq!(a.write(b"ab"), 2);
        let first = a.poll_transmit().unwrap();
        b.on_frame(first).unwrap();
        assert_eq!(a.write(b"cd"), 2);
        // The frame with "cd" is delayed (its packet lost); its copy arrives.
        let delayed = a.poll_transmit().unwrap();
        assert_eq!(b.on_copy(2, b"cd"), 2);
        assert_eq!(read_all(&mut b).0, b"abcd");
        // The frame comes later: nothing twice, and the stream goes on.
        b.on_frame(delayed).unwrap();
        assert_eq!(a.write(b"e"), 1);
        pump(&mut a, &mut b);
        assert_eq!(read_all(&mut b).0, b"e");
        assert_eq!(b.offsets().2, 5);
    }

    #[test]
    fn a_copy_that_cannot_continue_the_stream_is_dropped_not_an_error() {
        let (_, mut b) = pair();
        // A gap: an earlier frame has not arrived.
        assert_eq!(b.on_copy(3, b"xyz"), 0);
        // Already received, wholly and partly.
        assert_eq!(b.on_copy(0, b"ab"), 2);
        assert_eq!(b.on_copy(0, b"ab"), 0);
        assert_eq!(b.on_copy(1, b"bc"), 1);
        assert_eq!(read_all(&mut b).0, b"abc");
        // An offset that would overflow.
        assert_eq!(b.on_copy(u64::MAX, b"xy"), 0);
        // Beyond the announced end.
        b.on_frame(Frame::End {
            stream: 1,
            offset: 4,
        })
        .unwrap();
        assert_eq!(b.on_copy(3, b"de"), 0);
        assert_eq!(b.on_copy(3, b"d"), 1);
        assert_eq!(read_all(&mut b), (b"d".to_vec(), true));
    }

    #[test]
    fn a_copy_respects_the_receive_bound_and_a_reset() {
        let (_, mut b) = pair();
        // The queue holds at most `recv_bytes` (64): a copy that would pass it
        // is dropped; its frame is still to come and waits for room.
        assert_eq!(b.on_copy(0, &[1; 60]), 60);
        assert_eq!(b.on_copy(60, &[2; 8]), 0);
        assert_eq!(b.on_copy(60, &[2; 4]), 4);
        b.reset(ResetCode::Cancelled, "gone");
        assert_eq!(b.on_copy(64, b"x"), 0);
    }

    #[test]
    fn an_offset_that_would_overflow_is_a_protocol_error() {
        let (_, mut b) = pair();
        b.on_frame(Frame::Data {
            stream: 1,
            offset: 0,
            payload: Bytes::from_static(b"ab"),
        })
        .unwrap();
        // A peer cannot make `offset + len` wrap (a panic in debug, a bogus
        // end in release): it is refused.
        let r = b.on_frame(Frame::Data {
            stream: 1,
            offset: u64::MAX,
            payload: Bytes::from_static(b"xy"),
        });
        assert!(
            matches!(r, Err(StreamError::OffsetOverflow { .. })),
            "{r:?}"
        );
        let r = b.on_frame(Frame::Data {
            stream: 1,
            offset: 1,
            payload: Bytes::from(vec![0u8; 2]),
        });
        assert!(r.is_ok(), "an overlapping retransmit is fine: {r:?}");
        let (got, _) = read_all(&mut b);
        assert_eq!(got, b"ab\0");
    }

    #[test]
    fn small_frames_are_coalesced_and_read_in_order() {
        let (_, mut b) = pair();
        let mut offset = 0u64;
        let mut want = Vec::new();
        for (i, len) in [1usize, 2, 40, 1, 3].into_iter().enumerate() {
            let p = vec![i as u8; len];
            want.extend_from_slice(&p);
            b.on_frame(Frame::Data {
                stream: 1,
                offset,
                payload: Bytes::from(p),
            })
            .unwrap();
            offset += len as u64;
        }
        let mut got = Vec::new();
        while let ReadOutcome::Data(d) = b.read(5) {
            assert!(d.len() <= 5);
            got.extend_from_slice(&d);
        }
        assert_eq!(got, want);
    }

    #[test]
    fn bytes_flow_and_backpressure_holds() {
        let (mut a, mut b) = pair();
        assert_eq!(a.write(&[7u8; 100]), 64, "replay buffer caps writes");
        assert_eq!(a.write_room(), 0);
        pump(&mut a, &mut b);
        assert_eq!(
            a.write_room(),
            0,
            "sent but unacknowledged bytes still count"
        );
        let (got, eof) = read_all(&mut b);
        assert_eq!((got.len(), eof), (64, false));
        pump(&mut b, &mut a);
        assert_eq!(
            a.write_room(),
            64,
            "ack of delivered bytes frees the buffer"
        );
    }

    #[test]
    fn lost_frames_are_replayed_after_reattach() {
        let (mut a, mut b) = pair();
        a.write(b"hello world");
        a.finish();
        // Everything a transmits is lost with the transport.
        while a.poll_transmit().is_some() {}
        a.detach();
        b.detach();
        let (delivered, fin_received) = offsets(b.attach_frame());
        a.attach(delivered, fin_received).unwrap();
        let (delivered, fin_received) = offsets(a.attach_frame());
        b.attach(delivered, fin_received).unwrap();
        pump(&mut a, &mut b);
        assert_eq!(read_all(&mut b), (b"hello world".to_vec(), true));
    }

    #[test]
    fn an_ack_due_while_the_peers_attach_is_under_way_is_sent_after_it() {
        // b's reader is behind when the transport is lost, and catches up while
        // a's Attach is under way: the ack that fell due must still go, or a's
        // full replay buffer would never drain (nothing a replays is new to b).
        let (mut a, mut b) = pair();
        a.write(&[7; 64]);
        pump(&mut a, &mut b);
        assert_eq!(a.write_room(), 0);
        a.detach();
        b.detach();
        let (delivered, fin_received) = offsets(b.attach_frame());
        assert_eq!(delivered, 0, "b's Attach says nothing delivered yet");
        assert_eq!(read_all(&mut b), (vec![7; 64], false));
        a.attach(delivered, fin_received).unwrap();
        let (delivered, fin_received) = offsets(a.attach_frame());
        b.attach(delivered, fin_received).unwrap();
        for _ in 0..4 {
            pump(&mut a, &mut b);
            pump(&mut b, &mut a);
        }
        assert_eq!(
            a.write_room(),
            64,
            "offsets a {:?}, b {:?}",
            a.offsets(),
            b.offsets()
        );
    }

    #[test]
    fn fresh_attach_transmits_before_the_peers_attach() {
        let mut a = StreamState::new(1, L);
        let mut b = StreamState::new(1, L);
        a.write(b"GET /x");
        a.attach_fresh().unwrap();
        // a's Attach and data go out together; b (the acceptor) reads a's
        // Attach, attaches, and answers with its own before anything else.
        let (delivered, fin_received) = offsets(a.attach_frame());
        let early: Vec<Frame> = std::iter::from_fn(|| a.poll_transmit()).collect();
        assert!(!early.is_empty(), "nothing waits for the peer's attach");
        b.attach(delivered, fin_received).unwrap();
        a.on_frame(b.attach_frame()).unwrap();
        for f in early {
            b.on_frame(f).unwrap();
        }
        assert_eq!(read_all(&mut b), (b"GET /x".to_vec(), false));
        b.write(b"200");
        pump(&mut b, &mut a);
        pump(&mut a, &mut b);
        assert_eq!(read_all(&mut a), (b"200".to_vec(), false));
        assert_eq!(a.write_room(), 64, "b's ack freed a's replay buffer");
        assert_eq!(a.replayed(), 0);
    }

    #[test]
    fn fresh_attach_checks_the_peers_first_frame() {
        let fresh = || {
            let mut s = StreamState::new(1, L);
            s.attach_fresh().unwrap();
            s
        };
        let attach = |delivered, fin_received| Frame::Attach {
            stream: 1,
            delivered,
            fin_received,
        };
        assert_eq!(
            fresh().on_frame(attach(5, false)),
            Err(StreamError::FreshAttachMismatch {
                delivered: 5,
                fin_received: false
            })
        );
        assert_eq!(
            fresh().on_frame(attach(0, true)),
            Err(StreamError::FreshAttachMismatch {
                delivered: 0,
                fin_received: true
            })
        );
        let data = Frame::Data {
            stream: 1,
            offset: 0,
            payload: Bytes::from_static(b"x"),
        };
        assert_eq!(
            fresh().on_frame(data.clone()),
            Err(StreamError::AttachExpected("data"))
        );
        // Only the first Attach is expected: a second one is a violation.
        let mut s = fresh();
        s.on_frame(attach(0, false)).unwrap();
        s.on_frame(data).unwrap();
        assert_eq!(
            s.on_frame(attach(0, false)),
            Err(StreamError::Unexpected("attach"))
        );
        // A stream that was ever attached cannot start as new again.
        let mut s = fresh();
        s.detach();
        assert_eq!(s.attach_fresh(), Err(StreamError::NotFresh));
        let (mut a, _) = pair();
        assert_eq!(a.attach_fresh(), Err(StreamError::NotFresh));
    }

    #[test]
    fn fresh_stream_whose_first_transport_dies_resumes_normally() {
        let mut a = StreamState::new(1, L);
        let mut b = StreamState::new(1, L);
        a.attach_fresh().unwrap();
        a.write(b"lost in flight");
        // The transport dies before b saw anything; b never heard of the stream.
        while a.poll_transmit().is_some() {}
        a.detach();
        let (delivered, fin_received) = offsets(a.attach_frame());
        b.attach(delivered, fin_received).unwrap();
        // The re-attach waits for b's Attach (PeerAttach::Read) and replays.
        a.attach(0, false).unwrap();
        pump(&mut a, &mut b);
        assert_eq!(read_all(&mut b), (b"lost in flight".to_vec(), false));
        assert_eq!(a.replayed(), 14);
    }

    #[test]
    fn duplicates_are_dropped_and_gaps_refused() {
        let (_, mut b) = pair();
        let d = |o: u64, p: &'static [u8]| Frame::Data {
            stream: 1,
            offset: o,
            payload: Bytes::from_static(p),
        };
        b.on_frame(d(0, b"abc")).unwrap();
        b.on_frame(d(1, b"bcde")).unwrap();
        b.on_frame(d(0, b"ab")).unwrap();
        assert_eq!(read_all(&mut b).0, b"abcde");
        assert_eq!(
            b.on_frame(d(9, b"x")),
            Err(StreamError::Gap {
                expected: 5,
                got: 9
            })
        );
    }

    #[test]
    fn bad_acks_and_state_loss_are_errors() {
        let (mut a, _) = pair();
        a.write(b"abc");
        assert!(matches!(
            a.on_frame(Frame::Ack {
                stream: 1,
                delivered: 4,
                fin_received: false
            }),
            Err(StreamError::AckBeyondWritten { .. })
        ));
        assert_eq!(
            a.on_frame(Frame::Ack {
                stream: 1,
                delivered: 3,
                fin_received: true
            }),
            Err(StreamError::FinAckedEarly)
        );
        a.on_frame(Frame::Ack {
            stream: 1,
            delivered: 2,
            fin_received: false,
        })
        .unwrap();
        a.detach();
        assert_eq!(
            a.attach(0, false),
            Err(StreamError::PeerLostState { peer: 0, acked: 2 })
        );
        assert!(matches!(
            a.on_frame(Frame::Ack {
                stream: 2,
                delivered: 0,
                fin_received: false
            }),
            Err(StreamError::WrongStream { .. })
        ));
    }

    #[test]
    fn discarding_reader_still_lets_the_peer_finish() {
        let (mut a, mut b) = pair();
        b.finish();
        b.discard_incoming();
        a.write(b"ignored");
        a.finish();
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        assert_eq!(read_all(&mut a), (vec![], true));
        pump(&mut a, &mut b);
        assert!(a.is_done() && b.is_done());
    }

    #[test]
    fn reset_reaches_both_sides() {
        let (mut a, mut b) = pair();
        a.reset(ResetCode::KubeletUnreachable, "connection refused");
        assert_eq!(a.write(b"x"), 0);
        pump(&mut a, &mut b);
        assert!(a.is_done());
        assert!(b.is_done());
        assert_eq!(
            b.read(10),
            ReadOutcome::Reset(ResetCode::KubeletUnreachable, "connection refused".into())
        );
    }

    #[test]
    fn clean_close_needs_both_ends_acknowledged() {
        let (mut a, mut b) = pair();
        a.write(b"req");
        a.finish();
        b.write(b"resp");
        b.finish();
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        assert!(!a.is_done() && !b.is_done());
        assert_eq!(read_all(&mut a), (b"resp".to_vec(), true));
        assert_eq!(read_all(&mut b), (b"req".to_vec(), true));
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        assert!(a.is_done() && b.is_done());
    }

    /// One action of the random interleaving.
    #[derive(Debug, Clone)]
    enum Op {
        Write(bool, usize),
        Read(bool, usize),
        Transmit(bool),
        Deliver(bool),
        Finish(bool),
        /// The transport is lost; while each side waits for the other's
        /// `Attach`, its application reads this much.
        Disconnect(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<bool>(), 1usize..40).prop_map(|(s, n)| Op::Write(s, n)),
            (any::<bool>(), 1usize..40).prop_map(|(s, n)| Op::Read(s, n)),
            any::<bool>().prop_map(Op::Transmit),
            any::<bool>().prop_map(Op::Transmit),
            any::<bool>().prop_map(Op::Deliver),
            any::<bool>().prop_map(Op::Deliver),
            any::<bool>().prop_map(Op::Finish),
            (0usize..80, 0usize..80).prop_map(|(a, b)| Op::Disconnect(a, b)),
        ]
    }

    /// A side of the simulation: its state, what its application wrote and read.
    struct Side {
        s: StreamState,
        wrote: Vec<u8>,
        read: Vec<u8>,
        eof: bool,
        counter: u8,
    }

    impl Side {
        fn new() -> Self {
            Side {
                s: StreamState::new(9, L),
                wrote: vec![],
                read: vec![],
                eof: false,
                counter: 0,
            }
        }
        fn write(&mut self, n: usize) {
            let data: Vec<u8> = (0..n).map(|i| self.counter.wrapping_add(i as u8)).collect();
            let took = self.s.write(&data);
            self.counter = self.counter.wrapping_add(took as u8);
            self.wrote.extend_from_slice(&data[..took]);
        }
        fn read(&mut self, n: usize) {
            match self.s.read(n) {
                ReadOutcome::Data(b) => self.read.extend_from_slice(&b),
                ReadOutcome::Eof => self.eof = true,
                ReadOutcome::Reset(..) => panic!("unexpected reset"),
                ReadOutcome::Pending => {}
            }
        }
    }

    /// A lost transport: each side sends its `Attach`, its application reads
    /// `reads` bytes while the peer's is under way, then takes the peer's.
    fn reattach(
        a: &mut Side,
        b: &mut Side,
        ab: &mut VecDeque<Frame>,
        ba: &mut VecDeque<Frame>,
        reads: (usize, usize),
    ) {
        ab.clear();
        ba.clear();
        a.s.detach();
        b.s.detach();
        let (
            Frame::Attach {
                delivered: ad,
                fin_received: af,
                ..
            },
            Frame::Attach {
                delivered: bd,
                fin_received: bf,
                ..
            },
        ) = (a.s.attach_frame(), b.s.attach_frame())
        else {
            unreachable!()
        };
        a.read(reads.0);
        b.read(reads.1);
        a.s.attach(bd, bf).unwrap();
        b.s.attach(ad, af).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        /// Random interleavings of writes, reads, transmits, deliveries and
        /// transport losses: every byte arrives exactly once and in order, the
        /// ends arrive, and both states finish.
        #[test]
        fn every_byte_exactly_once_across_disconnects(ops in proptest::collection::vec(op(), 0..300)) {
            let mut a = Side::new();
            let mut b = Side::new();
            let (mut ab, mut ba) = (VecDeque::new(), VecDeque::new());
            // The cloud's start: `a` transmits at once (fresh); `b` attaches on
            // a's Attach and answers with its own as its first frame.
            a.s.attach_fresh().unwrap();
            b.s.attach(0, false).unwrap();
            ba.push_back(b.s.attach_frame());
            for op in ops {
                match op {
                    Op::Write(side, n) => if side { a.write(n) } else { b.write(n) },
                    Op::Read(side, n) => if side { a.read(n) } else { b.read(n) },
                    Op::Transmit(side) => {
                        let (s, q) = if side { (&mut a, &mut ab) } else { (&mut b, &mut ba) };
                        if let Some(f) = s.s.poll_transmit() { q.push_back(f) }
                    }
                    Op::Deliver(side) => {
                        let (q, to) = if side { (&mut ab, &mut b) } else { (&mut ba, &mut a) };
                        if to.s.recv_has_room() {
                            if let Some(f) = q.pop_front() { to.s.on_frame(f).unwrap() }
                        }
                    }
                    Op::Finish(side) => if side { a.s.finish() } else { b.s.finish() },
                    Op::Disconnect(ra, rb) => reattach(&mut a, &mut b, &mut ab, &mut ba, (ra, rb)),
                }
                prop_assert!(a.s.replay_buffered() <= L.replay_bytes);
                prop_assert!(b.s.replay_buffered() <= L.replay_bytes);
                prop_assert!(a.read.len() <= b.wrote.len() && b.wrote[..a.read.len()] == a.read[..]);
                prop_assert!(b.read.len() <= a.wrote.len() && a.wrote[..b.read.len()] == b.read[..]);
            }
            // Quiescence with both readers reading and no end sent: every byte
            // written is delivered and acknowledged, so no replay buffer stays
            // full (a lost acknowledgement would stall the writer here).
            for _ in 0..10_000 {
                let before = (a.s.offsets(), b.s.offsets());
                let mut sent = false;
                if let Some(f) = a.s.poll_transmit() { ab.push_back(f); sent = true }
                if let Some(f) = b.s.poll_transmit() { ba.push_back(f); sent = true }
                if let Some(f) = ab.pop_front() { b.s.on_frame(f).unwrap() }
                if let Some(f) = ba.pop_front() { a.s.on_frame(f).unwrap() }
                a.read(64);
                b.read(64);
                let still = before == (a.s.offsets(), b.s.offsets());
                if !sent && still && ab.is_empty() && ba.is_empty() { break; }
            }
            prop_assert_eq!(a.s.replay_buffered(), 0, "a's unacknowledged bytes: offsets a {:?}, b {:?}", a.s.offsets(), b.s.offsets());
            prop_assert_eq!(b.s.replay_buffered(), 0, "b's unacknowledged bytes: offsets a {:?}, b {:?}", a.s.offsets(), b.s.offsets());
            // Drain: finish both, then run the loop to quiescence.
            a.s.finish();
            b.s.finish();
            for _ in 0..10_000 {
                if a.s.is_done() && b.s.is_done() && ab.is_empty() && ba.is_empty() { break; }
                if let Some(f) = a.s.poll_transmit() { ab.push_back(f) }
                if let Some(f) = b.s.poll_transmit() { ba.push_back(f) }
                if let Some(f) = ab.pop_front() { b.s.on_frame(f).unwrap() }
                if let Some(f) = ba.pop_front() { a.s.on_frame(f).unwrap() }
                a.read(64);
                b.read(64);
            }
            a.read(64);
            b.read(64);
            prop_assert_eq!(&a.read, &b.wrote);
            prop_assert_eq!(&b.read, &a.wrote);
            prop_assert!(a.eof && b.eof);
            prop_assert!(a.s.is_done() && b.s.is_done());
        }
    }
}
