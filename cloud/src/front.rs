//! The HTTPS listener the kube-apiserver dials as if it were the kubelet.
//!
//! TLS with a client certificate from the apiserver client CA required (the
//! kubelet's own rule, `--client-ca-file`); the certificate's identity (CN/O)
//! is kept so each request can be authorised ([`crate::identity`]). HTTP/2 or
//! HTTP/1.1 by ALPN,
//! upgrades allowed. The SNI of each connection is kept for routing. A slow
//! or broken client affects its own connection only: the TLS handshake and
//! request head are bounded in time and size, connections in number.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::config::CloudConfig;
use crate::forward::{self, ConnInfo};
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
            let acceptor = self.acceptor.clone();
            let cfg = self.cfg.clone();
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let tls = match tokio::time::timeout(cfg.http_header_timeout, acceptor.accept(tcp))
                    .await
                {
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
                let info = Arc::new(ConnInfo {
                    peer,
                    sni: server_conn.server_name().map(str::to_string),
                    identity: server_conn
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .and_then(|c| ClientIdentity::from_der(c.as_ref())),
                });
                let service = service_fn(move |req| {
                    let ctx = ctx.clone();
                    let info = info.clone();
                    async move { Ok::<_, std::convert::Infallible>(ctx.handle(req, info).await) }
                });
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                builder
                    .http1()
                    .max_buf_size(cfg.max_http_header_bytes)
                    .header_read_timeout(cfg.http_header_timeout)
                    .timer(hyper_util::rt::TokioTimer::new());
                builder
                    .http2()
                    .max_header_list_size(cfg.max_http_header_bytes as u32);
                if let Err(e) = builder
                    .serve_connection_with_upgrades(TokioIo::new(tls), service)
                    .await
                {
                    debug!(%peer, error = %e, "apiserver connection ended with an error");
                }
                drop(permit);
            });
        }
    }
}
