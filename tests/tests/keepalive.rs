//! The adaptive keep-alive behind a NAT that drops idle bindings (issue 15,
//! item 4).
//!
//! The edge sits behind the link emulator's NAT, whose bindings expire after
//! a few seconds idle (a new public port for the next packet, as a carrier
//! NAT does). The edge starts below the binding and is allowed to go far
//! above it; it must learn the binding from the rebindings the cloud sees
//! (QUIC path challenges) and settle inside its bounds, below the binding,
//! with the session intact: one connection all along, requests still routed,
//! also one that arrives after the NAT dropped the binding.
//! No timed assertions: every wait is bounded, the assertions are on what
//! happened.
//!
//! Needs root, `ip`, `nft` and the workspace binaries (`cargo build --workspace --bins`).

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use linkemu::{Link, LinkOptions};
use support::{client_in_cloud, get_ok, kubelet_in_edge, spawn_cloud, spawn_edge};
use tether_tests::pki;

const BINDING: Duration = Duration::from_secs(6);
const MIN: Duration = Duration::from_secs(1);
const MAX: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_settles_below_the_nat_binding_and_the_session_survives() {
    let link = Arc::new(
        Link::create(LinkOptions::new().with_nat_binding(BINDING))
            .expect("creating the emulated link with a NAT (needs root, `ip` and `nft`)"),
    );
    let dir = tempfile::tempdir().unwrap();
    let pki = pki::mint(dir.path(), &["edge-1"]).unwrap();
    let (cloud, _) = spawn_cloud("tether-cloud", &link, &pki, dir.path(), &[]).await;
    let (_kubelet, kubelet_port) = kubelet_in_edge(&link);
    let mut edge = spawn_edge(
        &link,
        &pki,
        dir.path(),
        kubelet_port,
        &[
            "--keep-alive",
            "2s",
            "--keep-alive-min",
            "1s",
            "--keep-alive-max",
            "20s",
            "--idle-timeout",
            "60s",
        ],
    )
    .await;
    let client = client_in_cloud(&link, &pki);
    get_ok(&client, Duration::from_secs(30))
        .await
        .expect("the pod is routable");

    // Learning: 2, 4, 8 s (lost), then bisecting; well under three minutes.
    let started = Instant::now();
    let settled = edge
        .wait_line("keep-alive settled", Duration::from_secs(180), |l| {
            l.starts_with("tether-edge keep-alive settled")
        })
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the keep-alive never settled: {e:#}\nedge log:\n{}",
                tether_tests::process::tail_of_file(edge.log_path(), 40)
            )
        });
    let took = started.elapsed();
    let field = |k: &str| -> f64 {
        settled
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.trim_end_matches('s').parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {settled:?}"))
    };
    let interval = Duration::from_secs_f64(field("interval="));
    let rebindings = field("rebindings=");
    assert!(
        interval >= MIN && interval <= MAX,
        "settled outside the bounds: {settled}"
    );
    assert!(
        interval < BINDING,
        "settled at or above the NAT binding of {BINDING:?}: {settled}"
    );
    assert!(
        interval >= BINDING / 2,
        "settled far below the binding (it should be just below): {settled}"
    );
    assert!(
        rebindings >= 1.0,
        "allowed up to {MAX:?} against a {BINDING:?} binding, it must have lost a binding on the way: {settled}"
    );
    // The cloud saw the rebindings as migrations of the one connection.
    let cloud_log = std::fs::read_to_string(cloud.log_path()).unwrap_or_default();
    assert!(
        cloud_log.contains("edge migrated to a new address"),
        "the cloud never saw the NAT rebind the edge"
    );

    // Settled: idle for several bindings' worth; no more rebindings, and
    // the session is the same one and still routes.
    tokio::time::sleep(BINDING * 3).await;
    let more = edge
        .lines()
        .iter()
        .filter(|l| l.starts_with("tether-edge keep-alive settled"))
        .count();
    get_ok(&client, Duration::from_secs(30))
        .await
        .expect("a request after the idle period is routed");
    // A binding that expired anyway (the NAT drops every binding at once):
    // a request arriving now waits for the edge's next keep-alive to open a
    // new one, and gets through on the same connection.
    link.rebind_nat().expect("dropping the NAT's bindings");
    let t = Instant::now();
    get_ok(&client, Duration::from_secs(60))
        .await
        .expect("a request after the binding was dropped is routed");
    let reopen = t.elapsed();
    assert_eq!(
        edge.connects(),
        1,
        "the session must survive the learning on its first connection: {:?}",
        edge.lines()
    );
    println!(
        "FIGURE adaptive keep-alive behind a {BINDING:?} NAT binding: settled at {interval:?} after {:.0} s and {rebindings} rebinding(s); {more} settle line(s); one connection throughout; a request after the NAT dropped the binding took {:.1} s",
        took.as_secs_f64(),
        reopen.as_secs_f64()
    );
}
