//! The upgrade-aware pass-through of kube-apiserver (`upgradeaware.go` `tryUpgrade`):
//! clone the client's request (its `Host` kept, `X-Forwarded-For` added), point it at the
//! kubelet location, dial with ALPN `http/1.1`, and on `101` splice both connections;
//! non-101 below 400 is an "invalid upgrade response", ≥400 is copied to the client.
//! Used for SPDY (kubectl ≤1.29), nodes/proxy upgrades, and WebSocket exec/attach when
//! not translated (`--stream-translation passthrough`, or no `v5.channel.k8s.io` offered).

use std::net::SocketAddr;

use http::{header, HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::body::{self, Body};
use crate::headers;
use crate::kubelet::{Kubelets, Location};
use crate::status::ApiError;

/// Proxies an upgrade request to `loc`. `extra` headers are set on the cloned request.
pub async fn proxy(
    mut req: Request<Incoming>,
    loc: Location,
    peer: SocketAddr,
    extra: HeaderMap,
    kubelets: &Kubelets,
) -> Response<Body> {
    let client_upgrade = hyper::upgrade::on(&mut req);

    let mut out_headers = req.headers().clone();
    if !out_headers.contains_key(header::HOST) {
        if let Some(h) = headers::client_host(&req) {
            out_headers.insert(header::HOST, h);
        }
    }
    headers::strip_credentials(&mut out_headers);
    // The clone carries no body: let the HTTP/1.1 client frame it.
    out_headers.remove(header::CONTENT_LENGTH);
    out_headers.remove(header::TRANSFER_ENCODING);
    headers::append_forwarded_for(&mut out_headers, peer.ip());
    for (k, v) in extra.iter() {
        out_headers.insert(k.clone(), v.clone());
    }
    let mut out = Request::new(body::empty());
    *out.method_mut() = req.method().clone();
    *out.headers_mut() = out_headers;

    let mut resp = match kubelets.send(&loc, out).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("apiserver-sim: upgrade to {} failed: {e:#}", loc.log_url());
            return ApiError::backend(format!("error dialing backend: {e:#}")).into_response();
        }
    };
    let status = resp.status();
    if status != StatusCode::SWITCHING_PROTOCOLS {
        if status.as_u16() < 400 {
            eprintln!(
                "apiserver-sim: invalid upgrade response from {}: status code {}",
                loc.log_url(),
                status.as_u16()
            );
        }
        return crate::wsbridge::not_upgraded(resp);
    }

    let negotiated = ["sec-websocket-protocol", "x-stream-protocol-version"]
        .iter()
        .find_map(|h| resp.headers().get(*h))
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    eprintln!(
        "apiserver-sim: passing through {}: kubelet negotiated {} {negotiated}",
        loc.log_url(),
        resp.headers()
            .get(header::UPGRADE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default(),
    );
    let kubelet_upgrade = hyper::upgrade::on(&mut resp);
    let mut to_client = Response::new(body::empty());
    *to_client.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    *to_client.headers_mut() = resp.headers().clone();
    let url = loc.log_url();
    tokio::spawn(async move {
        let (client, kubelet) = match tokio::join!(client_upgrade, kubelet_upgrade) {
            (Ok(c), Ok(k)) => (c, k),
            (c, k) => {
                eprintln!(
                    "apiserver-sim: upgrade {url}: client {:?} kubelet {:?}",
                    c.err(),
                    k.err()
                );
                return;
            }
        };
        let mut client = TokioIo::new(client);
        let mut kubelet = TokioIo::new(kubelet);
        match tokio::io::copy_bidirectional(&mut client, &mut kubelet).await {
            Ok((up, down)) => {
                eprintln!("apiserver-sim: stream {url} closed ({up} bytes up, {down} down)")
            }
            Err(e) => eprintln!("apiserver-sim: stream {url} ended: {e}"),
        }
    });
    to_client
}
