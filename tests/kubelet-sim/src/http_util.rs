//! Small HTTP helpers shared by the handlers: the response body type, plain
//! text/JSON responses, query-string decoding and header-list parsing.

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};

/// Body type of every response.
pub type Body = BoxBody<Bytes, std::io::Error>;

/// A fixed body.
pub fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// An empty body.
pub fn empty() -> Body {
    full(Bytes::new())
}

fn with_type(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

/// A `text/plain` response.
pub fn text(status: StatusCode, body: impl Into<String>) -> Response<Body> {
    with_type(status, "text/plain; charset=utf-8", body.into())
}

/// An `application/json` response.
pub fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    with_type(status, "application/json", value.to_string())
}

/// A Prometheus text-format response.
pub fn prometheus(body: String) -> Response<Body> {
    with_type(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        body,
    )
}

/// 404 with the kubelet's wording.
pub fn not_found(what: &str) -> Response<Body> {
    text(StatusCode::NOT_FOUND, format!("{what} not found\n"))
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Percent-decode (with `+` as space, as in form encoding).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Decode a query string into ordered (name, value) pairs.
pub fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

/// All values of one query parameter.
pub fn query_all<'a>(pairs: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    pairs
        .iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

/// First value of one query parameter.
pub fn query_get<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// Go's strconv.ParseBool, plus "" meaning true (a bare `?follow`).
pub fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "" | "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// A boolean flag parameter that is false when absent or undecodable.
pub fn query_flag(pairs: &[(String, String)], name: &str) -> bool {
    query_get(pairs, name).and_then(parse_bool).unwrap_or(false)
}

/// All values of a header that may be repeated and/or comma-joined.
pub fn header_list(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

/// True when a header's comma-separated tokens include `token` (case-insensitive).
pub fn header_has_token(headers: &HeaderMap, name: &str, token: &str) -> bool {
    header_list(headers, name)
        .iter()
        .any(|t| t.eq_ignore_ascii_case(token))
}

/// A streaming body fed by a channel; each chunk is written (and flushed by
/// hyper) as it arrives, and the body ends when the sender is dropped.
pub struct ChannelBody {
    rx: tokio::sync::mpsc::Receiver<Bytes>,
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        self.rx
            .poll_recv(cx)
            .map(|o| o.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}

/// A body and the sender that feeds it.
pub fn channel_body(capacity: usize) -> (tokio::sync::mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = tokio::sync::mpsc::channel(capacity);
    (tx, ChannelBody { rx }.boxed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = query_pairs(Some(
            "command=sh&command=-c&command=echo+a%20b%3B&tty&x=%zz&y=%4",
        ));
        assert_eq!(query_all(&q, "command"), vec!["sh", "-c", "echo a b;"]);
        assert_eq!(query_get(&q, "tty"), Some(""));
        assert_eq!(query_get(&q, "x"), Some("%zz"));
        assert_eq!(query_get(&q, "y"), Some("%4"));
        assert!(query_flag(&q, "tty"));
        assert!(!query_flag(&q, "missing"));
        assert_eq!(parse_bool("yes"), None);
    }
}
