//! Scenario 7b, the edge's probing of a cloud that does not answer: what a real
//! `tether-edge` sends while its link is up and its cloud is down (an outage of the cloud,
//! a firewall), and how soon after the cloud's return it would be back.
//!
//! Two edges, each dialling a UDP port on loopback where nothing answers (a socket this
//! scenario owns, which timestamps every datagram): one with the defaults but
//! `--reconnect-patient-after` shortened (the default is the session's grace period, at
//! least 300 s, which would make the run long), one with `--reconnect-patient-interval 0s`
//! (dense probing for good, as before patient probing). For each phase — dense probing
//! before the edge turns patient, patient probing after — the datagrams and wire bytes
//! (IPv4 and UDP headers included) a minute, and, for a cloud back at a random moment of
//! the phase, the wait until the edge's next Initial (after which it is one handshake
//! from connected): mean and largest.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tether_tests::pki;
use tether_tests::process::{Proc, SpawnOptions};

use crate::table::{Cell, Table};
use crate::Report;

/// IPv4 (20) and UDP (8) header bytes of every datagram.
const HEADERS: usize = 28;

/// One run's timing.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// `--reconnect-patient-after` of the patient edge.
    pub patient_after: Duration,
    /// Its `--reconnect-patient-interval` (the default unless shorter for `--quick`).
    pub interval: Duration,
    /// How long both edges are watched.
    pub watch: Duration,
    /// The patient phase: from this long into the run (the edge turned patient
    /// after its round in progress at `patient_after`) to `watch` less `tail`
    /// (so a return late in the phase still sees the next datagram).
    pub patient_from: Duration,
    pub tail: Duration,
}

/// Figures of one phase of one edge.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Phase {
    pub datagrams_per_min: f64,
    pub wire_bytes_per_min: f64,
    /// Wait until the next datagram from a uniformly random moment of the phase.
    pub mean_wait: Duration,
    pub max_wait: Duration,
}

/// The figures of the phase `[from, to)` of datagrams at `at` (seconds from the start,
/// each with its length), the wait sampled every 10 ms. `None` if a moment of the phase
/// has no datagram after it.
pub fn phase(at: &[(f64, usize)], from: f64, to: f64) -> Option<Phase> {
    let span = to - from;
    if span <= 0.0 {
        return None;
    }
    let within = at.iter().filter(|(t, _)| *t >= from && *t < to);
    let (n, bytes) = within.fold((0usize, 0usize), |(n, b), (_, len)| {
        (n + 1, b + len + HEADERS)
    });
    let (mut sum, mut max, mut samples) = (0.0f64, 0.0f64, 0usize);
    let mut i = 0;
    let mut t = from;
    while t < to {
        while i < at.len() && at[i].0 < t {
            i += 1;
        }
        let next = at.get(i)?.0;
        sum += next - t;
        max = max.max(next - t);
        samples += 1;
        t = from + samples as f64 * 0.01;
    }
    Some(Phase {
        datagrams_per_min: n as f64 * 60.0 / span,
        wire_bytes_per_min: bytes as f64 * 60.0 / span,
        mean_wait: Duration::from_secs_f64(sum / samples.max(1) as f64),
        max_wait: Duration::from_secs_f64(max),
    })
}

/// Reads `sock` for `watch`: every datagram's time since `start` and length.
fn record(sock: UdpSocket, start: Instant, watch: Duration) -> Result<Vec<(f64, usize)>> {
    sock.set_read_timeout(Some(Duration::from_millis(100)))?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 2048];
    while start.elapsed() < watch {
        if let Ok((len, _)) = sock.recv_from(&mut buf) {
            seen.push((start.elapsed().as_secs_f64(), len));
        }
    }
    Ok(seen)
}

/// Runs the scenario and appends its table.
pub async fn run(r: &mut Report, timing: Timing) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let nodes = ["edge-patient", "edge-dense"];
    let pki = pki::mint(dir.path(), &nodes)?;
    let flag = |d: Duration| match d.as_millis() {
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    };
    let (after, interval) = (flag(timing.patient_after), flag(timing.interval));
    let flags: [Vec<&str>; 2] = [
        vec![
            "--reconnect-patient-after",
            &after,
            "--reconnect-patient-interval",
            &interval,
        ],
        vec!["--reconnect-patient-interval", "0s"],
    ];
    let start = Instant::now();
    let mut watchers = Vec::new();
    let mut edges = Vec::new();
    for (node, extra) in nodes.iter().zip(&flags) {
        let sock = UdpSocket::bind("127.0.0.1:0")?;
        let addr = sock.local_addr()?;
        let watch = timing.watch;
        watchers.push(std::thread::spawn(move || record(sock, start, watch)));
        let mut cmd = tokio::process::Command::new(crate::bed::edge_bin()?);
        cmd.arg("--cloud")
            .arg(addr.to_string())
            .args(pki.edge_flags(node).context("edge certificate")?)
            .args(["--kubelet-url", "http://127.0.0.1:9"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(["--announce-address", &format!("{node}.invalid")])
            .args(extra)
            .env("TETHER_LOG", "info")
            .env("RUST_BACKTRACE", "0");
        edges.push(Proc::spawn(node, cmd, dir.path(), SpawnOptions::default())?);
    }
    let mut seen = Vec::new();
    for w in watchers {
        let got = tokio::task::spawn_blocking(move || w.join())
            .await?
            .map_err(|_| anyhow::anyhow!("a datagram watcher panicked"))??;
        seen.push(got);
    }
    let patient_said = std::fs::read_to_string(edges[0].log_path())
        .unwrap_or_default()
        .contains("probing it one attempt at a time");
    drop(edges);
    anyhow::ensure!(
        patient_said,
        "the patient edge did not say it turned patient within {:?}",
        timing.watch
    );
    let end = (timing.watch - timing.tail).as_secs_f64();
    let dense_to = timing.patient_after.as_secs_f64();
    let mut t = Table::new(
        &[
            "edge, phase",
            "datagrams a minute",
            "wire KB a minute",
            "next Initial after the cloud is back: mean s",
            "largest s",
        ],
        1,
    );
    let rows = [
        ("patient edge, dense phase", &seen[0], 0.0, dense_to),
        (
            "patient edge, patient phase",
            &seen[0],
            timing.patient_from.as_secs_f64(),
            end,
        ),
        (
            "dense edge (interval 0s), first phase",
            &seen[1],
            0.0,
            dense_to,
        ),
        (
            "dense edge (interval 0s), second phase",
            &seen[1],
            timing.patient_from.as_secs_f64(),
            end,
        ),
    ];
    for (name, at, from, to) in rows {
        let cells = match phase(at, from, to) {
            Some(p) => vec![
                Cell::Num(p.datagrams_per_min),
                Cell::Num(p.wire_bytes_per_min / 1000.0),
                Cell::Num(p.mean_wait.as_secs_f64()),
                Cell::Num(p.max_wait.as_secs_f64()),
            ],
            None => vec![Cell::text("no datagram after a moment of the phase"); 4],
        };
        t.row(name, cells);
    }
    r.push(&format!(
        "\n### Cellular data: a cloud that does not answer\n\nTwo real tether-edges (defaults otherwise), each dialling a UDP port on loopback where nothing answers, watched {} s: \
         the patient edge with `--reconnect-patient-after {after}` (default: the session's grace period, at least 300 s) and `--reconnect-patient-interval {interval}`; \
         the dense edge with `--reconnect-patient-interval 0s` (as before patient probing). Dense phase: the first {} s; second phase: {} to {} s. \
         Wire bytes include IPv4 and UDP headers. The wait: from a moment of the phase drawn uniformly (every 10 ms) to the edge's next datagram, \
         after which it is one handshake from connected.\n\n{}",
        timing.watch.as_secs(),
        timing.patient_after.as_secs(),
        timing.patient_from.as_secs(),
        end,
        t.render()
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Datagrams every 2 s in a 10 s phase: 30 a minute, each 1,200 bytes
    /// plus headers; a random moment waits 1 s for the next on average and
    /// at most 2 s.
    #[test]
    fn a_regular_phase() {
        let at: Vec<(f64, usize)> = (0..=6).map(|k| (k as f64 * 2.0, 1200)).collect();
        let p = phase(&at, 0.0, 10.0).unwrap();
        assert!((p.datagrams_per_min - 30.0).abs() < 1e-9, "{p:?}");
        assert!((p.wire_bytes_per_min - 30.0 * 1228.0).abs() < 1e-6, "{p:?}");
        assert!((p.mean_wait.as_secs_f64() - 1.0).abs() < 0.02, "{p:?}");
        assert!((p.max_wait.as_secs_f64() - 2.0).abs() < 0.02, "{p:?}");
    }

    /// One long gap dominates the mean (a random moment more likely falls
    /// in it): gaps of 1 s and 9 s wait (1 + 81) / 2 / 10 = 4.1 s on average.
    #[test]
    fn a_long_gap_weighs_more() {
        let at = [(0.0, 1200), (1.0, 1200), (10.0, 1200)];
        let p = phase(&at, 0.0, 10.0).unwrap();
        assert!((p.mean_wait.as_secs_f64() - 4.1).abs() < 0.02, "{p:?}");
        assert!((p.max_wait.as_secs_f64() - 9.0).abs() < 0.02, "{p:?}");
        // A moment with no datagram after it has no figure.
        assert_eq!(phase(&at, 0.0, 11.0), None);
        assert_eq!(phase(&at, 5.0, 5.0), None);
    }
}
