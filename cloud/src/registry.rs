//! Which edges exist, what they reported, and routing lookups that never guess.
//!
//! The registry maps node name → [`Session`], and keeps two indices fed by
//! the edges: namespace/pod → nodes (from pod reports) and address → nodes
//! (from hellos). A lookup returns exactly one session or a [`RouteError`]
//! saying what was looked up and why it failed; a name or address claimed by
//! two nodes is refused, never resolved to either. Pods of a node whose
//! session ended are remembered so that a request for them gets "edge not
//! connected" (502) rather than "no such pod". A report's entries are
//! bounded as Kubernetes bounds them (namespace 63 bytes, name 253): longer
//! ones are dropped, logged with the node.
//!
//! With an [`Authority`] (the apiserver's pods and nodes; the default), the
//! edges' reports and hello addresses are hints: pods route by the node the
//! apiserver binds them to and addresses by the nodes' status, and a hint that
//! names another node's pod or address is refused, logged with both nodes and
//! counted in `tether_cloud_claims_refused` (one node's refused pod claims,
//! and apart from them its refused addresses, are logged at most once per
//! `--claim-warning-interval`, however its reports alternate or its hellos
//! repeat; every refused address is counted, once per hello however the
//! hello is admitted: new, joined, or resumed with a ticket). Without one
//! (the insecure opt-in) the edges' reports are all there is. Either way an address in
//! `Host`/SNI is looked up as an address before as a node name, so a node
//! named like an IP cannot take that IP's requests.
//!
//! With peer replicas, the registry also keeps the edges the peers hold
//! (learnt by [`crate::routes`]), in the same indices: a lookup resolves to a
//! [`Target`] that is either a local session or a peer replica to relay to,
//! and a pod or address two edges claim is ambiguous wherever they are held.
//! A node held in several places (it moved and the old holder has not let go
//! yet) goes to the holder with a live connection that attached last —
//! this replica's own session included, so a replica whose edge died without
//! a word relays to where the edge came back rather than waiting for its idle
//! timeout. (Attach times are the holders' clocks: replicas need NTP.)
//! [`Registry::local_session`] never looks at the peers' edges: it is what a
//! relayed request is served from, so a relay never goes a second hop.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tether_proto::copies::{self, CopyLink, CopySink, Fate, ReceivedCopy};
use tether_proto::handshake::PodRef;
use tether_proto::ticket::Ticket;
use tether_proto::token::SessionId;
use tracing::{info, warn};

use crate::admission::{Claim, Verdict};
use crate::authority::{Authority, PodPlacement};
use crate::metrics::KindLabel;
use crate::peer::{PeerLink, ReplicaId};
use crate::routes::{self, EdgeRecord, Update};
use crate::session::Session;

/// Where a request for one node goes.
#[derive(Clone)]
pub struct Target {
    pub node: String,
    pub holder: Holder,
}

/// Who holds a node's edge.
#[derive(Clone)]
pub enum Holder {
    /// This replica: its session (connected, or within its grace period).
    Local(Arc<Session>),
    /// A peer replica, reached over the peer link this replica dialled.
    Remote {
        replica: ReplicaId,
        conn: quinn::Connection,
        attached: bool,
    },
}

impl Target {
    /// Whether the holder has a live connection to the edge.
    pub fn attached(&self) -> bool {
        match &self.holder {
            Holder::Local(s) => s.connection().is_some(),
            Holder::Remote { attached, .. } => *attached,
        }
    }
}

/// One edge a peer holds.
#[derive(Clone)]
struct RemoteEdge {
    replica: ReplicaId,
    conn: quinn::Connection,
    /// The copy path of `conn` (relayed copies of interactive writes).
    copies: Arc<CopyLink>,
    record: EdgeRecord,
}

/// Which session a hello joins ([`Registry::admit`]).
pub enum Admitted {
    /// The node's live session here: the hello resumes it.
    Joined(Arc<Session>),
    /// The session the hello's ticket names, resumed on this replica (it was
    /// held elsewhere, or this replica only owned streams of it), installed;
    /// `replaced` are sessions of the node it replaces, which the caller ends.
    Resumed {
        session: Arc<Session>,
        replaced: Vec<Arc<Session>>,
    },
    /// A new session, installed; `replaced` are the node's previous ones
    /// (held or only owned here), which the caller ends.
    New {
        session: Arc<Session>,
        replaced: Vec<Arc<Session>>,
    },
    /// An attempt older than the connection attached now: refuse it.
    Superseded,
    /// A ticket older than what is known of the edge: refuse it (the message
    /// says why); the live session is not touched.
    StaleTicket(String),
}

/// Why a request could not be routed to exactly one edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("no connected edge reports pod {namespace}/{pod}")]
    UnknownPod { namespace: String, pod: String },
    #[error("pod {namespace}/{pod} was last reported by edge {node}, which is not connected")]
    PodNodeGone {
        namespace: String,
        pod: String,
        node: String,
    },
    #[error("pod {namespace}/{pod} is reported by several edges ({nodes}); refusing to guess")]
    AmbiguousPod {
        namespace: String,
        pod: String,
        nodes: String,
    },
    #[error("no connected edge is named or announces {looked_up}")]
    UnknownNode { looked_up: String },
    #[error("{what} {value} is announced by several edges ({nodes}); refusing to guess")]
    AmbiguousAddress {
        what: &'static str,
        value: String,
        nodes: String,
    },
    #[error("no node named in the request (no X-Forwarded-Uri node, SNI or Host)")]
    NoHint,
    /// A client can put any `X-Forwarded-Uri` on a request the apiserver proxies (its
    /// upgrade path copies the client's headers): the header may only choose among
    /// the nodes the apiserver's own connection (SNI, `Host`) stands for.
    #[error("X-Forwarded-Uri names node {node}, but {why}; refusing it")]
    ForwardedUriUntrusted { node: String, why: String },
    #[error("the apiserver has pod {namespace}/{pod} bound to no node")]
    PodUnscheduled { namespace: String, pod: String },
}

#[derive(Default)]
struct Tables {
    /// Sessions whose edge this replica holds (connected here, or its last
    /// connection was here and it is within its grace period).
    sessions: HashMap<String, Arc<Session>>,
    /// Sessions this replica only owns streams of: the edge is held by a
    /// peer (or was, and may come back anywhere within the grace period).
    owned: HashMap<String, Arc<Session>>,
    /// (namespace, pod) → nodes reporting it.
    pods: HashMap<(String, String), BTreeSet<String>>,
    /// node → its last pod report (shared: a new report is compared with
    /// it outside the lock, [`Registry::report_pods`]).
    node_pods: HashMap<String, Arc<Vec<PodRef>>>,
    /// address → nodes announcing it.
    addresses: HashMap<String, BTreeSet<String>>,
    /// node → the addresses it is indexed under (so a node leaves the index
    /// without a scan of every address: inserts stay O(1) with 10,000 edges).
    node_addresses: HashMap<String, Vec<String>>,
    /// (namespace, pod) → node, for nodes whose session ended.
    departed: HashMap<(String, String), String>,
    /// node → its pods in `departed`.
    node_departed: HashMap<String, Vec<(String, String)>>,
    /// Departures, oldest first: (node, departure number). An entry whose number is
    /// not the node's current one (`departed_seq`) is stale: the node came back.
    departed_order: VecDeque<(String, u64)>,
    /// node in `node_departed` → the number of its departure.
    departed_seq: HashMap<String, u64>,
    departures: u64,
    /// Bound on `departed` (`--max-departed-pods`).
    max_departed: DepartedLimit,
    /// node → the pod claims of its last report the apiserver contradicted
    /// (a claim repeated in every report is counted once), and when its
    /// refused pod claims and addresses were last logged; kept while the
    /// node is held here.
    node_refused: HashMap<String, RefusedClaims>,
    /// node → the peers holding it (usually one; two while it moves).
    remote: HashMap<String, Vec<RemoteEdge>>,
    /// (namespace, pod) → node → how many peers report it there.
    remote_pods: HashMap<(String, String), BTreeMap<String, usize>>,
    /// address → node → how many peers announce it there.
    remote_addresses: HashMap<String, BTreeMap<String, usize>>,
    /// peer instance → the nodes it holds.
    remote_by_replica: HashMap<u64, BTreeSet<String>>,
    /// Which local nodes changed, by change number (one entry per node, its
    /// latest), so a peer is told only what changed since it last heard.
    change_seq: u64,
    changed: BTreeMap<u64, String>,
    node_change: HashMap<String, u64>,
    /// Changes up to this number were forgotten (the log is bounded): a peer
    /// behind it gets a full comparison instead.
    forgotten_through: u64,
}

/// One node's refused pod and address claims ([`Tables::node_refused`]).
#[derive(Default)]
struct RefusedClaims {
    /// The claims of the node's last report the apiserver contradicted: a
    /// claim also in the next report is not counted or logged again.
    last: Arc<BTreeSet<String>>,
    /// Warnings about the node's refused pod claims.
    pods: ClaimWarnings,
    /// Warnings about the node's refused addresses (hellos and resumes).
    addresses: ClaimWarnings,
}

/// When one node's refused claims of one kind were last logged: at most one
/// warning per `--claim-warning-interval`, however its reports alternate or
/// its hellos repeat.
#[derive(Default)]
struct ClaimWarnings {
    warned_at: Option<Instant>,
    /// Claims refused (and counted) since then without a warning.
    unlogged: u64,
}

impl ClaimWarnings {
    /// `n` claims were just refused: `Some(k)` if they are to be logged now
    /// (`k` refused since the last warning went unlogged), `None` if only
    /// counted (they are added to the next warning's count).
    fn refused(&mut self, n: u64, interval: Duration) -> Option<u64> {
        let now = Instant::now();
        let due = self
            .warned_at
            .is_none_or(|at| now.saturating_duration_since(at) >= interval);
        if due {
            self.warned_at = Some(now);
            Some(std::mem::take(&mut self.unlogged))
        } else {
            self.unlogged += n;
            None
        }
    }
}

/// Default of `--claim-warning-interval`.
pub const DEFAULT_CLAIM_WARNING_INTERVAL: Duration = Duration::from_secs(60);

/// Default of `--max-departed-pods`.
pub const DEFAULT_MAX_DEPARTED_PODS: usize = 100_000;

/// How many departed pods are remembered.
#[derive(Debug, Clone, Copy)]
struct DepartedLimit(usize);

impl Default for DepartedLimit {
    fn default() -> Self {
        DepartedLimit(DEFAULT_MAX_DEPARTED_PODS)
    }
}

/// Entries the change log keeps beyond one per local session.
const CHANGE_LOG_SLACK: usize = 1024;

impl Tables {
    /// Remembers `keys` as the pods of `node`, which went away; then forgets the
    /// oldest departures beyond `--max-departed-pods`.
    fn depart(&mut self, node: &str, keys: impl IntoIterator<Item = (String, String)>) {
        if !self.departed_seq.contains_key(node) {
            self.departures += 1;
            self.departed_seq.insert(node.to_string(), self.departures);
            self.departed_order
                .push_back((node.to_string(), self.departures));
        }
        let list = self.node_departed.entry(node.to_string()).or_default();
        for key in keys {
            self.departed.insert(key.clone(), node.to_string());
            list.push(key);
        }
        let mut forgotten = 0;
        while self.departed.len() > self.max_departed.0 {
            let Some((oldest, seq)) = self.departed_order.pop_front() else {
                break;
            };
            if self.departed_seq.get(&oldest) == Some(&seq) {
                forgotten += self.forget_departed(&oldest);
            }
        }
        if forgotten > 0 {
            info!(
                forgotten,
                limit = self.max_departed.0,
                "forgot the pods of nodes that left first (--max-departed-pods)"
            );
        }
    }

    /// Forgets `node`'s departed pods (it came back, or is evicted); returns how many.
    fn forget_departed(&mut self, node: &str) -> usize {
        self.departed_seq.remove(node);
        let mut n = 0;
        for key in self.node_departed.remove(node).unwrap_or_default() {
            if self.departed.get(&key).map(String::as_str) == Some(node) {
                self.departed.remove(&key);
                n += 1;
            }
        }
        // Stale entries of nodes that came back: dropped once they outnumber the live ones.
        if self.departed_order.len() > 2 * self.departed_seq.len() + 64 {
            let seq = &self.departed_seq;
            let mut seen = HashSet::new();
            self.departed_order
                .retain(|(n, s)| seq.get(n) == Some(s) && seen.insert(n.clone()));
        }
        n
    }

    /// Records that local `node` changed.
    fn mark(&mut self, node: &str) {
        self.change_seq += 1;
        let seq = self.change_seq;
        if let Some(old) = self.node_change.insert(node.to_string(), seq) {
            self.changed.remove(&old);
        }
        self.changed.insert(seq, node.to_string());
        let keep = self.sessions.len() + CHANGE_LOG_SLACK;
        while self.changed.len() > keep {
            let Some((old, n)) = self.changed.pop_first() else {
                break;
            };
            self.node_change.remove(&n);
            self.forgotten_through = old;
        }
    }

    /// What peers are told about local session `s`.
    fn record_of(&self, s: &Arc<Session>) -> EdgeRecord {
        let since_ms = s
            .connected_since()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let pods = self
            .node_pods
            .get(&s.node)
            .map(|v| {
                v.iter()
                    .map(|p| (p.namespace.clone(), p.name.clone()))
                    .collect()
            })
            .unwrap_or_default();
        EdgeRecord {
            node: s.node.clone(),
            session: s.id.to_string(),
            attached: s.connection().is_some(),
            since_ms,
            sid: s.id.0,
            gen: s.gen(),
            limits: s.limits(),
            pods,
            addresses: self
                .node_addresses
                .get(&s.node)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// Who should serve `node`: the holder with a live connection that
    /// attached it last (here or on a peer; here on a tie), else, the same
    /// way, one within its grace period.
    fn holder(&self, node: &str) -> Option<Target> {
        let local = self.sessions.get(node);
        let remote = self.remote.get(node).map(Vec::as_slice).unwrap_or(&[]);
        let newest = |attached: bool| {
            remote
                .iter()
                .filter(|r| r.record.attached == attached)
                .max_by_key(|r| r.record.gen)
        };
        let remote_target = |r: &RemoteEdge| Target {
            node: node.to_string(),
            holder: Holder::Remote {
                replica: r.replica.clone(),
                conn: r.conn.clone(),
                attached: r.record.attached,
            },
        };
        let local_target = |s: &Arc<Session>| Target {
            node: node.to_string(),
            holder: Holder::Local(s.clone()),
        };
        // The newest generation wins, wherever it is: an edge that died
        // without a word (kill -9, power cut) still looks attached to its old
        // holder until the idle timeout, but its new connection is newer.
        for attached in [true, false] {
            let here = local.filter(|s| s.connection().is_some() == attached);
            match (here, newest(attached)) {
                (Some(s), Some(r)) if r.record.gen > s.gen() => return Some(remote_target(r)),
                (Some(s), _) => return Some(local_target(s)),
                (None, Some(r)) => return Some(remote_target(r)),
                (None, None) => {}
            }
        }
        None
    }

    /// The peer record of `node`'s newest attached connection.
    fn newest_remote(&self, node: &str) -> Option<RemoteEdge> {
        self.remote
            .get(node)?
            .iter()
            .filter(|r| r.record.attached)
            .max_by_key(|r| r.record.gen)
            .cloned()
    }

    /// The newest generation of `node`'s connections known here, its
    /// session and where it is: (gen, session id, replica).
    fn newest_known(&self, node: &str) -> Option<(u64, u64, String)> {
        let local = [self.sessions.get(node), self.owned.get(node)]
            .into_iter()
            .flatten()
            .filter(|s| !s.is_ended() && s.gen() > 0)
            .map(|s| (s.gen(), s.id.0, "this replica".to_string()));
        let remote = self.remote.get(node).into_iter().flatten().map(|r| {
            (
                r.record.gen,
                r.record.sid,
                format!("replica {}", r.replica.name),
            )
        });
        local.chain(remote).max_by_key(|(g, _, _)| *g)
    }

    /// Nodes claiming pod `key`, here and on peers.
    fn pod_nodes(&self, key: &(String, String)) -> BTreeSet<String> {
        let mut nodes = self.pods.get(key).cloned().unwrap_or_default();
        if let Some(r) = self.remote_pods.get(key) {
            nodes.extend(r.keys().cloned());
        }
        nodes
    }

    /// Nodes announcing `address`, here and on peers.
    fn address_nodes(&self, address: &str) -> BTreeSet<String> {
        let mut nodes = self.addresses.get(address).cloned().unwrap_or_default();
        if let Some(r) = self.remote_addresses.get(address) {
            nodes.extend(r.keys().cloned());
        }
        nodes
    }

    fn count<K: Ord + Clone>(map: &mut BTreeMap<K, usize>, k: &K, add: bool) {
        if add {
            *map.entry(k.clone()).or_default() += 1;
        } else if let Some(n) = map.get_mut(k) {
            *n -= 1;
            if *n == 0 {
                map.remove(k);
            }
        }
    }

    /// Adds or removes the index entries of one peer's record.
    fn index_remote(&mut self, r: &EdgeRecord, add: bool) {
        for p in &r.pods {
            let m = self.remote_pods.entry(p.clone()).or_default();
            Self::count(m, &r.node, add);
            if m.is_empty() {
                self.remote_pods.remove(p);
            }
        }
        for a in &r.addresses {
            let k = host_only(a);
            let m = self.remote_addresses.entry(k.clone()).or_default();
            Self::count(m, &r.node, add);
            if m.is_empty() {
                self.remote_addresses.remove(&k);
            }
        }
    }

    /// Forgets what peer `instance` said about `node`.
    fn remove_remote(&mut self, instance: u64, node: &str) {
        let Some(list) = self.remote.get_mut(node) else {
            return;
        };
        let Some(i) = list.iter().position(|r| r.replica.instance == instance) else {
            return;
        };
        let old = list.swap_remove(i);
        if list.is_empty() {
            self.remote.remove(node);
        }
        self.index_remote(&old.record, false);
        // Held nowhere now: its pods are remembered as departed, so a request
        // for them is "edge not connected" (502), as for a local edge.
        if !self.remote.contains_key(node) && !self.sessions.contains_key(node) {
            let keys: Vec<(String, String)> = old.record.pods.to_vec();
            self.depart(node, keys);
        }
        if let Some(set) = self.remote_by_replica.get_mut(&instance) {
            set.remove(node);
            if set.is_empty() {
                self.remote_by_replica.remove(&instance);
            }
        }
    }
}

/// The cloud's table of edge sessions.
pub struct Registry {
    tables: Mutex<Tables>,
    pub grace: Duration,
    /// The apiserver's word on pods and addresses; `None` only with the
    /// insecure opt-in (routing by edge reports).
    authority: Option<Arc<Authority>>,
    /// Edge claims refused because the apiserver disagrees, by kind (pod, address).
    claims_refused: Family<KindLabel, Counter>,
    /// Bumped on every change of a local session (what peers are told).
    local_changes: watch::Sender<u64>,
    /// Bumped on every change at all (what a waiting request watches).
    any_changes: watch::Sender<u64>,
    /// The waits of the streams of sessions made here.
    timeouts: Mutex<crate::session::Timeouts>,
    /// With peers, `--peer-max-message-bytes`: a report that makes the node's
    /// route record larger than one message is warned about (the record is
    /// published without its pods, see [`crate::routes::encode`]).
    peer_message_limit: Option<usize>,
    /// Least time between two warnings about one node's refused pod claims,
    /// and between two about its refused addresses (`--claim-warning-interval`).
    claim_warning_interval: Duration,
    /// Tests only: run once between the two locks of
    /// [`Registry::report_pods`] (to change the node's list in between).
    #[cfg(test)]
    between_report_locks: Mutex<Option<ReportHook>>,
}

/// What a test runs between the two locks of [`Registry::report_pods`].
#[cfg(test)]
type ReportHook = Box<dyn FnOnce(&Registry) + Send>;

/// Normalizes a `Host` or SNI value: lowercase, without port or IPv6 brackets.
pub fn host_only(h: &str) -> String {
    let h = h.trim();
    let h = if let Some(rest) = h.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else if h.matches(':').count() == 1 {
        h.split(':').next().unwrap_or(h)
    } else {
        h
    };
    h.trim_end_matches('.').to_ascii_lowercase()
}

impl Registry {
    pub fn new(grace: Duration) -> Self {
        Registry {
            tables: Mutex::new(Tables::default()),
            grace,
            authority: None,
            claims_refused: Family::default(),
            local_changes: watch::channel(0).0,
            any_changes: watch::channel(0).0,
            timeouts: Mutex::new(crate::session::Timeouts::default()),
            peer_message_limit: None,
            claim_warning_interval: DEFAULT_CLAIM_WARNING_INTERVAL,
            #[cfg(test)]
            between_report_locks: Mutex::new(None),
        }
    }

    /// The same registry, logging one node's refused pod claims, and its
    /// refused addresses, at most once per `interval` each
    /// (`--claim-warning-interval`; they are all counted).
    pub fn with_claim_warning_interval(mut self, interval: Duration) -> Self {
        self.claim_warning_interval = interval;
        self
    }

    /// The same registry, warning about pod reports that make their node's
    /// route record larger than `max` bytes, one message to the peers
    /// (`--peer-max-message-bytes`).
    pub fn with_peer_message_limit(mut self, max: usize) -> Self {
        self.peer_message_limit = Some(max);
        self
    }

    /// The same registry, remembering at most `n` pods of departed nodes.
    pub fn with_max_departed(self, n: usize) -> Self {
        self.tables
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .max_departed = DepartedLimit(n);
        self
    }

    /// A registry that routes by `authority` and counts refused claims in
    /// `claims_refused`.
    pub fn with_authority(
        grace: Duration,
        authority: Option<Arc<Authority>>,
        claims_refused: Family<KindLabel, Counter>,
    ) -> Self {
        Registry {
            authority,
            claims_refused,
            ..Registry::new(grace)
        }
    }

    /// Sets the waits of streams on a peer (`--peer-timeout`, `--route-wait`)
    /// for every session made from now on.
    pub fn set_timeouts(&self, t: crate::session::Timeouts) {
        *self.timeouts.lock().unwrap_or_else(|p| p.into_inner()) = t;
    }

    /// The waits sessions get.
    pub fn timeouts(&self) -> crate::session::Timeouts {
        *self.timeouts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs the claim `what` of `node` the apiserver gives to `owner`,
    /// refused with `more` others of the node's (of this `kind`) since its
    /// last such warning ([`ClaimWarnings`]).
    fn warn_refused(&self, kind: &'static str, node: &str, what: &str, owner: &str, more: u64) {
        if more == 0 {
            warn!(
                node = %node.escape_debug(),
                owner = %owner.escape_debug(),
                claim = %what.escape_debug(),
                "refusing an edge's {kind} claim: the apiserver has it on another node"
            );
        } else {
            warn!(
                node = %node.escape_debug(),
                owner = %owner.escape_debug(),
                claim = %what.escape_debug(),
                more,
                interval = ?self.claim_warning_interval,
                "refusing an edge's {kind} claim: the apiserver has it on another node; \
                 with it, `more` other {kind} claims of the node refused since its last such \
                 warning or in this {} (all counted in \
                 tether_cloud_claims_refused_total; one warning per node per \
                 --claim-warning-interval)",
                if kind == "pod" { "report" } else { "hello" }
            );
        }
    }

    /// The announced addresses of `node` the apiserver does not give to another
    /// node. The others are refused: each counted, and logged at most once per
    /// `--claim-warning-interval` for the node (one warning for several).
    fn vet_addresses(&self, t: &mut Tables, node: &str, addresses: Vec<String>) -> Vec<String> {
        let Some(auth) = &self.authority else {
            return addresses;
        };
        let mut refused: Vec<(String, String)> = Vec::new();
        let kept = addresses
            .into_iter()
            .filter(|a| {
                let owners = auth.address_nodes(a);
                if owners.is_empty() || owners.contains(node) {
                    true
                } else {
                    let owners = owners.into_iter().collect::<Vec<_>>().join(", ");
                    refused.push((a.clone(), owners));
                    false
                }
            })
            .collect();
        if let Some((what, owners)) = refused.first() {
            let n = refused.len() as u64;
            self.claims_refused
                .get_or_create(&KindLabel { kind: "address" })
                .inc_by(n);
            let warnings = &mut t
                .node_refused
                .entry(node.to_string())
                .or_default()
                .addresses;
            if let Some(unlogged) = warnings.refused(n, self.claim_warning_interval) {
                self.warn_refused("address", node, what, owners, unlogged + n - 1);
            }
        }
        kept
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session of a node, if any.
    pub fn get(&self, node: &str) -> Option<Arc<Session>> {
        self.tables().sessions.get(node).cloned()
    }

    /// How many sessions there are (cheap: no copy, no sort).
    pub fn len(&self) -> usize {
        self.tables().sessions.len()
    }

    /// Whether there is no session.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All sessions, sorted by node (for status and tests).
    pub fn sessions(&self) -> Vec<Arc<Session>> {
        let mut v: Vec<_> = self.tables().sessions.values().cloned().collect();
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
    }

    /// Installs `session` as its node's session, returning the one it
    /// replaces (which the caller ends).
    pub fn insert(&self, session: Arc<Session>) -> Option<Arc<Session>> {
        self.insert_locked(&mut self.tables(), session)
    }

    /// Decides, atomically with any other hello of the node, which session a
    /// hello with `claim` (and `ticket`, verified by the caller) joins (see
    /// [`crate::admission`]): the node's live session here; the session the
    /// ticket names, unless a newer generation of the edge is known; or a new
    /// one. `create` makes the session to install: `Some((id, gen))` for the
    /// ticket's session, `None` for a new one. The session admitted announces
    /// the hello's `addresses` from then on, vetted once whichever way it is
    /// admitted: an address refused is counted (and warned about) once per
    /// hello.
    pub fn admit<E>(
        &self,
        node: &str,
        claim: &Claim,
        addresses: Vec<String>,
        ticket: Option<&Ticket>,
        create: impl FnOnce(Option<(SessionId, u64)>) -> Result<Arc<Session>, E>,
    ) -> Result<Admitted, E> {
        let mut t = self.tables();
        t.owned.retain(|_, s| !s.is_ended());
        let current = t.sessions.get(node).cloned();
        let verdict = match &current {
            Some(s) => s.judge(claim),
            None => Verdict::NewSession,
        };
        match (verdict, current) {
            (Verdict::Join, Some(s)) => {
                self.set_addresses_locked(&mut t, &s, addresses);
                return Ok(Admitted::Joined(s));
            }
            (Verdict::Superseded, _) => return Ok(Admitted::Superseded),
            _ => {}
        }
        if let Some(tk) = ticket {
            if let Some((gen, sid, at)) = t.newest_known(node) {
                if sid == tk.session.0 && tk.gen < gen {
                    return Ok(Admitted::StaleTicket(format!(
                        "the ticket is of generation {}, but generation {gen} of session {} was attached since (at {at})",
                        tk.gen, tk.session
                    )));
                }
                if sid != tk.session.0 && gen > tk.gen {
                    return Ok(Admitted::StaleTicket(format!(
                        "session {} was replaced by a newer session of this edge (at {at})",
                        tk.session
                    )));
                }
            }
            let (session, mut replaced) = match t.owned.remove(node) {
                Some(o) if o.id == tk.session => {
                    o.set_gate(claim);
                    (o, Vec::new())
                }
                other => {
                    let s = create(Some((tk.session, tk.gen)))?;
                    s.set_timeouts(self.timeouts());
                    (s, other.into_iter().collect())
                }
            };
            // Installing it vets these (an owned session may still carry
            // those of an earlier hello, held here before).
            session.set_addresses(addresses);
            replaced.extend(self.insert_locked(&mut t, session.clone()));
            replaced.retain(|r| !Arc::ptr_eq(r, &session));
            return Ok(Admitted::Resumed { session, replaced });
        }
        let session = create(None)?;
        session.set_timeouts(self.timeouts());
        session.set_addresses(addresses);
        let mut replaced: Vec<_> = t.owned.remove(node).into_iter().collect();
        replaced.extend(self.insert_locked(&mut t, session.clone()));
        Ok(Admitted::New { session, replaced })
    }

    /// The session's connection was attached: it is held here (it may have
    /// been only owned here until now). Peers are told.
    pub fn hold(&self, session: &Arc<Session>) {
        let mut t = self.tables();
        if t.owned
            .get(&session.node)
            .is_some_and(|s| Arc::ptr_eq(s, session))
        {
            t.owned.remove(&session.node);
        }
        let here = t
            .sessions
            .get(&session.node)
            .is_some_and(|s| Arc::ptr_eq(s, session));
        if !here {
            if let Some(old) = self.insert_locked(&mut t, session.clone()) {
                drop(t);
                old.end(
                    tether_proto::frame::ResetCode::SessionLost,
                    &format!("edge {} resumed another session here", session.node),
                );
                return;
            }
        }
        t.mark(&session.node);
        drop(t);
        self.touch();
    }

    /// The session new streams for `node` go into when a peer holds its
    /// edge: this replica's own session of the node if it has one (held or
    /// owned), else a new owned session relayed through the peer holding the
    /// newest attached connection. `None` if no peer has it attached.
    pub fn owner_session(&self, node: &str, limits: tether_proto::Limits) -> Option<Arc<Session>> {
        let mut t = self.tables();
        for s in [t.sessions.get(node), t.owned.get(node)]
            .into_iter()
            .flatten()
        {
            if !s.is_ended() {
                return Some(s.clone());
            }
        }
        let best = t.newest_remote(node)?;
        let s = Session::relayed(
            node.to_string(),
            SessionId(best.record.sid),
            limits.agree(&best.record.limits),
            best.record.gen,
            best.replica.clone(),
            best.conn.clone(),
            best.copies.clone(),
        );
        s.set_timeouts(self.timeouts());
        t.owned.insert(node.to_string(), s.clone());
        Some(s)
    }

    /// Brings this replica's sessions of `node` in line with what peers
    /// hold: relayed through the peer with the newest attached connection of
    /// the same session (closing an older connection here), ended when that
    /// is another session of the edge (it lost its state), unreachable when
    /// the peer they were relayed through no longer has it. Returns the
    /// sessions to end (taken out of the tables) with the reason.
    fn reconcile(&self, t: &mut Tables, node: &str) -> Vec<(Arc<Session>, String)> {
        let mut to_end = Vec::new();
        let best = t.newest_remote(node);
        let locals: Vec<Arc<Session>> = [t.sessions.get(node), t.owned.get(node)]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        for s in locals {
            if s.is_ended() {
                continue;
            }
            if let Some(r) = &best {
                let lost_relay = !s.is_held() && s.relayed_via().is_none();
                if r.record.gen > s.gen() || (lost_relay && r.record.gen == s.gen()) {
                    if r.record.sid == s.id.0 {
                        s.relay_to(
                            r.replica.clone(),
                            r.conn.clone(),
                            r.copies.clone(),
                            r.record.gen,
                        );
                    } else {
                        to_end.push((
                            s.clone(),
                            format!(
                                "edge {node} started a new session at replica {} (it restarted or lost its state)",
                                r.replica.name
                            ),
                        ));
                    }
                    continue;
                }
            }
            if let Some(via) = s.relayed_via() {
                let still = t.remote.get(node).is_some_and(|l| {
                    l.iter().any(|r| {
                        r.replica.instance == via.instance
                            && r.record.attached
                            && r.record.sid == s.id.0
                    })
                });
                if !still {
                    if let Some(epoch) = s.relay_lost(via.instance) {
                        self.expire_later(s.clone(), epoch);
                    }
                }
            }
        }
        for (s, _) in &to_end {
            self.take_out(t, s);
        }
        // A held session now relayed elsewhere is only owned here: peers
        // stop routing to this replica for it.
        if let Some(s) = t.sessions.get(node).cloned() {
            if s.relayed_via().is_some() {
                self.take_out(t, &s);
                t.owned.insert(node.to_string(), s);
            }
        }
        to_end
    }

    /// Takes `s` out of the tables (held: its indices go, peers are told).
    fn take_out(&self, t: &mut Tables, s: &Arc<Session>) {
        let node = s.node.clone();
        if t.owned.get(&node).is_some_and(|o| Arc::ptr_eq(o, s)) {
            t.owned.remove(&node);
        }
        if t.sessions.get(&node).is_some_and(|o| Arc::ptr_eq(o, s)) {
            t.sessions.remove(&node);
            t.node_refused.remove(&node);
            Self::unindex_addresses(t, &node);
            Self::unindex_pods(t, &node);
            t.mark(&node);
            self.local_changes.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// Ends `s` after the grace period unless its link changed since `epoch`.
    fn expire_later(&self, s: Arc<Session>, epoch: u64) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let grace = self.grace;
        rt.spawn(async move {
            tokio::time::sleep(grace).await;
            if s.still_disconnected(epoch) {
                let reason = format!(
                    "edge {} did not come back within the grace period ({grace:?})",
                    s.node
                );
                warn!(node = %s.node, session = %s.id, "{reason}; ending the streams this replica owns");
                s.end(tether_proto::frame::ResetCode::SessionLost, &reason);
            }
        });
    }

    /// Every session here, held or only owned (for shutdown and status).
    pub fn all_sessions(&self) -> Vec<Arc<Session>> {
        let t = self.tables();
        let mut v: Vec<_> = t
            .sessions
            .values()
            .chain(t.owned.values())
            .cloned()
            .collect();
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
    }

    fn insert_locked(&self, t: &mut Tables, session: Arc<Session>) -> Option<Arc<Session>> {
        let node = session.node.clone();
        t.mark(&node);
        self.touch();
        let old = t.sessions.insert(node.clone(), session.clone());
        let addresses = self.vet_addresses(t, &node, session.addresses());
        Self::index_addresses(t, &node, addresses);
        t.forget_departed(&node);
        old
    }

    /// Updates the addresses a node announces, as a hello does in
    /// [`Registry::admit`] (which vets them there, once).
    #[cfg(test)]
    pub fn set_addresses(&self, session: &Arc<Session>, addresses: Vec<String>) {
        self.set_addresses_locked(&mut self.tables(), session, addresses);
    }

    fn set_addresses_locked(&self, t: &mut Tables, session: &Arc<Session>, addresses: Vec<String>) {
        let current = t
            .sessions
            .get(&session.node)
            .map(|s| Arc::ptr_eq(s, session))
            .unwrap_or(false);
        session.set_addresses(addresses.clone());
        if !current {
            return;
        }
        let addresses = self.vet_addresses(t, &session.node, addresses);
        Self::index_addresses(t, &session.node, addresses);
        t.mark(&session.node);
        self.touch();
    }

    /// Indexes `node` under `addresses` (replacing its previous ones).
    fn index_addresses(t: &mut Tables, node: &str, addresses: Vec<String>) {
        Self::unindex_addresses(t, node);
        let keys: Vec<String> = addresses.iter().map(|a| host_only(a)).collect();
        for k in &keys {
            t.addresses
                .entry(k.clone())
                .or_default()
                .insert(node.to_string());
        }
        if !keys.is_empty() {
            t.node_addresses.insert(node.to_string(), keys);
        }
    }

    fn unindex_addresses(t: &mut Tables, node: &str) {
        for k in t.node_addresses.remove(node).unwrap_or_default() {
            if let Some(nodes) = t.addresses.get_mut(&k) {
                nodes.remove(node);
                if nodes.is_empty() {
                    t.addresses.remove(&k);
                }
            }
        }
    }

    fn unindex_pods(t: &mut Tables, node: &str) -> Arc<Vec<PodRef>> {
        let old = t.node_pods.remove(node).unwrap_or_default();
        for p in old.iter() {
            let key = (p.namespace.clone(), p.name.clone());
            Self::unindex_pod(t, node, &key);
        }
        old
    }

    /// Takes `node` out of the index entry of pod `key`.
    fn unindex_pod(t: &mut Tables, node: &str, key: &(String, String)) {
        if let Some(nodes) = t.pods.get_mut(key) {
            nodes.remove(node);
            if nodes.is_empty() {
                t.pods.remove(key);
            }
        }
    }

    /// Replaces a node's pod list (only if `session` is still its session).
    /// Entries with a namespace or name longer than Kubernetes allows are
    /// dropped (logged with the node).
    pub fn report_pods(&self, session: &Arc<Session>, pods: Vec<PodRef>) {
        let (pods, overlong) = bounded_pods(pods);
        if overlong > 0 {
            warn!(
                node = %session.node,
                dropped = overlong,
                "dropping the pods of a report whose namespace is longer than {} bytes or name \
                 longer than {} (Kubernetes' bounds)",
                routes::MAX_NAMESPACE_LEN,
                routes::MAX_POD_NAME_LEN
            );
        }
        let node = session.node.as_str();
        // Everything that takes time in proportion to the report happens
        // outside the lock, which every lookup, attach and relay takes: the
        // apiserver's word on each pod (the authority has its own lock), the
        // comparison with the node's last report, the new index keys. Under
        // the lock only the entries that changed are touched, and the new
        // list swapped in.
        let (pods, refused) = self.vet_pods(node, pods);
        let current = |t: &Tables| {
            t.sessions
                .get(node)
                .is_some_and(|s| Arc::ptr_eq(s, session))
        };
        let (previous, refused_before) = {
            let t = self.tables();
            if !current(&t) {
                return;
            }
            (
                t.node_pods.get(node).cloned(),
                t.node_refused.get(node).map(|r| r.last.clone()),
            )
        };
        #[cfg(test)]
        {
            let hook = self
                .between_report_locks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if let Some(hook) = hook {
                hook(self);
            }
        }
        let (added, removed) = pod_delta(previous.as_deref().map_or(&[], Vec::as_slice), &pods);
        let newly_refused: Vec<(String, String)> = refused
            .iter()
            .filter(|(what, _)| !refused_before.as_ref().is_some_and(|b| b.contains(what)))
            .cloned()
            .collect();
        let refused: BTreeSet<String> = refused.into_iter().map(|(what, _)| what).collect();
        let pods_len =
            routes::pods_len(pods.iter().map(|p| (p.namespace.as_str(), p.name.as_str())));
        let count = pods.len();
        let pods = Arc::new(pods);
        let log = {
            let mut t = self.tables();
            if !current(&t) {
                return;
            }
            let unchanged = match (t.node_pods.get(node), &previous) {
                (Some(now), Some(then)) => Arc::ptr_eq(now, then),
                (None, None) => true,
                _ => false,
            };
            if unchanged {
                for key in &removed {
                    Self::unindex_pod(&mut t, node, key);
                }
                for key in added {
                    t.pods.entry(key).or_default().insert(node.to_string());
                }
            } else {
                // The list changed between the two locks (another report
                // of the session, which come one at a time, or the session
                // taken out and held here again): index the whole report.
                Self::unindex_pods(&mut t, node);
                for p in pods.iter() {
                    t.pods
                        .entry((p.namespace.clone(), p.name.clone()))
                        .or_default()
                        .insert(node.to_string());
                }
            }
            // Whether this report's new refusals are logged now (with how
            // many went unlogged before), or counted only.
            let mut log = None;
            if self.authority.is_some()
                && (!refused.is_empty() || t.node_refused.contains_key(node))
            {
                let r = t.node_refused.entry(node.to_string()).or_default();
                r.last = Arc::new(refused);
                if !newly_refused.is_empty() {
                    log = r
                        .pods
                        .refused(newly_refused.len() as u64, self.claim_warning_interval);
                }
            }
            t.mark(node);
            t.node_pods.insert(node.to_string(), pods);
            log
        };
        self.touch();
        if !newly_refused.is_empty() {
            self.claims_refused
                .get_or_create(&KindLabel { kind: "pod" })
                .inc_by(newly_refused.len() as u64);
        }
        if let (Some(unlogged), Some((what, owner))) = (log, newly_refused.first()) {
            let more = unlogged + newly_refused.len() as u64 - 1;
            self.warn_refused("pod", node, what, owner, more);
        }
        self.check_record_len(session, count, pods_len);
    }

    /// The pods of a report this registry accepts for `node`, and the
    /// claims it refuses with their owners (`namespace/name`, owner): with
    /// an apiserver, a pod it places on another node is refused; a pod it
    /// does not know (yet: its watch may lag the kubelet) is kept.
    fn vet_pods(&self, node: &str, pods: Vec<PodRef>) -> (Vec<PodRef>, Vec<(String, String)>) {
        let Some(auth) = &self.authority else {
            return (pods, Vec::new());
        };
        let mut refused = Vec::new();
        let pods = pods
            .into_iter()
            .filter(|p| match auth.pod(&p.namespace, &p.name) {
                PodPlacement::On(owner) if owner != node => {
                    refused.push((format!("{}/{}", p.namespace, p.name), owner));
                    false
                }
                _ => true,
            })
            .collect();
        (pods, refused)
    }

    /// Warns (once per report) when `session`'s route record with `pods`
    /// pods of `pods_len` bytes is too large for one message to the peers:
    /// they are told of the edge without its pods.
    fn check_record_len(&self, session: &Session, pods: usize, pods_len: usize) {
        let Some(max) = self.peer_message_limit else {
            return;
        };
        let without_pods = EdgeRecord {
            node: session.node.clone(),
            session: session.id.to_string(),
            attached: session.connection().is_some(),
            since_ms: u64::MAX,
            sid: session.id.0,
            gen: session.gen(),
            limits: session.limits(),
            pods: Vec::new(),
            addresses: session.addresses(),
        };
        let len = postcard::to_allocvec(&without_pods)
            .map_or(usize::MAX, |v| v.len())
            .saturating_sub(1)
            .saturating_add(pods_len);
        if !routes::record_fits(len, max) {
            warn!(
                node = %session.node,
                pods,
                record_bytes = len,
                peer_max_message_bytes = max,
                "this edge's route record with its pod report is larger than \
                 --peer-max-message-bytes: peer replicas are told of the edge without its pods \
                 (with an apiserver they route its pods all the same; without one they answer \
                 404 for them). Raise --peer-max-message-bytes on every replica"
            );
        }
    }

    /// Removes a node's session if it is still `session`; its pods are
    /// remembered as departed.
    pub fn remove(&self, session: &Arc<Session>) -> bool {
        let mut t = self.tables();
        if !t
            .sessions
            .get(&session.node)
            .map(|s| Arc::ptr_eq(s, session))
            .unwrap_or(false)
        {
            return false;
        }
        let node = session.node.clone();
        t.sessions.remove(&node);
        t.node_refused.remove(&node);
        Self::unindex_addresses(&mut t, &node);
        let keys: Vec<(String, String)> = Self::unindex_pods(&mut t, &node)
            .iter()
            .map(|p| (p.namespace.clone(), p.name.clone()))
            .collect();
        t.depart(&node, keys);
        t.mark(&node);
        self.touch();
        true
    }

    /// Wakes the route publishers and waiting requests (after a `mark`).
    fn touch(&self) {
        self.local_changes.send_modify(|v| *v = v.wrapping_add(1));
        self.any_changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Changes of local sessions ([`crate::routes::publish`] watches these).
    pub fn local_changes(&self) -> watch::Receiver<u64> {
        self.local_changes.subscribe()
    }

    /// Any change, local or learnt from a peer.
    pub fn any_changes(&self) -> watch::Receiver<u64> {
        self.any_changes.subscribe()
    }

    /// A relayed copy an owner sent on its peer link to this replica: sent on
    /// to the edge if this replica holds the connection of the session it
    /// names (never on to a third replica).
    pub fn copy_to_edge(&self, copy: ReceivedCopy) -> Fate {
        let Some(via) = &copy.via else {
            return Fate::Unused;
        };
        let edge = self
            .local_session(&via.node)
            .filter(|s| s.id.0 == via.session)
            .and_then(|s| s.edge_copies());
        match edge {
            Some(e) if e.send_copy(copy.stream, copy.offset, &copy.payload) => Fate::Relayed,
            _ => Fate::Unused,
        }
    }

    /// A relayed copy the holder of an edge's connection sent back on the
    /// peer link this replica dialled: applied to the stream it names in
    /// this replica's session (held or owned) of that edge.
    pub fn copy_from_holder(&self, copy: ReceivedCopy) -> Fate {
        let Some(via) = &copy.via else {
            return Fate::Unused;
        };
        let session = {
            let t = self.tables();
            let found = [t.sessions.get(&via.node), t.owned.get(&via.node)]
                .into_iter()
                .flatten()
                .find(|s| s.id.0 == via.session)
                .cloned();
            found
        };
        let stream = session.and_then(|s| s.stream(copy.stream));
        copies::apply(stream, &copy)
    }

    /// The session of `node` on this replica — never a peer's edge. A relayed
    /// request is served from this only, so it never takes a second hop.
    pub fn local_session(&self, node: &str) -> Option<Arc<Session>> {
        self.tables().sessions.get(node).cloned()
    }

    /// This replica's edges as its peers are told of them, and the change
    /// number they are current as of.
    pub fn local_records(&self) -> (u64, HashMap<String, EdgeRecord>) {
        let t = self.tables();
        let records = t
            .sessions
            .values()
            .map(|s| (s.node.clone(), t.record_of(s)))
            .collect();
        (t.change_seq, records)
    }

    /// The local nodes changed after change number `after`, each with its
    /// record now (`None`: no longer held here), and the current number; `None`
    /// for the list if the log no longer reaches back that far.
    #[allow(clippy::type_complexity)]
    pub fn changed_since(&self, after: u64) -> (u64, Option<Vec<(String, Option<EdgeRecord>)>>) {
        let t = self.tables();
        if after < t.forgotten_through {
            return (t.change_seq, None);
        }
        let list = t
            .changed
            .range(after + 1..)
            .map(|(_, node)| (node.clone(), t.sessions.get(node).map(|s| t.record_of(s))))
            .collect();
        (t.change_seq, Some(list))
    }

    /// Tells the peers and waiting requests that local `node` changed (the
    /// tunnel calls it when a connection attaches or is lost).
    pub fn touch_node(&self, node: &str) {
        self.tables().mark(node);
        self.touch();
    }

    /// Applies one update from the peer behind `link`.
    pub fn apply_remote(&self, link: &PeerLink, update: Update) {
        let mut t = self.tables();
        let instance = link.replica.instance;
        let mut touched = Vec::new();
        match update {
            Update::Upsert(records) => {
                for record in records {
                    let node = record.node.clone();
                    touched.push(node.clone());
                    t.remove_remote(instance, &node);
                    t.index_remote(&record, true);
                    t.forget_departed(&node);
                    t.remote.entry(node.clone()).or_default().push(RemoteEdge {
                        replica: link.replica.clone(),
                        conn: link.conn.clone(),
                        copies: link.copies.clone(),
                        record,
                    });
                    t.remote_by_replica
                        .entry(instance)
                        .or_default()
                        .insert(node);
                }
            }
            Update::Remove(nodes) => {
                for node in nodes {
                    t.remove_remote(instance, &node);
                    touched.push(node);
                }
            }
        }
        let mut to_end = Vec::new();
        for node in touched {
            to_end.extend(self.reconcile(&mut t, &node));
        }
        drop(t);
        self.end_all(to_end);
        self.any_changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    fn end_all(&self, to_end: Vec<(Arc<Session>, String)>) {
        for (s, reason) in to_end {
            info!(node = %s.node, session = %s.id, %reason, "ending this replica's session of the edge");
            s.end(tether_proto::frame::ResetCode::SessionLost, &reason);
        }
    }

    /// Forgets everything peer `instance` said (its link or subscription ended).
    pub fn drop_remote(&self, instance: u64) {
        let mut t = self.tables();
        let mut to_end = Vec::new();
        for node in t.remote_by_replica.remove(&instance).unwrap_or_default() {
            t.remove_remote(instance, &node);
            to_end.extend(self.reconcile(&mut t, &node));
        }
        // Sessions relayed through it that it did not list any more.
        let via: Vec<_> = t
            .owned
            .values()
            .filter(|s| s.relayed_via().is_some_and(|r| r.instance == instance))
            .cloned()
            .collect();
        for s in via {
            if let Some(epoch) = s.relay_lost(instance) {
                self.expire_later(s, epoch);
            }
        }
        drop(t);
        self.end_all(to_end);
        self.any_changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// How many (node, peer) pairs are known from peers.
    pub fn remote_len(&self) -> usize {
        self.tables().remote.values().map(Vec::len).sum()
    }

    /// The edges peers hold, as `/status` shows them: (node, replica, attached).
    pub fn remote_status(&self) -> Vec<(String, String, bool)> {
        let t = self.tables();
        let mut v: Vec<_> = t
            .remote
            .iter()
            .flat_map(|(n, list)| {
                list.iter()
                    .map(|r| (n.clone(), r.replica.name.clone(), r.record.attached))
            })
            .collect();
        v.sort();
        v
    }

    /// The session of the node running pod `namespace/pod`.
    pub fn route_pod(&self, namespace: &str, pod: &str) -> Result<Target, RouteError> {
        let t = self.tables();
        if let Some(auth) = &self.authority {
            return match auth.pod(namespace, pod) {
                PodPlacement::On(node) => t.holder(&node).ok_or(RouteError::PodNodeGone {
                    namespace: namespace.into(),
                    pod: pod.into(),
                    node,
                }),
                PodPlacement::Unscheduled => Err(RouteError::PodUnscheduled {
                    namespace: namespace.into(),
                    pod: pod.into(),
                }),
                PodPlacement::Unknown => Err(RouteError::UnknownPod {
                    namespace: namespace.into(),
                    pod: pod.into(),
                }),
            };
        }
        let key = (namespace.to_string(), pod.to_string());
        let nodes = t.pod_nodes(&key);
        match nodes.len() {
            1 => {
                let node = nodes.iter().next().cloned().unwrap_or_default();
                t.holder(&node).ok_or(RouteError::PodNodeGone {
                    namespace: namespace.into(),
                    pod: pod.into(),
                    node,
                })
            }
            n if n > 1 => Err(RouteError::AmbiguousPod {
                namespace: namespace.into(),
                pod: pod.into(),
                nodes: nodes.iter().cloned().collect::<Vec<_>>().join(", "),
            }),
            _ => match t.departed.get(&key) {
                Some(node) => Err(RouteError::PodNodeGone {
                    namespace: namespace.into(),
                    pod: pod.into(),
                    node: node.clone(),
                }),
                None => Err(RouteError::UnknownPod {
                    namespace: namespace.into(),
                    pod: pod.into(),
                }),
            },
        }
    }

    /// Resolves one name-or-address. An IP is looked up as an address first
    /// (a node named like an IP never outranks the node that has it), a name
    /// as a node name first. Addresses are the apiserver's node addresses with
    /// an authority, else the edges' announced ones. `Ok(None)`: nothing matches.
    fn resolve(
        &self,
        t: &Tables,
        what: &'static str,
        value: &str,
    ) -> Result<Option<Target>, RouteError> {
        let v = host_only(value);
        if v.is_empty() {
            return Ok(None);
        }
        let by_name = || t.holder(&v);
        let by_address = || -> Result<Option<Target>, RouteError> {
            let nodes = match &self.authority {
                Some(auth) => auth.address_nodes(&v),
                None => t.address_nodes(&v),
            };
            match nodes.len() {
                0 => Ok(None),
                1 => {
                    let node = nodes.into_iter().next().unwrap_or_default();
                    match t.holder(&node) {
                        Some(s) => Ok(Some(s)),
                        // The address is that node's: never fall through to another.
                        None => Err(RouteError::UnknownNode {
                            looked_up: format!("{what} {v:?} (node {node}, not connected)"),
                        }),
                    }
                }
                _ => Err(RouteError::AmbiguousAddress {
                    what,
                    value: v.clone(),
                    nodes: nodes.into_iter().collect::<Vec<_>>().join(", "),
                }),
            }
        };
        if v.parse::<IpAddr>().is_ok() {
            if let Some(s) = by_address()? {
                return Ok(Some(s));
            }
            return Ok(by_name());
        }
        if let Some(s) = by_name() {
            return Ok(Some(s));
        }
        by_address()
    }

    /// The nodes a connection hint (SNI or `Host`) can stand for: the node it
    /// names, and those its address belongs to.
    fn hint_nodes(&self, t: &Tables, value: &str) -> BTreeSet<String> {
        let v = host_only(value);
        let mut nodes = BTreeSet::new();
        if v.is_empty() {
            return nodes;
        }
        if t.holder(&v).is_some() {
            nodes.insert(v.clone());
        }
        nodes.extend(match &self.authority {
            Some(auth) => auth.address_nodes(&v),
            None => t.address_nodes(&v),
        });
        nodes
    }

    /// The session for a node-scoped upgrade request: by TLS SNI, else
    /// `Host`, each a node name or an address its edge announced. The node
    /// named in `X-Forwarded-Uri` only chooses among the nodes SNI and `Host`
    /// stand for (an address several edges share, say): it must be one of
    /// them for every hint that stands for any node, and at least one hint
    /// must, else the request is refused. On an upgrade kube-apiserver copies
    /// the client's headers and does not set `X-Forwarded-Uri` itself, so a
    /// client could have put it there to reach a node it was not let through
    /// to. Plain requests go through [`Registry::route_node_proxied`].
    pub fn route_node(
        &self,
        forwarded_node: Option<&str>,
        sni: Option<&str>,
        host: Option<&str>,
    ) -> Result<Target, RouteError> {
        self.route_node_inner(forwarded_node, false, sni, host)
    }

    /// The session for a node-scoped plain (non-upgrade) request. Like
    /// [`Registry::route_node`], except that `X-Forwarded-Uri` on its own is
    /// enough when nothing in the connection stands for a node: on plain
    /// requests kube-apiserver's node proxy sets that header itself
    /// (overwriting any the client sent) while keeping the client's `Host`
    /// (its own address) and dialling the node's IP (no SNI), so the header is
    /// the only name of the node there is. A header naming another node than
    /// SNI or `Host` stand for is still refused. Callers authorised by
    /// SubjectAccessReview are authorised for the node this returns, so
    /// naming a node gives them nothing they were not allowed.
    pub fn route_node_proxied(
        &self,
        forwarded_node: Option<&str>,
        sni: Option<&str>,
        host: Option<&str>,
    ) -> Result<Target, RouteError> {
        self.route_node_inner(forwarded_node, true, sni, host)
    }

    fn route_node_inner(
        &self,
        forwarded_node: Option<&str>,
        header_alone_suffices: bool,
        sni: Option<&str>,
        host: Option<&str>,
    ) -> Result<Target, RouteError> {
        let t = self.tables();
        if let Some(n) = forwarded_node {
            let mut confirmed = false;
            for (what, value) in [("SNI", sni), ("Host", host)] {
                let Some(v) = value else { continue };
                let nodes = self.hint_nodes(&t, v);
                if nodes.is_empty() {
                    continue;
                }
                if !nodes.contains(n) {
                    return Err(RouteError::ForwardedUriUntrusted {
                        node: n.to_string(),
                        why: format!(
                            "the apiserver's connection has {what} {:?}, which stands for {}",
                            host_only(v),
                            nodes.into_iter().collect::<Vec<_>>().join(", ")
                        ),
                    });
                }
                confirmed = true;
            }
            if !confirmed && !header_alone_suffices {
                return Err(RouteError::ForwardedUriUntrusted {
                    node: n.to_string(),
                    why: "this is an upgrade (whose headers kube-apiserver copies from the \
                          client) and neither the connection's SNI nor its Host stands for a \
                          connected node"
                        .to_string(),
                });
            }
            return t.holder(n).ok_or_else(|| RouteError::UnknownNode {
                looked_up: format!("node {n:?} (from X-Forwarded-Uri)"),
            });
        }
        let mut looked = Vec::new();
        for (what, value) in [("SNI", sni), ("Host", host)] {
            if let Some(v) = value {
                if let Some(s) = self.resolve(&t, what, v)? {
                    return Ok(s);
                }
                looked.push(format!("{what} {v:?}"));
            }
        }
        if looked.is_empty() {
            return Err(RouteError::NoHint);
        }
        Err(RouteError::UnknownNode {
            looked_up: looked.join(" or "),
        })
    }
}

/// The index keys (namespace, name) a node gains and loses when its report
/// `old` is replaced by `new` (a pod listed twice is one key).
#[allow(clippy::type_complexity)]
fn pod_delta(old: &[PodRef], new: &[PodRef]) -> (Vec<(String, String)>, Vec<(String, String)>) {
    fn keys(pods: &[PodRef]) -> HashSet<(&str, &str)> {
        pods.iter()
            .map(|p| (p.namespace.as_str(), p.name.as_str()))
            .collect()
    }
    let (old, new) = (keys(old), keys(new));
    let owned = |(ns, name): &(&str, &str)| (ns.to_string(), name.to_string());
    (
        new.difference(&old).map(owned).collect(),
        old.difference(&new).map(owned).collect(),
    )
}

/// `pods` without the entries whose namespace or name is longer than
/// Kubernetes allows, and how many those were.
fn bounded_pods(mut pods: Vec<PodRef>) -> (Vec<PodRef>, usize) {
    let before = pods.len();
    pods.retain(|p| {
        p.namespace.len() <= routes::MAX_NAMESPACE_LEN && p.name.len() <= routes::MAX_POD_NAME_LEN
    });
    let dropped = before - pods.len();
    (pods, dropped)
}

/// The node name in an `X-Forwarded-Uri` of the apiserver's node proxy:
/// `/api/v1/nodes/{node}/proxy/…`.
pub fn node_from_forwarded_uri(uri: &str) -> Option<&str> {
    let rest = uri.strip_prefix("/api/v1/nodes/")?;
    let (node, rest) = rest.split_once('/')?;
    let node = node.split(':').next().unwrap_or(node);
    if rest.starts_with("proxy") && !node.is_empty() {
        Some(node)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_proto::Limits;

    fn session(node: &str, addrs: &[&str]) -> Arc<Session> {
        Session::new(
            node.into(),
            addrs.iter().map(|s| s.to_string()).collect(),
            Limits::default(),
            &claim(1, 1),
        )
        .unwrap()
    }

    fn claim(token: u8, attempt: u64) -> Claim {
        Claim {
            token: tether_proto::token::ResumeToken([token; 16]),
            instance: 1,
            attempt,
        }
    }

    fn ticket(session: u64, gen: u64) -> Ticket {
        Ticket {
            node: "n".into(),
            session: SessionId(session),
            gen,
            expires_ms: u64::MAX,
            mac: [0; 32],
        }
    }

    /// A ticket (verified by the caller) resumes its session on a replica that never
    /// held it — taking over the streams this replica owned of it — unless a newer
    /// generation of the edge is known; then it is refused and nothing is touched.
    #[tokio::test]
    async fn tickets_resume_anywhere_but_never_over_a_newer_generation() {
        let (c1, _s1, _e1) = tether_proto::testing::quic_pair().await.unwrap();
        let peer = crate::peer::PeerLink::for_test("b", c1);
        let r = Registry::new(Duration::from_secs(60));
        let record = |gen: u64, sid: u64, attached: bool| EdgeRecord {
            node: "n".into(),
            session: format!("{sid:016x}"),
            attached,
            since_ms: gen,
            sid,
            gen,
            limits: Limits::default(),
            pods: vec![],
            addresses: vec![],
        };
        // Replica b holds n (session 7, generation 100); this replica owns a
        // stream of it, relayed through b.
        r.apply_remote(&peer, Update::Upsert(vec![record(100, 7, true)]));
        let owned = r.owner_session("n", Limits::default()).unwrap();
        assert_eq!((owned.id, owned.gen()), (SessionId(7), 100));
        assert!(owned.relayed_via().is_some() && !owned.is_held());
        let make = |resume: Option<(SessionId, u64)>| {
            let (id, gen) = resume.expect("a ticket resumes");
            Ok::<_, rand::rand_core::OsError>(Session::resumed(
                "n".into(),
                id,
                gen,
                vec![],
                Limits::default(),
                &claim(1, 1),
            ))
        };
        // An older generation of that session: refused, nothing touched.
        assert!(matches!(
            r.admit("n", &claim(1, 1), vec![], Some(&ticket(7, 99)), make),
            Ok(Admitted::StaleTicket(_))
        ));
        // Another session older than the one attached: refused likewise.
        assert!(matches!(
            r.admit("n", &claim(1, 1), vec![], Some(&ticket(8, 50)), make),
            Ok(Admitted::StaleTicket(_))
        ));
        assert!(!owned.is_ended() && r.get("n").is_none());
        // The current generation (the edge's link to b died): resumed here, in the
        // very session object that owns the stream.
        let Ok(Admitted::Resumed { session, replaced }) =
            r.admit("n", &claim(1, 1), vec![], Some(&ticket(7, 100)), make)
        else {
            panic!("the ticket resumes")
        };
        assert!(Arc::ptr_eq(&session, &owned) && replaced.is_empty());
        // The edge commits here: generation 150, held here.
        let (edge_conn, _far, _e2) = tether_proto::testing::quic_pair().await.unwrap();
        session
            .attach_connection(edge_conn.clone(), None, &claim(1, 1), 150)
            .unwrap();
        r.hold(&session);
        assert!(session.is_held() && Arc::ptr_eq(&r.get("n").unwrap(), &session));
        // A commit of an older generation is refused.
        let (old_conn, _far2, _e3) = tether_proto::testing::quic_pair().await.unwrap();
        assert!(session
            .attach_connection(old_conn, None, &claim(1, 2), 120)
            .is_err());
        // Two connections raced on two replicas: b's newer generation wins here
        // too — ours is closed, the session is relayed through b and no longer
        // held (published) here.
        r.apply_remote(&peer, Update::Upsert(vec![record(200, 7, true)]));
        assert_eq!(session.gen(), 200);
        assert!(session.relayed_via().is_some());
        assert!(
            edge_conn.close_reason().is_some(),
            "the older connection is closed"
        );
        assert!(r.get("n").is_none());
        // b's older generation never displaces a newer one here.
        r.apply_remote(&peer, Update::Upsert(vec![record(180, 7, true)]));
        assert_eq!(session.gen(), 200);
        // A newer generation of *another* session (the edge restarted): this
        // replica's session of the old state ends.
        r.apply_remote(&peer, Update::Upsert(vec![record(300, 9, true)]));
        assert!(session.is_ended());
    }

    #[test]
    fn admit_joins_attempts_of_one_state_and_replaces_for_another() {
        let r = Registry::new(Duration::from_secs(1));
        let make = |c: Claim| move |_| Session::new("n".into(), vec![], Limits::default(), &c);
        let Ok(Admitted::New {
            session: first,
            replaced,
        }) = r.admit("n", &claim(1, 1), vec![], None, make(claim(1, 1)))
        else {
            panic!("the first hello starts a session")
        };
        assert!(replaced.is_empty());
        // Sibling and later attempts of the same state join it, whatever
        // their order.
        for attempt in [3, 2, 7] {
            let Ok(Admitted::Joined(s)) = r.admit(
                "n",
                &claim(1, attempt),
                vec![],
                None,
                make(claim(1, attempt)),
            ) else {
                panic!("attempt {attempt} must join")
            };
            assert!(Arc::ptr_eq(&s, &first));
        }
        // Another state of the edge replaces it.
        let Ok(Admitted::New {
            session: second,
            replaced,
        }) = r.admit("n", &claim(2, 8), vec![], None, make(claim(2, 8)))
        else {
            panic!("another state starts a new session")
        };
        assert_eq!(replaced.len(), 1);
        assert!(Arc::ptr_eq(&replaced[0], &first));
        assert!(Arc::ptr_eq(&r.get("n").unwrap(), &second));
        // An ended session is joined by nobody.
        second.end(tether_proto::frame::ResetCode::Shutdown, "test");
        assert!(matches!(
            r.admit("n", &claim(2, 9), vec![], None, make(claim(2, 9))),
            Ok(Admitted::New { replaced, .. }) if replaced.len() == 1
        ));
    }

    fn pod(ns: &str, name: &str) -> PodRef {
        PodRef {
            namespace: ns.into(),
            name: name.into(),
            uid: format!("{ns}-{name}"),
        }
    }

    #[test]
    fn host_normalization() {
        assert_eq!(host_only("Edge-1:10250"), "edge-1");
        assert_eq!(host_only("10.0.0.1:10350"), "10.0.0.1");
        assert_eq!(host_only("[fd00::1]:10250"), "fd00::1");
        assert_eq!(host_only("fd00::1"), "fd00::1");
        assert_eq!(host_only("edge-1."), "edge-1");
    }

    #[test]
    fn address_index_follows_inserts_resumes_and_removals() {
        let r = Registry::new(Duration::from_secs(1));
        let a = session("edge-a", &["10.0.0.1", "10.0.0.9"]);
        let b = session("edge-b", &["10.0.0.1"]);
        r.insert(a.clone());
        r.insert(b.clone());
        assert_eq!(r.len(), 2);
        assert!(matches!(
            r.route_node(None, None, Some("10.0.0.1")),
            Err(RouteError::AmbiguousAddress { .. })
        ));
        // a resumes from another address: its old ones no longer route to it.
        r.set_addresses(&a, vec!["10.0.0.5".into()]);
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.1")).unwrap().node,
            "edge-b"
        );
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.5")).unwrap().node,
            "edge-a"
        );
        assert!(matches!(
            r.route_node(None, None, Some("10.0.0.9")),
            Err(RouteError::UnknownNode { .. })
        ));
        // A new session of b replaces its addresses; removing a empties its index.
        r.insert(session("edge-b", &["10.0.0.2"]));
        assert!(matches!(
            r.route_node(None, None, Some("10.0.0.1")),
            Err(RouteError::UnknownNode { .. })
        ));
        assert!(r.remove(&a));
        assert_eq!(r.len(), 1);
        let t = r.tables();
        assert_eq!(t.addresses.keys().collect::<Vec<_>>(), vec!["10.0.0.2"]);
        assert!(!t.node_addresses.contains_key("edge-a"));
    }

    #[test]
    fn departed_pods_are_forgotten_when_their_node_returns() {
        let r = Registry::new(Duration::from_secs(1));
        let a = session("edge-a", &[]);
        r.insert(a.clone());
        r.report_pods(&a, vec![pod("default", "p1")]);
        assert!(r.remove(&a));
        assert!(matches!(
            r.route_pod("default", "p1"),
            Err(RouteError::PodNodeGone { .. })
        ));
        r.insert(session("edge-a", &[]));
        assert!(matches!(
            r.route_pod("default", "p1"),
            Err(RouteError::UnknownPod { .. })
        ));
        let t = r.tables();
        assert!(t.departed.is_empty() && t.node_departed.is_empty());
    }

    #[test]
    fn forwarded_uri_only_chooses_among_the_connections_nodes() {
        let r = Registry::new(Duration::from_secs(1));
        // Two edges behind one NAT address, a third elsewhere.
        r.insert(session("edge-a", &["10.0.0.9"]));
        r.insert(session("edge-b", &["10.0.0.9"]));
        r.insert(session("edge-c", &["10.0.0.7"]));
        let node = |fwd, sni, host| r.route_node(fwd, sni, host).map(|t| t.node);
        assert!(matches!(
            node(None, None, Some("10.0.0.9:10250")),
            Err(RouteError::AmbiguousAddress { .. })
        ));
        assert_eq!(
            node(Some("edge-b"), None, Some("10.0.0.9:10250")),
            Ok("edge-b".to_string())
        );
        assert_eq!(
            node(Some("edge-c"), Some("edge-c"), Some("10.96.0.1:443")),
            Ok("edge-c".to_string())
        );
        for (fwd, sni, host) in [
            // Another node than the connection's address or name.
            ("edge-c", None, Some("10.0.0.9:10250")),
            ("edge-b", None, Some("edge-a:10250")),
            ("edge-b", Some("edge-a"), Some("10.0.0.9:10250")),
            // Nothing in the connection stands for a node.
            ("edge-b", None, Some("10.96.0.1:443")),
            ("edge-b", None, None),
        ] {
            assert!(
                matches!(
                    node(Some(fwd), sni, host),
                    Err(RouteError::ForwardedUriUntrusted { .. })
                ),
                "{fwd} {sni:?} {host:?}"
            );
        }
        // A plain request proxied by the apiserver (which sets the header itself):
        // the header alone names the node when nothing in the connection does…
        let proxied = |fwd, sni, host| r.route_node_proxied(fwd, sni, host).map(|t| t.node);
        assert_eq!(
            proxied(Some("edge-b"), None, Some("10.96.0.1:443")),
            Ok("edge-b".to_string())
        );
        assert_eq!(
            proxied(Some("edge-c"), None, None),
            Ok("edge-c".to_string())
        );
        assert!(matches!(
            proxied(Some("nope"), None, Some("10.96.0.1:443")),
            Err(RouteError::UnknownNode { .. })
        ));
        // …but never against what the connection stands for.
        for (fwd, sni, host) in [
            ("edge-c", None, Some("10.0.0.9:10250")),
            ("edge-b", None, Some("edge-a:10250")),
            ("edge-b", Some("edge-a"), Some("10.96.0.1:443")),
        ] {
            assert!(
                matches!(
                    proxied(Some(fwd), sni, host),
                    Err(RouteError::ForwardedUriUntrusted { .. })
                ),
                "{fwd} {sni:?} {host:?}"
            );
        }
    }

    #[test]
    fn departed_pods_are_bounded_oldest_node_first() {
        let r = Registry::new(Duration::from_secs(1)).with_max_departed(5);
        let leave = |node: &str, pods: &[&str]| {
            let s = session(node, &[]);
            r.insert(s.clone());
            r.report_pods(&s, pods.iter().map(|p| pod("default", p)).collect());
            assert!(r.remove(&s));
        };
        leave("edge-a", &["a1", "a2"]);
        leave("edge-b", &["b1", "b2"]);
        // A node that comes back and leaves again departs anew (its old place is stale).
        leave("edge-a", &["a1", "a2"]);
        assert_eq!(r.tables().departed.len(), 4);
        leave("edge-c", &["c1", "c2"]);
        // Six pods: edge-b, the oldest departure, is forgotten (404, not 502).
        let t = r.tables();
        assert_eq!(t.departed.len(), 4);
        assert!(!t.node_departed.contains_key("edge-b"));
        drop(t);
        for (p, gone) in [("b1", false), ("a1", true), ("c2", true)] {
            let route = r.route_pod("default", p);
            assert_eq!(
                matches!(route, Err(RouteError::PodNodeGone { .. })),
                gone,
                "{p}: {:?}",
                route.err().map(|e| e.to_string())
            );
        }
        assert!(matches!(
            r.route_pod("default", "b1"),
            Err(RouteError::UnknownPod { .. })
        ));
        // Flapping nodes never grow the order beyond its compaction bound.
        for i in 0..500 {
            leave(&format!("edge-f{}", i % 3), &[]);
            r.insert(session(&format!("edge-f{}", i % 3), &[]));
        }
        let t = r.tables();
        assert!(t.departed.len() <= 5);
        assert!(
            t.departed_order.len() <= 2 * t.departed_seq.len() + 65,
            "{}",
            t.departed_order.len()
        );
    }

    fn refused(r: &Registry, kind: &'static str) -> u64 {
        r.claims_refused.get_or_create(&KindLabel { kind }).get()
    }

    #[test]
    fn the_apiserver_decides_pods_and_addresses_and_claims_are_refused() {
        let auth = Arc::new(Authority::new());
        auth.set_pod("default", "p1", Some(Some("edge-a".into())));
        auth.set_pod("default", "pending", Some(None));
        auth.set_node("edge-a", Some(vec!["10.0.0.1".into()]));
        auth.set_node("edge-b", Some(vec!["10.0.0.2".into()]));
        let r = Registry::with_authority(
            Duration::from_secs(1),
            Some(auth.clone()),
            Family::default(),
        );
        let a = session("edge-a", &["10.0.0.1"]);
        r.insert(a.clone());
        r.report_pods(&a, vec![pod("default", "p1")]);
        // edge-b claims edge-a's pod and address (and one of its own).
        let b = session("edge-b", &["10.0.0.1", "10.0.0.2"]);
        r.insert(b.clone());
        r.report_pods(&b, vec![pod("default", "p1")]);
        // The same claim in the next report is not counted again.
        r.report_pods(&b, vec![pod("default", "p1")]);
        assert_eq!(refused(&r, "pod"), 1);
        assert_eq!(refused(&r, "address"), 1);
        // The real owner still routes; nothing is ambiguous.
        assert_eq!(r.route_pod("default", "p1").unwrap().node, "edge-a");
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.1")).unwrap().node,
            "edge-a"
        );
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.2")).unwrap().node,
            "edge-b"
        );
        // A resume that re-announces the stolen address is refused again.
        r.set_addresses(&b, vec!["10.0.0.1".into()]);
        assert_eq!(refused(&r, "address"), 2);
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.1")).unwrap().node,
            "edge-a"
        );
        // The owner gone: its pod and address are "not connected", never the claimant's.
        assert!(r.remove(&a));
        assert!(matches!(
            r.route_pod("default", "p1"),
            Err(RouteError::PodNodeGone { ref node, .. }) if node == "edge-a"
        ));
        assert!(matches!(
            r.route_node(None, None, Some("10.0.0.1")),
            Err(RouteError::UnknownNode { .. })
        ));
        // Pods the apiserver does not have (or has on no node) do not route.
        r.report_pods(&b, vec![pod("default", "made-up")]);
        assert!(matches!(
            r.route_pod("default", "made-up"),
            Err(RouteError::UnknownPod { .. })
        ));
        assert!(matches!(
            r.route_pod("default", "pending"),
            Err(RouteError::PodUnscheduled { .. })
        ));
        // The apiserver moves the pod: it follows.
        auth.set_pod("default", "p1", Some(Some("edge-b".into())));
        assert_eq!(r.route_pod("default", "p1").unwrap().node, "edge-b");
    }

    #[test]
    fn a_node_named_like_an_ip_does_not_outrank_that_ip() {
        // Without an authority: the announced address wins over the name.
        let r = Registry::new(Duration::from_secs(1));
        r.insert(session("10.0.0.5", &[]));
        r.insert(session("edge-c", &["10.0.0.5"]));
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.5:10250"))
                .unwrap()
                .node,
            "edge-c"
        );
        assert_eq!(
            r.route_node(None, Some("10.0.0.5"), None).unwrap().node,
            "edge-c"
        );
        // Nobody announces it: the name still reaches its node.
        r.insert(session("edge-c", &["10.0.0.6"]));
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.5")).unwrap().node,
            "10.0.0.5"
        );
        // With an authority: the apiserver's address owner, connected or not.
        let auth = Arc::new(Authority::new());
        auth.set_node("edge-c", Some(vec!["10.0.0.5".into()]));
        let r = Registry::with_authority(Duration::from_secs(1), Some(auth), Family::default());
        r.insert(session("10.0.0.5", &[]));
        assert!(matches!(
            r.route_node(None, None, Some("10.0.0.5")),
            Err(RouteError::UnknownNode { .. })
        ));
        r.insert(session("edge-c", &[]));
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.5")).unwrap().node,
            "edge-c"
        );
    }

    #[test]
    fn forwarded_uri() {
        assert_eq!(
            node_from_forwarded_uri("/api/v1/nodes/edge-1/proxy/metrics"),
            Some("edge-1")
        );
        assert_eq!(
            node_from_forwarded_uri("/api/v1/nodes/edge-1:10250/proxy/stats/summary"),
            Some("edge-1")
        );
        assert_eq!(node_from_forwarded_uri("/api/v1/nodes/edge-1"), None);
        assert_eq!(node_from_forwarded_uri("/api/v1/pods"), None);
    }

    #[test]
    fn routes_pods_and_refuses_ambiguity() {
        let r = Registry::new(Duration::from_secs(1));
        let a = session("edge-a", &["10.0.0.1"]);
        let b = session("edge-b", &["10.0.0.1", "10.0.0.2"]);
        r.insert(a.clone());
        r.insert(b.clone());
        r.report_pods(&a, vec![pod("default", "p1"), pod("default", "dup")]);
        r.report_pods(&b, vec![pod("default", "p2"), pod("default", "dup")]);
        assert_eq!(r.route_pod("default", "p1").unwrap().node, "edge-a");
        assert_eq!(r.route_pod("default", "p2").unwrap().node, "edge-b");
        assert!(matches!(
            r.route_pod("default", "dup"),
            Err(RouteError::AmbiguousPod { .. })
        ));
        assert!(matches!(
            r.route_pod("default", "nope"),
            Err(RouteError::UnknownPod { .. })
        ));
        // Node-scoped (X-Forwarded-Uri picks among the address's nodes, never another).
        assert_eq!(
            r.route_node(Some("edge-b"), None, Some("10.0.0.1"))
                .unwrap()
                .node,
            "edge-b"
        );
        assert!(matches!(
            r.route_node(Some("edge-b"), None, Some("edge-a")),
            Err(RouteError::ForwardedUriUntrusted { .. })
        ));
        assert_eq!(
            r.route_node(None, Some("edge-a"), None).unwrap().node,
            "edge-a"
        );
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.2:10350"))
                .unwrap()
                .node,
            "edge-b"
        );
        assert!(matches!(
            r.route_node(None, None, Some("10.0.0.1")),
            Err(RouteError::AmbiguousAddress { .. })
        ));
        assert!(matches!(
            r.route_node(None, Some("unknown"), Some("10.9.9.9")),
            Err(RouteError::UnknownNode { .. })
        ));
        assert!(matches!(
            r.route_node(Some("nope"), None, None),
            Err(RouteError::ForwardedUriUntrusted { .. })
        ));
        assert!(matches!(
            r.route_node(None, None, None),
            Err(RouteError::NoHint)
        ));
        // SNI that names nothing falls through to Host.
        assert_eq!(
            r.route_node(None, Some("cloud.example"), Some("edge-a:10250"))
                .unwrap()
                .node,
            "edge-a"
        );
        // A departed node's pods give "not connected".
        assert!(r.remove(&a));
        assert!(matches!(
            r.route_pod("default", "p1"),
            Err(RouteError::PodNodeGone { .. })
        ));
        assert_eq!(r.route_pod("default", "dup").unwrap().node, "edge-b");
        // A replaced session's late report is ignored.
        let a2 = session("edge-a", &[]);
        r.insert(a2.clone());
        r.report_pods(&a, vec![pod("x", "y")]);
        assert!(matches!(
            r.route_pod("x", "y"),
            Err(RouteError::UnknownPod { .. })
        ));
    }

    #[test]
    fn peers_are_told_only_what_changed_and_a_lagging_one_gets_everything() {
        let r = Registry::new(Duration::from_secs(1));
        let (s0, all) = r.local_records();
        assert!(all.is_empty());
        let a = session("edge-a", &[]);
        let b = session("edge-b", &[]);
        r.insert(a.clone());
        r.insert(b.clone());
        let (s1, list) = r.changed_since(s0);
        let nodes: Vec<_> = list
            .unwrap()
            .into_iter()
            .map(|(n, rec)| (n, rec.is_some()))
            .collect();
        assert_eq!(
            nodes,
            [("edge-a".to_string(), true), ("edge-b".to_string(), true)]
        );
        // Only b changes: only b is listed; a removal lists the node without a record.
        r.touch_node("edge-b");
        r.remove(&b);
        let (s2, list) = r.changed_since(s1);
        let list = list.unwrap();
        assert_eq!(list.len(), 1, "one entry per node, its latest");
        assert_eq!(list[0].0, "edge-b");
        assert!(list[0].1.is_none());
        assert_eq!(r.changed_since(s2).1.unwrap().len(), 0);
        // The log is bounded: far behind, the answer is "compare everything".
        for i in 0..(CHANGE_LOG_SLACK + 10) {
            r.touch_node(&format!("gone-{i}"));
        }
        assert!(r.changed_since(s0).1.is_none());
        assert!(r.changed_since(r.local_records().0).1.unwrap().is_empty());
    }

    /// The audit's case: edge `evil` sends a pod report that fits one 1 MiB
    /// frame, and with its 64 long addresses its route record is over the
    /// default `--peer-max-message-bytes` (1 MiB). Before, encoding the
    /// replica's table for a peer failed (`TooLarge`), so no peer learnt any
    /// edge of this replica; now `good` is published whole and `evil`
    /// without its pods, and the report is warned about once, naming the
    /// node and the flag.
    #[test]
    fn one_edges_oversized_record_does_not_stop_the_others_being_published() {
        use crate::routes::{diff, encode};
        let max = 1 << 20;
        let r = Registry::new(Duration::from_secs(1)).with_peer_message_limit(max);
        let long = |i: usize| format!("{i:0>253}");
        let addresses: Vec<String> = (0..64).map(long).collect();
        let addresses: Vec<&str> = addresses.iter().map(String::as_str).collect();
        let evil = session("evil", &addresses);
        let good = session("good", &["10.0.0.2"]);
        r.insert(evil.clone());
        r.insert(good.clone());
        r.report_pods(&good, vec![pod("default", "p")]);
        let report: Vec<PodRef> = (0..3960)
            .map(|i| PodRef {
                namespace: "default".into(),
                name: long(i),
                uid: String::new(),
            })
            .collect();
        let frame = tether_proto::Frame::PodReport(tether_proto::handshake::PodReport {
            pods: report.clone(),
        });
        assert!(tether_proto::frame::encode_to_bytes(&frame, max).is_ok());
        let ((), warnings) = crate::testlog::warnings(|| r.report_pods(&evil, report));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("node=evil") && warnings[0].contains("--peer-max-message-bytes"),
            "{warnings:?}"
        );
        let (_, now) = r.local_records();
        let (up, gone) = diff(&HashMap::new(), &now);
        let encoded = encode(up, gone, max).expect("one record does not fail the others");
        assert_eq!(encoded.without_pods, ["evil"]);
        let mut sent = Vec::new();
        for m in &encoded.messages {
            assert!(m.len() <= 4 + max);
            if let Update::Upsert(v) = postcard::from_bytes(&m[4..]).unwrap() {
                sent.extend(v);
            }
        }
        let by_node: HashMap<_, _> = sent.iter().map(|r| (r.node.as_str(), r)).collect();
        assert_eq!(
            by_node["good"].pods,
            [("default".to_string(), "p".to_string())]
        );
        assert!(by_node["evil"].pods.is_empty());
        assert_eq!(by_node["evil"].addresses.len(), 64);
        // A small report of evil's fits again: no warning.
        let ((), warnings) =
            crate::testlog::warnings(|| r.report_pods(&evil, vec![pod("default", "q")]));
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    /// Pod names and namespaces longer than Kubernetes allows (253, 63) are
    /// dropped from a report, with one warning naming the node; the rest of
    /// the report stands.
    #[test]
    fn overlong_pod_names_and_namespaces_are_dropped_from_a_report() {
        let r = Registry::new(Duration::from_secs(1));
        let a = session("edge-a", &[]);
        r.insert(a.clone());
        let ns63 = "n".repeat(63);
        let name253 = "p".repeat(253);
        let report = vec![
            pod("default", "ok"),
            pod(&ns63, &name253),
            pod(&"n".repeat(64), "p"),
            pod("default", &"p".repeat(254)),
        ];
        let ((), warnings) = crate::testlog::warnings(|| r.report_pods(&a, report));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("node=edge-a") && warnings[0].contains("dropped=2"),
            "{warnings:?}"
        );
        assert_eq!(r.route_pod("default", "ok").unwrap().node, "edge-a");
        assert_eq!(r.route_pod(&ns63, &name253).unwrap().node, "edge-a");
        assert_eq!(r.tables().node_pods["edge-a"].len(), 2);
    }

    /// A report is indexed by its difference from the node's last one
    /// (computed outside the lock): whatever the sequence — pods coming and
    /// going, listed twice, shared with another node, an empty report, a
    /// node leaving and coming back — the index is exactly what indexing
    /// every node's last report from scratch gives.
    #[test]
    fn pod_reports_index_exactly_the_last_report_of_each_node() {
        let r = Registry::new(Duration::from_secs(1));
        let a = session("edge-a", &[]);
        let b = session("edge-b", &[]);
        r.insert(a.clone());
        r.insert(b.clone());
        let from_scratch = |r: &Registry| {
            let t = r.tables();
            let mut want: HashMap<(String, String), BTreeSet<String>> = HashMap::new();
            for (node, pods) in &t.node_pods {
                for p in pods.iter() {
                    want.entry((p.namespace.clone(), p.name.clone()))
                        .or_default()
                        .insert(node.clone());
                }
            }
            assert_eq!(t.pods, want);
        };
        let list = |names: &[&str]| names.iter().map(|n| pod("default", n)).collect();
        let steps: [(&Arc<Session>, &[&str]); 8] = [
            (&a, &["p1", "p2", "p2", "shared"]),
            (&b, &["shared", "q1"]),
            (&a, &["p2", "p3", "shared"]),
            (&b, &[]),
            (&a, &["p3"]),
            (&b, &["p3", "q2", "q2"]),
            (&a, &[]),
            (&a, &["p1", "shared"]),
        ];
        for (s, names) in steps {
            r.report_pods(s, list(names));
            from_scratch(&r);
        }
        assert_eq!(r.route_pod("default", "q2").unwrap().node, "edge-b");
        assert_eq!(r.route_pod("default", "p3").unwrap().node, "edge-b");
        assert_eq!(r.route_pod("default", "p1").unwrap().node, "edge-a");
        // Leaving and coming back: the new session's first report replaces
        // what the old one's left in the index.
        assert!(r.remove(&b));
        from_scratch(&r);
        let b2 = session("edge-b", &[]);
        r.insert(b2.clone());
        r.report_pods(&b2, list(&["q3", "shared"]));
        from_scratch(&r);
        assert!(matches!(
            r.route_pod("default", "shared"),
            Err(RouteError::AmbiguousPod { .. })
        ));
        // A replaced session's late report changes nothing.
        r.report_pods(&b, list(&["late"]));
        from_scratch(&r);
        assert!(r.route_pod("default", "late").is_err());
    }

    /// A report whose node's list changed between its two locks (another
    /// report of the session, a departure and return of the session, a
    /// first report raced by another) is indexed whole, not by its
    /// difference from the list it was compared with; a report whose session
    /// was replaced in between changes nothing. Either way the index is
    /// exactly what indexing every node's last list from scratch gives, and
    /// that list is the last report applied.
    #[test]
    fn a_pod_list_changed_between_the_two_locks_is_indexed_whole() {
        let r = Registry::new(Duration::from_secs(1));
        let list =
            |names: &[&str]| -> Vec<PodRef> { names.iter().map(|n| pod("default", n)).collect() };
        // `s` reports `names`, and `between` runs between its two locks.
        let racing = |s: &Arc<Session>, names: &[&str], between: ReportHook| {
            *r.between_report_locks.lock().unwrap() = Some(between);
            r.report_pods(s, list(names));
            assert!(r.between_report_locks.lock().unwrap().is_none(), "ran");
        };
        let check = |r: &Registry, node: &str, want: &[&str]| {
            let t = r.tables();
            let mut index: HashMap<(String, String), BTreeSet<String>> = HashMap::new();
            for (n, pods) in &t.node_pods {
                for p in pods.iter() {
                    index
                        .entry((p.namespace.clone(), p.name.clone()))
                        .or_default()
                        .insert(n.clone());
                }
            }
            assert_eq!(t.pods, index, "the index is the nodes' lists");
            let names: BTreeSet<&str> = t
                .node_pods
                .get(node)
                .map(|l| l.iter().map(|p| p.name.as_str()).collect())
                .unwrap_or_default();
            assert_eq!(names, want.iter().copied().collect::<BTreeSet<_>>());
        };
        let a = session("edge-a", &[]);
        r.insert(a.clone());
        r.report_pods(&a, list(&["p1", "p2"]));
        check(&r, "edge-a", &["p1", "p2"]);

        // Another report of the session lands between the two locks.
        let a2 = a.clone();
        racing(
            &a,
            &["p2", "p3"],
            Box::new(move |r: &Registry| r.report_pods(&a2, list(&["p1", "p4"]))),
        );
        check(&r, "edge-a", &["p2", "p3"]);
        assert!(matches!(
            r.route_pod("default", "p4"),
            Err(RouteError::UnknownPod { .. })
        ));

        // The session departs and is held here again (a relay that came
        // back) between the two locks: its list went with it.
        let a2 = a.clone();
        racing(
            &a,
            &["p3", "p5"],
            Box::new(move |r: &Registry| {
                assert!(r.remove(&a2));
                r.hold(&a2);
            }),
        );
        check(&r, "edge-a", &["p3", "p5"]);
        assert!(matches!(
            r.route_pod("default", "p2"),
            Err(RouteError::UnknownPod { .. })
        ));
        assert_eq!(r.route_pod("default", "p5").unwrap().node, "edge-a");

        // A first report raced by another one of the same session.
        let b = session("edge-b", &[]);
        r.insert(b.clone());
        let b2 = b.clone();
        racing(
            &b,
            &["q2"],
            Box::new(move |r: &Registry| r.report_pods(&b2, list(&["q1", "p3"]))),
        );
        check(&r, "edge-b", &["q2"]);
        check(&r, "edge-a", &["p3", "p5"]);
        assert_eq!(r.route_pod("default", "p3").unwrap().node, "edge-a");

        // A new session of the node (with its own report) between the two
        // locks: the old session's report is dropped.
        let b3 = session("edge-b", &[]);
        let b4 = b3.clone();
        racing(
            &b,
            &["q4"],
            Box::new(move |r: &Registry| {
                r.insert(b4.clone());
                r.report_pods(&b4, list(&["q3"]));
            }),
        );
        check(&r, "edge-b", &["q3"]);
        assert!(r.route_pod("default", "q4").is_err());
        assert!(r.route_pod("default", "q2").is_err());
    }

    /// An edge alternating a report that claims another node's pod with an
    /// empty one: before, every other report logged the claim again (a
    /// refusal was suppressed only when in the previous report). Now one
    /// node's claims are logged at most once per `--claim-warning-interval`
    /// and every new refusal is still counted; several new claims in one
    /// report make one warning. With the interval at 0 each is logged.
    #[test]
    fn refused_pod_claims_are_logged_at_most_once_per_interval_per_node() {
        let auth = Arc::new(Authority::new());
        for p in ["p1", "p2", "p3"] {
            auth.set_pod("default", p, Some(Some("edge-a".into())));
        }
        let run = |interval: Duration, reports: &[&[&str]]| {
            let r = Registry::with_authority(
                Duration::from_secs(1),
                Some(auth.clone()),
                Family::default(),
            )
            .with_claim_warning_interval(interval);
            let b = session("edge-b", &[]);
            r.insert(b.clone());
            let ((), warnings) = crate::testlog::warnings(|| {
                for names in reports {
                    r.report_pods(&b, names.iter().map(|n| pod("default", n)).collect());
                }
            });
            let claims: Vec<String> = warnings
                .into_iter()
                .filter(|w| w.contains("refusing an edge's pod claim"))
                .collect();
            (claims, refused(&r, "pod"))
        };
        let alternating: Vec<&[&str]> = (0..6)
            .map(|i| if i % 2 == 0 { &["p1"][..] } else { &[][..] })
            .collect();
        let (warnings, counted) = run(Duration::from_secs(3600), &alternating);
        assert_eq!((warnings.len(), counted), (1, 3), "{warnings:?}");
        assert!(
            warnings[0].contains("node=edge-b")
                && warnings[0].contains("owner=edge-a")
                && warnings[0].contains("claim=default/p1"),
            "{warnings:?}"
        );
        // The same claim in every report: counted once, logged once.
        let (warnings, counted) = run(Duration::ZERO, &[&["p1"], &["p1"], &["p1"]]);
        assert_eq!((warnings.len(), counted), (1, 1), "{warnings:?}");
        // Interval 0: every new claim is logged, as before the flag.
        let (warnings, counted) = run(Duration::ZERO, &alternating);
        assert_eq!((warnings.len(), counted), (3, 3), "{warnings:?}");
        // Three new claims in one report, then two more within the interval:
        // one warning, naming how many more; the later ones counted only.
        let (warnings, counted) = run(
            Duration::from_secs(3600),
            &[&["p1", "p2", "p3"], &[], &["p2", "p3"]],
        );
        assert_eq!((warnings.len(), counted), (1, 5), "{warnings:?}");
        assert!(warnings[0].contains("more=2"), "{warnings:?}");
    }

    /// An edge announcing an address the apiserver gives another node, on
    /// every hello (reconnecting in a loop, or resuming): before, each hello
    /// logged a warning per refused address. Now one node's refused addresses
    /// are logged at most once per `--claim-warning-interval`, several in one
    /// hello make one warning, the next warning after the interval says how
    /// many went unlogged, and every refusal is still counted. Each node, and
    /// a node's pod claims, have their own: the first of each is logged. With
    /// the interval at 0 every hello with a refused address is logged.
    #[test]
    fn refused_address_claims_are_logged_at_most_once_per_interval_per_node() {
        let auth = Arc::new(Authority::new());
        let a_addrs = ["10.0.0.1", "10.0.0.3", "10.0.0.4"];
        auth.set_node(
            "edge-a",
            Some(a_addrs.iter().map(|a| a.to_string()).collect()),
        );
        auth.set_node("edge-b", Some(vec!["10.0.0.2".into()]));
        auth.set_pod("default", "p1", Some(Some("edge-a".into())));
        let registry = |interval: Duration| {
            Registry::with_authority(
                Duration::from_secs(1),
                Some(auth.clone()),
                Family::default(),
            )
            .with_claim_warning_interval(interval)
        };
        let of_kind = |kind: &str, warnings: &[String]| -> Vec<String> {
            let what = format!("refusing an edge's {kind} claim");
            warnings
                .iter()
                .filter(|w| w.contains(&what))
                .cloned()
                .collect()
        };
        let addrs = |l: &[&str]| l.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        // Six hellos of edge-b naming edge-a's address beside its own: a new
        // session (the edge restarted) and a resume of it, in turn.
        let six_hellos = |r: &Registry| {
            let ((), warnings) = crate::testlog::warnings(|| {
                for _ in 0..3 {
                    let b = session("edge-b", &["10.0.0.2", "10.0.0.1"]);
                    r.insert(b.clone());
                    r.set_addresses(&b, addrs(&["10.0.0.1", "10.0.0.2"]));
                }
            });
            (of_kind("address", &warnings), refused(r, "address"))
        };
        let r = registry(Duration::from_secs(3600));
        let (warnings, counted) = six_hellos(&r);
        assert_eq!((warnings.len(), counted), (1, 6), "{warnings:?}");
        assert!(
            warnings[0].contains("node=edge-b")
                && warnings[0].contains("owner=edge-a")
                && warnings[0].contains("claim=10.0.0.1")
                && !warnings[0].contains("more="),
            "{warnings:?}"
        );
        assert_eq!(
            r.route_node(None, None, Some("10.0.0.2")).unwrap().node,
            "edge-b"
        );
        assert!(r.route_node(None, None, Some("10.0.0.1")).is_err());
        // Interval 0: every hello with a refused address is logged.
        let (warnings, counted) = six_hellos(&registry(Duration::ZERO));
        assert_eq!((warnings.len(), counted), (6, 6), "{warnings:?}");

        // Three refused in one hello, then two more within the interval, then
        // one once the interval has passed.
        let r = registry(Duration::from_secs(3600));
        let b = session("edge-b", &a_addrs);
        let ((), warnings) = crate::testlog::warnings(|| {
            r.insert(b.clone());
            // Its pod claims are warned about apart: the first is logged.
            r.report_pods(&b, vec![pod("default", "p1")]);
            r.set_addresses(&b, addrs(&a_addrs[..2]));
        });
        let (claims, pods) = (of_kind("address", &warnings), of_kind("pod", &warnings));
        assert_eq!((claims.len(), pods.len()), (1, 1), "{warnings:?}");
        assert!(claims[0].contains("more=2"), "{claims:?}");
        assert_eq!(refused(&r, "address"), 5);
        {
            let mut t = r.tables();
            let w = &mut t.node_refused.get_mut("edge-b").unwrap().addresses;
            // As if the interval had passed since the warning.
            w.warned_at = w
                .warned_at
                .and_then(|at| at.checked_sub(Duration::from_secs(3600)));
            assert!(w.warned_at.is_some(), "the warning's time, moved back");
        }
        let ((), warnings) = crate::testlog::warnings(|| {
            r.set_addresses(&b, addrs(&["10.0.0.4"]));
            // Another node's refusal within the interval: its own first warning.
            r.insert(session("edge-c", &["10.0.0.3"]));
            r.set_addresses(&b, addrs(&["10.0.0.3"]));
        });
        let claims = of_kind("address", &warnings);
        assert_eq!(claims.len(), 2, "{claims:?}");
        assert!(
            claims[0].contains("node=edge-b")
                && claims[0].contains("claim=10.0.0.4")
                && claims[0].contains("more=2"),
            "{claims:?}"
        );
        assert!(
            claims[1].contains("node=edge-c") && !claims[1].contains("more="),
            "{claims:?}"
        );
        assert_eq!(refused(&r, "address"), 8);
    }
}
