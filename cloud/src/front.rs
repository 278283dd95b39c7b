//! The HTTPS listener the kube-apiserver dials as if it were the kubelet.
//!
//! TLS with a client certificate from the apiserver client CA required (the
//! kubelet's own rule, `--client-ca-file`); the certificate's identity (CN/O)
//! is kept so each request can be authorised ([`crate::identity`]). HTTP/2 or
//! HTTP/1.1 by ALPN (HTTP/1.1 when the client offered none, as the kubelet),
//! upgrades allowed. The SNI of each connection is kept for routing. A slow
//! or broken client affects its own connection only: the TLS handshake and
//! request head (on HTTP/2, the preface and first request) are bounded in
//! time and size, connections in number, HTTP/2 streams per connection in
//! number, and a peer that went away without a word is found by keep-alives
//! (HTTP/2 PINGs and TCP's own probes).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper::Response;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::config::CloudConfig;
use crate::forward::{self, ConnInfo, ResBody};
use crate::identity::ClientIdentity;
use crate::registry::Registry;

/// The bound kubelet-API listener.
pub struct Front {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    cfg: Arc<CloudConfig>,
    registry: Arc<Registry>,
    metrics: crate::metrics::CloudMetrics,
    reviewer: Option<Arc<crate::authz::Reviewer>>,
}

impl Front {
    /// Loads certificates and binds the TCP listener.
    pub async fn bind(
        cfg: Arc<CloudConfig>,
        registry: Arc<Registry>,
        metrics: crate::metrics::CloudMetrics,
    ) -> anyhow::Result<Front> {
        let tls = crate::tls::front_server_config(&cfg)?;
        if cfg.apiserver_client_ca.is_none() {
            warn!("--insecure-skip-client-auth: ANYONE who reaches {} can exec into edge pods; local development only", cfg.kubelet_listen);
        }
        let reviewer = match &cfg.webhook {
            Some(w) => {
                let client = crate::apiserver::client(w.kubeconfig.as_deref())
                    .await
                    .context("the apiserver client for --authorization-webhook")?;
                Some(Arc::new(crate::authz::Reviewer::new(
                    client,
                    w.reviews.clone(),
                )))
            }
            None => None,
        };
        let listener = TcpListener::bind(cfg.kubelet_listen)
            .await
            .with_context(|| format!("binding TCP {}", cfg.kubelet_listen))?;
        Ok(Front {
            listener,
            acceptor: TlsAcceptor::from(Arc::new(tls)),
            cfg,
            registry,
            metrics,
            reviewer,
        })
    }

    pub fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        self.listener
            .local_addr()
            .context("reading the kubelet-API listener's address")
    }

    /// Serves connections until the listener fails.
    pub async fn serve(self) -> anyhow::Result<()> {
        let slots = Arc::new(Semaphore::new(self.cfg.max_apiserver_connections));
        let ctx = Arc::new(forward::Forwarder::new(
            self.cfg.clone(),
            self.registry.clone(),
            self.metrics.clone(),
            self.reviewer.clone(),
        ));
        loop {
            let (tcp, peer) = match self.listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off briefly, keep serving.
                    warn!(error = %e, "accepting an apiserver connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                warn!(%peer, limit = self.cfg.max_apiserver_connections, "refusing apiserver connection: --max-apiserver-connections reached");
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let keep_alive = (
                self.cfg.apiserver_keep_alive,
                self.cfg.apiserver_keep_alive_probes,
            );
            if let Err(e) = tcp_keep_alive(&tcp, keep_alive) {
                debug!(%peer, error = %e, "setting TCP keep-alive on an apiserver connection");
            }
            let conn = Conn {
                acceptor: self.acceptor.clone(),
                cfg: self.cfg.clone(),
                ctx: ctx.clone(),
            };
            tokio::spawn(conn.handshake(tcp, peer, permit));
        }
    }
}

/// What one apiserver connection needs from the listener.
struct Conn {
    acceptor: TlsAcceptor,
    cfg: Arc<CloudConfig>,
    ctx: Arc<forward::Forwarder>,
}

/// A request's future as hyper holds it: boxed (see [`Conn::handshake`]).
type Handling = Pin<Box<dyn Future<Output = Result<Response<ResBody>, Infallible>> + Send>>;

impl Conn {
    /// TLS within `--http-header-timeout`, then a task of its own serving
    /// HTTP until the connection ends (with `permit`, its slot of
    /// `--max-apiserver-connections`).
    ///
    /// HTTP/2 when ALPN chose it, HTTP/1.1 otherwise, as the kubelet itself
    /// (Go's server speaks HTTP/2 over TLS only by ALPN). Going by the
    /// handshake instead of sniffing the first bytes (`hyper_util`'s auto
    /// server) also keeps hyper's HTTP/1 read buffer at 8 KiB: the sniffer
    /// hands hyper its first 24 bytes apart from the rest, and the buffer's
    /// reserve then doubled to 16 KiB for the life of a connection, which a
    /// `logs -f` holds for hours.
    ///
    /// What a connection holds for its life is sized to what it serves:
    /// this task, laid out for the TLS handshake and for building either
    /// protocol's future (5 KiB when it also awaited them), ends with the
    /// handshake, and the connection's own future lives in one box, awaited
    /// by a task of a few words.
    async fn handshake(self, tcp: TcpStream, peer: SocketAddr, permit: OwnedSemaphorePermit) {
        let Conn { acceptor, cfg, ctx } = self;
        let tls = match tokio::time::timeout(cfg.http_header_timeout, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                info!(%peer, error = %e, "apiserver TLS handshake failed");
                return;
            }
            Err(_) => {
                info!(%peer, "apiserver TLS handshake timed out");
                return;
            }
        };
        let (_, server_conn) = tls.get_ref();
        let h2 = server_conn.alpn_protocol() == Some(b"h2");
        let info = Arc::new(ConnInfo {
            peer,
            sni: server_conn.server_name().map(str::to_string),
            identity: server_conn
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| ClientIdentity::from_der(c.as_ref())),
        });
        // hyper keeps room for one request's future per HTTP/1 connection for
        // the connection's whole life; the handler's is several KiB and a
        // streamed response outlives it, so it lives in a box of its own
        // only while a request is being answered.
        let service = |first: Option<Arc<Notify>>| {
            service_fn(move |req| -> Handling {
                if let Some(first) = &first {
                    first.notify_one();
                }
                let ctx = ctx.clone();
                let info = info.clone();
                Box::pin(async move { Ok(ctx.handle(req, info).await) })
            })
        };
        let io = TokioIo::new(tls);
        if h2 {
            // hyper bounds neither HTTP/2's preface nor the first request
            // (its header-read timer is HTTP/1's), and keep-alive PINGs
            // start only after the preface: the first request must come
            // within `--http-header-timeout` as on HTTP/1.
            let first = Arc::new(Notify::new());
            let conn = http2_builder(&cfg).serve_connection(io, service(Some(first.clone())));
            let conn = first_request_within(conn, first, cfg.http_header_timeout, peer);
            tokio::spawn(serve(Box::pin(conn), peer, permit));
        } else {
            let service = service(None);
            let conn = http1_builder(&cfg).serve_connection(io, service);
            tokio::spawn(serve(Box::pin(conn.with_upgrades()), peer, permit));
        }
    }
}

/// Serves one connection until it ends; then its slot is free.
async fn serve<F, E>(conn: Pin<Box<F>>, peer: SocketAddr, permit: OwnedSemaphorePermit)
where
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    if let Err(e) = conn.await {
        debug!(%peer, error = %e, "apiserver connection ended with an error");
    }
    drop(permit);
}

/// Serves an HTTP/2 connection, or ends it (and frees its slot) when its
/// first request (`first`, notified by the service) has not come within
/// `timeout` of the TLS handshake: a client that sends no preface, or a
/// preface and nothing more.
async fn first_request_within<F, E>(
    conn: F,
    first: Arc<Notify>,
    timeout: Duration,
    peer: SocketAddr,
) -> Result<(), E>
where
    F: Future<Output = Result<(), E>>,
{
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = &mut conn => return r,
        _ = first.notified() => {}
        _ = tokio::time::sleep(timeout) => {
            info!(%peer, "apiserver HTTP/2 connection sent no request within --http-header-timeout; closing it");
            return Ok(());
        }
    }
    drop(first);
    conn.await
}

/// TCP keep-alive on an accepted apiserver connection, so that a peer gone
/// without a FIN or RST (a half-open connection under a quiet `logs -f`) is
/// found and its slot freed: probes after `every` of silence, then every
/// `every`, and the connection dropped after `probes` unanswered ones
/// (`--apiserver-keep-alive-probes`; the kernel's own count, 9, kept a dead
/// connection 5 minutes at 30 s).
///
/// No TCP_USER_TIMEOUT is set. Linux applies it to zero-window probing
/// too, so it would cut a client that stops reading for a while as data
/// waits for it (an HTTP/1.1 exec or port-forward whose terminal is paused),
/// which a kubelet never does. A peer that vanished while data was in flight
/// is left to the kernel's retransmission limit (`tcp_retries2`, about 15
/// minutes), as on a kubelet; on HTTP/2 the unanswered PING finds it sooner.
fn tcp_keep_alive(tcp: &TcpStream, (every, probes): (Duration, u32)) -> std::io::Result<()> {
    let ka = socket2::TcpKeepalive::new()
        .with_time(every)
        .with_interval(every)
        .with_retries(probes);
    let sock = socket2::SockRef::from(tcp);
    sock.set_tcp_keepalive(&ka)
}

/// HTTP/1.1: request heads bounded in size and time (`--max-http-header-bytes`,
/// `--http-header-timeout`). The size is checked on the parsed head
/// (`max_header_size`): the read buffer's bound alone (`max_buf_size`) is
/// only checked while a head is incomplete, so a head that arrived whole in
/// one large read could pass it.
fn http1_builder(cfg: &CloudConfig) -> http1::Builder {
    let mut b = http1::Builder::new();
    b.max_buf_size(cfg.max_http_header_bytes)
        .max_header_size(cfg.max_http_header_bytes)
        .header_read_timeout(cfg.http_header_timeout)
        .timer(hyper_util::rt::TokioTimer::new());
    b
}

/// HTTP/2: header lists bounded in size (`--max-http-header-bytes`),
/// streams open at once in number (`--max-apiserver-streams-per-connection`,
/// announced in SETTINGS; h2 refuses one more with REFUSED_STREAM); a PING
/// every `--apiserver-keep-alive`, and the connection closed when one goes
/// unanswered that long.
fn http2_builder(cfg: &CloudConfig) -> http2::Builder<TokioExecutor> {
    let mut b = http2::Builder::new(TokioExecutor::new());
    b.max_header_list_size(cfg.max_http_header_bytes as u32)
        .max_concurrent_streams(cfg.max_apiserver_streams_per_connection)
        .keep_alive_interval(cfg.apiserver_keep_alive)
        .keep_alive_timeout(cfg.apiserver_keep_alive)
        .timer(hyper_util::rt::TokioTimer::new());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An accepted apiserver connection probes a silent peer (TCP's own
    /// keep-alive is off by default) every `--apiserver-keep-alive`, gives
    /// up after `--apiserver-keep-alive-probes` unanswered probes (not the
    /// kernel's 9), and sets no TCP_USER_TIMEOUT (it would cut a paused
    /// reader).
    #[tokio::test]
    async fn accepted_connections_get_tcp_keep_alive() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        let sock = socket2::SockRef::from(&tcp);
        assert!(!sock.keepalive().unwrap());
        assert_eq!(sock.tcp_user_timeout().unwrap(), None);
        tcp_keep_alive(&tcp, (Duration::from_secs(7), 3)).unwrap();
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.keepalive_time().unwrap(), Duration::from_secs(7));
        assert_eq!(sock.keepalive_interval().unwrap(), Duration::from_secs(7));
        assert_eq!(sock.keepalive_retries().unwrap(), 3);
        assert_eq!(sock.tcp_user_timeout().unwrap(), None);
    }
}
