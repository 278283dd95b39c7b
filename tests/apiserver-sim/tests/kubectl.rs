//! End-to-end tests of apiserver-sim with real kubectl 1.28 (SPDY) and 1.33 (WebSocket)
//! against a fake kubelet: discovery + get, logs, nodes/proxy, and what the kubelet sees
//! for exec / port-forward upgrades (path, query, Host, X-Forwarded-For, SNI, client cert).
//! Missing kubectl binaries fail the tests.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use rustls::pki_types::ServerName;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::Message;

const T: Duration = Duration::from_secs(30);

async fn ip_fixture() -> (Pki, FakeKubelet, Apiserver) {
    ip_fixture_with(&[]).await
}

/// [`ip_fixture`] with extra apiserver-sim flags.
async fn ip_fixture_with(extra: &[&str]) -> (Pki, FakeKubelet, Apiserver) {
    let pki = pki();
    let kubelet = FakeKubelet::start(&pki).await;
    let mut args = vec![
        "--node".to_string(),
        format!("edge-1=127.0.0.1:{}", kubelet.port),
        "--pod".into(),
        "default/p1=edge-1:c1".into(),
        "--pod".into(),
        "default/gone=edge-1:c1".into(),
        "--pod".into(),
        "default/multi=edge-1:a,b".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let api = Apiserver::start(&pki, &args).await;
    (pki, kubelet, api)
}

fn assert_ok(what: &str, run: &KubectlRun) {
    assert!(
        run.success,
        "{what} failed (timed out: {}):\nstdout: {}\nstderr: {}",
        run.timed_out, run.stdout, run.stderr
    );
}

/// Checks shared by both kubectl versions: get, logs, nodes/proxy, errors.
async fn common_flows(kubectl: &str, kubelet: &FakeKubelet, api: &Apiserver) {
    let run = api
        .kubectl(kubectl, &["get", "pod", "p1", "-o", "json"], T)
        .await;
    assert_ok("get pod", &run);
    let pod: serde_json::Value = serde_json::from_str(&run.stdout).expect("pod JSON");
    assert_eq!(pod["metadata"]["name"], "p1");
    assert_eq!(pod["spec"]["nodeName"], "edge-1");
    assert_eq!(pod["spec"]["containers"][0]["name"], "c1");
    assert_eq!(pod["status"]["phase"], "Running");

    let run = api.kubectl(kubectl, &["get", "pods"], T).await;
    assert_ok("get pods", &run);
    assert!(
        run.stdout
            .lines()
            .any(|l| l.starts_with("p1 ") && l.contains("1/1") && l.contains("Running")),
        "{}",
        run.stdout
    );
    let run = api
        .kubectl(kubectl, &["get", "nodes", "-o", "wide"], T)
        .await;
    assert_ok("get nodes", &run);
    assert!(
        run.stdout.contains("edge-1") && run.stdout.contains("Ready"),
        "{}",
        run.stdout
    );

    let run = api
        .kubectl(kubectl, &["get", "pod", "nope", "-o", "json"], T)
        .await;
    assert!(!run.success);
    assert!(
        run.stderr.contains("pods \"nope\" not found"),
        "{}",
        run.stderr
    );

    let run = api.kubectl(kubectl, &["logs", "p1"], T).await;
    assert_ok("logs", &run);
    assert_eq!(run.stdout, LOG_LINES);
    let rec = kubelet
        .wait_for("/containerLogs/default/p1/c1", Duration::from_secs(5))
        .await
        .expect("kubelet saw the log request");
    assert_eq!(rec.method, "GET");
    assert_eq!(rec.query(), "");
    assert_eq!(
        rec.header("host"),
        Some(format!("127.0.0.1:{}", kubelet.port).as_str())
    );
    assert!(rec.client_cert, "kubelet client certificate presented");
    assert_eq!(rec.sni, None, "no SNI for an IP node address");
    assert_eq!(rec.alpn.as_deref(), Some("http/1.1"));

    let run = api.kubectl(kubectl, &["logs", "gone"], T).await;
    assert!(!run.success);
    assert!(run.stderr.contains("is not available"), "{}", run.stderr);

    let run = api
        .kubectl(
            kubectl,
            &["get", "--raw", "/api/v1/nodes/edge-1/proxy/metrics"],
            T,
        )
        .await;
    assert_ok("get --raw metrics", &run);
    assert_eq!(run.stdout, METRICS);
    let rec = kubelet
        .wait_for("/metrics", Duration::from_secs(5))
        .await
        .expect("kubelet saw /metrics");
    assert_eq!(
        rec.header("host"),
        Some(api.address().as_str()),
        "client's Host kept"
    );
    assert_eq!(
        rec.header("x-forwarded-uri"),
        Some("/api/v1/nodes/edge-1/proxy/metrics")
    );
    assert_eq!(rec.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(
        rec.header("authorization"),
        None,
        "bearer token not forwarded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_128_spdy() {
    let (_pki, kubelet, api) = ip_fixture().await;
    common_flows(KUBECTL_128, &kubelet, &api).await;

    // exec: SPDY passed through; the echoing kubelet cannot finish the protocol, so
    // kubectl is bounded and we only look at what the kubelet received.
    let (_run, rec) = tokio::join!(
        api.kubectl(
            KUBECTL_128,
            &["exec", "p1", "--", "echo", "hi"],
            Duration::from_secs(6)
        ),
        kubelet.wait_for("/exec/", Duration::from_secs(6))
    );
    let rec = rec.expect("kubelet saw the exec upgrade");
    assert_eq!(rec.method, "POST");
    assert_eq!(rec.path(), "/exec/default/p1/c1");
    assert_eq!(rec.query(), "command=echo&command=hi&error=1&output=1");
    assert_eq!(
        rec.header("host"),
        Some(api.address().as_str()),
        "Host is the apiserver's"
    );
    assert_eq!(rec.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(rec.header("upgrade"), Some("SPDY/3.1"));
    assert!(rec
        .header("x-stream-protocol-version")
        .is_some_and(|v| v.contains("channel.k8s.io")));
    assert_eq!(rec.header("authorization"), None);
    assert!(rec.client_cert);

    let (run, rec) = tokio::join!(
        api.kubectl(
            KUBECTL_128,
            &["port-forward", "p1", ":80"],
            Duration::from_secs(6)
        ),
        kubelet.wait_for("/portForward/", Duration::from_secs(6))
    );
    assert!(
        run.stdout.contains("Forwarding from 127.0.0.1:"),
        "kubectl port-forward did not get going: {run:?}"
    );
    let rec = rec.expect("kubelet saw the port-forward upgrade");
    assert_eq!(rec.method, "POST");
    assert_eq!(rec.target, "/portForward/default/p1");
    assert_eq!(rec.header("host"), Some(api.address().as_str()));
    assert_eq!(
        rec.header("x-stream-protocol-version"),
        Some("portforward.k8s.io")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_133_websocket() {
    // Pass-through mode: the fake kubelet speaks the v5 WebSocket itself (translation to
    // SPDY, the default, is checked against kubelet-sim in tether-tests' kubectl_e2e and
    // by the unit tests in src/translate.rs).
    let (_pki, kubelet, api) = ip_fixture_with(&["--stream-translation", "passthrough"]).await;
    common_flows(KUBECTL_133, &kubelet, &api).await;

    // exec: WebSocket passed straight through; the fake kubelet answers v5 frames.
    let run = api
        .kubectl(KUBECTL_133, &["exec", "p1", "--", "echo", "hi"], T)
        .await;
    assert_ok("exec", &run);
    assert_eq!(run.stdout, "hi\n");
    let rec = kubelet
        .wait_for("/exec/", Duration::from_secs(5))
        .await
        .expect("kubelet saw the exec upgrade");
    assert_eq!(rec.method, "GET");
    assert_eq!(rec.path(), "/exec/default/p1/c1");
    assert_eq!(rec.query(), "command=echo&command=hi&error=1&output=1");
    assert_eq!(
        rec.header("host"),
        Some(api.address().as_str()),
        "Host is the apiserver's"
    );
    assert_eq!(rec.header("x-forwarded-for"), Some("127.0.0.1"));
    assert!(rec
        .header("upgrade")
        .is_some_and(|u| u.eq_ignore_ascii_case("websocket")));
    assert!(rec
        .header("sec-websocket-protocol")
        .is_some_and(|p| p.contains("v5.channel.k8s.io")));

    // A multi-container pod without -c: kubectl picks the first container itself.
    let run = api
        .kubectl(KUBECTL_133, &["exec", "multi", "-c", "b", "--", "true"], T)
        .await;
    assert_ok("exec -c b", &run);
    assert!(kubelet.requests().iter().any(
        |r| r.path() == "/exec/default/multi/b" && r.query() == "command=true&error=1&output=1"
    ));

    // port-forward: the apiserver unwraps the WebSocket and speaks SPDY upgrade itself.
    let (run, rec) = tokio::join!(
        api.kubectl(
            KUBECTL_133,
            &["port-forward", "p1", ":80"],
            Duration::from_secs(6)
        ),
        kubelet.wait_for("/portForward/", Duration::from_secs(6))
    );
    assert!(
        run.stdout.contains("Forwarding from 127.0.0.1:"),
        "kubectl port-forward did not get going: {run:?}"
    );
    let rec = rec.expect("kubelet saw the port-forward upgrade");
    assert_eq!(rec.method, "POST");
    assert_eq!(rec.target, "/portForward/default/p1");
    assert_eq!(rec.header("upgrade"), Some("SPDY/3.1"));
    assert_eq!(
        rec.header("x-stream-protocol-version"),
        Some("portforward.k8s.io")
    );
    assert_eq!(
        rec.header("host"),
        Some(format!("127.0.0.1:{}", kubelet.port).as_str()),
        "the translated request is the apiserver's own: node Host"
    );
    let n = kubelet
        .requests()
        .iter()
        .filter(|r| r.path().starts_with("/portForward/"))
        .count();
    assert_eq!(n, 1, "kubectl kept the WebSocket tunnel (no SPDY fallback)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_node_through_dial_override() {
    let pki = pki();
    let kubelet = FakeKubelet::start(&pki).await;
    let args = vec![
        "--node".to_string(),
        "edge-2=edge-2.example:10350".into(),
        "--kubelet-dial".into(),
        format!("127.0.0.1:{}", kubelet.port),
        "--pod".into(),
        "default/p2=edge-2:c1".into(),
    ];
    let api = Apiserver::start(&pki, &args).await;

    let run = api
        .kubectl(
            KUBECTL_133,
            &["logs", "p2", "-f", "--tail=3", "--timestamps"],
            T,
        )
        .await;
    assert_ok("logs -f", &run);
    assert_eq!(run.stdout, LOG_LINES);
    let rec = kubelet
        .wait_for("/containerLogs/", Duration::from_secs(5))
        .await
        .expect("log request");
    assert_eq!(
        rec.target,
        "/containerLogs/default/p2/c1?follow=true&tailLines=3&timestamps=true"
    );
    assert_eq!(rec.header("host"), Some("edge-2.example:10350"));
    assert_eq!(rec.sni.as_deref(), Some("edge-2.example"));

    let run = api
        .kubectl(
            KUBECTL_128,
            &["get", "--raw", "/api/v1/nodes/edge-2/proxy/metrics"],
            T,
        )
        .await;
    assert_ok("get --raw", &run);
    let rec = kubelet
        .wait_for("/metrics", Duration::from_secs(5))
        .await
        .expect("metrics");
    assert_eq!(rec.sni.as_deref(), Some("edge-2.example"));
    assert_eq!(rec.header("host"), Some(api.address().as_str()));
}

/// Sends `req` on a fresh TLS connection and returns one response (head + a
/// Content-Length body), read within 10 s.
async fn raw_exchange(api: &Apiserver, req: &str) -> String {
    let mut tls = connect_tls(api).await;
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            let text = String::from_utf8_lossy(&out).to_string();
            if let Some(end) = text.find("\r\n\r\n") {
                let len = text[..end]
                    .lines()
                    .find_map(|l| {
                        let (n, v) = l.split_once(':')?;
                        n.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                if out.len() >= end + 4 + len {
                    return;
                }
            }
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(10), read).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_error_responses() {
    let (_pki, kubelet, api) = ip_fixture().await;
    let head = |path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n",
            api.address()
        )
    };
    // ≥400 from the kubelet: status and body copied.
    let out = raw_exchange(
        &api,
        &head("/api/v1/namespaces/default/pods/gone/exec?command=ls&stdout=true"),
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    assert!(
        out.contains("forbidden: exec denied by the fake kubelet"),
        "{out}"
    );
    // A non-101 success is an invalid upgrade response.
    let out = raw_exchange(
        &api,
        &head("/api/v1/namespaces/default/pods/p1/attach?stdout=true"),
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 502"), "{out}");
    assert!(
        out.contains("invalid upgrade response: status code 200"),
        "{out}"
    );
    let rec = kubelet
        .wait_for("/attach/", Duration::from_secs(5))
        .await
        .expect("attach");
    assert_eq!(rec.target, "/attach/default/p1/c1?output=1");
    // Multi-container pod without a container: 400 Status, nothing sent to the kubelet.
    let out = raw_exchange(
        &api,
        &head("/api/v1/namespaces/default/pods/multi/exec?command=ls&stdout=true"),
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert!(out.contains("choose one of: [a b]"), "{out}");
    // Unknown paths: 404 Status.
    let out = raw_exchange(
        &api,
        &format!(
            "GET /apis/apps/v1 HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            api.address()
        ),
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 404"), "{out}");
    assert!(out.contains("\"kind\": \"Status\""), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_ca_verification() {
    let pki = pki();
    let kubelet = FakeKubelet::start(&pki).await;
    let args = |ca: &std::path::Path| {
        vec![
            "--node".to_string(),
            "edge-2=edge-2.example:10350".into(),
            "--kubelet-dial".into(),
            format!("127.0.0.1:{}", kubelet.port),
            "--kubelet-ca".into(),
            ca.display().to_string(),
            "--pod".into(),
            "default/p2=edge-2:c1".into(),
        ]
    };
    let good = Apiserver::start(&pki, &args(&pki.kubelet_cert)).await;
    let run = good.kubectl(KUBECTL_133, &["logs", "p2"], T).await;
    assert_ok("logs with --kubelet-ca", &run);
    assert_eq!(run.stdout, LOG_LINES);

    let bad = Apiserver::start(&pki, &args(&pki.client_ca)).await;
    let run = bad.kubectl(KUBECTL_133, &["logs", "p2"], T).await;
    assert!(!run.success, "{run:?}");
    assert!(run.stderr.contains("TLS handshake"), "{}", run.stderr);
}

async fn connect_tls(api: &Apiserver) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(api.address())
        .await
        .expect("connect");
    let name = ServerName::try_from("127.0.0.1").expect("name");
    TlsConnector::from(client_config(&api.ca_pem))
        .connect(name, tcp)
        .await
        .expect("TLS to apiserver-sim")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_spdy_passthrough_and_websocket_tunnel_echo() {
    let (_pki, kubelet, api) = ip_fixture().await;
    let limit = Duration::from_secs(10);

    // SPDY pass-through: 101 then bytes both ways, half-close propagated.
    let mut tls = connect_tls(&api).await;
    let req = format!(
        "POST /api/v1/namespaces/default/pods/p1/portforward HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer secret\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: portforward.k8s.io\r\nContent-Length: 0\r\n\r\n",
        api.address()
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(limit, tls.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n == 1 && head.len() < 8192, "short head: {head:?}");
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(
        head.contains("x-stream-protocol-version: portforward.k8s.io"),
        "{head}"
    );
    tls.write_all(b"hello spdy").await.unwrap();
    let mut echo = [0u8; 10];
    tokio::time::timeout(limit, tls.read_exact(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echo, b"hello spdy");
    tls.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(limit, tls.read_to_end(&mut rest))
        .await
        .unwrap();
    assert!(n.is_ok() && rest.is_empty(), "{n:?} {rest:?}");
    let rec = kubelet
        .wait_for("/portForward/", limit)
        .await
        .expect("recorded");
    assert_eq!(rec.header("host"), Some(api.address().as_str()));
    assert_eq!(rec.header("authorization"), None);

    // WebSocket tunnel: binary payloads ↔ raw bytes over the kubelet's SPDY upgrade.
    let tls = connect_tls(&api).await;
    let request = http::Request::builder()
        .uri(format!(
            "wss://{}/api/v1/namespaces/default/pods/p1/portforward",
            api.address()
        ))
        .header("Host", api.address())
        .header("Connection", "Upgrade")
        .header("Upgrade", "websocket")
        .header("Sec-WebSocket-Version", "13")
        .header(
            "Sec-WebSocket-Key",
            tokio_tungstenite::tungstenite::handshake::client::generate_key(),
        )
        .header("Sec-WebSocket-Protocol", "SPDY/3.1+portforward.k8s.io")
        .body(())
        .unwrap();
    let (mut ws, resp) = tokio::time::timeout(limit, tokio_tungstenite::client_async(request, tls))
        .await
        .unwrap()
        .expect("websocket handshake");
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "SPDY/3.1+portforward.k8s.io"
    );
    ws.send(Message::Binary(Bytes::from_static(b"inner spdy")))
        .await
        .unwrap();
    ws.send(Message::Ping(Bytes::from_static(b"pp")))
        .await
        .unwrap();
    let (mut got, mut pong) = (Vec::new(), false);
    while got.len() < 10 || !pong {
        match tokio::time::timeout(limit, ws.next()).await.unwrap() {
            Some(Ok(Message::Binary(b))) => got.extend_from_slice(&b),
            Some(Ok(Message::Pong(p))) => {
                assert_eq!(&p[..], b"pp");
                pong = true;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, b"inner spdy");
    ws.close(None).await.unwrap();
    let reqs = kubelet.requests();
    let tunneled: Vec<_> = reqs
        .iter()
        .filter(|r| r.path() == "/portForward/default/p1")
        .collect();
    assert_eq!(tunneled.len(), 2);
    assert_eq!(
        tunneled[1].header("host"),
        Some(format!("127.0.0.1:{}", kubelet.port).as_str())
    );
    let _ = Arc::strong_count(&kubelet.seen);
}
