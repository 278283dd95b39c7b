//! The tokio adapter: a [`StreamState`] as `AsyncRead + AsyncWrite`, driven
//! over whatever transport is attached at the moment.
//!
//! - [`ResumableIo`] is what the application holds: the cloud puts the
//!   apiserver's connection on one side of it, the edge the kubelet's. Reads
//!   and writes only touch the shared state; they never wait on the network,
//!   except that a write waits while the replay buffer is full
//!   (backpressure).
//! - [`drive`] moves frames between the shared state and one transport (a
//!   QUIC stream pair, or anything `AsyncRead + AsyncWrite` in tests). When
//!   the transport dies it returns an error and the stream stays intact;
//!   calling [`drive`] again with a new transport re-attaches it, and both
//!   ends replay from each other's delivered offset. Only the latest
//!   transport to attach drives the stream: an older driver still running
//!   (its abort not yet taken effect on another worker thread) neither
//!   transmits, nor applies what it reads, nor detaches the stream when its
//!   transport fails; it ends with [`TransportError::Superseded`].
//! - [`FrameReader`] / [`write_frame`] read and write single frames.
//!
//! The state lives behind a `std::sync::Mutex` held only for bookkeeping,
//! never across an `.await`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::Notify;

use crate::copies::{CopyBudget, CopySink};
use crate::frame::{self, Frame, FrameError, ResetCode};
use crate::stream::{ReadOutcome, StreamError, StreamState};

/// A frame reader's first buffer.
const READER_START: usize = 2048;
/// `Data` payloads from this size on are read into a buffer of their own.
const DIRECT_PAYLOAD: usize = READER_START / 2;

/// Reads length-delimited frames from a byte stream. Its buffer starts small,
/// grows only as frames other than `Data` need it, and is given back while
/// the stream has nothing to read: an idle interactive stream (one of
/// thousands held open) holds none. A `Data` payload of
/// [`DIRECT_PAYLOAD`] bytes or more is read straight into an allocation of
/// its own that becomes the frame's payload: no second copy, and the small
/// buffer stays free for reuse instead of being held by payloads that wait
/// in the receive queue (which cost a fresh allocation, and page faults,
/// per frame).
pub struct FrameReader {
    buf: BytesMut,
    max: usize,
    /// The `Data` frame whose payload is being read: stream, offset, length,
    /// the payload so far.
    payload: Option<(frame::StreamId, u64, usize, BytesMut)>,
}

impl FrameReader {
    /// A reader that refuses frames over `max` bytes.
    pub fn new(max: usize) -> Self {
        FrameReader {
            buf: BytesMut::with_capacity(READER_START),
            max,
            payload: None,
        }
    }

    /// The next frame; `Ok(None)` at a clean end of the stream. Cancel-safe.
    pub async fn next<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
    ) -> Result<Option<Frame>, TransportError> {
        loop {
            if let Some((stream, offset, len, bytes)) = &mut self.payload {
                let missing = *len - bytes.len();
                if missing == 0 {
                    let (stream, offset, bytes) = (*stream, *offset, std::mem::take(bytes));
                    self.payload = None;
                    return Ok(Some(Frame::Data {
                        stream,
                        offset,
                        payload: bytes.freeze(),
                    }));
                }
                if (&mut *r).take(missing as u64).read_buf(bytes).await? == 0 {
                    return Err(FrameError::Truncated {
                        have: bytes.len(),
                        need: *len,
                    }
                    .into());
                }
                continue;
            }
            if let Some((stream, offset, header, len)) =
                frame::peek_data_header(&self.buf, self.max)?
            {
                if len >= DIRECT_PAYLOAD && self.buf.len() < header + len {
                    self.buf.advance(header);
                    let mut bytes = BytesMut::with_capacity(len);
                    bytes.extend_from_slice(&self.buf);
                    self.buf.clear();
                    self.payload = Some((stream, offset, len, bytes));
                    continue;
                }
            }
            if let Some(f) = frame::decode(&mut self.buf, self.max)? {
                return Ok(Some(f));
            }
            if self.fill(r).await? == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(FrameError::Truncated {
                    have: self.buf.len(),
                    need: 0,
                }
                .into());
            }
        }
    }

    /// Reads what `r` has into the buffer; the bytes read, 0 at its end.
    /// While `r` has nothing and nothing is buffered the buffer is given back,
    /// so an idle stream (one of thousands held open) holds none; it is taken
    /// again when bytes arrive.
    async fn fill<R: AsyncRead + Unpin>(&mut self, r: &mut R) -> io::Result<usize> {
        std::future::poll_fn(|cx| {
            if self.buf.capacity() - self.buf.len() < READER_START / 2 {
                self.buf.reserve(self.buf.len().max(READER_START));
            }
            let mut rb = ReadBuf::uninit(self.buf.spare_capacity_mut());
            match Pin::new(&mut *r).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    // SAFETY: `ReadBuf` counts only bytes the reader wrote (it
                    // cannot swap the slice it was given), and `n` is within the
                    // spare capacity that slice came from.
                    unsafe { self.buf.set_len(self.buf.len() + n) };
                    Poll::Ready(Ok(n))
                }
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => {
                    if self.buf.is_empty() {
                        self.buf = BytesMut::new();
                    }
                    Poll::Pending
                }
            }
        })
        .await
    }
}

impl FrameReader {
    /// Turns this reader back into a byte stream: the bytes it buffered but
    /// did not decode yet, then the rest of `r`. Used when the caller read
    /// the first frame itself and hands the stream on.
    pub fn into_prefixed<R: AsyncRead + Unpin>(self, r: R) -> Prefixed<R> {
        let buf = match self.payload {
            // A payload begun by a cancelled `next`: its frame goes back in
            // front, as it came.
            Some((stream, offset, len, partial)) => {
                let mut front = BytesMut::new();
                // The header was within `max` when it arrived.
                let _ = frame::encode_data_header(stream, offset, len, &mut front, usize::MAX);
                front.extend_from_slice(&partial);
                front.extend_from_slice(&self.buf);
                front
            }
            None => self.buf,
        };
        Prefixed { buf, inner: r }
    }
}

/// A byte stream with some bytes already read in front; see
/// [`FrameReader::into_prefixed`].
pub struct Prefixed<R> {
    buf: BytesMut,
    inner: R,
}

impl<R: AsyncRead + Unpin> AsyncRead for Prefixed<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.buf.is_empty() {
            let n = self.buf.len().min(out.remaining());
            let chunk = self.buf.split_to(n);
            out.put_slice(&chunk);
            if self.buf.is_empty() {
                // Free the allocation: the stream lives on for hours.
                self.buf = BytesMut::new();
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, out)
    }
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    f: &Frame,
    max: usize,
) -> Result<(), TransportError> {
    let bytes = frame::encode_to_bytes(f, max)?;
    w.write_all(&bytes).await?;
    Ok(())
}

/// A transport the driver writes frames to as whole [`Bytes`] chunks: a QUIC
/// send stream takes them over without a copy (a `Data` payload goes from
/// the replay buffer to the packet being encrypted untouched); any other
/// writer gets them copied through [`Copying`].
pub trait ChunkWrite: AsyncWrite + Unpin + Send {
    /// Writes every chunk, in order.
    fn write_chunks(&mut self, chunks: &mut [Bytes])
        -> impl Future<Output = io::Result<()>> + Send;
}

impl ChunkWrite for quinn::SendStream {
    async fn write_chunks(&mut self, chunks: &mut [Bytes]) -> io::Result<()> {
        Ok(self.write_all_chunks(chunks).await?)
    }
}

/// Any byte writer as a [`ChunkWrite`], copying each chunk (tests, pipes).
pub struct Copying<W>(pub W);

impl<W: AsyncWrite + Unpin + Send> ChunkWrite for Copying<W> {
    async fn write_chunks(&mut self, chunks: &mut [Bytes]) -> io::Result<()> {
        for c in chunks.iter() {
            self.0.write_all(c).await?;
        }
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Copying<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Why a transport under a stream stopped.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("transport I/O: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("stream protocol: {0}")]
    Stream(#[from] StreamError),
    #[error("transport closed before the stream ended")]
    Closed,
    #[error("expected an attach frame, got {0}")]
    NoAttach(&'static str),
    #[error("a newer transport attached the stream")]
    Superseded,
}

struct Inner {
    state: StreamState,
    /// Counts the transports that attached the stream: a driver acts on the
    /// state only while the latest attach is its own.
    attaches: u64,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
    /// Counts replayed bytes, when the application asked for metrics.
    replay_counter: Option<prometheus_client::metrics::counter::Counter>,
}

/// The state shared by a stream's application handle and its driver.
pub struct SharedStream {
    inner: Mutex<Inner>,
    /// Wakes the transmit loop: something may be ready to send.
    tx: Notify,
    /// Wakes the receive loop: the local reader made room.
    rx_room: Notify,
    /// Wakes whoever waits for the stream to finish.
    done: Notify,
    /// Wakes whoever waits for a reset ([`SharedStream::wait_reset`]).
    reset: Notify,
    /// Small writes are also sent as datagram copies ([`crate::copies`]).
    interactive: AtomicBool,
}

impl SharedStream {
    /// Wraps a fresh stream state.
    pub fn new(state: StreamState) -> Arc<Self> {
        Arc::new(SharedStream {
            inner: Mutex::new(Inner {
                state,
                attaches: 0,
                read_waker: None,
                write_waker: None,
                replay_counter: None,
            }),
            tx: Notify::new(),
            rx_room: Notify::new(),
            done: Notify::new(),
            reset: Notify::new(),
            interactive: AtomicBool::new(false),
        })
    }

    /// Marks the stream interactive (an upgraded exec, attach or
    /// port-forward): its small writes are also sent as datagram copies
    /// where the transport allows ([`crate::copies`]).
    pub fn mark_interactive(&self) {
        self.interactive.store(true, Ordering::Relaxed);
    }

    /// Applies a datagram copy of the peer's bytes (see
    /// [`StreamState::on_copy`]); returns how many bytes it delivered first.
    pub fn on_copy(&self, offset: u64, payload: &[u8]) -> usize {
        let mut g = self.lock();
        let added = g.state.on_copy(offset, payload);
        if added > 0 {
            if let Some(w) = g.read_waker.take() {
                w.wake();
            }
        }
        added
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock is a bug in this module; the state
        // is still consistent bookkeeping, so keep going with it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the state, then wakes everyone who may now make progress.
    pub fn with_state<T>(&self, f: impl FnOnce(&mut StreamState) -> T) -> T {
        let mut g = self.lock();
        let out = f(&mut g.state);
        self.wake_all(&mut g);
        out
    }

    fn wake_all(&self, g: &mut Inner) {
        if let Some(w) = g.read_waker.take() {
            w.wake();
        }
        if let Some(w) = g.write_waker.take() {
            w.wake();
        }
        self.tx.notify_one();
        self.rx_room.notify_one();
        if g.state.is_done() {
            self.done.notify_waiters();
        }
        if g.state.reset_reason().is_some() {
            self.reset.notify_waiters();
        }
    }

    /// Resets the stream (the peer is told if a transport is attached now or
    /// later).
    pub fn reset(&self, code: ResetCode, message: impl Into<String>) {
        let message = message.into();
        self.with_state(|s| s.reset(code, message));
    }

    /// Whether the stream is over in both directions.
    pub fn is_done(&self) -> bool {
        self.lock().state.is_done()
    }

    /// Waits until the stream is reset (by either side), for a task that is
    /// busy elsewhere (e.g. waiting on the kubelet) and reads nothing.
    pub async fn wait_reset(&self) -> (ResetCode, String) {
        loop {
            let n = self.reset.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some((code, message)) = self.lock().state.reset_reason() {
                return (code, message.to_string());
            }
            n.await;
        }
    }

    /// The application end's read, for both ways of reading: on delivered
    /// data, `take` gets the first payload (at most `max` bytes) and the state
    /// to take more from, and its result comes back as `Some`; `None` at the
    /// peer's clean end; a reset as the I/O error [`StreamReset::from_io`]
    /// reads; otherwise it waits for the peer's bytes.
    fn poll_delivered<T>(
        &self,
        cx: &mut Context<'_>,
        max: usize,
        take: impl FnOnce(Bytes, &mut StreamState) -> T,
    ) -> Poll<io::Result<Option<T>>> {
        let mut g = self.lock();
        match g.state.read(max) {
            ReadOutcome::Data(first) => {
                let out = take(first, &mut g.state);
                self.tx.notify_one();
                self.rx_room.notify_one();
                Poll::Ready(Ok(Some(out)))
            }
            ReadOutcome::Eof => {
                self.tx.notify_one();
                Poll::Ready(Ok(None))
            }
            ReadOutcome::Reset(code, msg) => Poll::Ready(Err(reset_error(code, &msg))),
            ReadOutcome::Pending => {
                g.read_waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Reads what has arrived as one chunk of at most `max` bytes (`None` at
    /// the peer's clean end), holding no buffer while nothing has: a payload
    /// of [`CHUNK_AS_IS`] bytes or more is handed up as it arrived, without
    /// a copy; smaller ones are joined with whatever else is queued behind
    /// them into one allocation of just that size, so a chunked body's
    /// pieces of a few bytes do not each become a frame of their own.
    /// `max` must be positive. The application's end reads either this way or
    /// through [`ResumableIo`]'s `AsyncRead`, not both at once; bytes read
    /// this way are not counted by the handle's counters.
    pub fn poll_read_chunk(
        &self,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<io::Result<Option<Bytes>>> {
        self.poll_delivered(cx, max, |first, state| {
            let queued = state.recv_buffered();
            if first.len() >= CHUNK_AS_IS || queued == 0 || first.len() >= max {
                return first;
            }
            let mut joined = BytesMut::with_capacity(max.min(first.len() + queued));
            joined.extend_from_slice(&first);
            read_queued(state, max - first.len(), |b| joined.extend_from_slice(b));
            joined.freeze()
        })
    }

    /// Waits until the stream is over.
    pub async fn wait_done(&self) {
        loop {
            let n = self.done.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.is_done() {
                return;
            }
            n.await;
        }
    }
}

/// The application's end of a resumable stream.
pub struct ResumableIo {
    shared: Arc<SharedStream>,
    counters: Option<crate::ops::ByteCounters>,
}

impl ResumableIo {
    pub fn new(shared: Arc<SharedStream>) -> Self {
        ResumableIo {
            shared,
            counters: None,
        }
    }

    /// Counts the bytes read and written through this handle.
    pub fn with_counters(mut self, counters: crate::ops::ByteCounters) -> Self {
        self.shared.lock().replay_counter = Some(counters.replayed.clone());
        self.counters = Some(counters);
        self
    }

    pub fn shared(&self) -> &Arc<SharedStream> {
        &self.shared
    }
}

/// [`SharedStream::poll_read_chunk`] hands payloads from this size on up as
/// they arrived, and joins smaller ones with what is queued behind them.
pub const CHUNK_AS_IS: usize = 16 * 1024;

/// The error inside the `io::Error` a reset stream returns; recover it with
/// [`StreamReset::from_io`] to map the reset code to an HTTP outcome.
#[derive(Debug, Clone, thiserror::Error)]
#[error("stream reset ({code:?}): {message}")]
pub struct StreamReset {
    pub code: ResetCode,
    pub message: String,
}

impl StreamReset {
    /// The reset behind an I/O error, if it is one.
    pub fn from_io(e: &io::Error) -> Option<&StreamReset> {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<StreamReset>())
    }

    /// The I/O error a reset stream returns (what [`StreamReset::from_io`] reads).
    pub fn io_error(code: ResetCode, message: &str) -> io::Error {
        reset_error(code, message)
    }
}

fn reset_error(code: ResetCode, message: &str) -> io::Error {
    let kind = match code {
        ResetCode::Cancelled => io::ErrorKind::ConnectionAborted,
        _ => io::ErrorKind::ConnectionReset,
    };
    io::Error::new(
        kind,
        StreamReset {
            code,
            message: message.to_string(),
        },
    )
}

impl AsyncRead for ResumableIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let read = self
            .shared
            .poll_delivered(cx, buf.remaining(), |first, state| {
                buf.put_slice(&first);
                // Every queued payload that fits, not just the first: the peer's
                // writes arrive as payloads of their own (a piece of a chunked
                // body can be a few bytes), and handing them up one at a time
                // made one body frame, TLS record and system call of each on the
                // way out.
                first.len() + read_queued(state, buf.remaining(), |b| buf.put_slice(b))
            });
        match read {
            Poll::Ready(Ok(Some(n))) => {
                if let Some(c) = &self.counters {
                    c.received.inc_by(n as u64);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(None)) => Poll::Ready(Ok(())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Hands `put` every further delivered payload while they fit in `room`
/// bytes (a payload larger than what is left is split); returns how many
/// bytes it handed. Stops at the end or a reset, which the next read reports.
fn read_queued(state: &mut StreamState, room: usize, mut put: impl FnMut(&[u8])) -> usize {
    let mut n = 0;
    while n < room {
        match state.read(room - n) {
            ReadOutcome::Data(b) => {
                put(&b);
                n += b.len();
            }
            _ => break,
        }
    }
    n
}

impl AsyncWrite for ResumableIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let shared = &self.shared;
        let mut g = shared.lock();
        if let Some((code, msg)) = g.state.reset_reason() {
            return Poll::Ready(Err(reset_error(code, msg)));
        }
        if g.state.is_finished() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "stream already shut down",
            )));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = g.state.write(buf);
        if n > 0 {
            if let Some(c) = &self.counters {
                c.sent.inc_by(n as u64);
            }
            shared.tx.notify_one();
            return Poll::Ready(Ok(n));
        }
        g.write_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let g = &mut *self.shared.lock();
        if let Some((code, msg)) = g.state.reset_reason() {
            return Poll::Ready(Err(reset_error(code, msg)));
        }
        g.state.finish();
        self.shared.tx.notify_one();
        Poll::Ready(Ok(()))
    }
}

impl Drop for ResumableIo {
    /// Dropping the handle after shutting down our direction lets the peer
    /// finish (its remaining bytes are discarded); dropping it earlier aborts
    /// the stream, so the far side sees an error rather than a clean end.
    fn drop(&mut self) {
        self.shared.with_state(|s| {
            if s.is_finished() {
                s.discard_incoming();
            } else {
                s.reset(ResetCode::Cancelled, "the local side closed the stream");
            }
        });
    }
}

/// How the peer's `Attach` is obtained on a new transport.
#[derive(Debug, Clone, Copy)]
pub enum PeerAttach {
    /// Already read by the caller (the acceptor read it to learn the stream id).
    Known { delivered: u64, fin_received: bool },
    /// Read it as the first frame before transmitting (a re-attach: where to
    /// resume from is the peer's to say).
    Read,
    /// A new stream's first transport: transmit at once; the peer's `Attach`
    /// (offset 0) is checked when it arrives. Saves a round trip per stream open.
    Fresh,
}

/// Attaches the stream to a transport and moves frames until the stream is
/// done (`Ok`) or the transport fails (`Err`; the stream is detached and can be
/// re-attached by calling `drive` again with a new transport).
///
/// Sends our `Attach` first. `max_frame` bounds frames both ways. With
/// `copies`, an interactive stream's small writes also go as datagram copies
/// on the transport's connection ([`crate::copies`]).
pub async fn drive<R, W>(
    shared: Arc<SharedStream>,
    mut recv: R,
    mut send: W,
    peer: PeerAttach,
    max_frame: usize,
    copies: Option<Arc<dyn CopySink>>,
) -> Result<(), TransportError>
where
    R: AsyncRead + Unpin,
    W: ChunkWrite,
{
    // The attach count when this driver started, and once it attached, its
    // own attach's number.
    let started = shared.lock().attaches;
    let mut mine = None;
    let result = drive_inner(
        &shared, &mut recv, &mut send, peer, max_frame, copies, &mut mine,
    )
    .await;
    match result {
        // Once the stream is done, the transport closing under the last
        // frames (the peer dropped its end first) is no failure.
        Err(_) if shared.is_done() => Ok(()),
        Err(e) => {
            // Detached only if no newer transport attached it meanwhile: an
            // older driver failing late must not stop the newer one.
            let mut g = shared.lock();
            if g.attaches == mine.unwrap_or(started) {
                g.state.detach();
                shared.wake_all(&mut g);
            }
            Err(e)
        }
        Ok(()) => Ok(()),
    }
}

/// Counts a new attach of `g`'s stream; returns its number, and wakes every
/// transmit loop waiting (an older driver's finds itself superseded and
/// ends, the new one starts).
fn count_attach(shared: &SharedStream, g: &mut Inner) -> u64 {
    g.attaches += 1;
    shared.tx.notify_waiters();
    g.attaches
}

async fn drive_inner<R, W>(
    shared: &Arc<SharedStream>,
    recv: &mut R,
    send: &mut W,
    peer: PeerAttach,
    max_frame: usize,
    copies: Option<Arc<dyn CopySink>>,
    mine: &mut Option<u64>,
) -> Result<(), TransportError>
where
    R: AsyncRead + Unpin,
    W: ChunkWrite,
{
    let ours = shared.with_state(|s| s.attach_frame());
    write_frame(send, &ours, max_frame).await?;
    let mut reader = FrameReader::new(max_frame);
    let (delivered, fin_received) = match peer {
        PeerAttach::Known {
            delivered,
            fin_received,
        } => (delivered, fin_received),
        PeerAttach::Fresh => {
            let attached = {
                let mut g = shared.lock();
                let r = g.state.attach_fresh();
                if r.is_ok() {
                    *mine = Some(count_attach(shared, &mut g));
                }
                shared.wake_all(&mut g);
                r
            };
            if let Err(e) = attached {
                shared.reset(ResetCode::ProtocolError, e.to_string());
                return Err(e.into());
            }
            let mine = mine.unwrap_or_default();
            return attached_loops(shared, recv, send, &mut reader, max_frame, copies, mine).await;
        }
        PeerAttach::Read => match reader.next(recv).await? {
            Some(Frame::Attach {
                stream,
                delivered,
                fin_received,
            }) => {
                // Another stream's offsets would be taken as this one's.
                let id = shared.with_state(|s| s.id());
                if stream != id {
                    return Err(StreamError::WrongStream {
                        expected: id,
                        got: stream,
                    }
                    .into());
                }
                (delivered, fin_received)
            }
            Some(other) => return Err(TransportError::NoAttach(other.kind())),
            None => return Err(TransportError::Closed),
        },
    };
    let attached = {
        let mut g = shared.lock();
        let before = g.state.replayed();
        let r = g.state.attach(delivered, fin_received);
        if r.is_ok() {
            *mine = Some(count_attach(shared, &mut g));
        }
        let replayed = g.state.replayed() - before;
        if let (Some(c), true) = (&g.replay_counter, replayed > 0) {
            c.inc_by(replayed);
        }
        if replayed > 0 {
            tracing::debug!(
                stream = g.state.id(),
                replayed,
                "re-attached; replaying undelivered bytes"
            );
        }
        drop(g);
        shared.with_state(|_| ());
        r
    };
    if let Err(e) = attached {
        shared.reset(ResetCode::ProtocolError, e.to_string());
        // Best effort: tell the peer before giving up on this transport. The
        // state was not attached, so it transmits nothing itself: write the
        // Reset directly (the state sends it again on a later transport).
        let reset = shared.with_state(|s| {
            s.reset_reason().map(|(code, message)| Frame::Reset {
                stream: s.id(),
                code,
                message: message.to_string(),
            })
        });
        if let Some(f) = reset {
            let _ = write_frame(send, &f, max_frame).await;
        }
        // The stream can never be attached again: it is over, and its slot
        // is freed now rather than retried on every later connection (a
        // stream the edge finished while its final ack was lost ends here).
        shared.with_state(|s| s.abandon());
        return Err(e.into());
    }
    let mine = mine.unwrap_or_default();
    attached_loops(shared, recv, send, &mut reader, max_frame, copies, mine).await
}

/// Moves frames both ways on an attached transport (attach number `mine`)
/// until the stream is done, the transport fails, or a newer transport
/// attaches the stream.
async fn attached_loops<R, W>(
    shared: &Arc<SharedStream>,
    recv: &mut R,
    send: &mut W,
    reader: &mut FrameReader,
    max_frame: usize,
    copies: Option<Arc<dyn CopySink>>,
    mine: u64,
) -> Result<(), TransportError>
where
    R: AsyncRead + Unpin,
    W: ChunkWrite,
{
    let rx = receive_loop(shared, recv, reader, mine);
    let tx = transmit_loop(shared, send, max_frame, copies, mine);
    tokio::pin!(rx, tx);
    tokio::select! {
        r = &mut tx => r,
        r = &mut rx => match r {
            // The peer closed its side cleanly: flush what we still owe
            // (bounded: the peer may already be gone), then we are done or
            // the transport closed under an unfinished stream.
            Ok(()) => {
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), &mut tx).await;
                if shared.is_done() {
                    Ok(())
                } else {
                    Err(TransportError::Closed)
                }
            }
            Err(e) => Err(e),
        },
    }
}

async fn receive_loop<R: AsyncRead + Unpin>(
    shared: &Arc<SharedStream>,
    recv: &mut R,
    reader: &mut FrameReader,
    mine: u64,
) -> Result<(), TransportError> {
    loop {
        // Wait for room in the receive queue before taking more from QUIC, so
        // a slow local reader pushes back through QUIC flow control.
        loop {
            let room = shared.rx_room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if shared.lock().state.recv_has_room() {
                break;
            }
            room.await;
        }
        match reader.next(recv).await? {
            Some(f) => {
                let applied = {
                    let mut g = shared.lock();
                    if g.attaches != mine {
                        return Err(TransportError::Superseded);
                    }
                    let r = g.state.on_frame(f);
                    shared.wake_all(&mut g);
                    r
                };
                if let Err(e) = applied {
                    shared.reset(ResetCode::ProtocolError, e.to_string());
                    return Err(e.into());
                }
            }
            // The peer finished its side: it does so only once its state is
            // done. Whether ours is follows from our last transmits.
            None => return Ok(()),
        }
    }
}

/// Bytes of frames gathered into one write to the transport.
const TRANSMIT_BATCH: usize = 256 * 1024;

async fn transmit_loop<W: ChunkWrite>(
    shared: &Arc<SharedStream>,
    send: &mut W,
    max_frame: usize,
    copies: Option<Arc<dyn CopySink>>,
    mine: u64,
) -> Result<(), TransportError> {
    // Frame headers and small frames are encoded into `head`; each `Data`
    // payload joins `chunks` as it is, after the header before it.
    let mut head = BytesMut::new();
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut budget = CopyBudget::default();
    loop {
        // The copy of this batch's lone small write, sent after the batch.
        let mut copy = None;
        let wake = shared.tx.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        let done = {
            let mut g = shared.lock();
            if g.attaches != mine {
                // A newer transport drives the stream; a wake this loop took
                // may have been meant for its loop.
                drop(g);
                shared.tx.notify_one();
                return Err(TransportError::Superseded);
            }
            // Batch whatever is ready into one write.
            let mut batched = 0;
            // The batch's `Data` frames: how many, and the first's place.
            let mut data_frames = 0;
            let mut first_data = None;
            while batched < TRANSMIT_BATCH {
                match g.state.poll_transmit() {
                    Some(Frame::Data {
                        stream,
                        offset,
                        payload,
                    }) => {
                        frame::encode_data_header(
                            stream,
                            offset,
                            payload.len(),
                            &mut head,
                            max_frame,
                        )?;
                        batched += payload.len();
                        data_frames += 1;
                        if first_data.is_none() {
                            first_data = Some((stream, offset, chunks.len() + 1));
                        }
                        chunks.push(head.split().freeze());
                        chunks.push(payload);
                    }
                    Some(f) => {
                        let before = head.len();
                        frame::encode(&f, &mut head, max_frame)?;
                        batched += head.len() - before;
                    }
                    None => break,
                }
            }
            if !head.is_empty() {
                chunks.push(head.split().freeze());
            }
            // A lone small write of an interactive stream (a keystroke, its
            // echo) goes once more as a datagram (see `crate::copies`); a
            // batch of several is a transfer, not typing.
            if let (Some(sink), 1, Some((stream, offset, at))) = (&copies, data_frames, first_data)
            {
                let settings = sink.settings();
                if shared.interactive.load(Ordering::Relaxed)
                    && chunks[at].len() <= settings.max_payload
                    && budget.take(settings.per_sec, std::time::Instant::now())
                {
                    copy = Some((stream, offset, chunks[at].clone()));
                }
            }
            if !chunks.is_empty() {
                // Writing made room in nobody's buffer, but acks may have let
                // writers continue; wake them cheaply.
                if let Some(w) = g.write_waker.take() {
                    w.wake();
                }
            }
            g.state.is_done()
        };
        if !chunks.is_empty() {
            send.write_chunks(&mut chunks).await?;
            chunks.clear();
            if let (Some(sink), Some((stream, offset, payload))) = (&copies, copy) {
                // Queued only once the connection's driver, woken by the
                // write, has had its turn: queued together, the frame and
                // its copy would leave in one segmentation-offload batch,
                // which a host that drops whole batches loses at once.
                tokio::task::yield_now().await;
                sink.send_copy(stream, offset, &payload);
            }
            continue;
        }
        if done {
            send.shutdown().await?;
            return Ok(());
        }
        wake.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::StreamLimits;
    use std::time::Duration;
    use tokio::io::{duplex, split};

    const L: StreamLimits = StreamLimits {
        replay_bytes: 64 * 1024,
        recv_bytes: 64 * 1024,
        max_payload: 8 * 1024,
    };

    type Driver = tokio::task::JoinHandle<Result<(), TransportError>>;

    /// A driver for `shared` on the transport halves `r`, `w` (1 MiB frames).
    fn spawn_drive<R, W>(
        shared: Arc<SharedStream>,
        r: R,
        w: W,
        peer: PeerAttach,
        copies: Option<Arc<dyn CopySink>>,
    ) -> Driver
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: ChunkWrite + 'static,
    {
        tokio::spawn(drive(shared, r, w, peer, 1 << 20, copies))
    }

    fn pair() -> (Arc<SharedStream>, Arc<SharedStream>) {
        (
            SharedStream::new(StreamState::new(5, L)),
            SharedStream::new(StreamState::new(5, L)),
        )
    }

    /// Connects both ends over an in-memory transport; returns the drivers.
    fn connect(a: &Arc<SharedStream>, b: &Arc<SharedStream>) -> (Driver, Driver) {
        let (x, y) = duplex(16 * 1024);
        let (xr, xw) = split(x);
        let (yr, yw) = split(y);
        (
            spawn_drive(a.clone(), xr, Copying(xw), PeerAttach::Read, None),
            spawn_drive(b.clone(), yr, Copying(yw), PeerAttach::Read, None),
        )
    }

    /// A transport between two drivers whose one direction can be held up
    /// (its packets lost and not yet resent): bytes from the first end wait
    /// while `open` is false; the other direction flows. Returns both ends.
    fn held_transport(
        mut open: tokio::sync::watch::Receiver<bool>,
    ) -> (tokio::io::DuplexStream, tokio::io::DuplexStream) {
        let (a, a_far) = duplex(16 * 1024);
        let (b, b_far) = duplex(16 * 1024);
        let (mut from_a, mut to_a) = split(a_far);
        let (mut from_b, mut to_b) = split(b_far);
        tokio::spawn(async move {
            let mut buf = vec![0; 16 * 1024];
            loop {
                let n = from_a.read(&mut buf).await?;
                if n == 0 || open.wait_for(|o| *o).await.is_err() {
                    return to_b.shutdown().await;
                }
                to_b.write_all(&buf[..n]).await?;
            }
        });
        tokio::spawn(async move {
            tokio::io::copy(&mut from_b, &mut to_a).await?;
            to_a.shutdown().await
        });
        (a, b)
    }

    /// Copies go straight into the far end's state, and are counted.
    struct Direct {
        to: Arc<SharedStream>,
        settings: crate::copies::CopySettings,
        sent: Mutex<Vec<(u64, Vec<u8>)>>,
    }

    impl CopySink for Direct {
        fn settings(&self) -> crate::copies::CopySettings {
            self.settings
        }
        fn send_copy(&self, _stream: u64, offset: u64, payload: &[u8]) -> bool {
            self.sent.lock().unwrap().push((offset, payload.to_vec()));
            self.to.on_copy(offset, payload);
            true
        }
    }

    async fn read_some(io: &mut ResumableIo, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        tokio::time::timeout(Duration::from_secs(5), io.read_exact(&mut buf))
            .await
            .expect("bytes within 5 s")
            .unwrap();
        buf
    }

    /// A small write of an interactive stream arrives through its copy while
    /// the stream's own transport is held up; when the frame comes it is a
    /// duplicate, and every byte is read exactly once. A write over the size
    /// bound and a stream not marked interactive send no copy.
    #[tokio::test]
    async fn a_held_up_small_write_arrives_through_its_copy_exactly_once() {
        let (a, b) = pair();
        let (gate, open) = tokio::sync::watch::channel(true);
        let (x, y) = held_transport(open);
        let (xr, xw) = split(x);
        let (yr, yw) = split(y);
        let sink = Arc::new(Direct {
            to: b.clone(),
            settings: crate::copies::CopySettings {
                max_payload: 4,
                per_sec: 100,
                ..crate::copies::CopySettings::default()
            },
            sent: Mutex::new(Vec::new()),
        });
        let copies: Arc<dyn CopySink> = sink.clone();
        let da = spawn_drive(a.clone(), xr, Copying(xw), PeerAttach::Read, Some(copies));
        let db = spawn_drive(b.clone(), yr, Copying(yw), PeerAttach::Read, None);
        let mut wa = ResumableIo::new(a.clone());
        let mut rb = ResumableIo::new(b.clone());
        // Not interactive yet: no copy.
        wa.write_all(b"x").await.unwrap();
        assert_eq!(read_some(&mut rb, 1).await, b"x");
        assert!(sink.sent.lock().unwrap().is_empty());
        a.mark_interactive();
        gate.send_replace(false);
        wa.write_all(b"yz").await.unwrap();
        // Only the copy can bring these now.
        assert_eq!(read_some(&mut rb, 2).await, b"yz");
        assert_eq!(*sink.sent.lock().unwrap(), vec![(1, b"yz".to_vec())]);
        // Over the size bound: no copy, so it waits for the transport.
        wa.write_all(b"hello").await.unwrap();
        gate.send_replace(true);
        assert_eq!(read_some(&mut rb, 5).await, b"hello");
        assert_eq!(sink.sent.lock().unwrap().len(), 1);
        wa.write_all(b"!").await.unwrap();
        assert_eq!(read_some(&mut rb, 1).await, b"!");
        assert_eq!(sink.sent.lock().unwrap().len(), 2);
        assert_eq!(b.with_state(|s| s.offsets().2), 9, "nothing received twice");
        wa.shutdown().await.unwrap();
        rb.shutdown().await.unwrap();
        let mut rest = Vec::new();
        rb.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        drop((wa, rb));
        tokio::time::timeout(Duration::from_secs(5), async {
            da.await.unwrap().unwrap();
            db.await.unwrap().unwrap();
        })
        .await
        .expect("both drivers finish");
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8).collect()
    }

    /// A peer whose first frame on a transport is another stream's Attach: the
    /// driver gives up on that transport at once, naming both streams, and the
    /// stream stays resumable (its offsets untouched, not reset).
    #[tokio::test]
    async fn an_attach_for_another_stream_is_refused_on_that_transport() {
        let a = SharedStream::new(StreamState::new(5, L));
        a.with_state(|s| {
            s.attach(0, false).unwrap();
            s.write(b"abc");
            while s.poll_transmit().is_some() {}
            s.detach();
        });
        let (x, mut y) = duplex(16 * 1024);
        let (xr, xw) = split(x);
        let driver = spawn_drive(a.clone(), xr, Copying(xw), PeerAttach::Read, None);
        let other = Frame::Attach {
            stream: 6,
            delivered: 3,
            fin_received: false,
        };
        write_frame(&mut y, &other, 1 << 20).await.unwrap();
        let result = tokio::time::timeout(Duration::from_secs(5), driver)
            .await
            .expect("the driver must give up on the transport")
            .unwrap();
        assert!(
            matches!(
                result,
                Err(TransportError::Stream(StreamError::WrongStream {
                    expected: 5,
                    got: 6
                }))
            ),
            "{result:?}"
        );
        assert!(!a.is_done());
        assert_eq!(a.with_state(|s| s.offsets()), (3, 0, 0, 0));
        assert!(a.with_state(|s| s.reset_reason().is_none()));
    }

    /// A peer that lost the stream's state (it attaches below what it had
    /// acknowledged — e.g. the edge finished the stream but its final ack was
    /// lost with the connection) is told with a Reset on that transport, the
    /// driver gives up at once, and the stream is over: its slot is freed
    /// instead of the re-attach being retried on every later connection.
    #[tokio::test]
    async fn peer_that_lost_state_is_reset_promptly() {
        let a = SharedStream::new(StreamState::new(5, L));
        a.with_state(|s| {
            s.attach(0, false).unwrap();
            s.write(b"abc");
            while s.poll_transmit().is_some() {}
            s.on_frame(Frame::Ack {
                stream: 5,
                delivered: 3,
                fin_received: false,
            })
            .unwrap();
            s.detach();
        });
        let (x, mut y) = duplex(16 * 1024);
        let (xr, xw) = split(x);
        let driver = spawn_drive(a.clone(), xr, Copying(xw), PeerAttach::Read, None);
        let lost = Frame::Attach {
            stream: 5,
            delivered: 0,
            fin_received: false,
        };
        write_frame(&mut y, &lost, 1 << 20).await.unwrap();
        let result = tokio::time::timeout(Duration::from_secs(5), driver)
            .await
            .expect("the driver must give up, not wait on a transport it never attached")
            .unwrap();
        assert!(
            a.is_done(),
            "a stream the peer lost is over: its slot must be freed, not retried"
        );
        // The stream is over (reset): the driver reports no transport
        // failure to retry.
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(
            a.with_state(|s| s.reset_reason().map(|(c, _)| c)),
            Some(ResetCode::ProtocolError)
        );
        let mut reader = FrameReader::new(1 << 20);
        assert!(matches!(
            reader.next(&mut y).await.unwrap(),
            Some(Frame::Attach { .. })
        ));
        assert!(matches!(
            reader.next(&mut y).await.unwrap(),
            Some(Frame::Reset {
                code: ResetCode::ProtocolError,
                ..
            })
        ));
    }

    /// Yields its bytes a few at a time, as a network does.
    struct Trickle {
        data: Vec<u8>,
        at: usize,
        step: usize,
        /// At the end of `data`, wait (forever) instead of ending.
        stall: bool,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if self.stall && self.at == self.data.len() {
                return Poll::Pending;
            }
            let step = self.step;
            self.step = self.step % 97 + 13;
            let n = step.min(out.remaining()).min(self.data.len() - self.at);
            let at = self.at;
            out.put_slice(&self.data[at..at + n]);
            self.at += n;
            Poll::Ready(Ok(()))
        }
    }

    fn mixed_frames() -> Vec<Frame> {
        let mut frames = Vec::new();
        for (i, len) in [0usize, 1, 1023, 1024, 1025, 4000, 32 * 1024, 7, 100_000]
            .into_iter()
            .enumerate()
        {
            frames.push(Frame::Data {
                stream: 9,
                offset: (i as u64) << 20,
                payload: Bytes::from(pattern(len)),
            });
            frames.push(Frame::Ack {
                stream: 9,
                delivered: i as u64,
                fin_received: false,
            });
        }
        frames.push(Frame::GoAway {
            reason: "x".repeat(5000),
        });
        frames
    }

    /// Frames of every size arrive whole and in order whatever the read
    /// sizes, large payloads bypass the reader's buffer (it stays at its
    /// starting size), and a truncated payload is an error.
    #[tokio::test]
    async fn reader_reassembles_frames_from_any_read_sizes() {
        let frames = mixed_frames();
        let mut wire = BytesMut::new();
        for f in &frames {
            frame::encode(f, &mut wire, 1 << 20).unwrap();
        }
        for first_step in [1, 5, 64, 3000] {
            let mut r = Trickle {
                data: wire.to_vec(),
                at: 0,
                step: first_step,
                stall: false,
            };
            let mut reader = FrameReader::new(1 << 20);
            for f in &frames {
                assert_eq!(reader.next(&mut r).await.unwrap().as_ref(), Some(f));
                if !matches!(f, Frame::GoAway { .. }) {
                    assert!(reader.buf.capacity() <= 4 * READER_START);
                }
            }
            assert!(reader.next(&mut r).await.unwrap().is_none());
        }
        let cut = wire.len() - 6000;
        let mut r = &wire[..cut];
        let mut reader = FrameReader::new(1 << 20);
        let err = loop {
            match reader.next(&mut r).await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("a cut stream ended cleanly"),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(err, TransportError::Frame(FrameError::Truncated { .. })),
            "{err}"
        );
    }

    /// A reader handed on in the middle of a large payload (its `next`
    /// cancelled there) gives back the frame as it came.
    #[tokio::test]
    async fn reader_handed_on_mid_payload_loses_nothing() {
        let frames = mixed_frames();
        let mut wire = BytesMut::new();
        let mut starts = Vec::new();
        for f in &frames {
            starts.push(wire.len());
            frame::encode(f, &mut wire, 1 << 20).unwrap();
        }
        // Frame 16 carries 100 000 bytes; the transport stalls in its middle.
        assert!(matches!(&frames[16], Frame::Data { payload, .. } if payload.len() == 100_000));
        let stop = starts[16] + 50_000;
        let mut r = Trickle {
            data: wire[..stop].to_vec(),
            at: 0,
            step: 50,
            stall: true,
        };
        let mut reader = FrameReader::new(1 << 20);
        for f in &frames[..16] {
            assert_eq!(reader.next(&mut r).await.unwrap().as_ref(), Some(f));
        }
        {
            let mut cx = Context::from_waker(Waker::noop());
            let fut = reader.next(&mut r);
            tokio::pin!(fut);
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            // Dropped here: cancelled mid-payload.
        }
        assert!(reader.payload.is_some(), "the payload was under way");
        let rest = wire[stop..].to_vec();
        let mut prefixed = reader.into_prefixed(&rest[..]);
        let mut again = FrameReader::new(1 << 20);
        let mut got = Vec::new();
        while let Some(f) = again.next(&mut prefixed).await.unwrap() {
            got.push(f);
        }
        assert_eq!(&got[..], &frames[16..]);
    }

    /// An older transport's driver still running when a newer transport
    /// attaches the stream (an abort takes effect only at the task's next
    /// await, and another worker thread may be inside its poll): it must
    /// neither take frames for its dead transport nor, when that transport
    /// then fails, detach the stream under the newer driver. Before, the
    /// old driver's failure detached the stream (the newer transport then
    /// sent nothing until it failed in turn) and its transmit loop took
    /// frames the newer transport never carried: the transfer hung.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_superseded_transports_failure_leaves_the_newer_attach_alone() {
        let (a, b) = pair();
        let data = pattern(1024 * 1024);
        let ia = ResumableIo::new(a.clone());
        let ib = ResumableIo::new(b.clone());
        let send = data.clone();
        // The first half goes at once, the rest once the first transport
        // has failed.
        let (go_on, resume) = tokio::sync::oneshot::channel::<()>();
        let writer = tokio::spawn(async move {
            let mut ia = ia;
            let (early, late) = send.split_at(send.len() / 2);
            ia.write_all(early).await.unwrap();
            let _ = resume.await;
            for chunk in late.chunks(16 * 1024) {
                ia.write_all(chunk).await.unwrap();
            }
            ia.shutdown().await.unwrap();
            ia
        });
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            let mut ib = ib;
            let mut got = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = ib.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
                let _ = tx.send(got.len());
            }
            ib.shutdown().await.unwrap();
            (got, ib)
        });
        // The first transport carries part of the transfer, then a second
        // attaches both ends while the first's drivers still run.
        let (da1, db1) = connect(&a, &b);
        let first = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("bytes over the first transport");
        assert!(first.is_some());
        let (da2, db2) = connect(&a, &b);
        let attached = tokio::time::timeout(Duration::from_secs(10), async {
            while a.lock().attaches < 2 || b.lock().attaches < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(attached.is_ok(), "the second transport did not attach");
        // Now the first transport dies under its drivers, which were never
        // aborted: b's end of it goes, and a's old driver fails.
        db1.abort();
        let _ = db1.await;
        let old = tokio::time::timeout(Duration::from_secs(10), da1)
            .await
            .expect("the first transport's driver ends")
            .unwrap();
        assert!(old.is_err(), "{old:?}");
        let _ = go_on.send(());
        let (got, _ib) = tokio::time::timeout(Duration::from_secs(20), reader)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the transfer hung on the second transport after the first failed: \
                     a attached {}, b attached {}",
                    a.with_state(|s| s.is_attached()),
                    b.with_state(|s| s.is_attached())
                )
            })
            .unwrap();
        let _ia = writer.await.unwrap();
        assert!(got == data, "bytes differ: {} of {}", got.len(), data.len());
        let (ra, rb) = tokio::join!(da2, db2);
        ra.unwrap().unwrap();
        rb.unwrap().unwrap();
        assert!(a.is_done() && b.is_done());
    }

    #[tokio::test]
    async fn bytes_exactly_once_across_reattach() {
        exactly_once_across_reattach(PeerAttach::Read).await;
    }

    /// The cloud's way: the first transport does not wait for the peer's attach.
    #[tokio::test]
    async fn bytes_exactly_once_across_reattach_after_a_fresh_start() {
        exactly_once_across_reattach(PeerAttach::Fresh).await;
    }

    async fn exactly_once_across_reattach(first: PeerAttach) {
        let (a, b) = pair();
        let data = pattern(2 * 1024 * 1024);
        let ia = ResumableIo::new(a.clone());
        let ib = ResumableIo::new(b.clone());
        let send = data.clone();
        let writer = tokio::spawn(async move {
            let mut ia = ia;
            for chunk in send.chunks(50_000) {
                ia.write_all(chunk).await.unwrap();
            }
            ia.shutdown().await.unwrap();
            ia
        });
        let reader = tokio::spawn(async move {
            let mut ib = ib;
            let mut got = Vec::new();
            ib.read_to_end(&mut got).await.unwrap();
            ib.shutdown().await.unwrap();
            (got, ib)
        });
        // Three transports in a row; the first two are cut mid-transfer.
        for round in 0..3 {
            let (x, y) = duplex(8 * 1024);
            let (xr, xw) = split(x);
            let (yr, yw) = split(y);
            let attach = if round == 0 { first } else { PeerAttach::Read };
            let da = spawn_drive(a.clone(), xr, Copying(xw), attach, None);
            let db = spawn_drive(b.clone(), yr, Copying(yw), PeerAttach::Read, None);
            if round < 2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                da.abort();
                db.abort();
                let _ = da.await;
                let _ = db.await;
                a.with_state(|s| s.detach());
                b.with_state(|s| s.detach());
            } else {
                let (ra, rb) = tokio::join!(da, db);
                ra.unwrap().unwrap();
                rb.unwrap().unwrap();
            }
        }
        let (got, _ib) = reader.await.unwrap();
        let _ia = writer.await.unwrap();
        assert_eq!(got.len(), data.len());
        assert!(got == data, "bytes differ after re-attach");
        assert!(a.is_done() && b.is_done());
    }

    #[tokio::test]
    async fn reset_surfaces_as_io_error() {
        let (a, b) = pair();
        let (_da, _db) = connect(&a, &b);
        let mut ib = ResumableIo::new(b.clone());
        a.reset(
            ResetCode::KubeletUnreachable,
            "dial tcp 127.0.0.1:10350: connection refused",
        );
        let mut buf = [0u8; 8];
        let err = tokio::time::timeout(Duration::from_secs(5), ib.read(&mut buf))
            .await
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("connection refused"), "{err}");
        assert_eq!(
            StreamReset::from_io(&err).unwrap().code,
            ResetCode::KubeletUnreachable
        );
    }

    /// Payloads that arrived one by one (each write sent as a frame of its
    /// own) come up in one read when they fit, and the end after them in the
    /// next. A chunked body forwarded through the tunnel arrives as large
    /// payloads with a few bytes between them (the rest of a chunk, its
    /// framing), and a read that stopped at each payload made one body frame,
    /// TLS record and system call of every few-byte piece on the way out.
    #[tokio::test]
    async fn one_read_takes_every_queued_payload_that_fits() {
        let big = vec![b'x'; 6000];
        let pieces: [&[u8]; 4] = [&big, b"\r\n10000\r\n", &big, b"tail"];
        let want = pieces.concat();
        let (mut rb, _d) = sent_as_payloads(&pieces, L).await;
        let mut buf = vec![0u8; 64 * 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), rb.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, want.len(), "one read, every queued byte");
        assert_eq!(&buf[..n], want.as_slice());
        // The end comes after the data, by itself.
        let n = tokio::time::timeout(Duration::from_secs(5), rb.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, 0);

        // A buffer smaller than what is queued takes what fits, in order.
        let (c, d) = pair();
        let (_dc, _dd) = connect(&c, &d);
        let mut wc = ResumableIo::new(c.clone());
        let mut rd = ResumableIo::new(d.clone());
        for p in pieces {
            wc.write_all(p).await.unwrap();
        }
        let mut got = Vec::new();
        let mut small = vec![0u8; 5000];
        while got.len() < want.len() {
            let n = tokio::time::timeout(Duration::from_secs(5), rd.read(&mut small))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0 && n <= small.len());
            got.extend_from_slice(&small[..n]);
        }
        assert_eq!(got, want);
    }

    /// Writes `pieces` one payload each (each received before the next is
    /// written), then the end; returns the reading side.
    async fn sent_as_payloads(
        pieces: &[&[u8]],
        limits: StreamLimits,
    ) -> (ResumableIo, Vec<Driver>) {
        let a = SharedStream::new(StreamState::new(5, limits));
        let b = SharedStream::new(StreamState::new(5, limits));
        let (da, db) = connect(&a, &b);
        let mut wa = ResumableIo::new(a.clone());
        let mut total = 0u64;
        for p in pieces {
            wa.write_all(p).await.unwrap();
            total += p.len() as u64;
            tokio::time::timeout(Duration::from_secs(5), async {
                while b.with_state(|s| s.offsets().2) < total {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await
            .expect("each piece arrives within 5 s");
        }
        wa.shutdown().await.unwrap();
        (ResumableIo::new(b), vec![da, db])
    }

    /// Every chunk up to the end, reading at most `max` at a time.
    async fn read_chunks(rd: &mut ResumableIo, max: usize) -> Vec<Bytes> {
        let mut chunks = Vec::new();
        loop {
            let next = tokio::time::timeout(
                Duration::from_secs(5),
                std::future::poll_fn(|cx| rd.shared().poll_read_chunk(cx, max)),
            )
            .await
            .expect("a chunk or the end within 5 s")
            .unwrap();
            match next {
                Some(c) => {
                    assert!(!c.is_empty() && c.len() <= max, "{} > {max}", c.len());
                    chunks.push(c);
                }
                None => return chunks,
            }
        }
    }

    /// A chunk read joins a small payload with everything queued behind it,
    /// hands a large payload up by itself, keeps to its bound, and ends with
    /// `None` after the data.
    #[tokio::test]
    async fn chunk_reads_join_small_payloads_and_pass_large_ones_as_they_came() {
        const BIG: StreamLimits = StreamLimits {
            replay_bytes: 256 * 1024,
            recv_bytes: 256 * 1024,
            max_payload: 64 * 1024,
        };
        let small = vec![b's'; 3000];
        let large = vec![b'L'; CHUNK_AS_IS + 4000];
        let lens = |c: &[Bytes]| c.iter().map(|c| c.len()).collect::<Vec<_>>();

        let pieces: [&[u8]; 4] = [&small, b"\r\n10\r\n", &large, b"tail"];
        let (mut rd, _d) = sent_as_payloads(&pieces, BIG).await;
        let chunks = read_chunks(&mut rd, 1 << 20).await;
        assert_eq!(chunks.concat(), pieces.concat());
        assert_eq!(lens(&chunks), [pieces.concat().len()]);

        let pieces: [&[u8]; 3] = [&large, b"\r\n", b"tail"];
        let (mut rd, _d) = sent_as_payloads(&pieces, BIG).await;
        let chunks = read_chunks(&mut rd, 1 << 20).await;
        assert_eq!(chunks.concat(), pieces.concat());
        assert_eq!(lens(&chunks), [large.len(), 6]);

        let (mut rd, _d) = sent_as_payloads(&pieces, BIG).await;
        let chunks = read_chunks(&mut rd, 5000).await;
        assert_eq!(chunks.concat(), pieces.concat());
        // The large payload's last piece is small: what is queued joins it.
        let total = pieces.concat().len();
        assert_eq!(
            lens(&chunks).len(),
            total.div_ceil(5000),
            "{:?}",
            lens(&chunks)
        );
    }

    #[tokio::test]
    async fn slow_reader_applies_backpressure() {
        let (a, b) = pair();
        let (_da, _db) = connect(&a, &b);
        let mut ia = ResumableIo::new(a.clone());
        let _ib = ResumableIo::new(b.clone());
        // Nobody reads b: a can write at most its replay buffer, then blocks.
        let wrote = tokio::time::timeout(Duration::from_millis(300), async {
            loop {
                ia.write_all(&[1u8; 4096]).await.unwrap();
            }
        })
        .await;
        assert!(wrote.is_err(), "writer must block");
        assert!(a.with_state(|s| s.replay_buffered()) <= L.replay_bytes);
        assert!(b.with_state(|s| s.recv_buffered()) <= L.recv_bytes + L.max_payload);
    }
}
