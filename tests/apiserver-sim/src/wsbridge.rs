//! What the two WebSocket-to-SPDY bridges share (tunneled port-forward in
//! [`crate::wsportforward`], exec/attach translation in [`crate::translate`]):
//! the client's WebSocket handshake, the SPDY upgrade request to the kubelet,
//! what to answer when the kubelet does not upgrade, and the server-side
//! WebSocket over the upgraded client connection.

use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

use crate::body::{self, Body};
use crate::headers;
use crate::kubelet::Location;
use crate::status::ApiError;

/// Bound on one WebSocket message from the client.
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;
/// Bound on closing handshakes (and, in the translator, on opening the SPDY streams).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The client's `Sec-WebSocket-Key` (version 13), or the 400 to answer.
#[allow(clippy::result_large_err)]
pub fn websocket_key(req: &Request<Incoming>) -> Result<HeaderValue, Response<Body>> {
    match req.headers().get(header::SEC_WEBSOCKET_KEY) {
        Some(k)
            if req
                .headers()
                .get(header::SEC_WEBSOCKET_VERSION)
                .is_some_and(|v| v == "13") =>
        {
            Ok(k.clone())
        }
        _ => Err(
            ApiError::bad_request("websocket upgrade needs Sec-WebSocket-Key and version 13")
                .into_response(),
        ),
    }
}

/// The SPDY upgrade request the apiserver itself builds for the kubelet
/// (`Host` is the node's address), asking for `protocol`.
pub fn spdy_request(loc: &Location, protocol: &'static str) -> Request<Body> {
    let mut req = Request::new(body::empty());
    *req.method_mut() = Method::POST;
    let h = req.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&loc.node.host_port()) {
        h.insert(header::HOST, v);
    }
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
    h.insert(
        "x-stream-protocol-version",
        HeaderValue::from_static(protocol),
    );
    h.insert(
        header::USER_AGENT,
        HeaderValue::from_static("apiserver-sim"),
    );
    req
}

/// The answer to the client when the kubelet did not switch protocols: its own
/// error response (hop-by-hop headers stripped), or a 502 for a non-error status.
pub fn not_upgraded(resp: Response<Incoming>) -> Response<Body> {
    let status = resp.status();
    if status.as_u16() < 400 {
        return ApiError::new(
            StatusCode::BAD_GATEWAY,
            "InternalError",
            format!("invalid upgrade response: status code {}", status.as_u16()),
        )
        .into_response();
    }
    let (mut parts, incoming) = resp.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body::boxed(incoming))
}

/// The 101 that accepts the client's WebSocket with `key` and `protocol`.
pub fn accept(key: &HeaderValue, protocol: &'static str) -> Response<Body> {
    let mut to_client = Response::new(body::empty());
    *to_client.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = to_client.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(v) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    h.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(protocol),
    );
    to_client
}

/// The server side of the client's WebSocket, messages bounded by [`MAX_MESSAGE`].
pub async fn server_socket(client: Upgraded) -> WebSocketStream<TokioIo<Upgraded>> {
    let config = WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE));
    WebSocketStream::from_raw_socket(TokioIo::new(client), Role::Server, Some(config)).await
}
