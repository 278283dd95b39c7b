//! WebSocket side of the kubelet streaming API: upgrade validation,
//! subprotocol negotiation, the 101 answer, and the Kubernetes channel
//! framing (binary `[channel, payload…]`, base64 text `'0'+channel` + base64,
//! and v5's `[255, channel]` close-channel message).

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use tokio_tungstenite::tungstenite::Message;

use crate::http_util::{self, header_has_token, header_list, Body};

pub const V5_CHANNEL: &str = "v5.channel.k8s.io";
pub const V4_CHANNEL: &str = "v4.channel.k8s.io";
pub const V4_BASE64_CHANNEL: &str = "v4.base64.channel.k8s.io";
pub const CHANNEL: &str = "channel.k8s.io";
pub const BASE64_CHANNEL: &str = "base64.channel.k8s.io";
pub const SPDY_PORTFORWARD: &str = "SPDY/3.1+portforward.k8s.io";

/// Subprotocols accepted for exec/attach, in our preference order (the
/// client's order decides).
pub const REMOTECOMMAND_PROTOCOLS: &[&str] = &[
    V5_CHANNEL,
    V4_CHANNEL,
    V4_BASE64_CHANNEL,
    CHANNEL,
    BASE64_CHANNEL,
];

/// Subprotocols accepted for port-forward.
pub const PORTFORWARD_PROTOCOLS: &[&str] = &[
    SPDY_PORTFORWARD,
    V4_CHANNEL,
    V4_BASE64_CHANNEL,
    CHANNEL,
    BASE64_CHANNEL,
];

/// Channel numbers.
pub const STDIN: u8 = 0;
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;
pub const ERROR: u8 = 3;
pub const RESIZE: u8 = 4;
/// v5 close-channel marker.
pub const CLOSE: u8 = 255;

/// Whether the request asks for a WebSocket upgrade.
pub fn is_websocket_upgrade(headers: &HeaderMap) -> bool {
    header_has_token(headers, "upgrade", "websocket")
}

/// Pick the first client-offered subprotocol we support. `Ok(None)` when the
/// client offered none (legacy `channel.k8s.io` semantics apply); `Err` when it
/// offered only unsupported ones.
pub fn negotiate(
    headers: &HeaderMap,
    supported: &[&'static str],
) -> Result<Option<&'static str>, String> {
    let offered = header_list(headers, "sec-websocket-protocol");
    if offered.is_empty() {
        return Ok(None);
    }
    offered
        .iter()
        .find_map(|o| {
            supported
                .iter()
                .find(|s| s.eq_ignore_ascii_case(o))
                .copied()
        })
        .map(Some)
        .ok_or_else(|| {
            format!(
                "requested protocol(s) {:?} are not supported; supported: {:?}",
                offered, supported
            )
        })
}

/// Validate the handshake headers and build the 101 response.
// The error is a ready-made HTTP answer, built at most once per request.
#[allow(clippy::result_large_err)]
pub fn accept_response(
    headers: &HeaderMap,
    protocol: Option<&str>,
) -> Result<Response<Body>, Response<Body>> {
    let bad = |m: &str| http_util::text(StatusCode::BAD_REQUEST, format!("{m}\n"));
    if !header_has_token(headers, "connection", "upgrade") {
        return Err(bad("websocket: 'Connection' header must contain 'Upgrade'"));
    }
    let version_ok = headers
        .get("sec-websocket-version")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim() == "13");
    if !version_ok {
        return Err(bad(
            "websocket: unsupported Sec-WebSocket-Version (want 13)",
        ));
    }
    let Some(key) = headers.get("sec-websocket-key") else {
        return Err(bad("websocket: missing Sec-WebSocket-Key"));
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let mut r = Response::new(http_util::empty());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(
        http::header::UPGRADE,
        http::HeaderValue::from_static("websocket"),
    );
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("Upgrade"),
    );
    if let Ok(v) = accept.parse() {
        h.insert("sec-websocket-accept", v);
    }
    if let Some(p) = protocol {
        if let Ok(v) = p.parse() {
            h.insert("sec-websocket-protocol", v);
        }
    }
    Ok(r)
}

/// Payload encoding of a channel protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Binary,
    Base64,
}

impl Encoding {
    pub fn for_protocol(protocol: Option<&str>) -> Self {
        match protocol {
            Some(p) if p.contains("base64") => Encoding::Base64,
            _ => Encoding::Binary,
        }
    }
}

/// Encode `data` for channel `ch`.
pub fn encode(enc: Encoding, ch: u8, data: &[u8]) -> Message {
    match enc {
        Encoding::Binary => {
            let mut v = Vec::with_capacity(data.len() + 1);
            v.push(ch);
            v.extend_from_slice(data);
            Message::Binary(Bytes::from(v))
        }
        Encoding::Base64 => {
            let mut s = String::with_capacity(data.len() * 4 / 3 + 4);
            s.push(char::from(b'0'.wrapping_add(ch)));
            base64::engine::general_purpose::STANDARD.encode_string(data, &mut s);
            Message::text(s)
        }
    }
}

/// The v5 message that half-closes channel `ch`.
pub fn close_channel(ch: u8) -> Message {
    Message::Binary(Bytes::from(vec![CLOSE, ch]))
}

/// A decoded channel message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelMessage {
    Data(u8, Bytes),
    /// v5: the peer will send nothing more on this channel.
    CloseChannel(u8),
}

/// Decode a data message. Returns `Ok(None)` for control messages (ping,
/// pong, close) and empty messages.
pub fn decode(enc: Encoding, v5: bool, msg: &Message) -> Result<Option<ChannelMessage>, String> {
    let raw: &[u8] = match msg {
        Message::Binary(b) => b,
        Message::Text(t) => t.as_str().as_bytes(),
        _ => return Ok(None),
    };
    let Some((&first, rest)) = raw.split_first() else {
        return Ok(None);
    };
    match enc {
        Encoding::Binary => {
            if v5 && first == CLOSE {
                let ch = rest
                    .first()
                    .copied()
                    .ok_or("close message without channel")?;
                return Ok(Some(ChannelMessage::CloseChannel(ch)));
            }
            Ok(Some(ChannelMessage::Data(
                first,
                Bytes::copy_from_slice(rest),
            )))
        }
        Encoding::Base64 => {
            let ch = first
                .checked_sub(b'0')
                .filter(|c| *c < 10)
                .ok_or("base64 channel prefix is not a digit")?;
            let data = base64::engine::general_purpose::STANDARD
                .decode(rest)
                .map_err(|e| format!("invalid base64 payload: {e}"))?;
            Ok(Some(ChannelMessage::Data(ch, Bytes::from(data))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_framing_round_trip() {
        let m = encode(Encoding::Binary, STDOUT, b"hello");
        assert_eq!(m, Message::Binary(Bytes::from_static(b"\x01hello")));
        assert_eq!(
            decode(Encoding::Binary, true, &m),
            Ok(Some(ChannelMessage::Data(1, Bytes::from_static(b"hello"))))
        );
        assert_eq!(
            decode(Encoding::Binary, true, &close_channel(STDIN)),
            Ok(Some(ChannelMessage::CloseChannel(0)))
        );
        // Without v5 a 255 is just a channel number.
        assert_eq!(
            decode(Encoding::Binary, false, &close_channel(STDIN)),
            Ok(Some(ChannelMessage::Data(255, Bytes::from_static(b"\0"))))
        );
        assert_eq!(
            decode(Encoding::Binary, true, &Message::Binary(Bytes::new())),
            Ok(None)
        );
        assert_eq!(
            decode(Encoding::Binary, true, &Message::Ping(Bytes::new())),
            Ok(None)
        );
    }

    #[test]
    fn base64_framing_round_trip() {
        let m = encode(Encoding::Base64, STDERR, b"\x00\xffhi");
        assert_eq!(m, Message::text("2AP9oaQ=="));
        assert_eq!(
            decode(Encoding::Base64, false, &m),
            Ok(Some(ChannelMessage::Data(
                2,
                Bytes::from_static(b"\x00\xffhi")
            )))
        );
        assert!(decode(Encoding::Base64, false, &Message::text("x!!")).is_err());
        assert!(decode(Encoding::Base64, false, &Message::text("0!!")).is_err());
    }

    #[test]
    fn negotiation_prefers_client_order() {
        let mut h = HeaderMap::new();
        h.append(
            "sec-websocket-protocol",
            "foo, v4.channel.k8s.io".parse().unwrap(),
        );
        h.append(
            "sec-websocket-protocol",
            "v5.channel.k8s.io".parse().unwrap(),
        );
        assert_eq!(negotiate(&h, REMOTECOMMAND_PROTOCOLS), Ok(Some(V4_CHANNEL)));
        let mut h = HeaderMap::new();
        h.insert("sec-websocket-protocol", "foo".parse().unwrap());
        assert!(negotiate(&h, REMOTECOMMAND_PROTOCOLS).is_err());
        assert_eq!(
            negotiate(&HeaderMap::new(), REMOTECOMMAND_PROTOCOLS),
            Ok(None)
        );
    }
}
