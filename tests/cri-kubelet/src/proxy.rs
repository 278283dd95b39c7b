//! Proxying an upgraded kubelet request to the runtime's streaming server, as the
//! kubelet's UpgradeAwareHandler does: the client's request goes to the CRI's URL with
//! its headers (Upgrade, X-Stream-Protocol-Version, Sec-WebSocket-*) unchanged, the
//! runtime's answer comes back as it is, and after a 101 the two connections are joined
//! byte for byte.

use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::server::{text, Body};

/// Bound on connecting to the streaming server and on its answer to the upgrade.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(15);

/// Forward `req` to `url` (from CRI Exec/Attach/PortForward) and splice after a 101.
pub async fn proxy_upgrade(mut req: Request<Incoming>, url: &str) -> Response<Body> {
    match forward(&mut req, url).await {
        Ok((resp, _conn)) => {
            let negotiated = |h: &str| {
                resp.headers()
                    .get(h)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_string()
            };
            // The record of what the runtime's streaming server agreed to.
            tracing::info!(
                "cri-kubelet: upgrade {} {} -> {} upgrade={} x-stream-protocol-version={} sec-websocket-protocol={}",
                req.method(),
                req.uri().path(),
                resp.status().as_u16(),
                negotiated("upgrade"),
                negotiated("x-stream-protocol-version"),
                negotiated("sec-websocket-protocol"),
            );
            if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                let client = hyper::upgrade::on(&mut req);
                let mut out = Response::builder().status(resp.status());
                for (k, v) in resp.headers() {
                    out = out.header(k, v);
                }
                let upstream = hyper::upgrade::on(resp);
                tokio::spawn(async move {
                    let (client, upstream) = match tokio::join!(client, upstream) {
                        (Ok(c), Ok(u)) => (c, u),
                        (c, u) => {
                            tracing::warn!(
                                client = ?c.err(),
                                upstream = ?u.err(),
                                "upgrade failed on one side"
                            );
                            return;
                        }
                    };
                    let mut client = TokioIo::new(client);
                    let mut upstream = TokioIo::new(upstream);
                    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                        Ok((up, down)) => tracing::debug!(up, down, "stream proxy closed"),
                        Err(e) => tracing::debug!("stream proxy ended: {e}"),
                    }
                });
                out.body(crate::server::empty()).unwrap_or_else(|_| {
                    text(StatusCode::INTERNAL_SERVER_ERROR, "bad upstream headers\n")
                })
            } else {
                let status = resp.status();
                let headers = resp.headers().clone();
                let body = match tokio::time::timeout(UPSTREAM_TIMEOUT, resp.into_body().collect())
                    .await
                {
                    Ok(Ok(b)) => b.to_bytes(),
                    _ => Bytes::new(),
                };
                let mut out = Response::builder().status(status);
                for (k, v) in &headers {
                    out = out.header(k, v);
                }
                out.body(crate::server::full(body)).unwrap_or_else(|_| {
                    text(StatusCode::INTERNAL_SERVER_ERROR, "bad upstream answer\n")
                })
            }
        }
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("streaming server {url}: {e:#}\n"),
        ),
    }
}

/// Send the request to the streaming server; returns its response and the connection
/// task (kept alive until the upgrade completes).
async fn forward(
    req: &mut Request<Incoming>,
    url: &str,
) -> Result<(Response<Incoming>, tokio::task::JoinHandle<()>)> {
    let uri: http::Uri = url.parse().with_context(|| format!("bad URL {url:?}"))?;
    let authority = uri.authority().context("URL without host")?.clone();
    let port = authority.port_u16().unwrap_or(80);
    let tcp = tokio::time::timeout(
        UPSTREAM_TIMEOUT,
        tokio::net::TcpStream::connect((authority.host(), port)),
    )
    .await
    .context("connect timed out")?
    .context("connect")?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .context("HTTP handshake")?;
    let task = tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("streaming server connection: {e}");
        }
    });
    let path = uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let mut out = Request::builder().method(req.method().clone()).uri(path);
    for (k, v) in req.headers() {
        if k == http::header::HOST || k == http::header::CONTENT_LENGTH {
            continue;
        }
        out = out.header(k, v);
    }
    out = out.header(http::header::HOST, authority.as_str());
    let out = out
        .body(Empty::<Bytes>::new())
        .context("building the upstream request")?;
    let resp = tokio::time::timeout(UPSTREAM_TIMEOUT, sender.send_request(out))
        .await
        .context("streaming server did not answer")?
        .context("streaming server request")?;
    Ok((resp, task))
}
