//! The limits of the cloud's apiserver-facing side, each hit on the real
//! binaries: `--max-apiserver-connections` (the one over is closed, a freed
//! slot serves again), `--http-header-timeout` on an HTTP/2 connection that
//! sends no request, `--apiserver-keep-alive` (unanswered HTTP/2 PINGs close
//! the connection; accepted sockets carry TCP keep-alive),
//! `--response-timeout` (504 naming it) and `--max-streams-per-edge` in the
//! cloud (503 naming it).
//!
//! Needs the binaries built first: `cargo build --workspace --bins`.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use support::{empty, Env, NodeSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ONE: &[NodeSpec<'static>] = &[NodeSpec {
    name: "edge-1",
    pods: &["default/p1"],
    announce: &["10.77.0.1"],
}];

/// HTTP/2's client preface and an empty SETTINGS frame: a client that has
/// started HTTP/2 and then sends no request.
const PREFACE_AND_SETTINGS: &[u8] =
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// `io` is closed by the server within `within`; returns when it was.
async fn closed_within<R: tokio::io::AsyncRead + Unpin>(
    io: &mut R,
    within: Duration,
    what: &str,
) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(within.saturating_sub(started.elapsed()), io.read(&mut buf))
            .await
        {
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => continue, // SETTINGS and the like: not a close
            Err(_) => panic!("{what}: not closed within {within:?}"),
        }
    }
}

/// A GET over HTTP/2 on a new connection; `None` when the connection was
/// refused or broke before an answer.
async fn h2_get(env: &Env, path: &str) -> Option<(StatusCode, String)> {
    let tls = env.client.connect(None, true).await.ok()?;
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .ok()?;
    tokio::spawn(conn);
    let req = Request::get(format!("https://edge-1:10250{path}"))
        .body(empty())
        .ok()?;
    let resp = sender.send_request(req).await.ok()?;
    let status = resp.status();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Retries `attempt` every 100 ms until it gives `Some`, for at most 15 s.
async fn within_15s<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(v) = attempt().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within 15 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An HTTP/2 connection that sends nothing after TLS, or only the preface,
/// is closed after `--http-header-timeout` (hyper bounds neither), and its
/// slot of `--max-apiserver-connections` (1 here) serves the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_without_a_request_is_closed_after_the_header_timeout_and_frees_its_slot() {
    let env = Env::start(
        &[],
        &[
            "--http-header-timeout",
            "2s",
            "--max-apiserver-connections",
            "1",
        ],
    )
    .await
    .unwrap();

    // Silent after TLS (ALPN h2).
    let mut tls = env.client.connect(None, true).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let after = closed_within(&mut tls, Duration::from_secs(15), "silent HTTP/2 client").await;
    assert!(
        after >= Duration::from_millis(1500),
        "silent HTTP/2 client closed after {after:?}, before --http-header-timeout 2s"
    );
    drop(tls);
    // The only slot is free again: a request is answered (404: no such node).
    let (status, body) = within_15s("a request after the silent client", || {
        h2_get(&env, "/metrics")
    })
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    // The preface and SETTINGS, then nothing: closed all the same.
    let mut tls = within_15s("a connection for the preface", || async {
        env.client.connect(None, true).await.ok()
    })
    .await;
    tls.write_all(PREFACE_AND_SETTINGS).await.unwrap();
    let after = closed_within(&mut tls, Duration::from_secs(15), "HTTP/2 preface only").await;
    assert!(
        after >= Duration::from_millis(1500),
        "HTTP/2 preface only: closed after {after:?}, before --http-header-timeout 2s"
    );
    drop(tls);
    let (status, body) = within_15s("a request after the preface-only client", || {
        h2_get(&env, "/metrics")
    })
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let log = env.cloud_log();
    assert_eq!(
        log.matches("sent no request within --http-header-timeout")
            .count(),
        2,
        "{log}"
    );
}

/// The next HTTP/2 frame on `io`: (type, flags, payload).
async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    io: &mut R,
) -> std::io::Result<(u8, u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    io.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    io.read_exact(&mut payload).await?;
    Ok((head[3], head[4], payload))
}

/// The front PINGs an HTTP/2 client every `--apiserver-keep-alive` (1 s
/// here) and closes the connection when a PING goes unanswered, long
/// before the 30 s `--http-header-timeout` would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_stops_answering_pings_is_closed() {
    const PING: u8 = 6;
    let env = Env::start(
        &[],
        &[
            "--apiserver-keep-alive",
            "1s",
            "--http-header-timeout",
            "30s",
        ],
    )
    .await
    .unwrap();
    let mut tls = env.client.connect(None, true).await.unwrap();
    tls.write_all(PREFACE_AND_SETTINGS).await.unwrap();
    let started = Instant::now();
    let ping = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let (kind, flags, _) = read_frame(&mut tls).await.expect("reading frames");
            if kind == PING && flags & 1 == 0 {
                return;
            }
        }
    })
    .await;
    assert!(ping.is_ok(), "no PING from the front within 15 s");
    // Not answered: closed (the 30 s header timeout has not come).
    closed_within(&mut tls, Duration::from_secs(15), "unanswered PING").await;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "closed by the header timeout, not the keep-alive"
    );
}

/// Whether the kernel runs the keep-alive timer (`tr` 2 in /proc/net/tcp)
/// of the established loopback connection from `local` to `remote`.
fn keep_alive_timer(local: SocketAddr, remote: SocketAddr) -> Option<bool> {
    let hex = |a: SocketAddr| match a {
        SocketAddr::V4(v4) => format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(v4.ip().octets()),
            v4.port()
        ),
        SocketAddr::V6(_) => String::new(),
    };
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let (local, remote) = (hex(local), hex(remote));
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&local.as_str()) && f.get(2) == Some(&remote.as_str()))
            .then(|| f.get(5).is_some_and(|t| t.starts_with("02:")))
    })
}

/// `--max-apiserver-connections 2`: with two connections held, the third is
/// closed before its TLS handshake ends (and logged); once one of the two
/// is gone a new connection is served, and the one still held still
/// serves. Accepted connections carry TCP keep-alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_apiserver_connections_refuses_the_one_over_and_frees_slots() {
    let env = Env::start(
        &[],
        &[
            "--max-apiserver-connections",
            "2",
            "--http-header-timeout",
            "60s",
        ],
    )
    .await
    .unwrap();
    let first = env.client.connect(None, false).await.unwrap();
    let second = env.client.connect(None, false).await.unwrap();

    // The kernel probes the held connections: the cloud's end runs TCP's
    // keep-alive timer (unless another is due at the moment: looked at again).
    let client_end = first.get_ref().0.local_addr().unwrap();
    within_15s("TCP keep-alive on the cloud's end", || async {
        keep_alive_timer(env.kubelet_api, client_end)
            .unwrap_or(false)
            .then_some(())
    })
    .await;

    let third = tokio::time::timeout(Duration::from_secs(15), env.client.connect(None, false))
        .await
        .expect("the third connection's TLS handshake neither ended nor failed within 15 s");
    assert!(
        third.is_err(),
        "a third connection was served with the limit at 2"
    );
    assert!(
        env.cloud_log()
            .contains("refusing apiserver connection: --max-apiserver-connections reached"),
        "{}",
        env.cloud_log()
    );

    drop(first);
    let reply = within_15s("a connection after one was freed", || async {
        env.client.get("/metrics", "edge-1", None, &[]).await.ok()
    })
    .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.body);

    // The connection held all along is served too.
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(second))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = sender
        .send_request(
            Request::get("/metrics")
                .header("host", "edge-1")
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
}

/// A kubelet that lists `pods` and answers nothing else: every other
/// request is read and left without a response.
async fn silent_kubelet(pods: &'static [&'static str]) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let service = hyper::service::service_fn(move |req: Request<_>| async move {
                if req.uri().path() != "/pods" {
                    std::future::pending::<()>().await;
                }
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(
                    tether_tests::netns::pod_list_json(pods),
                ))))
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service),
            );
        }
    });
    addr
}

/// `--response-timeout 1s`: a kubelet that takes the request and never
/// answers gets the apiserver a 504 naming the node and the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_never_answers_gets_504_naming_the_response_timeout() {
    // The harness mints certificates for the nodes it starts and one more,
    // "edge-intruder": with no node of its own, the edge here is that one.
    let env = Env::start(&[], &["--response-timeout", "1s"])
        .await
        .unwrap();
    let kubelet = silent_kubelet(&["default/p9"]).await;
    let _edge = env
        .spawn_edge("edge-intruder", &format!("http://{kubelet}"), &[], &[])
        .await
        .unwrap();
    let reply = within_15s("an answer from the edge's node", || async {
        let r = env
            .client
            .get("/metrics", "edge-intruder", None, &[])
            .await
            .ok()?;
        // 404 until the edge's node is known.
        (r.status != StatusCode::NOT_FOUND).then_some(r)
    })
    .await;
    assert_eq!(reply.status, StatusCode::GATEWAY_TIMEOUT, "{}", reply.body);
    assert!(
        reply.body.contains("--response-timeout") && reply.body.contains("edge-intruder"),
        "{}",
        reply.body
    );
}

/// `--max-streams-per-edge 2` in the cloud: with two `logs -f` open to the
/// edge, a third request gets 503 naming the node and the flag; once one
/// follow ends, requests are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_streams_per_edge_refuses_the_one_over_with_503() {
    let env = Env::start(ONE, &["--max-streams-per-edge", "2"])
        .await
        .unwrap();
    let mut follows = Vec::new();
    for _ in 0..2 {
        let mut resp = env.client.follow_log("default/p1").await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        // Flowing: its first line arrived.
        let frame = tokio::time::timeout(Duration::from_secs(15), resp.body_mut().frame())
            .await
            .expect("no log line within 15 s");
        assert!(matches!(frame, Some(Ok(_))), "{frame:?}");
        follows.push(resp);
    }
    let reply = env
        .client
        .get("/containerLogs/default/p1/c", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.body
    );
    assert!(
        reply.body.contains("--max-streams-per-edge") && reply.body.contains("edge-1"),
        "{}",
        reply.body
    );
    // The follows still flow.
    for resp in &mut follows {
        let frame = tokio::time::timeout(Duration::from_secs(15), resp.body_mut().frame())
            .await
            .expect("a follow stalled after the refusal");
        assert!(matches!(frame, Some(Ok(_))), "{frame:?}");
    }

    follows.pop();
    let reply = within_15s("a request after a follow ended", || async {
        let r = env
            .client
            .get("/containerLogs/default/p1/c", "edge-1", None, &[])
            .await
            .ok()?;
        (r.status == StatusCode::OK).then_some(r)
    })
    .await;
    assert_eq!(reply.node(), Some("edge-1"));
}
