//! Finding links and removing leftovers (`linkemu list`, `linkemu cleanup`).
//!
//! A link is known by its state directory (`/run/linkemu/<tag>/`) and by its
//! namespaces (`<tag>-cloud`, `<tag>-edge`). A link is *live* while the
//! router recorded in its pid file runs (a zombie or a recycled pid running
//! something else counts as dead). Cleanup removes dead links only, unless
//! asked to stop live ones too, so it is safe to run while other test runs
//! are using their links. Namespaces without a state directory are removed
//! only if their tag has the default shape (`te<digits>-<digits>`): a name
//! like that was made by linkemu.

use std::time::{Duration, Instant, SystemTime};

use crate::link::router_pid_of;
use crate::naming;
use crate::netns;
use crate::router;

/// What is known about one tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkStatus {
    /// The tag.
    pub tag: String,
    /// The router's pid, if recorded.
    pub router_pid: Option<u32>,
    /// Whether that router is running.
    pub alive: bool,
    /// Its namespaces that exist.
    pub namespaces: Vec<String>,
    /// Whether it has a state directory.
    pub has_state: bool,
}

/// What a cleanup did.
#[derive(Clone, Debug, Default)]
pub struct CleanupReport {
    /// Tags removed.
    pub removed: Vec<String>,
    /// Live tags left alone.
    pub skipped_live: Vec<String>,
    /// Failures, one line each.
    pub errors: Vec<String>,
}

/// Whether `pid` is a running (not zombie) `linkemu` process.
pub fn router_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state letter follows the parenthesised command name.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    if matches!(state, Some("Z") | Some("X") | None) {
        return false;
    }
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains("linkemu"))
        .unwrap_or(false)
}

/// All links, from state directories and namespace names.
pub fn list() -> Vec<LinkStatus> {
    let mut tags: Vec<String> = Vec::new();
    if let Ok(dir) = std::fs::read_dir(naming::state_root()) {
        for entry in dir.filter_map(|e| e.ok()) {
            if entry.path().is_dir() {
                if let Ok(name) = entry.file_name().into_string() {
                    tags.push(name);
                }
            }
        }
    }
    for ns in netns::list() {
        if let Some(tag) = naming::tag_of_ns(&ns) {
            let has_state = naming::state_dir(tag).is_dir();
            if has_state || naming::is_default_tag(tag) {
                tags.push(tag.to_string());
            }
        }
    }
    tags.sort();
    tags.dedup();
    tags.into_iter()
        .filter(|t| naming::validate_tag(t).is_ok())
        .map(|tag| {
            let router_pid = router_pid_of(&tag);
            LinkStatus {
                alive: router_pid.map(router_alive).unwrap_or(false),
                router_pid,
                namespaces: [naming::cloud_ns(&tag), naming::edge_ns(&tag)]
                    .into_iter()
                    .filter(|ns| netns::exists(ns))
                    .collect(),
                has_state: naming::state_dir(&tag).is_dir(),
                tag,
            }
        })
        .collect()
}

/// A state directory younger than this without a pid file may be a router
/// that is starting: leave it alone.
const STARTING_GRACE: Duration = Duration::from_secs(30);

fn is_starting(status: &LinkStatus) -> bool {
    if status.router_pid.is_some() || !status.has_state {
        return false;
    }
    std::fs::metadata(naming::state_dir(&status.tag))
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .map(|age| age < STARTING_GRACE)
        .unwrap_or(false)
}

/// Remove dead links' leftovers; with `all`, stop live routers first
/// (SIGTERM, then SIGKILL after 5 s).
pub fn cleanup(all: bool) -> CleanupReport {
    let mut report = CleanupReport::default();
    for status in list() {
        if status.alive && !all {
            report.skipped_live.push(status.tag);
            continue;
        }
        if is_starting(&status) && !all {
            report.skipped_live.push(status.tag);
            continue;
        }
        if status.alive {
            if let Some(pid) = status.router_pid {
                stop_router(pid);
            }
        }
        match router::teardown_tag(&status.tag) {
            Ok(()) => report.removed.push(status.tag),
            Err(e) => report.errors.push(format!("{}: {e:#}", status.tag)),
        }
    }
    report
}

/// SIGTERM a router and wait for it to exit (it tears its link down);
/// SIGKILL it after 5 s.
fn stop_router(pid: u32) {
    let pid_i = pid as i32;
    // SAFETY: signalling a pid we checked is a live linkemu router.
    unsafe {
        libc::kill(pid_i, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while router_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if router_alive(pid) {
        // SAFETY: as above.
        unsafe {
            libc::kill(pid_i, libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
