//! Copying an upgraded stream both ways (exec, attach, port-forward) without
//! holding buffers while it is idle.
//!
//! `tokio::io::copy_bidirectional` keeps an 8 KiB buffer per direction for the
//! life of the stream: 16 KiB on each side of the tunnel for every open
//! session, most of which sit idle (a shell waiting for a key). [`copy_both`]
//! reads into a buffer on the stack and writes straight from it; only bytes
//! the writer cannot take at once are kept, in a heap buffer that is used
//! while data flows and freed as soon as the reader has nothing more. An
//! idle session holds no copy buffer at all.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read at a time (on the stack, or in the heap buffer while data flows).
pub const CHUNK: usize = 16 * 1024;

/// One direction's state.
#[derive(Default)]
struct OneWay {
    /// Bytes read but not yet written: `buf[pos..end]`; `None` when empty.
    buf: Option<Vec<u8>>,
    pos: usize,
    end: usize,
    read_done: bool,
    need_flush: bool,
    done: bool,
    copied: u64,
}

impl OneWay {
    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        mut r: Pin<&mut R>,
        mut w: Pin<&mut W>,
    ) -> Poll<io::Result<u64>>
    where
        R: AsyncRead + ?Sized,
        W: AsyncWrite + ?Sized,
    {
        loop {
            if self.done {
                return Poll::Ready(Ok(self.copied));
            }
            // Write out what is held first.
            if let Some(buf) = &self.buf {
                if self.pos < self.end {
                    let n = match w.as_mut().poll_write(cx, &buf[self.pos..self.end]) {
                        Poll::Ready(Ok(0)) => {
                            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()))
                        }
                        Poll::Ready(Ok(n)) => n,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => return Poll::Pending,
                    };
                    self.pos += n;
                    self.copied += n as u64;
                    self.need_flush = true;
                    continue;
                }
                self.pos = 0;
                self.end = 0;
            }
            if self.read_done {
                ready!(w.as_mut().poll_flush(cx))?;
                ready!(w.as_mut().poll_shutdown(cx))?;
                self.done = true;
                continue;
            }
            // Read: into the heap buffer while data flows, else on the stack.
            let n = if let Some(buf) = &mut self.buf {
                let mut rb = ReadBuf::new(buf.as_mut_slice());
                match r.as_mut().poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) => {
                        let n = rb.filled().len();
                        self.end = n;
                        n
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        // Idle: give the buffer back.
                        self.buf = None;
                        return self.pending_after_flush(cx, w);
                    }
                }
            } else {
                // Not zeroed: the reader only ever writes into it.
                let mut stack = [std::mem::MaybeUninit::<u8>::uninit(); CHUNK];
                let mut rb = ReadBuf::uninit(&mut stack);
                match r.as_mut().poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return self.pending_after_flush(cx, w),
                }
                let data = rb.filled();
                let mut off = 0;
                // Straight from the stack while the writer takes it.
                while off < data.len() {
                    match w.as_mut().poll_write(cx, &data[off..]) {
                        Poll::Ready(Ok(0)) => {
                            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()))
                        }
                        Poll::Ready(Ok(k)) => {
                            off += k;
                            self.copied += k as u64;
                            self.need_flush = true;
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => break,
                    }
                }
                if off < data.len() {
                    // The writer is full: keep the rest until it drains.
                    let mut buf = vec![0u8; CHUNK];
                    buf[..data.len() - off].copy_from_slice(&data[off..]);
                    self.end = data.len() - off;
                    self.pos = 0;
                    self.buf = Some(buf);
                    return Poll::Pending;
                }
                data.len()
            };
            if n == 0 {
                self.read_done = true;
            }
        }
    }

    /// The reader has nothing: flush what was written, then wait.
    fn pending_after_flush<W: AsyncWrite + ?Sized>(
        &mut self,
        cx: &mut Context<'_>,
        w: Pin<&mut W>,
    ) -> Poll<io::Result<u64>> {
        if self.need_flush {
            match w.poll_flush(cx) {
                Poll::Ready(Ok(())) => self.need_flush = false,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        Poll::Pending
    }
}

/// Copies `a` to `b` and `b` to `a` until both have ended (each end's write
/// side is shut down after the other's read side ended), like
/// `tokio::io::copy_bidirectional`; returns the bytes copied `a`→`b` and
/// `b`→`a`. The first error ends both directions.
pub async fn copy_both<A, B>(a: &mut A, b: &mut B) -> io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let mut ab = OneWay::default();
    let mut ba = OneWay::default();
    poll_fn(|cx| {
        let x = ab.poll_copy(cx, Pin::new(&mut *a), Pin::new(&mut *b))?;
        let y = ba.poll_copy(cx, Pin::new(&mut *b), Pin::new(&mut *a))?;
        match (x, y) {
            (Poll::Ready(x), Poll::Ready(y)) => Poll::Ready(Ok((x, y))),
            _ => Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn copies_both_ways_through_a_slow_reader_and_ends_with_both() {
        // a_far <-> a ==copy_both== b <-> b_far; small duplex buffers make
        // the writer push back (the held-buffer path).
        let (a_far, mut a) = tokio::io::duplex(1000);
        let (mut b, b_far) = tokio::io::duplex(777);
        let pump = tokio::spawn(async move { copy_both(&mut a, &mut b).await });
        let up: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
        let (u2, d2) = (up.clone(), down.clone());
        let (mut a_rd, mut a_wr) = tokio::io::split(a_far);
        let (mut b_rd, mut b_wr) = tokio::io::split(b_far);
        let wa = tokio::spawn(async move {
            a_wr.write_all(&u2).await.unwrap();
            a_wr.shutdown().await.unwrap();
        });
        let wb = tokio::spawn(async move {
            b_wr.write_all(&d2).await.unwrap();
            b_wr.shutdown().await.unwrap();
        });
        let w1 = tokio::spawn(async move {
            let mut got = Vec::new();
            a_rd.read_to_end(&mut got).await.unwrap();
            got
        });
        let w2 = tokio::spawn(async move {
            let mut got = Vec::new();
            // Read slowly at first so the pump has to hold bytes.
            let mut chunk = [0u8; 100];
            for _ in 0..50 {
                let n = b_rd.read(&mut chunk).await.unwrap();
                got.extend_from_slice(&chunk[..n]);
                tokio::task::yield_now().await;
            }
            b_rd.read_to_end(&mut got).await.unwrap();
            got
        });
        wa.await.unwrap();
        wb.await.unwrap();
        let got_down = w1.await.unwrap();
        let got_up = w2.await.unwrap();
        assert_eq!(got_up, up);
        assert_eq!(got_down, down);
        let (x, y) = pump.await.unwrap().unwrap();
        assert_eq!((x, y), (up.len() as u64, down.len() as u64));
    }

    #[tokio::test]
    async fn an_idle_stream_holds_no_buffer() {
        let (mut a_far, mut a) = tokio::io::duplex(64);
        let (mut b, mut b_far) = tokio::io::duplex(64);
        let mut ab = OneWay::default();
        let waker = futures_waker();
        let mut cx = Context::from_waker(&waker);
        // Nothing to read: pending, no buffer.
        assert!(ab
            .poll_copy(&mut cx, Pin::new(&mut a), Pin::new(&mut b))
            .is_pending());
        assert!(ab.buf.is_none());
        // More than the writer takes: the rest is held...
        a_far.write_all(&[7u8; 64]).await.unwrap();
        assert!(ab
            .poll_copy(&mut cx, Pin::new(&mut a), Pin::new(&mut b))
            .is_pending());
        // ...(64 bytes fit the duplex exactly, so write more to force a hold)
        a_far.write_all(&[8u8; 64]).await.unwrap();
        assert!(ab
            .poll_copy(&mut cx, Pin::new(&mut a), Pin::new(&mut b))
            .is_pending());
        assert!(ab.buf.is_some(), "the writer was full: bytes must be held");
        // ...and once drained and idle, given back.
        let mut sink = [0u8; 128];
        b_far.read_exact(&mut sink[..64]).await.unwrap();
        let _ = ab.poll_copy(&mut cx, Pin::new(&mut a), Pin::new(&mut b));
        b_far.read_exact(&mut sink[64..]).await.unwrap();
        assert!(ab
            .poll_copy(&mut cx, Pin::new(&mut a), Pin::new(&mut b))
            .is_pending());
        assert!(ab.buf.is_none(), "idle again: the buffer must be freed");
        assert_eq!(ab.copied, 128);
    }

    fn futures_waker() -> std::task::Waker {
        std::task::Waker::noop().clone()
    }
}
