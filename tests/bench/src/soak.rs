//! The soak (issue "Hardening"): many exec sessions through one edge for a long
//! time, the link going down every minute.
//!
//! `n` upgraded exec sessions stay open through Tether for the whole run; each
//! writes a position-dependent byte pattern (`CHUNK` bytes every `EVERY`) and
//! checks every echoed byte against it, so a byte lost, doubled or reordered is
//! caught where it happens. Every minute the emulated link has a total outage
//! whose length cycles through [`OUTAGES`] (5–40 s: the longer ones outlast the
//! 30 s QUIC idle timeout, so the session is resumed over a new connection).
//! Every other minute the link comes back slow ([`slow_return`]: 1 s RTT, 10 %
//! loss, for [`SLOW_FOR`] or to the minute's end) instead of clean, and goes
//! down again for [`FLAP_DOWN`] [`FLAP_AFTER`] into it, so the resumes and
//! re-attaches of every session run over the hard return too. An edge that
//! lost its connection in the outage and has not connected again by then
//! keeps the slow link until it has (up to [`SLOW_MAX`]): the report says
//! when it connected, and a resume that never happened over the slow link
//! shows as 0.
//! At the end the writers stop, every session must have echoed exactly what it
//! wrote, and the cloud's and edge's RSS are compared with their values after
//! the first minute (every session open, the longest outage and its resume
//! behind them: buffers a resume allocates once are not a leak; growth after
//! that is). RSS is sampled after every minute to show the trend. Verdict: 0 sessions lost, 0 bytes lost or
//! duplicated, RSS at the end within [`RSS_TOLERANCE`] of the start. The
//! command prints a table and exits non-zero when the verdict fails; it is a
//! soak, not a timing test (no figure of speed is judged).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use linkemu::Impairment;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::bed::{Bed, BedOptions, TETHER};
use crate::footprint::status_kb;
use crate::table::{Cell, Table};
use crate::Report;

/// Bytes each session writes per tick.
const CHUNK: usize = 64;
/// Tick of each session's writer.
const EVERY: Duration = Duration::from_secs(1);
/// Outage lengths, one a minute, in turn (seconds). The first is the longest,
/// so the warm-up minute allocates every buffer a resume needs once: RSS that
/// grows after it is a leak, not a high-water mark. The second outlasts the
/// idle timeout too and comes back slow ([`back_slow`]), so even the short
/// soak's two minutes resume every session over the hard return.
pub const OUTAGES: [u64; 10] = [40, 35, 5, 20, 12, 31, 8, 25, 38, 15];
/// How long the link stays slow after an odd minute's outage (at most to
/// the minute's end), before it is clean again.
pub const SLOW_FOR: Duration = Duration::from_secs(20);
/// The longest the link stays slow while the edge, its connection lost in
/// the outage, has not connected again (past [`SLOW_FOR`] or the minute's
/// end). A handshake over the slow link that takes longer is a failure.
pub const SLOW_MAX: Duration = Duration::from_secs(60);
/// How long into a slow return the link goes down again ([`FLAP_DOWN`]): a
/// flap while the sessions are being resumed and re-attached.
pub const FLAP_AFTER: Duration = Duration::from_secs(3);
/// How long that flap lasts.
pub const FLAP_DOWN: Duration = Duration::from_secs(2);
/// Allowed growth of either agent's RSS from start to end.
pub const RSS_TOLERANCE: f64 = 0.10;
/// Opens in flight at once.
const IN_FLIGHT: usize = 64;

/// The link as it comes back after an odd minute's outage: 1 s RTT, 10 %
/// loss (the bench's slow return: its outage cycles use it too).
pub fn slow_return() -> Impairment {
    Impairment::clean()
        .with_delay(Duration::from_millis(500))
        .with_loss(10.0)
}

/// Whether minute `minute`'s outage ends with the link coming back slow.
pub fn back_slow(minute: u64) -> bool {
    minute % 2 == 1
}

/// What happened while the link was slow after one minute's outage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlowReturn {
    pub minute: u64,
    /// How many times the edge connected to the cloud while the link was
    /// slow (0: its connection outlived the outage; 1: every session was
    /// resumed over the slow link).
    pub connects: usize,
    /// From the link's return to the edge's first connection over it.
    pub connected_after: Option<Duration>,
    /// How long the link stayed slow.
    pub slow_for: Duration,
}

/// tether-edge's log lines when it has connected to the cloud, and when its
/// connection is lost.
const CONNECTED: &str = "connected to the cloud";
const LOST: &str = "connection to the cloud lost";

/// Whether the edge's log `since` the outage says its connection was lost
/// and it has not connected again.
fn disconnected(since: &str) -> bool {
    since.rfind(LOST) > since.rfind(CONNECTED)
}

/// Brings the link back slow after an outage ([`slow_return`]), flaps it
/// ([`FLAP_DOWN`], [`FLAP_AFTER`] in), and makes it clean again after
/// [`SLOW_FOR`] or at the minute's end (`next`): later if the edge lost its
/// connection in the outage and has not connected again, until it has, up
/// to [`SLOW_MAX`]. So the resume over the slow link is always exercised
/// when the outage outlasted the connection, however long its handshake
/// takes; the soak's check is that it happened. `since_outage` is the
/// length of the edge's log when the outage began.
async fn slow_return_of(
    bed: &Bed,
    minute: u64,
    since_outage: usize,
    next: Instant,
) -> Result<SlowReturn> {
    let seen = edge_log(bed).len();
    bed.link.set(slow_return())?;
    bed.link.outage(false)?;
    let restored = Instant::now();
    let until = (restored + SLOW_FOR)
        .min(next)
        .max(restored + FLAP_AFTER + FLAP_DOWN);
    // The flap: none yet, down, over.
    let (mut flap_down, mut flapped) = (false, false);
    let mut connected_after = None;
    loop {
        if !flap_down && restored.elapsed() >= FLAP_AFTER {
            bed.link.outage(true)?;
            flap_down = true;
        }
        if flap_down && !flapped && restored.elapsed() >= FLAP_AFTER + FLAP_DOWN {
            bed.link.outage(false)?;
            flapped = true;
        }
        let log = edge_log(bed);
        if connected_after.is_none() && log.get(seen..).is_some_and(|l| l.contains(CONNECTED)) {
            connected_after = Some(restored.elapsed());
        }
        let down = log.get(since_outage..).is_some_and(disconnected);
        if flapped && Instant::now() >= until && (!down || restored.elapsed() >= SLOW_MAX) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let slow_for = restored.elapsed();
    bed.link.set(Impairment::clean())?;
    let log = edge_log(bed);
    let window = log.get(seen..).unwrap_or_default();
    let connects = window.matches(CONNECTED).count();
    if connects == 0 {
        // What the edge did instead, for whoever reads the report.
        eprintln!(
            "tether-bench soak: minute {minute}: the edge did not connect while the link was slow ({slow_for:?}); its log then:\n{window}"
        );
    }
    Ok(SlowReturn {
        minute,
        connects,
        connected_after,
        slow_for,
    })
}

fn pattern_byte(session: u64, i: u64) -> u8 {
    (i.wrapping_add(session.wrapping_mul(7919))
        .wrapping_mul(2654435761)
        >> 13) as u8
}

/// One session's counters.
struct Session {
    written: Arc<AtomicU64>,
    echoed: Arc<AtomicU64>,
    writer: tokio::task::JoinHandle<Result<u64>>,
    reader: tokio::task::JoinHandle<Result<u64>>,
}

/// What the soak saw.
pub struct Verdict {
    pub lost_sessions: usize,
    pub bytes_written: u64,
    pub bytes_wrong: u64,
    pub outages: Vec<u64>,
    /// Each minute the link came back slow, in turn.
    pub slow_returns: Vec<SlowReturn>,
    /// (start, end) KiB.
    pub cloud_rss: (u64, u64),
    pub edge_rss: (u64, u64),
    /// (cloud, edge) KiB after each minute.
    pub samples: Vec<(u64, u64)>,
    pub first_error: Option<String>,
}

impl Verdict {
    pub fn rss_ok(&self) -> bool {
        let within = |(a, b): (u64, u64)| (b as f64) <= (a as f64) * (1.0 + RSS_TOLERANCE);
        within(self.cloud_rss) && within(self.edge_rss)
    }

    pub fn ok(&self) -> bool {
        self.lost_sessions == 0 && self.bytes_wrong == 0 && self.rss_ok()
    }
}

async fn open(bed: &Bed, id: u64, stop: Arc<AtomicBool>) -> Result<Session> {
    let dial = bed
        .peers
        .iter()
        .find(|p| p.name == TETHER)
        .context("no tether peer in the bed")?
        .dial
        .clone()
        .map_err(anyhow::Error::msg)?;
    let io = tokio::time::timeout(Duration::from_secs(60), crate::measure::exec(&dial))
        .await
        .context("open timed out")??;
    let (mut r, mut w) = tokio::io::split(io);
    let written = Arc::new(AtomicU64::new(0));
    let echoed = Arc::new(AtomicU64::new(0));
    let wr = written.clone();
    let writer = tokio::spawn(async move {
        let mut off = 0u64;
        // Spread the sessions' ticks over the interval.
        tokio::time::sleep(EVERY.mul_f64((id % 1000) as f64 / 1000.0)).await;
        while !stop.load(Ordering::Relaxed) {
            let chunk: Vec<u8> = (off..off + CHUNK as u64)
                .map(|i| pattern_byte(id, i))
                .collect();
            w.write_all(&chunk).await?;
            off += CHUNK as u64;
            wr.store(off, Ordering::Relaxed);
            tokio::time::sleep(EVERY).await;
        }
        Ok(off)
    });
    let ec = echoed.clone();
    let reader = tokio::spawn(async move {
        let mut off = 0u64;
        let mut buf = vec![0u8; 4096];
        loop {
            let n = r.read(&mut buf).await?;
            if n == 0 {
                return Ok(off);
            }
            for (k, b) in buf[..n].iter().enumerate() {
                let at = off + k as u64;
                if *b != pattern_byte(id, at) {
                    bail!("session {id}: echoed byte {at} is wrong (lost, doubled or reordered)");
                }
            }
            off += n as u64;
            ec.store(off, Ordering::Relaxed);
        }
    });
    Ok(Session {
        written,
        echoed,
        writer,
        reader,
    })
}

/// The edge's log so far (empty if it cannot be read).
fn edge_log(bed: &Bed) -> String {
    std::fs::read_to_string(bed.edge.log_path()).unwrap_or_default()
}

fn rss(bed: &Bed) -> Result<(u64, u64)> {
    let cloud = bed.cloud.pid().context("cloud pid")?;
    let edge = bed.edge.pid().context("edge pid")?;
    Ok((status_kb(cloud, "VmRSS:")?, status_kb(edge, "VmRSS:")?))
}

/// Runs the soak: `n` sessions for `minutes`, an outage every minute.
pub async fn soak(n: usize, minutes: u64) -> Result<Verdict> {
    let bed = Bed::start(
        Impairment::clean(),
        BedOptions {
            tether_only: true,
            ..BedOptions::default()
        },
    )
    .await
    .context("starting the bed")?;
    let stop = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let bed = Arc::new(bed);
    let mut opening = Vec::with_capacity(n);
    for id in 0..n as u64 {
        let (bed, gate, stop) = (bed.clone(), gate.clone(), stop.clone());
        opening.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await?;
            open(&bed, id, stop).await
        }));
    }
    let mut sessions = Vec::with_capacity(n);
    for o in opening {
        sessions.push(o.await.context("open task")??);
    }
    eprintln!("tether-bench soak: {n} sessions open");
    let mut start_rss = rss(&bed)?;
    let t0 = Instant::now();
    let mut outages = Vec::new();
    let mut slow_returns = Vec::new();
    let mut samples = Vec::new();
    for minute in 0..minutes {
        let len = OUTAGES[minute as usize % OUTAGES.len()];
        let slow = back_slow(minute);
        tokio::time::sleep(Duration::from_secs(10)).await;
        eprintln!(
            "tether-bench soak: minute {minute}: {len} s outage, back {}",
            if slow { "slow" } else { "clean" }
        );
        // The edge's log (stderr) up to the outage.
        let since_outage = edge_log(&bed).len();
        bed.link.outage(true)?;
        tokio::time::sleep(Duration::from_secs(len)).await;
        let next = t0 + Duration::from_secs(60 * (minute + 1));
        if slow {
            slow_returns.push(slow_return_of(&bed, minute, since_outage, next).await?);
        } else {
            bed.link.outage(false)?;
        }
        outages.push(len);
        tokio::time::sleep_until(next.into()).await;
        samples.push(rss(&bed)?);
        if minute == 0 && minutes > 1 {
            // The reference reading: after the first outage and resume.
            start_rss = rss(&bed)?;
        }
    }
    // Before stopping: the memory at the end, with every session still open.
    let end_rss = rss(&bed)?;
    stop.store(true, Ordering::Relaxed);
    // Drain: every written byte echoed, bounded.
    let deadline = Instant::now() + Duration::from_secs(120);
    while sessions.iter().any(|s| {
        !s.reader.is_finished()
            && s.echoed.load(Ordering::Relaxed) < s.written.load(Ordering::Relaxed)
    }) && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut v = Verdict {
        lost_sessions: 0,
        bytes_written: 0,
        bytes_wrong: 0,
        outages,
        slow_returns,
        cloud_rss: (start_rss.0, end_rss.0),
        edge_rss: (start_rss.1, end_rss.1),
        samples,
        first_error: None,
    };
    for s in sessions {
        let wrote = s.written.load(Ordering::Relaxed);
        let echoed = s.echoed.load(Ordering::Relaxed);
        v.bytes_written += wrote;
        let mut lost = false;
        if s.reader.is_finished() {
            // A reader ends only with an error or the stream's end: both
            // mean the session was lost.
            lost = true;
            match s.reader.await {
                Ok(Err(e)) => {
                    v.first_error.get_or_insert(format!("{e:#}"));
                }
                Ok(Ok(at)) => {
                    v.first_error
                        .get_or_insert(format!("a session ended early at byte {at}"));
                }
                Err(e) => {
                    v.first_error.get_or_insert(format!("reader task: {e}"));
                }
            }
        } else {
            s.reader.abort();
        }
        if s.writer.is_finished() {
            if let Ok(Err(e)) = s.writer.await {
                lost = true;
                v.first_error.get_or_insert(format!("writer: {e:#}"));
            }
        } else {
            s.writer.abort();
        }
        if echoed != wrote {
            v.bytes_wrong += wrote.abs_diff(echoed);
            lost = true;
        }
        v.lost_sessions += usize::from(lost);
    }
    Ok(v)
}

/// The soak as a report section.
pub async fn run(r: &mut Report, n: usize, minutes: u64) -> Result<bool> {
    let v = soak(n, minutes).await?;
    r.push(&format!(
        "\n### Soak: {n} exec sessions through one edge for {minutes} min, a total outage every minute\n\n\
         Each session writes {CHUNK} bytes a second of a checksummed pattern and checks every echoed byte; \
         outages (s): {:?}; after the outages of minutes 1, 3, 5, … the link comes back slow (1 s RTT, 10 % loss) \
         for {} s or to the minute's end (down again for {} s {} s into it), longer while the edge has lost its connection and not connected again (up to {} s), then clean. RSS at the start (after the first minute: every session open, the longest outage and its resume behind) and at the end (still open).\n\n",
        v.outages,
        SLOW_FOR.as_secs(),
        FLAP_DOWN.as_secs(),
        FLAP_AFTER.as_secs(),
        SLOW_MAX.as_secs()
    ));
    let mut t = Table::new(
        &[
            "sessions",
            "lost",
            "bytes written",
            "bytes lost or wrong",
            "cloud RSS MiB start",
            "end",
            "edge RSS MiB start",
            "end",
            "verdict",
        ],
        1,
    );
    let mib = |kb: u64| Cell::Num(kb as f64 / 1024.0);
    t.row(
        &n.to_string(),
        vec![
            Cell::Int(v.lost_sessions as u64),
            Cell::Int(v.bytes_written),
            Cell::Int(v.bytes_wrong),
            mib(v.cloud_rss.0),
            mib(v.cloud_rss.1),
            mib(v.edge_rss.0),
            mib(v.edge_rss.1),
            Cell::text(if v.ok() { "pass" } else { "FAIL" }),
        ],
    );
    r.push(&t.render());
    let mib = |kb: u64| format!("{:.1}", kb as f64 / 1024.0);
    r.push(&format!(
        "\nRSS MiB after each minute: cloud {}; edge {}.\n",
        v.samples
            .iter()
            .map(|s| mib(s.0))
            .collect::<Vec<_>>()
            .join(", "),
        v.samples
            .iter()
            .map(|s| mib(s.1))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    r.push(&format!(
        "\nThe edge connected again while the link was slow (0: its connection outlived the outage; 1: every session resumed over the slow link): {}.\n",
        v.slow_returns
            .iter()
            .map(|s| {
                let after = s
                    .connected_after
                    .map(|d| format!(", {:.1} s after the link was back", d.as_secs_f64()))
                    .unwrap_or_default();
                format!(
                    "minute {}: {}{after}, slow for {:.0} s",
                    s.minute,
                    s.connects,
                    s.slow_for.as_secs_f64()
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    ));
    if let Some(e) = &v.first_error {
        r.push(&format!("\nFirst error: {e}\n"));
    }
    if !v.rss_ok() {
        r.push(&format!(
            "\nRSS grew by more than {:.0} %.\n",
            RSS_TOLERANCE * 100.0
        ));
    }
    Ok(v.ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disconnected_until_connected_again() {
        let lost = "x connection to the cloud lost reason=timed out\n";
        let back = "y connected to the cloud node=e resumed=true\n";
        assert!(!disconnected(""));
        assert!(!disconnected(back));
        assert!(disconnected(lost));
        assert!(!disconnected(&format!("{lost}{back}")));
        assert!(disconnected(&format!("{back}{lost}")));
        assert!(disconnected(&format!("{lost}{back}{lost}")));
    }
}
