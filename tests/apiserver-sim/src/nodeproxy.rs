//! `nodes/{name}/proxy/{path…}`: any method to the kubelet's `/{path}` with the client's
//! query and `Host`, `X-Forwarded-Uri` set to the request URI the client used; upgrades
//! pass through, everything else goes through the reverse proxy.

use std::net::SocketAddr;

use http::{HeaderMap, HeaderValue, Request, Response};
use hyper::body::Incoming;

use crate::body::Body;
use crate::cluster::Node;
use crate::headers;
use crate::kubelet::{Kubelets, Location};
use crate::{reverse, upgrade};

/// The kubelet location for `rest` (the path after `/proxy`, raw, possibly empty) and the
/// raw query: like `net.JoinPreservingTrailingSlash("/", rest)`.
pub fn location(node: &Node, rest: &str, raw_query: Option<&str>) -> Location {
    let trimmed = rest.trim_start_matches('/');
    let path = format!("/{trimmed}");
    Location::new(node, path, raw_query.unwrap_or("").to_string())
}

/// Proxies a nodes/proxy request.
pub async fn serve(
    req: Request<Incoming>,
    node: &Node,
    rest: &str,
    peer: SocketAddr,
    kubelets: &Kubelets,
) -> Response<Body> {
    let loc = location(node, rest, req.uri().query());
    let mut extra = HeaderMap::new();
    let request_uri = req
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    if let Ok(v) = HeaderValue::from_str(&request_uri) {
        extra.insert("x-forwarded-uri", v);
    }
    if headers::is_upgrade(req.headers()) {
        upgrade::proxy(req, loc, peer, extra, kubelets).await
    } else {
        reverse::forward(req, loc, peer, extra, kubelets).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let n = Node::parse("edge-1=127.0.0.1:10350").unwrap();
        assert_eq!(location(&n, "metrics", None).path_and_query(), "/metrics");
        assert_eq!(location(&n, "", None).path_and_query(), "/");
        assert_eq!(
            location(&n, "logs/", Some("query=kubelet")).path_and_query(),
            "/logs/?query=kubelet"
        );
        assert_eq!(
            location(&n, "stats/summary", Some("only_cpu_and_memory=true")).url(),
            "https://127.0.0.1:10350/stats/summary?only_cpu_and_memory=true"
        );
    }
}
