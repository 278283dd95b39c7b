//! # tether-cloud — the cloud end of the tunnel
//!
//! Follow a request from the apiserver to the kubelet by reading, in order:
//! - [`front`]: the HTTPS listener the kube-apiserver dials as if it were the
//!   kubelet (client-certificate authentication, HTTP/1.1 and HTTP/2, SNI);
//! - [`forward`]: one apiserver request → one logical stream: pick the node,
//!   send the request head, relay the response (a `101` upgrade becomes a byte
//!   pipe), map every failure to a clear HTTP status;
//! - [`identity`]: which client-certificate identities (CN/O) may use the
//!   front; any other certificate gets 403;
//! - [`authz`]: bearer tokens (TokenReview) and per-request
//!   SubjectAccessReviews for callers other than the apiserver, as a kubelet;
//!   [`apiserver`] builds the client for those reviews;
//! - [`authority`]: the apiserver's pods and nodes, watched, which routing
//!   trusts over what edges claim;
//! - [`registry`]: which edge sessions exist, the pods and addresses each
//!   reported, and the routing lookups that never guess;
//! - [`session`]: one edge's session: its current QUIC connection, its
//!   admission gate, and the logical streams that outlive any one connection;
//! - [`admission`]: the I/O-free rules for which session a hello joins and
//!   which connection a session is attached to;
//! - [`tunnel`]: the QUIC listener for edges: mutual TLS, hello/welcome,
//!   resume, pod reports, connection loss and grace expiry;
//! - [`gate`]: which Initials may start a handshake (Retry under load, a
//!   per-source rate);
//! - [`join`]: the join ALPN: a new edge presents a join token and a CSR
//!   and receives its certificate;
//! - [`drain`]: on SIGTERM, which edge is told to move to another replica
//!   when (staggered, after its streams end);
//! - [`revocation`]: revoked edge certificates (from the join store),
//!   refused at the handshake;
//! - [`members`]: which other replicas exist (static list, DNS) and which
//!   have a live peer link;
//! - [`peer`]: the peer listener between replicas: mutual TLS with peer
//!   certificates, the hello, and which stream a peer opened;
//! - [`routes`]: which edges each replica holds, pushed to its peers;
//! - [`relay`]: a request carried over the peer link to the replica that
//!   holds its edge, one hop, bytes untouched;
//! - [`tls`]: rustls configurations for both listeners;
//! - [`slim_tls`]: the edge listener's QUIC TLS sessions, which drop
//!   rustls once the handshake is over;
//! - [`session_tickets`]: the edge listener's TLS session tickets, which
//!   any replica opens (resumption without signatures after a restart);
//! - [`metrics`]: the Prometheus metrics, registered in one place (served
//!   with `/healthz`, `/readyz` and `/status` by [`tether_proto::ops`]);
//! - [`config`]: the typed configuration `main` parses once.

pub mod admission;
pub mod apiserver;
pub mod authority;
pub mod authz;
pub mod backlog;
pub mod config;
pub mod drain;
pub mod forward;
pub mod front;
pub mod gate;
pub mod identity;
pub mod join;
pub mod latest;
pub mod members;
pub mod metrics;
pub mod migration;
pub mod peer;
pub mod registry;
pub mod relay;
pub mod revocation;
pub mod routes;
pub mod session;
pub mod session_tickets;
pub mod slim_tls;
#[cfg(test)]
mod testlog;
pub mod tls;
pub mod tunnel;

use std::net::SocketAddr;
use std::sync::Arc;

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use tracing::info;

/// A running cloud: all listeners bound.
pub struct Cloud {
    pub tunnel_addr: SocketAddr,
    pub kubelet_api_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// The peer listener, when this replica has peers.
    pub peer_addr: Option<SocketAddr>,
    /// The other replicas, when this replica has peers.
    pub members: Option<Arc<members::Members>>,
    pub registry: Arc<registry::Registry>,
    pub metrics: metrics::CloudMetrics,
    endpoint: quinn::Endpoint,
    shutting_down: Arc<AtomicBool>,
    shutdown_grace: std::time::Duration,
    drain_spread: std::time::Duration,
    shutdown_delay: std::time::Duration,
    shutdown_close_wait: std::time::Duration,
    tasks: tokio::task::JoinSet<anyhow::Result<()>>,
}

impl Cloud {
    /// Binds all listeners and starts serving.
    pub async fn start(cfg: config::CloudConfig) -> anyhow::Result<Cloud> {
        let cfg = Arc::new(cfg);
        let mut prom = prometheus_client::registry::Registry::default();
        let metrics = metrics::CloudMetrics::register(&mut prom);
        let authority = match &cfg.authority {
            config::AuthoritySource::Apiserver {
                kubeconfig,
                sync_timeout,
                read_timeout,
            } => {
                if *read_timeout < authority::WATCH_SILENCE {
                    tracing::warn!(
                        read_timeout = ?read_timeout,
                        "--apiserver-read-timeout is below {:?}, the longest an idle watch of \
                         pods or nodes stays silent: idle watches are cut after it and opened \
                         again (from where they were, no new list), each with a warning",
                        authority::WATCH_SILENCE
                    );
                }
                let client = authority::client(kubeconfig.as_deref(), *read_timeout).await?;
                let a = authority::watch(client, *sync_timeout, *read_timeout)
                    .await
                    .context("watching pods and nodes on the apiserver")?;
                info!("routing by the apiserver's pods and nodes");
                Some(a)
            }
            config::AuthoritySource::EdgeReports => {
                tracing::warn!(
                    "--insecure-trust-edge-reports: routing by what edges report; an edge can \
                     claim another node's pods and addresses. Development only"
                );
                None
            }
        };
        if let Some(w) = cfg
            .join
            .as_ref()
            .and_then(config::JoinConfig::renewal_warning)
        {
            tracing::warn!("{w}");
        }
        if let Some(w) = cfg.route_record_warning() {
            tracing::warn!("{w}");
        }
        let registry = registry::Registry::with_authority(
            cfg.grace,
            authority,
            metrics.claims_refused.clone(),
        )
        .with_max_departed(cfg.max_departed_pods)
        .with_claim_warning_interval(cfg.claim_warning_interval);
        let registry = Arc::new(match &cfg.peer {
            Some(p) => registry.with_peer_message_limit(p.max_message_bytes),
            None => registry,
        });
        registry.set_timeouts(session::Timeouts {
            relay: cfg
                .peer
                .as_ref()
                .map_or(cfg.response_timeout, |p| p.timeout),
            first_attach: cfg.route_wait,
            reattach: cfg.grace,
        });
        let shutting_down = Arc::new(AtomicBool::new(false));
        let moves = migration::Watcher::new();
        let shared = tunnel::shared_key(&cfg).context("starting the QUIC listener for edges")?;
        let endpoint = tunnel::bind(&cfg, shared.clone(), &moves, &metrics)
            .context("starting the QUIC listener for edges")?;
        let tunnel_addr = endpoint
            .local_addr()
            .context("reading the QUIC listener's address")?;
        let front = front::Front::bind(cfg.clone(), registry.clone(), metrics.clone())
            .await
            .context("starting the kubelet-API listener")?;
        let kubelet_api_addr = front.local_addr()?;
        let ops_listener = tokio::net::TcpListener::bind(cfg.metrics_listen)
            .await
            .with_context(|| format!("binding the metrics listener {}", cfg.metrics_listen))?;
        let metrics_addr = ops_listener
            .local_addr()
            .context("reading the metrics listener's address")?;
        let mut tasks = tokio::task::JoinSet::new();
        let (peer_addr, members) = match &cfg.peer {
            Some(pc) => {
                let me = peer::ReplicaId::new(&pc.replica_name);
                let ep = peer::bind(pc).context("starting the peer listener")?;
                let addr = ep
                    .local_addr()
                    .context("reading the peer listener's address")?;
                let mut pc = pc.clone();
                pc.listen = addr;
                let members = members::Members::new(
                    me.clone(),
                    pc.clone(),
                    ep.clone(),
                    metrics.clone(),
                    registry.clone(),
                );
                let seen = members.clone();
                tasks.spawn(peer::serve(
                    ep,
                    me,
                    pc.clone(),
                    registry.clone(),
                    metrics.clone(),
                    Arc::new(move |addr, replica| seen.seen(addr, replica)),
                ));
                tasks.spawn(members.clone().run());
                (Some(addr), Some(members))
            }
            None => (None, None),
        };
        let sd = shutting_down.clone();
        let drain_flag = shutting_down.clone();
        let reg = registry.clone();
        let mem = members.clone();
        let ops = tether_proto::ops::Ops {
            registry: prom,
            ready: Box::new(move || {
                if sd.load(Ordering::Relaxed) {
                    Err("shutting down".into())
                } else {
                    Ok(())
                }
            }),
            status: Some(Box::new(move || {
                let mut v = status_json(&reg, mem.as_deref());
                // SIGTERM received: edges are being moved to other replicas.
                v["draining"] = serde_json::json!(drain_flag.load(Ordering::Relaxed));
                v
            })),
        };
        tasks.spawn(tunnel::serve(
            endpoint.clone(),
            cfg.clone(),
            registry.clone(),
            metrics.clone(),
            shutting_down.clone(),
            moves,
            shared,
        ));
        tasks.spawn(front.serve());
        tasks.spawn(async move {
            tether_proto::ops::serve(ops_listener, Arc::new(ops))
                .await
                .context("metrics listener failed")
        });
        tasks.spawn(sample_edges(registry.clone(), metrics.clone()));
        Ok(Cloud {
            tunnel_addr,
            kubelet_api_addr,
            metrics_addr,
            peer_addr,
            members,
            registry,
            metrics,
            endpoint,
            shutting_down,
            shutdown_grace: cfg.shutdown_grace,
            drain_spread: cfg.drain_spread,
            shutdown_delay: cfg.shutdown_delay,
            shutdown_close_wait: cfg.shutdown_close_wait,
            tasks,
        })
    }

    /// Runs until a listener fails.
    pub async fn run(&mut self) -> anyhow::Result<()> {
        match self.tasks.join_next().await {
            Some(Ok(r)) => r,
            Some(Err(e)) => Err(anyhow::anyhow!("listener task failed: {e}")),
            None => Ok(()),
        }
    }

    /// Graceful shutdown (SIGTERM): report not-ready and refuse new edge
    /// connections at once; tell the edges to move to another replica,
    /// staggered over `--drain-spread` (see [`drain`]: their streams move
    /// with them); let the streams this replica owns finish for up to
    /// `--shutdown-grace` (the kubelet-API listener and the peer links keep
    /// serving meanwhile); then reset what is left with a clear reason,
    /// close every edge connection left with the shutdown code and stop.
    pub async fn shutdown(mut self) {
        self.shutting_down.store(true, Ordering::Relaxed);
        let open = |r: &registry::Registry| {
            r.all_sessions()
                .iter()
                .map(|s| s.open_streams())
                .sum::<usize>()
        };
        info!(streams = open(&self.registry), grace = ?self.shutdown_grace, spread = ?self.drain_spread, "shutting down: not ready, moving edges, draining open streams");
        let started = tokio::time::Instant::now();
        let deadline = started + self.shutdown_grace;
        let moved =
            drain::move_edges(&self.registry, self.drain_spread, deadline, &self.metrics).await;
        info!(moved, "edges told to move");
        // Streams relayed from here to edges held by other replicas, and
        // requests still being routed, are not in this registry's sessions:
        // the gauge of every served request and stream has them.
        let served = |m: &metrics::CloudMetrics| m.streams_open_any.get().max(0) as usize;
        while (open(&self.registry) > 0 || served(&self.metrics) > 0)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        // With peers, keep answering until the load balancers have taken this
        // replica out (requests that still land here are routed to where the
        // edges went): at least --shutdown-delay after the SIGTERM. A lone
        // replica has nowhere to send them.
        if self.members.is_some() {
            tokio::time::sleep_until(started + self.shutdown_delay).await;
            // Requests that landed meanwhile finish too (still being routed,
            // or streaming), within --shutdown-grace.
            while (open(&self.registry) > 0 || served(&self.metrics) > 0)
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
        // What cannot survive: streams this replica owns (their apiserver
        // connections end with it). Each is reset with a clear reason, which
        // reaches the edge (directly or through the replica holding it now)
        // before the peer links close.
        let left = open(&self.registry);
        for s in self.registry.all_sessions() {
            s.end(
                tether_proto::frame::ResetCode::Shutdown,
                "the cloud replica that owned this stream is shutting down (--shutdown-grace ran out)",
            );
        }
        if left > 0 {
            info!(
                streams = left,
                "reset the streams still open after --shutdown-grace"
            );
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        self.endpoint.close(
            tether_proto::handshake::close_code::SHUTDOWN.into(),
            b"cloud shutting down",
        );
        // The peers learn at once that this replica's edges are gone.
        if let Some(m) = &self.members {
            m.close().await;
        }
        // quinn keeps each closed connection for three probe timeouts, to
        // answer a peer whose own close was lost; after a reconnect storm
        // inflated the RTT estimates that outlasts any reasonable wait.
        if tokio::time::timeout(self.shutdown_close_wait, self.endpoint.wait_idle())
            .await
            .is_err()
        {
            info!(
                connections = self.endpoint.open_connections(),
                wait = ?self.shutdown_close_wait,
                "edge connections still closing after --shutdown-close-wait: exiting without them"
            );
        }
        self.tasks.abort_all();
        info!("shut down");
    }
}

/// The `/status` document: connected nodes with addresses, RTT and connected-since.
fn status_json(
    registry: &registry::Registry,
    members: Option<&members::Members>,
) -> serde_json::Value {
    let nodes: Vec<_> = registry
        .sessions()
        .iter()
        .map(|s| {
            let (connected, rtt_ms, remote) = match s.connection() {
                Some(c) => (
                    true,
                    Some(c.rtt().as_secs_f64() * 1e3),
                    Some(c.remote_address().to_string()),
                ),
                None => (false, None, None),
            };
            let since = s
                .connected_since()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            serde_json::json!({
                "node": s.node,
                "session": s.id.to_string(),
                "connected": connected,
                "remote": remote,
                "addresses": s.addresses(),
                "rtt_ms": rtt_ms,
                "connected_since_unix": since,
                "open_streams": s.open_streams(),
            })
        })
        .collect();
    match members {
        Some(m) => serde_json::json!({
            "replica": m.me().name,
            "nodes": nodes,
            "peers": m.status().iter().map(|p| p.json()).collect::<Vec<_>>(),
            "remote_nodes": registry
                .remote_status()
                .into_iter()
                .map(|(node, replica, connected)| serde_json::json!({
                    "node": node,
                    "replica": replica,
                    "connected": connected,
                }))
                .collect::<Vec<_>>(),
        }),
        None => serde_json::json!({ "nodes": nodes }),
    }
}

/// Samples RTT and loss of every connected edge every 10 s.
async fn sample_edges(
    registry: Arc<registry::Registry>,
    metrics: metrics::CloudMetrics,
) -> anyhow::Result<()> {
    let mut lost: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(10)).await;
        let sessions = registry.sessions();
        metrics.sessions.set(sessions.len() as i64);
        let mut seen = std::collections::HashMap::new();
        for s in sessions {
            if let Some(c) = s.connection() {
                metrics.edge_rtt_seconds.observe(c.rtt().as_secs_f64());
                let now = c.stats().path.lost_packets;
                let before = lost.get(&s.node).copied().unwrap_or(0);
                if now > before {
                    metrics.edge_lost_packets.inc_by(now - before);
                }
                seen.insert(s.node.clone(), now);
            }
        }
        lost = seen;
    }
}
