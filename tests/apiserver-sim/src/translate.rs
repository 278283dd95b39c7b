//! kube-apiserver's stream translator (feature gate `TranslateStreamCloseWebsocketRequests`,
//! on by default since 1.30): an exec or attach requested over WebSocket with the
//! `v5.channel.k8s.io` subprotocol offered is accepted here as a WebSocket (`v5` or `v4`
//! channel protocol, the client's first choice), while the kubelet gets what
//! kube-apiserver's SPDY executor sends: an SPDY/3.1 upgrade with
//! `X-Stream-Protocol-Version: v4.channel.k8s.io` and one SPDY stream per `streamType`
//! (error, stdin, stdout, stderr, resize). Payload bytes are copied unchanged both ways:
//! WebSocket channel 0/4 → stdin/resize streams, stdout/stderr/error streams → channels
//! 1/2/3; a v5 close of channel 0 half-closes the stdin stream. The WebSocket closes once
//! the kubelet has ended stdout, stderr and error (the error stream carries the exit
//! status). SPDY framing and header compression come from kubelet-sim's `spdy` module.

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{header, HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kubelet_sim::spdy::{self, Session};
use kubelet_sim::websocket::{self as chan, ChannelMessage, Encoding};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::body::Body;
use crate::headers;
use crate::kubelet::{Kubelets, Location};
use crate::query::Query;
use crate::status::ApiError;
use crate::wsbridge::{self, CLOSE_TIMEOUT};

/// The SPDY remotecommand protocol offered to the kubelet.
pub const KUBELET_PROTOCOL: &str = "v4.channel.k8s.io";
/// WebSocket subprotocols the translator accepts from the client.
const CLIENT_PROTOCOLS: &[&str] = &[chan::V5_CHANNEL, chan::V4_CHANNEL];

/// How apiserver-sim carries exec/attach requested over WebSocket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StreamTranslation {
    /// WebSocket to the client, SPDY to the kubelet (kube-apiserver's default).
    Translate,
    /// Pass the WebSocket upgrade through to the kubelet untouched.
    Passthrough,
}

/// Which streams the client asked for (`stdin`, `stdout`, `stderr`, `tty` query flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams {
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

impl Streams {
    pub fn from_query(q: &Query) -> Self {
        Streams {
            stdin: q.flag("stdin"),
            stdout: q.flag("stdout"),
            stderr: q.flag("stderr"),
            tty: q.flag("tty"),
        }
    }

    /// The `streamType`s the SPDY executor opens, in its order: error first; stderr is
    /// merged into stdout under a tty; resize only with a tty.
    fn stream_types(&self) -> Vec<(&'static str, Option<u8>)> {
        let mut v = vec![("error", Some(chan::ERROR))];
        if self.stdin {
            v.push(("stdin", None));
        }
        if self.stdout {
            v.push(("stdout", Some(chan::STDOUT)));
        }
        if self.stderr && !self.tty {
            v.push(("stderr", Some(chan::STDERR)));
        }
        if self.tty {
            v.push(("resize", None));
        }
        v
    }
}

/// Whether kube-apiserver would translate this request: a WebSocket upgrade offering
/// the stream-close protocol `v5.channel.k8s.io`.
pub fn wants_translation(headers: &HeaderMap) -> bool {
    headers::is_websocket_upgrade(headers) && headers::offers_ws_protocol(headers, chan::V5_CHANNEL)
}

/// The client's first offered subprotocol the translator speaks.
fn negotiate(headers: &HeaderMap) -> Option<&'static str> {
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .find_map(|o| CLIENT_PROTOCOLS.iter().find(|p| **p == o).copied())
}

/// The SPDY upgrade request kube-apiserver's executor sends to the kubelet.
pub fn kubelet_request(loc: &Location) -> Request<Body> {
    wsbridge::spdy_request(loc, KUBELET_PROTOCOL)
}

/// Serves an exec/attach WebSocket request by translating it to SPDY towards `loc`.
pub async fn serve(
    mut req: Request<Incoming>,
    loc: Location,
    streams: Streams,
    kubelets: &Kubelets,
) -> Response<Body> {
    let key = match wsbridge::websocket_key(&req) {
        Ok(k) => k,
        Err(resp) => return resp,
    };
    let Some(protocol) = negotiate(req.headers()) else {
        return ApiError::bad_request(format!(
            "none of the offered websocket protocols is supported; supported: {CLIENT_PROTOCOLS:?}"
        ))
        .into_response();
    };
    let client_upgrade = hyper::upgrade::on(&mut req);

    let mut resp = match kubelets.send(&loc, kubelet_request(&loc)).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "apiserver-sim: SPDY upgrade to {} failed: {e:#}",
                loc.log_url()
            );
            return ApiError::backend(format!("error dialing backend: {e:#}")).into_response();
        }
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return wsbridge::not_upgraded(resp);
    }
    let negotiated = resp
        .headers()
        .get("x-stream-protocol-version")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let url = loc.log_url();
    if negotiated != KUBELET_PROTOCOL {
        eprintln!("apiserver-sim: kubelet {url} answered SPDY with protocol {negotiated:?}, want {KUBELET_PROTOCOL}");
        return ApiError::new(
            StatusCode::BAD_GATEWAY,
            "InternalError",
            format!("kubelet negotiated unsupported stream protocol {negotiated:?}"),
        )
        .into_response();
    }
    eprintln!(
        "apiserver-sim: translating {url}: client WebSocket {protocol}, kubelet negotiated SPDY/3.1 {negotiated}"
    );
    let kubelet_upgrade = hyper::upgrade::on(&mut resp);

    let to_client = wsbridge::accept(&key, protocol);

    tokio::spawn(async move {
        let (client, kubelet) = match tokio::join!(client_upgrade, kubelet_upgrade) {
            (Ok(c), Ok(k)) => (c, k),
            (c, k) => {
                eprintln!(
                    "apiserver-sim: translated stream {url}: client {:?} kubelet {:?}",
                    c.err(),
                    k.err()
                );
                return;
            }
        };
        let ws = wsbridge::server_socket(client).await;
        let v5 = protocol == chan::V5_CHANNEL;
        match relay(ws, TokioIo::new(kubelet), streams, v5).await {
            Ok(s) => eprintln!(
                "apiserver-sim: translated stream {url} closed: {} (stdin {} bytes, stdout {}, stderr {}, error {})",
                s.why, s.stdin, s.stdout, s.stderr, s.error
            ),
            Err(e) => eprintln!("apiserver-sim: translated stream {url} failed: {e:#}"),
        }
    });
    to_client
}

/// What one translated session carried.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub stdin: u64,
    pub stdout: u64,
    pub stderr: u64,
    pub error: u64,
    pub why: String,
}

/// Opens the SPDY streams on `kubelet` and copies between them and the WebSocket
/// channels of `ws` until the kubelet has ended its output streams (then the WebSocket
/// is closed normally) or the client went away (then the SPDY session is closed).
pub async fn relay<C, K>(
    ws: WebSocketStream<C>,
    kubelet: K,
    streams: Streams,
    v5: bool,
) -> anyhow::Result<Summary>
where
    C: AsyncRead + AsyncWrite + Unpin,
    K: AsyncRead + AsyncWrite + Send + 'static,
{
    let session = Session::new(kubelet, spdy::Role::Client)?;
    let mut ws = ws;
    let (mut stdin, mut resize, outputs) = match open_streams(&session, streams).await {
        Ok(opened) => opened,
        Err(e) => {
            // As kube-apiserver: the failure reaches kubectl as a Status on the error
            // channel, then a normal close.
            let status = ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                format!("error opening the kubelet's streams: {e:#}"),
            )
            .to_json()
            .to_string();
            let _ = tokio::time::timeout(
                CLOSE_TIMEOUT,
                ws.send(chan::encode(
                    Encoding::Binary,
                    chan::ERROR,
                    status.as_bytes(),
                )),
            )
            .await;
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, ws.close(Some(normal_close()))).await;
            let _ = tokio::time::timeout(CLOSE_TIMEOUT * 2, session.close()).await;
            return Err(e);
        }
    };

    // Every output stream forwards into one queue; the queue ends when all have ended.
    let (out_tx, mut out_rx) = mpsc::channel::<(u8, Bytes)>(64);
    for (mut rx, ch) in outputs {
        let tx = out_tx.clone();
        tokio::spawn(async move {
            while let Some(b) = rx.recv().await {
                if !b.is_empty() && tx.send((ch, b)).await.is_err() {
                    break;
                }
            }
        });
    }
    drop(out_tx);

    let mut sum = Summary::default();
    let mut client_open = true;
    let why = loop {
        tokio::select! {
            out = out_rx.recv() => match out {
                Some((ch, data)) => {
                    let n = data.len() as u64;
                    match ch {
                        chan::STDOUT => sum.stdout += n,
                        chan::STDERR => sum.stderr += n,
                        _ => sum.error += n,
                    }
                    if let Err(e) = ws.send(chan::encode(Encoding::Binary, ch, &data)).await {
                        break format!("client write: {e}");
                    }
                }
                None => break "kubelet ended its streams".to_string(),
            },
            msg = ws.next(), if client_open => match msg {
                Some(Ok(m @ (Message::Binary(_) | Message::Text(_)))) => {
                    match chan::decode(Encoding::Binary, v5, &m) {
                        Ok(Some(ChannelMessage::Data(chan::STDIN, b))) => {
                            sum.stdin += b.len() as u64;
                            if let Some(w) = &stdin {
                                if let Err(e) = w.write(&b) {
                                    break format!("kubelet stdin: {e}");
                                }
                            }
                        }
                        Ok(Some(ChannelMessage::Data(chan::RESIZE, b))) => {
                            if let Some(w) = &resize {
                                if let Err(e) = w.write(&b) {
                                    break format!("kubelet resize: {e}");
                                }
                            }
                        }
                        Ok(Some(ChannelMessage::CloseChannel(chan::STDIN))) => {
                            if let Some(w) = stdin.take() {
                                w.close();
                            }
                        }
                        Ok(Some(ChannelMessage::CloseChannel(chan::RESIZE))) => {
                            if let Some(w) = resize.take() {
                                w.close();
                            }
                        }
                        Ok(_) => {}
                        Err(e) => break format!("client sent a bad channel message: {e}"),
                    }
                }
                Some(Ok(Message::Ping(_))) => {
                    // tungstenite queued the pong; push it out now.
                    if let Err(e) = ws.flush().await {
                        break format!("client pong: {e}");
                    }
                }
                Some(Ok(Message::Pong(_))) | Some(Ok(Message::Frame(_))) => {}
                Some(Ok(Message::Close(_))) | None => {
                    client_open = false;
                    break "client closed".to_string();
                }
                Some(Err(e)) => break format!("client: {e}"),
            },
        }
    };
    sum.why = why;
    if client_open {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, ws.close(Some(normal_close()))).await;
    }
    let _ = tokio::time::timeout(CLOSE_TIMEOUT * 2, session.close()).await;
    Ok(sum)
}

/// A normal closure: client-go reads code 1000 as the end of every channel, any other
/// code (1005 "no status" included) as an error.
fn normal_close() -> CloseFrame {
    CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    }
}

/// The streams of one session: stdin and resize writers, output receivers with the
/// WebSocket channel each feeds.
type Opened = (
    Option<spdy::StreamWriter>,
    Option<spdy::StreamWriter>,
    Vec<(mpsc::UnboundedReceiver<Bytes>, u8)>,
);

/// Opens the executor's streams in its order, each waiting for its SYN_REPLY.
async fn open_streams(session: &Session, streams: Streams) -> anyhow::Result<Opened> {
    let (mut stdin, mut resize, mut outputs) = (None, None, Vec::new());
    for (kind, channel) in streams.stream_types() {
        let s = tokio::time::timeout(
            CLOSE_TIMEOUT * 6,
            session.open_stream(vec![("streamtype".into(), kind.into())], false),
        )
        .await
        .map_err(|_| anyhow::anyhow!("opening SPDY stream {kind} timed out"))??;
        let (rx, writer) = s.split();
        match (kind, channel) {
            ("stdin", _) => stdin = Some(writer),
            ("resize", _) => resize = Some(writer),
            (_, Some(ch)) => outputs.push((rx, ch)),
            _ => {}
        }
    }
    Ok((stdin, resize, outputs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Node;
    use http::{HeaderValue, Method};
    use std::time::Duration;
    use tokio_tungstenite::tungstenite::protocol::Role;

    const T: Duration = Duration::from_secs(10);

    fn ws_headers(protocols: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_str(protocols).unwrap(),
        );
        h
    }

    #[test]
    fn translation_only_for_v5_offers_and_client_order_wins() {
        let h = ws_headers("v5.channel.k8s.io, v4.channel.k8s.io");
        assert!(wants_translation(&h));
        assert_eq!(negotiate(&h), Some(chan::V5_CHANNEL));
        let h = ws_headers("v4.channel.k8s.io,v5.channel.k8s.io");
        assert_eq!(negotiate(&h), Some(chan::V4_CHANNEL));
        assert!(!wants_translation(&ws_headers("v4.channel.k8s.io")));
        assert!(!wants_translation(&ws_headers(
            "SPDY/3.1+portforward.k8s.io"
        )));
        assert_eq!(negotiate(&ws_headers("base64.channel.k8s.io")), None);
    }

    #[test]
    fn kubelet_request_is_spdy_v4() {
        let n = Node::parse("edge-1=edge-1.example:10350").unwrap();
        let loc = Location::new(&n, "/exec/default/p1/c1".into(), "output=1".into());
        let r = kubelet_request(&loc);
        assert_eq!(r.method(), Method::POST);
        assert_eq!(r.headers()[header::HOST], "edge-1.example:10350");
        assert_eq!(r.headers()[header::UPGRADE], "SPDY/3.1");
        assert_eq!(
            r.headers()["x-stream-protocol-version"],
            "v4.channel.k8s.io"
        );
    }

    #[test]
    fn stream_types_follow_the_executor() {
        let all = Streams {
            stdin: true,
            stdout: true,
            stderr: true,
            tty: false,
        };
        let kinds: Vec<_> = all.stream_types().into_iter().map(|(k, _)| k).collect();
        assert_eq!(kinds, ["error", "stdin", "stdout", "stderr"]);
        let tty = Streams { tty: true, ..all };
        let kinds: Vec<_> = tty.stream_types().into_iter().map(|(k, _)| k).collect();
        assert_eq!(kinds, ["error", "stdin", "stdout", "resize"]);
    }

    /// A kubelet on the far side of a duplex: accepts the executor's streams by type.
    async fn accept_all(
        session: &mut Session,
        n: usize,
    ) -> std::collections::HashMap<String, spdy::Stream> {
        let mut m = std::collections::HashMap::new();
        for _ in 0..n {
            let s = tokio::time::timeout(T, session.accept())
                .await
                .unwrap()
                .unwrap();
            let kind = s.header("streamtype").unwrap().to_string();
            m.insert(kind, s);
        }
        m
    }

    /// The next binary message, or the close code once the server closed.
    async fn next_data(
        client: &mut WebSocketStream<tokio::io::DuplexStream>,
    ) -> Result<Bytes, Option<CloseCode>> {
        loop {
            match tokio::time::timeout(T, client.next()).await.unwrap() {
                Some(Ok(Message::Binary(b))) => return Ok(b),
                Some(Ok(Message::Close(c))) => return Err(c.map(|c| c.code)),
                None => return Err(None),
                Some(Ok(_)) => continue,
                Some(Err(e)) => panic!("client: {e}"),
            }
        }
    }

    #[tokio::test]
    async fn v5_exec_round_trip_with_stdin_close_and_exit_code() {
        let (client_io, server_io) = tokio::io::duplex(256 * 1024);
        let (kubelet_io, kubelet_far) = tokio::io::duplex(256 * 1024);
        let server_ws = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let streams = Streams {
            stdin: true,
            stdout: true,
            stderr: true,
            tty: false,
        };
        let task = tokio::spawn(relay(server_ws, kubelet_io, streams, true));
        let mut client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let mut kubelet = Session::new(kubelet_far, spdy::Role::Server).unwrap();
        let mut s = accept_all(&mut kubelet, 4).await;
        let ids: Vec<u32> = ["error", "stdin", "stdout", "stderr"]
            .iter()
            .map(|k| s[*k].id)
            .collect();
        assert_eq!(ids, [1, 3, 5, 7], "the executor's order, client stream ids");

        // stdin: bytes through unchanged (all 256 values), then the v5 close → SPDY FIN.
        let payload: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        for chunk in payload.chunks(30_000) {
            client
                .send(chan::encode(Encoding::Binary, chan::STDIN, chunk))
                .await
                .unwrap();
        }
        client.send(chan::close_channel(chan::STDIN)).await.unwrap();
        let stdin = s.get_mut("stdin").unwrap();
        let mut got = Vec::new();
        while let Some(b) = tokio::time::timeout(T, stdin.read()).await.unwrap() {
            got.extend_from_slice(&b);
        }
        assert_eq!(got, payload, "stdin bytes and then its close");

        // Output streams come back on their own channels, the exit status on channel 3.
        let status = br#"{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: error executing command [sh -c exit 3], exit code 3","reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"3"}]}}"#;
        let out = s.remove("stdout").unwrap().writer();
        let err = s.remove("stderr").unwrap().writer();
        let errch = s.remove("error").unwrap().writer();
        out.write(b"\x00out\xff").unwrap();
        err.write(b"err").unwrap();
        out.close();
        err.close();
        errch.write(status).unwrap();
        errch.close();

        let mut by_channel: std::collections::HashMap<u8, Vec<u8>> = Default::default();
        let close = loop {
            match next_data(&mut client).await {
                Ok(b) => by_channel
                    .entry(b[0])
                    .or_default()
                    .extend_from_slice(&b[1..]),
                Err(code) => break code,
            }
        };
        assert_eq!(
            close,
            Some(CloseCode::Normal),
            "client-go takes only 1000 as a clean end"
        );
        assert_eq!(by_channel[&chan::STDOUT], b"\x00out\xff");
        assert_eq!(by_channel[&chan::STDERR], b"err");
        assert_eq!(by_channel[&chan::ERROR], status.to_vec());
        // The relay closes the SPDY session: the kubelet sees it end, and closes too.
        assert!(tokio::time::timeout(T, kubelet.accept())
            .await
            .unwrap()
            .is_none());
        kubelet.close().await;
        let sum = tokio::time::timeout(T, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(sum.stdin, 100_000);
        assert_eq!(sum.why, "kubelet ended its streams");
    }

    #[tokio::test]
    async fn kubelet_gone_before_the_streams_is_a_status_on_the_error_channel() {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let (kubelet_io, kubelet_far) = tokio::io::duplex(64 * 1024);
        drop(kubelet_far);
        let server_ws = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let streams = Streams {
            stdout: true,
            ..Streams::default()
        };
        let task = tokio::spawn(relay(server_ws, kubelet_io, streams, true));
        let mut client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let b = next_data(&mut client).await.unwrap();
        assert_eq!(b[0], chan::ERROR);
        let status: serde_json::Value = serde_json::from_slice(&b[1..]).unwrap();
        assert_eq!(status["status"], "Failure");
        assert_eq!(status["reason"], "InternalError");
        assert!(status["message"]
            .as_str()
            .unwrap()
            .contains("error opening the kubelet's streams"));
        assert_eq!(next_data(&mut client).await, Err(Some(CloseCode::Normal)));
        let r = tokio::time::timeout(T, task).await.unwrap().unwrap();
        assert!(r.is_err());
    }

    #[tokio::test]
    async fn v4_tty_resize_and_client_close_ends_the_spdy_session() {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let (kubelet_io, kubelet_far) = tokio::io::duplex(64 * 1024);
        let server_ws = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let streams = Streams {
            stdin: true,
            stdout: true,
            stderr: true,
            tty: true,
        };
        let task = tokio::spawn(relay(server_ws, kubelet_io, streams, false));
        let mut client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let mut kubelet = Session::new(kubelet_far, spdy::Role::Server).unwrap();
        let mut s = accept_all(&mut kubelet, 4).await;
        assert!(!s.contains_key("stderr"), "no stderr stream under a tty");

        let size = br#"{"Width":120,"Height":40}"#;
        client
            .send(chan::encode(Encoding::Binary, chan::RESIZE, size))
            .await
            .unwrap();
        let got = tokio::time::timeout(T, s.get_mut("resize").unwrap().read())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got[..], size);
        // In v4, 255 is an ordinary channel number, not a close signal: ignored.
        client
            .send(Message::Binary(Bytes::from_static(&[255, 0])))
            .await
            .unwrap();
        client
            .send(chan::encode(Encoding::Binary, chan::STDIN, b"ls\r"))
            .await
            .unwrap();
        let got = tokio::time::timeout(T, s.get_mut("stdin").unwrap().read())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got[..], b"ls\r");

        client.close(None).await.unwrap();
        // The client went away: the relay closes the SPDY session, so the kubelet's
        // streams end (stdin first among them) and the kubelet closes its side too.
        let stdin = s.get_mut("stdin").unwrap();
        assert!(tokio::time::timeout(T, stdin.read())
            .await
            .unwrap()
            .is_none());
        assert!(tokio::time::timeout(T, kubelet.accept())
            .await
            .unwrap()
            .is_none());
        kubelet.close().await;
        let sum = tokio::time::timeout(T, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(sum.why, "client closed");
        assert_eq!(sum.stdin, 3);
    }
}
