//! Scenario: a rolling restart of all three replicas with sessions open (issue
//! "Streams survive a replica's roll"), in the replica bed of network namespaces
//! ([`tether_tests::replicabed`]: nftables DNAT services, apiserver-sim, real kubectl).
//!
//! Three edges, one held by each replica. `kubectl logs -f` sessions are opened through
//! each replica in turn (the apiserver's TCP service pinned to it while they start: it is
//! their *owner*) for every edge, before the roll and after each replica is back; a line
//! is appended to every followed log every [`APPEND_EVERY`]. Each replica in turn: out of
//! both services, SIGTERM, exit, started again, back in. At the end every session is
//! judged — survived: every line exactly once, in order, and still running — and counted
//! by what the roll did to it after it opened: its **owner was rolled** (its apiserver
//! connection ended there: expected lost), or **only its edge's holder was rolled** (the
//! edge moved: must survive), or neither. Also: for sessions whose holder was rolled, the
//! time from the holder's exit to the first line after it, and the longest pause between
//! two lines.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tether_tests::cluster::PodSpec;
use tether_tests::kubectl::{self, Kubectl};
use tether_tests::process::Proc;
use tether_tests::replicabed::{Bed, BedSpec, EdgeSpec, REPLICAS};

use crate::table::{Cell, Table};
use crate::Report;

/// How often a line is appended to every followed log.
const APPEND_EVERY: Duration = Duration::from_millis(100);

/// One `kubectl logs -f` session.
struct Session {
    owner: usize,
    edge: usize,
    opened: Instant,
    proc: Arc<Mutex<Proc>>,
    /// When the session's printed line count grew (polled every 20 ms).
    arrivals: Arc<Mutex<Vec<(Instant, usize)>>>,
    /// Lines of its log before it opened (kubectl prints them first).
    skip: usize,
}

/// What happened to one replica in the roll.
struct Step {
    replica: usize,
    sigterm: Instant,
    exited: Instant,
    /// Edges it held at its SIGTERM.
    held: Vec<usize>,
}

/// Replica `i`'s TLS handshakes with edges so far: (full, resumed).
async fn handshakes(bed: &Bed, i: usize) -> Result<(f64, f64)> {
    let kind = |k: &str| format!("tether_cloud_edge_tls_handshakes_total{{kind=\"{k}\"}}");
    Ok((
        bed.metric(i, &kind("full")).await?,
        bed.metric(i, &kind("resumed")).await?,
    ))
}

fn flags(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

pub async fn run(r: &mut Report) -> Result<()> {
    let dir = tempfile::Builder::new().prefix("bench-roll-").tempdir()?;
    let spec = BedSpec {
        edges: (0..REPLICAS)
            .map(|i| EdgeSpec {
                name: format!("edge-{}", i + 1),
                pods: vec![PodSpec::new(
                    "default",
                    &format!("p{}", i + 1),
                    &["c1", "follow"],
                )],
            })
            .collect(),
        api_pods: Vec::new(),
        cloud_extra: flags(&[
            "--keep-alive",
            "1s",
            "--idle-timeout",
            "10s",
            "--peer-timeout",
            "2s",
            "--drain-spread",
            "1s",
            "--shutdown-grace",
            "5s",
            "--shutdown-delay",
            "2s",
        ]),
        edge_extra: flags(&["--keep-alive", "1s", "--idle-timeout", "10s"]),
        pin: (0..REPLICAS).map(Some).collect(),
        authority: true,
    };
    let mut bed = Bed::start(spec, &dir.path().join("bed")).await?;
    let result = roll(&mut bed).await;
    drop(bed);
    let (rows, notes) = result?;
    let mut t = Table::new(&["sessions", "open", "survived", "share"], 1);
    for (k, open, ok) in rows {
        let share = if open == 0 {
            Cell::text("–")
        } else {
            Cell::Num(100.0 * ok as f64 / open as f64)
        };
        t.row(
            &k,
            vec![Cell::Num(open as f64), Cell::Num(ok as f64), share],
        );
    }
    r.push(&format!(
        "\n### Rolling restart of all 3 replicas with `kubectl logs -f` sessions open (replica bed, network namespaces)\n\n{}\n{notes}\n",
        t.render()
    ));
    Ok(())
}

async fn open_sessions(
    bed: &mut Bed,
    k: &Kubectl,
    owner: usize,
    sessions: &mut Vec<Session>,
) -> Result<()> {
    bed.set_tcp_backends(&[owner])?;
    for edge in 0..REPLICAS {
        let pod = format!("p{}", edge + 1);
        let log = bed.log_path(edge, "default", &pod, "follow");
        let skip = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count();
        let name = format!("follow-o{owner}-e{edge}-{}", sessions.len());
        let mut proc = k.spawn(&name, &["logs", "-f", &pod, "-c", "follow"], false)?;
        // Opened once the existing lines are through.
        proc.wait_lines(skip, Duration::from_secs(20))
            .await
            .with_context(|| format!("{name}: the log's first lines"))?;
        let proc = Arc::new(Mutex::new(proc));
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        {
            let (proc, arrivals) = (proc.clone(), arrivals.clone());
            tokio::spawn(async move {
                let mut last = 0;
                loop {
                    let n = proc.lock().map(|p| p.lines().len()).unwrap_or(0);
                    if n != last {
                        if let Ok(mut a) = arrivals.lock() {
                            a.push((Instant::now(), n));
                        }
                        last = n;
                    }
                    if Arc::strong_count(&proc) == 1 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        }
        sessions.push(Session {
            owner,
            edge,
            opened: Instant::now(),
            proc,
            arrivals,
            skip,
        });
    }
    bed.set_tcp_backends(&(0..REPLICAS).collect::<Vec<_>>())?;
    Ok(())
}

#[allow(clippy::type_complexity)]
async fn roll(bed: &mut Bed) -> Result<(Vec<(String, usize, usize)>, String)> {
    let bins = kubectl::under_test().await?;
    let bin = bins.last().context("no kubectl")?;
    let k = Kubectl::new(
        bin.clone(),
        &bed.kubeconfig,
        &bed.dir.join(format!("kubectl-{}", bin.version)),
    )?
    .in_netns(&bed.api_ns());
    // Every followed log starts empty and grows by one line every APPEND_EVERY.
    let logs: Vec<_> = (0..REPLICAS)
        .map(|e| bed.log_path(e, "default", &format!("p{}", e + 1), "follow"))
        .collect();
    for l in &logs {
        std::fs::write(l, "")?;
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let appender = {
        let (logs, stop) = (logs.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                for l in &logs {
                    use std::io::Write;
                    if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(l) {
                        let _ = writeln!(f, "line {n:06}");
                    }
                }
                tokio::time::sleep(APPEND_EVERY).await;
            }
            n
        })
    };
    let mut sessions = Vec::new();
    for owner in 0..REPLICAS {
        open_sessions(bed, &k, owner, &mut sessions).await?;
    }
    let mut steps = Vec::new();
    // The edges' TLS handshakes in the roll, (full, resumed), summed over
    // every replica process: each old one's from here to its SIGTERM (out of
    // the services by then), each new one's whole count at the end.
    let mut tls = (0.0, 0.0);
    let mut base = Vec::with_capacity(REPLICAS);
    for i in 0..REPLICAS {
        base.push(handshakes(bed, i).await?);
    }
    for (i, &(full0, resumed0)) in base.iter().enumerate() {
        let others: Vec<usize> = (0..REPLICAS).filter(|&x| x != i).collect();
        let mut held = Vec::new();
        for e in 0..REPLICAS {
            if bed.holder_of(&format!("edge-{}", e + 1)).await? == Some(i) {
                held.push(e);
            }
        }
        // The load balancers follow readiness: out of both services, then SIGTERM.
        bed.set_udp_backends(&others)?;
        bed.set_tcp_backends(&others)?;
        let (full, resumed) = handshakes(bed, i).await?;
        tls.0 += full - full0;
        tls.1 += resumed - resumed0;
        let sigterm = Instant::now();
        bed.sigterm_replica(i)?;
        bed.wait_replica_exit(i, Duration::from_secs(60)).await?;
        let exited = Instant::now();
        steps.push(Step {
            replica: i,
            sigterm,
            exited,
            held,
        });
        bed.spawn_replica(i)?;
        bed.wait_replica_ready(i).await?;
        bed.set_udp_backends(&(0..REPLICAS).collect::<Vec<_>>())?;
        bed.set_tcp_backends(&(0..REPLICAS).collect::<Vec<_>>())?;
        // New sessions owned by the replica just rolled.
        open_sessions(bed, &k, i, &mut sessions).await?;
    }
    // Let every survivor catch up, then stop appending and judge.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for i in 0..REPLICAS {
        let (full, resumed) = handshakes(bed, i).await?;
        tls.0 += full;
        tls.1 += resumed;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let total = appender.await.unwrap_or(0) as usize;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // (owner rolled, holder rolled) → (open, survived)
    let mut tally = [[(0usize, 0usize); 2]; 2];
    let mut after_exit = Vec::new();
    let mut longest = Duration::ZERO;
    for s in &sessions {
        let owner_rolled = steps
            .iter()
            .any(|st| st.replica == s.owner && st.sigterm > s.opened);
        let holder_steps: Vec<&Step> = steps
            .iter()
            .filter(|st| {
                st.sigterm > s.opened && st.held.contains(&s.edge) && st.replica != s.owner
            })
            .collect();
        let holder_rolled = !holder_steps.is_empty();
        let (lines, running) = {
            let mut p = s.proc.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
            (p.lines(), p.exited().is_none())
        };
        let want: Vec<String> = (s.skip + 1..=total)
            .map(|n| format!("line {n:06}"))
            .collect();
        let got: Vec<String> = lines.iter().skip(s.skip).cloned().collect();
        let survived = running && got == want;
        let cell = &mut tally[owner_rolled as usize][holder_rolled as usize];
        cell.0 += 1;
        cell.1 += survived as usize;
        if holder_rolled && !owner_rolled {
            let a = s.arrivals.lock().map(|a| a.clone()).unwrap_or_default();
            for st in &holder_steps {
                if let Some((t, _)) = a.iter().find(|(t, _)| *t >= st.exited) {
                    after_exit.push(t.duration_since(st.exited));
                }
                let window: Vec<&(Instant, usize)> = a
                    .iter()
                    .filter(|(t, _)| *t >= st.sigterm && *t <= st.exited + Duration::from_secs(10))
                    .collect();
                for w in window.windows(2) {
                    longest = longest.max(w[1].0.duration_since(w[0].0));
                }
            }
        }
    }
    // Stop them: their pids (kill -9 of our own children) without holding a lock
    // across an await.
    for s in &sessions {
        let pid = s.proc.lock().ok().and_then(|p| p.pid());
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: a signal to our own child process.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
    let rows = vec![
        (
            "owner rolled (the apiserver's connection ended there)".to_string(),
            tally[1][0].0 + tally[1][1].0,
            tally[1][0].1 + tally[1][1].1,
        ),
        (
            "only the edge's holder rolled".to_string(),
            tally[0][1].0,
            tally[0][1].1,
        ),
        ("neither".to_string(), tally[0][0].0, tally[0][0].1),
    ];
    after_exit.sort();
    let med = after_exit
        .get(after_exit.len() / 2)
        .copied()
        .unwrap_or_default();
    let max = after_exit.last().copied().unwrap_or_default();
    let notes = format!(
        "Sessions whose edge's holder was rolled: first line after the holder exited {} ms median, {} ms max ({} cases; the edge had moved during the drain, before the exit: lines arrive every {} ms); longest pause between two lines from SIGTERM to 10 s after the exit: {} ms. \
         The edges' TLS handshakes at the replicas in the roll (each edge holds one TLS session ticket, \
         the cloud's default; all replicas share the reset key the tickets are sealed under): {} full, {} resumed.",
        med.as_millis(),
        max.as_millis(),
        after_exit.len(),
        APPEND_EVERY.as_millis(),
        longest.as_millis(),
        tls.0,
        tls.1
    );
    Ok((rows, notes))
}
