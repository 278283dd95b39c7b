//! # tether-cloud — the cloud end of the tunnel
//!
//! Follow a request from the apiserver to the kubelet by reading, in order:
//! - [`front`]: the HTTPS listener the kube-apiserver dials as if it were the
//!   kubelet (client-certificate authentication, HTTP/1.1 and HTTP/2, SNI);
//! - [`forward`]: one apiserver request → one logical stream: pick the node,
//!   send the request head, relay the response (a `101` upgrade becomes a byte
//!   pipe), map every failure to a clear HTTP status;
//! - [`registry`]: which edge sessions exist, the pods and addresses each
//!   reported, and the routing lookups that never guess;
//! - [`session`]: one edge's session: its current QUIC connection, resume
//!   token, and the logical streams that outlive any one connection;
//! - [`tunnel`]: the QUIC listener for edges: mutual TLS, hello/welcome,
//!   resume, pod reports, connection loss and grace expiry;
//! - [`tls`]: rustls configurations for both listeners;
//! - [`config`]: the typed configuration `main` parses once.

pub mod config;
pub mod forward;
pub mod front;
pub mod registry;
pub mod session;
pub mod tls;
pub mod tunnel;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;

/// A running cloud: both listeners bound.
pub struct Cloud {
    pub tunnel_addr: SocketAddr,
    pub kubelet_api_addr: SocketAddr,
    pub registry: Arc<registry::Registry>,
    tasks: tokio::task::JoinSet<anyhow::Result<()>>,
}

impl Cloud {
    /// Binds both listeners and starts serving.
    pub async fn start(cfg: config::CloudConfig) -> anyhow::Result<Cloud> {
        let cfg = Arc::new(cfg);
        let registry = Arc::new(registry::Registry::new(cfg.grace));
        let endpoint = tunnel::bind(&cfg).context("starting the QUIC listener for edges")?;
        let tunnel_addr = endpoint
            .local_addr()
            .context("reading the QUIC listener's address")?;
        let front = front::Front::bind(cfg.clone(), registry.clone())
            .await
            .context("starting the kubelet-API listener")?;
        let kubelet_api_addr = front.local_addr()?;
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(tunnel::serve(endpoint, cfg.clone(), registry.clone()));
        tasks.spawn(front.serve());
        Ok(Cloud {
            tunnel_addr,
            kubelet_api_addr,
            registry,
            tasks,
        })
    }

    /// Runs until a listener fails.
    pub async fn run(mut self) -> anyhow::Result<()> {
        match self.tasks.join_next().await {
            Some(Ok(r)) => r,
            Some(Err(e)) => Err(anyhow::anyhow!("listener task failed: {e}")),
            None => Ok(()),
        }
    }
}
