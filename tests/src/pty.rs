//! Running a program under a pseudo-terminal, as a person at a terminal would run
//! `kubectl exec -it`: the program gets the pty's slave as stdin/stdout/stderr and as its
//! controlling terminal (new session), so it sees a real terminal, puts it in raw mode,
//! reads its size, and receives SIGWINCH when [`PtySession::resize`] changes that size.
//! Everything it prints is collected from the master; [`PtySession::expect`] waits,
//! bounded, for some text to appear.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::{Child, Command};

/// A program running under a pty.
pub struct PtySession {
    master: File,
    child: Child,
    /// Everything read from the master so far.
    output: Arc<Mutex<Vec<u8>>>,
}

fn cloexec(fd: i32) -> Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    let r = unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context("setting FD_CLOEXEC");
    }
    Ok(())
}

fn winsize(rows: u16, cols: u16) -> libc::winsize {
    libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

impl PtySession {
    /// Spawns `cmd` on a new pty of `rows`×`cols`.
    pub fn spawn(cmd: std::process::Command, rows: u16, cols: u16) -> Result<PtySession> {
        let mut master_fd: libc::c_int = -1;
        let mut slave_fd: libc::c_int = -1;
        let ws = winsize(rows, cols);
        // SAFETY: openpty writes two descriptors into the provided integers; name and
        // termios may be null; the winsize pointer is valid for the call.
        let r = unsafe {
            libc::openpty(
                &mut master_fd,
                &mut slave_fd,
                std::ptr::null_mut(),
                std::ptr::null(),
                &ws,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error()).context("openpty");
        }
        // SAFETY: openpty succeeded, so both descriptors are open and ours alone.
        let (master, slave) = unsafe {
            (
                OwnedFd::from_raw_fd(master_fd),
                OwnedFd::from_raw_fd(slave_fd),
            )
        };
        cloexec(master.as_raw_fd())?;
        cloexec(slave.as_raw_fd())?;

        let mut cmd = Command::from(cmd);
        cmd.stdin(Stdio::from(slave.try_clone().context("dup pty slave")?))
            .stdout(Stdio::from(slave.try_clone().context("dup pty slave")?))
            .stderr(Stdio::from(slave))
            .kill_on_drop(true);
        // SAFETY: only async-signal-safe calls (setsid, ioctl, prctl) in the child.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::ioctl(0, libc::TIOCSCTTY as _, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().context("spawning under a pty")?;
        // The slave copies in `cmd` are closed as it drops here, so the master reads EIO
        // once the child and its descendants are gone.
        drop(cmd);

        let master = File::from(master);
        let mut reader = master.try_clone().context("dup pty master")?;
        let output = Arc::new(Mutex::new(Vec::new()));
        let sink = output.clone();
        std::thread::Builder::new()
            .name("pty-reader".into())
            .spawn(move || {
                let mut buf = [0u8; 8192];
                loop {
                    match reader.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => sink
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .extend_from_slice(&buf[..n]),
                    }
                }
            })
            .context("starting the pty reader thread")?;
        Ok(PtySession {
            master,
            child,
            output,
        })
    }

    /// Everything printed so far (lossy text).
    pub fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }

    /// Byte length of the output so far: a mark for [`PtySession::expect_after`].
    pub fn mark(&self) -> usize {
        self.output.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Types `text`.
    pub fn send(&mut self, text: &str) -> Result<()> {
        self.master
            .write_all(text.as_bytes())
            .context("writing to the pty")?;
        self.master.flush().context("flushing the pty")
    }

    /// Waits at most `limit` for `needle` to appear in the output after byte `mark`.
    pub async fn expect_after(&self, mark: usize, needle: &str, limit: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            {
                let out = self.output.lock().unwrap_or_else(|p| p.into_inner());
                let tail = String::from_utf8_lossy(&out[mark.min(out.len())..]);
                if tail.contains(needle) {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{needle:?} did not appear on the terminal within {limit:?}; terminal output: {:?}",
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits at most `limit` for `needle` anywhere in the output.
    pub async fn expect(&self, needle: &str, limit: Duration) -> Result<()> {
        self.expect_after(0, needle, limit).await
    }

    /// Changes the terminal size; the kernel sends SIGWINCH to the program.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        let ws = winsize(rows, cols);
        // SAFETY: TIOCSWINSZ on our master descriptor with a valid winsize.
        let r = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ as _, &ws) };
        if r != 0 {
            return Err(std::io::Error::last_os_error()).context("TIOCSWINSZ");
        }
        Ok(())
    }

    /// Waits at most `limit` for the program to exit; returns its exit code.
    pub async fn wait(&mut self, limit: Duration) -> Result<Option<i32>> {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(s) => Ok(s.context("waiting for the pty program")?.code()),
            Err(_) => bail!(
                "the program under the pty did not exit within {limit:?}; terminal output: {:?}",
                self.output()
            ),
        }
    }
}
