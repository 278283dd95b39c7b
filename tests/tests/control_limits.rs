//! Bounds on what an edge says on its control stream, end to end.
//!
//! The edge's control stream stays within the frame bound it agreed with the
//! cloud. The cloud runs with `--max-frame-bytes 64KiB`, the edge
//! with the default 1 MiB, and the edge's kubelet lists 3,000 pods (a pod
//! report of about 230 KB). Before, the edge wrote its pod report with its own
//! bound: the cloud took the frame for a protocol error and closed the
//! connection, and the edge sent the same report on every reconnect (and had
//! the report exceeded the edge's own bound, the edge closed the connection
//! itself). Now the report is cut to the pods that fit in the agreed 64 KiB,
//! with a warning naming the node, the pods and the bound, and the connection
//! stays up: the first pods route, the last ones get 404.
//!
//! A hello announces at most `--max-announced-addresses` addresses: one more
//! is refused with a reason naming the bound and the flag, and a hello at the
//! bound is welcomed.
//!
//! The binaries must be built first (`cargo build --workspace --bins`).

mod support;

use std::time::Duration;

use hyper::StatusCode;
use support::{Env, Kubelet};

/// The one node: the certificate every [`Env`] mints besides its specs'.
const NODE: &str = "edge-intruder";
const PODS: usize = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_list_larger_than_the_agreed_frame_is_cut_and_the_connection_kept() {
    let env = Env::start(
        &[],
        &["--max-frame-bytes", "64KiB", "--max-head-bytes", "32KiB"],
    )
    .await
    .unwrap();
    // Sorted as the edge sorts them (by namespace, then name).
    let pods: Vec<String> = (0..PODS)
        .map(|i| format!("default/pod-with-a-longish-name-{i:05}"))
        .collect();
    let names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let kubelet = Kubelet::start(NODE, &names).await.unwrap();
    let edge_log = {
        let edge = env
            .spawn_edge(NODE, &format!("http://{}", kubelet.addr), &[], &[])
            .await
            .unwrap();
        // The first pod is reported: the cut report reached the cloud.
        env.wait_routable(&pods[0]).await.unwrap();
        // Several pod reads later (every 200 ms), still the first connection.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let connects = edge.connects();
        let log = std::fs::read_to_string(edge.log_path()).unwrap_or_default();
        assert_eq!(
            connects,
            1,
            "the edge reconnected; its log:\n{}\ncloud log:\n{}",
            edge.stderr_tail(40),
            env.cloud_log()
        );
        log
    };
    assert!(
        !env.cloud_log().contains("control stream failed"),
        "the cloud refused a control frame:\n{}",
        env.cloud_log()
    );
    // The warning names the node, the pods and the bound.
    let warning = edge_log
        .lines()
        .find(|l| l.contains("does not fit in one pod report"))
        .unwrap_or_else(|| panic!("no warning about the cut report in:\n{edge_log}"));
    for part in [NODE, &format!("of {PODS} pods"), "max_frame_bytes=65536"] {
        assert!(warning.contains(part), "{part:?} not in {warning}");
    }
    // The pods past the cut are unknown to the cloud.
    let last = pods[PODS - 1].split_once('/').unwrap().1;
    let r = env
        .client
        .get(
            &format!("/containerLogs/default/{last}/c"),
            "apiserver.example:6443",
            None,
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
}

/// `--max-announced-addresses 3`: a hand-driven edge announcing 4 addresses
/// is refused (`BadHello`, naming the bound and the flag, logged with the
/// node); announcing 3 it is welcomed and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_announcing_more_than_max_announced_addresses_is_refused() {
    let env = Env::start(&[], &["--max-announced-addresses", "3"])
        .await
        .unwrap();
    let pair = &env.pki.edges[NODE];
    let announcing = |n: usize| {
        let addresses = (1..=n).map(|i| format!("10.9.0.{i}")).collect();
        support::RawEdge::connect_announcing(
            env.tunnel,
            &env.pki.tether_ca_pem,
            &pair.cert_pem,
            &pair.key_pem,
            NODE,
            addresses,
        )
    };
    let refusal = match announcing(4).await {
        Ok(_) => panic!("a hello announcing 4 addresses was welcomed"),
        Err(e) => format!("{e:#}"),
    };
    for part in [
        "BadHello",
        NODE,
        "4 addresses announced, at most 3 (--max-announced-addresses)",
    ] {
        assert!(refusal.contains(part), "{part:?} not in {refusal}");
    }
    assert!(
        env.cloud_log()
            .contains("4 addresses announced, at most 3 (--max-announced-addresses)"),
        "the refusal is not logged:\n{}",
        env.cloud_log()
    );
    let edge = announcing(3)
        .await
        .expect("a hello at the bound is welcomed");
    assert!(edge.conn.close_reason().is_none());
}

/// `--max-pods-per-report 1000`: an edge whose kubelet lists 3,000 pods
/// (a report well within the default 1 MiB frame) has its report cut by
/// the cloud to the first 1,000, with one warning naming the node and the
/// flag; the connection stays up, pod 1,000 routes and pod 1,001 gets 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_report_over_max_pods_per_report_is_cut_by_the_cloud() {
    let env = Env::start(&[], &["--max-pods-per-report", "1000"])
        .await
        .unwrap();
    let pods: Vec<String> = (0..PODS).map(|i| format!("default/pod-{i:05}")).collect();
    let names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let kubelet = Kubelet::start(NODE, &names).await.unwrap();
    let edge = env
        .spawn_edge(NODE, &format!("http://{}", kubelet.addr), &[], &[])
        .await
        .unwrap();
    env.wait_routable(&pods[999]).await.unwrap();
    let next = pods[1000].split_once('/').unwrap().1;
    let r = env
        .client
        .get(
            &format!("/containerLogs/default/{next}/c"),
            "apiserver.example:6443",
            None,
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
    let log = env.cloud_log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("--max-pods-per-report"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    for part in [
        &format!("node={NODE}"),
        "pods=3000",
        "max_pods_per_report=1000",
    ] {
        assert!(
            warnings[0].contains(part),
            "{part:?} not in {}",
            warnings[0]
        );
    }
    let connects = edge.connects();
    assert_eq!(
        connects,
        1,
        "the edge reconnected:\n{}",
        edge.stderr_tail(40)
    );
}

/// `--pod-reports-per-sec 1 --pod-report-burst 3`: a hand-driven edge
/// sends four pod reports at once; the cloud takes three and closes the
/// connection on the fourth, logging the node and both flags. (The
/// defaults, 10/s with a burst of 20, would take all four.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_reports_beyond_the_configured_rate_close_the_connection() {
    use tether_proto::handshake::{PodRef, PodReport};
    use tether_proto::Frame;
    let env = Env::start(
        &[],
        &["--pod-reports-per-sec", "1", "--pod-report-burst", "3"],
    )
    .await
    .unwrap();
    let pair = &env.pki.edges[NODE];
    let mut edge = support::RawEdge::connect(
        env.tunnel,
        &env.pki.tether_ca_pem,
        &pair.cert_pem,
        &pair.key_pem,
        NODE,
    )
    .await
    .unwrap();
    for i in 0..4 {
        let report = Frame::PodReport(PodReport {
            pods: vec![PodRef {
                namespace: "default".into(),
                name: format!("r{i}"),
                uid: String::new(),
            }],
        });
        tether_proto::io::write_frame(&mut edge.send, &report, 1 << 20)
            .await
            .unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), edge.conn.closed())
        .await
        .expect("the cloud closes the connection within 10 s");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let line = loop {
        let log = env.cloud_log();
        if let Some(l) = log.lines().find(|l| l.contains("pod reports faster than")) {
            break l.to_string();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no refusal logged:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for part in [
        &format!("node={NODE}"),
        "faster than 1/s (burst 3; --pod-reports-per-sec, --pod-report-burst)",
    ] {
        assert!(line.contains(part), "{part:?} not in {line}");
    }
    let accepted = env
        .cloud_log()
        .lines()
        .filter(|l| l.contains("pod report") && l.contains(&format!("node={NODE} pods=1")))
        .count();
    assert_eq!(accepted, 3, "{}", env.cloud_log());
}
