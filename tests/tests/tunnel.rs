//! Integration tests of the core tunnel: the real `tether-cloud` and
//! `tether-edge` binaries on loopback, an in-process kubelet stand-in, and an
//! HTTPS client holding the apiserver's client certificate.
//!
//! Needs the binaries built first: `cargo build --workspace --bins`.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use support::{echo, empty, Env, NodeSpec};
use tether_tests::{random_bytes, sha256_hex};

const ONE: &[NodeSpec<'static>] = &[NodeSpec {
    name: "edge-1",
    pods: &["default/p1"],
    announce: &["10.77.0.1"],
}];

fn two() -> Vec<NodeSpec<'static>> {
    vec![
        NodeSpec {
            name: "edge-a",
            pods: &["default/pa", "kube-system/shared"],
            announce: &["10.77.1.1", "10.77.9.9"],
        },
        NodeSpec {
            name: "edge-b",
            pods: &["default/pb", "kube-system/shared"],
            announce: &["10.77.2.1", "10.77.9.9"],
        },
    ]
}

/// Upgrades a `cat` exec on pod `pod` through the tunnel, as the apiserver does.
async fn cat_upgrade(
    env: &Env,
    pod: &str,
) -> anyhow::Result<(support::Reply, hyper::upgrade::Upgraded)> {
    env.client
        .upgrade(
            &format!("/exec/default/{pod}/c?command=cat&input=1&output=1"),
            "apiserver.example:6443",
        )
        .await
}

/// Starts a healthy 1 MiB echo on pod `pod` that stays open until the returned
/// sender is used, then checks it was intact: the "healthy stream running at
/// the same time" of the bad-input tests.
async fn healthy_stream(env: &Env, pod: &str) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_, up) = cat_upgrade(env, pod).await.expect("healthy stream upgrade");
    tokio::spawn(async move {
        let data = random_bytes(1 << 20);
        let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
        let want = data.clone();
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; want.len()];
            r.read_exact(&mut got).await?;
            anyhow::ensure!(got == want, "healthy stream corrupted");
            Ok::<_, anyhow::Error>(())
        });
        // Trickle the data over ~2 s so it overlaps the bad inputs.
        for chunk in data.chunks(32 * 1024) {
            w.write_all(chunk).await?;
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        reader.await??;
        w.shutdown().await?;
        Ok(())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_log_streams_while_it_grows() {
    let env = Env::start(ONE, &[]).await.unwrap();
    let resp = env
        .client
        .send(
            None,
            Request::get("/containerLogs/default/p1/c?follow=true")
                .header("host", "edge-1:10250")
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers().get("x-kubelet-node").unwrap(), "edge-1");
    let mut body = resp.into_body();
    let mut text = String::new();
    let started = Instant::now();
    while text.lines().count() < 40 {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Ok(d) = frame.into_data() {
            text.push_str(&String::from_utf8_lossy(&d));
        }
    }
    // 40 lines at 20 ms each: the body streamed as it grew, never buffered whole.
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "{:?}",
        started.elapsed()
    );
    for (i, line) in text.lines().take(40).enumerate() {
        assert_eq!(line, format!("edge-1 line {i}"));
    }
}

/// An edge that accepts only small frames (`--max-frame-bytes`, announced in its
/// hello): the cloud sends it frames no bigger than that (limits agreed both ways), so
/// 2 MiB cross byte-exact; with the cloud's own 32 KiB payloads the edge would refuse
/// the first data frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_with_small_frame_limits_gets_frames_it_accepts() {
    let env = Env::start_with(
        ONE,
        &[],
        &[
            "--max-frame-bytes",
            "16384",
            "--max-data-payload",
            "4096",
            "--max-head-bytes",
            "8192",
        ],
        false,
    )
    .await
    .unwrap();
    let data = random_bytes(2 << 20);
    let (_reply, up) = cat_upgrade(&env, "p1").await.unwrap();
    let back = tokio::time::timeout(
        Duration::from_secs(60),
        echo(TokioIo::new(up), data.clone()),
    )
    .await
    .expect("the echo must not stall")
    .unwrap();
    assert_eq!(sha256_hex(&back), sha256_hex(&data));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_echo_10_mib_byte_exact_with_half_close() {
    let env = Env::start(ONE, &[]).await.unwrap();
    let data = random_bytes(10 << 20);
    let want = sha256_hex(&data);
    // Through the tunnel.
    let (reply, up) = cat_upgrade(&env, "p1").await.unwrap();
    assert_eq!(
        reply.headers.get("x-stream-protocol-version").unwrap(),
        "v4.channel.k8s.io"
    );
    assert_eq!(reply.headers.get("upgrade").unwrap(), "SPDY/3.1");
    let t = Instant::now();
    let back = echo(TokioIo::new(up), data.clone()).await.unwrap();
    let tunnel = t.elapsed();
    assert_eq!(back.len(), data.len());
    assert_eq!(sha256_hex(&back), want);
    // Directly against the kubelet stand-in, for the figure.
    let tcp = tokio::net::TcpStream::connect(env.nodes[0].kubelet.addr)
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn.with_upgrades());
    let mut resp = sender
        .send_request(
            Request::post("/exec/default/p1/c")
                .header("connection", "Upgrade")
                .header("upgrade", "SPDY/3.1")
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let up = hyper::upgrade::on(&mut resp).await.unwrap();
    let t = Instant::now();
    let back = echo(TokioIo::new(up), data).await.unwrap();
    let direct = t.elapsed();
    assert_eq!(sha256_hex(&back), want);
    println!(
        "FIGURE 10 MiB echo: tunnel {:.0} ms, direct {:.0} ms, ratio {:.1}x",
        tunnel.as_secs_f64() * 1e3,
        direct.as_secs_f64() * 1e3,
        tunnel.as_secs_f64() / direct.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_get_and_request_body() {
    let env = Env::start(ONE, &[]).await.unwrap();
    let tls = env.client.connect(Some("edge-1"), true).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let resp = sender
        .send_request(
            Request::get("https://edge-1:10250/metrics")
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"node_name{node=\"edge-1\"} 1\n");
    // A POST body reaches the kubelet (the stand-in echoes /stats/summary bodies).
    let payload = Bytes::from(random_bytes(300_000));
    let req = Request::post("https://edge-1:10250/stats/summary")
        .body(
            http_body_util::Full::new(payload.clone())
                .map_err(|n| match n {})
                .boxed(),
        )
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.into_body().collect().await.unwrap().to_bytes(),
        payload
    );
}

/// The front speaks HTTP/2 when ALPN chose it and HTTP/1.1 otherwise, with
/// or without ALPN, as the kubelet does (HTTP/2 without ALPN is refused, not
/// guessed), and bounds request heads on every path: `--max-http-header-bytes`
/// gives 431 however the head arrives, and `--http-header-timeout` closes a
/// connection whose TLS handshake or HTTP/1 head does not finish in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_versions_go_by_alpn_and_heads_are_bounded_on_each() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = Env::start(
        ONE,
        &[
            "--http-header-timeout",
            "2s",
            "--max-http-header-bytes",
            "16KiB",
        ],
    )
    .await
    .unwrap();
    let metrics = b"node_name{node=\"edge-1\"} 1\n";
    // Larger than the limit, in TLS records that hyper's read buffer bound
    // catches by itself; `bad_inputs_get_clear_errors_and_spare_healthy_streams`
    // sends 100 KiB against the default 64 KiB, a head whose last read takes
    // it past the buffer bound and completes it, so only the check on the
    // parsed head refuses it (it got 200 without that check).
    let big = "x".repeat(20 * 1024);

    // HTTP/1.1: by ALPN, and without any ALPN.
    let client = &env.client;
    let h1_tls = move |alpn: bool| async move {
        let tls = if alpn {
            client.connect(Some("edge-1"), false).await.unwrap()
        } else {
            client.connect_without_alpn(Some("edge-1")).await.unwrap()
        };
        let want: Option<&[u8]> = if alpn { Some(b"http/1.1") } else { None };
        assert_eq!(tls.get_ref().1.alpn_protocol(), want);
        tls
    };
    for alpn in [true, false] {
        let what = if alpn {
            "HTTP/1.1 by ALPN"
        } else {
            "HTTP/1.1 without ALPN"
        };
        for (extra, want) in [
            ("", StatusCode::OK),
            (big.as_str(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        ] {
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(h1_tls(alpn).await))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            let mut req = Request::get("/metrics").header("host", "edge-1");
            if !extra.is_empty() {
                req = req.header("x-big", extra);
            }
            let resp = sender
                .send_request(req.body(empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(resp.status(), want, "{what}");
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            if want == StatusCode::OK {
                assert_eq!(&body[..], metrics, "{what}");
            }
        }
        // A head that never ends: closed after --http-header-timeout.
        let mut tls = h1_tls(alpn).await;
        tls.write_all(b"GET /metrics HTTP/1.1\r\nhost: edge-1\r\n")
            .await
            .unwrap();
        closed_after_header_timeout(&mut tls, &format!("{what}, an unfinished head")).await;
    }

    // HTTP/2 by ALPN.
    let tls = env.client.connect(Some("edge-1"), true).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let mut sender = h2_sender(tls).await;
    let get = |big: Option<&str>| {
        let mut req = Request::get("https://edge-1:10250/metrics");
        if let Some(v) = big {
            req = req.header("x-big", v);
        }
        req.body(empty()).unwrap()
    };
    let resp = sender.send_request(get(None)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], metrics);
    // Over the header list limit the server advertised: refused (431 or a
    // reset stream, as the HTTP/2 stack decides), never forwarded.
    match sender.send_request(get(Some(&big))).await {
        Ok(r) => assert_eq!(r.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        Err(e) => eprintln!("HTTP/2: oversized header list refused: {e}"),
    }
    // The connection still serves.
    let resp = sender.send_request(get(None)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);

    // HTTP/2's preface without ALPN is a bad HTTP/1.1 request line: the
    // front closes the connection (hyper answers nothing to it), a client
    // that tries gets an error, and no HTTP/2 frame comes back.
    let tls = env
        .client
        .connect_without_alpn(Some("edge-1"))
        .await
        .unwrap();
    let mut sender = h2_sender(tls).await;
    let r = tokio::time::timeout(Duration::from_secs(15), sender.send_request(get(None)))
        .await
        .expect("HTTP/2 without ALPN must fail within 15 s");
    assert!(r.is_err(), "HTTP/2 without ALPN must be refused, got {r:?}");
    let mut tls = env
        .client
        .connect_without_alpn(Some("edge-1"))
        .await
        .unwrap();
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(15), tls.read_to_end(&mut got)).await;
    assert!(
        read.is_ok(),
        "HTTP/2's preface without ALPN: not closed within 15 s"
    );
    let text = String::from_utf8_lossy(&got);
    assert!(
        got.is_empty() || text.starts_with("HTTP/1.1 4") || text.starts_with("HTTP/1.1 5"),
        "HTTP/2's preface without ALPN must get nothing or an HTTP/1.1 error, got {text:?}"
    );

    // A TLS handshake that never starts: closed after --http-header-timeout.
    let mut tcp = tokio::net::TcpStream::connect(env.kubelet_api)
        .await
        .unwrap();
    closed_after_header_timeout(&mut tcp, "a silent TLS client").await;
}

/// An HTTP/2 client on `tls` (its connection driven by a task of its own).
async fn h2_sender(
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
) -> hyper::client::conn::http2::SendRequest<support::Body> {
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

/// `io` is closed by the server after `--http-header-timeout` (2 s), not
/// before, and within 15 s.
async fn closed_after_header_timeout<R: tokio::io::AsyncRead + Unpin>(io: &mut R, what: &str) {
    use tokio::io::AsyncReadExt;
    let started = Instant::now();
    let mut buf = [0u8; 256];
    let read = tokio::time::timeout(Duration::from_secs(15), io.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "{what}: must be closed within 15 s, got {read:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "{what}: closed after {:?}, before --http-header-timeout 2s",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_through_one_edge() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = Env::start(ONE, &[]).await.unwrap();
    let rss = |pid: Option<u32>| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", pid.unwrap())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    };
    let (cloud_idle, edge_idle) = (rss(env.cloud.pid()), rss(env.nodes[0].edge.pid()));
    // All 200 streams are open at once (barrier) before any finishes.
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(201));
    let mut tasks = Vec::new();
    for i in 0..200u32 {
        let client = env.client.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let (_, up) = client
                .upgrade(
                    &format!("/exec/default/p1/c?command=cat&n={i}"),
                    "apiserver.example:6443",
                )
                .await?;
            let data = random_bytes(64 * 1024 + i as usize);
            let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
            w.write_all(&data[..1024]).await?;
            let mut first = vec![0u8; 1024];
            r.read_exact(&mut first).await?;
            barrier.wait().await;
            w.write_all(&data[1024..]).await?;
            w.shutdown().await?;
            let mut back = first;
            r.read_to_end(&mut back).await?;
            anyhow::ensure!(back == data, "stream {i} corrupted");
            Ok::<_, anyhow::Error>(())
        }));
    }
    let t = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), barrier.wait())
        .await
        .unwrap();
    let (cloud_open, edge_open) = (rss(env.cloud.pid()), rss(env.nodes[0].edge.pid()));
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    println!(
        "FIGURE 200 open streams: cloud RSS {} KiB (idle {} KiB), edge RSS {} KiB (idle {} KiB); all 200 echoes done in {:.0} ms",
        cloud_open,
        cloud_idle,
        edge_open,
        edge_idle,
        t.elapsed().as_secs_f64() * 1e3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_each_reach_only_their_own_kubelet() {
    let env = Env::start(&two(), &[]).await.unwrap();
    for (pod, node) in [("pa", "edge-a"), ("pb", "edge-b")] {
        let r = env
            .client
            .get(
                &format!("/containerLogs/default/{pod}/c"),
                "apiserver.example:6443",
                None,
                &[],
            )
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.node(), Some(node));
        assert!(r.body.starts_with(&format!("{node} line 0")));
    }
    for node in ["edge-a", "edge-b"] {
        let r = env
            .client
            .get("/metrics", &format!("{node}:10250"), None, &[])
            .await
            .unwrap();
        assert_eq!((r.status, r.node()), (StatusCode::OK, Some(node)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_never_guesses() {
    let env = Env::start(&two(), &[]).await.unwrap();
    let c = &env.client;
    // An upgrade whose Host is the apiserver's own address reaches the pod's node.
    let (reply, up) = c
        .upgrade("/exec/default/pb/c?command=sh", "10.96.0.1:6443")
        .await
        .unwrap();
    assert_eq!(reply.headers.get("x-kubelet-node").unwrap(), "edge-b");
    assert_eq!(
        echo(TokioIo::new(up), b"ping".to_vec()).await.unwrap(),
        b"ping"
    );
    // Node-scoped: X-Forwarded-Uri only chooses among the nodes the connection stands
    // for — an address both edges announce…
    const FWD: (&str, &str) = ("x-forwarded-uri", "/api/v1/nodes/edge-b/proxy/metrics");
    let fwd_get = |host: &'static str, sni: Option<&'static str>, upgrade: bool| async move {
        let up = [FWD, ("connection", "Upgrade"), ("upgrade", "websocket")];
        let extra = if upgrade { &up[..] } else { &up[..1] };
        c.get("/metrics", host, sni, extra).await.unwrap()
    };
    let r = fwd_get("10.77.9.9:10350", None, false).await;
    assert_eq!((r.status, r.node()), (StatusCode::OK, Some("edge-b")));
    // …never redirects a request whose Host (or SNI) names another node, as a client
    // could through the apiserver's proxy: refused, both named…
    let r = fwd_get("edge-a:10250", None, false).await;
    assert_eq!(r.status, StatusCode::MISDIRECTED_REQUEST, "{}", r.body);
    assert!(r.node().is_none());
    assert!(
        r.body.contains("X-Forwarded-Uri names node edge-b") && r.body.contains("edge-a"),
        "{}",
        r.body
    );
    let r = fwd_get("10.96.0.1:6443", Some("edge-a"), false).await;
    assert_eq!(r.status, StatusCode::MISDIRECTED_REQUEST, "{}", r.body);
    // …on its own it names the node of a plain request, which kube-apiserver's node
    // proxy sends with its own Host and the header set by itself…
    let r = fwd_get("10.96.0.1:6443", None, false).await;
    assert_eq!((r.status, r.node()), (StatusCode::OK, Some("edge-b")));
    // …but not of an upgrade, whose headers kube-apiserver copies from the client.
    let r = fwd_get("10.96.0.1:6443", None, true).await;
    assert_eq!(r.status, StatusCode::MISDIRECTED_REQUEST, "{}", r.body);
    assert!(r.body.contains("upgrade"), "{}", r.body);
    // …by Host naming the node or an address it announced…
    assert_eq!(
        c.get("/metrics", "edge-a:10250", None, &[])
            .await
            .unwrap()
            .node(),
        Some("edge-a")
    );
    assert_eq!(
        c.get("/metrics", "10.77.2.1:10350", None, &[])
            .await
            .unwrap()
            .node(),
        Some("edge-b")
    );
    // …and by SNI (Host unrelated).
    assert_eq!(
        c.get("/metrics", "10.96.0.1:6443", Some("edge-b"), &[])
            .await
            .unwrap()
            .node(),
        Some("edge-b")
    );
    // The kubelet's own 404 and 500 arrive unchanged.
    let r = c.get("/runningpods/", "edge-a", None, &[]).await.unwrap();
    assert_eq!(
        (r.status, r.node()),
        (StatusCode::NOT_FOUND, Some("edge-a"))
    );
    assert!(r.body.contains("kubelet edge-a"));
    let r = c.get("/metrics/probes", "edge-a", None, &[]).await.unwrap();
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::INTERNAL_SERVER_ERROR, "probe failure\n")
    );
    // An address announced by both edges, or a pod both report: refused, named.
    let r = c
        .get("/metrics", "10.77.9.9:10350", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    assert!(
        r.body.contains("10.77.9.9") && r.body.contains("edge-a") && r.body.contains("edge-b"),
        "{}",
        r.body
    );
    let r = c
        .get("/containerLogs/kube-system/shared/c", "edge-a", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    // Unknown host, unknown pod, unforwarded path: clear errors from the cloud itself.
    let r = c
        .get("/metrics", "nowhere.example:10250", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(r.body.contains("nowhere.example"), "{}", r.body);
    assert!(r.headers.get("x-kubelet-node").is_none());
    let r = c
        .get("/containerLogs/default/ghost/c", "edge-a", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(r.body.contains("default/ghost"), "{}", r.body);
    for path in ["/run/default/pa/c", "/configz", "/debug/pprof/heap", "/"] {
        let r = c.get(path, "edge-a", None, &[]).await.unwrap();
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}");
        assert!(r.body.starts_with("tether-cloud:"), "{path}: {}", r.body);
    }
}

/// Issue 14 item 7: any certificate from the apiserver client CA (on kubeadm
/// it also signs every user and node) proves only cluster membership. Only
/// `--apiserver-allowed-identity` (default: kubeadm's apiserver kubelet-client
/// CN) is served; every other identity gets 403, for node- and pod-scoped
/// paths alike, and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_allowed_apiserver_identities_are_served() {
    let env = Env::start(ONE, &[]).await.unwrap();
    let dir = env.dir.path();
    let admin = tether_tests::pki::issue_client(
        dir,
        "admin",
        "kubernetes-admin",
        &["kubeadm:cluster-admins"],
    )
    .unwrap();
    let node =
        tether_tests::pki::issue_client(dir, "node-user", "system:node:edge-1", &["system:nodes"])
            .unwrap();
    for (who, pair) in [("kubernetes-admin", &admin), ("system:node:edge-1", &node)] {
        let client = support::Client::new(
            &env.pki.with_apiserver_client(pair.clone()),
            env.kubelet_api,
        )
        .unwrap();
        for path in ["/metrics", "/containerLogs/default/p1/c"] {
            let r = client.get(path, "edge-1", None, &[]).await.unwrap();
            assert_eq!(r.status, StatusCode::FORBIDDEN, "{who} {path}: {}", r.body);
            assert!(
                r.body.contains(who) && r.body.contains("--apiserver-allowed-identity"),
                "{}",
                r.body
            );
        }
    }
    // The apiserver's own certificate is still served.
    let r = env
        .client
        .get("/metrics", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let (_, m) = support::plain_get(env.metrics, "/metrics").await.unwrap();
    assert_eq!(
        support::sample(
            &m,
            "tether_cloud_refused_requests_total{reason=\"forbidden\"}"
        ),
        Some(4.0),
        "{m}"
    );
    drop(env);

    // A list with a group: kubeadm's cluster admins are served too, a node is not.
    let env = Env::start(
        ONE,
        &[
            "--apiserver-allowed-identity",
            "CN=kube-apiserver-kubelet-client,O=kubeadm:cluster-admins",
        ],
    )
    .await
    .unwrap();
    let dir = env.dir.path();
    let admin = tether_tests::pki::issue_client(
        dir,
        "admin",
        "kubernetes-admin",
        &["kubeadm:cluster-admins"],
    )
    .unwrap();
    let node =
        tether_tests::pki::issue_client(dir, "node-user", "system:node:edge-1", &["system:nodes"])
            .unwrap();
    let get = |pair: tether_tests::pki::Pair| {
        let client =
            support::Client::new(&env.pki.with_apiserver_client(pair), env.kubelet_api).unwrap();
        async move { client.get("/metrics", "edge-1", None, &[]).await.unwrap() }
    };
    let r = get(admin).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = get(node).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert!(r.body.contains("O=kubeadm:cluster-admins"), "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_clear_errors_and_spare_healthy_streams() {
    let env = Env::start(ONE, &[]).await.unwrap();
    let healthy = healthy_stream(&env, "p1").await;

    // Garbage datagrams on the QUIC port.
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for i in 0..500u32 {
        let junk = random_bytes(1 + (i as usize * 37) % 1400);
        sock.send_to(&junk, env.tunnel).await.unwrap();
    }

    // An apiserver without a client certificate: the TLS handshake fails.
    let no_cert = {
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(
                tether_certs::pem::certs_from_pem(&env.pki.tether_ca_pem, "ca")
                    .unwrap()
                    .remove(0),
            )
            .unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(env.kubelet_api)
            .await
            .unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        match tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
            .connect(name, tcp)
            .await
        {
            // TLS 1.3: the server's refusal arrives with the first read.
            Ok(mut tls) => {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let _ = tls
                    .write_all(b"GET /metrics HTTP/1.1\r\nhost: edge-1\r\n\r\n")
                    .await;
                let mut buf = Vec::new();
                tls.read_to_end(&mut buf).await.is_err() || buf.is_empty()
            }
            Err(_) => true,
        }
    };
    assert!(no_cert, "a client without a certificate must be refused");

    // Oversized request headers: 431, not a crash.
    let big = "x".repeat(100 * 1024);
    let r = env
        .client
        .get("/metrics", "edge-1", None, &[("x-big", &big)])
        .await;
    match r {
        Ok(r) => assert_eq!(r.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        Err(e) => panic!("oversized headers should get 431, got {e:#}"),
    }

    // A hello whose node name differs from the certificate's.
    let refusal = hello_as(&env, "edge-intruder", "edge-1", None).await;
    assert!(
        refusal.contains("NodeMismatch") && refusal.contains("edge-intruder"),
        "{refusal}"
    );

    // Resume tickets that are not this node's, or not this cloud's: refused
    // with the reason, logged, and the live session of edge-1 untouched.
    let forged = |node: &str| tether_proto::ticket::Ticket {
        node: node.into(),
        session: tether_proto::token::SessionId(1),
        gen: u64::MAX / 2,
        expires_ms: u64::MAX,
        mac: [7; 32],
    };
    let refusal = hello_as(&env, "edge-1", "edge-1", Some(forged("edge-2"))).await;
    assert!(
        refusal.contains("Ticket")
            && refusal.contains("issued to node")
            && refusal.contains("edge-2"),
        "{refusal}"
    );
    let refusal = hello_as(&env, "edge-1", "edge-1", Some(forged("edge-1"))).await;
    assert!(
        refusal.contains("Ticket") && refusal.contains("MAC does not verify"),
        "{refusal}"
    );

    // An edge certificate from another CA.
    let other = tether_certs::Ca::new("other-ca", Duration::from_secs(3600)).unwrap();
    let rogue = other
        .issue_edge("edge-1", Duration::from_secs(3600))
        .unwrap();
    let cert = env.dir.path().join("rogue.crt");
    let key = env.dir.path().join("rogue.key");
    std::fs::write(&cert, &rogue.cert_pem).unwrap();
    std::fs::write(&key, &rogue.key_pem).unwrap();
    let mut rogue_edge = env
        .edge_process("rogue", &cert, &key, "http://127.0.0.1:9", &[], &[])
        .unwrap();
    let seen = rogue_edge
        .wait_connected("rogue connected", Duration::from_secs(3))
        .await;
    assert!(
        seen.is_err(),
        "an edge with a foreign certificate must not be welcomed"
    );
    rogue_edge.kill().await;

    // Unknown host.
    let r = env
        .client
        .get("/metrics", "10.1.2.3:10250", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::NOT_FOUND);

    healthy.await.unwrap().expect("healthy stream intact");
    // The real edge is still the one connected.
    let r = env
        .client
        .get("/metrics", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(r.node(), Some("edge-1"));
    let log = env.cloud_log();
    assert!(log.contains("NodeMismatch"), "refusal not logged");
}

/// Connects to the cloud as `cert_node` and says hello as `hello_node`;
/// returns what the cloud answered.
async fn hello_as(
    env: &Env,
    cert_node: &str,
    hello_node: &str,
    ticket: Option<tether_proto::ticket::Ticket>,
) -> String {
    use tether_proto::handshake::{Hello, ALPN_TUNNEL, PROTOCOL_VERSION};
    use tether_proto::io::{write_frame, FrameReader};
    let pair = &env.pki.edges[cert_node];
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(
            tether_certs::pem::certs_from_pem(&env.pki.tether_ca_pem, "ca")
                .unwrap()
                .remove(0),
        )
        .unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(
            tether_certs::pem::certs_from_pem(&pair.cert_pem, "c").unwrap(),
            tether_certs::pem::key_from_pem(&pair.key_pem, "k").unwrap(),
        )
        .unwrap();
    tls.alpn_protocols = vec![ALPN_TUNNEL.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(crypto)));
    let conn = ep
        .connect(env.tunnel, tether_tests::pki::CLOUD_SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = Hello {
        versions: vec![PROTOCOL_VERSION],
        node: hello_node.into(),
        addresses: vec![],
        resume: tether_proto::token::ResumeToken([1; 16]),
        instance: 1,
        attempt: 1,
        limits: tether_proto::Limits::default(),
        ticket,
    };
    write_frame(&mut send, &tether_proto::Frame::Hello(hello), 1 << 20)
        .await
        .unwrap();
    let mut reader = FrameReader::new(1 << 20);
    let answer = tokio::time::timeout(Duration::from_secs(5), reader.next(&mut recv))
        .await
        .unwrap();
    format!("{answer:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_edge_aborts_streams_and_never_hangs() {
    // Short timers so the dead edge is noticed in seconds.
    let env = Env::start(
        ONE,
        &[
            "--idle-timeout",
            "2s",
            "--keep-alive",
            "500ms",
            "--grace",
            "1s",
        ],
    )
    .await
    .unwrap();
    let resp = env.client.follow_log("default/p1").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    // Some lines flow, then the edge dies.
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.is_data());
    let mut env = env;
    env.nodes[0].edge.kill().await;
    let t = Instant::now();
    let outcome = support::body_end(&mut body, Duration::from_secs(20))
        .await
        .expect("the response must end, not hang");
    assert!(
        outcome.is_err(),
        "a cut log must end as an aborted response, not a clean end"
    );
    println!(
        "FIGURE killed edge: log response aborted {:.1} s after the kill",
        t.elapsed().as_secs_f64()
    );
    // New requests get 502 naming the edge, not a hang.
    let r = env
        .client
        .get("/containerLogs/default/p1/c", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.body);
    assert!(r.body.contains("edge-1"), "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_down_gives_502_and_restarted_edge_ends_old_streams() {
    let mut env = Env::start(ONE, &[]).await.unwrap();
    // An edge whose kubelet refuses connections: 502 with the reason.
    let kubelet_url = format!("http://{}", env.nodes[0].kubelet.addr);
    let r = env
        .client
        .get("/metrics", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);
    // Open a follow stream, then restart the edge (state lost): the stream ends promptly.
    let resp = env.client.follow_log("default/p1").await.unwrap();
    let mut body = resp.into_body();
    tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    env.nodes[0].edge.kill().await;
    let restarted = env
        .spawn_edge("edge-1", "http://127.0.0.1:9", &["10.77.0.1"], &[])
        .await
        .unwrap();
    let t = Instant::now();
    let outcome = support::body_end(&mut body, Duration::from_secs(10))
        .await
        .expect("old stream must end promptly when the edge restarts");
    assert!(outcome.is_err());
    assert!(t.elapsed() < Duration::from_secs(5));
    // The restarted edge points at a closed port: 502 naming the kubelet.
    let r = env
        .client
        .get("/metrics", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.body);
    assert!(r.body.contains("could not reach its kubelet"), "{}", r.body);
    drop(restarted);
    let _ = kubelet_url;
}

/// A cloud with one handshake slot (and `extra` flags), handshakes allowed 30 s.
async fn one_handshake_slot(extra: &[&str]) -> Env {
    let mut flags = vec![
        "--max-pending-handshakes",
        "1",
        "--handshake-timeout",
        "30s",
    ];
    flags.extend_from_slice(extra);
    Env::start(&two(), &flags).await.unwrap()
}

/// The cloud's count of Initials refused or dropped for `reason`.
fn refused(metrics: &str, reason: &str) -> f64 {
    support::sample(
        metrics,
        &format!("tether_cloud_edges_refused_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

/// `n` QUIC handshakes of edge-intruder started at once, each from its own
/// socket, all completed; then the cloud's metrics.
async fn dial_at_once(env: &Env, n: usize) -> (Vec<(quinn::Endpoint, quinn::Connection)>, String) {
    let pair = &env.pki.edges["edge-intruder"];
    let dials: Vec<_> = (0..n)
        .map(|_| {
            let (tunnel, ca) = (env.tunnel, env.pki.tether_ca_pem.clone());
            let (cert, key) = (pair.cert_pem.clone(), pair.key_pem.clone());
            tokio::spawn(async move { support::RawEdge::handshake(tunnel, &ca, &cert, &key).await })
        })
        .collect();
    let mut conns = Vec::new();
    for (i, d) in dials.into_iter().enumerate() {
        let r = d.await.unwrap();
        conns.push(r.unwrap_or_else(|e| panic!("handshake {i} of {n}: {e:#}")));
    }
    let (_, m) = support::plain_get(env.metrics, "/metrics").await.unwrap();
    (conns, m)
}

/// `--max-pending-handshakes` (here 1): edges dialling at once over the limit wait
/// for a slot, first come first served, instead of being dropped (which left each
/// to QUIC's doubling retransmission timer): every handshake completes, none is
/// counted as dropped for the backlog, and the cloud logs the waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_over_the_backlog_wait_for_a_slot() {
    const DIALS: usize = 8;
    let env = one_handshake_slot(&[]).await;
    let (conns, m) = dial_at_once(&env, DIALS).await;
    let dropped = refused(&m, "handshake_backlog");
    assert_eq!(dropped, 0.0, "Initials dropped for the backlog:\n{m}");
    let log = env.cloud_log();
    assert!(
        log.contains("an edge's Initial waits for a handshake slot"),
        "{DIALS} edges dialling at once never waited for the one slot: {log}"
    );
    drop(conns);
}

/// `--max-waiting-handshakes` (here 1) behind one handshake slot: of six edges
/// dialling at once, the Initials beyond the line are dropped and counted
/// (`waiting_full`); their QUIC retransmits them and every handshake completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_line_holds_at_most_max_waiting_handshakes() {
    const DIALS: usize = 6;
    let env = one_handshake_slot(&["--max-waiting-handshakes", "1"]).await;
    let (conns, m) = dial_at_once(&env, DIALS).await;
    let full = refused(&m, "waiting_full");
    assert!(
        full >= 1.0,
        "{DIALS} edges at once never found the line of one full:\n{m}"
    );
    drop(conns);
}

/// Attempts of one edge (one UDP socket) while the cloud is busy: once one of
/// them holds the only handshake slot, the others are another attempt of an
/// edge already being served and are dropped (`duplicate_attempt`) instead of
/// queueing for a handshake the edge would throw away; when the slot is free
/// again their retransmissions are served as usual, so nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_of_an_edge_already_served_do_not_queue_while_the_cloud_is_busy() {
    const ATTEMPTS: usize = 3;
    let env = one_handshake_slot(&[]).await;
    let pair = &env.pki.edges["edge-intruder"];
    let endpoint =
        support::RawEdge::endpoint(&env.pki.tether_ca_pem, &pair.cert_pem, &pair.key_pem).unwrap();
    let dials: Vec<_> = (0..ATTEMPTS)
        .map(|_| {
            let connecting = endpoint
                .connect(env.tunnel, tether_tests::pki::CLOUD_SERVER_NAME)
                .unwrap();
            tokio::spawn(tokio::time::timeout(Duration::from_secs(15), connecting))
        })
        .collect();
    let mut conns = Vec::new();
    for (i, d) in dials.into_iter().enumerate() {
        let r = d.await.unwrap();
        conns.push(
            r.unwrap_or_else(|_| panic!("attempt {i} of {ATTEMPTS}: no handshake within 15 s"))
                .unwrap_or_else(|e| panic!("attempt {i} of {ATTEMPTS}: {e}")),
        );
    }
    let (_, m) = support::plain_get(env.metrics, "/metrics").await.unwrap();
    let dup = refused(&m, "duplicate_attempt");
    assert!(
        dup >= 1.0,
        "{ATTEMPTS} attempts from one socket against one slot: none was dropped as a duplicate:\n{m}"
    );
    drop(conns);
}
