//! Heads stay within the head bound the edge and the cloud agreed (the
//! smaller `--max-head-bytes` of the two), end to end, whichever side's bound
//! is the smaller.
//!
//! - The cloud runs with `--max-head-bytes 4KiB`, the edge with the default
//!   256 KiB, and the kubelet answers one request with a 6 KB head. Before,
//!   the edge wrote the head with its own bound and the cloud refused it as
//!   a bad head (a 502 that said nothing of the edge's limit). Now the edge
//!   resets the stream with `LimitExceeded`: its log names the node, the
//!   head's size and the bound, the apiserver's client gets a 502 naming the
//!   bound, and the next request on the same connection is served.
//! - The mirror image: the cloud runs with the default 256 KiB, the edge with
//!   `--max-head-bytes 4KiB`, and the apiserver sends a request with a 6 KB
//!   header. Before, the cloud sent it within its own bound and the edge
//!   refused it as a bad request head (a 502 `ProtocolError`). Now the cloud
//!   answers 431 naming the node and the bound it agreed with that edge (its
//!   log too), opens no stream, and the next request is served. Likewise for
//!   a request relayed by a second replica: the replica that owns the stream
//!   knows the bound the edge's holder agreed with it (its route record), and
//!   answers 431 before anything crosses the peer link (before, the holder
//!   spliced the head through and the edge refused it: a 502).
//!
//! The binaries must be built first (`cargo build --workspace --bins`).

mod support;

use std::time::Duration;

use hyper::StatusCode;
use support::{Env, Kubelet};
use tether_tests::process::Proc;

/// The one node: the certificate every [`Env`] mints besides its specs'.
const NODE: &str = "edge-intruder";

/// What both the edge's reset (and so the 502's body) and its log say.
const NAMES_THE_BOUND: &str =
    "(--max-head-bytes, the smaller of the edge's and the cloud's: 4096 bytes)";

/// A cloud with `cloud_args` and one edge with `edge_args` serving pod
/// `default/p1` (its kubelet stand-in returned to be kept), routable.
async fn start(cloud_args: &[&str], edge_args: &[&str]) -> (Env, Kubelet, Proc) {
    let env = Env::start(&[], cloud_args).await.unwrap();
    let kubelet = Kubelet::start(NODE, &["default/p1"]).await.unwrap();
    let edge = env
        .spawn_edge(NODE, &format!("http://{}", kubelet.addr), &[], edge_args)
        .await
        .unwrap();
    env.wait_routable("default/p1").await.unwrap();
    (env, kubelet, edge)
}

/// Waits (10 s at most) for a line of `log()` containing `what`; returns it.
async fn log_line(what: &str, log: impl Fn() -> String) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = log();
        if let Some(l) = text.lines().find(|l| l.contains(what)) {
            return l.to_string();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no log line with {what:?}; the log:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A plain request right after is served, and the edge never reconnected.
async fn served_on(env: &Env, edge: &Proc) {
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
    let connects = edge.connects();
    assert_eq!(
        connects,
        1,
        "the edge reconnected:\n{}",
        edge.stderr_tail(40)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_head_over_the_clouds_bound_is_a_502_naming_it_and_the_edge_serves_on() {
    let (env, _kubelet, edge) = start(&["--max-head-bytes", "4KiB"], &[]).await;

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
    let line = log_line(NAMES_THE_BOUND, || {
        std::fs::read_to_string(edge.log_path()).unwrap_or_default()
    })
    .await;
    for part in [NODE, "head_bytes=", "max_head_bytes=4096"] {
        assert!(line.contains(part), "{part:?} not in {line}");
    }

    // The next request, right after, is served, on the same connection.
    served_on(&env, &edge).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_over_the_edges_bound_is_a_431_naming_it_and_the_edge_serves_on() {
    let (env, _kubelet, edge) = start(&[], &["--max-head-bytes", "4KiB"]).await;

    // 6 KB of header: over the edge's 4 KiB, well within the cloud's 256 KiB
    // (and its 64 KiB --max-http-header-bytes).
    let padding = "a".repeat(6000);
    let r = env
        .client
        .get(
            "/containerLogs/default/p1/c",
            "apiserver.example:6443",
            None,
            &[("x-padding", &padding)],
        )
        .await
        .unwrap();
    assert_eq!(
        r.status,
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        "{}",
        r.body
    );
    assert!(
        r.body
            .contains(&format!("exceeds the head bound agreed with edge {NODE}")),
        "{}",
        r.body
    );
    assert!(r.body.contains(NAMES_THE_BOUND), "{}", r.body);

    // The cloud's log line names the node, the head's size and the bound.
    let line = log_line(NAMES_THE_BOUND, || env.cloud_log()).await;
    for part in [NODE, "head_bytes=", "max_head_bytes=4096"] {
        assert!(line.contains(part), "{part:?} not in {line}");
    }

    // The next request, right after, is served, on the same connection.
    served_on(&env, &edge).await;
}

/// The relayed mirror image: two replicas, the edge (`--max-head-bytes 4KiB`)
/// held by the first; a request through the second, which owns the stream and
/// would relay it, with a 6 KB query: 431 naming the bound agreed with the
/// edge, through the relayed path; the next request there is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_request_head_over_the_edges_bound_is_a_431_naming_it_and_the_next_is_served() {
    use tether_tests::cluster::{sample, Cluster, ClusterSpec, NodeSpec, PodSpec};
    const EDGE: &str = "edge-0";
    const RELAYED: &str = "tether_cloud_route_lookups_total{result=\"relayed\"}";
    let dir = tempfile::tempdir().unwrap();
    let mut spec = ClusterSpec::tunnel(
        vec![NodeSpec {
            name: EDGE.into(),
            pods: vec![PodSpec::new("default", "p0", &["c"])],
        }],
        2,
    );
    spec.edge_args = ["--max-head-bytes", "4KiB"].map(String::from).to_vec();
    let cluster = Cluster::start(&spec, dir.path()).await.unwrap();
    let result = async {
        // The edge is held by replica 0; replica 1 relays.
        let via = cluster.kubelet_apis_for(EDGE)?[1];
        let entry = &cluster.more_clouds[0];
        let relayed = || async {
            let text = entry.ops_get("/metrics").await?;
            Ok::<_, anyhow::Error>(sample(&text, RELAYED).unwrap_or(0.0))
        };
        let before = relayed().await?;
        let path = format!("/containerLogs/default/p0/c?pad={}", "a".repeat(6000));
        let r = cluster.kubelet_get_via(via, EDGE, &path).await?;
        let body = String::from_utf8_lossy(&r.body);
        anyhow::ensure!(
            r.status == StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "{}: {body}",
            r.status
        );
        anyhow::ensure!(
            body.contains(&format!("exceeds the head bound agreed with edge {EDGE}"))
                && body.contains(NAMES_THE_BOUND),
            "the 431 does not name the bound: {body}"
        );
        let after = relayed().await?;
        anyhow::ensure!(
            after == before + 1.0,
            "the request did not take the relayed path ({RELAYED} {before} -> {after})"
        );
        let r = cluster
            .kubelet_get_via(via, EDGE, "/containerLogs/default/p0/c")
            .await?;
        anyhow::ensure!(
            r.status.is_success() && r.node() == Some(EDGE),
            "the next request: {} from {:?}: {}",
            r.status,
            r.node(),
            String::from_utf8_lossy(&r.body)
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let diagnostics = cluster.diagnostics(20);
    cluster.shutdown().await;
    if let Err(e) = result {
        panic!("{e:#}\n{diagnostics}");
    }
}
