//! Real child processes behind exec and attach: spawning with pipes or with a
//! pseudo-terminal (openpty + setsid + TIOCSCTTY), window resizing with
//! TIOCSWINSZ, output pumping into channels, stdin writing, exit codes and
//! killing the whole process group.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// A terminal size as sent on the resize stream/channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct TermSize {
    #[serde(rename = "Width")]
    pub width: u16,
    #[serde(rename = "Height")]
    pub height: u16,
}

/// Incremental decoder of the consecutive JSON objects on a resize stream.
#[derive(Default)]
pub struct ResizeDecoder {
    buf: Vec<u8>,
}

impl ResizeDecoder {
    /// Feed bytes; returns every complete size decoded so far. Garbage is
    /// discarded rather than allowed to grow the buffer without bound.
    pub fn push(&mut self, data: &[u8]) -> Vec<TermSize> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        let mut consumed = 0;
        {
            let mut it = serde_json::Deserializer::from_slice(&self.buf).into_iter::<TermSize>();
            loop {
                match it.next() {
                    Some(Ok(sz)) => {
                        out.push(sz);
                        consumed = it.byte_offset();
                    }
                    Some(Err(e)) if e.is_eof() => break,
                    Some(Err(_)) => {
                        consumed = self.buf.len();
                        break;
                    }
                    None => {
                        consumed = self.buf.len();
                        break;
                    }
                }
            }
        }
        self.buf.drain(..consumed.min(self.buf.len()));
        if self.buf.len() > 4096 {
            self.buf.clear();
        }
        out
    }
}

/// Writes to a child's stdin (pipe or pty master).
pub enum StdinWriter {
    Pipe(tokio::process::ChildStdin),
    Pty(tokio::fs::File),
}

impl StdinWriter {
    pub async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self {
            StdinWriter::Pipe(p) => {
                p.write_all(data).await?;
                p.flush().await
            }
            StdinWriter::Pty(f) => {
                f.write_all(data).await?;
                f.flush().await
            }
        }
    }
}

/// A running child process and its plumbing.
pub struct Spawned {
    pub child: tokio::process::Child,
    /// Process group id (== pid) used for killing.
    pub pgid: i32,
    pub stdin: Option<StdinWriter>,
    /// stdout (with a tty: the terminal's combined output).
    pub stdout: mpsc::Receiver<Bytes>,
    /// stderr; `None` with a tty.
    pub stderr: Option<mpsc::Receiver<Bytes>>,
    /// The pty master, for resizing.
    pub pty: Option<Arc<OwnedFd>>,
}

/// How to start a process.
pub struct SpawnOptions<'a> {
    pub command: &'a [String],
    pub cwd: &'a Path,
    pub tty: bool,
    pub stdin: bool,
    pub initial_size: Option<TermSize>,
    pub hostname: &'a str,
}

/// Apply a window size to a pty master.
pub fn resize(master: &OwnedFd, size: TermSize) -> Result<()> {
    let ws = libc::winsize {
        ws_row: size.height,
        ws_col: size.width,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: fd is a valid open descriptor owned by `master`; ws is a valid winsize.
    let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if rc != 0 {
        bail!("TIOCSWINSZ: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn set_cloexec(fd: &OwnedFd) -> Result<()> {
    // SAFETY: fcntl on a valid descriptor.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    if rc != 0 {
        bail!("fcntl FD_CLOEXEC: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn open_pty(size: TermSize) -> Result<(OwnedFd, OwnedFd)> {
    let mut master: libc::c_int = -1;
    let mut slave: libc::c_int = -1;
    let ws = libc::winsize {
        ws_row: size.height,
        ws_col: size.width,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: out-pointers are valid; name/termp may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    if rc != 0 {
        bail!("openpty: {}", std::io::Error::last_os_error());
    }
    // SAFETY: openpty succeeded, both descriptors are open and ours.
    let (m, s) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    set_cloexec(&m)?;
    set_cloexec(&s)?;
    Ok((m, s))
}

fn pump_async<R>(mut r: R) -> mpsc::Receiver<Bytes>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

fn pump_pty(master: File) -> mpsc::Receiver<Bytes> {
    let (tx, rx) = mpsc::channel(64);
    let spawned = std::thread::Builder::new()
        .name("pty-reader".into())
        .spawn(move || {
            let mut master = master;
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                match master.read(&mut buf) {
                    // EIO once every slave descriptor is closed.
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx.blocking_send(Bytes::copy_from_slice(&buf[..n])).is_err() {
                            break;
                        }
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start pty reader thread: {e}");
    }
    rx
}

/// Start a process as described by `opts`.
pub fn spawn(opts: &SpawnOptions<'_>) -> Result<Spawned> {
    let Some((program, args)) = opts.command.split_first() else {
        bail!("no command given");
    };
    std::fs::create_dir_all(opts.cwd)
        .with_context(|| format!("create working directory {}", opts.cwd.display()))?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .current_dir(opts.cwd)
        .env("HOSTNAME", opts.hostname)
        .kill_on_drop(false);
    if opts.tty {
        let size = opts.initial_size.unwrap_or(TermSize {
            width: 80,
            height: 24,
        });
        let (master, slave) = open_pty(size)?;
        cmd.env("TERM", "xterm")
            .stdin(Stdio::from(slave.try_clone().context("dup pty slave")?))
            .stdout(Stdio::from(slave.try_clone().context("dup pty slave")?))
            .stderr(Stdio::from(slave));
        // SAFETY: only async-signal-safe calls (setsid, ioctl) in the child.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("exec {program:?}"))?;
        // Close our copies of the slave so the master sees EIO at exit.
        drop(cmd);
        let pgid = child.id().map(|p| p as i32).unwrap_or(0);
        let reader = File::from(master.try_clone().context("dup pty master")?);
        let writer = File::from(master.try_clone().context("dup pty master")?);
        Ok(Spawned {
            child,
            pgid,
            stdin: opts
                .stdin
                .then(|| StdinWriter::Pty(tokio::fs::File::from_std(writer))),
            stdout: pump_pty(reader),
            stderr: None,
            pty: Some(Arc::new(master)),
        })
    } else {
        cmd.stdin(if opts.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
        let mut child = cmd.spawn().with_context(|| format!("exec {program:?}"))?;
        let pgid = child.id().map(|p| p as i32).unwrap_or(0);
        let stdin = child.stdin.take().map(StdinWriter::Pipe);
        let stdout = child
            .stdout
            .take()
            .map(pump_async)
            .context("child stdout missing")?;
        let stderr = child.stderr.take().map(pump_async);
        Ok(Spawned {
            child,
            pgid,
            stdin,
            stdout,
            stderr,
            pty: None,
        })
    }
}

/// SIGKILL the whole process group.
pub fn kill_group(pgid: i32) {
    if pgid > 0 {
        // SAFETY: plain kill(2) on a process group we created.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
}

/// Shell-style exit code: the code, or 128+signal.
pub fn exit_code(status: &ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resize_decoder_handles_split_and_concatenated_json() {
        let mut d = ResizeDecoder::default();
        assert!(d.push(br#"{"Width":80,"#).is_empty());
        assert_eq!(
            d.push(br#""Height":24}{"Width":100,"Height":40}"#),
            vec![
                TermSize {
                    width: 80,
                    height: 24
                },
                TermSize {
                    width: 100,
                    height: 40
                }
            ]
        );
        assert!(d.push(b"garbage").is_empty());
        assert_eq!(
            d.push(br#"{"Width":1,"Height":2}"#),
            vec![TermSize {
                width: 1,
                height: 2
            }]
        );
    }

    #[tokio::test]
    async fn pty_child_sees_window_size() {
        let dir = std::env::temp_dir();
        let cmd = vec!["sh".to_string(), "-c".to_string(), "stty size".to_string()];
        let mut sp = spawn(&SpawnOptions {
            command: &cmd,
            cwd: &dir,
            tty: true,
            stdin: false,
            initial_size: Some(TermSize {
                width: 99,
                height: 33,
            }),
            hostname: "t",
        })
        .expect("spawn");
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while let Ok(Some(b)) = tokio::time::timeout_at(deadline, sp.stdout.recv()).await {
            out.extend_from_slice(&b);
        }
        let status = sp.child.wait().await.expect("wait");
        assert!(status.success());
        assert!(String::from_utf8_lossy(&out).contains("33 99"), "{out:?}");
    }
}
