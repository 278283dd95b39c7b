//! The limits of the cloud's apiserver-facing side, each hit on the real
//! binaries: `--max-apiserver-connections` (the one over is closed, a freed
//! slot serves again), `--http-header-timeout` on an HTTP/2 connection that
//! sends no request, `--apiserver-keep-alive` (unanswered HTTP/2 PINGs close
//! the connection; accepted sockets carry TCP keep-alive),
//! `--response-timeout` (504 naming it), `--max-streams-per-edge` in the
//! cloud (503 naming it) and `--max-apiserver-streams-per-connection` (the
//! HTTP/2 stream past it refused, a freed one served).
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

/// The next HTTP/2 frame on `io`: (type, flags, stream, payload).
async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    io: &mut R,
) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    io.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; len];
    io.read_exact(&mut payload).await?;
    Ok((head[3], head[4], stream, payload))
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
            let (kind, flags, _, _) = read_frame(&mut tls).await.expect("reading frames");
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

/// A HEADERS frame opening HTTP/2 stream `id`: `GET {path}` to `edge-1`,
/// with no body (END_STREAM). HPACK by hand: `:method GET` and
/// `:scheme https` from the static table, `:path` and `:authority` as
/// literals with indexed names, not indexed.
fn h2_get_frame(id: u32, path: &str) -> Vec<u8> {
    const END_STREAM_AND_HEADERS: u8 = 0x1 | 0x4;
    let mut block = vec![0x82, 0x87];
    for (name_index, value) in [(4u8, path), (1, "edge-1")] {
        assert!(value.len() < 127, "{value}: a one-byte HPACK length");
        block.push(name_index);
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    h2_frame(H2_HEADERS, END_STREAM_AND_HEADERS, id, &block)
}

/// HTTP/2 frame types and error codes the stream-limit test speaks.
const H2_HEADERS: u8 = 1;
const H2_RST_STREAM: u8 = 3;
const H2_SETTINGS: u8 = 4;
const H2_SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 3;
const H2_REFUSED_STREAM: u32 = 7;
const H2_CANCEL: u32 = 8;

/// One HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut frame = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    frame.extend([kind, flags]);
    frame.extend(stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// Reads frames from `io` until one of type `kind` on `stream` comes (for
/// at most 15 s); returns it as (flags, payload), and panics on a
/// RST_STREAM of `stream` when that is not what was asked for.
async fn h2_await<R: tokio::io::AsyncRead + Unpin>(
    io: &mut R,
    kind: u8,
    stream: u32,
) -> (u8, Vec<u8>) {
    tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let (k, flags, s, payload) = read_frame(io).await.expect("reading frames");
            if s == stream && k == kind {
                return (flags, payload);
            }
            assert!(
                !(s == stream && k == H2_RST_STREAM),
                "stream {stream} reset ({payload:?}) while waiting for a frame of type {kind}"
            );
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no frame of type {kind} on stream {stream} within 15 s"))
}

/// `--max-apiserver-streams-per-connection 2`: the front announces 2 in its
/// SETTINGS (hyper's 200 before the flag); with two `logs -f` streams open
/// on one connection, a third stream the client opens anyway is refused
/// (RST_STREAM REFUSED_STREAM, h2's answer: the request was not processed
/// and may be retried); once the client cancels one of the two, a new
/// stream on the same connection is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http2_stream_past_max_apiserver_streams_per_connection_is_refused() {
    let env = Env::start(ONE, &["--max-apiserver-streams-per-connection", "2"])
        .await
        .unwrap();
    let follow = "/containerLogs/default/p1/c?follow=true";
    let mut tls = env.client.connect(None, true).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    tls.write_all(PREFACE_AND_SETTINGS).await.unwrap();

    // The server's SETTINGS (not an ACK) announce the bound.
    let settings = loop {
        let (flags, payload) = h2_await(&mut tls, H2_SETTINGS, 0).await;
        if flags & 1 == 0 {
            break payload;
        }
    };
    let announced = settings.chunks(6).find_map(|p| {
        (u16::from_be_bytes([p[0], p[1]]) == H2_SETTINGS_MAX_CONCURRENT_STREAMS)
            .then(|| u32::from_be_bytes([p[2], p[3], p[4], p[5]]))
    });
    assert_eq!(announced, Some(2), "SETTINGS {settings:?}");
    tls.write_all(&h2_frame(H2_SETTINGS, 1, 0, &[]))
        .await
        .unwrap();

    // Two follows, each answered (response HEADERS), then a third at once.
    for id in [1, 3] {
        tls.write_all(&h2_get_frame(id, follow)).await.unwrap();
        h2_await(&mut tls, H2_HEADERS, id).await;
    }
    tls.write_all(&h2_get_frame(5, follow)).await.unwrap();
    let (_, code) = h2_await(&mut tls, H2_RST_STREAM, 5).await;
    assert_eq!(
        code,
        H2_REFUSED_STREAM.to_be_bytes(),
        "stream 5 reset otherwise"
    );

    // One follow ends: the next stream is served.
    tls.write_all(&h2_frame(H2_RST_STREAM, 0, 1, &H2_CANCEL.to_be_bytes()))
        .await
        .unwrap();
    tls.write_all(&h2_get_frame(7, follow)).await.unwrap();
    h2_await(&mut tls, H2_HEADERS, 7).await;
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
