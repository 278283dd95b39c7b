//! Exact sleeps for the idle edge's long timers (the keep-alive, the pod
//! reads), on a Linux timerfd in tokio's reactor.
//!
//! tokio's timer wheel fires a deadline tens of seconds away in steps: it
//! wakes at the start of the coarse slot holding it (4 s wide), again at the
//! start of the finer one (64 ms), and then at the deadline — three wake-ups
//! of an idle device where one would do. A timerfd makes the kernel wake the
//! reactor exactly once, at the deadline. Where a timerfd cannot be had,
//! tokio's sleep is used.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

/// One re-armable exact timer.
pub struct Exact {
    fd: Option<AsyncFd<OwnedFd>>,
}

impl Exact {
    /// A timerfd on `CLOCK_MONOTONIC` (the clock of [`Instant`]); tokio's
    /// sleep if it cannot be created. Must be called within a tokio runtime
    /// with I/O enabled (it panics otherwise, as tokio's own I/O types do).
    pub fn new() -> Exact {
        // SAFETY: timerfd_create with constant arguments.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        let fd = if raw < 0 {
            None
        } else {
            // SAFETY: raw is a fresh descriptor owned by nobody else; the
            // OwnedFd keeps it open, unchanged, for the AsyncFd's lifetime
            // (it is the AsyncFd's inner value).
            unsafe { AsyncFd::register(OwnedFd::from_raw_fd(raw)) }.ok()
        };
        Exact { fd }
    }

    /// Sleeps until `deadline`. Cancel-safe: a later call re-arms the timer.
    pub async fn sleep_until(&mut self, deadline: Instant) {
        let Some(fd) = &self.fd else {
            return tokio::time::sleep_until(deadline).await;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: left.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: libc::c_long::from(left.subsec_nanos() as i32),
            },
        };
        // SAFETY: a valid timerfd and itimerspec; relative time (flags 0).
        let set = unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if set != 0 {
            return tokio::time::sleep_until(deadline).await;
        }
        loop {
            let Ok(mut guard) = fd.readable().await else {
                return tokio::time::sleep_until(deadline).await;
            };
            let mut expirations = [0u8; 8];
            // SAFETY: reading 8 bytes into a buffer of 8 from a valid fd.
            let n = unsafe {
                libc::read(
                    fd.as_raw_fd(),
                    expirations.as_mut_ptr() as *mut libc::c_void,
                    expirations.len(),
                )
            };
            if n == 8 {
                return;
            }
            guard.clear_ready();
            if Instant::now() >= deadline {
                return;
            }
        }
    }
}

impl Default for Exact {
    fn default() -> Self {
        Exact::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn sleeps_until_the_deadline_and_rearms() {
        let mut t = Exact::new();
        assert!(t.fd.is_some(), "timerfd available on Linux");
        for ms in [30u64, 10, 50] {
            let start = Instant::now();
            let deadline = start + Duration::from_millis(ms);
            t.sleep_until(deadline).await;
            assert!(Instant::now() >= deadline);
        }
        // Cancelled (dropped) while armed, then re-armed for sooner.
        let _ = tokio::time::timeout(
            Duration::from_millis(5),
            t.sleep_until(Instant::now() + Duration::from_secs(60)),
        )
        .await;
        let deadline = Instant::now() + Duration::from_millis(20);
        t.sleep_until(deadline).await;
        assert!(Instant::now() >= deadline);
        // A deadline in the past returns at once.
        t.sleep_until(Instant::now() - Duration::from_millis(1))
            .await;
    }
}
