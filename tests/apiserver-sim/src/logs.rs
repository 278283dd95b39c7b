//! `pods/{name}/log`: the apiserver's `LogLocation` (container defaulting and the options
//! that are set → `/containerLogs/{ns}/{pod}/{container}?…`) and its log streamer: a fresh
//! GET with the node's `Host`, the body streamed back chunk by chunk, non-2xx turned into a
//! Status error carrying up to 50,000 bytes of the kubelet's body.

use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;

use crate::body::{self, Body};
use crate::cluster::{Node, Pod};
use crate::kubelet::{Kubelets, Location};
use crate::query::{self, Query};
use crate::status::ApiError;

/// How much of an error body is kept (client-go's generic response checker).
pub const MAX_ERROR_BODY: usize = 50_000;
/// Bound on reading an error body.
const ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(10);

fn int_param(q: &Query, key: &str, min: i64) -> Result<Option<i64>, ApiError> {
    match q.first(key) {
        None | Some("") => Ok(None),
        Some(v) => {
            let n: i64 = v
                .parse()
                .map_err(|_| ApiError::bad_request(format!("{key}: invalid value {v:?}")))?;
            if n < min {
                return Err(ApiError::invalid(format!(
                    "{key}: Invalid value: {n}: must be greater than or equal to {min}"
                )));
            }
            Ok(Some(n))
        }
    }
}

/// Checks `sinceTime` is RFC 3339 and formats it like Go's `time.RFC3339` (whole seconds).
fn since_time(v: &str) -> Result<String, ApiError> {
    let bad = || ApiError::bad_request(format!("sinceTime: invalid RFC 3339 time {v:?}"));
    let b = v.as_bytes();
    if b.len() < 20 || !v.is_ascii() {
        return Err(bad());
    }
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    if !(digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && (b[10] == b'T' || b[10] == b't')
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19))
    {
        return Err(bad());
    }
    let mut rest = &v[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let n = frac.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return Err(bad());
        }
        rest = &frac[n..];
    }
    let zone_ok = rest.eq_ignore_ascii_case("z")
        || (rest.len() == 6
            && (rest.starts_with('+') || rest.starts_with('-'))
            && rest.as_bytes()[3] == b':'
            && rest.as_bytes()[1..3].iter().all(u8::is_ascii_digit)
            && rest.as_bytes()[4..6].iter().all(u8::is_ascii_digit));
    if !zone_ok {
        return Err(bad());
    }
    let zone = if rest.eq_ignore_ascii_case("z") || rest == "+00:00" || rest == "-00:00" {
        "Z"
    } else {
        rest
    };
    Ok(format!("{}T{}{}", &v[..10], &v[11..19], zone))
}

/// The kubelet location for a log request.
pub fn location(pod: &Pod, node: &Node, q: &Query) -> Result<Location, ApiError> {
    let container = pod
        .pick_container(q.first("container"))
        .map_err(ApiError::bad_request)?;
    let mut params: Vec<(&str, String)> = Vec::new();
    if q.flag("follow") {
        params.push(("follow", "true".into()));
    }
    if q.flag("previous") {
        params.push(("previous", "true".into()));
    }
    if q.flag("timestamps") {
        params.push(("timestamps", "true".into()));
    }
    let since_seconds = int_param(q, "sinceSeconds", 1)?;
    let since = match q.first("sinceTime") {
        None | Some("") => None,
        Some(v) => Some(since_time(v)?),
    };
    if since_seconds.is_some() && since.is_some() {
        return Err(ApiError::invalid(
            "sinceTime: Forbidden: at most one of `sinceTime` or `sinceSeconds` may be specified",
        ));
    }
    if let Some(s) = since_seconds {
        params.push(("sinceSeconds", s.to_string()));
    }
    if let Some(t) = since {
        params.push(("sinceTime", t));
    }
    if let Some(n) = int_param(q, "tailLines", 0)? {
        params.push(("tailLines", n.to_string()));
    }
    if let Some(n) = int_param(q, "limitBytes", 1)? {
        params.push(("limitBytes", n.to_string()));
    }
    Ok(Location::new(
        node,
        format!(
            "/containerLogs/{}/{}/{}",
            pod.namespace, pod.name, container.name
        ),
        query::encode(&params),
    ))
}

/// Streams the kubelet's logs for `loc` to the client.
pub async fn serve(loc: Location, kubelets: &Kubelets) -> Response<Body> {
    let mut req = Request::new(body::empty());
    *req.method_mut() = Method::GET;
    if let Ok(v) = HeaderValue::from_str(&loc.node.host_port()) {
        req.headers_mut().insert(header::HOST, v);
    }
    req.headers_mut().insert(
        header::USER_AGENT,
        HeaderValue::from_static("apiserver-sim"),
    );
    let resp = match kubelets.send(&loc, req).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("apiserver-sim: logs from {} failed: {e:#}", loc.log_url());
            return ApiError::backend(format!("error trying to reach kubelet: {e:#}"))
                .into_response();
        }
    };
    let status = resp.status();
    let mut incoming = resp.into_body();
    if !status.is_success() {
        let mut kept = Vec::new();
        let read = async {
            while kept.len() < MAX_ERROR_BODY {
                match incoming.frame().await {
                    Some(Ok(f)) => {
                        if let Ok(data) = f.into_data() {
                            let room = MAX_ERROR_BODY - kept.len();
                            kept.extend_from_slice(&data[..data.len().min(room)]);
                        }
                    }
                    _ => break,
                }
            }
        };
        let _ = tokio::time::timeout(ERROR_BODY_TIMEOUT, read).await;
        let text = String::from_utf8_lossy(&kept);
        return ApiError::from_backend_response(status, &text).into_response();
    }
    let mut out = Response::new(body::boxed(incoming));
    *out.status_mut() = StatusCode::OK;
    out.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(q: &str) -> Result<Location, ApiError> {
        let pod = Pod::parse("default/p1=edge-1:c1").unwrap();
        let node = Node::parse("edge-1=edge-1.example:10350").unwrap();
        location(&pod, &node, &Query::parse(Some(q)))
    }

    #[test]
    fn kubectl_logs_follow_tail() {
        let l = loc("container=c1&follow=true&tailLines=3").unwrap();
        assert_eq!(l.path, "/containerLogs/default/p1/c1");
        assert_eq!(l.query, "follow=true&tailLines=3");
        assert_eq!(
            l.url(),
            "https://edge-1.example:10350/containerLogs/default/p1/c1?follow=true&tailLines=3"
        );
    }

    #[test]
    fn only_set_params_are_sent() {
        assert_eq!(loc("").unwrap().query, "");
        assert_eq!(loc("follow=false&previous=false").unwrap().query, "");
        let l = loc("previous=true&timestamps=true&sinceSeconds=10&limitBytes=100&tailLines=0")
            .unwrap();
        assert_eq!(
            l.query,
            "limitBytes=100&previous=true&sinceSeconds=10&tailLines=0&timestamps=true"
        );
        let l = loc("sinceTime=2024-05-01T10:00:00.123%2B00:00").unwrap();
        assert_eq!(l.query, "sinceTime=2024-05-01T10%3A00%3A00Z");
        let l = loc("sinceTime=2024-05-01T10:00:00-07:00").unwrap();
        assert_eq!(l.query, "sinceTime=2024-05-01T10%3A00%3A00-07%3A00");
    }

    #[test]
    fn bad_params() {
        assert_eq!(
            loc("sinceSeconds=x").unwrap_err().code,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            loc("sinceSeconds=0").unwrap_err().code,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            loc("tailLines=-1").unwrap_err().code,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            loc("limitBytes=0").unwrap_err().code,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert!(loc("sinceSeconds=5&sinceTime=2024-05-01T10:00:00Z").is_err());
        assert!(loc("sinceTime=yesterday").is_err());
        assert!(loc("sinceTime=2024-05-01T10:00:00").is_err());
        assert!(loc("container=nope").is_err());
    }
}
