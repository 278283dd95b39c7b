//! What the benchmark charges to a peer's processes, read from `/proc`: which processes
//! are a peer's agents, their process trees (sshd forks per connection), and the trees'
//! RSS and CPU time.

use anyhow::{bail, Context, Result};

use crate::bed::{Bed, TETHER};

/// The agents of a peer: (edge side, cloud side) pids; `None` for a peer without
/// agents of its own (direct).
pub fn agents(bed: &Bed, peer: &str) -> Option<(u32, u32)> {
    let by = |name: &str| {
        bed.others
            .iter()
            .find(|p| p.name() == name)
            .and_then(|p| p.pid())
    };
    match peer {
        TETHER => Some((bed.edge.pid()?, bed.cloud.pid()?)),
        "ssh -R" => Some((by("ssh-R")?, by("sshd")?)),
        "rathole" => Some((by("rathole-client")?, by("rathole-server")?)),
        _ => None,
    }
}

/// The fields of `/proc/PID/stat` after the command (state is `[0]`), or `None` when
/// the process is gone.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// Every process there is now and its parent, from one listing of `/proc` (a
/// process that exits while we look is left out).
fn parents() -> Result<Vec<(u32, u32)>> {
    let mut parents = Vec::new();
    for e in std::fs::read_dir("/proc").context("listing /proc")? {
        let Ok(e) = e else { continue };
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Some(f) = stat_fields(p) else { continue };
        let ppid = f.get(1).and_then(|v| v.parse::<u32>().ok()).unwrap_or(0);
        parents.push((p, ppid));
    }
    Ok(parents)
}

/// `pid` and every process descending from it in `parents`.
fn descendants(parents: &[(u32, u32)], pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let cur = tree[i];
        tree.extend(parents.iter().filter(|(_, pp)| *pp == cur).map(|(p, _)| *p));
        i += 1;
    }
    tree
}

/// `pid` and every process descending from it, as they are now.
pub fn tree(pid: u32) -> Result<Vec<u32>> {
    Ok(descendants(&parents()?, pid))
}

/// RSS of `pid` and all its descendants, in KiB.
pub fn tree_rss_kb(pid: u32) -> Result<u64> {
    let mut kb = 0;
    for p in tree(pid)? {
        kb += crate::footprint::status_kb(p, "VmRSS:").unwrap_or(0);
    }
    if kb == 0 {
        bail!("no RSS for process {pid}");
    }
    Ok(kb)
}

/// utime + stime of `pid` (all its threads), in clock ticks.
pub fn cpu_ticks(pid: u32) -> Result<u64> {
    let f = stat_fields(pid).with_context(|| format!("no /proc/{pid}/stat"))?;
    // utime [11], stime [12].
    let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    Ok(field(11) + field(12))
}

/// CPU time of `tree` (the processes alive now; a child that exited since the last
/// look takes its time with it), in clock ticks.
fn tree_cpu_ticks(tree: &[u32]) -> u64 {
    // A process may exit while we look.
    tree.iter().map(|&p| cpu_ticks(p).unwrap_or(0)).sum()
}

/// Clock ticks per second (`/proc`'s unit of CPU time).
pub fn ticks_per_sec() -> f64 {
    // SAFETY: sysconf reads a constant of the system.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64
}

/// CPU time at one moment, in ticks: a peer's agents at each end (their trees) and the
/// link's router.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSample {
    ticks: [u64; 3],
}

impl CpuSample {
    /// Reads the trees of `agents` (edge side, cloud side) and the router `router`.
    pub fn take(agents: Option<(u32, u32)>, router: u32) -> Result<CpuSample> {
        let (edge, cloud) = match agents {
            Some((e, c)) => {
                let parents = parents()?;
                (
                    tree_cpu_ticks(&descendants(&parents, e)),
                    tree_cpu_ticks(&descendants(&parents, c)),
                )
            }
            None => (0, 0),
        };
        Ok(CpuSample {
            ticks: [edge, cloud, cpu_ticks(router).context("the link's router")?],
        })
    }
}

/// Whose CPU time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuPart {
    /// The agent on the edge side (tether-edge, ssh, rathole's client).
    Edge = 0,
    /// The agent on the cloud side (tether-cloud, sshd, rathole's server).
    Cloud = 1,
    /// The link's router.
    Router = 2,
}

/// CPU time spent on transfers, and the bytes they moved.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSpent {
    ticks: [u64; 3],
    bytes: u64,
}

impl CpuSpent {
    /// Adds one transfer of `bytes` between `before` and `after`.
    pub fn add(&mut self, before: CpuSample, after: CpuSample, bytes: u64) {
        for (t, (b, a)) in self
            .ticks
            .iter_mut()
            .zip(before.ticks.iter().zip(after.ticks))
        {
            *t += a.saturating_sub(*b);
        }
        self.bytes += bytes;
    }

    /// CPU seconds per GiB moved, or `None` before any transfer.
    pub fn per_gib(&self, part: CpuPart) -> Option<f64> {
        if self.bytes == 0 {
            return None;
        }
        let ticks = self.ticks[part as usize];
        Some(ticks as f64 / ticks_per_sec() / (self.bytes as f64 / f64::from(1u32 << 30)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_time_grows_with_work() {
        let me = std::process::id();
        assert!(tree(me).expect("tree").contains(&me));
        let before = tree_cpu_ticks(&tree(me).expect("tree"));
        // Spin until 20 ticks (200 ms at 100 Hz) of CPU time are counted, for at
        // most 30 s of wall time however busy the machine is.
        let t = std::time::Instant::now();
        let mut x = 0u64;
        let mut spun = 0;
        while spun < 20 && t.elapsed() < std::time::Duration::from_secs(30) {
            for _ in 0..1_000_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            spun = tree_cpu_ticks(&tree(me).expect("tree")) - before;
        }
        assert!(
            spun >= 20,
            "{spun} ticks counted in {:?} of spinning",
            t.elapsed()
        );
        assert!(tree_rss_kb(me).expect("rss") > 0);
    }

    #[test]
    fn cpu_per_gib() {
        let mut spent = CpuSpent::default();
        assert_eq!(spent.per_gib(CpuPart::Edge), None);
        let hz = ticks_per_sec();
        let at = |edge: f64, cloud: f64, router: f64| CpuSample {
            ticks: [
                (edge * hz) as u64,
                (cloud * hz) as u64,
                (router * hz) as u64,
            ],
        };
        // Per half a GiB, twice: 2 s of the edge, 3 s of the cloud, 1 s of the router.
        spent.add(at(1.0, 0.0, 5.0), at(3.0, 3.0, 6.0), 1 << 29);
        spent.add(at(3.0, 3.0, 6.0), at(5.0, 6.0, 7.0), 1 << 29);
        assert_eq!(spent.per_gib(CpuPart::Edge), Some(4.0));
        assert_eq!(spent.per_gib(CpuPart::Cloud), Some(6.0));
        assert_eq!(spent.per_gib(CpuPart::Router), Some(2.0));
    }
}
