//! Scenario 6, the edge's footprint: stripped size of the `tether-edge` binary this run
//! uses, its RSS while connected and idle, and its wake-ups per minute when idle
//! (voluntary + involuntary context switches of all its threads over a window).

use std::time::Duration;

use anyhow::{Context, Result};
use linkemu::Impairment;

use crate::bed::{Bed, BedOptions};
use crate::table::{Cell, Table};
use crate::Report;

/// Context switches of every thread of `pid` so far.
fn switches(pid: u32) -> Result<u64> {
    let mut n = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let s = std::fs::read_to_string(t?.path().join("status"))?;
        for l in s.lines() {
            if let Some(v) = l
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                n += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    Ok(n)
}

/// A field of `/proc/PID/status` in kB.
pub fn status_kb(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// Stripped size of `bin` in bytes (copied into `dir` first); whether strip worked.
fn stripped_size(bin: &std::path::Path, dir: &std::path::Path) -> Result<(u64, bool)> {
    let name = bin.file_name().context("binary name")?;
    let copy = dir.join(format!("{}.stripped", name.to_string_lossy()));
    std::fs::copy(bin, &copy).with_context(|| format!("copying {}", bin.display()))?;
    let ok = std::process::Command::new("strip")
        .arg(&copy)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    Ok((std::fs::metadata(&copy)?.len(), ok))
}

/// Runs the scenario and appends its table: the edge-side agent of every tunnel,
/// connected and idle (`tether-edge`, the `ssh -N -R` client, `rathole --client`).
pub async fn run(r: &mut Report, window: Duration) -> Result<()> {
    let bed = Bed::start(Impairment::clean(), BedOptions::default()).await?;
    // (peer, pid, binary). The agents run under `linkemu`'s setns + exec: the
    // child's pid is the agent's.
    let mut agents = Vec::new();
    for p in bed
        .others
        .iter()
        .filter(|p| p.name() == "ssh-R" || p.name() == "rathole-client")
    {
        let (peer, bin) = if p.name() == "ssh-R" {
            ("ssh -R", std::path::PathBuf::from("/usr/bin/ssh"))
        } else {
            (
                "rathole",
                crate::bed::rathole_bin().context("rathole binary")?,
            )
        };
        if let Some(pid) = p.pid() {
            agents.push((peer, pid, bin));
        }
    }
    agents.push((
        crate::bed::TETHER,
        bed.edge.pid().context("edge pid")?,
        crate::bed::edge_bin()?,
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before: Vec<u64> = agents.iter().map(|a| switches(a.1).unwrap_or(0)).collect();
    tokio::time::sleep(window).await;
    let mut t = Table::new(
        &[
            "edge agent",
            "binary MiB (stripped)",
            "idle RSS MiB",
            &format!(
                "wake-ups per minute idle (context switches, all threads, {} s)",
                window.as_secs()
            ),
        ],
        1,
    );
    for ((peer, pid, bin), before) in agents.iter().zip(before) {
        let size = match stripped_size(bin, bed.dir.path()) {
            Ok((n, true)) => Cell::Num(n as f64 / 1048576.0),
            Ok((n, false)) => Cell::text(format!("{:.1} (unstripped)", n as f64 / 1048576.0)),
            Err(e) => Cell::text(format!("{e:#}")),
        };
        let rss = match status_kb(*pid, "VmRSS:") {
            Ok(kb) => Cell::Num(kb as f64 / 1024.0),
            Err(e) => Cell::text(format!("{e:#}")),
        };
        let wake = match switches(*pid) {
            Ok(n) => Cell::Num(n.saturating_sub(before) as f64 * 60.0 / window.as_secs_f64()),
            Err(e) => Cell::text(format!("{e:#}")),
        };
        t.row(peer, vec![size, rss, wake]);
    }
    r.push(&format!(
        "\n### Edge footprint (tether-edge: {})\n\nConnected and idle, measured from 2 s after connecting. tether-edge: defaults — one runtime worker, pods read every 20 s, adaptive keep-alive from 20 s (no NAT on this link, so it doubles towards 110 s: 20, 20, 40, … s during the window); ssh: ServerAliveInterval 5 s; rathole: defaults (heartbeat 30 s).\n\n",
        if std::env::var_os("TETHER_EDGE_BIN").is_some() {
            "the `edge` profile build, as shipped"
        } else if cfg!(debug_assertions) {
            "debug build"
        } else {
            "release build"
        }
    ));
    r.push(&t.render());
    Ok(())
}
