//! HTTP/1.1 connection upgrades shared by exec, attach and port-forward: the
//! SPDY/3.1 handshake (X-Stream-Protocol-Version negotiation, 400/403
//! answers, the 101) and handing the upgraded connection to a task.

use std::future::Future;

use http::{HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;

use crate::http_util::{self, header_has_token, header_list, Body};

/// The upgraded connection type.
pub type UpgradedIo = TokioIo<Upgraded>;

/// SPDY protocol versions of remotecommand, newest first.
pub const REMOTECOMMAND_SPDY_VERSIONS: &[&str] = &[
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
];

/// The one SPDY port-forward protocol.
pub const PORTFORWARD_SPDY_VERSIONS: &[&str] = &["portforward.k8s.io"];

/// Whether the request asks for a SPDY/3.1 upgrade.
pub fn is_spdy_upgrade(headers: &HeaderMap) -> bool {
    header_has_token(headers, "upgrade", "SPDY/3.1")
}

/// httpstream.Handshake: the first client-listed version we support.
// The error is a ready-made HTTP answer, built at most once per request.
#[allow(clippy::result_large_err)]
pub fn negotiate_spdy(
    headers: &HeaderMap,
    supported: &[&'static str],
) -> Result<&'static str, Response<Body>> {
    let offered = header_list(headers, "x-stream-protocol-version");
    if offered.is_empty() {
        return Err(http_util::text(
            StatusCode::BAD_REQUEST,
            "unable to upgrade: X-Stream-Protocol-Version is required\n",
        ));
    }
    if let Some(v) = offered
        .iter()
        .find_map(|o| supported.iter().find(|s| **s == o.as_str()).copied())
    {
        return Ok(v);
    }
    let mut r = http_util::text(
        StatusCode::FORBIDDEN,
        format!(
            "unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server accepts {supported:?}\n"
        ),
    );
    for s in supported {
        if let Ok(v) = s.parse() {
            r.headers_mut()
                .append("x-accepted-stream-protocol-versions", v);
        }
    }
    Err(r)
}

/// The 101 answer to a SPDY upgrade.
pub fn spdy_switching(version: &str) -> Response<Body> {
    let mut r = Response::new(http_util::empty());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("Upgrade"),
    );
    h.insert(
        http::header::UPGRADE,
        http::HeaderValue::from_static("SPDY/3.1"),
    );
    if let Ok(v) = version.parse() {
        h.insert("x-stream-protocol-version", v);
    }
    r
}

/// Run `f` on the upgraded connection once hyper has sent the 101.
pub fn on_upgrade<F, Fut>(req: &mut Request<Incoming>, f: F)
where
    F: FnOnce(UpgradedIo) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let on = hyper::upgrade::on(req);
    tokio::spawn(async move {
        match on.await {
            Ok(up) => f(TokioIo::new(up)).await,
            Err(e) => tracing::debug!("upgrade failed: {e}"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spdy_negotiation() {
        let mut h = HeaderMap::new();
        h.append(
            "x-stream-protocol-version",
            "v5.channel.k8s.io".parse().unwrap(),
        );
        h.append(
            "x-stream-protocol-version",
            "v3.channel.k8s.io, v4.channel.k8s.io".parse().unwrap(),
        );
        assert_eq!(
            negotiate_spdy(&h, REMOTECOMMAND_SPDY_VERSIONS).ok(),
            Some("v3.channel.k8s.io")
        );
        let mut h = HeaderMap::new();
        h.insert("x-stream-protocol-version", "nope".parse().unwrap());
        let r = negotiate_spdy(&h, REMOTECOMMAND_SPDY_VERSIONS).expect_err("403");
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
        assert_eq!(
            r.headers()
                .get_all("x-accepted-stream-protocol-versions")
                .iter()
                .count(),
            4
        );
        let r = negotiate_spdy(&HeaderMap::new(), REMOTECOMMAND_SPDY_VERSIONS).expect_err("400");
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }
}
