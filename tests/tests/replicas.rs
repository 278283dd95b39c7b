//! Several cloud replicas (issue "Cloud replicas"), as real `tether-cloud`
//! processes on loopback: they find each other through a static `--peers`
//! list over the mutual-TLS peer link, notice a replica that joins or dies
//! within a bound, and refuse a "peer" whose certificate is not a peer's; and,
//! with a real edge and kubelet-sim behind them, relay no more requests to one
//! peer at once than `--peer-max-streams`, saying so.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use support::{plain_get, sample};
use tether_tests::pki::{self, Pair, PeerPki, Pki};
use tether_tests::ports;
use tether_tests::process::{Proc, SpawnOptions};

/// Short membership timings so the test is quick: re-resolve every second,
/// a silent peer is down after two.
const RESOLVE: &str = "1s";
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on a membership change being seen: one resolve round plus the peer
/// timeout, with room for a loaded machine.
const NOTICE_BOUND: Duration = Duration::from_secs(10);

struct Replica {
    name: String,
    proc: Proc,
    metrics: SocketAddr,
}

/// A free UDP port on loopback, below the ephemeral range (see `tether_tests::ports`).
fn free_udp_port() -> u16 {
    ports::free_loopback(ports::Proto::Udp).unwrap().port()
}

/// A run directory and the certificates every replica of a test uses.
struct Bed {
    dir: tempfile::TempDir,
    pki: Pki,
    peers: PeerPki,
}

impl Bed {
    fn new() -> Bed {
        let dir = tempfile::tempdir().unwrap();
        let pki = pki::mint(dir.path(), &["edge-1"]).unwrap();
        let peers = pki::mint_peers(&dir.path().join("peers")).unwrap();
        Bed { dir, pki, peers }
    }

    /// Starts replica `name` with `peer_cert`, peer listener `listen`,
    /// static `members` and `extra` flags.
    async fn spawn(
        &self,
        name: &str,
        peer_cert: &Pair,
        listen: SocketAddr,
        members: &[SocketAddr],
        extra: &[String],
    ) -> Result<Replica> {
        spawn_replica(
            self.dir.path(),
            &self.pki,
            &self.peers,
            name,
            (peer_cert, listen),
            members,
            extra,
        )
        .await
    }
}

async fn spawn_replica(
    dir: &Path,
    pki: &Pki,
    peers: &PeerPki,
    name: &str,
    (peer_cert, listen): (&Pair, SocketAddr),
    members: &[SocketAddr],
    extra: &[String],
) -> Result<Replica> {
    let list = members
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut cmd = tokio::process::Command::new(tether_tests::bins::binary("tether-cloud")?);
    cmd.args(tether_tests::LOOPBACK_LISTENS)
        .args([
            "--peer-resolve-interval",
            RESOLVE,
            "--peer-timeout",
            &format!("{}s", PEER_TIMEOUT.as_secs()),
            "--replica-name",
            name,
            "--peer-listen",
            &listen.to_string(),
            "--peers",
            &list,
        ])
        .args(extra)
        .args(pki.cloud_flags())
        .args(peers.flags_with(peer_cert))
        .env("TETHER_LOG", "info,tether_cloud=debug")
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0");
    let mut proc = Proc::spawn(name, cmd, dir, SpawnOptions::default())?;
    let ready = support::ReadyLine::wait(&mut proc).await?;
    assert_eq!(
        ready.addr("peer")?,
        listen,
        "{name} listens for peers where told"
    );
    Ok(Replica {
        name: name.to_string(),
        proc,
        metrics: ready.addr("metrics")?,
    })
}

async fn metric(r: &Replica, series: &str) -> f64 {
    let (_, text) = plain_get(r.metrics, "/metrics").await.unwrap();
    sample(&text, series).unwrap_or(0.0)
}

/// Waits until `r` reports `want` peers up; returns how long it took.
async fn wait_peers_up(r: &Replica, want: f64, since: Instant) -> Duration {
    let deadline = Instant::now() + NOTICE_BOUND;
    loop {
        let up = metric(r, "tether_cloud_peers_up").await;
        if up == want {
            return since.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "{}: peers_up {up}, expected {want} within {NOTICE_BOUND:?}\n{}",
            r.name,
            r.proc.stderr_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn log(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_find_each_other_and_notice_joins_and_deaths() {
    let bed = Bed::new();
    let addrs: Vec<SocketAddr> = (0..3)
        .map(|_| SocketAddr::from(([127, 0, 0, 1], free_udp_port())))
        .collect();
    // Every replica is given the whole list, itself included (as a headless
    // Service's DNS answer would): it must skip itself.
    let start = Instant::now();
    let a = bed
        .spawn("replica-a", &bed.peers.peer, addrs[0], &addrs, &[])
        .await
        .unwrap();
    let b = bed
        .spawn("replica-b", &bed.peers.peer, addrs[1], &addrs, &[])
        .await
        .unwrap();
    let t = wait_peers_up(&a, 1.0, start).await;
    wait_peers_up(&b, 1.0, start).await;
    eprintln!("two replicas linked {t:?} after the first started");

    // A third joins: all see two peers. It finds A only through DNS
    // (`localhost` resolves to A's loopback address), B through its list.
    let joined = Instant::now();
    let dns = vec![
        "--peer-dns".to_string(),
        format!("localhost:{}", addrs[0].port()),
    ];
    let mut c = bed
        .spawn("replica-c", &bed.peers.peer, addrs[2], &addrs[1..], &dns)
        .await
        .unwrap();
    for r in [&a, &b, &c] {
        let t = wait_peers_up(r, 2.0, joined).await;
        eprintln!("{} sees the join after {t:?}", r.name);
    }
    let (_, status) = plain_get(a.metrics, "/status").await.unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["replica"], "replica-a");
    let mut names: Vec<String> = status["peers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["up"] == true)
        .map(|p| p["replica"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["replica-b", "replica-c"], "{status}");
    // Self-links are never counted: the own address is not a peer.
    assert!(
        !status["peers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["addr"] == addrs[0].to_string()),
        "{status}"
    );

    // kill -9 of C: the others notice within the bound, and keep their link.
    let died = Instant::now();
    c.proc.kill().await;
    for r in [&a, &b] {
        let t = wait_peers_up(r, 1.0, died).await;
        eprintln!("{} notices the death after {t:?}", r.name);
    }
    assert!(log(bed.dir.path(), "replica-a").contains("peer down"));
    // A stays linked to B after C's death (no flapping).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(metric(&a, "tether_cloud_peers_up").await, 1.0);
    assert_eq!(metric(&b, "tether_cloud_peers_up").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_a_wrong_certificate_is_refused_and_logged() {
    let bed = Bed::new();
    let good = SocketAddr::from(([127, 0, 0, 1], free_udp_port()));
    let a = bed
        .spawn("replica-a", &bed.peers.peer, good, &[good], &[])
        .await
        .unwrap();

    // The right CA, but an edge certificate: refused by the explicit check.
    let start = Instant::now();
    let edge_addr = SocketAddr::from(([127, 0, 0, 1], free_udp_port()));
    let pretender = bed
        .spawn(
            "pretender",
            &bed.peers.edge_signed_by_peer_ca,
            edge_addr,
            &[good],
            &[],
        )
        .await
        .unwrap();
    // A trusted stranger from another CA: refused by TLS.
    let foreign_addr = SocketAddr::from(([127, 0, 0, 1], free_udp_port()));
    let foreign = bed
        .spawn(
            "foreign",
            &bed.peers.foreign_peer,
            foreign_addr,
            &[good],
            &[],
        )
        .await
        .unwrap();
    let deadline = start + NOTICE_BOUND;
    loop {
        let not_peer = metric(
            &a,
            "tether_cloud_peers_refused_total{reason=\"not_a_peer\"}",
        )
        .await;
        let tls = metric(&a, "tether_cloud_peers_refused_total{reason=\"tls\"}").await;
        if not_peer >= 1.0 && tls >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not refused in time: not_a_peer {not_peer}, tls {tls}\n{}",
            a.proc.stderr_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log_a = log(bed.dir.path(), "replica-a");
    assert!(
        log_a.contains("refused a peer connection") && log_a.contains("not a peer certificate"),
        "{log_a}"
    );
    assert!(log_a.contains("handshake failed"), "{log_a}");
    // Neither ever counts as a peer, on either side.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for r in [&a, &pretender, &foreign] {
        assert_eq!(metric(r, "tether_cloud_peers_up").await, 0.0, "{}", r.name);
    }
    let (_, status) = plain_get(a.metrics, "/status").await.unwrap();
    assert!(!status.contains("\"up\":true"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_peer_link_is_seen_within_the_timeout_and_heals() {
    let bed = Bed::new();
    let pa = SocketAddr::from(([127, 0, 0, 1], free_udp_port()));
    let pb = SocketAddr::from(([127, 0, 0, 1], free_udp_port()));
    // B is alive throughout; A reaches it only through a relay we can cut.
    let _b = bed
        .spawn("replica-b", &bed.peers.peer, pb, &[pb], &[])
        .await
        .unwrap();
    let relay = support::UdpRelay::start(pb).await.unwrap();
    let a = bed
        .spawn("replica-a", &bed.peers.peer, pa, &[relay.addr], &[])
        .await
        .unwrap();
    wait_peers_up(&a, 1.0, Instant::now()).await;

    let cut = Instant::now();
    relay.set_outage(true);
    let t = wait_peers_up(&a, 0.0, cut).await;
    eprintln!("replica-a sees the cut link after {t:?} (peer timeout {PEER_TIMEOUT:?})");
    assert!(
        t >= PEER_TIMEOUT / 2,
        "down after {t:?}: before any timeout could expire"
    );
    let (_, status) = plain_get(a.metrics, "/status").await.unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let peer = &status["peers"][0];
    assert_eq!(peer["up"], false, "{status}");
    assert!(
        peer["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{status}"
    );

    let healed = Instant::now();
    relay.set_outage(false);
    let t = wait_peers_up(&a, 1.0, healed).await;
    eprintln!("replica-a relinks after {t:?} once the link heals");
}

/// `--peer-max-streams` bounds the requests one replica relays to another at once
/// (a `logs -f` holds its stream for as long as it runs). Past it a relay fails
/// within `--route-wait` with a 502 that names the flag, the held ones go on, and
/// relays open again once some have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_past_the_peer_stream_limit_fail_naming_it_and_open_again_when_some_end() {
    use tether_tests::cluster::{read_until, Cluster, ClusterSpec, NodeSpec, PodSpec};
    const LIMIT: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let mut spec = ClusterSpec::tunnel(
        vec![NodeSpec {
            name: "edge-0".into(),
            pods: vec![PodSpec::new("default", "p0", &["c"])],
        }],
        2,
    );
    spec.cloud_args = [
        "--peer-max-streams",
        &LIMIT.to_string(),
        "--peer-timeout",
        "2s",
        "--route-wait",
        "3s",
    ]
    .map(String::from)
    .to_vec();
    let cluster = Cluster::start(&spec, dir.path()).await.unwrap();
    let result = async {
        // edge-0 is held by replica 0; replica 1 relays.
        let via = cluster.kubelet_apis_for("edge-0")?[1];
        let path = "/containerLogs/default/p0/c?follow=true&tailLines=0";
        let limit = Duration::from_secs(30);
        let mut held = Vec::new();
        let refusal = loop {
            anyhow::ensure!(
                held.len() <= LIMIT,
                "{} relayed follows open with --peer-max-streams {LIMIT}",
                held.len()
            );
            let r = cluster.kubelet_open_via(via, "edge-0", path, limit).await?;
            if r.status != 200 {
                break r;
            }
            held.push(r.io);
        };
        // The route subscription may take one of the link's streams.
        anyhow::ensure!(
            held.len() + 1 >= LIMIT,
            "only {} relayed follows opened before a refusal: {}",
            held.len(),
            refusal.text
        );
        anyhow::ensure!(
            refusal.status == 502 && refusal.text.contains("--peer-max-streams"),
            "the refusal does not name the limit: {}",
            refusal.text
        );
        // Two end (a follow notices at the next line); every other one gets
        // that line, and a new relay opens. (quinn announces freed streams
        // once more than an eighth of the limit are free: here two.)
        held.truncate(held.len() - 2);
        cluster
            .append_log("edge-0", "default", "p0", "c", "one-ended\n")
            .await?;
        for (i, io) in held.iter_mut().enumerate() {
            tokio::time::timeout(limit, read_until(io, b"one-ended", 64 << 10))
                .await
                .map_err(|_| anyhow::anyhow!("held follow {i}: no line within {limit:?}"))?
                .with_context(|| format!("held follow {i}"))?;
        }
        let start = Instant::now();
        loop {
            let r = cluster.kubelet_open_via(via, "edge-0", path, limit).await?;
            if r.status == 200 {
                break;
            }
            anyhow::ensure!(
                start.elapsed() < Duration::from_secs(20),
                "no relay opened within 20 s after two ended: {}",
                r.text
            );
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let diagnostics = cluster.diagnostics(20);
    cluster.shutdown().await;
    if let Err(e) = result {
        panic!("{e:#}\n{diagnostics}");
    }
}
