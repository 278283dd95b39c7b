//! The edge's response heads stay within the head bound it agreed with the
//! cloud, end to end. The cloud runs with `--max-head-bytes 4KiB`, the edge
//! with the default 256 KiB, and the kubelet answers one request with a
//! 6 KB head. Before, the edge wrote the head with its own bound and the
//! cloud refused it as a bad head (a 502 that said nothing of the edge's
//! limit). Now the edge resets the stream with `LimitExceeded`: its log names
//! the node, the head's size and the bound, the apiserver's client gets a 502
//! naming the bound, and the next request on the same connection is served.
//!
//! The binaries must be built first (`cargo build --workspace --bins`).

mod support;

use std::time::Duration;

use hyper::StatusCode;
use support::{Env, Kubelet};

/// The one node: the certificate every [`Env`] mints besides its specs'.
const NODE: &str = "edge-intruder";

/// What both the edge's reset (and so the 502's body) and its log say.
const NAMES_THE_BOUND: &str =
    "(--max-head-bytes, the smaller of the edge's and the cloud's: 4096 bytes)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_head_over_the_clouds_bound_is_a_502_naming_it_and_the_edge_serves_on() {
    let env = Env::start(&[], &["--max-head-bytes", "4KiB"])
        .await
        .unwrap();
    let kubelet = Kubelet::start(NODE, &["default/p1"]).await.unwrap();
    let edge = env
        .spawn_edge(NODE, &format!("http://{}", kubelet.addr), &[], &[])
        .await
        .unwrap();
    env.wait_routable("default/p1").await.unwrap();

    // 6 KB of header: over the cloud's 4 KiB, well within the edge's 256 KiB.
    let r = env
        .client
        .get(
            "/containerLogs/default/p1/c?head-bytes=6000",
            "apiserver.example:6443",
            None,
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.body);
    assert!(
        r.body
            .contains(&format!("edge {NODE} ended the stream (LimitExceeded)")),
        "{}",
        r.body
    );
    assert!(r.body.contains(NAMES_THE_BOUND), "{}", r.body);

    // The edge's log line names the node, the head's size and the bound.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let line = loop {
        let log = std::fs::read_to_string(edge.log_path()).unwrap_or_default();
        if let Some(l) = log.lines().find(|l| l.contains(NAMES_THE_BOUND)) {
            break l.to_string();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no log line naming the bound; the edge's log:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for part in [NODE, "head_bytes=", "max_head_bytes=4096"] {
        assert!(line.contains(part), "{part:?} not in {line}");
    }

    // The next request, right after, is served, on the same connection.
    let r = env
        .client
        .get(
            "/containerLogs/default/p1/c",
            "apiserver.example:6443",
            None,
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body.contains(&format!("{NODE} line 0")), "{}", r.body);
    let connects = edge
        .lines()
        .iter()
        .filter(|l| l.starts_with("tether-edge connected"))
        .count();
    assert_eq!(
        connects,
        1,
        "the edge reconnected:\n{}",
        edge.stderr_tail(40)
    );
}
