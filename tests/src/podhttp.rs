//! The HTTP server "behind the pod" for port-forward tests, and a client for it.
//!
//! kubelet-sim forwards a pod's port `P` to `127.0.0.1:P` on its host, so a server the
//! test starts on loopback is what the pod serves. It answers `GET /hello/<x>` with
//! `hello <x> from behind the pod` and `POST /echo` with the request body, and counts
//! the requests it served. [`HttpClient`] keeps one HTTP/1.1 connection open so that a
//! test can send several requests over one forwarded connection as well as over many.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

/// Bound on one request/response exchange.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(15);

/// A running pod-side HTTP server; stops when dropped.
pub struct PodHttpServer {
    pub port: u16,
    served: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PodHttpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(req: Request<Incoming>, served: Arc<AtomicU64>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let reply = |status: StatusCode, body: Bytes| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        r
    };
    let resp = match (method, path.strip_prefix("/hello/")) {
        (Method::GET, Some(x)) => reply(
            StatusCode::OK,
            Bytes::from(format!("hello {x} from behind the pod")),
        ),
        (Method::POST, None) if path == "/echo" => match req.into_body().collect().await {
            Ok(b) => reply(StatusCode::OK, b.to_bytes()),
            Err(e) => reply(StatusCode::BAD_REQUEST, Bytes::from(e.to_string())),
        },
        _ => reply(StatusCode::NOT_FOUND, Bytes::from_static(b"not found")),
    };
    served.fetch_add(1, Ordering::SeqCst);
    resp
}

impl PodHttpServer {
    /// Starts the server on a free loopback port.
    pub async fn start() -> Result<PodHttpServer> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the pod HTTP server")?;
        Self::serve(listener)
    }

    /// Starts the server on `listener`, bound already (e.g. inside a network namespace).
    pub fn start_on(listener: std::net::TcpListener) -> Result<PodHttpServer> {
        listener
            .set_nonblocking(true)
            .context("making the pod HTTP listener non-blocking")?;
        Self::serve(TcpListener::from_std(listener).context("registering the listener")?)
    }

    fn serve(listener: TcpListener) -> Result<PodHttpServer> {
        let port = listener.local_addr().context("local address")?.port();
        let served = Arc::new(AtomicU64::new(0));
        let counter = served.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let counter = counter.clone();
                        async move { Ok::<_, Infallible>(answer(req, counter).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Ok(PodHttpServer { port, served, task })
    }

    /// How many requests were answered.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }
}

/// One kept-alive HTTP/1.1 connection.
pub struct HttpClient {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
}

impl HttpClient {
    /// Connects to `addr`.
    pub async fn connect(addr: SocketAddr) -> Result<HttpClient> {
        Self::connect_with(addr, std::net::TcpStream::connect).await
    }

    /// Connects to `addr` with `dial` (a blocking connect, e.g. made inside a network
    /// namespace), bounded like [`HttpClient::connect`].
    pub async fn connect_with(
        addr: SocketAddr,
        dial: impl FnOnce(SocketAddr) -> std::io::Result<std::net::TcpStream> + Send + 'static,
    ) -> Result<HttpClient> {
        let fut = async {
            let tcp = tokio::task::spawn_blocking(move || dial(addr))
                .await
                .context("connect task")?
                .with_context(|| format!("connecting to {addr}"))?;
            tcp.set_nonblocking(true).context("non-blocking socket")?;
            let tcp = TcpStream::from_std(tcp).context("registering the socket")?;
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .context("HTTP/1.1 handshake")?;
            tokio::spawn(conn);
            Ok::<_, anyhow::Error>(HttpClient { sender, addr })
        };
        tokio::time::timeout(EXCHANGE_TIMEOUT, fut)
            .await
            .map_err(|_| anyhow!("connecting to {addr}: timed out"))?
    }

    /// Sends one request and returns the 200 response's body.
    pub async fn request(&mut self, method: Method, path: &str, body: Bytes) -> Result<Bytes> {
        let req = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(http::header::HOST, self.addr.to_string())
            .body(Full::new(body))
            .with_context(|| format!("building {method} {path}"))?;
        let fut = async {
            self.sender
                .ready()
                .await
                .context("connection not ready for another request")?;
            let resp = self
                .sender
                .send_request(req)
                .await
                .with_context(|| format!("{method} {path}"))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .with_context(|| format!("reading the body of {method} {path}"))?
                .to_bytes();
            if status != StatusCode::OK {
                bail!(
                    "{method} {path}: {status}: {}",
                    String::from_utf8_lossy(&body)
                );
            }
            Ok(body)
        };
        tokio::time::timeout(EXCHANGE_TIMEOUT, fut)
            .await
            .map_err(|_| anyhow!("{method} {path} via {}: timed out", self.addr))?
    }
}
