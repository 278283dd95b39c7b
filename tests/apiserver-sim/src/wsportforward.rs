//! Port-forward from WebSocket clients (kubectl ≥1.31, subprotocol
//! `SPDY/3.1+portforward.k8s.io`), done like kube-apiserver's tunneling handler: open a
//! SPDY upgrade to the kubelet's `/portForward/{ns}/{pod}`, then accept the client's
//! WebSocket and carry the SPDY bytes unparsed: binary message payloads → kubelet, kubelet
//! bytes → binary messages. Pings are answered; either end closing closes both.

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::body::Body;
use crate::headers;
use crate::kubelet::{Kubelets, Location};
use crate::status::ApiError;
use crate::wsbridge::{self, CLOSE_TIMEOUT};

/// The WebSocket subprotocol of tunneled port-forward.
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";

/// Whether this request is a tunneled (WebSocket-wrapped SPDY) port-forward.
pub fn is_tunnel_request(headers: &http::HeaderMap) -> bool {
    headers::is_websocket_upgrade(headers) && headers::offers_ws_protocol(headers, TUNNEL_PROTOCOL)
}

/// The SPDY upgrade request the apiserver sends to the kubelet for a tunneled
/// port-forward.
pub fn kubelet_request(loc: &Location) -> Request<Body> {
    wsbridge::spdy_request(loc, "portforward.k8s.io")
}

/// Serves a tunneled port-forward request.
pub async fn serve(
    mut req: Request<Incoming>,
    loc: Location,
    kubelets: &Kubelets,
) -> Response<Body> {
    let key = match wsbridge::websocket_key(&req) {
        Ok(k) => k,
        Err(resp) => return resp,
    };
    let client_upgrade = hyper::upgrade::on(&mut req);

    let mut resp = match kubelets.send(&loc, kubelet_request(&loc)).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "apiserver-sim: port-forward upgrade to {} failed: {e:#}",
                loc.log_url()
            );
            return ApiError::backend(format!("error dialing backend: {e:#}")).into_response();
        }
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return wsbridge::not_upgraded(resp);
    }
    let kubelet_upgrade = hyper::upgrade::on(&mut resp);

    let to_client = wsbridge::accept(&key, TUNNEL_PROTOCOL);

    let url = loc.log_url();
    tokio::spawn(async move {
        let (client, kubelet) = match tokio::join!(client_upgrade, kubelet_upgrade) {
            (Ok(c), Ok(k)) => (c, k),
            (c, k) => {
                eprintln!(
                    "apiserver-sim: port-forward {url}: client {:?} kubelet {:?}",
                    c.err(),
                    k.err()
                );
                return;
            }
        };
        let ws = wsbridge::server_socket(client).await;
        let (up, down, why) = relay(ws, TokioIo::new(kubelet)).await;
        eprintln!("apiserver-sim: port-forward {url} closed: {why} ({up} bytes up, {down} down)");
    });
    to_client
}

/// Copies WebSocket binary payloads to `kubelet` and kubelet bytes back as binary
/// messages until either side ends. Returns (bytes up, bytes down, reason).
async fn relay<S, K>(mut ws: WebSocketStream<S>, kubelet: K) -> (u64, u64, String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    K: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut kr, mut kw) = tokio::io::split(kubelet);
    let mut buf = vec![0u8; 32 * 1024];
    let (mut up, mut down) = (0u64, 0u64);
    let why = loop {
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    if let Err(e) = kw.write_all(&b).await {
                        break format!("kubelet write: {e}");
                    }
                    up += b.len() as u64;
                }
                Some(Ok(Message::Text(t))) => {
                    if let Err(e) = kw.write_all(t.as_bytes()).await {
                        break format!("kubelet write: {e}");
                    }
                    up += t.len() as u64;
                }
                Some(Ok(Message::Ping(_))) => {
                    // tungstenite queued the pong; push it out now.
                    if let Err(e) = ws.flush().await {
                        break format!("client pong: {e}");
                    }
                }
                Some(Ok(Message::Pong(_))) | Some(Ok(Message::Frame(_))) => {}
                Some(Ok(Message::Close(_))) | None => break "client closed".to_string(),
                Some(Err(e)) => break format!("client: {e}"),
            },
            n = kr.read(&mut buf) => match n {
                Ok(0) => break "kubelet closed".to_string(),
                Ok(n) => {
                    if let Err(e) = ws.send(Message::Binary(Bytes::copy_from_slice(&buf[..n]))).await {
                        break format!("client write: {e}");
                    }
                    down += n as u64;
                }
                Err(e) => break format!("kubelet read: {e}"),
            },
        }
    };
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, ws.close(None)).await;
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, kw.shutdown()).await;
    (up, down, why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Node;
    use http::{header, HeaderValue, Method};
    use std::time::Duration;
    use tokio_tungstenite::tungstenite::protocol::Role;

    #[test]
    fn kubelet_request_is_spdy_to_node_host() {
        let n = Node::parse("edge-1=edge-1.example:10350").unwrap();
        let loc = Location::new(&n, "/portForward/default/p1".into(), String::new());
        let r = kubelet_request(&loc);
        assert_eq!(r.method(), Method::POST);
        assert_eq!(r.headers()[header::HOST], "edge-1.example:10350");
        assert_eq!(r.headers()[header::UPGRADE], "SPDY/3.1");
        assert_eq!(
            r.headers()["x-stream-protocol-version"],
            "portforward.k8s.io"
        );
    }

    #[test]
    fn tunnel_detection() {
        let mut h = http::HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(TUNNEL_PROTOCOL),
        );
        assert!(is_tunnel_request(&h));
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("v5.channel.k8s.io"),
        );
        assert!(!is_tunnel_request(&h));
    }

    #[tokio::test]
    async fn relay_copies_both_ways_and_answers_pings() {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let (kubelet_io, mut kubelet_far) = tokio::io::duplex(64 * 1024);
        let server_ws = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let task = tokio::spawn(relay(server_ws, kubelet_io));
        let mut client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let timeout = Duration::from_secs(5);

        client
            .send(Message::Binary(Bytes::from_static(b"spdy-bytes")))
            .await
            .unwrap();
        let mut got = [0u8; 10];
        tokio::time::timeout(timeout, kubelet_far.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got, b"spdy-bytes");

        client
            .send(Message::Ping(Bytes::from_static(b"p")))
            .await
            .unwrap();
        kubelet_far.write_all(b"reply").await.unwrap();
        let mut saw_pong = false;
        let mut saw_reply = false;
        while !(saw_pong && saw_reply) {
            match tokio::time::timeout(timeout, client.next()).await.unwrap() {
                Some(Ok(Message::Pong(p))) => {
                    assert_eq!(&p[..], b"p");
                    saw_pong = true;
                }
                Some(Ok(Message::Binary(b))) => {
                    assert_eq!(&b[..], b"reply");
                    saw_reply = true;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        drop(kubelet_far);
        let (up, down, why) = tokio::time::timeout(timeout, task).await.unwrap().unwrap();
        assert_eq!((up, down), (10, 5));
        assert_eq!(why, "kubelet closed");
    }
}
