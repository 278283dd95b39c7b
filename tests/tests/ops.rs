//! Operations: metrics that move with traffic, health and readiness, the
//! status document, and graceful shutdown of both binaries.

mod support;

use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::StatusCode;
use support::{plain_get, sample, Env, NodeSpec};

const ONE: &[NodeSpec<'static>] = &[NodeSpec {
    name: "edge-1",
    pods: &["default/p1"],
    announce: &["10.77.0.1"],
}];

fn edge_metrics_addr(env: &Env) -> std::net::SocketAddr {
    env.nodes[0]
        .edge
        .lines()
        .iter()
        .find_map(|l| {
            l.strip_prefix("tether-edge started ")
                .and_then(|r| r.split("metrics=").nth(1))
        })
        .expect("edge printed its metrics address")
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_status() {
    let env = Env::start(ONE, &[]).await.unwrap();
    let (s, _) = plain_get(env.metrics, "/healthz").await.unwrap();
    assert_eq!(s, StatusCode::OK);
    let (s, _) = plain_get(env.metrics, "/readyz").await.unwrap();
    assert_eq!(s, StatusCode::OK);
    let (_, before) = plain_get(env.metrics, "/metrics").await.unwrap();
    for name in [
        "tether_cloud_edges_connected",
        "tether_cloud_streams_open",
        "tether_cloud_streams ",
        "tether_cloud_bytes_to_apiserver ",
        "tether_cloud_bytes_to_edge ",
        "tether_cloud_resumes ",
        "tether_cloud_migrations ",
        "tether_cloud_stream_open_seconds",
        "tether_cloud_edge_rtt_seconds",
    ] {
        assert!(before.contains(name), "{name} missing from:\n{before}");
    }
    assert_eq!(sample(&before, "tether_cloud_edges_connected"), Some(1.0));
    let streams_before =
        sample(&before, "tether_cloud_streams_total{kind=\"metrics\"}").unwrap_or(0.0);
    let bytes_before = sample(&before, "tether_cloud_bytes_to_apiserver_total").unwrap_or(0.0);
    for _ in 0..3 {
        let r = env
            .client
            .get("/metrics", "edge-1", None, &[])
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::OK);
    }
    let r = env
        .client
        .get("/metrics", "nowhere", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let (_, after) = plain_get(env.metrics, "/metrics").await.unwrap();
    assert_eq!(
        sample(&after, "tether_cloud_streams_total{kind=\"metrics\"}"),
        Some(streams_before + 3.0),
        "{after}"
    );
    assert!(sample(&after, "tether_cloud_bytes_to_apiserver_total").unwrap() > bytes_before);
    assert!(
        sample(
            &after,
            "tether_cloud_refused_requests_total{reason=\"not_found\"}"
        )
        .unwrap()
            >= 1.0
    );
    assert_eq!(
        sample(&after, "tether_cloud_streams_open{kind=\"metrics\"}"),
        Some(0.0)
    );

    let (s, status) = plain_get(env.metrics, "/status").await.unwrap();
    assert_eq!(s, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    let node = &v["nodes"][0];
    assert_eq!(node["node"], "edge-1");
    assert_eq!(node["connected"], true);
    assert_eq!(node["addresses"][0], "10.77.0.1");
    assert!(node["rtt_ms"].as_f64().is_some());

    let edge = edge_metrics_addr(&env);
    let (s, _) = plain_get(edge, "/readyz").await.unwrap();
    assert_eq!(s, StatusCode::OK);
    let (_, m) = plain_get(edge, "/metrics").await.unwrap();
    assert_eq!(sample(&m, "tether_edge_connected"), Some(1.0), "{m}");
    assert!(
        sample(&m, "tether_edge_streams_total").unwrap() >= 3.0,
        "{m}"
    );
    assert!(
        sample(&m, "tether_edge_bytes_to_cloud_total").unwrap() > 0.0,
        "{m}"
    );
}

/// Threads of process `pid` named as tokio names its runtime's workers.
fn runtime_workers(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim() == "tokio-rt-worker")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_threads_follow_worker_threads() {
    // The edge's default is one; the cloud's is one per available CPU, unless
    // --worker-threads says otherwise. Both serve with what they were given.
    for (flags, cloud_workers) in [
        (vec![], std::thread::available_parallelism().unwrap().get()),
        (vec!["--worker-threads", "3"], 3),
    ] {
        let env = Env::start(ONE, &flags).await.unwrap();
        let r = env
            .client
            .get("/containerLogs/default/p1/c", "edge-1", None, &[])
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::OK, "{flags:?}: {}", r.body);
        assert_eq!(
            runtime_workers(env.cloud.pid().unwrap()),
            cloud_workers,
            "{flags:?}"
        );
        assert_eq!(runtime_workers(env.nodes[0].edge.pid().unwrap()), 1);
    }
}

/// With a short `--shutdown-drain` the edge exits within it (plus a
/// margin) and its close still reaches the cloud.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_sigterm_ends_its_session_at_once() {
    const DRAIN: Duration = Duration::from_millis(300);
    let mut env = Env::start_with(ONE, &[], &["--shutdown-drain", "300ms"], false)
        .await
        .unwrap();
    let resp = env.client.follow_log("default/p1").await.unwrap();
    let mut body = resp.into_body();
    tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let t = Instant::now();
    let status = env.nodes[0].edge.terminate(Duration::from_secs(5)).await;
    let took = t.elapsed();
    assert!(
        status.map(|s| s.success()).unwrap_or(false),
        "edge must exit cleanly on SIGTERM: {status:?}"
    );
    assert!(
        took < DRAIN + Duration::from_secs(1),
        "exited {took:?} after the SIGTERM, --shutdown-drain {DRAIN:?}"
    );
    let outcome = support::body_end(&mut body, Duration::from_secs(10))
        .await
        .expect("stream must end promptly");
    assert!(outcome.is_err(), "cut stream must be an aborted response");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let r = env
        .client
        .get("/containerLogs/default/p1/c", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.body);
    let log = env.cloud_log();
    assert!(
        log.contains("edge shut down; ending its session"),
        "the cloud must see a shutdown, not a lost link: {log}"
    );
    assert!(!log.contains("keeping its streams for a resume"), "{log}");
}

/// `--shutdown-drain` (was a fixed 2 s): on SIGTERM the edge waits at most
/// this for its closed connections to finish. A connection still in its
/// handshake with a cloud that never answers stays closing for three probe
/// timeouts (~2.7 s before any RTT sample, at `--initial-rtt 300ms`), so
/// the drain is what ends the wait: by default the edge exits after ~2 s,
/// with `--shutdown-drain 200ms` well within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_sigterm_waits_at_most_its_shutdown_drain() {
    // The environment's cloud is never dialled: it gives the edge its
    // certificates and command line.
    let env = Env::start(&[], &[]).await.unwrap();
    let pair = &env.pki.edges["edge-intruder"];
    let s = Duration::from_millis;
    for (drain, at_least, below) in [(None, s(1500), s(4000)), (Some("200ms"), s(150), s(1000))] {
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let cloud = silent.local_addr().unwrap().to_string();
        let mut args = vec!["--cloud", &cloud, "--handshake-timeout", "30s"];
        if let Some(d) = drain {
            args.extend(["--shutdown-drain", d]);
        }
        let mut edge = env
            .edge_process(
                "edge-intruder",
                &pair.cert,
                &pair.key,
                "http://127.0.0.1:9",
                &[],
                &args,
            )
            .unwrap();
        // Its first Initial has arrived: a connection is in its handshake.
        silent
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = [0u8; 2048];
        let got = tokio::task::spawn_blocking(move || silent.recv(&mut buf).map(|_| silent))
            .await
            .unwrap();
        let _silent = got.unwrap_or_else(|e| panic!("no Initial within 10 s: {e}"));
        let t = Instant::now();
        let status = edge.terminate(Duration::from_secs(10)).await;
        let took = t.elapsed();
        eprintln!("--shutdown-drain {drain:?}: exited {took:?} after the SIGTERM");
        assert!(
            status.map(|s| s.success()).unwrap_or(false),
            "{drain:?}: the edge must exit cleanly on SIGTERM: {status:?}\n{}",
            edge.stderr_tail(20)
        );
        assert!(
            took >= at_least && took < below,
            "{drain:?}: exited {took:?} after the SIGTERM, expected {at_least:?} to {below:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_sigterm_moves_edges_then_drains_its_streams() {
    let mut env = Env::start(ONE, &["--shutdown-grace", "2s"]).await.unwrap();
    // A follow stream this replica owns outlives the drain.
    let resp = env.client.follow_log("default/p1").await.unwrap();
    let mut body = resp.into_body();
    tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let t = Instant::now();
    let terminate = {
        let cloud = &mut env.cloud;
        cloud.terminate(Duration::from_secs(10))
    };
    // The apiserver's side of the stream this replica owns ends with an error once
    // --shutdown-grace has run out: never a clean-looking end.
    let (status, outcome) = tokio::join!(
        terminate,
        support::body_end(&mut body, Duration::from_secs(10))
    );
    let took = t.elapsed();
    assert!(
        status.map(|s| s.success()).unwrap_or(false),
        "cloud must exit cleanly: {status:?}"
    );
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(8),
        "drained for {took:?}"
    );
    let outcome = outcome.expect("the follow stream must end within 10 s of the SIGTERM");
    assert!(
        outcome.is_err(),
        "a stream whose owner shut down must end as an aborted response"
    );
    let log = env.cloud_log();
    assert!(log.contains("draining open streams"), "{log}");
    assert!(log.contains("edges told to move"), "{log}");
    // The edge was told to move at once (its streams move with it to whichever
    // replica it reaches) and took the close for that, not for a lost link.
    let edge = &mut env.nodes[0].edge;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = false;
    while !seen && Instant::now() < deadline {
        let l = std::fs::read_to_string(edge.log_path()).unwrap();
        seen = l.contains("the cloud replica is draining and told this edge to move");
        if !seen {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert!(
        seen,
        "edge must take the close for a move: {}",
        std::fs::read_to_string(edge.log_path()).unwrap()
    );
}

/// `--shutdown-close-wait` bounds how long a replica on SIGTERM waits for its
/// closed edge connections to finish closing. The edge is cut off (its relay
/// drops every packet), so nothing it sends ends a close early: given `0s`
/// the replica exits at once and says how many were still closing; given the
/// default (2 s) quinn's three probe timeouts on loopback end first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_close_wait_bounds_the_wait_for_closed_connections() {
    for (close_wait, cut_short) in [(Some("0s"), true), (None, false)] {
        let mut args = vec!["--shutdown-grace", "0s"];
        if let Some(w) = close_wait {
            args.extend(["--shutdown-close-wait", w]);
        }
        let mut env = Env::start_with(ONE, &args, &[], true).await.unwrap();
        env.relay.as_ref().unwrap().set_outage(true);
        let status = env.cloud.terminate(Duration::from_secs(20)).await;
        let log = env.cloud_log();
        assert!(
            status.map(|s| s.success()).unwrap_or(false),
            "cloud must exit cleanly ({close_wait:?}): {status:?}\n{log}"
        );
        assert!(log.contains("shut down"), "{log}");
        let line = log
            .lines()
            .find(|l| l.contains("edge connections still closing after --shutdown-close-wait"));
        match line {
            Some(l) if cut_short => assert!(l.contains("connections=1"), "{l}"),
            None if !cut_short => {}
            _ => panic!("close wait {close_wait:?}: cut short {cut_short} expected\n{log}"),
        }
    }
}

#[test]
fn configuration_file_env_and_flags_with_precedence_and_rejection() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cloud.toml");
    std::fs::write(
        &file,
        "grace = \"7m\"\nresponse-timeout = \"9s\"\nkeep-alive = \"5s\"\n",
    )
    .unwrap();
    let base = [
        "--tunnel-cert",
        "a",
        "--tunnel-key",
        "b",
        "--edge-ca",
        "c",
        "--kubelet-cert",
        "d",
        "--kubelet-key",
        "e",
    ];
    let cloud = tether_tests::bins::binary("tether-cloud").unwrap();
    let out = std::process::Command::new(&cloud)
        .arg("--config")
        .arg(&file)
        .args(base)
        .args([
            "--insecure-skip-client-auth",
            "--print-config",
            "--keep-alive",
            "4s",
        ])
        .env("TETHER_GRACE", "6m")
        .env_remove("TETHER_RESPONSE_TIMEOUT")
        .env_remove("TETHER_KEEP_ALIVE")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("keep-alive = \"4s\"  # flag"),
        "flag beats all: {text}"
    );
    assert!(text.contains("grace = \"6m\""), "env beats file: {text}");
    assert!(
        text.contains("response-timeout = \"9s\""),
        "file beats default: {text}"
    );
    assert!(
        text.contains("handshake-timeout = \"10s\"  # default"),
        "{text}"
    );
    // Invalid values are rejected at start, naming the setting.
    std::fs::write(&file, "grace = \"ten minutes\"\n").unwrap();
    let out = std::process::Command::new(&cloud)
        .arg("--config")
        .arg(&file)
        .args(base)
        .arg("--insecure-skip-client-auth")
        .env_remove("TETHER_GRACE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--grace"), "{err}");
    std::fs::write(&file, "gracee = \"1m\"\n").unwrap();
    let out = std::process::Command::new(&cloud)
        .arg("--config")
        .arg(&file)
        .args(base)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown setting \"gracee\""));
    // A keep-alive not below the idle timeout is rejected by name.
    let out = std::process::Command::new(&cloud)
        .args(base)
        .args([
            "--insecure-skip-client-auth",
            "--keep-alive",
            "200s",
            "--print-config",
        ])
        .env_remove("TETHER_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("keep-alive"));
}

/// `bin --print-config` with `args`, nothing from the environment: its output.
fn print_config(bin: &str, args: &[&str]) -> String {
    let path = tether_tests::bins::binary(bin).unwrap();
    let out = std::process::Command::new(&path)
        .args(args)
        .arg("--print-config")
        .env_clear()
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{bin} {args:?} --print-config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The settings `--print-config` shows with a value, as `key = value` lines
/// (the comment saying where each came from cut off), redacted ones left out.
fn shown_settings(printed: &str) -> Vec<String> {
    printed
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains("<redacted>"))
        .map(|l| l.rsplit_once("  # ").map_or(l, |(kv, _)| kv).to_string())
        .collect()
}

/// `--print-config`'s output is a configuration file for both binaries: given back
/// through `--config`, with no flag and no environment, every setting it showed comes
/// back with the same value, now from the file. The first print sets values of every
/// kind away from their defaults by flag (an address, a duration, a count, a size, a
/// switch, a list, a name), so a setting the file could not carry, or could only carry
/// changed (one without an environment variable, a value printed in a form its parser
/// refuses), fails here.
#[test]
fn print_config_output_round_trips_through_a_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let edge = [
        "--cloud",
        "127.0.0.1:1",
        "--ca",
        "a",
        "--cert",
        "b",
        "--key",
        "c",
        "--kubelet-url",
        "https://127.0.0.1:10250",
        "--kubelet-insecure-skip-tls-verify",
        "--announce-address",
        "10.0.0.1",
        "--announce-address",
        "10.0.0.2",
        "--copy-hello-tries",
        "3",
        "--copy-hello-resend",
        "250ms",
        "--max-data-payload",
        "16KiB",
        "--log-format",
        "json",
    ];
    let cloud = [
        "--tunnel-cert",
        "a",
        "--tunnel-key",
        "b",
        "--edge-ca",
        "c",
        "--kubelet-cert",
        "d",
        "--kubelet-key",
        "e",
        "--insecure-skip-client-auth",
        "--peer-listen",
        "0.0.0.0:7000",
        "--peer-cert",
        "f",
        "--peer-key",
        "g",
        "--peer-ca",
        "h",
        "--peers",
        "10.0.0.1:7000,10.0.0.2:7000",
        "--replica-name",
        "r0",
        "--renewal-min-interval",
        "1h",
        "--max-edges",
        "5",
        "--peer-copy-hello-resend",
        "300ms",
        "--join-max-message-bytes",
        "2KiB",
        "--join-store-lock-wait",
        "250ms",
    ];
    for (bin, args) in [("tether-edge", &edge[..]), ("tether-cloud", &cloud[..])] {
        let first = print_config(bin, args);
        let settings = shown_settings(&first);
        for flag in args.iter().filter_map(|a| a.strip_prefix("--")) {
            assert!(
                settings
                    .iter()
                    .any(|s| s.starts_with(&format!("{flag} = "))),
                "{bin}: --{flag} set by flag is not shown: {first}"
            );
        }
        let file = dir.path().join(format!("{bin}.toml"));
        std::fs::write(&file, settings.join("\n") + "\n").unwrap();
        let again = print_config(bin, &["--config", file.to_str().unwrap()]);
        assert_eq!(
            shown_settings(&again),
            settings,
            "{bin}: the printed configuration given back as a file"
        );
        for line in again.lines().filter(|l| !l.starts_with('#')) {
            assert!(
                line.ends_with("  # env or file") || line.contains("<redacted>"),
                "{bin}: {line:?} is not from the file"
            );
        }
    }
}

/// Without an apiserver to watch, the cloud refuses to start unless told to
/// route by edge reports (`--insecure-trust-edge-reports`, warned about);
/// with a kubeconfig whose apiserver does not answer, it gives up after
/// `--apiserver-sync-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_without_an_apiserver_refuses_to_start_unless_opted_in() {
    use tether_tests::process::{Proc, SpawnOptions};
    let dir = tempfile::tempdir().unwrap();
    let pki = tether_tests::pki::mint(dir.path(), &["edge-1"]).unwrap();
    let cloud = tether_tests::bins::binary("tether-cloud").unwrap();
    // Without the opt-in to route by edge reports.
    let flags = pki.cloud_cert_flags();
    let common = |cmd: &mut std::process::Command| {
        cmd.args(&flags)
            .args(tether_tests::LOOPBACK_LISTENS)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            .env_remove("TETHER_INSECURE_TRUST_EDGE_REPORTS")
            .env_remove("TETHER_APISERVER_KUBECONFIG")
            .env("NO_COLOR", "1");
    };
    let mut cmd = std::process::Command::new(&cloud);
    common(&mut cmd);
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without an apiserver: {err}");
    assert!(err.contains("--insecure-trust-edge-reports"), "{err}");
    assert!(err.contains("--apiserver-kubeconfig"), "{err}");

    // An apiserver that never answers: a bound port nobody accepts on.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        tether_tests::pki::token_kubeconfig(&format!("https://{}", silent.local_addr().unwrap())),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(&cloud);
    common(&mut cmd);
    cmd.arg("--apiserver-kubeconfig")
        .arg(&kubeconfig)
        .args(["--apiserver-sync-timeout", "2s"]);
    let started = std::time::Instant::now();
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started without pods and nodes: {err}"
    );
    assert!(err.contains("within 2s"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20));

    // The opt-in: it starts, and says what it gave up.
    let mut cmd = tokio::process::Command::new(&cloud);
    cmd.args(&flags)
        .args(tether_tests::LOOPBACK_LISTENS)
        .args(["--insecure-trust-edge-reports"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("NO_COLOR", "1");
    let mut proc = Proc::spawn("tether-cloud", cmd, dir.path(), SpawnOptions::default()).unwrap();
    proc.wait_line("ready line", std::time::Duration::from_secs(20), |l| {
        l.starts_with("tether-cloud ready")
    })
    .await
    .unwrap();
    let log = std::fs::read_to_string(proc.log_path()).unwrap();
    assert!(
        log.contains("--insecure-trust-edge-reports: routing by what edges report"),
        "{log}"
    );
}
