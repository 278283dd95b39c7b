//! Network namespace plumbing: create, delete, enter, list, and the `ip`
//! command runner.
//!
//! Namespaces are the named ones of `ip netns` (bind mounts under
//! `/run/netns`). Entering one is done on a short-lived dedicated thread
//! ([`run_in`]): `setns(2)` changes only the calling thread, so the rest of
//! the process stays where it was, and a socket or TUN device created on that
//! thread stays in the namespace after the thread ends.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Directory of the named namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// The bind-mount path of a named namespace.
pub fn ns_path(ns: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(ns)
}

/// Whether a named namespace exists.
pub fn exists(ns: &str) -> bool {
    ns_path(ns).exists()
}

/// Names of all named namespaces.
pub fn list() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    names
}

/// Run `ip` with `args`; the error carries the command and its stderr.
pub fn ip<S: AsRef<OsStr>>(args: &[S]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running `ip` (install iproute2)")?;
    if !out.status.success() {
        let shown: Vec<String> = args
            .iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect();
        bail!(
            "`ip {}` failed ({}): {}",
            shown.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Create a named namespace with its loopback up; fails if it exists.
pub fn add(ns: &str) -> anyhow::Result<()> {
    if exists(ns) {
        bail!("network namespace {ns} already exists (leftover? run `linkemu cleanup`)");
    }
    ip(&["netns", "add", ns])?;
    ip(&["-n", ns, "link", "set", "lo", "up"])
}

/// Delete a named namespace; a missing one is not an error.
pub fn delete(ns: &str) -> anyhow::Result<()> {
    if !exists(ns) {
        return Ok(());
    }
    ip(&["netns", "delete", ns])
}

/// A command that runs `program` inside namespace `ns` (`ip netns exec`).
pub fn command_in(ns: &str, program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new("ip");
    cmd.arg("netns").arg("exec").arg(ns).arg(program);
    cmd
}

/// Run `f` on a fresh thread that has entered namespace `ns`, and return its
/// result. Sockets (and TUN devices) created by `f` belong to `ns` for their
/// whole life, whichever thread uses them later. A panic in `f` is resumed
/// on the caller's thread.
pub fn run_in<F, T>(ns: &str, f: F) -> anyhow::Result<T>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    let file = File::open(ns_path(ns)).with_context(|| format!("opening namespace {ns}"))?;
    std::thread::scope(|scope| {
        let handle = scope.spawn(|| {
            // SAFETY: setns on a valid namespace fd; it affects only this thread.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        });
        match handle.join() {
            Ok(r) => r.with_context(|| format!("entering namespace {ns}")),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Processes (whole processes, judged by their main thread) whose network
/// namespace is `ns`, never including this process or its parent.
pub fn pids_in(ns: &str) -> Vec<i32> {
    let Ok(target) = std::fs::metadata(ns_path(ns)) else {
        return Vec::new();
    };
    let me = std::process::id() as i32;
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let Ok(proc_dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    proc_dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid > 1 && pid != me && pid != parent)
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/net"))
                .map(|m| m.ino() == target.ino() && m.dev() == target.dev())
                .unwrap_or(false)
        })
        .collect()
}

/// SIGKILL every process in `ns` and wait (bounded by `timeout`) until none
/// is left. Returns the pids still present at the deadline.
pub fn kill_all_in(ns: &str, timeout: Duration) -> Vec<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        let pids = pids_in(ns);
        if pids.is_empty() || Instant::now() >= deadline {
            return pids;
        }
        for pid in &pids {
            // SAFETY: kill with a pid we just listed; a stale pid is harmless
            // (ESRCH), and pids_in never lists us, our parent or init.
            unsafe {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether we run as root (the emulator needs it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
