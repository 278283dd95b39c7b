//! Issue 17: callers other than the apiserver — metrics-server and Prometheus
//! with a bearer token — are authenticated (TokenReview) and authorised
//! (SubjectAccessReview, the kubelet's attribute mapping) against the
//! apiserver stand-in, as a kubelet does; node-scoped paths still route by the
//! address the caller dialled (`Host`). Reviews are cached (counted at the
//! sim); bad Authorization headers and a stalled apiserver fail only their
//! own request.
//!
//! Debian's Prometheus scrapes two edge nodes' `/metrics` and `/metrics/cadvisor`
//! through Tether both ways a cluster does: through the apiserver's node proxy, and
//! directly at the node's address with a bearer token file (an HTTP CONNECT proxy in
//! the test stands in for the DNAT of the node status port: the cloud sees exactly
//! what it would, a TLS connection whose `Host` is the node's address).
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
    {"token": "nobody-token", "username": "nobody", "groups": ["system:authenticated"]},
    {"token": "prom-token", "username": "system:serviceaccount:monitoring:prometheus",
     "groups": ["system:serviceaccounts", "system:authenticated"]}
  ],
  "rules": [
    {"name": "prometheus", "user": "system:serviceaccount:monitoring:prometheus",
     "verbs": ["get"], "resources": ["nodes/metrics"]},
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

/// An HTTP CONNECT proxy that sends every tunnel to `to`, whatever address the
/// client asked for — what the DNAT of the node status port does to a scraper's
/// connection. Returns its address and the addresses clients asked for.
async fn connect_proxy(
    to: std::net::SocketAddr,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = asked.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
                    if client.read_exact(&mut b).await.is_err() {
                        return;
                    }
                    head.push(b[0]);
                }
                let text = String::from_utf8_lossy(&head).to_string();
                let Some(target) = text
                    .strip_prefix("CONNECT ")
                    .and_then(|r| r.split_whitespace().next())
                else {
                    let _ = client
                        .write_all(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                        .await;
                    return;
                };
                seen.lock().unwrap().push(target.to_string());
                let Ok(mut upstream) = tokio::net::TcpStream::connect(to).await else {
                    let _ = client.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await;
                    return;
                };
                if client
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await
                    .is_ok()
                {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    });
    (addr, asked)
}

/// A free TCP port on loopback, below the ephemeral range (see `tether_tests::ports`).
fn free_tcp_port() -> u16 {
    tether_tests::ports::free_loopback(tether_tests::ports::Proto::Tcp)
        .unwrap()
        .port()
}

/// Every target of Prometheus's `/api/v1/targets`: (job, instance, health, last error).
async fn targets(prom: std::net::SocketAddr) -> Vec<(String, String, String, String)> {
    let Ok((_, body)) = support::plain_get(prom, "/api/v1/targets").await else {
        return Vec::new();
    };
    let Some(body) = body
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .or(Some(body))
    else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["activeTargets"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    let s = |k: &str| t[k].as_str().unwrap_or_default().to_string();
                    (
                        t["labels"]["job"].as_str().unwrap_or_default().to_string(),
                        t["labels"]["instance"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string(),
                        s("health"),
                        s("lastError"),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_edge_nodes_through_the_apiserver_and_directly() {
    let prometheus = std::path::Path::new("/usr/bin/prometheus");
    assert!(
        prometheus.exists(),
        "Debian's prometheus is required (scripts/setup.sh installs it)"
    );
    let (env, _review_sim, kubeconfig) = start(&[], &[]).await;
    let dir = tempfile::tempdir().unwrap();

    // The apiserver, whose node proxy Prometheus uses: it dials the cloud for
    // the nodes' addresses, with the apiserver's kubelet-client certificate.
    let proxy_kubeconfig = dir.path().join("proxy.kubeconfig");
    let mut cmd =
        tokio::process::Command::new(tether_tests::bins::binary("apiserver-sim").unwrap());
    cmd.arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--write-kubeconfig")
        .arg(&proxy_kubeconfig)
        .arg("--kubelet-client-cert")
        .arg(&env.pki.apiserver_client.cert)
        .arg("--kubelet-client-key")
        .arg(&env.pki.apiserver_client.key)
        // The nodes' addresses are IPs the cloud's test certificate does not name:
        // like a kube-apiserver without --kubelet-certificate-authority.
        .args(["--node", "edge-a=10.77.1.1:10350"])
        .args(["--node", "edge-b=10.77.2.1:10350"])
        .arg("--kubelet-dial")
        .arg(env.kubelet_api.to_string());
    let mut sim = Proc::spawn("apiserver-proxy", cmd, dir.path(), SpawnOptions::default()).unwrap();
    let server = tether_tests::cluster::wait_kubeconfig(&proxy_kubeconfig, &mut sim)
        .await
        .unwrap();
    let server = server.trim_start_matches("https://").to_string();

    let (proxy, asked) = connect_proxy(env.kubelet_api).await;
    let token = dir.path().join("token");
    std::fs::write(&token, "prom-token").unwrap();
    let web = std::net::SocketAddr::from(([127, 0, 0, 1], free_tcp_port()));
    let mut jobs = String::new();
    for (job, path) in [("metrics", "/metrics"), ("cadvisor", "/metrics/cadvisor")] {
        jobs.push_str(&format!(
            r#"
  - job_name: apiserver-proxy-{job}
    scheme: https
    authorization: {{ credentials: apiserver-sim-token }}
    tls_config: {{ insecure_skip_verify: true }}
    static_configs:
      - targets: ["{server}"]
        labels: {{ node: edge-a, __metrics_path__: /api/v1/nodes/edge-a/proxy{path} }}
      - targets: ["{server}"]
        labels: {{ node: edge-b, __metrics_path__: /api/v1/nodes/edge-b/proxy{path} }}
  - job_name: direct-{job}
    scheme: https
    metrics_path: {path}
    proxy_url: http://{proxy}
    authorization: {{ credentials_file: {token} }}
    tls_config: {{ ca_file: {ca}, server_name: localhost }}
    static_configs:
      - targets: ["10.77.1.1:10350", "10.77.2.1:10350"]
"#,
            token = token.display(),
            ca = env.pki.tether_ca.display(),
        ));
    }
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:{jobs}"),
    )
    .unwrap();
    let mut cmd = tokio::process::Command::new(prometheus);
    cmd.arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={web}"));
    let mut prom = Proc::spawn("prometheus", cmd, dir.path(), SpawnOptions::default()).unwrap();

    // All eight targets up within a bound.
    let deadline = Instant::now() + Duration::from_secs(45);
    let ts = loop {
        let ts = targets(web).await;
        if ts.len() == 8 && ts.iter().all(|t| t.2 == "up") {
            break ts;
        }
        assert!(
            Instant::now() < deadline && prom.exited().is_none(),
            "not every target up: {ts:?}\nprometheus: {}\ncloud: {}",
            prom.stderr_tail(20),
            env.cloud_log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("targets: {ts:?}");

    // The scraped series, read back: each node's own metrics under each job.
    for (series, node_label) in [
        ("node_name", "node"),
        ("container_cpu_usage_seconds_total", "node"),
    ] {
        let path = format!("/api/v1/query?query={series}");
        let (_, body) = support::plain_get(web, &path).await.unwrap();
        let body = body.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or(&body);
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        let mut got: Vec<(String, String, String)> = v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let l = |k: &str| r["metric"][k].as_str().unwrap_or_default().to_string();
                // The series' own label (from the kubelet) and the job/instance.
                // The kubelet's own `node` label (renamed `exported_node` where the
                // target carries a `node` label of its own).
                let own = match l(&format!("exported_{node_label}")) {
                    e if e.is_empty() => l(node_label),
                    e => e,
                };
                (l("job"), l("instance"), own)
            })
            .collect();
        got.sort();
        let job = if series == "node_name" {
            "metrics"
        } else {
            "cadvisor"
        };
        let want = vec![
            (
                format!("apiserver-proxy-{job}"),
                server.clone(),
                "edge-a".to_string(),
            ),
            (
                format!("apiserver-proxy-{job}"),
                server.clone(),
                "edge-b".to_string(),
            ),
            (
                format!("direct-{job}"),
                "10.77.1.1:10350".to_string(),
                "edge-a".to_string(),
            ),
            (
                format!("direct-{job}"),
                "10.77.2.1:10350".to_string(),
                "edge-b".to_string(),
            ),
        ];
        let mut want = want;
        want.sort();
        assert_eq!(got, want, "{series}: {body}");
    }
    // The direct scrapes dialled the nodes' addresses (through the "DNAT") and were
    // reviewed like a kubelet's callers: one TokenReview for the token, one
    // SubjectAccessReview per node (cached after that).
    let asked = asked.lock().unwrap().clone();
    assert!(asked.iter().any(|a| a == "10.77.1.1:10350"), "{asked:?}");
    assert!(asked.iter().any(|a| a == "10.77.2.1:10350"), "{asked:?}");
    let (tokens, sars) = review_counts(&kubeconfig);
    assert_eq!((tokens, sars), (1, 2), "reviews are cached");
    prom.terminate(Duration::from_secs(5)).await;
    sim.terminate(Duration::from_secs(5)).await;
}
