//! Scenario 5, second half: many concurrent sessions through one edge.
//!
//! On the clean link, every peer in turn carries `n` exec sessions (upgraded, echoing)
//! held open at once: like `n` `kubectl exec -it` or `logs -f` against one node. Opens
//! run at most [`IN_FLIGHT`] at a time, so listen backlogs are not what is measured.
//! Measured per peer: time to open all, each open's time (connection through the peer,
//! request, `101` response), one echo on every session at once, and the memory of the
//! agents at both ends (process tree RSS: sshd forks per connection) idle and with all
//! sessions open. Nothing is asserted about the figures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use linkemu::Impairment;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::bed::{Bed, BedOptions, Dial};
use crate::measure::pct;
use crate::procs::{agents, tree_rss_kb};
use crate::table::{Cell, Table};
use crate::Report;

/// Opens in flight at once.
const IN_FLIGHT: usize = 64;
/// Bound of one open and of the echo round.
const LIMIT: Duration = Duration::from_secs(60);

/// What one peer did.
struct Figures {
    open_all: Duration,
    opens_ms: Vec<f64>,
    echo_all: Duration,
    /// (edge idle, edge open, cloud idle, cloud open) KiB.
    rss: Option<(u64, u64, u64, u64)>,
}

async fn one_peer(dial: &Dial, n: usize, pids: Option<(u32, u32)>) -> Result<Figures> {
    let rss_now = || -> Result<Option<(u64, u64)>> {
        match pids {
            Some((e, c)) => Ok(Some((tree_rss_kb(e)?, tree_rss_kb(c)?))),
            None => Ok(None),
        }
    };
    let idle = rss_now()?;
    let gate = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let (dial, gate) = (dial.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await?;
            let t = Instant::now();
            let io = tokio::time::timeout(LIMIT, crate::measure::exec(&dial))
                .await
                .context("open timed out")??;
            Ok::<_, anyhow::Error>((io, t.elapsed().as_secs_f64() * 1e3))
        }));
    }
    let mut sessions = Vec::with_capacity(n);
    let mut opens_ms = Vec::with_capacity(n);
    let mut failed = 0usize;
    let mut first_error = None;
    for t in tasks {
        match t.await.context("open task")? {
            Ok((io, ms)) => {
                sessions.push(io);
                opens_ms.push(ms);
            }
            Err(e) => {
                failed += 1;
                first_error.get_or_insert(e);
            }
        }
    }
    let open_all = t0.elapsed();
    if let Some(e) = first_error {
        bail!("{failed} of {n} sessions did not open; first: {e:#}");
    }
    // Let buffers settle before reading memory.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let open = rss_now()?;
    // One echo on every session at once.
    let t1 = Instant::now();
    let mut echoes = Vec::with_capacity(n);
    for (i, mut io) in sessions.into_iter().enumerate() {
        echoes.push(tokio::spawn(async move {
            let b = [b'a' + (i % 26) as u8];
            io.write_all(&b).await?;
            let mut got = [0u8; 1];
            io.read_exact(&mut got).await?;
            if got != b {
                bail!("session {i}: sent {:?} got {:?}", b[0], got[0]);
            }
            Ok::<_, anyhow::Error>(io)
        }));
    }
    let echoed = tokio::time::timeout(LIMIT, async {
        let mut kept = Vec::with_capacity(n);
        for e in echoes {
            kept.push(e.await.context("echo task")??);
        }
        Ok::<_, anyhow::Error>(kept)
    })
    .await
    .context("echo on every session timed out")??;
    let echo_all = t1.elapsed();
    drop(echoed);
    let rss = match (idle, open) {
        (Some((ei, ci)), Some((eo, co))) => Some((ei, eo, ci, co)),
        _ => None,
    };
    Ok(Figures {
        open_all,
        opens_ms,
        echo_all,
        rss,
    })
}

/// Runs the scenario with `n` sessions and appends its table.
pub async fn run(r: &mut Report, n: usize) -> Result<()> {
    let bed = Bed::start(Impairment::clean(), BedOptions::default()).await?;
    let mut t = Table::new(
        &[
            "peer",
            &format!("open all {n} ms"),
            "one open p50 ms",
            "p99 ms",
            &format!("one echo on all {n} ms"),
            "edge agent RSS MiB idle",
            &format!("with {n} open"),
            "KiB per session",
            "cloud agent RSS MiB idle",
            &format!("with {n} open"),
            "KiB per session",
        ],
        1,
    );
    for p in &bed.peers {
        let Some(dial) = crate::unavailable(r, p) else {
            t.row(p.name, vec![Cell::text("n/a"); 10]);
            continue;
        };
        match one_peer(&dial, n, agents(&bed, p.name)).await {
            Ok(f) => {
                let mut cells = vec![
                    Cell::Num(f.open_all.as_secs_f64() * 1e3),
                    Cell::Num(pct(&f.opens_ms, 0.5)),
                    Cell::Num(pct(&f.opens_ms, 0.99)),
                    Cell::Num(f.echo_all.as_secs_f64() * 1e3),
                ];
                let mib = |kb: u64| Cell::Num(kb as f64 / 1024.0);
                let per = |a: u64, b: u64| Cell::Num(b.saturating_sub(a) as f64 / n as f64);
                match f.rss {
                    Some((ei, eo, ci, co)) => {
                        cells.extend([mib(ei), mib(eo), per(ei, eo), mib(ci), mib(co), per(ci, co)])
                    }
                    None => cells.extend(vec![Cell::text("n/a"); 6]),
                }
                t.row(p.name, cells);
            }
            Err(e) => {
                let c = r.error(format!("{n} concurrent sessions: {}: {e:#}", p.name));
                t.row(p.name, vec![c; 10]);
            }
        }
        // Let closed sessions drain before the next peer.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    r.push(&format!(
        "\n### Concurrent sessions: {n} exec sessions held open through one edge (clean link)\n\n\
         Opens {IN_FLIGHT} at a time (connection and TLS handshake, request, `101`); then one byte echoed on every session at once. \
         Agents: tether-edge / tether-cloud, ssh client / sshd (with its per-connection children), rathole client / server; \
         direct has none.\n\n"
    ));
    r.push(&t.render());
    Ok(())
}
