//! `/portForward/{ns}/{pod}[/{uid}]`: forwarding to 127.0.0.1:<port> on this
//! machine over SPDY (`portforward.k8s.io`: an error and a data stream per
//! connection, paired by `requestID`), over SPDY tunnelled in WebSocket binary
//! messages (`SPDY/3.1+portforward.k8s.io`), and over the legacy WebSocket
//! channel framing (`?port=` list, data channel 2i, error channel 2i+1, each
//! opened with the port as little-endian u16).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::http_util::{self, query_all, query_pairs, Body};
use crate::server::AppState;
use crate::spdy::{Session, SessionHandle, Stream};
use crate::upgrade::{self, UpgradedIo};
use crate::websocket::{self, ChannelMessage, Encoding};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Describes the pod in error messages.
#[derive(Clone)]
struct PodDesc {
    name: String,
    uid: String,
}

/// Entry point of `/portForward/…`.
pub async fn handle(
    state: Arc<AppState>,
    mut req: Request<Incoming>,
    ns: &str,
    pod: &str,
    uid: Option<&str>,
) -> Response<Body> {
    let Some(spec) = state.pods.find(ns, pod, uid) else {
        return http_util::not_found(&format!("pod {ns}/{pod}"));
    };
    let desc = PodDesc {
        name: format!("{ns}/{pod}"),
        uid: spec.uid.clone(),
    };
    if websocket::is_websocket_upgrade(req.headers()) {
        let protocol = match websocket::negotiate(req.headers(), websocket::PORTFORWARD_PROTOCOLS) {
            Ok(p) => p,
            Err(m) => return http_util::text(StatusCode::BAD_REQUEST, m + "\n"),
        };
        if protocol == Some(websocket::SPDY_PORTFORWARD) {
            let resp = match websocket::accept_response(req.headers(), protocol) {
                Ok(r) => r,
                Err(r) => return r,
            };
            upgrade::on_upgrade(&mut req, move |io| serve_spdy_over_websocket(io, desc));
            return resp;
        }
        let q = query_pairs(req.uri().query());
        let mut ports = Vec::new();
        for p in query_all(&q, "port") {
            match p.parse::<u16>() {
                Ok(p) if p > 0 => ports.push(p),
                _ => {
                    return http_util::text(
                        StatusCode::BAD_REQUEST,
                        format!("unable to parse {p:?} as a port\n"),
                    )
                }
            }
        }
        if ports.is_empty() {
            return http_util::text(
                StatusCode::BAD_REQUEST,
                "query parameter \"port\" is required\n",
            );
        }
        let resp = match websocket::accept_response(req.headers(), protocol) {
            Ok(r) => r,
            Err(r) => return r,
        };
        let enc = Encoding::for_protocol(protocol);
        upgrade::on_upgrade(&mut req, move |io| serve_websocket(io, enc, ports, desc));
        return resp;
    }
    if !upgrade::is_spdy_upgrade(req.headers()) {
        return http_util::text(StatusCode::BAD_REQUEST, "Upgrade request required\n");
    }
    let version = match upgrade::negotiate_spdy(req.headers(), upgrade::PORTFORWARD_SPDY_VERSIONS) {
        Ok(v) => v,
        Err(r) => return r,
    };
    upgrade::on_upgrade(&mut req, move |io| async move {
        match Session::new(io, crate::spdy::Role::Server) {
            Ok(s) => serve_spdy(s, desc).await,
            Err(e) => tracing::warn!("spdy session: {e:#}"),
        }
    });
    upgrade::spdy_switching(version)
}

#[derive(Default)]
struct Pair {
    error: Option<Stream>,
    data: Option<Stream>,
}

/// Pair error/data streams by requestID and forward each pair.
async fn serve_spdy(mut session: Session, desc: PodDesc) {
    let handle = session.handle();
    let mut pending: HashMap<String, Pair> = HashMap::new();
    while let Some(s) = session.accept().await {
        let kind = s.header("streamtype").unwrap_or("").to_ascii_lowercase();
        // Old clients send no requestID: the data stream follows its error
        // stream, two ids later.
        let request_id = match s.header("requestid") {
            Some(r) => r.to_string(),
            None if kind == "data" => s.id.saturating_sub(2).to_string(),
            None => s.id.to_string(),
        };
        let entry = pending.entry(request_id.clone()).or_default();
        match kind.as_str() {
            "error" if entry.error.is_none() => entry.error = Some(s),
            "data" if entry.data.is_none() => entry.data = Some(s),
            _ => {
                tracing::debug!("port-forward: unexpected stream {kind:?} for {request_id}");
                s.writer().reset();
                continue;
            }
        }
        if entry.error.is_some() && entry.data.is_some() {
            if let Some(Pair {
                error: Some(e),
                data: Some(d),
            }) = pending.remove(&request_id)
            {
                tokio::spawn(forward_pair(e, d, desc.clone(), handle.clone()));
            }
        }
    }
    session.close().await;
}

async fn forward_pair(error: Stream, data: Stream, desc: PodDesc, session: SessionHandle) {
    let port_header = data
        .header("port")
        .or_else(|| error.header("port"))
        .unwrap_or("")
        .to_string();
    let (mut err_rx, err_w) = error.split();
    // The client half-closes the error stream right away; drain it.
    tokio::spawn(async move { while err_rx.recv().await.is_some() {} });
    let (mut data_rx, data_w) = data.split();
    let port = match port_header.parse::<u16>() {
        Ok(p) if p > 0 => p,
        _ => {
            let _ = err_w
                .write(format!("invalid port {port_header:?} for pod {}", desc.name).as_bytes());
            err_w.close();
            data_w.reset();
            return;
        }
    };
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(("127.0.0.1", port))).await;
    let tcp = match conn {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            fail_connect(&err_w, &data_w, &desc, port, &e.to_string());
            return;
        }
        Err(_) => {
            fail_connect(&err_w, &data_w, &desc, port, "connection timed out");
            return;
        }
    };
    let (mut rd, mut wr) = tcp.into_split();
    let upstream = tokio::spawn(async move {
        while let Some(b) = data_rx.recv().await {
            if wr.write_all(&b).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let dw = data_w.clone();
    let downstream = async move {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            tokio::select! {
                r = rd.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if dw.write(&buf[..n]).is_err() {
                            return;
                        }
                    }
                },
                _ = session.closed() => return,
            }
        }
        dw.close();
    };
    downstream.await;
    let _ = upstream.await;
    err_w.close();
}

fn fail_connect(
    err_w: &crate::spdy::StreamWriter,
    data_w: &crate::spdy::StreamWriter,
    desc: &PodDesc,
    port: u16,
    why: &str,
) {
    let msg = format!(
        "error forwarding port {port} to pod {}, uid {}: failed to connect to localhost:{port}: {why}",
        desc.name, desc.uid
    );
    let _ = err_w.write(msg.as_bytes());
    err_w.close();
    data_w.close();
}

/// SPDY carried in WebSocket binary messages, bridged through an in-memory pipe.
async fn serve_spdy_over_websocket(io: UpgradedIo, desc: PodDesc) {
    let ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
    let (mut sink, mut stream) = ws.split();
    let (ours, theirs) = tokio::io::duplex(256 * 1024);
    let (mut trd, mut twr) = tokio::io::split(theirs);
    let inbound = tokio::spawn(async move {
        while let Some(Ok(msg)) = stream.next().await {
            let data = match msg {
                Message::Binary(b) => b,
                Message::Text(t) => Bytes::copy_from_slice(t.as_str().as_bytes()),
                Message::Close(_) => break,
                _ => continue,
            };
            if twr.write_all(&data).await.is_err() {
                break;
            }
        }
        let _ = twr.shutdown().await;
    });
    let outbound = tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match trd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if sink
                        .send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        let _ = sink.send(Message::Close(None)).await;
        let _ = sink.close().await;
    });
    match Session::new(ours, crate::spdy::Role::Server) {
        Ok(s) => serve_spdy(s, desc).await,
        Err(e) => tracing::warn!("spdy session: {e:#}"),
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), outbound).await;
    inbound.abort();
}

/// Legacy WebSocket port-forward with channel pairs per port.
async fn serve_websocket(io: UpgradedIo, enc: Encoding, ports: Vec<u16>, desc: PodDesc) {
    let ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
    let (mut sink, mut stream) = ws.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(64);
    let mut inbound: Vec<mpsc::UnboundedSender<Bytes>> = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let Ok(ch) = u8::try_from(i * 2) else { break };
        for c in [ch, ch.saturating_add(1)] {
            if sink
                .send(websocket::encode(enc, c, &port.to_le_bytes()))
                .await
                .is_err()
            {
                return;
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        inbound.push(tx);
        tokio::spawn(forward_ws_port(
            *port,
            ch,
            enc,
            rx,
            out_tx.clone(),
            desc.clone(),
        ));
    }
    drop(out_tx);
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if sink.send(m).await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });
    while let Some(Ok(msg)) = stream.next().await {
        if matches!(msg, Message::Close(_)) {
            break;
        }
        match websocket::decode(enc, false, &msg) {
            Ok(Some(ChannelMessage::Data(ch, b))) if ch % 2 == 0 => {
                if let Some(tx) = inbound.get(usize::from(ch / 2)) {
                    let _ = tx.send(b);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!("port-forward websocket: {e}"),
        }
    }
    drop(inbound);
    writer.abort();
}

async fn forward_ws_port(
    port: u16,
    ch: u8,
    enc: Encoding,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
    out: mpsc::Sender<Message>,
    desc: PodDesc,
) {
    let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(("127.0.0.1", port)))
        .await
    {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            let msg = format!(
                "error forwarding port {port} to pod {}, uid {}: failed to connect to localhost:{port}: {e}",
                desc.name, desc.uid
            );
            let _ = out
                .send(websocket::encode(enc, ch + 1, msg.as_bytes()))
                .await;
            return;
        }
        Err(_) => {
            let _ = out
                .send(websocket::encode(enc, ch + 1, b"connection timed out"))
                .await;
            return;
        }
    };
    let (mut rd, mut wr) = tcp.into_split();
    tokio::spawn(async move {
        while let Some(b) = rx.recv().await {
            if wr.write_all(&b).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match rd.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if out
                    .send(websocket::encode(enc, ch, &buf[..n]))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        }
    }
}
