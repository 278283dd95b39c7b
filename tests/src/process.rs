//! A child process under the harness's control.
//!
//! [`Proc`] wraps a tokio child that is killed when dropped (and, on Linux, when the
//! harness itself dies: `PR_SET_PDEATHSIG`), so no test leaves processes behind. Its
//! stdout is read line by line into memory — readiness and results are announced there —
//! and [`Proc::wait_line`] waits, bounded, for a line that matches. Its stderr goes to a
//! log file in the run directory whose tail is quoted in every error about the process.
//! [`Proc::terminate`] stops it politely (SIGTERM, then SIGKILL after a grace period).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::watch;

/// How a process is spawned.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpawnOptions {
    /// Give the child a pipe for stdin (else /dev/null).
    pub stdin: bool,
    /// Put the child in its own process group, so that a terminal's Ctrl-C reaches only
    /// the harness, which then stops its children in order (the demo wants this).
    pub own_process_group: bool,
}

/// Lines read from a child's stdout so far.
#[derive(Default)]
struct Lines {
    lines: Vec<String>,
    /// Set when stdout reached end of file.
    closed: bool,
}

/// What `tether-edge` prints on stdout each time it connects to the cloud, followed by
/// its node, the session and whether it resumed.
pub const EDGE_CONNECTED: &str = "tether-edge connected";

/// A running child process; killed on drop.
pub struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Arc<Mutex<Lines>>,
    /// Bumped whenever `lines` changes.
    changed: watch::Receiver<u64>,
    /// Index of the first line [`Proc::wait_line`] has not consumed yet.
    cursor: usize,
    stderr_log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` as `name`; its stderr goes to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path, opts: SpawnOptions) -> Result<Proc> {
        let stderr_log = log_dir.join(format!("{name}.log"));
        let stderr = File::create(&stderr_log)
            .with_context(|| format!("creating log file {}", stderr_log.display()))?;
        cmd.stdin(if opts.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .kill_on_drop(true);
        if opts.own_process_group {
            cmd.process_group(0);
        }
        die_with_parent(&mut cmd);
        let program = format!("{:?}", cmd.as_std().get_program());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawning {name} ({program})"))?;
        let stdout = child.stdout.take().context("child stdout pipe")?;
        let stdin = child.stdin.take();
        let lines = Arc::new(Mutex::new(Lines::default()));
        let (tx, changed) = watch::channel(0u64);
        let reader_lines = lines.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            loop {
                let next = reader.next_line().await;
                let mut l = reader_lines.lock().unwrap_or_else(|p| p.into_inner());
                match next {
                    Ok(Some(line)) => l.lines.push(line),
                    Ok(None) | Err(_) => {
                        l.closed = true;
                        drop(l);
                        tx.send_modify(|n| *n += 1);
                        return;
                    }
                }
                drop(l);
                tx.send_modify(|n| *n += 1);
            }
        });
        Ok(Proc {
            name: name.to_string(),
            child,
            stdin,
            lines,
            changed,
            cursor: 0,
            stderr_log,
        })
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's process id, if it is still running.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Path of the stderr log.
    pub fn log_path(&self) -> &Path {
        &self.stderr_log
    }

    /// Every stdout line so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .lines
            .clone()
    }

    /// The last `n` lines of the stderr log, for error messages.
    pub fn stderr_tail(&self, n: usize) -> String {
        tail_of_file(&self.stderr_log, n)
    }

    /// Waits at most `limit` for a stdout line (after the ones already consumed by earlier
    /// calls) that satisfies `pred`, and returns it. Fails when the limit passes or the
    /// process closes its stdout first, quoting its stderr.
    pub async fn wait_line(
        &mut self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let closed = {
                let l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
                while self.cursor < l.lines.len() {
                    let line = &l.lines[self.cursor];
                    self.cursor += 1;
                    if pred(line) {
                        return Ok(line.clone());
                    }
                }
                l.closed
            };
            if closed {
                // Give the exit status a moment to become known, for the message.
                let status =
                    match tokio::time::timeout(Duration::from_millis(500), self.child.wait()).await
                    {
                        Ok(Ok(s)) => s.to_string(),
                        _ => "still running".to_string(),
                    };
                bail!(
                    "{} closed its stdout ({status}) before printing {what}; stderr ({}):\n{}",
                    self.name,
                    self.stderr_log.display(),
                    self.stderr_tail(30)
                );
            }
            if tokio::time::timeout_at(deadline, self.changed.changed())
                .await
                .is_err()
            {
                bail!(
                    "{} did not print {what} within {limit:?}; stdout so far: {:?}; stderr ({}):\n{}",
                    self.name,
                    self.lines(),
                    self.stderr_log.display(),
                    self.stderr_tail(30)
                );
            }
        }
    }

    /// Waits at most `limit` for `tether-edge`'s next [`EDGE_CONNECTED`] line (see
    /// [`Proc::wait_line`]) and returns it: it names the session and whether it resumed.
    pub async fn wait_connected(&mut self, what: &str, limit: Duration) -> Result<String> {
        self.wait_line(what, limit, |l| l.starts_with(EDGE_CONNECTED))
            .await
    }

    /// How many times `tether-edge` has connected so far (its [`EDGE_CONNECTED`] lines).
    pub fn connects(&self) -> usize {
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines
            .lines
            .iter()
            .filter(|l| l.starts_with(EDGE_CONNECTED))
            .count()
    }

    /// Waits at most `limit` until the child printed at least `n` stdout lines in all;
    /// returns them all. Fails when it exits first or the limit passes, quoting stderr.
    pub async fn wait_lines(&mut self, n: usize, limit: Duration) -> Result<Vec<String>> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let lines = self.lines();
            if lines.len() >= n {
                return Ok(lines);
            }
            if let Some(status) = self.exited() {
                bail!(
                    "{} exited ({status}) after {} of {n} lines: {lines:?}; stderr: {}",
                    self.name,
                    lines.len(),
                    self.stderr_tail(10)
                );
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{} printed {} of {n} lines within {limit:?}: {lines:?}; stderr: {}",
                    self.name,
                    lines.len(),
                    self.stderr_tail(10)
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Writes `data` to the child's stdin (spawned with `stdin: true`).
    pub async fn write_stdin(&mut self, data: &[u8]) -> Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .with_context(|| format!("{} has no stdin pipe", self.name))?;
        stdin
            .write_all(data)
            .await
            .with_context(|| format!("writing to {}'s stdin", self.name))?;
        stdin
            .flush()
            .await
            .with_context(|| format!("flushing {}'s stdin", self.name))
    }

    /// Closes the child's stdin.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Whether the child has exited (without waiting).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits at most `limit` for the child to exit by itself.
    pub async fn wait_exit(&mut self, limit: Duration) -> Result<std::process::ExitStatus> {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(r) => r.with_context(|| format!("waiting for {}", self.name)),
            Err(_) => bail!(
                "{} did not exit within {limit:?}; stderr ({}):\n{}",
                self.name,
                self.stderr_log.display(),
                self.stderr_tail(20)
            ),
        }
    }

    /// SIGTERM, then SIGKILL if the child has not exited after `grace`. Returns the exit
    /// status, or `None` when it had to be killed.
    pub async fn terminate(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: sending a signal to our own child, whose pid is still reserved for
            // us because we have not reaped it.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(Ok(status)) => Some(status),
            _ => {
                let _ = self.child.kill().await;
                None
            }
        }
    }

    /// Sends SIGKILL and reaps the child.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// Makes the child receive SIGKILL when the thread that spawned it (a runtime worker or
/// the main thread, which live as long as the harness) goes away, so a harness that is
/// itself killed leaves no processes behind.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches only the calling (child) process.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The last `n` lines of the file at `path` (or a note that it cannot be read).
pub fn tail_of_file(path: &Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(n);
            lines[start..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}
