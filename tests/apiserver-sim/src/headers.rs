//! Header handling shared by the proxies: the client's `Host`, `X-Forwarded-For`,
//! hop-by-hop headers, upgrade detection, and the headers the apiserver's authentication
//! filter strips before proxying.

use std::net::IpAddr;

use http::{header, HeaderMap, HeaderName, HeaderValue, Request};

/// Hop-by-hop headers Go's `httputil.ReverseProxy` removes.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The `Host` the client addressed: its `Host` header (HTTP/1.1) or the request URI's
/// authority (`:authority` on HTTP/2).
pub fn client_host<B>(req: &Request<B>) -> Option<HeaderValue> {
    if let Some(h) = req.headers().get(header::HOST) {
        return Some(h.clone());
    }
    req.uri()
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
}

/// Whether a header list contains `token` (comma-separated, case-insensitive).
fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.to_str()
            .map(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
            .unwrap_or(false)
    })
}

/// `httpstream.IsUpgradeRequest`: `Connection` names `upgrade` and `Upgrade` is set.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    has_token(headers, header::CONNECTION, "upgrade") && headers.contains_key(header::UPGRADE)
}

/// Whether the `Upgrade` header asks for a WebSocket.
pub fn is_websocket_upgrade(headers: &HeaderMap) -> bool {
    is_upgrade(headers) && has_token(headers, header::UPGRADE, "websocket")
}

/// Whether `Sec-WebSocket-Protocol` offers `proto`.
pub fn offers_ws_protocol(headers: &HeaderMap, proto: &str) -> bool {
    has_token(headers, header::SEC_WEBSOCKET_PROTOCOL, proto)
}

/// Appends the client's IP to `X-Forwarded-For` like Go's reverse proxy.
pub fn append_forwarded_for(headers: &mut HeaderMap, peer: IpAddr) {
    let prior: Vec<String> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok().map(str::to_string))
        .collect();
    let value = if prior.is_empty() {
        peer.to_string()
    } else {
        format!("{}, {peer}", prior.join(", "))
    };
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert("x-forwarded-for", v);
    }
}

/// Removes what the apiserver's authentication filter consumes (the bearer token).
pub fn strip_credentials(headers: &mut HeaderMap) {
    headers.remove(header::AUTHORIZATION);
}

/// Removes hop-by-hop headers, including any named by `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .filter(|t| !t.is_empty())
        .collect();
    for n in named {
        if let Ok(name) = HeaderName::from_bytes(n.as_bytes()) {
            headers.remove(name);
        }
    }
    for h in HOP_BY_HOP {
        headers.remove(*h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upgrade_detection() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(!is_upgrade(&h));
        h.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        assert!(is_upgrade(&h));
        assert!(!is_websocket_upgrade(&h));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(is_websocket_upgrade(&h));
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("v5.channel.k8s.io, SPDY/3.1+portforward.k8s.io"),
        );
        assert!(offers_ws_protocol(&h, "SPDY/3.1+portforward.k8s.io"));
        assert!(!offers_ws_protocol(&h, "portforward.k8s.io"));
    }

    #[test]
    fn forwarded_for_appends() {
        let mut h = HeaderMap::new();
        append_forwarded_for(&mut h, "127.0.0.1".parse().unwrap());
        assert_eq!(h["x-forwarded-for"], "127.0.0.1");
        append_forwarded_for(&mut h, "::1".parse().unwrap());
        assert_eq!(h["x-forwarded-for"], "127.0.0.1, ::1");
    }

    #[test]
    fn hop_by_hop_removed() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, X-Foo"));
        h.insert("x-foo", HeaderValue::from_static("1"));
        h.insert(header::UPGRADE, HeaderValue::from_static("x"));
        h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn host_from_header_or_authority() {
        let r = Request::get("https://10.0.0.1:6443/x").body(()).unwrap();
        assert_eq!(client_host(&r).unwrap(), "10.0.0.1:6443");
        let r = Request::get("/x")
            .header(header::HOST, "api:6443")
            .body(())
            .unwrap();
        assert_eq!(client_host(&r).unwrap(), "api:6443");
    }
}
