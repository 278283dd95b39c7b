//! The kubelet stand-in every peer reaches: HTTPS (HTTP/1.1) with client certificates
//! required, like a real kubelet, in-process, serving on a listener made inside the
//! link's edge namespace. So every peer carries the apiserver's end-to-end TLS to the
//! kubelet (through ssh -R and rathole) or terminates and re-originates it (Tether),
//! as in a cluster.
//!
//! - any request with `Upgrade:` → `101`, then every byte is echoed (an `exec -it`
//!   session whose shell echoes keystrokes);
//! - `GET /pods` → the pod list the Tether edge reports to its cloud;
//! - `GET /containerLogs/default/bulk/c?limitBytes=N` → `N` bytes as fast as the reader
//!   takes them (bulk throughput);
//! - `GET /containerLogs/default/chatty/c?id=K&rate=R` → an endless log at `R` bytes/s
//!   whose byte at offset `i` is [`pattern`]`(i)`, so a reader can tell a gap or a
//!   duplicate from an intact stream; the bytes handed to the connection so far are
//!   counted under id `K` ([`Kubelet::sent`]) to compute bytes lost when a stream dies.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

/// A response or request body.
pub type Body = BoxBody<Bytes, std::io::Error>;

/// The pods the stand-in runs.
pub const PODS: &[&str] = &["default/p1", "default/bulk", "default/chatty"];

/// The byte at offset `i` of a chatty log.
pub fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

/// Counters of the chatty streams, by id.
type Counters = Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>;

/// A running stand-in; stops serving when dropped.
pub struct Kubelet {
    pub port: u16,
    counters: Counters,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Kubelet {
    /// Serves on `listener` (bound inside the edge namespace); TLS with `tls`.
    pub fn start(
        listener: std::net::TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Result<Kubelet> {
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let counters: Counters = Arc::default();
        let c = counters.clone();
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let _ = tcp.set_nodelay(true);
                let c = c.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| serve(req, c.clone()));
                    let http = hyper::server::conn::http1::Builder::new();
                    match acceptor {
                        Some(a) => {
                            // A failed handshake is the client's problem; drop it.
                            let Ok(tls) = a.accept(tcp).await else { return };
                            let _ = http
                                .serve_connection(TokioIo::new(tls), svc)
                                .with_upgrades()
                                .await;
                        }
                        None => {
                            let _ = http
                                .serve_connection(TokioIo::new(tcp), svc)
                                .with_upgrades()
                                .await;
                        }
                    }
                });
            }
        });
        Ok(Kubelet {
            port,
            counters,
            task,
        })
    }

    /// Bytes the chatty stream `id` has handed to its connection so far.
    pub fn sent(&self, id: &str) -> u64 {
        self.counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .map(|c| c.load(Ordering::Relaxed))
            .unwrap_or(0)
    }
}

fn full(s: impl Into<Bytes>) -> Body {
    Full::new(s.into())
        .map_err(|n: Infallible| match n {})
        .boxed()
}

fn query<'a>(req: &'a Request<Incoming>, key: &str) -> Option<&'a str> {
    req.uri()
        .query()?
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

async fn serve(
    mut req: Request<Incoming>,
    counters: Counters,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let mut resp = Response::new(full(""));
    if let Some(proto) = req.headers().get("upgrade").cloned() {
        tether_tests::netns::spawn_echo(hyper::upgrade::on(&mut req));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let h = resp.headers_mut();
        h.insert(
            "connection",
            hyper::header::HeaderValue::from_static("Upgrade"),
        );
        h.insert("upgrade", proto);
        h.insert(
            "x-stream-protocol-version",
            hyper::header::HeaderValue::from_static("v4.channel.k8s.io"),
        );
    } else if path == "/pods" {
        *resp.body_mut() = full(tether_tests::netns::pod_list_json(PODS));
    } else if path.starts_with("/containerLogs/default/bulk/") {
        let total: u64 = query(&req, "limitBytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1 << 20);
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let stream = futures_util::stream::unfold(0u64, move |sent| {
            let chunk = chunk.clone();
            async move {
                if sent >= total {
                    return None;
                }
                let n = (total - sent).min(chunk.len() as u64) as usize;
                Some((
                    Ok::<_, std::io::Error>(Frame::data(chunk.slice(..n))),
                    sent + n as u64,
                ))
            }
        });
        *resp.body_mut() = StreamBody::new(stream).boxed();
    } else if path.starts_with("/containerLogs/default/chatty/") {
        let id = query(&req, "id").unwrap_or("-").to_string();
        let rate: u64 = query(&req, "rate")
            .and_then(|v| v.parse().ok())
            .unwrap_or(256 * 1024)
            .max(1000);
        let counter = Arc::new(AtomicU64::new(0));
        counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, counter.clone());
        // A chunk every 10 ms.
        let per_tick = (rate / 100).max(1);
        let stream = futures_util::stream::unfold(0u64, move |off| {
            let counter = counter.clone();
            async move {
                if off > 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let chunk: Vec<u8> = (off..off + per_tick).map(pattern).collect();
                counter.store(off + per_tick, Ordering::Relaxed);
                Some((
                    Ok::<_, std::io::Error>(Frame::data(Bytes::from(chunk))),
                    off + per_tick,
                ))
            }
        });
        *resp.body_mut() = StreamBody::new(stream).boxed();
    } else if path == "/healthz" {
        *resp.body_mut() = full("ok");
    } else {
        *resp.status_mut() = StatusCode::NOT_FOUND;
    }
    Ok(resp)
}
