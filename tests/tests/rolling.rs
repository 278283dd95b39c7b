//! Rolling upgrades and crashes of cloud replicas (issue "Cloud replicas",
//! item 3), with real `tether-cloud` and `tether-edge` processes in a network
//! namespace of the test's own. The edge dials one UDP "service" address
//! that nftables DNATs to one replica, the way kube-proxy programs a
//! Service: connection tracking pins each flow (source port) to the replica
//! it first reached, so only a new source port can reach another one.
//!
//! - SIGTERM of the replica holding the edge: `/readyz` turns 503 at once,
//!   an apiserver stream open through it keeps flowing until it ends, then
//!   the edge is told to move and is connected to the other replica within a
//!   bound, from a new source port; the replica exits 0.
//! - `kill -9` of the replica holding the edge (the service then points at
//!   the other one and the stale conntrack entry is deleted, as kube-proxy
//!   does): with a reset key shared by the replicas the edge learns it from
//!   a stateless reset within a bound far below the idle timeout; without a
//!   shared key (the control) only at the idle timeout.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use http_body_util::BodyExt;
use hyper::StatusCode;
use linkemu::netns;
use support::{sample, Client, Kubelet};
use tether_tests::pki::{self, PeerPki, Pki};
use tether_tests::process::{Proc, SpawnOptions};

/// The UDP "service" address edges dial inside the namespace.
const SERVICE: &str = "127.0.0.1:7000";
/// Per replica (index 0 = A, 1 = B): tunnel, kubelet-API, metrics, peer ports.
const TUNNEL: [u16; 2] = [7101, 7102];
const API: [u16; 2] = [7201, 7202];
const METRICS: [u16; 2] = [7301, 7302];
const PEER: [u16; 2] = [7401, 7402];
/// Edge `n`'s operations listener.
fn edge_metrics(n: u16) -> SocketAddr {
    addr(7499 + n)
}
/// Short QUIC timings so a missed crash costs seconds, not half a minute.
const KEEP_ALIVE: &str = "1s";
const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A network namespace of this test, deleted on drop (after the processes
/// in it, which are declared later and so dropped — killed — first).
struct Ns(String);

impl Ns {
    fn new(tag: &str) -> Ns {
        let name = format!("tether-roll-{}-{tag}", std::process::id());
        netns::add(&name).unwrap();
        Ns(name)
    }

    /// Points the UDP service at `backend` (flushing the rules; conntrack
    /// entries are kept, as kube-proxy keeps them for live endpoints).
    fn route_service_to(&self, backend: SocketAddr) {
        let (svc_ip, svc_port) = SERVICE.split_once(':').unwrap();
        let rules = format!(
            "flush ruleset\n\
             table ip tether_svc {{\n\
               chain out {{\n\
                 type nat hook output priority -100; policy accept;\n\
                 ip daddr {svc_ip} udp dport {svc_port} dnat to {backend}\n\
               }}\n\
             }}\n"
        );
        let mut cmd = netns::command_in(&self.0, "nft");
        cmd.args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd
            .spawn()
            .expect("running nft (scripts/setup.sh installs nftables)");
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(rules.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "nft: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Deletes every conntrack entry of the namespace (what kube-proxy does
    /// for the UDP flows of an endpoint that went away).
    fn flush_conntrack(&self) {
        netns::run_in(&self.0, linkemu::conntrack::flush_ipv4)
            .unwrap()
            .unwrap();
    }

    fn command(&self, bin: &str) -> tokio::process::Command {
        tokio::process::Command::from(netns::command_in(
            &self.0,
            tether_tests::bins::binary(bin).unwrap(),
        ))
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = netns::delete(&self.0);
    }
}

/// GET over plain HTTP inside the namespace: status and body.
async fn ns_get(ns: &str, to: SocketAddr, path: &str) -> Result<(StatusCode, String)> {
    let ns = ns.to_string();
    let tcp = tokio::task::spawn_blocking(move || {
        netns::run_in(&ns, || std::net::TcpStream::connect(to))
    })
    .await???;
    tcp.set_nonblocking(true)?;
    let tcp = tokio::net::TcpStream::from_std(tcp)?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let resp = tokio::time::timeout(
        Duration::from_secs(5),
        sender.send_request(
            hyper::Request::get(path)
                .header("host", "ops")
                .body(support::empty())?,
        ),
    )
    .await
    .context("ops request timed out")??;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

struct Bed {
    // Dropped last: the processes below are killed before it goes.
    ns: Ns,
    dir: tempfile::TempDir,
    pki: Pki,
    peers: PeerPki,
    reset_key: std::path::PathBuf,
}

impl Bed {
    fn new(tag: &str) -> Bed {
        let ns = Ns::new(tag);
        let dir = tempfile::tempdir().unwrap();
        let pki = pki::mint(dir.path(), &["edge-1", "edge-2", "edge-3"]).unwrap();
        let peers = pki::mint_peers(&dir.path().join("peers")).unwrap();
        // Made as an operator would, with tether-certs.
        let reset_key = dir.path().join("reset.key");
        let out = std::process::Command::new(tether_tests::bins::binary("tether-certs").unwrap())
            .args(["reset-key", "--out"])
            .arg(&reset_key)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        Bed {
            ns,
            dir,
            pki,
            peers,
            reset_key,
        }
    }

    /// Starts replica `i` (0 = A, 1 = B), linked to the other as its peer.
    async fn replica(&self, i: usize, shared_key: bool, extra: &[&str]) -> Proc {
        let name = ["replica-a", "replica-b"][i];
        let mut cmd = self.ns.command("tether-cloud");
        cmd.args([
            "--tunnel-listen",
            &addr(TUNNEL[i]).to_string(),
            "--kubelet-listen",
            &addr(API[i]).to_string(),
            "--metrics-listen",
            &addr(METRICS[i]).to_string(),
            "--replica-name",
            name,
            "--peer-listen",
            &addr(PEER[i]).to_string(),
            "--peers",
            &format!("{},{}", addr(PEER[0]), addr(PEER[1])),
            "--peer-resolve-interval",
            "1s",
            "--keep-alive",
            KEEP_ALIVE,
            "--idle-timeout",
            &format!("{}s", IDLE_TIMEOUT.as_secs()),
        ])
        .args(self.pki.cloud_flags())
        .args(self.peers.flags())
        .args(extra)
        .env("TETHER_LOG", "info,tether_cloud=debug")
        // JSON: the staggering is read from the log's timestamps.
        .env("TETHER_LOG_FORMAT", "json")
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0");
        if shared_key {
            cmd.arg("--reset-key-file").arg(&self.reset_key);
        }
        let mut p = Proc::spawn(name, cmd, self.dir.path(), SpawnOptions::default()).unwrap();
        p.wait_line("cloud ready line", Duration::from_secs(20), |l| {
            l.starts_with("tether-cloud ready")
        })
        .await
        .unwrap();
        p
    }

    /// The kubelet stand-in (its socket in the namespace) and edge-1
    /// dialling the service, waited for until connected.
    async fn edge(&self) -> (Kubelet, Proc) {
        self.edge_n(1).await
    }

    /// As [`Bed::edge`] for `edge-<n>` (pod `default/p<n>`, metrics on
    /// port 7499 + n).
    async fn edge_n(&self, n: u16) -> (Kubelet, Proc) {
        let node = format!("edge-{n}");
        let listener = netns::run_in(&self.ns.0, || std::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap()
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let kubelet =
            Kubelet::start_on(listener, &node, &[format!("default/p{n}").as_str()]).unwrap();
        let pair = &self.pki.edges[&node];
        let mut cmd = self.ns.command("tether-edge");
        cmd.args(["--cloud", SERVICE, "--server-name", pki::CLOUD_SERVER_NAME])
            .arg("--ca")
            .arg(&self.pki.tether_ca)
            .arg("--cert")
            .arg(&pair.cert)
            .arg("--key")
            .arg(&pair.key)
            .args([
                "--kubelet-url",
                &format!("http://127.0.0.1:{port}"),
                "--pods-refresh",
                "200ms",
                "--metrics-listen",
                &edge_metrics(n).to_string(),
                "--announce-address",
                &format!("{node}.invalid"),
                "--keep-alive",
                KEEP_ALIVE,
                "--idle-timeout",
                &format!("{}s", IDLE_TIMEOUT.as_secs()),
            ])
            .env("TETHER_LOG", "info,tether_edge=debug")
            .env("NO_COLOR", "1")
            .env("RUST_BACKTRACE", "0");
        let name = if n == 1 {
            "tether-edge".to_string()
        } else {
            format!("tether-edge-{n}")
        };
        let mut edge = Proc::spawn(&name, cmd, self.dir.path(), SpawnOptions::default()).unwrap();
        edge.wait_connected("edge connected", Duration::from_secs(20))
            .await
            .unwrap();
        (kubelet, edge)
    }

    /// The apiserver's client for replica `i`'s kubelet-API listener.
    fn client(&self, i: usize) -> Client {
        let ns = self.ns.0.clone();
        Client::new(&self.pki, addr(API[i]))
            .unwrap()
            .with_dial(std::sync::Arc::new(move |a| {
                netns::run_in(&ns, || std::net::TcpStream::connect(a))
                    .map_err(std::io::Error::other)?
            }))
    }

    /// Edge-1's source address as replica `i`'s `/status` shows it, once
    /// the edge is connected there (bounded wait).
    async fn edge_remote_on(&self, i: usize, within: Duration) -> SocketAddr {
        self.node_remote_on("edge-1", i, within).await
    }

    /// As [`Bed::edge_remote_on`] for `node`.
    async fn node_remote_on(&self, node: &str, i: usize, within: Duration) -> SocketAddr {
        let deadline = Instant::now() + within;
        loop {
            if let Ok((_, body)) = ns_get(&self.ns.0, addr(METRICS[i]), "/status").await {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let remote = v["nodes"].as_array().and_then(|nodes| {
                    nodes
                        .iter()
                        .find(|n| n["node"] == node && n["connected"] == true)
                        .and_then(|n| n["remote"].as_str())
                        .and_then(|r| r.parse().ok())
                });
                if let Some(r) = remote {
                    return r;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{node} not connected to replica {i} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn edge_metric(&self, series: &str) -> f64 {
        let (_, text) = ns_get(&self.ns.0, edge_metrics(1), "/metrics")
            .await
            .unwrap();
        sample(&text, series).unwrap_or(0.0)
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }
}

/// Waits for the edge's next "connected" line; returns how long it took.
async fn next_connect(edge: &mut Proc, within: Duration, since: Instant) -> Duration {
    edge.wait_connected("edge reconnected", within)
        .await
        .unwrap();
    since.elapsed()
}

/// After SIGTERM of replica A (`a`): the `what` in `body` keeps flowing through it for
/// 2 s (at least 10 frames), A still runs, and it reports not ready.
async fn keeps_flowing_while_draining(
    bed: &Bed,
    body: &mut hyper::body::Incoming,
    a: &mut Proc,
    what: &str,
) {
    let flow_until = Instant::now() + Duration::from_secs(2);
    let mut frames = 0;
    while Instant::now() < flow_until {
        match tokio::time::timeout(Duration::from_secs(2), body.frame()).await {
            Ok(Some(Ok(_))) => frames += 1,
            other => panic!("the {what} through the draining replica broke: {other:?}"),
        }
    }
    assert!(frames >= 10, "only {frames} frames in 2 s after SIGTERM");
    assert!(
        a.exited().is_none(),
        "A must carry its {what} until it ends"
    );
    let (s, _) = ns_get(&bed.ns.0, addr(METRICS[0]), "/readyz")
        .await
        .unwrap();
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
}

fn sigterm(p: &Proc) {
    let pid = i32::try_from(p.pid().expect("replica is running")).unwrap();
    // SAFETY: a signal to our own, not yet reaped, child.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
}

/// Bound on an edge reaching the other replica after it was told to move.
const MOVE_BOUND: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_replica_and_its_edge_moves_from_a_new_port() {
    let bed = Bed::new("drain");
    let grace = Duration::from_secs(20);
    let extra = ["--shutdown-grace", "20s", "--drain-spread", "1s"];
    bed.ns.route_service_to(addr(TUNNEL[0]));
    let mut a = bed.replica(0, true, &extra).await;
    let _b = bed.replica(1, true, &extra).await;
    let (_kubelet, mut edge) = bed.edge().await;
    let first = bed.edge_remote_on(0, Duration::from_secs(10)).await;

    // An apiserver stream through A to the edge held on A.
    let client = bed.client(0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let resp = loop {
        let r = client.follow_log("default/p1").await.unwrap();
        if r.status() == StatusCode::OK {
            break r;
        }
        assert!(Instant::now() < deadline, "p1 never routable on A");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut body = resp.into_body();
    tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // SIGTERM: not ready at once; the service follows readiness (new flows
    // go to B), while A's conntrack entry for the edge's port stays.
    let term = Instant::now();
    sigterm(&a);
    loop {
        let (s, _) = ns_get(&bed.ns.0, addr(METRICS[0]), "/readyz")
            .await
            .unwrap();
        if s == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert!(
            term.elapsed() < Duration::from_secs(2),
            "/readyz still {s} {:?} after SIGTERM",
            term.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("replica-a not ready {:?} after SIGTERM", term.elapsed());
    bed.ns.route_service_to(addr(TUNNEL[1]));

    // The open stream keeps flowing through A (the edge stays on A meanwhile).
    keeps_flowing_while_draining(&bed, &mut body, &mut a, "stream").await;
    let (_, status) = ns_get(&bed.ns.0, addr(METRICS[0]), "/status")
        .await
        .unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["draining"], true, "{status}");

    // The stream ends (the client goes away): the edge is told to move, and
    // reconnects to B at once, from a new source port.
    drop(body);
    let ended = Instant::now();
    let t = next_connect(&mut edge, MOVE_BOUND, ended).await;
    let second = bed.edge_remote_on(1, Duration::from_secs(5)).await;
    eprintln!("edge moved to replica-b {t:?} after its stream ended: {first} -> {second}");
    assert_ne!(first.port(), second.port(), "a new UDP source port");

    // A exits 0 within --shutdown-grace.
    let status = a.wait_exit(grace).await.unwrap();
    assert!(status.success(), "{status:?}\n{}", bed.log("replica-a"));
    eprintln!("replica-a exited {:?} after SIGTERM", term.elapsed());
    let log_a = bed.log("replica-a");
    assert!(
        log_a.contains("draining: telling the edge to move"),
        "{log_a}"
    );
    assert_eq!(bed.edge_metric("tether_edge_moves_obeyed_total").await, 1.0);
    assert!(
        bed.edge_metric("tether_edge_source_port_changes_total")
            .await
            >= 1.0
    );

    // The edge serves through B.
    let r = bed
        .client(1)
        .get("/containerLogs/default/p1/c", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body.contains("edge-1 line 0"), "{}", r.body);
}

/// kill -9 of the replica holding the edge; returns how long until the edge
/// was connected to the other replica, and checks the new source port.
/// Also returns the edge's count of stateless resets seen.
async fn crash_and_measure(tag: &str, shared_key: bool) -> (Duration, f64, Bed) {
    let bed = Bed::new(tag);
    bed.ns.route_service_to(addr(TUNNEL[0]));
    let mut a = bed.replica(0, shared_key, &[]).await;
    let b = bed.replica(1, shared_key, &[]).await;
    let (kubelet, mut edge) = bed.edge().await;
    let first = bed.edge_remote_on(0, Duration::from_secs(10)).await;
    // Let the connection settle (keep-alives flowing) before the crash.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let crash = Instant::now();
    a.kill().await;
    bed.ns.route_service_to(addr(TUNNEL[1]));
    bed.ns.flush_conntrack();
    let t = next_connect(&mut edge, IDLE_TIMEOUT * 3, crash).await;
    let second = bed.edge_remote_on(1, Duration::from_secs(5)).await;
    eprintln!(
        "{tag}: edge connected to replica-b {t:?} after kill -9 of replica-a ({first} -> {second})"
    );
    assert_ne!(first.port(), second.port(), "a new UDP source port");
    let resets = bed.edge_metric("tether_edge_resets_seen_total").await;
    drop((b, kubelet, edge));
    (t, resets, bed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_a_shared_reset_key_brings_the_edge_back_at_once() {
    let (t, resets, bed) = crash_and_measure("key", true).await;
    assert_eq!(resets, 1.0);
    assert!(
        t < Duration::from_secs(5),
        "with the shared key the edge must learn the crash from a stateless reset, took {t:?} (idle timeout {IDLE_TIMEOUT:?})\n{}",
        bed.log("tether-edge")
    );
    let log = bed.log("tether-edge");
    assert!(log.contains("stateless reset"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_without_a_shared_key_the_edge_waits_for_the_idle_timeout() {
    let (t, resets, bed) = crash_and_measure("nokey", false).await;
    assert_eq!(resets, 0.0);
    // The last packet from A came at most a keep-alive before the crash.
    assert!(
        t >= IDLE_TIMEOUT - Duration::from_secs(2),
        "without a shared key only the idle timeout can tell, yet it took {t:?}"
    );
    let log = bed.log("tether-edge");
    assert!(!log.contains("stateless reset"), "{log}");
}

/// The times (seconds into the UTC day) of the JSON log lines containing
/// `needle`, in order.
fn log_times(log: &str, needle: &str) -> Vec<f64> {
    log.lines()
        .filter(|l| l.contains(needle))
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let ts = v["timestamp"].as_str()?;
            let (_, time) = ts.split_once('T')?;
            let mut parts = time.trim_end_matches('Z').split(':');
            let h: f64 = parts.next()?.parse().ok()?;
            let m: f64 = parts.next()?.parse().ok()?;
            let s: f64 = parts.next()?.parse().ok()?;
            Some(h * 3600.0 + m * 60.0 + s)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_moves_edges_staggered_and_a_refused_edge_retries_from_new_ports() {
    let bed = Bed::new("spread");
    let spread = Duration::from_secs(3);
    let extra = ["--shutdown-grace", "20s", "--drain-spread", "3s"];
    bed.ns.route_service_to(addr(TUNNEL[0]));
    let mut a = bed.replica(0, true, &extra).await;
    let _b = bed.replica(1, true, &extra).await;
    let mut edges = Vec::new();
    for n in 1..=3 {
        edges.push(bed.edge_n(n).await);
        // Attached at A (its commit arrived), not only welcomed.
        bed.node_remote_on(&format!("edge-{n}"), 0, Duration::from_secs(5))
            .await;
    }

    // SIGTERM while the service still sends new flows to A (kube-proxy has
    // not caught up yet): the first edge moved is refused by A, and retries
    // from new ports until the service points at B.
    let term = Instant::now();
    sigterm(&a);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    bed.ns.route_service_to(addr(TUNNEL[1]));

    // Every edge lands on B, within a bound after its move.
    for n in 1..=3u16 {
        let node = format!("edge-{n}");
        bed.node_remote_on(&node, 1, spread + MOVE_BOUND).await;
    }
    let on_b = term.elapsed();
    let status = a.wait_exit(Duration::from_secs(20)).await.unwrap();
    assert!(status.success(), "{status:?}");
    let log_a = bed.log("replica-a");
    let began = log_times(&log_a, "shutting down: not ready");
    let moves: Vec<Duration> = log_times(&log_a, "draining: telling the edge to move")
        .iter()
        .map(|t| Duration::from_secs_f64(t - began[0]))
        .collect();
    eprintln!("edges told to move at {moves:?} after SIGTERM (--drain-spread {spread:?})");
    assert_eq!(
        moves.len(),
        3,
        "every edge told to move: {moves:?}\n{log_a}"
    );
    // Slots at 0, 1 and 2 s: the first at once, the others spread out.
    assert!(moves[0] < Duration::from_millis(500), "{moves:?}");
    assert!(moves[1] >= Duration::from_millis(900), "{moves:?}");
    assert!(moves[2] >= Duration::from_millis(1900), "{moves:?}");
    assert!(moves[2] < spread, "{moves:?}");
    let refused = log_a
        .matches("refusing an edge connection: this replica is draining")
        .count();
    eprintln!(
        "all edges on replica-b {on_b:?} after SIGTERM; A refused {refused} attempts while draining"
    );
    assert!(
        refused >= 1,
        "the first moved edge was refused by the draining A"
    );
    let log1 = bed.log("tether-edge");
    assert!(log1.contains("told this edge to move"), "{log1}");
    assert!(
        log1.contains("cannot reach the cloud"),
        "refused, then retried: {log1}"
    );
    drop(edges);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_keeps_relaying_a_stream_to_an_edge_held_elsewhere() {
    let bed = Bed::new("relay");
    let extra = ["--shutdown-grace", "20s", "--drain-spread", "1s"];
    // The edge is held by B; the apiserver's stream lands on A, which relays it.
    bed.ns.route_service_to(addr(TUNNEL[1]));
    let mut a = bed.replica(0, true, &extra).await;
    let _b = bed.replica(1, true, &extra).await;
    let (_kubelet, _edge) = bed.edge().await;
    bed.edge_remote_on(1, Duration::from_secs(10)).await;
    let client = bed.client(0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let resp = loop {
        let r = client.follow_log("default/p1").await.unwrap();
        if r.status() == StatusCode::OK {
            break r;
        }
        assert!(Instant::now() < deadline, "p1 never routable through A");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut body = resp.into_body();
    tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let (_, m) = ns_get(&bed.ns.0, addr(METRICS[0]), "/metrics")
        .await
        .unwrap();
    assert_eq!(
        sample(&m, "tether_cloud_relayed_streams_total{role=\"entry\"}"),
        Some(1.0),
        "the stream is relayed by A: {m}"
    );

    let term = Instant::now();
    sigterm(&a);
    keeps_flowing_while_draining(&bed, &mut body, &mut a, "relayed stream").await;

    // The stream ends: A exits 0 soon after, well within --shutdown-grace.
    drop(body);
    let ended = Instant::now();
    let status = a.wait_exit(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "{status:?}\n{}", bed.log("replica-a"));
    eprintln!(
        "replica-a relayed for {:?} after SIGTERM, exited {:?} after the stream ended",
        ended - term,
        ended.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_serves_new_requests_for_shutdown_delay_then_exits() {
    let bed = Bed::new("min");
    let min = Duration::from_secs(2);
    let extra = ["--shutdown-grace", "20s", "--shutdown-delay", "2s"];
    // A holds no edge: without --shutdown-delay it would exit at once, while
    // the load balancer may still send it requests.
    bed.ns.route_service_to(addr(TUNNEL[1]));
    let mut a = bed.replica(0, true, &extra).await;
    let _b = bed.replica(1, true, &extra).await;
    let (_kubelet, _edge) = bed.edge().await;
    bed.edge_remote_on(1, Duration::from_secs(10)).await;
    let client = bed.client(0);
    let get = || client.get("/containerLogs/default/p1/c", "edge-1", None, &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while get().await.map(|r| r.status).ok() != Some(StatusCode::OK) {
        assert!(Instant::now() < deadline, "p1 never routable through A");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let term = Instant::now();
    sigterm(&a);
    let mut served = 0;
    while term.elapsed() < min - Duration::from_millis(500) {
        let r = get().await.unwrap();
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{} after SIGTERM: {}",
            served,
            r.body
        );
        served += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(a.exited().is_none(), "A must stay for --shutdown-delay");
    let status = a.wait_exit(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "{status:?}");
    let exited = term.elapsed();
    eprintln!("replica-a served {served} new requests after SIGTERM, exited after {exited:?} (--shutdown-delay {min:?})");
    assert!(
        exited >= min,
        "exited after {exited:?}, before --shutdown-delay"
    );
}
