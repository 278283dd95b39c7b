//! # tether-bench — Tether against real peers on the same emulated links
//!
//! Puts the apiserver's side of a kubelet connection (this process, in the link's cloud
//! namespace) and a kubelet stand-in (in its edge namespace) on either side of a
//! [`linkemu`] link, and measures each way across it (see [`bed`]):
//! **direct** (TLS straight to the kubelet: the limit), **ssh -R** (OpenSSH reverse
//! tunnel, every session over one TCP connection), **rathole** (a TCP connection per
//! session) and **tether** (`tether-cloud` + `tether-edge`, a QUIC stream per session).
//!
//! Scenarios, each printed as a markdown table with Tether's ratio to every peer:
//! 1. interactive echo (1-byte writes) p50/p99/max, idle and under a bulk stream;
//! 2. bulk throughput, one stream and ten in parallel;
//! 3. a total outage during an interactive session and a chatty log;
//! 4. the edge's address changes mid-stream;
//! 5. scale: many idle edges held by one cloud (see [`scale`]), and many concurrent
//!    sessions through one edge (see [`concurrent`]);
//! 6. the edge's footprint (see [`footprint`]);
//! 7. cellular data: bytes on the wire per idle edge per day, and what path-MTU
//!    searches add on a path that silently drops larger packets (see [`cellular`]);
//!    what an edge sends while its cloud does not answer (see [`unreachable`]).
//!
//! `tether-bench` runs everything (release build: `scripts/bench.sh`); `--quick` runs a
//! short variant (clean link, small sizes, 5 s outage, 100 sessions, no idle edges) for CI. Results go to
//! `target/bench/results.md` (`results-quick.md`) and stdout. It measures and prints;
//! it exits non-zero only when the harness itself breaks (a bed that cannot start, a
//! measurement that errors where it must not).

mod bed;
mod cellular;
mod concurrent;
mod footprint;
mod kubelet;
mod measure;
mod procs;
mod replicas;
mod roll;
mod scale;
mod soak;
mod table;
mod unreachable;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use linkemu::Impairment;

use bed::{Bed, BedOptions, Dial, Peer};
use measure::{pct, Load, StreamFate, Watch};
use procs::{CpuPart, CpuSample, CpuSpent};
use table::{Cell, Table};

/// Sizes of one link's runs.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    echo_rounds: usize,
    bulk_bytes: u64,
    parallel_bytes: u64,
    /// Each download of the "under bulk" load.
    load_bytes: u64,
    /// Bound of one bulk download.
    bulk_limit: Duration,
    /// Rounds of the bulk table, the peers taking turns in each; a figure is
    /// the median of its rounds (one 64 MiB download is a third of a second
    /// here, and single runs of the same code differed by almost 2×).
    bulk_rounds: usize,
}

/// What a run does.
#[derive(Clone, Debug)]
struct Plan {
    quick: bool,
    links: Vec<(&'static str, Impairment, Sizes)>,
    outage: Duration,
    /// How long to watch after the link event.
    observe: Duration,
    /// Repeated outages, the link coming back clean or slow: cycles per
    /// way of coming back, outage length, how long to watch after each.
    outage_cycles: usize,
    cycle_outage: Duration,
    cycle_observe: Duration,
    idle_window: Duration,
    /// Idle window of the cellular-data scenario.
    cellular_window: Duration,
    /// The edges probing a cloud that does not answer.
    unreachable: unreachable::Timing,
    scale_edges: Vec<usize>,
    /// Exec sessions held open at once through one edge.
    sessions: usize,
    /// Simulated edges of the replicas scenario, and its bulk log size (MiB).
    replica_edges: usize,
    replica_bulk_mib: usize,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        let clean = Impairment::clean();
        let lossy = Impairment::clean()
            .with_delay(Duration::from_millis(25))
            .with_loss(1.0);
        let bad = Impairment::clean()
            .with_delay(Duration::from_millis(100))
            .with_loss(3.0)
            .with_rate(10_000_000 / 8);
        if quick {
            let s = Sizes {
                echo_rounds: 40,
                bulk_bytes: 4 << 20,
                parallel_bytes: 512 << 10,
                load_bytes: 4 << 20,
                bulk_limit: Duration::from_secs(30),
                bulk_rounds: 1,
            };
            return Plan {
                quick,
                links: vec![("clean", clean, s)],
                outage: Duration::from_secs(5),
                observe: Duration::from_secs(8),
                outage_cycles: 1,
                cycle_outage: Duration::from_secs(5),
                cycle_observe: Duration::from_secs(15),
                idle_window: Duration::from_secs(5),
                cellular_window: Duration::from_secs(30),
                // Patient after 5 s; its first round (10 s) ends first.
                unreachable: unreachable::Timing {
                    patient_after: Duration::from_secs(5),
                    interval: Duration::from_secs(5),
                    watch: Duration::from_secs(40),
                    patient_from: Duration::from_secs(12),
                    tail: Duration::from_secs(18),
                },
                scale_edges: Vec::new(),
                sessions: 100,
                replica_edges: 150,
                replica_bulk_mib: 8,
            };
        }
        Plan {
            quick,
            links: vec![
                (
                    "clean",
                    clean,
                    Sizes {
                        echo_rounds: 300,
                        bulk_bytes: 64 << 20,
                        parallel_bytes: 8 << 20,
                        load_bytes: 8 << 20,
                        bulk_limit: Duration::from_secs(60),
                        bulk_rounds: 7,
                    },
                ),
                (
                    "50 ms RTT, 1 % loss",
                    lossy,
                    Sizes {
                        echo_rounds: 100,
                        bulk_bytes: 16 << 20,
                        parallel_bytes: 2 << 20,
                        load_bytes: 8 << 20,
                        bulk_limit: Duration::from_secs(120),
                        bulk_rounds: 5,
                    },
                ),
                (
                    "200 ms RTT, 3 % loss, 10 Mbit/s",
                    bad,
                    Sizes {
                        echo_rounds: 40,
                        bulk_bytes: 2 << 20,
                        parallel_bytes: 256 << 10,
                        load_bytes: 2 << 20,
                        bulk_limit: Duration::from_secs(120),
                        bulk_rounds: 3,
                    },
                ),
            ],
            outage: Duration::from_secs(60),
            observe: Duration::from_secs(45),
            // Longer than the 30 s idle timeout: Tether's connection dies
            // in every cycle and the session must be resumed.
            outage_cycles: 4,
            cycle_outage: Duration::from_secs(35),
            cycle_observe: Duration::from_secs(40),
            idle_window: Duration::from_secs(60),
            cellular_window: Duration::from_secs(300),
            // Patient after 120 s, once its fourth round (80 s, from about
            // 70 s in) is over; the default interval, 30 s.
            unreachable: unreachable::Timing {
                patient_after: Duration::from_secs(120),
                interval: Duration::from_secs(30),
                watch: Duration::from_secs(400),
                patient_from: Duration::from_secs(160),
                tail: Duration::from_secs(60),
            },
            scale_edges: vec![1000, 10_000],
            sessions: 1000,
            replica_edges: 1000,
            replica_bulk_mib: 64,
        }
    }
}

/// The report being written, and what went wrong on the way.
struct Report {
    out: String,
    /// Harness failures (exit status).
    errors: Vec<String>,
    /// Peers not available, printed under the tables.
    notes: Vec<String>,
    /// A peer that is not available is a harness failure (CI: every peer runs).
    require_peers: bool,
}

impl Report {
    fn push(&mut self, s: &str) {
        self.out.push_str(s);
        print!("{s}");
    }

    fn error(&mut self, what: String) -> Cell {
        eprintln!("tether-bench: {what}");
        self.errors.push(what);
        Cell::text("error")
    }
}

pub(crate) fn unavailable(r: &mut Report, p: &Peer) -> Option<Dial> {
    match &p.dial {
        Ok(d) => Some(d.clone()),
        Err(why) if r.require_peers => {
            r.error(format!(
                "{} is required (--require-peers) but not available: {why}",
                p.name
            ));
            None
        }
        Err(why) => {
            let note = format!("{} not measured: {why}", p.name);
            if !r.notes.contains(&note) {
                eprintln!("tether-bench: {note}");
                r.notes.push(note);
            }
            None
        }
    }
}

/// How the link scenarios run, from the command line: for comparing one
/// Tether setting against another (`--tether-only --rounds 15`, the setting
/// from the environment) more rounds say more than the default's 3–7.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct LinkOpts {
    /// Measure Tether and direct only (ssh -R and rathole are not started).
    tether_only: bool,
    /// Bulk rounds instead of the link's own, each round's figures printed.
    rounds: Option<usize>,
}

/// One kind's figures, round by round ("-" for none; a kind that failed is
/// listed as "-" by its caller, as in the ranges).
fn round_list(v: &[f64]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.iter()
        .map(|x| format!("{x:.1}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The most `--rounds` a link scenario takes (a round of the slow link takes
/// seconds per peer; 1,000 is hours).
const MAX_ROUNDS: usize = 1000;

/// Scenarios 1 and 2 on one link.
async fn link_runs(
    r: &mut Report,
    name: &str,
    imp: Impairment,
    s: Sizes,
    o: LinkOpts,
) -> Result<()> {
    let bed = Bed::start(
        imp,
        BedOptions {
            tether_only: o.tether_only,
            ..BedOptions::default()
        },
    )
    .await
    .with_context(|| format!("starting the bed on link {name}"))?;
    r.push(&format!(
        "\n### Link: {name}\n\nInteractive: {} one-byte writes echoed through an upgraded exec stream, 10 ms apart (ms); under bulk: while {} MiB downloads loop through the same tunnel.\n\n",
        s.echo_rounds,
        s.load_bytes >> 20
    ));
    let mut t = Table::new(
        &[
            "peer",
            "echo p50 ms",
            "p99 ms",
            "max ms",
            "under bulk p50",
            "p99",
            "max",
        ],
        1,
    );
    let limit = Duration::from_secs(30);
    for p in &bed.peers {
        let Some(dial) = unavailable(r, p) else {
            t.row(p.name, vec![Cell::text("n/a"); 6]);
            continue;
        };
        let gap = Duration::from_millis(10);
        let mut cells = Vec::new();
        match measure::interactive(&dial, s.echo_rounds, gap, limit).await {
            Ok(v) => cells.extend([0.5, 0.99, 1.0].map(|q| Cell::Num(pct(&v, q)))),
            Err(e) => cells.extend(vec![
                r.error(format!(
                    "{name}: {} interactive: {e:#}",
                    p.name
                ));
                3
            ]),
        }
        let load = Load::start(dial.clone(), s.load_bytes);
        tokio::time::sleep(Duration::from_millis(500)).await;
        match measure::interactive(&dial, s.echo_rounds, gap, limit).await {
            Ok(v) => cells.extend([0.5, 0.99, 1.0].map(|q| Cell::Num(pct(&v, q)))),
            Err(e) => cells.extend(vec![
                r.error(format!(
                    "{name}: {} interactive under bulk: {e:#}",
                    p.name
                ));
                3
            ]),
        }
        drop(load);
        t.row(p.name, cells);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    r.push(&t.render());

    // Streams of the parallel transfer, in every label that names it.
    const STREAMS: usize = 10;
    let rounds = o.rounds.unwrap_or(s.bulk_rounds).max(1);
    let what = match rounds {
        1 => String::new(),
        n => format!(", median of {n}"),
    };
    let mut t = Table::new(
        &[
            "peer",
            &format!("1 stream MB/s ({} MiB{what})", s.bulk_bytes >> 20),
            &format!(
                "{STREAMS} streams MB/s (sum, {} KiB each{what})",
                s.parallel_bytes >> 10
            ),
        ],
        1,
    );
    // Round by round, the peers taking turns, so that a slow minute of the
    // machine falls on all of them alike.
    let dials: Vec<_> = bed.peers.iter().map(|p| unavailable(r, p)).collect();
    // Per peer: the figures of each kind so far, or the error that ended it.
    let mut got: Vec<[Result<Vec<f64>, Cell>; 2]> = bed
        .peers
        .iter()
        .map(|_| [Ok(Vec::new()), Ok(Vec::new())])
        .collect();
    // Per peer and kind: the CPU time its agents and the link's router spent on the
    // transfers that succeeded, and the bytes those moved.
    let router = bed.link.info().router_pid;
    let agents: Vec<_> = bed
        .peers
        .iter()
        .map(|p| procs::agents(&bed, p.name))
        .collect();
    let mut cpu: Vec<[CpuSpent; 2]> = bed.peers.iter().map(|_| Default::default()).collect();
    for _ in 0..rounds {
        for ((((p, dial), [one, ten]), spent), &agents) in bed
            .peers
            .iter()
            .zip(&dials)
            .zip(got.iter_mut())
            .zip(cpu.iter_mut())
            .zip(&agents)
        {
            let Some(dial) = dial else { continue };
            let [spent_one, spent_ten] = spent;
            if let Ok(v) = one {
                let c0 = CpuSample::take(agents, router)?;
                match measure::bulk(dial, s.bulk_bytes, s.bulk_limit).await {
                    Ok(x) => {
                        v.push(x);
                        spent_one.add(c0, CpuSample::take(agents, router)?, s.bulk_bytes);
                    }
                    Err(e) => *one = Err(r.error(format!("{name}: {} bulk: {e:#}", p.name))),
                }
            }
            if let Ok(v) = ten {
                let c0 = CpuSample::take(agents, router)?;
                match measure::parallel(dial, STREAMS, s.parallel_bytes, s.bulk_limit).await {
                    Ok(x) => {
                        v.push(x);
                        let bytes = STREAMS as u64 * s.parallel_bytes;
                        spent_ten.add(c0, CpuSample::take(agents, router)?, bytes);
                    }
                    Err(e) => {
                        *ten = Err(r.error(format!("{name}: {} {STREAMS} streams: {e:#}", p.name)))
                    }
                }
            }
        }
    }
    let mut ranges = Vec::new();
    let mut each = Vec::new();
    for ((p, dial), kinds) in bed.peers.iter().zip(&dials).zip(got) {
        if dial.is_none() {
            t.row(p.name, vec![Cell::text("n/a"); 2]);
            continue;
        }
        let mut cells = Vec::new();
        let mut spans = Vec::new();
        let mut listed = Vec::new();
        for kind in kinds {
            match kind {
                Ok(v) => {
                    listed.push(round_list(&v));
                    let (lo, hi) = (pct(&v, 0.0), pct(&v, 1.0));
                    spans.push(format!("{lo:.0}–{hi:.0}"));
                    cells.push(Cell::Num(pct(&v, 0.5)));
                }
                Err(c) => {
                    listed.push("-".into());
                    spans.push("-".into());
                    cells.push(c);
                }
            }
        }
        each.push(format!(
            "{}: 1 stream {}; {STREAMS} streams {}",
            p.name, listed[0], listed[1]
        ));
        ranges.push(format!("{} {}", p.name, spans.join(" / ")));
        t.row(p.name, cells);
    }
    r.push("\n");
    r.push(&t.render());
    if rounds > 1 {
        r.push(&format!(
            "\nRange of the {rounds} rounds (1 stream / {STREAMS} streams, MB/s): {}.\n",
            ranges.join("; ")
        ));
    }
    if o.rounds.is_some() {
        r.push(&format!(
            "\nEach round in order (MB/s): {}.\n",
            each.join(". ")
        ));
    }
    r.push(&format!(
        "\nCPU per GiB moved in those rounds (s; lower is better): each peer's agent at the \
         edge's end (tether-edge, ssh, rathole's client) and at the cloud's (tether-cloud, \
         sshd with its children, rathole's server), utime + stime, and the link's userspace \
         router, whose system time includes the kernel's work on the packets it forwards. \
         The client and the kubelet stand-in are the same for every peer and not counted. \
         These move far less than the MB/s above with what else the {} cores were doing \
         (about ±10 % between runs of the clean link, against ±40 %).\n\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let parts = [
        ("edge", CpuPart::Edge),
        ("cloud", CpuPart::Cloud),
        ("link router", CpuPart::Router),
    ];
    let mut header = vec!["peer".to_string()];
    for kind in ["1 stream".to_string(), format!("{STREAMS} streams")] {
        header.extend(parts.iter().map(|(who, _)| format!("{kind}: {who} s/GiB")));
    }
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut t = Table::new(&header, 2);
    for (((p, dial), spent), agents) in bed.peers.iter().zip(&dials).zip(&cpu).zip(&agents) {
        if dial.is_none() {
            t.row(p.name, vec![Cell::text("n/a"); header.len() - 1]);
            continue;
        }
        let has_agents = agents.is_some();
        let mut cells = Vec::new();
        for kind in spent {
            for (_, part) in parts {
                cells.push(match kind.per_gib(part) {
                    Some(_) if part != CpuPart::Router && !has_agents => Cell::text("n/a"),
                    Some(v) => Cell::Num(v),
                    None => Cell::text("-"),
                });
            }
        }
        t.row(p.name, cells);
    }
    r.push(&t.render());

    // Time to open a stream: a new connection (TCP + TLS handshake; to the cloud for
    // Tether, through the tunnel to the kubelet for the others), a GET, its whole
    // (small) response.
    let mut t = Table::new(&["peer", "open + request → response p50 ms", "p99 ms"], 1);
    for p in &bed.peers {
        let Some(dial) = unavailable(r, p) else {
            t.row(p.name, vec![Cell::text("n/a"); 2]);
            continue;
        };
        let mut v = Vec::new();
        let mut failed = None;
        for _ in 0..s.echo_rounds.min(50) {
            let t0 = Instant::now();
            match tokio::time::timeout(limit, measure::get(&dial, "/healthz")).await {
                Ok(Ok(200)) => v.push(t0.elapsed().as_secs_f64() * 1e3),
                Ok(Ok(st)) => failed = Some(format!("status {st}")),
                Ok(Err(e)) => failed = Some(format!("{e:#}")),
                Err(_) => failed = Some(format!("no response within {limit:?}")),
            }
            if failed.is_some() {
                break;
            }
        }
        match failed {
            None => t.row(
                p.name,
                vec![Cell::Num(pct(&v, 0.5)), Cell::Num(pct(&v, 0.99))],
            ),
            Some(e) => {
                let c = r.error(format!("{name}: {} open stream: {e}", p.name));
                t.row(p.name, vec![c.clone(), c]);
            }
        }
    }
    r.push("\n");
    r.push(&t.render());
    Ok(())
}

fn secs(d: Option<Duration>) -> Cell {
    match d {
        Some(d) => Cell::Num(d.as_secs_f64()),
        None => Cell::text("never"),
    }
}

/// "yes", or why not.
fn survived(f: &StreamFate, after: Instant) -> (bool, String) {
    if let Some(at) = f.corrupt_at {
        return (false, format!("corrupt at byte {at}"));
    }
    if let Some(why) = &f.died {
        return (false, format!("no ({why})"));
    }
    if f.first_after(after).is_none() {
        return (false, "no (stalled)".into());
    }
    (true, "yes".into())
}

/// Sessions kept across repeated outages (scenario 3b): in each cycle every
/// peer opens an exec session and a `logs -f`, the link goes down for
/// `cycle_outage`, then comes back clean or slow (1 s RTT, 10 % loss). A
/// session is kept when both its streams deliver again after the restore.
async fn outage_cycles_run(r: &mut Report, plan: &Plan) -> Result<()> {
    let returns = [
        ("clean", Impairment::clean()),
        ("1 s RTT, 10 % loss", soak::slow_return()),
    ];
    r.push(&format!(
        "\n### Outage cycles: {} × {} s total outage, the link back clean or slow, watched {} s after each restore\n\n\
         In each cycle every peer opens an exec session typing a byte every 100 ms and a `logs -f` at 16 KiB/s; \
         kept = both still deliver after the restore (a new connection that lost the session does not count).\n\n",
        plan.outage_cycles,
        plan.cycle_outage.as_secs(),
        plan.cycle_observe.as_secs()
    ));
    let mut kept: Vec<(&'static str, Vec<usize>)> = Vec::new();
    for (i, (label, imp)) in returns.iter().enumerate() {
        let bed = Bed::start(Impairment::clean(), BedOptions::default())
            .await
            .context("starting the bed")?;
        for cycle in 0..plan.outage_cycles {
            bed.link.set(Impairment::clean())?;
            let mut watches = Vec::new();
            for p in &bed.peers {
                let Some(dial) = unavailable(r, p) else {
                    continue;
                };
                let id = format!("{}_{i}_{cycle}", p.name.replace(' ', "_"));
                match Watch::start(&dial, &id, Duration::from_millis(100), 16 << 10).await {
                    Ok(w) => watches.push((p.name, Some(w))),
                    // A tunnel that did not survive an earlier cycle (ssh -R
                    // exits when its connection dies) cannot open sessions:
                    // that cycle is not kept either.
                    Err(e) if cycle > 0 => {
                        let note = format!(
                            "{} (back {label}): no sessions could be opened after an earlier outage: {e:#}",
                            p.name
                        );
                        if !r.notes.contains(&note) {
                            r.notes.push(note);
                        }
                        watches.push((p.name, None));
                    }
                    Err(e) => {
                        r.error(format!("{}: opening sessions: {e:#}", p.name));
                    }
                }
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            bed.link.outage(true)?;
            tokio::time::sleep(plan.cycle_outage).await;
            bed.link.set(*imp)?;
            bed.link.outage(false)?;
            let restored = Instant::now();
            tokio::time::sleep(plan.cycle_observe).await;
            for (name, w) in watches {
                let ok = match w {
                    Some(w) => {
                        let (typed, log) = w.finish(Duration::from_secs(2), &bed.kubelet).await;
                        survived(&typed, restored).0 && survived(&log, restored).0
                    }
                    None => false,
                };
                let row = match kept.iter_mut().find(|k| k.0 == name) {
                    Some(row) => row,
                    None => {
                        kept.push((name, vec![0; returns.len()]));
                        kept.last_mut().expect("just pushed")
                    }
                };
                row.1[i] += usize::from(ok);
                eprintln!("tether-bench: outage cycle {cycle}, back {label}: {name} kept={ok}");
            }
        }
    }
    let cols: Vec<String> = std::iter::once("peer".to_string())
        .chain(
            returns
                .iter()
                .map(|(l, _)| format!("back {l}: kept of {}", plan.outage_cycles)),
        )
        .collect();
    let cols: Vec<&str> = cols.iter().map(String::as_str).collect();
    let mut t = Table::new(&cols, 1);
    for (name, k) in &kept {
        t.row(name, k.iter().map(|n| Cell::Int(*n as u64)).collect());
    }
    r.push(&t.render());
    Ok(())
}

/// What a link event does to sessions: scenario 3 (outage) or 4 (address change).
/// Every peer's session runs at once, through the one event.
async fn event_run(r: &mut Report, plan: &Plan, outage: bool) -> Result<()> {
    let bed = Bed::start(Impairment::clean(), BedOptions::default())
        .await
        .context("starting the bed")?;
    let mut watches = Vec::new();
    for p in &bed.peers {
        let Some(dial) = unavailable(r, p) else {
            continue;
        };
        // A keystroke every 100 ms; a chatty log at 128 KiB/s.
        match Watch::start(
            &dial,
            &p.name.replace(' ', "_"),
            Duration::from_millis(100),
            128 << 10,
        )
        .await
        {
            Ok(w) => watches.push((p.name, w)),
            Err(e) => {
                r.error(format!("{}: opening sessions: {e:#}", p.name));
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t0 = Instant::now();
    let restored;
    if outage {
        bed.link.outage(true)?;
        tokio::time::sleep(plan.outage).await;
        bed.link.outage(false)?;
        restored = Instant::now();
    } else {
        let new = tokio::task::block_in_place(|| bed.link.change_edge_address())?;
        eprintln!("tether-bench: edge address now {new}");
        restored = Instant::now();
    }
    tokio::time::sleep(plan.observe).await;
    let end = Instant::now();
    let mut fates = Vec::new();
    for (name, w) in watches {
        fates.push((name, w.finish(Duration::from_secs(2), &bed.kubelet).await));
    }
    let mut t = if outage {
        r.push(&format!(
            "\n### Outage: {} s total outage (clean link), watched {} s after restore\n\n\
             An exec session typing a byte every 100 ms and a `logs -f` at 128 KiB/s through each peer at once. \
             Lost = typed but never echoed / handed out by the kubelet but never received, when the session died or stalled \
             (a session that goes on still delivers what was in flight); \
             first byte = from link restore to the first byte received.\n\n",
            plan.outage.as_secs(),
            plan.observe.as_secs()
        ));
        Table::new(
            &[
                "peer",
                "exec survived",
                "keystrokes lost",
                "restore → first echo s",
                "logs survived",
                "log bytes lost",
                "restore → first log byte s",
            ],
            1,
        )
    } else {
        r.push(&format!(
            "\n### Address change of the edge mid-stream (clean link), watched {} s\n\n\
             Same sessions as the outage; stall = longest gap between arrivals from the change to the end (or death) (s).\n\n",
            plan.observe.as_secs()
        ));
        Table::new(
            &[
                "peer",
                "exec survived",
                "exec stall s",
                "logs survived",
                "logs stall s",
            ],
            1,
        )
    };
    for p in &bed.peers {
        let Some((_, (typed, log))) = fates.iter().find(|f| f.0 == p.name) else {
            t.row(p.name, vec![Cell::text("n/a"); if outage { 6 } else { 4 }]);
            continue;
        };
        let (ok_t, why_t) = survived(typed, restored);
        let (ok_l, why_l) = survived(log, restored);
        if outage {
            // A session that goes on delivers what is still in flight: nothing
            // is lost. One that died or stalled lost what never arrived.
            let lost = |f: &StreamFate, ok: bool| {
                if ok {
                    0
                } else {
                    f.sent.saturating_sub(f.received)
                }
            };
            let (lost_t, lost_l) = (lost(typed, ok_t), lost(log, ok_l));
            t.row(
                p.name,
                vec![
                    Cell::text(why_t),
                    Cell::Int(lost_t),
                    secs(typed.first_after(restored)),
                    Cell::text(why_l),
                    Cell::Int(lost_l),
                    secs(log.first_after(restored)),
                ],
            );
        } else {
            let stall = |f: &StreamFate, ok: bool| {
                if ok {
                    Cell::Num(f.longest_gap(t0, end).as_secs_f64())
                } else {
                    Cell::text("—")
                }
            };
            t.row(
                p.name,
                vec![
                    Cell::text(why_t),
                    stall(typed, ok_t),
                    Cell::text(why_l),
                    stall(log, ok_l),
                ],
            );
        }
    }
    r.push(&t.render());
    Ok(())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    format!(
        "nproc {cores}, {cpu}, {date}, {} build",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    )
}

struct Args {
    quick: bool,
    only: Vec<String>,
    /// Edge counts of the scale scenario (instead of the plan's).
    scale: Vec<usize>,
    /// Concurrent sessions (instead of the plan's).
    sessions: Option<usize>,
    require_peers: bool,
    out: std::path::PathBuf,
    /// Run the soak instead of the benchmark, for this many minutes.
    soak_minutes: Option<u64>,
    /// `--tether-only`, `--rounds`.
    link: LinkOpts,
}

fn args() -> Result<Args> {
    parse_args(std::env::args().skip(1))
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args> {
    let mut a = Args {
        quick: false,
        only: Vec::new(),
        scale: Vec::new(),
        sessions: None,
        require_peers: false,
        out: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench"),
        soak_minutes: None,
        link: LinkOpts::default(),
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--quick" => a.quick = true,
            "--only" => a.only.push(it.next().context("--only needs a scenario")?),
            "--scale" => a.scale.push(
                it.next()
                    .context("--scale needs a number of edges")?
                    .parse()?,
            ),
            "--sessions" => {
                a.sessions = Some(
                    it.next()
                        .context("--sessions needs a number of sessions")?
                        .parse()?,
                )
            }
            "--require-peers" => a.require_peers = true,
            "--tether-only" => a.link.tether_only = true,
            "--rounds" => {
                let n: usize = it
                    .next()
                    .context("--rounds needs a number of rounds")?
                    .parse()
                    .context("--rounds needs a number of rounds")?;
                if !(1..=MAX_ROUNDS).contains(&n) {
                    anyhow::bail!("--rounds must be between 1 and {MAX_ROUNDS}, not {n}");
                }
                a.link.rounds = Some(n);
            }
            "--soak" => {
                a.soak_minutes = Some(
                    it.next()
                        .context("--soak needs a number of minutes")?
                        .parse()?,
                )
            }
            "--out" => a.out = it.next().context("--out needs a directory")?.into(),
            "-h" | "--help" => {
                println!(
                    "tether-bench [--quick] [--only interactive|outage|cycles|migration|footprint|cellular|mtu|unreachable|scale|sessions|replicas|roll|LINK-TEXT]... [--scale EDGES]... [--sessions N] [--require-peers] [--tether-only] [--rounds N] [--out DIR]\n\
                     (--tether-only: the link scenarios measure Tether and direct only; --rounds N: their bulk rounds, 1-{MAX_ROUNDS}, each round's figures printed)\n\
                     tether-bench --soak MINUTES [--sessions N] [--out DIR]   (exits non-zero unless 0 sessions lost, 0 bytes lost, RSS within 10 %)"
                );
                std::process::exit(0);
            }
            other => anyhow::bail!("unknown argument {other:?} (try --help)"),
        }
    }
    Ok(a)
}

async fn run(plan: &Plan, a: &Args, r: &mut Report) -> Result<()> {
    let want = |what: &str| a.only.is_empty() || a.only.iter().any(|o| what.contains(o.as_str()));
    for (name, imp, s) in &plan.links {
        if want(&format!("interactive bulk {name}")) {
            let res = link_runs(r, name, *imp, *s, a.link).await;
            scenario(r, &format!("link {name}"), res);
        }
    }
    if want("outage") {
        let res = event_run(r, plan, true).await;
        scenario(r, "outage scenario", res);
    }
    if want("outage cycles slow return") {
        let res = outage_cycles_run(r, plan).await;
        scenario(r, "outage cycles scenario", res);
    }
    if want("migration address") {
        let res = event_run(r, plan, false).await;
        scenario(r, "address change scenario", res);
    }
    if want("cellular data") {
        let res = cellular::run(r, plan.cellular_window, plan.quick).await;
        scenario(r, "cellular data", res);
    }
    if want("cellular data unreachable") {
        let res = unreachable::run(r, plan.unreachable).await;
        scenario(r, "unreachable cloud", res);
    }
    if want("cellular data mtu") {
        let res = cellular::mtu_searches(r, plan.quick).await;
        scenario(r, "path-MTU searches", res);
    }
    if want("footprint") {
        let res = footprint::run(r, plan.idle_window).await;
        scenario(r, "footprint", res);
    }
    if want("scale sessions concurrent") {
        let res = concurrent::run(r, plan.sessions).await;
        scenario(r, &format!("{} concurrent sessions", plan.sessions), res);
    }
    if want("replicas") {
        let res = replicas::run(r, plan.replica_edges, plan.replica_bulk_mib, plan.sessions).await;
        scenario(r, "replicas scenario", res);
    }
    if want("roll replicas") {
        let res = roll::run(r).await;
        scenario(r, "roll scenario", res);
    }
    if want("scale edges") {
        for n in &plan.scale_edges {
            let res = scale::run(r, *n, plan.idle_window.min(Duration::from_secs(30))).await;
            scenario(r, &format!("scale {n}"), res);
        }
    }
    Ok(())
}

/// A scenario that failed is said in the report and counted as a failed
/// measurement (the run's exit status is non-zero), and the next scenario
/// runs: one scenario's failure (a keep-alive that did not settle within
/// its limit) used to lose every table after it.
fn scenario(r: &mut Report, what: &str, res: Result<()>) {
    if let Err(e) = res {
        let msg = format!("{what} failed: {e:#}");
        r.push(&format!("\n_{msg}_\n"));
        r.error(msg);
    }
}

fn main() -> Result<()> {
    let a = args()?;
    let mut plan = Plan::new(a.quick);
    if !a.scale.is_empty() {
        plan.scale_edges = a.scale.clone();
    }
    if let Some(n) = a.sessions {
        plan.sessions = n;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut r = Report {
        out: String::new(),
        errors: Vec::new(),
        notes: Vec::new(),
        require_peers: a.require_peers,
    };
    r.push(&format!(
        "## Tether benchmarks ({})\n\nMachine: {}. Peers on the same emulated link (userspace TUN router between two network namespaces): \
         direct = TLS straight to the kubelet stand-in; ssh -R = OpenSSH reverse tunnel (one TCP connection); \
         rathole = TCP transport (a connection per session); tether = tether-cloud + tether-edge (QUIC, a stream per session). \
         The kubelet stand-in is HTTPS with client certificates required, like a kubelet: through ssh -R and rathole the client's TLS runs end to end; \
         Tether's cloud terminates it and its edge opens TLS to the kubelet. \
         Ratio rows: Tether's figure ÷ the peer's (latency: lower is better; throughput: higher is better).\n",
        if a.soak_minutes.is_some() {
            "soak"
        } else if plan.quick {
            "quick"
        } else {
            "full"
        },
        machine()
    ));
    if a.link.tether_only {
        r.push(
            "\nThe link scenarios measure Tether and direct only (`--tether-only`): ssh -R and \
             rathole are not started.\n",
        );
    }
    if let Some(n) = a.link.rounds {
        r.push(&format!(
            "\nThe link scenarios run {n} bulk rounds (`--rounds`) instead of their own.\n"
        ));
    }
    let started = Instant::now();
    let mut soak_failed = false;
    let result = match a.soak_minutes {
        Some(minutes) => {
            let n = a.sessions.unwrap_or(1000);
            rt.block_on(soak::run(&mut r, n, minutes)).map(|ok| {
                soak_failed = !ok;
            })
        }
        None => rt.block_on(run(&plan, &a, &mut r)),
    };
    if !r.notes.is_empty() {
        let notes: Vec<String> = r.notes.iter().map(|n| format!("- {n}\n")).collect();
        r.push(&format!("\nNot measured:\n{}", notes.concat()));
    }
    r.push(&format!(
        "\n_Run took {:.0} s._\n",
        started.elapsed().as_secs_f64()
    ));
    std::fs::create_dir_all(&a.out)?;
    let file = a.out.join(if a.soak_minutes.is_some() {
        "results-soak.md"
    } else if plan.quick {
        "results-quick.md"
    } else {
        "results.md"
    });
    std::fs::write(&file, &r.out).with_context(|| format!("writing {}", file.display()))?;
    eprintln!("tether-bench: written {}", file.display());
    rt.shutdown_timeout(Duration::from_secs(5));
    result?;
    if soak_failed {
        anyhow::bail!("the soak failed its verdict (see {})", file.display());
    }
    if !r.errors.is_empty() {
        anyhow::bail!(
            "{} measurement(s) failed:\n{}",
            r.errors.len(),
            r.errors.join("\n")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_scenario_is_reported_and_counted_and_the_run_goes_on() {
        let mut r = Report {
            out: String::new(),
            errors: Vec::new(),
            notes: Vec::new(),
            require_peers: true,
        };
        let failed: Result<()> =
            Err(anyhow::anyhow!("the keep-alive did not settle")).context("NAT binding 120 s");
        scenario(&mut r, "cellular data", failed);
        scenario(&mut r, "footprint", Ok(()));
        assert_eq!(
            r.errors,
            vec!["cellular data failed: NAT binding 120 s: the keep-alive did not settle"]
        );
        assert!(
            r.out.contains("_cellular data failed: NAT binding 120 s"),
            "{}",
            r.out
        );
        assert!(!r.out.contains("footprint"), "{}", r.out);
    }

    fn parse(args: &[&str]) -> Result<Args> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn link_options_default_to_every_peer_and_the_links_own_rounds() {
        let a = parse(&["--only", "clean"]).unwrap();
        assert_eq!(a.link, LinkOpts::default());
        assert!(!a.link.tether_only);
        assert_eq!(a.link.rounds, None);
    }

    #[test]
    fn tether_only_and_rounds_are_taken_within_their_bounds() {
        let a = parse(&["--tether-only", "--rounds", "15", "--only", "clean"]).unwrap();
        assert_eq!(
            a.link,
            LinkOpts {
                tether_only: true,
                rounds: Some(15)
            }
        );
        assert_eq!(parse(&["--rounds", "1"]).unwrap().link.rounds, Some(1));
        let max = MAX_ROUNDS.to_string();
        assert_eq!(
            parse(&["--rounds", &max]).unwrap().link.rounds,
            Some(MAX_ROUNDS)
        );
        let over = (MAX_ROUNDS + 1).to_string();
        for bad in [
            &["--rounds", "0"][..],
            &["--rounds", &over],
            &["--rounds", "many"],
            &["--rounds"],
        ] {
            let e = parse(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} was taken"));
            assert!(format!("{e:#}").contains("--rounds"), "{bad:?}: {e:#}");
        }
    }

    #[test]
    fn each_round_is_listed_in_order() {
        assert_eq!(round_list(&[71.54, 59.4, 88.0]), "71.5 59.4 88.0");
        assert_eq!(round_list(&[]), "-");
    }
}
