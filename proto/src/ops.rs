//! The operations listener both binaries serve: Prometheus text exposition
//! on `/metrics`, liveness on `/healthz`, readiness on `/readyz`, and an
//! optional read-only JSON `/status`. Plain HTTP on its own port, separate
//! from the tunnel and the kubelet API; metric registration stays in each
//! binary's `metrics` module.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Readiness: `Ok` when ready, else why not.
pub type ReadyFn = dyn Fn() -> Result<(), String> + Send + Sync;
/// The `/status` document.
pub type StatusFn = dyn Fn() -> serde_json::Value + Send + Sync;

/// What the operations listener serves.
pub struct Ops {
    pub registry: Registry,
    pub ready: Box<ReadyFn>,
    pub status: Option<Box<StatusFn>>,
}

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

fn handle(ops: &Ops, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/metrics" => {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, &ops.registry) {
                Ok(()) => reply(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    out,
                ),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("encoding metrics: {e}\n"),
                ),
            }
        }
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => match (ops.ready)() {
            Ok(()) => reply(StatusCode::OK, "text/plain", "ready\n"),
            Err(why) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("not ready: {why}\n"),
            ),
        },
        "/status" => match &ops.status {
            Some(f) => reply(StatusCode::OK, "application/json", f().to_string()),
            None => reply(StatusCode::NOT_FOUND, "text/plain", "no status here\n"),
        },
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// Bounds of the operations listener: it is plain HTTP, often reachable by
/// more than the scraper, so neither idle nor slow clients may pile up.
#[derive(Debug, Clone, Copy)]
pub struct OpsLimits {
    /// Connections served at once; further ones are closed at once.
    pub max_connections: usize,
    /// Time allowed for a request head (also bounds an idle keep-alive).
    pub header_timeout: std::time::Duration,
}

impl Default for OpsLimits {
    fn default() -> Self {
        OpsLimits {
            max_connections: 64,
            header_timeout: std::time::Duration::from_secs(10),
        }
    }
}

/// Serves the operations endpoints until the listener fails.
pub async fn serve(listener: TcpListener, ops: Arc<Ops>) -> std::io::Result<()> {
    serve_with(listener, ops, OpsLimits::default()).await
}

/// [`serve`] with explicit bounds.
pub async fn serve_with(
    listener: TcpListener,
    ops: Arc<Ops>,
    limits: OpsLimits,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    loop {
        let (tcp, _) = listener.accept().await?;
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(tcp);
            continue;
        };
        let ops = ops.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let r = handle(&ops, &req);
                async move { Ok::<_, Infallible>(r) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
            drop(permit);
        });
    }
}

/// Counters of bytes moved through resumable streams, shared by all streams
/// of a binary.
#[derive(Clone, Debug, Default)]
pub struct ByteCounters {
    /// Bytes the local side read from streams (came from the peer).
    pub received: prometheus_client::metrics::counter::Counter,
    /// Bytes the local side wrote into streams (sent to the peer).
    pub sent: prometheus_client::metrics::counter::Counter,
    /// Bytes transmitted again after a stream was re-attached to a new
    /// connection (what the resume replayed).
    pub replayed: prometheus_client::metrics::counter::Counter,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Reads until the server closes; how long that took.
    async fn closed_after(s: &mut tokio::net::TcpStream) -> Duration {
        let t = Instant::now();
        let mut buf = [0u8; 4096];
        let _ = tokio::time::timeout(Duration::from_secs(10), async {
            while s.read(&mut buf).await.map(|n| n > 0).unwrap_or(false) {}
        })
        .await;
        t.elapsed()
    }

    #[tokio::test]
    async fn silent_clients_are_cut_off_and_connections_are_bounded() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ops = Arc::new(Ops {
            registry: Registry::default(),
            ready: Box::new(|| Ok(())),
            status: None,
        });
        let limits = OpsLimits {
            max_connections: 2,
            header_timeout: Duration::from_millis(500),
        };
        let server = tokio::spawn(serve_with(listener, ops, limits));
        // Two silent clients hold both slots; a third is closed at once.
        let mut a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut b = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(closed_after(&mut c).await < Duration::from_millis(400));
        // The silent ones are closed after the header timeout.
        assert!(closed_after(&mut a).await < Duration::from_secs(3));
        assert!(closed_after(&mut b).await < Duration::from_secs(3));
        // Then the listener serves again.
        let mut d = tokio::net::TcpStream::connect(addr).await.unwrap();
        d.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        d.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        server.abort();
    }
}
