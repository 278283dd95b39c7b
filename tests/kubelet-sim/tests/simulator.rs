//! End-to-end tests of the kubelet-sim binary: spawn it on an ephemeral port
//! and talk to it over real HTTP, WebSocket and SPDY connections.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use kubelet_sim::spdy::{Role, Session};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

struct Sim {
    addr: String,
    log_dir: PathBuf,
    _child: tokio::process::Child,
    _tmp: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(tag: &str) -> TempDir {
    let p = std::env::temp_dir().join(format!(
        "kubelet-sim-it-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&p).expect("create temp dir");
    TempDir(p)
}

async fn start(tag: &str) -> Sim {
    let tmp = temp_dir(tag);
    let log_dir = tmp.0.join("logs");
    let work_dir = tmp.0.join("work");
    std::fs::create_dir_all(&log_dir).expect("log dir");
    std::fs::create_dir_all(&work_dir).expect("work dir");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kubelet-sim"))
        .args(["--listen", "127.0.0.1:0", "--node-name", "test-node"])
        .args([
            "--pod",
            "default/p1=c1,c2",
            "--pod",
            "kube-system/p2/uid-2=main",
        ])
        .arg("--log-dir")
        .arg(&log_dir)
        .arg("--work-dir")
        .arg(&work_dir)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn kubelet-sim");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("startup timeout")
        .expect("read stdout")
        .expect("startup line");
    let addr = line
        .split("://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("address in startup line")
        .to_string();
    Sim {
        addr,
        log_dir,
        _child: child,
        _tmp: tmp,
    }
}

type Resp = http::Response<hyper::body::Incoming>;

async fn request(sim: &Sim, req: http::Request<Empty<Bytes>>) -> Resp {
    let tcp = TcpStream::connect(&sim.addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("handshake");
    tokio::spawn(conn.with_upgrades());
    sender.send_request(req).await.expect("send request")
}

fn get(path: &str) -> http::Request<Empty<Bytes>> {
    http::Request::get(path)
        .header("host", "kubelet")
        .body(Empty::new())
        .expect("request")
}

async fn body_string(resp: Resp) -> String {
    let b = resp.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8_lossy(&b).into_owned()
}

#[tokio::test]
async fn pods_health_and_errors() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let sim = start("pods").await;
        let r = request(&sim, get("/pods")).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kubelet-sim-node"], "test-node");
        let v: Value = serde_json::from_str(&body_string(r).await).expect("json");
        assert_eq!(v["kind"], "PodList");
        assert_eq!(v["apiVersion"], "v1");
        assert_eq!(v["items"][0]["metadata"]["name"], "p1");
        assert_eq!(v["items"][0]["metadata"]["namespace"], "default");
        assert_eq!(v["items"][0]["spec"]["nodeName"], "test-node");
        assert_eq!(v["items"][0]["spec"]["containers"][1]["name"], "c2");
        assert_eq!(v["items"][0]["status"]["phase"], "Running");
        assert_eq!(v["items"][1]["metadata"]["uid"], "uid-2");

        let r = request(&sim, get("/healthz")).await;
        assert_eq!(body_string(r).await, "ok");
        let r = request(&sim, get("/metrics/resource")).await;
        assert!(body_string(r)
            .await
            .contains("node_cpu_usage_seconds_total"));
        let r = request(&sim, get("/nope")).await;
        assert_eq!(r.status(), 404);
        assert_eq!(r.headers()["x-kubelet-sim-node"], "test-node");
        let r = request(&sim, get("/exec/default/p1/c1?command=true&output=1")).await;
        assert_eq!(r.status(), 400);
        assert!(body_string(r).await.contains("Upgrade request required"));
        let r = request(&sim, get("/exec/default/p1/zz?command=true&output=1")).await;
        assert_eq!(r.status(), 404);
        let r = request(&sim, get("/containerLogs/default/p1/c1?tailLines=x")).await;
        assert_eq!(r.status(), 400);
        let r = request(&sim, get("/debug/echo-headers?a=b")).await;
        let v: Value = serde_json::from_str(&body_string(r).await).expect("json");
        assert_eq!(v["method"], "GET");
        assert_eq!(v["query"], "a=b");
        assert_eq!(v["headers"]["host"], "kubelet");
    })
    .await
    .expect("test timed out");
}

#[tokio::test]
async fn container_logs_tail_and_follow() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let sim = start("logs").await;
        let path = sim.log_dir.join("default_p1_c1.log");
        std::fs::write(&path, "one\ntwo\nthree\nfour\nfive\n").expect("write log");

        let r = request(&sim, get("/containerLogs/default/p1/c1?tailLines=2")).await;
        assert_eq!(r.status(), 200);
        assert_eq!(body_string(r).await, "four\nfive\n");
        let r = request(&sim, get("/containerLogs/default/p1/c1?limitBytes=6")).await;
        assert_eq!(body_string(r).await, "one\ntw");
        let r = request(
            &sim,
            get("/containerLogs/default/p1/c1?tailLines=1&timestamps=true"),
        )
        .await;
        let s = body_string(r).await;
        assert!(s.ends_with("Z five\n"), "{s:?}");
        let r = request(&sim, get("/containerLogs/default/p1/nope")).await;
        assert_eq!(r.status(), 404);

        let r = request(
            &sim,
            get("/containerLogs/default/p1/c1?follow=true&tailLines=1"),
        )
        .await;
        assert_eq!(r.status(), 200);
        let mut body = r.into_body();
        let mut got = String::new();
        let mut expect = String::from("five\n");
        let mut next = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while got != expect || next < 20 {
            if got == expect {
                // Append the next line while the client is following.
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(&path)
                    .expect("open log");
                writeln!(f, "appended {next}").expect("append");
                expect.push_str(&format!("appended {next}\n"));
                next += 1;
            }
            let frame = tokio::time::timeout_at(deadline, body.frame())
                .await
                .expect("follow stalled")
                .expect("stream ended")
                .expect("frame");
            if let Ok(d) = frame.into_data() {
                got.push_str(&String::from_utf8_lossy(&d));
            }
            assert!(
                expect.starts_with(&got),
                "got {got:?}, expected prefix of {expect:?}"
            );
        }
        assert_eq!(got, expect);
    })
    .await
    .expect("test timed out");
}

/// Collected output of a WebSocket exec.
#[derive(Default, Debug)]
struct WsResult {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    error: Vec<u8>,
    closed: bool,
}

async fn ws_exec(
    sim: &Sim,
    path_query: &str,
    stdin: Option<&[u8]>,
    resize: Option<&str>,
) -> WsResult {
    let mut req = format!("ws://{}{path_query}", sim.addr)
        .into_client_request()
        .expect("ws request");
    req.headers_mut().insert(
        "sec-websocket-protocol",
        "v5.channel.k8s.io".parse().expect("header"),
    );
    let tcp = TcpStream::connect(&sim.addr).await.expect("connect");
    let (mut ws, resp) = tokio_tungstenite::client_async(req, tcp)
        .await
        .expect("websocket handshake");
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "v5.channel.k8s.io"
    );
    assert_eq!(resp.headers()["x-kubelet-sim-node"], "test-node");
    if let Some(r) = resize {
        let mut m = vec![4u8];
        m.extend_from_slice(r.as_bytes());
        ws.send(Message::Binary(m.into()))
            .await
            .expect("send resize");
    }
    if let Some(data) = stdin {
        let mut m = vec![0u8];
        m.extend_from_slice(data);
        ws.send(Message::Binary(m.into()))
            .await
            .expect("send stdin");
        ws.send(Message::Binary(vec![255u8, 0].into()))
            .await
            .expect("close stdin");
    }
    let mut res = WsResult::default();
    while let Some(msg) = ws.next().await {
        match msg.expect("ws message") {
            Message::Binary(b) => match b.split_first() {
                Some((1, rest)) => res.stdout.extend_from_slice(rest),
                Some((2, rest)) => res.stderr.extend_from_slice(rest),
                Some((3, rest)) => res.error.extend_from_slice(rest),
                other => panic!("unexpected message {other:?}"),
            },
            Message::Close(_) => {
                res.closed = true;
                break;
            }
            _ => {}
        }
    }
    res
}

#[tokio::test]
async fn exec_websocket_v5_separates_streams_and_reports_exit_code() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let sim = start("ws").await;
        let res = ws_exec(
            &sim,
            "/exec/default/p1/c1?command=sh&command=-c&command=echo%20out%3B%20echo%20err%20%3E%262%3B%20exit%203&output=1&error=1",
            None,
            None,
        )
        .await;
        assert_eq!(String::from_utf8_lossy(&res.stdout), "out\n");
        assert_eq!(String::from_utf8_lossy(&res.stderr), "err\n");
        assert!(res.closed);
        let status: Value = serde_json::from_slice(&res.error).expect("status json");
        assert_eq!(status["status"], "Failure");
        assert_eq!(status["reason"], "NonZeroExitCode");
        assert_eq!(status["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(status["details"]["causes"][0]["message"], "3");

        // stdin with v5 close-channel, and success status.
        let res = ws_exec(&sim, "/exec/default/p1/c1?command=cat&input=1&output=1&error=1", Some(b"via ws\n"), None).await;
        assert_eq!(String::from_utf8_lossy(&res.stdout), "via ws\n");
        let status: Value = serde_json::from_slice(&res.error).expect("status json");
        assert_eq!(status["status"], "Success");

        // A real pty that sees the requested window size.
        let res = ws_exec(
            &sim,
            "/exec/default/p1/c1?command=stty&command=size&output=1&tty=1",
            None,
            Some(r#"{"Width":123,"Height":45}"#),
        )
        .await;
        assert!(String::from_utf8_lossy(&res.stdout).contains("45 123"), "{res:?}");
    })
    .await
    .expect("test timed out");
}

async fn spdy_upgrade(sim: &Sim, path_query: &str, versions: &str) -> (Resp, Session) {
    let req = http::Request::post(path_query)
        .header("host", "kubelet")
        .header("connection", "Upgrade")
        .header("upgrade", "SPDY/3.1")
        .header("x-stream-protocol-version", versions)
        .body(Empty::<Bytes>::new())
        .expect("request");
    let mut resp = request(sim, req).await;
    assert_eq!(resp.status(), 101);
    let upgraded = hyper::upgrade::on(&mut resp).await.expect("upgrade");
    let session = Session::new(TokioIo::new(upgraded), Role::Client).expect("session");
    (resp, session)
}

fn stream_headers(kind: &str) -> Vec<(String, String)> {
    vec![("streamType".to_string(), kind.to_string())]
}

#[tokio::test]
async fn exec_spdy_cat_with_stdin_half_close() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let sim = start("spdy").await;
        let (resp, session) = spdy_upgrade(
            &sim,
            "/exec/default/p1/c1?command=cat&input=1&output=1&error=1",
            "v4.channel.k8s.io, v3.channel.k8s.io",
        )
        .await;
        assert_eq!(
            resp.headers()["x-stream-protocol-version"],
            "v4.channel.k8s.io"
        );
        assert_eq!(resp.headers()["x-kubelet-sim-node"], "test-node");
        let mut error = session
            .open_stream(stream_headers("error"), false)
            .await
            .expect("error");
        let stdin = session
            .open_stream(stream_headers("stdin"), false)
            .await
            .expect("stdin");
        let mut stdout = session
            .open_stream(stream_headers("stdout"), false)
            .await
            .expect("stdout");
        let mut stderr = session
            .open_stream(stream_headers("stderr"), false)
            .await
            .expect("stderr");
        session.ping(Duration::from_secs(5)).await.expect("ping");
        let payload: Vec<u8> = (0..100_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        stdin.writer().write(&payload).expect("write stdin");
        stdin.writer().close();
        let mut out = Vec::new();
        while let Some(b) = stdout.read().await {
            out.extend_from_slice(&b);
        }
        assert_eq!(out.len(), payload.len());
        assert!(out == payload);
        let mut err = Vec::new();
        while let Some(b) = stderr.read().await {
            err.extend_from_slice(&b);
        }
        assert!(err.is_empty());
        let mut status = Vec::new();
        while let Some(b) = error.read().await {
            status.extend_from_slice(&b);
        }
        let status: Value = serde_json::from_slice(&status).expect("status");
        assert_eq!(status["status"], "Success");
        // The server closes the connection after the exec.
        tokio::time::timeout(Duration::from_secs(10), session.closed())
            .await
            .expect("server closed the connection");
    })
    .await
    .expect("test timed out");
}

#[tokio::test]
async fn portforward_spdy_echo() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let sim = start("pf").await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            if let Ok((mut s, _)) = listener.accept().await {
                let mut buf = Vec::new();
                let _ = s.read_to_end(&mut buf).await;
                buf.reverse();
                let _ = s.write_all(&buf).await;
            }
        });
        let (_resp, session) =
            spdy_upgrade(&sim, "/portForward/default/p1", "portforward.k8s.io").await;
        let hdrs = |t: &str| {
            vec![
                ("streamType".to_string(), t.to_string()),
                ("port".to_string(), port.to_string()),
                ("requestID".to_string(), "0".to_string()),
            ]
        };
        let error = session
            .open_stream(hdrs("error"), false)
            .await
            .expect("error");
        error.writer().close();
        let mut data = session
            .open_stream(hdrs("data"), false)
            .await
            .expect("data");
        data.writer().write(b"forwarded").expect("write");
        data.writer().close();
        let mut got = Vec::new();
        while let Some(b) = data.read().await {
            got.extend_from_slice(&b);
        }
        assert_eq!(got, b"dedrawrof");

        // A port nobody listens on: error text on the error stream.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let h = |t: &str| {
            vec![
                ("streamType".to_string(), t.to_string()),
                ("port".to_string(), dead.to_string()),
                ("requestID".to_string(), "1".to_string()),
            ]
        };
        let mut error = session.open_stream(h("error"), false).await.expect("error");
        error.writer().close();
        let _data = session.open_stream(h("data"), false).await.expect("data");
        let mut msg = Vec::new();
        while let Some(b) = error.read().await {
            msg.extend_from_slice(&b);
        }
        assert!(
            String::from_utf8_lossy(&msg).contains("error forwarding port"),
            "{msg:?}"
        );
    })
    .await
    .expect("test timed out");
}

#[tokio::test]
async fn attach_keeps_main_process_across_clients() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let sim = start("attach").await;
        let mut pids = Vec::new();
        for word in ["first", "second"] {
            let mut req = format!(
                "ws://{}/attach/default/p1/c2?input=1&output=1&error=1",
                sim.addr
            )
            .into_client_request()
            .expect("ws request");
            req.headers_mut().insert(
                "sec-websocket-protocol",
                "v5.channel.k8s.io".parse().expect("header"),
            );
            let tcp = TcpStream::connect(&sim.addr).await.expect("connect");
            let (mut ws, _) = tokio_tungstenite::client_async(req, tcp)
                .await
                .expect("handshake");
            let mut m = vec![0u8];
            m.extend_from_slice(format!("echo {word} $$\n").as_bytes());
            ws.send(Message::Binary(m.into())).await.expect("send");
            let mut out = Vec::new();
            while !String::from_utf8_lossy(&out).contains('\n') {
                match ws.next().await {
                    Some(Ok(Message::Binary(b))) if b.first() == Some(&1) => {
                        out.extend_from_slice(&b[1..])
                    }
                    Some(Ok(_)) => {}
                    other => panic!("attach ended early: {other:?}"),
                }
            }
            let s = String::from_utf8_lossy(&out).into_owned();
            assert!(s.starts_with(word), "{s:?}");
            pids.push(s.split_whitespace().nth(1).map(str::to_string));
            let _ = ws.close(None).await;
        }
        // Both clients talked to the same shell.
        assert!(pids[0].is_some());
        assert_eq!(pids[0], pids[1]);
    })
    .await
    .expect("test timed out");
}

#[tokio::test]
async fn portforward_legacy_websocket_channels() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let sim = start("wspf").await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            if let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n].to_ascii_uppercase()).await.is_err() {
                        break;
                    }
                }
            }
        });
        let mut req = format!("ws://{}/portForward/default/p1?port={port}", sim.addr)
            .into_client_request()
            .expect("ws request");
        req.headers_mut().insert(
            "sec-websocket-protocol",
            "v4.channel.k8s.io".parse().expect("header"),
        );
        let tcp = TcpStream::connect(&sim.addr).await.expect("connect");
        let (mut ws, _) = tokio_tungstenite::client_async(req, tcp)
            .await
            .expect("handshake");
        let le = port.to_le_bytes();
        for ch in [0u8, 1] {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => assert_eq!(&b[..], &[ch, le[0], le[1]]),
                other => panic!("expected port announcement, got {other:?}"),
            }
        }
        ws.send(Message::Binary(Bytes::from_static(b"\x00hello")))
            .await
            .expect("send");
        let mut got = Vec::new();
        while got.len() < 5 {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) if b.first() == Some(&0) => {
                    got.extend_from_slice(&b[1..])
                }
                Some(Ok(_)) => {}
                other => panic!("stream ended: {other:?}"),
            }
        }
        assert_eq!(got, b"HELLO");
    })
    .await
    .expect("test timed out");
}
