//! Membership: which other replicas exist and which of them this replica has
//! a live peer link to.
//!
//! The candidates are the static `--peers` and every A/AAAA record of
//! `--peer-dns` (a headless Service answers one record per ready pod). They
//! are resolved again every `--peer-resolve-interval`; each candidate without
//! a link is dialled ([`crate::peer::dial`]), concurrently, each dial bounded
//! by `--peer-timeout`, so one silent peer never delays the others. An
//! address that turns out to be this replica (its hello carries our own
//! instance number) is remembered and not dialled again while it is listed.
//!
//! A replica that **joins** is linked on the next round (within one resolve
//! interval). One that **leaves** is noticed when its link closes — at once
//! for a clean exit, within `--peer-timeout` (QUIC idle timeout) for a crash
//! or a cut link — or when it drops out of DNS, whichever is first. The
//! gauge `tether_cloud_peers_up` counts live links; `/status` lists them.
//! Over each link it dialled, this replica subscribes to the peer's routes
//! ([`crate::routes`]) for as long as the link lives.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tracing::{debug, info, warn};

use crate::config::PeerConfig;
use crate::metrics::CloudMetrics;
use crate::peer::{self, PeerError, PeerLink, ReplicaId};
use crate::registry::Registry;
use crate::routes;

/// What this replica knows about one candidate address.
#[derive(Debug, Clone)]
enum Candidate {
    /// A dial is in flight.
    Dialling,
    /// Linked.
    Up { link: PeerLink, since: SystemTime },
    /// The address is this replica.
    IsSelf,
    /// The last dial failed (retried next round).
    Down { error: String },
}

/// One peer as `/status` shows it.
#[derive(Debug, Clone)]
pub struct PeerStatus {
    pub addr: SocketAddr,
    pub up: bool,
    pub replica: Option<String>,
    pub up_since_unix: Option<u64>,
    pub error: Option<String>,
}

impl PeerStatus {
    /// The `/status` entry.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "addr": self.addr.to_string(),
            "up": self.up,
            "replica": self.replica,
            "up_since_unix": self.up_since_unix,
            "error": self.error,
        })
    }
}

/// The membership table and the task that keeps it current.
pub struct Members {
    me: ReplicaId,
    cfg: PeerConfig,
    endpoint: quinn::Endpoint,
    metrics: CloudMetrics,
    registry: Arc<Registry>,
    table: Mutex<HashMap<SocketAddr, Candidate>>,
}

impl Members {
    /// A table for `me`, dialling out of `endpoint`.
    pub fn new(
        me: ReplicaId,
        cfg: PeerConfig,
        endpoint: quinn::Endpoint,
        metrics: CloudMetrics,
        registry: Arc<Registry>,
    ) -> Arc<Members> {
        Arc::new(Members {
            me,
            cfg,
            endpoint,
            metrics,
            registry,
            table: Mutex::new(HashMap::new()),
        })
    }

    /// Closes every peer link at once (the end of a shutdown), so the peers
    /// drop this replica's edges now rather than after `--peer-timeout`;
    /// waits (bounded) for the closes to go out.
    pub async fn close(&self) {
        self.endpoint
            .close(peer::close_code::LEFT.into(), b"replica shut down");
        let _ = tokio::time::timeout(self.cfg.timeout, self.endpoint.wait_idle()).await;
    }

    /// A peer dialled us from `addr` as `replica`: if our own link to that
    /// address is to an older instance (the peer restarted at the same
    /// address), that link is stale — close it and dial again now, rather
    /// than after `--peer-timeout`.
    pub fn seen(self: &Arc<Self>, addr: SocketAddr, replica: &ReplicaId) {
        let mut table = self.table();
        let stale = matches!(
            table.get(&addr),
            Some(Candidate::Up { link, .. }) if link.replica.instance != replica.instance
        );
        if !stale {
            return;
        }
        if let Some(Candidate::Up { link, .. }) = table.get(&addr) {
            info!(peer = %replica.name, %addr, "peer restarted; dialling its new instance");
            link.conn
                .close(peer::close_code::LEFT.into(), b"replaced by a restart");
        }
        table.insert(addr, Candidate::Dialling);
        self.publish(&table);
        tokio::spawn(self.clone().dial(addr));
    }

    /// This replica.
    pub fn me(&self) -> &ReplicaId {
        &self.me
    }

    fn table(&self) -> MutexGuard<'_, HashMap<SocketAddr, Candidate>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Live links to other replicas.
    pub fn up(&self) -> Vec<PeerLink> {
        self.table()
            .values()
            .filter_map(|c| match c {
                Candidate::Up { link, .. } => Some(link.clone()),
                _ => None,
            })
            .collect()
    }

    /// Every candidate but this replica, for `/status`.
    pub fn status(&self) -> Vec<PeerStatus> {
        let mut v: Vec<PeerStatus> = self
            .table()
            .iter()
            .filter_map(|(addr, c)| {
                let unix = |t: &SystemTime| {
                    t.duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .ok()
                };
                let (up, replica, since, error) = match c {
                    Candidate::IsSelf => return None,
                    Candidate::Dialling => (false, None, None, None),
                    Candidate::Up { link, since } => {
                        (true, Some(link.replica.name.clone()), unix(since), None)
                    }
                    Candidate::Down { error } => (false, None, None, Some(error.clone())),
                };
                Some(PeerStatus {
                    addr: *addr,
                    up,
                    replica,
                    up_since_unix: since,
                    error,
                })
            })
            .collect();
        v.sort_by_key(|p| p.addr);
        v
    }

    fn publish(&self, table: &HashMap<SocketAddr, Candidate>) {
        let up = table
            .values()
            .filter(|c| matches!(c, Candidate::Up { .. }))
            .count();
        self.metrics.peers_up.set(up as i64);
    }

    /// Resolves the candidates and dials missing links, every resolve interval, forever.
    pub async fn run(self: Arc<Self>) -> anyhow::Result<()> {
        loop {
            let targets = self.resolve().await;
            self.reconcile(&targets);
            tokio::time::sleep(self.cfg.resolve_interval).await;
        }
    }

    /// Every address the static list and the DNS name give now. A name that
    /// does not resolve in time contributes nothing this round (logged).
    async fn resolve(&self) -> HashSet<SocketAddr> {
        let mut out = HashSet::new();
        let names = self.cfg.static_peers.iter().chain(self.cfg.dns.iter());
        for name in names {
            match tokio::time::timeout(self.cfg.timeout, tokio::net::lookup_host(name.as_str()))
                .await
            {
                Ok(Ok(addrs)) => out.extend(addrs),
                Ok(Err(e)) => warn!(peer = %name, error = %e, "resolving a peer name failed"),
                Err(_) => {
                    warn!(peer = %name, timeout = ?self.cfg.timeout, "resolving a peer name timed out")
                }
            }
        }
        if !self.cfg.listen.ip().is_unspecified() {
            out.remove(&self.cfg.listen);
        }
        out
    }

    /// Drops candidates no longer listed and dials the listed ones without a link.
    fn reconcile(self: &Arc<Self>, targets: &HashSet<SocketAddr>) {
        let mut table = self.table();
        table.retain(|addr, c| {
            if targets.contains(addr) {
                return true;
            }
            if let Candidate::Up { link, .. } = c {
                info!(peer = %link.replica.name, %addr, "peer left the member list");
                link.conn
                    .close(peer::close_code::LEFT.into(), b"no longer a member");
            }
            false
        });
        for addr in targets {
            let dial = match table.get(addr) {
                None | Some(Candidate::Down { .. }) => true,
                Some(Candidate::Up { link, .. }) => link.conn.close_reason().is_some(),
                Some(Candidate::Dialling) | Some(Candidate::IsSelf) => false,
            };
            if dial {
                table.insert(*addr, Candidate::Dialling);
                tokio::spawn(self.clone().dial(*addr));
            }
        }
        self.publish(&table);
    }

    /// Dials one candidate and records the outcome; watches the link until it closes.
    async fn dial(self: Arc<Self>, addr: SocketAddr) {
        let result = peer::dial(
            &self.endpoint,
            addr,
            &self.me,
            self.cfg.timeout,
            self.cfg.copies,
            &self.metrics,
        )
        .await;
        let link = {
            let mut table = self.table();
            // Dropped from the list while dialling: forget the outcome.
            if !matches!(table.get(&addr), Some(Candidate::Dialling)) {
                if let Ok(link) = result {
                    link.conn
                        .close(peer::close_code::LEFT.into(), b"no longer a member");
                }
                return;
            }
            let (entry, link) = match result {
                Ok(link) => {
                    info!(peer = %link.replica.name, %addr, "peer up");
                    (
                        Candidate::Up {
                            link: link.clone(),
                            since: SystemTime::now(),
                        },
                        Some(link),
                    )
                }
                Err(PeerError::IsSelf) => {
                    debug!(%addr, "this address is this replica");
                    (Candidate::IsSelf, None)
                }
                Err(e) => {
                    warn!(%addr, error = %e, "dialling a peer failed");
                    (
                        Candidate::Down {
                            error: e.to_string(),
                        },
                        None,
                    )
                }
            };
            table.insert(addr, entry);
            self.publish(&table);
            link
        };
        let Some(link) = link else { return };
        // Learn the peer's edges over this link for as long as it lives.
        tokio::spawn(routes::subscribe(
            link.clone(),
            self.registry.clone(),
            self.metrics.clone(),
            self.cfg.max_message_bytes,
            self.cfg.timeout,
        ));
        // Relayed copies the peer sends back for the streams this replica
        // owns through it, until the link closes.
        let registry = self.registry.clone();
        link.copies
            .announce_and_serve(move |c| registry.copy_from_holder(c), &link.replica.name)
            .await;
        let why = link.conn.closed().await;
        let mut table = self.table();
        if let Some(Candidate::Up { link: cur, .. }) = table.get(&addr) {
            if cur.conn.stable_id() == link.conn.stable_id() {
                warn!(peer = %link.replica.name, %addr, reason = %why, "peer down");
                table.insert(
                    addr,
                    Candidate::Down {
                        error: why.to_string(),
                    },
                );
                self.publish(&table);
            }
        }
    }

    /// How long a change in membership takes to be noticed at most: a join
    /// within one resolve interval plus a dial, a leave within the peer timeout.
    pub fn notice_bound(&self) -> Duration {
        self.cfg.resolve_interval + self.cfg.timeout
    }
}
