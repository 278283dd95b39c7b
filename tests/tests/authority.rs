//! The apiserver is the routing authority: `tether-cloud` watches pods and
//! nodes on `apiserver-sim` (list, then watch; re-list after `410 Gone`), and an
//! edge that claims another node's pod or address is refused, logged with both
//! nodes and counted, while the real owner still gets the requests.

mod support;

use std::time::{Duration, Instant};

use hyper::StatusCode;
use support::{plain_get, sample, Env, NodeSpec};
use tether_tests::bins;
use tether_tests::process::{Proc, SpawnOptions};

/// Starts apiserver-sim with `args` and returns it with its kubeconfig.
async fn apiserver(dir: &std::path::Path, args: &[&str]) -> (Proc, std::path::PathBuf) {
    let kubeconfig = dir.join("kubeconfig");
    let mut cmd = tokio::process::Command::new(bins::binary(bins::APISERVER_SIM).unwrap());
    cmd.args(["--listen", "127.0.0.1:0", "--write-kubeconfig"])
        .arg(&kubeconfig)
        .args(args);
    let proc = Proc::spawn("apiserver-sim", cmd, dir, SpawnOptions::default()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !kubeconfig.exists() {
        assert!(
            Instant::now() < deadline,
            "apiserver-sim wrote no kubeconfig"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (proc, kubeconfig)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_another_nodes_pod_or_address_are_refused_and_watches_recover() {
    let dir = tempfile::tempdir().unwrap();
    // Watches end every 2 s; at 4 s the cluster's resourceVersion is compacted,
    // so the cloud's next watch gets 410 Gone and must list again.
    let (_sim, kubeconfig) = apiserver(
        dir.path(),
        &[
            "--node",
            "edge-a=10.0.0.1",
            "--node",
            "edge-b=10.0.0.2",
            "--pod",
            "default/p1=edge-a:c",
            "--pod",
            "default/p2=edge-b:c",
            "--watch-timeout-secs",
            "2",
            "--compact-after-secs",
            "4",
        ],
    )
    .await;
    let kc = kubeconfig.to_str().unwrap();
    let env = Env::start(
        &[
            NodeSpec {
                name: "edge-a",
                pods: &["p1"],
                announce: &["10.0.0.1"],
            },
            // edge-b's kubelet says it runs p1 too, and it announces edge-a's address.
            NodeSpec {
                name: "edge-b",
                pods: &["p1", "p2"],
                announce: &["10.0.0.1", "10.0.0.2"],
            },
        ],
        &["--apiserver-kubeconfig", kc],
    )
    .await
    .unwrap();

    let route = |path: &'static str, host: &'static str| {
        let client = &env.client;
        async move {
            let r = client.get(path, host, None, &[]).await.unwrap();
            (r.status, r.node().map(str::to_string), r.body)
        }
    };
    let check = || async {
        for _ in 0..5 {
            let (s, node, body) = route("/containerLogs/default/p1/c", "apiserver.example").await;
            assert_eq!(
                (s, node.as_deref()),
                (StatusCode::OK, Some("edge-a")),
                "{body}"
            );
        }
        let (s, node, body) = route("/containerLogs/default/p2/c", "apiserver.example").await;
        assert_eq!(
            (s, node.as_deref()),
            (StatusCode::OK, Some("edge-b")),
            "{body}"
        );
        let (s, node, body) = route("/metrics", "10.0.0.1:10250").await;
        assert_eq!(
            (s, node.as_deref()),
            (StatusCode::OK, Some("edge-a")),
            "{body}"
        );
        let (s, node, body) = route("/metrics", "10.0.0.2:10250").await;
        assert_eq!(
            (s, node.as_deref()),
            (StatusCode::OK, Some("edge-b")),
            "{body}"
        );
    };
    check().await;

    // Refused, counted (once per claim, not once per report) and logged with both nodes.
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let (_, text) = plain_get(env.metrics, "/metrics").await.unwrap();
        if sample(&text, "tether_cloud_claims_refused_total{kind=\"pod\"}").is_some() {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no refused pod claim counted: {text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    tokio::time::sleep(Duration::from_secs(1)).await; // several more reports of edge-b
    let (_, text) = plain_get(env.metrics, "/metrics").await.unwrap();
    assert_eq!(
        sample(&text, "tether_cloud_claims_refused_total{kind=\"pod\"}"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(&text, "tether_cloud_claims_refused_total{kind=\"address\"}"),
        Some(1.0),
        "{text}"
    );
    let log = env.cloud_log();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refusing an edge's"))
        .collect();
    assert_eq!(refusals.len(), 2, "{log}");
    assert!(
        refusals
            .iter()
            .all(|l| l.contains("node=edge-b") && l.contains("owner=edge-a")),
        "{refusals:?}"
    );
    assert!(refusals.iter().any(|l| l.contains("claim=default/p1")));
    assert!(refusals.iter().any(|l| l.contains("claim=10.0.0.1")));

    // The watches end and resume; after the compaction the resume gets 410 Gone
    // and the cloud lists again. Routing holds throughout.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = env.cloud_log();
        let lists = log.matches("listed pods from the apiserver").count();
        let node_lists = log.matches("listed nodes from the apiserver").count();
        if lists >= 2 && node_lists >= 2 {
            assert!(log.contains("410") || log.contains("Expired"), "{log}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cloud never listed again after 410 Gone: {log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    check().await;
}

/// An apiserver that takes the connections and requests of the pod and
/// node lists and never answers: with `--apiserver-read-timeout 300ms`,
/// each list fails after it, is logged naming the flag and is asked again,
/// until `--apiserver-sync-timeout` gives up the start. With the fixed 300 s
/// bound the lists waited the whole sync timeout without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_apiserver_fails_each_read_after_the_apiserver_read_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let pki = tether_tests::pki::mint(dir.path(), &["edge-1"]).unwrap();
    // A bound port nobody accepts on: the kernel takes the connection and
    // the request, and nothing answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        tether_tests::pki::token_kubeconfig(&format!("http://{}", silent.local_addr().unwrap())),
    )
    .unwrap();
    let flags = pki.cloud_cert_flags();
    let mut cmd = std::process::Command::new(bins::binary("tether-cloud").unwrap());
    cmd.args(&flags)
        .args(tether_tests::LOOPBACK_LISTENS)
        .args([
            "--apiserver-sync-timeout",
            "4s",
            "--apiserver-read-timeout",
            "300ms",
        ])
        .arg("--apiserver-kubeconfig")
        .arg(&kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("TETHER_INSECURE_TRUST_EDGE_REPORTS")
        .env("NO_COLOR", "1");
    let started = Instant::now();
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started without pods and nodes: {err}"
    );
    assert!(started.elapsed() < Duration::from_secs(40), "{err}");
    // The shorter bound is warned about at start.
    assert!(
        err.contains("--apiserver-read-timeout is below 295s"),
        "{err}"
    );
    // Both lists timed out on the read, each named the flag.
    for what in ["pods", "nodes"] {
        let timed_out = format!(
            "watching {what}: no answer from the apiserver within 300ms (--apiserver-read-timeout)"
        );
        assert!(err.contains(&timed_out), "no {timed_out:?} in: {err}");
    }
    assert!(err.contains("within 4s"), "{err}");
    drop(silent);
}
