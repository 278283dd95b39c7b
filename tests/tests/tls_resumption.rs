//! TLS session resumption on the edge listener: a real `tether-edge` resumes
//! its TLS session on a restarted cloud that shares the replicas' secret
//! (`--reset-key-file`), makes a full handshake with one that does not, and
//! is refused when its certificate lapsed after the ticket was sealed.

mod support;

use std::time::{Duration, Instant};

use support::{plain_get, sample, Env, Kubelet, NodeSpec};

const ONE: &[NodeSpec<'static>] = &[NodeSpec {
    name: "edge-1",
    pods: &["default/p1"],
    announce: &["10.77.0.1"],
}];

/// Edges reconnect at once after a restart (no `--reconnect-spread` wait).
const EDGE: &[&str] = &["--reconnect-spread", "0s"];

fn secret_file(dir: &std::path::Path, name: &str) -> String {
    let hex: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, hex).unwrap();
    path.display().to_string()
}

/// A cloud with the shared secret in `secret_file` and eight tickets per
/// handshake, and edges for `specs`. An edge spends a ticket per attempt,
/// also on those the stopping cloud refuses, and must have one left when the
/// new cloud is up (with the default one it may not: then a full handshake).
async fn with_tickets(specs: &[NodeSpec<'_>], secret_file: &str) -> Env {
    Env::start_with(
        specs,
        &[
            "--reset-key-file",
            secret_file,
            "--tls-tickets-per-handshake",
            "8",
        ],
        EDGE,
        false,
    )
    .await
    .unwrap()
}

/// The new cloud's completed edge handshakes: (full, resumed).
async fn handshakes(env: &Env) -> (f64, f64) {
    let (_, text) = plain_get(env.metrics, "/metrics").await.unwrap();
    let kind = |k: &str| {
        sample(
            &text,
            &format!("tether_cloud_edge_tls_handshakes_total{{kind=\"{k}\"}}"),
        )
        .unwrap_or(0.0)
    };
    (kind("full"), kind("resumed"))
}

async fn reconnected(env: &mut Env) {
    env.nodes[0]
        .edge
        .wait_connected("edge reconnects", Duration::from_secs(30))
        .await
        .unwrap();
    env.wait_routable("default/p1").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_cloud_with_the_shared_secret_resumes_the_edges_tls_session() {
    let keys = tempfile::tempdir().unwrap();
    let shared = secret_file(keys.path(), "reset.key");
    let mut env = with_tickets(ONE, &shared).await;
    assert_eq!(handshakes(&env).await, (1.0, 0.0), "the first is full");

    // Same secret: the edge's tickets open; its certificate is the ticket's.
    env.restart_cloud("tether-cloud-2", &[]).await.unwrap();
    reconnected(&mut env).await;
    let (full, resumed) = handshakes(&env).await;
    assert!(
        full == 0.0 && resumed >= 1.0,
        "full {full}, resumed {resumed}: {}",
        env.cloud_log()
    );
    let r = env
        .client
        .get("/containerLogs/default/p1/c", "10.96.0.1:6443", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, hyper::StatusCode::OK, "{}", r.body);

    // Another secret (a replica not given the shared one): a full handshake.
    let other = secret_file(keys.path(), "other.key");
    for a in env.cloud_args.iter_mut() {
        if *a == shared {
            *a = other.clone();
        }
    }
    // (The full handshake gives it tickets of this cloud, so a later
    // attempt, if any, may resume.)
    env.restart_cloud("tether-cloud-3", &[]).await.unwrap();
    reconnected(&mut env).await;
    let (full, resumed) = handshakes(&env).await;
    assert!(
        full >= 1.0,
        "full {full}, resumed {resumed}: {}",
        env.cloud_log()
    );

    // Tickets off: no session resumes, though the edge holds tickets sealed
    // under this cloud's secret (the previous cloud's).
    env.restart_cloud("tether-cloud-4", &["--tls-ticket-lifetime", "0s"])
        .await
        .unwrap();
    reconnected(&mut env).await;
    let (full, resumed) = handshakes(&env).await;
    assert!(
        full >= 1.0 && resumed == 0.0,
        "full {full}, resumed {resumed}: {}",
        env.cloud_log()
    );
}

/// A ticket carries the certificate the full handshake verified; the cloud
/// checks its validity period again at every connection, so an edge whose
/// certificate expired since is refused even though its ticket still opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_session_whose_certificate_expired_since_is_refused() {
    let keys = tempfile::tempdir().unwrap();
    let shared = secret_file(keys.path(), "reset.key");
    let mut env = with_tickets(&[], &shared).await;
    let valid_for = Duration::from_secs(8);
    let issued = Instant::now();
    let pair =
        tether_tests::pki::issue_edge(env.dir.path(), "edge-short", "edge-2", valid_for).unwrap();
    let kubelet = Kubelet::start("edge-2", &["default/p2"]).await.unwrap();
    let mut edge = env
        .edge_process(
            "edge-2",
            &pair.cert,
            &pair.key,
            &format!("http://{}", kubelet.addr),
            &[],
            &[],
        )
        .unwrap();
    edge.wait_connected("edge connected", Duration::from_secs(20))
        .await
        .unwrap();
    env.wait_routable("default/p2").await.unwrap();

    // The certificate expires (certificate times have one-second precision).
    tokio::time::sleep((valid_for + Duration::from_secs(2)).saturating_sub(issued.elapsed())).await;
    env.restart_cloud("tether-cloud-2", &[]).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !env
        .cloud_log()
        .contains("refusing node edge-2: the certificate expired")
    {
        assert!(
            Instant::now() < deadline,
            "the lapsed certificate was not refused: {}\nedge: {}",
            env.cloud_log(),
            edge.stderr_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, text) = plain_get(env.metrics, "/metrics").await.unwrap();
    let resumed = sample(
        &text,
        "tether_cloud_edge_tls_handshakes_total{kind=\"resumed\"}",
    );
    assert!(resumed >= Some(1.0), "{text}");
    assert!(
        sample(
            &text,
            "tether_cloud_edges_refused_total{reason=\"certificate_lapsed\"}"
        ) >= Some(1.0),
        "{text}"
    );
    let connected = edge.connects();
    assert_eq!(
        connected,
        1,
        "an expired certificate must not connect again: {:?}",
        edge.lines()
    );
    drop(kubelet);
}
