//! One logical stream → one request replayed against the kubelet.
//!
//! Reads the [`RequestHead`] the cloud wrote first, refuses paths Tether does
//! not forward (the same [`classify`] the cloud uses), connects to the one
//! configured kubelet, sends the request (streaming the body that follows the
//! head), and answers with a [`ResponseHead`]. After a `101` both ends become
//! a byte pipe; otherwise the response body streams back and our direction
//! ends cleanly only when the kubelet's body did. Every failure resets the
//! stream with a code the cloud turns into an HTTP status (kubelet
//! unreachable → 502).
//!
//! Heads are read and written within the head bound agreed with the cloud
//! (the smaller `--max-head-bytes` of the two, [`Limits::agree`]), which the
//! stream table hands to [`Forward::run`]: a kubelet response head larger
//! than that resets the stream with `LimitExceeded`, naming the bound (the
//! cloud answers 502 with it), instead of reaching a cloud that would refuse
//! it as a bad head. The cloud checks its request heads against the same
//! bound before it opens a stream (431); one that arrives over it anyway (a
//! replica that agreed a larger bound with this edge on an earlier
//! connection, and owns streams relayed to it now) is reset with
//! `LimitExceeded` naming the bound too, not as a malformed head.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tether_proto::frame::ResetCode;
use tether_proto::head::{
    encode_head, is_hop_by_hop, read_head, HeadError, RequestHead, ResponseHead,
};
use tether_proto::io::{ResumableIo, SharedStream};
use tether_proto::route::classify;
use tether_proto::Limits;
use tokio::io::AsyncWriteExt;
use tokio_util::io::ReaderStream;
use tracing::{debug, info, warn};

use crate::kubelet::{KubeletIo, KubeletTarget};

/// Replays streams against the kubelet.
pub struct Forward {
    pub target: Arc<KubeletTarget>,
    /// How long a new stream waits for the cloud's request head
    /// (`--request-head-timeout`).
    pub head_timeout: Duration,
}

/// The task driving one kubelet HTTP connection; dropping it closes the
/// connection.
struct KubeletConn(tokio::task::JoinHandle<()>);

impl Drop for KubeletConn {
    fn drop(&mut self) {
        self.0.abort();
    }
}

type ReqBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

impl Forward {
    /// Serves one stream to its end, reading and writing heads within
    /// `limits`: the wire bounds agreed with the cloud.
    pub async fn run(self: Arc<Self>, io: ResumableIo, limits: Limits) {
        let max_head = limits.max_head_bytes as usize;
        let shared = io.shared().clone();
        let (mut rd, mut wr) = tokio::io::split(io);
        // Bounded: a cloud that attaches a stream and never sends its head
        // must not hold the stream's slot (and this task) until the session
        // ends.
        let head = tokio::time::timeout(
            self.head_timeout,
            read_head::<RequestHead, _>(&mut rd, max_head),
        );
        let head = match head.await {
            Ok(Ok(h)) => h,
            Ok(Err(HeadError::TooLarge { len, max })) => {
                let why = format!(
                    "the cloud's request head ({len} bytes) exceeds the head bound agreed with \
                     the cloud (--max-head-bytes, the smaller of the edge's and the cloud's: \
                     {max} bytes)"
                );
                warn!(
                    head_bytes = len,
                    max_head_bytes = max,
                    "{why}; resetting the stream"
                );
                shared.reset(ResetCode::LimitExceeded, why);
                return;
            }
            Ok(Err(e)) => {
                warn!(error = %e, "bad request head from the cloud");
                shared.reset(ResetCode::ProtocolError, format!("bad request head: {e}"));
                return;
            }
            Err(_) => {
                let why = format!(
                    "no request head from the cloud within {:?} (--request-head-timeout)",
                    self.head_timeout
                );
                warn!("{why}; resetting the stream");
                shared.reset(ResetCode::ProtocolError, why);
                return;
            }
        };
        let path = head.path().to_string();
        if classify(&path).is_none() {
            warn!(?path, "refusing a path Tether does not forward");
            shared.reset(
                ResetCode::Refused,
                format!("path {path} is not forwarded by this edge"),
            );
            return;
        }
        let Ok(method) = http::Method::from_bytes(head.method.as_bytes()) else {
            shared.reset(
                ResetCode::Refused,
                format!("invalid method {:?}", head.method),
            );
            return;
        };
        debug!(%method, path = %head.path_and_query, "replaying against the kubelet");
        let kubelet = match self.target.connect().await {
            Ok(k) => k,
            Err(e) => {
                info!(error = format!("{e:#}"), "kubelet unreachable");
                shared.reset(ResetCode::KubeletUnreachable, format!("{e:#}"));
                return;
            }
        };
        let (mut sender, conn) = match hyper::client::conn::http1::Builder::new()
            // hyper's least buffer is 8 KiB; a head that fits in it but not
            // in `max_head` is caught when it is encoded below.
            .max_buf_size(max_head.max(MIN_HYPER_BUF))
            .handshake(TokioIo::new(kubelet))
            .await
        {
            Ok(x) => x,
            Err(e) => {
                shared.reset(
                    ResetCode::KubeletUnreachable,
                    format!("HTTP handshake with the kubelet: {e}"),
                );
                return;
            }
        };
        // Aborted when the cloud resets the stream: that closes the kubelet
        // connection (and so ends an exec process or a log follower) even
        // while we are only waiting on the kubelet.
        let conn_task = KubeletConn(tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                debug!(error = %e, "kubelet connection ended with an error");
            }
        }));
        let upgrade = head.is_upgrade();
        let mut builder = http::Request::builder()
            .method(method)
            .uri(head.path_and_query.as_str());
        for (name, value) in &head.headers {
            if is_hop_by_hop(name) && !(upgrade && (name == "connection" || name == "upgrade")) {
                continue;
            }
            builder = builder.header(name.as_str(), value.as_slice());
        }
        builder = builder.header(http::header::HOST, self.target.authority.as_str());
        // The body: what follows the head in the cloud's direction (none for
        // upgrades: those bytes belong to the upgraded protocol).
        let (body, rd): (ReqBody, _) = if head.has_body {
            let stream = ReaderStream::new(rd);
            (
                StreamBody::new(futures_util::StreamExt::map(stream, |r| r.map(Frame::data)))
                    .boxed(),
                None,
            )
        } else {
            (
                Empty::new().map_err(|never| match never {}).boxed(),
                Some(rd),
            )
        };
        let req = match builder.body(body) {
            Ok(r) => r,
            Err(e) => {
                shared.reset(
                    ResetCode::Refused,
                    format!("request head does not make a valid request: {e}"),
                );
                return;
            }
        };
        let sent = tokio::select! {
            r = sender.send_request(req) => r,
            (code, why) = shared.wait_reset() => {
                info!(?code, ?why, "stream reset while waiting for the kubelet's answer; closing the kubelet connection");
                return;
            }
        };
        // The request is out and answered: nothing more goes over this
        // connection. Dropping the sender lets hyper's connection task finish
        // (handing an upgraded connection over) instead of holding its
        // request channel and read buffer for the life of the session.
        drop(sender);
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) if e.is_parse_too_large() => {
                head_too_large(&shared, None, max_head);
                return;
            }
            Err(e) => {
                shared.reset(
                    ResetCode::KubeletUnreachable,
                    format!("kubelet request failed: {e}"),
                );
                return;
            }
        };
        let status = resp.status();
        let switching = status == http::StatusCode::SWITCHING_PROTOCOLS;
        let headers = resp
            .headers()
            .iter()
            .filter(|(n, _)| {
                !is_hop_by_hop(n.as_str())
                    || (switching
                        && (*n == http::header::CONNECTION || *n == http::header::UPGRADE))
            })
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect();
        let rh = ResponseHead {
            status: status.as_u16(),
            headers,
        };
        let bytes = match encode_head(&rh, max_head) {
            Ok(b) => b,
            Err(HeadError::TooLarge { len, .. }) => {
                head_too_large(&shared, Some(len), max_head);
                return;
            }
            Err(e) => {
                shared.reset(
                    ResetCode::LimitExceeded,
                    format!("kubelet response head: {e}"),
                );
                return;
            }
        };
        if wr.write_all(&bytes).await.is_err() {
            return;
        }
        if switching {
            let Some(rd) = rd else {
                shared.reset(
                    ResetCode::ProtocolError,
                    "kubelet upgraded a request with a body",
                );
                return;
            };
            let upgraded = match hyper::upgrade::on(&mut resp).await {
                Ok(u) => u,
                Err(e) => {
                    shared.reset(
                        ResetCode::KubeletUnreachable,
                        format!("kubelet upgrade: {e}"),
                    );
                    return;
                }
            };
            // hyper's connection task ended when it handed the connection
            // over; its handle is all that is left of it.
            drop(conn_task);
            // exec, attach, port-forward: someone may be typing.
            shared.mark_interactive();
            let mut io = rd.unsplit(wr);
            // The kubelet connection itself, out of hyper's wrapper: what
            // hyper read past the 101 goes to the cloud first, and then no
            // read buffer of hyper's stays with the session.
            let mut kubelet: Box<dyn KubeletIo> = match upgraded
                .downcast::<TokioIo<Box<dyn KubeletIo>>>()
            {
                Ok(parts) => {
                    if !parts.read_buf.is_empty() && io.write_all(&parts.read_buf).await.is_err() {
                        return;
                    }
                    parts.io.into_inner()
                }
                // Not reached (the type is the one handed to hyper above);
                // hyper's wrapper works too, with its read buffer.
                Err(upgraded) => Box::new(TokioIo::new(upgraded)),
            };
            match tether_proto::pump::copy_both(&mut kubelet, &mut io).await {
                Ok((to_kubelet, to_cloud)) => debug!(to_kubelet, to_cloud, "upgraded stream ended"),
                Err(e) => {
                    debug!(error = %e, "upgraded stream failed");
                    shared.reset(ResetCode::Cancelled, format!("kubelet side: {e}"));
                }
            }
            return;
        }
        let mut body = resp.into_body();
        loop {
            let frame = tokio::select! {
                f = body.frame() => f,
                (code, why) = shared.wait_reset() => {
                    info!(?code, ?why, "stream reset while waiting on the kubelet's body; closing the kubelet connection");
                    return;
                }
            };
            let Some(frame) = frame else { break };
            match frame {
                Ok(f) => {
                    if let Ok(data) = f.into_data() {
                        if wr.write_all(&data).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    info!(error = %e, "kubelet response body cut short");
                    shared.reset(ResetCode::Cancelled, format!("kubelet response body: {e}"));
                    return;
                }
            }
        }
        let _ = wr.shutdown().await;
    }
}

/// hyper's smallest read buffer (it asserts at least this).
const MIN_HYPER_BUF: usize = 8192;

/// Ends a stream whose kubelet response head is larger than `max`, the head
/// bound agreed with the cloud: `len` is the encoded head's size, `None` when
/// the kubelet's head did not even fit in hyper's read buffer. Logged (the
/// stream's span names the node) and reset with `LimitExceeded`, whose
/// message the cloud puts in its 502.
fn head_too_large(shared: &SharedStream, len: Option<usize>, max: usize) {
    let size = match len {
        Some(len) => format!("{len} bytes"),
        None => format!("over {} bytes", max.max(MIN_HYPER_BUF)),
    };
    let why = format!(
        "the kubelet's response head ({size}) exceeds the head bound agreed with the cloud \
         (--max-head-bytes, the smaller of the edge's and the cloud's: {max} bytes)"
    );
    warn!(
        head_bytes = len,
        max_head_bytes = max,
        "{why}; resetting the stream"
    );
    shared.reset(ResetCode::LimitExceeded, why);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tether_proto::frame::Frame;
    use tether_proto::io::SharedStream;
    use tether_proto::stream::StreamState;
    use tokio::io::AsyncReadExt;

    /// Reads a request head (up to its blank line) from the edge.
    async fn read_request(s: &mut tokio::net::TcpStream) {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "no request");
            got.extend_from_slice(&buf[..n]);
        }
    }

    /// A kubelet that reads one request, writes `answer`, then stays silent;
    /// reports how long after the answer its connection was closed.
    async fn silent_kubelet(
        answer: &'static [u8],
    ) -> (String, tokio::sync::oneshot::Receiver<Instant>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_request(&mut s).await;
            let mut buf = [0u8; 4096];
            s.write_all(answer).await.unwrap();
            // Bounded: the test gives up after 10 s anyway.
            let _ = tokio::time::timeout(Duration::from_secs(10), async {
                while s.read(&mut buf).await.map(|n| n > 0).unwrap_or(false) {}
            })
            .await;
            let _ = tx.send(Instant::now());
        });
        (addr, rx)
    }

    /// A forwarder to the plain-HTTP kubelet at `addr`, and stream 7's state.
    fn forward_to(addr: &str) -> (Arc<Forward>, Arc<SharedStream>, Limits) {
        let limits = Limits::default();
        let forward = Arc::new(Forward {
            target: crate::kubelet::testing::plain_target(addr, Duration::from_secs(2)),
            head_timeout: Duration::from_secs(30),
        });
        let shared = SharedStream::new(StreamState::new(7, (&limits).into()));
        (forward, shared, limits)
    }

    /// Stream 7 receives `head` from the cloud, as its first bytes; their length.
    fn deliver_head(shared: &SharedStream, limits: &Limits, head: RequestHead) -> u64 {
        let head = encode_head(&head, limits.max_head_bytes as usize).unwrap();
        let len = head.len() as u64;
        shared
            .with_state(|s| {
                s.on_frame(Frame::Data {
                    stream: 7,
                    offset: 0,
                    payload: head.into(),
                })
            })
            .unwrap();
        len
    }

    async fn reset_while_waiting(answer: &'static [u8]) -> Duration {
        let (addr, closed) = silent_kubelet(answer).await;
        let (forward, shared, limits) = forward_to(&addr);
        deliver_head(
            &shared,
            &limits,
            RequestHead {
                method: "GET".into(),
                path_and_query: "/containerLogs/default/p1/c?follow=true".into(),
                headers: vec![("accept".to_string(), b"*/*".to_vec())],
                has_body: false,
            },
        );
        let task = tokio::spawn(forward.run(ResumableIo::new(shared.clone()), limits));
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The cloud gives up (504, or the apiserver left): its Reset arrives.
        let reset_at = Instant::now();
        shared
            .with_state(|s| {
                s.on_frame(Frame::Reset {
                    stream: 7,
                    code: ResetCode::Cancelled,
                    message: "apiserver went away".into(),
                })
            })
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the forward did not end after the reset")
            .unwrap();
        let closed = closed.await.unwrap();
        closed.saturating_duration_since(reset_at)
    }

    #[tokio::test]
    async fn a_reset_while_waiting_for_the_head_closes_the_kubelet_connection() {
        let took = reset_while_waiting(b"").await;
        assert!(
            took < Duration::from_secs(2),
            "closed {took:?} after the reset"
        );
    }

    #[tokio::test]
    async fn a_reset_while_waiting_for_the_body_closes_the_kubelet_connection() {
        let took = reset_while_waiting(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        )
        .await;
        assert!(
            took < Duration::from_secs(2),
            "closed {took:?} after the reset"
        );
    }

    /// Waits (bounded) for `task` to end, and returns how stream 7 was reset.
    async fn reset_of(
        task: tokio::task::JoinHandle<()>,
        shared: &SharedStream,
    ) -> (ResetCode, String) {
        tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("the forward did not end")
            .unwrap();
        shared
            .with_state(|s| s.reset_reason().map(|(c, m)| (c, m.to_string())))
            .expect("the stream was not reset")
    }

    /// Item 4 of the control-stream audit: a cloud that attaches a stream
    /// and never sends its request head held the stream (and its task)
    /// until the session ended. Now the stream is reset after
    /// `--request-head-timeout`, naming it.
    #[tokio::test]
    async fn a_stream_whose_head_never_comes_is_reset_after_the_head_timeout() {
        const TIMEOUT: Duration = Duration::from_millis(500);
        // Never dialled: the head never comes.
        let (forward, shared, _) = forward_to("127.0.0.1:9");
        let forward = Arc::new(Forward {
            target: forward.target.clone(),
            head_timeout: TIMEOUT,
        });
        let start = Instant::now();
        let task = tokio::spawn(forward.run(ResumableIo::new(shared.clone()), Limits::default()));
        let (code, message) = reset_of(task, &shared).await;
        assert_eq!(code, ResetCode::ProtocolError, "{message}");
        assert!(message.contains("--request-head-timeout"), "{message}");
        assert!(
            start.elapsed() >= TIMEOUT,
            "reset after {:?}",
            start.elapsed()
        );
    }

    /// A kubelet response head over the head bound `run` is given ends the
    /// stream with `LimitExceeded` naming the bound: one that hyper parses
    /// (6 KB, in its 8 KiB buffer) and is too large to encode, and one too
    /// large for hyper's buffer (20 KB), which was a vague `KubeletUnreachable`
    /// ("kubelet request failed: message head is too large").
    #[tokio::test]
    async fn a_kubelet_response_head_over_the_bound_is_a_limit_error_naming_it() {
        let limits = Limits {
            max_head_bytes: 4096,
            ..Limits::default()
        };
        for (header, size) in [(6000, "bytes)"), (20_000, "(over 8192 bytes)")] {
            let addr = crate::kubelet::testing::answering_kubelet(
                crate::kubelet::testing::big_head_response(header),
            )
            .await;
            let (forward, shared, _) = forward_to(&addr);
            deliver_head(
                &shared,
                &limits,
                RequestHead {
                    method: "GET".into(),
                    path_and_query: "/containerLogs/default/p1/c".into(),
                    headers: vec![],
                    has_body: false,
                },
            );
            let task = tokio::spawn(forward.run(ResumableIo::new(shared.clone()), limits));
            let (code, message) = reset_of(task, &shared).await;
            assert_eq!(code, ResetCode::LimitExceeded, "{header}: {message}");
            assert!(message.contains(size), "{header}: {message}");
            assert!(
                message.contains(
                    "(--max-head-bytes, the smaller of the edge's and the cloud's: 4096 bytes)"
                ),
                "{header}: {message}"
            );
        }
    }

    /// A request head over the head bound `run` is given (one a replica sent
    /// within a larger bound it agreed with this edge on an earlier
    /// connection) ends the stream with `LimitExceeded` naming the bound and
    /// the head's size; it was a `ProtocolError` "bad request head".
    #[tokio::test]
    async fn a_request_head_over_the_bound_is_a_limit_error_naming_it() {
        let (forward, shared, limits) = forward_to("127.0.0.1:9");
        deliver_head(
            &shared,
            &limits,
            RequestHead {
                method: "GET".into(),
                path_and_query: "/containerLogs/default/p1/c".into(),
                headers: vec![("x-padding".into(), vec![b'a'; 6000])],
                has_body: false,
            },
        );
        let small = Limits {
            max_head_bytes: 4096,
            ..limits
        };
        let task = tokio::spawn(forward.run(ResumableIo::new(shared.clone()), small));
        let (code, message) = reset_of(task, &shared).await;
        assert_eq!(code, ResetCode::LimitExceeded, "{message}");
        assert!(
            message.contains("the cloud's request head (6046 bytes)"),
            "{message}"
        );
        assert!(
            message.contains(
                "(--max-head-bytes, the smaller of the edge's and the cloud's: 4096 bytes)"
            ),
            "{message}"
        );
    }

    /// `--kubelet-connect-timeout` bounds the TLS handshake too: a kubelet
    /// that accepts the TCP connection and never answers the handshake ends
    /// the stream with `KubeletUnreachable` (the cloud's 502), naming the
    /// timeout.
    #[tokio::test]
    async fn a_kubelet_that_never_finishes_tls_is_given_up_on_after_the_connect_timeout() {
        const TIMEOUT: Duration = Duration::from_secs(1);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let kubelet = tokio::spawn(async move {
            // Accepts and reads the ClientHello; never answers it.
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            while s.read(&mut buf).await.map(|n| n > 0).unwrap_or(false) {}
        });
        let cfg = crate::config::KubeletConfig {
            url: format!("https://{addr}").parse().unwrap(),
            ca: None,
            insecure_skip_tls_verify: true,
            client_cert: None,
            connect_timeout: TIMEOUT,
            pods_timeout: Duration::from_secs(2),
            pods_max_bytes: 1 << 20,
        };
        let limits = Limits::default();
        let forward = Arc::new(Forward {
            target: Arc::new(KubeletTarget::new(&cfg).unwrap()),
            head_timeout: Duration::from_secs(30),
        });
        let shared = SharedStream::new(StreamState::new(7, (&limits).into()));
        deliver_head(
            &shared,
            &limits,
            RequestHead {
                method: "GET".into(),
                path_and_query: "/containerLogs/default/p1/c".into(),
                headers: vec![],
                has_body: false,
            },
        );
        let start = Instant::now();
        let task = tokio::spawn(forward.run(ResumableIo::new(shared.clone()), limits));
        let (code, message) = reset_of(task, &shared).await;
        assert_eq!(code, ResetCode::KubeletUnreachable, "{message}");
        assert!(message.contains("timed out after 1s"), "{message}");
        assert!(
            start.elapsed() >= TIMEOUT,
            "reset after {:?}",
            start.elapsed()
        );
        kubelet.abort();
    }

    /// A kubelet that answers an upgrade with `101` and, in the same write,
    /// the upgraded protocol's first bytes; then echoes what it reads.
    async fn eager_kubelet() -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_request(&mut s).await;
            let mut buf = [0u8; 4096];
            s.write_all(
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: Upgrade\r\nupgrade: SPDY/3.1\r\n\r\nearly",
            )
            .await
            .unwrap();
            loop {
                let n = s.read(&mut buf).await.unwrap_or(0);
                if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        });
        addr
    }

    /// Everything the edge has sent on `shared` so far, as payload bytes.
    fn sent_bytes(shared: &SharedStream, into: &mut Vec<u8>) {
        shared.with_state(|s| {
            while let Some(f) = s.poll_transmit() {
                if let Frame::Data { payload, .. } = f {
                    into.extend_from_slice(&payload);
                }
            }
        });
    }

    #[tokio::test]
    async fn bytes_the_kubelet_sends_with_its_101_come_first_then_the_pipe() {
        let addr = eager_kubelet().await;
        let (forward, shared, limits) = forward_to(&addr);
        // Attached, as a new stream is, and the cloud's Attach already in.
        shared
            .with_state(|s| {
                s.attach_fresh()?;
                s.on_frame(Frame::Attach {
                    stream: 7,
                    delivered: 0,
                    fin_received: false,
                })
            })
            .unwrap();
        let head_len = deliver_head(
            &shared,
            &limits,
            RequestHead {
                method: "POST".into(),
                path_and_query: "/exec/default/p1/c?command=sh&stdin=1&stdout=1".into(),
                headers: vec![
                    ("connection".to_string(), b"Upgrade".to_vec()),
                    ("upgrade".to_string(), b"SPDY/3.1".to_vec()),
                ],
                has_body: false,
            },
        );
        let task = tokio::spawn(forward.run(ResumableIo::new(shared.clone()), limits));
        // Bounded: 5 s for the answer and the early bytes.
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        let rest = loop {
            sent_bytes(&shared, &mut out);
            let mut cur = std::io::Cursor::new(out.clone());
            if let Ok(h) = read_head::<ResponseHead, _>(&mut cur, 1 << 16).await {
                assert_eq!(h.status, 101);
                let rest = out[cur.position() as usize..].to_vec();
                if rest.len() >= 5 {
                    break rest;
                }
            }
            assert!(Instant::now() < deadline, "no 101 and early bytes: {out:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(rest, b"early");
        // Then the pipe: what the cloud sends comes back from the kubelet.
        shared
            .with_state(|s| {
                s.on_frame(Frame::Data {
                    stream: 7,
                    offset: head_len,
                    payload: bytes::Bytes::from_static(b"ping"),
                })
            })
            .unwrap();
        let mut echoed = Vec::new();
        while echoed.len() < 4 {
            sent_bytes(&shared, &mut echoed);
            assert!(Instant::now() < deadline, "no echo: {echoed:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(echoed, b"ping");
        task.abort();
    }
}
