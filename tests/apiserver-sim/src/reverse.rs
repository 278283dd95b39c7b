//! The plain reverse proxy (Go `httputil.ReverseProxy` as kube-apiserver configures it)
//! for non-upgrade requests to a kubelet: client headers minus hop-by-hop and credentials,
//! the client's `Host` kept, `X-Forwarded-For` appended, bodies streamed both ways.

use std::net::SocketAddr;

use http::{header, HeaderMap, Request, Response};
use hyper::body::{Body as _, Incoming};

use crate::body::{self, Body};
use crate::headers;
use crate::kubelet::{Kubelets, Location};
use crate::status::ApiError;

/// Forwards `req` to `loc`; `extra` headers are set on the outgoing request.
pub async fn forward(
    req: Request<Incoming>,
    loc: Location,
    peer: SocketAddr,
    extra: HeaderMap,
    kubelets: &Kubelets,
) -> Response<Body> {
    let host = headers::client_host(&req);
    let (parts, incoming) = req.into_parts();
    let mut out_headers = parts.headers;
    headers::strip_hop_by_hop(&mut out_headers);
    headers::strip_credentials(&mut out_headers);
    if let Some(h) = host {
        out_headers.insert(header::HOST, h);
    }
    headers::append_forwarded_for(&mut out_headers, peer.ip());
    for (k, v) in extra.iter() {
        out_headers.insert(k.clone(), v.clone());
    }
    let out_body = if incoming.is_end_stream() {
        out_headers.remove(header::CONTENT_LENGTH);
        body::empty()
    } else {
        body::boxed(incoming)
    };
    let mut out = Request::new(out_body);
    *out.method_mut() = parts.method;
    *out.headers_mut() = out_headers;

    match kubelets.send(&loc, out).await {
        Ok(resp) => {
            let (mut parts, incoming) = resp.into_parts();
            headers::strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, body::boxed(incoming))
        }
        Err(e) => {
            eprintln!("apiserver-sim: proxy to {} failed: {e:#}", loc.log_url());
            ApiError::backend(format!("error trying to reach service: {e:#}")).into_response()
        }
    }
}
