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

/// Serves the operations endpoints until the listener fails.
pub async fn serve(listener: TcpListener, ops: Arc<Ops>) -> std::io::Result<()> {
    loop {
        let (tcp, _) = listener.accept().await?;
        let ops = ops.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let r = handle(&ops, &req);
                async move { Ok::<_, Infallible>(r) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
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
