//! Issue 17: callers other than the apiserver — metrics-server and Prometheus
//! with a bearer token — are authenticated (TokenReview) and authorised
//! (SubjectAccessReview, the kubelet's attribute mapping) against the
//! apiserver stand-in, as a kubelet does; node-scoped paths still route by the
//! address the caller dialled (`Host`). Reviews are cached (counted at the
//! sim); bad Authorization headers and a stalled apiserver fail only their
//! own request.
//!
//! Needs the binaries built first: `cargo build --workspace --bins`.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper::StatusCode;
use support::{Client, Env, NodeSpec};
use tether_tests::process::{Proc, SpawnOptions};

const KUBECTL: &str = "/usr/lib/google-cloud-sdk/bin/kubectl.1.33";
const MS: &str = "system:serviceaccount:kube-system:metrics-server";

const AUTH: &str = r#"{
  "tokens": [
    {"token": "ms-token", "username": "system:serviceaccount:kube-system:metrics-server",
     "uid": "u-ms", "groups": ["system:serviceaccounts", "system:authenticated"]},
    {"token": "nobody-token", "username": "nobody", "groups": ["system:authenticated"]}
  ],
  "rules": [
    {"name": "system:metrics-server", "user": "system:serviceaccount:kube-system:metrics-server",
     "verbs": ["get"], "resources": ["nodes/metrics", "nodes/stats"]}
  ]
}"#;

fn two() -> Vec<NodeSpec<'static>> {
    vec![
        NodeSpec {
            name: "edge-a",
            pods: &["default/pa"],
            announce: &["10.77.1.1"],
        },
        NodeSpec {
            name: "edge-b",
            pods: &["default/pb"],
            announce: &["10.77.2.1"],
        },
    ]
}

/// apiserver-sim with the tokens and rules above; returns it and its kubeconfig.
async fn start_sim(dir: &Path, extra: &[&str]) -> (Proc, PathBuf) {
    let auth = dir.join("auth.json");
    std::fs::write(&auth, AUTH).unwrap();
    let kubeconfig = dir.join("sim.kubeconfig");
    let mut cmd =
        tokio::process::Command::new(tether_tests::bins::binary("apiserver-sim").unwrap());
    cmd.arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--write-kubeconfig")
        .arg(&kubeconfig)
        .arg("--auth-file")
        .arg(&auth)
        .args(extra);
    let mut sim = Proc::spawn("apiserver-sim", cmd, dir, SpawnOptions::default()).unwrap();
    tether_tests::cluster::wait_kubeconfig(&kubeconfig, &mut sim)
        .await
        .unwrap();
    (sim, kubeconfig)
}

/// The sim's review counters, read with real kubectl.
fn review_counts(kubeconfig: &Path) -> (u64, u64) {
    let out = std::process::Command::new(KUBECTL)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["get", "--raw", "/sim/reviews", "--request-timeout", "10s"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        v["tokenReviews"].as_u64().unwrap(),
        v["subjectAccessReviews"].as_u64().unwrap(),
    )
}

async fn start(sim_extra: &[&str], cloud_extra: &[&str]) -> (Env, Proc, PathBuf) {
    let simdir = tempfile::tempdir().unwrap().keep();
    let (sim, kubeconfig) = start_sim(&simdir, sim_extra).await;
    let kc = kubeconfig.display().to_string();
    let mut args = vec![
        "--authorization-webhook",
        "--authentication-token-webhook",
        "--review-kubeconfig",
        kc.as_str(),
    ];
    args.extend_from_slice(cloud_extra);
    let env = Env::start(&two(), &args).await.unwrap();
    (env, sim, kubeconfig)
}

async fn get(client: &Client, path: &str, host: &str, auth: Option<&str>) -> support::Reply {
    let extra: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
    client.get(path, host, None, &extra).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_server_tokens_are_reviewed_like_a_kubelet_does() {
    let (env, _sim, kubeconfig) = start(&[], &[]).await;
    let ms = Client::without_cert(&env.pki, env.kubelet_api).unwrap();

    // What metrics-server does: GET /metrics/resource on each node's address.
    for _ in 0..3 {
        for (addr, node) in [("10.77.1.1:10350", "edge-a"), ("10.77.2.1:10350", "edge-b")] {
            let r = get(&ms, "/metrics/resource", addr, Some("Bearer ms-token")).await;
            assert_eq!(r.status, StatusCode::OK, "{node}: {}", r.body);
            assert_eq!(r.node(), Some(node));
            // The caller's token never reaches the edge's kubelet.
            assert!(!r.body.contains("ms-token"), "{}", r.body);
        }
    }
    // Allowed for nodes/metrics but not nodes/proxy.
    let r = get(
        &ms,
        "/containerLogs/default/pa/c",
        "10.77.1.1:10350",
        Some("Bearer ms-token"),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert!(
        r.body.contains(&format!("user={MS}")) && r.body.contains("subresource=proxy"),
        "{}",
        r.body
    );

    // Unknown token: 401. Known token without the permission: 403 with the attributes.
    let r = get(
        &ms,
        "/metrics/resource",
        "10.77.1.1:10350",
        Some("Bearer forged"),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{}", r.body);
    assert!(r.body.contains("invalid bearer token"), "{}", r.body);
    for _ in 0..2 {
        let r = get(
            &ms,
            "/metrics/resource",
            "10.77.1.1:10350",
            Some("Bearer nobody-token"),
        )
        .await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
        assert!(
            r.body.contains("user=nobody")
                && r.body.contains("subresource=metrics")
                && r.body.contains("node=edge-a"),
            "{}",
            r.body
        );
    }
    // No credentials at all: 401 (anonymous is off).
    let r = get(&ms, "/metrics/resource", "10.77.1.1:10350", None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{}", r.body);

    // Cached: one TokenReview per distinct token (ms, forged, nobody), one
    // SubjectAccessReview per distinct user/attributes/node (ms on a and b,
    // ms proxy on a, nobody on a).
    assert_eq!(review_counts(&kubeconfig), (3, 4));

    // Bad Authorization headers: 401 with a reason, and the others still work.
    let long = format!("Bearer {}", "x".repeat(9000));
    for (bad, want) in [
        ("Basic dXNlcjpwYXNz", "malformed Authorization header"),
        ("Bearer", "malformed Authorization header"),
        (long.as_str(), "longer than"),
    ] {
        let r = get(&ms, "/metrics/resource", "10.77.1.1:10350", Some(bad)).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{bad:.20}: {}", r.body);
        assert!(r.body.contains(want), "{}", r.body);
    }
    let r = get(
        &ms,
        "/metrics/resource",
        "10.77.2.1:10350",
        Some("Bearer ms-token"),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    // The apiserver's own certificate is served without any review.
    let r = get(&env.client, "/metrics", "edge-a", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(review_counts(&kubeconfig), (3, 4));

    let (_, m) = support::plain_get(env.metrics, "/metrics").await.unwrap();
    for (reason, n) in [("unauthenticated", 5.0), ("forbidden", 3.0)] {
        assert_eq!(
            support::sample(
                &m,
                &format!("tether_cloud_refused_requests_total{{reason=\"{reason}\"}}")
            ),
            Some(n),
            "{reason}: {m}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_review_fails_only_its_own_request() {
    let (env, _sim, _kc) = start(&["--review-delay-ms", "4000"], &["--review-timeout", "1s"]).await;
    let ms = Client::without_cert(&env.pki, env.kubelet_api).unwrap();
    let started = Instant::now();
    let (stalled, apiserver) = tokio::join!(
        get(
            &ms,
            "/metrics/resource",
            "10.77.1.1:10350",
            Some("Bearer ms-token")
        ),
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let t = Instant::now();
            let r = get(&env.client, "/metrics", "edge-b", None).await;
            (r, t.elapsed())
        }
    );
    assert_eq!(
        stalled.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        stalled.body
    );
    assert!(
        stalled.body.contains("--review-timeout"),
        "{}",
        stalled.body
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(apiserver.0.status, StatusCode::OK);
    assert!(
        apiserver.1 < Duration::from_millis(900),
        "{:?}",
        apiserver.1
    );
    let (_, m) = support::plain_get(env.metrics, "/metrics").await.unwrap();
    assert_eq!(
        support::sample(
            &m,
            "tether_cloud_refused_requests_total{reason=\"review_unavailable\"}"
        ),
        Some(1.0),
        "{m}"
    );
}
