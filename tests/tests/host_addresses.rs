//! What a real edge announces by default, and what moves it, with a
//! kube-proxy in IPVS mode on its node: every Service ClusterIP bound on
//! the interface `kube-ipvs0`, which stays down.
//!
//! The edge runs in a link's edge namespace (`linkemu`) with no
//! `--announce-address`, beside a down `kube-ipvs0` holding 100 addresses
//! that sort before its own (10.0.0.* before 10.231.2.2): it must announce
//! its own address (the cloud logs what an edge announced) and serve a
//! node-scoped request addressed to it (a `Host` the apiserver dials, as
//! metrics-server's scrapes do), and none of the ClusterIPs. Services
//! created in the cluster afterwards (more addresses on `kube-ipvs0`) must
//! not rebind the edge's socket; an address on an interface that is up
//! still does, once.
//!
//! Needs root, `ip` and the workspace binaries (`cargo build --workspace --bins`).

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::StatusCode;
use linkemu::{Link, LinkOptions};
use support::{client_in_cloud, kubelet_in_edge, spawn_cloud, spawn_edge_announcing};
use tether_tests::pki;

/// `ip -n NS args…`, which must succeed.
fn ip_in(ns: &str, args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(["-n", ns])
        .args(args)
        .output()
        .expect("running ip");
    assert!(
        out.status.success(),
        "ip -n {ns} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Adds 10.0.0.`i`/32 on `kube-ipvs0` for each `i` of `range`.
fn add_cluster_ips(ns: &str, range: std::ops::RangeInclusive<u32>) {
    for i in range {
        ip_in(
            ns,
            &[
                "addr",
                "add",
                &format!("10.0.0.{i}/32"),
                "dev",
                "kube-ipvs0",
            ],
        );
    }
}

/// Polls `f` every 100 ms until it gives `Some`, for `limit` at most.
async fn within<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_on_a_down_kube_ipvs0_are_neither_announced_nor_followed() {
    let link = Arc::new(
        Link::create(LinkOptions::new()).expect("creating the emulated link (needs root and `ip`)"),
    );
    let ns = link.edge_ns().to_string();
    // kube-proxy makes a dummy interface; a bridge where the kernel has no
    // dummy driver: both stay down until set up.
    let added = std::process::Command::new("ip")
        .args(["-n", &ns, "link", "add", "kube-ipvs0", "type", "dummy"])
        .output()
        .expect("running ip");
    if !added.status.success() {
        ip_in(&ns, &["link", "add", "kube-ipvs0", "type", "bridge"]);
    }
    add_cluster_ips(&ns, 1..=100);

    let dir = tempfile::tempdir().unwrap();
    let pki = pki::mint(dir.path(), &["edge-1"]).unwrap();
    let (cloud, _) = spawn_cloud("tether-cloud", &link, &pki, dir.path(), &[]).await;
    let (_kubelet, kubelet_port) = kubelet_in_edge(&link);
    let edge = spawn_edge_announcing(&link, &pki, dir.path(), kubelet_port, None, &[]).await;

    // What the edge announced, as the cloud logged it when it connected.
    let edge_ip = link.edge_ip().to_string();
    let announced = within(
        Duration::from_secs(10),
        "the cloud's `edge connected`",
        || {
            std::fs::read_to_string(cloud.log_path())
                .unwrap_or_default()
                .lines()
                .find(|l| l.contains("edge connected") && l.contains("addresses="))
                .map(|l| l.split("addresses=").nth(1).unwrap_or_default().to_string())
        },
    )
    .await;
    assert!(
        announced.contains(&format!("\"{edge_ip}\"")),
        "the edge's own address {edge_ip} is not announced: {announced}"
    );
    assert!(
        !announced.contains("10.0.0."),
        "addresses of the down kube-ipvs0 announced: {announced}"
    );

    // A node-scoped request by the node's address (metrics-server's scrape
    // of https://NODE_IP:10250/metrics/resource) reaches this edge.
    let client = client_in_cloud(&link, &pki);
    let host = format!("{edge_ip}:10250");
    let r = client.get("/metrics", &host, None, &[]).await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.node(), Some("edge-1"));

    // Services created in the cluster: more ClusterIPs on kube-ipvs0.
    let rebinds = || {
        std::fs::read_to_string(edge.log_path())
            .unwrap_or_default()
            .matches("local addresses changed")
            .count()
    };
    add_cluster_ips(&ns, 101..=120);
    // 20 times the edge's 50 ms settling of a burst of address events: a
    // rebind for these would be logged by then.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let for_the_services = rebinds();
    // An address on an interface that is up is followed, once.
    ip_in(&ns, &["addr", "add", "10.231.9.9/32", "dev", "lo"]);
    let total = within(Duration::from_secs(10), "a rebind for 10.231.9.9", || {
        Some(rebinds()).filter(|&n| n > for_the_services)
    })
    .await;
    assert_eq!(
        (for_the_services, total),
        (0, 1),
        "rebinds for the ClusterIPs, then for 10.231.9.9: {}",
        edge.stderr_tail(20)
    );
    // Still the one connection.
    assert_eq!(edge.connects(), 1);
}
