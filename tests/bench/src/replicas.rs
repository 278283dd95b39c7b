//! Scenario: three `tether-cloud` replicas (issue "Cloud replicas"), on loopback.
//!
//! Part 1, real processes ([`tether_tests::cluster`] with three replicas, one real
//! `tether-edge` + kubelet-sim per replica): the same request sent to the replica that
//! holds the edge (served locally) and to another (relayed once over the peer link) —
//! open latency p50/p99 of a small log request (a new TLS connection each, as the
//! apiserver makes), one-stream throughput of a large log, and the memory a held
//! `kubectl logs -f` session costs: `sessions` follow requests held open at once, the
//! RSS they add to all replicas together and to the edge (a relayed one crosses two
//! replicas: the one the apiserver reached and the edge's holder, each given apart);
//! relayed ÷ local.
//!
//! Part 2, `n` simulated edges (the scale scenario's generator: real QUIC, real
//! certificates, the edge's handshake) spread over three replicas: time until all are
//! connected, until every replica knows every edge (route propagation), RSS per replica
//! and per peer link; then `kill -9` of one replica: its edges move to the next replica
//! (as a load balancer would send them) — time until they are all welcomed again and
//! until the survivors route to them.
//!
//! Not measured here: the request success rate during a rolling restart (that needs
//! the edges' load balancer to follow the replicas; the replica test bed in network
//! namespaces measures it).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tether_certs::Ca;
use tether_tests::cluster::{read_until, sample, Cluster, ClusterSpec, NodeSpec, PodSpec};
use tether_tests::process::{Proc, SpawnOptions};

use crate::measure::pct;
use crate::scale;
use crate::table::{Cell, Table};
use crate::Report;

/// Requests per latency sample set.
const LATENCY_N: usize = 200;

/// The simulated edges' transport here: QUIC's defaults (keep-alive 10 s, idle
/// timeout 30 s). On loopback no load balancer sends an edge's next packet to a
/// survivor (whose shared reset key would end the connection at once), so after
/// the `kill -9` the edges notice only by their idle timeout; tether-edge's
/// 150 s would outlast the scenario's 120 s wait.
fn kill_quic() -> tether_proto::quic::QuicSettings {
    tether_proto::quic::QuicSettings::default()
}

/// Runs both parts and appends their tables.
pub async fn run(r: &mut Report, n_edges: usize, bulk_mib: usize, sessions: usize) -> Result<()> {
    let (rows, held) = real_processes(bulk_mib, sessions)
        .await
        .context("replicas: part 1")?;
    let mut t = Table::new(&["figure", "local", "relayed", "relayed ÷ local"], 2);
    for (k, l, rl) in rows {
        t.row(&k, vec![Cell::Num(l), Cell::Num(rl), Cell::Num(rl / l)]);
    }
    r.push(&format!(
        "\n### Replicas: local vs relayed (3 replicas, real tether-edge + kubelet-sim, loopback)\n\n{}\n\
         Held sessions: {sessions} `logs -f` requests open at once, each on its own TLS connection \
         (as the apiserver makes one per `kubectl logs -f`), RSS 1 s after the last opened and one \
         appended line reached every one. Relayed, per session: {:.1} KiB on the replica the \
         apiserver reached, {:.1} KiB on the replica holding the edge.\n",
        t.render(),
        held.entry_kib,
        held.holder_kib,
    ));
    let rows = simulated(n_edges).await.context("replicas: part 2")?;
    let mut t = Table::new(&["figure", "value"], 1);
    for (k, v) in rows {
        t.row(&k, vec![v]);
    }
    r.push(&format!(
        "\n### Replicas: {n_edges} simulated edges over 3 replicas (loopback)\n\n{}",
        t.render()
    ));
    Ok(())
}

/// A relayed held session's cost on each replica it crosses (KiB).
struct HeldSplit {
    entry_kib: f64,
    holder_kib: f64,
}

/// (figure, local, relayed) rows, and the relayed held session's split.
async fn real_processes(
    bulk_mib: usize,
    sessions: usize,
) -> Result<(Vec<(String, f64, f64)>, HeldSplit)> {
    let dir = tempfile::tempdir()?;
    let nodes: Vec<NodeSpec> = (0..3)
        .map(|i| NodeSpec {
            name: format!("edge-{i}"),
            pods: vec![PodSpec::new("default", &format!("p{i}"), &["c"])],
        })
        .collect();
    let spec = ClusterSpec::tunnel(nodes, 3);
    let cluster = Cluster::start(&spec, dir.path()).await?;
    let result = async {
        let apis = cluster.kubelet_apis_for("edge-0")?;
        // edge-0 is held by replica 0 (node i → replica i mod 3).
        let (local, relayed) = (apis[0], apis[1]);
        let small = "/containerLogs/default/p0/c?limitBytes=1";
        let mut lat = (Vec::new(), Vec::new());
        for i in 0..LATENCY_N * 2 {
            let via = if i % 2 == 0 { local } else { relayed };
            let t = Instant::now();
            let reply = cluster.kubelet_get_via(via, "edge-0", small).await?;
            if !reply.status.is_success() {
                bail!("GET {small} via {via}: {}", reply.status);
            }
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if i % 2 == 0 {
                lat.0.push(ms);
            } else {
                lat.1.push(ms);
            }
        }
        let log = cluster.log_path("edge-0", "default", "p0", "c")?;
        let line = "0123456789abcdef".repeat(4) + "\n";
        let body = line.repeat(bulk_mib * (1 << 20) / line.len());
        std::fs::write(&log, &body).with_context(|| format!("writing {}", log.display()))?;
        let big = "/containerLogs/default/p0/c";
        let mut best = (0.0f64, 0.0f64);
        for round in 0..3 {
            for (k, via) in [(0, local), (1, relayed)] {
                let t = Instant::now();
                let reply = cluster
                    .kubelet_get_via(via, "edge-0", big)
                    .await
                    .with_context(|| {
                        let path = if k == 0 { "local" } else { "relayed" };
                        format!("round {round} of the {bulk_mib} MiB log, {path}")
                    })?;
                let secs = t.elapsed().as_secs_f64();
                if reply.body.len() != body.len() {
                    bail!(
                        "round {round}: {} of {} bytes via {via}",
                        reply.body.len(),
                        body.len()
                    );
                }
                let mbs = body.len() as f64 / secs / 1e6;
                if k == 0 {
                    best.0 = best.0.max(mbs);
                } else {
                    best.1 = best.1.max(mbs);
                }
            }
        }
        // Each follow starts at the log's end (tailLines=0): nothing to send until
        // a line is appended. The large log goes first: finding its end would
        // cost each follow a read of the whole file.
        std::fs::write(&log, "").with_context(|| format!("emptying {}", log.display()))?;
        // Local: edge-0 through replica 0. Relayed: edge-1 (held by replica 1)
        // through replica 2, so no process of the relayed count reuses memory
        // the local sessions freed.
        let local_held = held(&cluster, local, 0, sessions)
            .await
            .context("held sessions, local")?;
        let relayed_via = cluster.kubelet_apis_for("edge-1")?[2];
        let relayed_held = held(&cluster, relayed_via, 1, sessions)
            .await
            .context("held sessions, relayed")?;
        let rows = vec![
            (
                format!("request open p50, {LATENCY_N} requests (ms)"),
                pct(&lat.0, 0.5),
                pct(&lat.1, 0.5),
            ),
            (
                format!("request open p99, {LATENCY_N} requests (ms)"),
                pct(&lat.0, 0.99),
                pct(&lat.1, 0.99),
            ),
            (
                format!("one stream, {bulk_mib} MiB log, best of 3 (MB/s)"),
                best.0,
                best.1,
            ),
            (
                format!("RSS per held `logs -f` session, all 3 replicas, {sessions} held (KiB)"),
                local_held.replicas_kib,
                relayed_held.replicas_kib,
            ),
            (
                format!("RSS per held `logs -f` session, tether-edge, {sessions} held (KiB)"),
                local_held.edge_kib,
                relayed_held.edge_kib,
            ),
        ];
        let split = HeldSplit {
            entry_kib: relayed_held.per_replica_kib[2],
            holder_kib: relayed_held.per_replica_kib[1],
        };
        Ok((rows, split))
    }
    .await;
    if let Err(e) = &result {
        // The run's report gets the error; the processes' own account of it
        // (a stream reset, a lost peer link) goes to the bench's stderr.
        eprintln!(
            "replicas part 1 failed: {e:#}\nthe cluster's processes, last lines:\n{}",
            cluster.diagnostics(30)
        );
    }
    cluster.shutdown().await;
    result
}

/// Bound of opening one held session, and of the appended line reaching all.
const HELD_LIMIT: Duration = Duration::from_secs(60);

/// What `n` held sessions added (KiB per session).
struct Held {
    /// Per replica, in replica order.
    per_replica_kib: Vec<f64>,
    replicas_kib: f64,
    edge_kib: f64,
}

/// RSS (KiB) of the three replicas, in order, and of `node`'s tether-edge.
fn cluster_rss(cluster: &Cluster, node: &str) -> Result<(Vec<u64>, u64)> {
    let procs = cluster.processes();
    let rss = |name: &str| -> Result<u64> {
        let pid = procs
            .iter()
            .find(|(n, _, _)| n == name)
            .and_then(|(_, pid, _)| *pid)
            .with_context(|| format!("no running {name}"))?;
        crate::footprint::status_kb(pid, "VmRSS:")
    };
    let replicas = (0..3)
        .map(|i| rss(&format!("tether-cloud-{i}")))
        .collect::<Result<Vec<_>>>()?;
    Ok((replicas, rss(&format!("tether-edge-{node}"))?))
}

/// Opens `n` `logs -f` requests for the pod of edge-`i` through the kubelet API at `via`,
/// one after another, each on its own TLS connection, waits for every response head, appends one line
/// and waits until every session got it, reads memory, then closes them all.
async fn held(cluster: &Cluster, via: SocketAddr, i: usize, n: usize) -> Result<Held> {
    let (node, pod) = (format!("edge-{i}"), format!("p{i}"));
    let (replicas0, edge0) = cluster_rss(cluster, &node)?;
    let path = format!("/containerLogs/default/{pod}/c?follow=true&tailLines=0");
    let mut open = Vec::with_capacity(n);
    for i in 0..n {
        let reply = cluster
            .kubelet_open_via(via, &node, &path, HELD_LIMIT)
            .await
            .with_context(|| format!("session {i}"))?;
        if reply.status != 200 {
            bail!("session {i}: {}", reply.text.trim());
        }
        open.push(reply.io);
    }
    let marker = "held-session-marker\n";
    cluster
        .append_log(&node, "default", &pod, "c", marker)
        .await?;
    let mut reading = Vec::with_capacity(n);
    for (i, mut tls) in open.into_iter().enumerate() {
        reading.push(tokio::spawn(async move {
            tokio::time::timeout(HELD_LIMIT, read_until(&mut tls, marker.as_bytes(), 1 << 20))
                .await
                .with_context(|| format!("session {i}: the appended line did not arrive"))?
                .with_context(|| format!("session {i}"))?;
            Ok::<_, anyhow::Error>(tls)
        }));
    }
    let mut live = Vec::with_capacity(n);
    for t in reading {
        live.push(t.await.context("read task")??);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (replicas1, edge1) = cluster_rss(cluster, &node)?;
    // A follow whose client left notices when it next writes (as with a real
    // kubelet): one more line ends them all along the path, then they settle.
    drop(live);
    cluster
        .append_log(&node, "default", &pod, "c", "held-sessions-closed\n")
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per = |a: u64, b: u64| b as f64 / n as f64 - a as f64 / n as f64;
    let per_replica_kib: Vec<f64> = replicas0
        .iter()
        .zip(&replicas1)
        .map(|(a, b)| per(*a, *b))
        .collect();
    Ok(Held {
        replicas_kib: per(replicas0.iter().sum(), replicas1.iter().sum()),
        per_replica_kib,
        edge_kib: per(edge0, edge1),
    })
}

/// One replica of part 2.
struct Replica {
    proc: Proc,
    tunnel: SocketAddr,
    metrics: SocketAddr,
}

async fn spawn_replica(
    dir: &std::path::Path,
    files: &scale::CloudFiles,
    peers: &tether_tests::pki::PeerPki,
    i: usize,
    listens: &[SocketAddr],
    n: usize,
) -> Result<Replica> {
    let list = listens
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut cmd = tokio::process::Command::new(tether_tests::bins::binary("tether-cloud")?);
    cmd.args(["--tunnel-listen", "127.0.0.1:0"])
        .args(["--kubelet-listen", "127.0.0.1:0"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .args(["--max-edges", &(n + 100).to_string()])
        // Every simulated edge dials from 127.0.0.1: the per-source handshake
        // rate (20/s, for floods) would pace them like edges behind one NAT.
        .args(["--handshakes-per-source", &(n + 100).to_string()])
        .args(["--replica-name", &format!("replica-{i}")])
        .args(["--peer-listen", &listens[i].to_string()])
        .args(["--peers", &list])
        .args(["--peer-resolve-interval", "1s"])
        .args(&files.args)
        .args(peers.flags())
        .env("TETHER_LOG", "warn")
        .env("RUST_BACKTRACE", "0");
    let mut proc = Proc::spawn(
        &format!("tether-cloud-replica-{i}"),
        cmd,
        dir,
        SpawnOptions::default(),
    )?;
    let ready = proc
        .wait_line("tether-cloud ready", Duration::from_secs(20), |l| {
            l.starts_with("tether-cloud ready")
        })
        .await?;
    let field = |k: &str| -> Result<SocketAddr> {
        ready
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .and_then(|a| a.parse().ok())
            .with_context(|| format!("no {k}= in {ready:?}"))
    };
    Ok(Replica {
        tunnel: field("tunnel")?,
        metrics: field("metrics")?,
        proc,
    })
}

async fn metric(addr: SocketAddr, series: &str) -> f64 {
    match crate::measure::metrics_text(addr).await {
        Some(text) => sample(&text, series).unwrap_or(0.0),
        None => 0.0,
    }
}

/// Waits until every replica in `rs` reports `series` ≥ `want`.
async fn wait_metric(
    rs: &[&Replica],
    series: &str,
    want: f64,
    limit: Duration,
) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        let mut all = true;
        for r in rs {
            if metric(r.metrics, series).await < want {
                all = false;
                break;
            }
        }
        if all {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn rss_mib(p: &Proc) -> f64 {
    p.pid()
        .and_then(|pid| crate::footprint::status_kb(pid, "VmRSS:").ok())
        .map(|kb| kb as f64 / 1024.0)
        .unwrap_or(0.0)
}

async fn simulated(n: usize) -> Result<Vec<(String, Cell)>> {
    let dir = tempfile::tempdir()?;
    let ca = Ca::new("tether-replicas-ca", scale::VALIDITY)?;
    let files = scale::cloud_files(dir.path(), &ca)?;
    let peers = tether_tests::pki::mint_peers(&dir.path().join("peers"))?;
    let listens: Vec<SocketAddr> = (0..3)
        .map(|_| tether_tests::ports::free_loopback(tether_tests::ports::Proto::Udp))
        .collect::<Result<_>>()?;
    let mut cfgs = Vec::with_capacity(n);
    for i in 0..n {
        cfgs.push(scale::client_config_with(
            &ca,
            &format!("edge-{i}"),
            kill_quic(),
        )?);
    }
    // Replica 0 alone first: its RSS before any peer, then with two peer links.
    let r0 = spawn_replica(dir.path(), &files, &peers, 0, &listens, n).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_alone = rss_mib(&r0.proc);
    let r1 = spawn_replica(dir.path(), &files, &peers, 1, &listens, n).await?;
    let r2 = spawn_replica(dir.path(), &files, &peers, 2, &listens, n).await?;
    let mut reps = vec![r0, r1, r2];
    let all: Vec<&Replica> = reps.iter().collect();
    wait_metric(&all, "tether_cloud_peers_up", 2.0, Duration::from_secs(20))
        .await
        .context("the three replicas did not link within 20 s")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_linked = rss_mib(&reps[0].proc);

    let tunnels: Vec<SocketAddr> = reps.iter().map(|r| r.tunnel).collect();
    let endpoints = scale::endpoints_for(n)?;
    let welcomes = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Never changed: these edges send no warm-up keep-alives.
    let (_warm_tx, warm) = tokio::sync::watch::channel(0u64);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (i, cfg) in cfgs.into_iter().enumerate() {
        // Edge i starts at replica i mod 3 and moves to the next when it loses it.
        let mut order = tunnels.clone();
        order.rotate_left(i % 3);
        tasks.push(tokio::spawn(scale::edge(
            endpoints[i % endpoints.len()].clone(),
            cfg,
            format!("edge-{i}"),
            order,
            welcomes.clone(),
            stop.clone(),
            warm.clone(),
        )));
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    }
    let result = async {
        let connected = scale::wait_count(&welcomes, n, Duration::from_secs(120))
            .await
            .map(|_| t0.elapsed())
            .with_context(|| {
                format!(
                    "only {} of {n} edges connected within 120 s",
                    welcomes.load(Ordering::Relaxed)
                )
            })?;
        // Every replica knows every edge: its own plus those the others hold.
        let routed = async {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(60) {
                let mut all = true;
                for r in &reps {
                    let here = metric(r.metrics, "tether_cloud_sessions").await;
                    let there = metric(r.metrics, "tether_cloud_remote_edges").await;
                    if here + there < n as f64 {
                        all = false;
                        break;
                    }
                }
                if all {
                    return Some(t0.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            None
        }
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss: Vec<f64> = reps.iter().map(|r| rss_mib(&r.proc)).collect();
        let mut rows = vec![
            (
                format!("connect all {n}: first dial → last welcome (s)"),
                Cell::Num(connected.as_secs_f64()),
            ),
            (
                "first dial → every replica routes every edge (s)".into(),
                match routed {
                    Some(d) => Cell::Num(d.as_secs_f64()),
                    None => Cell::text("no, within 60 s"),
                },
            ),
            (
                format!("RSS per replica with {n} edges over 3, mean (MiB)"),
                Cell::Num(rss.iter().sum::<f64>() / 3.0),
            ),
            (
                "RSS per peer link: replica 0 linked to 2 peers − alone, ÷ 2 (KiB)".into(),
                Cell::Num((rss_linked - rss_alone) * 1024.0 / 2.0),
            ),
        ];
        // kill -9 of replica 2: its edges go to replica 0 (the next in their order).
        let before = welcomes.load(Ordering::Relaxed);
        let moved = metric(reps[2].metrics, "tether_cloud_sessions").await as usize;
        let killed = Instant::now();
        let mut gone = reps.remove(2);
        gone.proc.kill().await;
        let back = scale::wait_count(&welcomes, before + moved, Duration::from_secs(120)).await;
        rows.push((
            format!("kill -9 of a replica: its {moved} edges welcomed elsewhere (s)"),
            match back {
                Some(_) => Cell::Num(killed.elapsed().as_secs_f64()),
                None => Cell::text(format!(
                    "no: {} of {moved} within 120 s",
                    welcomes.load(Ordering::Relaxed) - before
                )),
            },
        ));
        Ok(rows)
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in &tasks {
        t.abort();
    }
    for ep in &endpoints {
        ep.close(0u32.into(), b"bench done");
    }
    for mut r in reps {
        r.proc.terminate(Duration::from_secs(5)).await;
    }
    result
}
