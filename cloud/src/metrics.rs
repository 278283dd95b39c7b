//! The cloud's Prometheus metrics, registered in one place.
//!
//! Label cardinality is bounded: stream kinds and refusal reasons are fixed
//! sets; per-edge RTT and loss are histograms/counters over all edges, not
//! one series per node (the `/status` endpoint lists nodes individually).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tether_proto::copies::CopyCounters;
use tether_proto::ops::ByteCounters;
use tether_proto::route::StreamKind;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabel {
    pub role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// Every metric of `tether-cloud`.
#[derive(Clone)]
pub struct CloudMetrics {
    pub edges_connected: Gauge,
    pub sessions: Gauge,
    pub streams_open: Family<KindLabel, Gauge>,
    pub streams_total: Family<KindLabel, Counter>,
    pub bytes: ByteCounters,
    pub resumes: Counter,
    pub migrations: Counter,
    pub refused: Family<ReasonLabel, Counter>,
    /// Edge connections refused before their handshake, by reason.
    pub edges_refused: Family<ReasonLabel, Counter>,
    /// Completed edge TLS handshakes: `full` or `resumed` (a session ticket).
    pub edge_handshakes: Family<KindLabel, Counter>,
    pub stream_open_seconds: Histogram,
    pub edge_rtt_seconds: Histogram,
    pub edge_lost_packets: Counter,
    /// Peer replicas with a live link from this one.
    pub peers_up: Gauge,
    /// Peer connections refused (either direction), by reason.
    pub peers_refused: Family<ReasonLabel, Counter>,
    /// Edge pod/address claims refused because the apiserver disagrees.
    pub claims_refused: Family<KindLabel, Counter>,
    /// Edges told to move to another replica while draining (SIGTERM).
    pub edges_moved: Counter,
    /// Every request being routed and every stream this replica serves now,
    /// of any kind, as the entry (local or relayed) or as the holder of a
    /// peer's relay: what a drain waits for. Not exported (`streams_open`
    /// has the streams by kind).
    pub streams_open_any: Gauge,
    /// Relayed streams, by this replica's role (entry: the request landed
    /// here; holder: the edge is held here).
    pub relayed_streams: Family<RoleLabel, Counter>,
    /// Bytes this replica sent to / received from holders over relays.
    pub relayed_bytes: ByteCounters,
    /// Relays this replica refused as holder, by reason.
    pub relays_refused: Family<ReasonLabel, Counter>,
    /// Routing lookups, by result (local, relayed, unroutable).
    pub route_lookups: Family<ResultLabel, Counter>,
    /// Relays a peer answered "not here" (the route was stale).
    pub stale_routes: Counter,
    /// Requests that waited for an edge between replicas, by outcome.
    pub route_waits: Family<ResultLabel, Counter>,
    /// (node, peer) pairs learnt from peers.
    pub remote_edges: Gauge,
    /// Datagram copies of interactive writes, both ways.
    pub copies: CopyCounters,
}

impl CloudMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> CloudMetrics {
        let m = CloudMetrics {
            edges_connected: Gauge::default(),
            sessions: Gauge::default(),
            streams_open: Family::default(),
            streams_total: Family::default(),
            bytes: ByteCounters::default(),
            resumes: Counter::default(),
            migrations: Counter::default(),
            refused: Family::default(),
            edges_refused: Family::default(),
            edge_handshakes: Family::default(),
            stream_open_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            edge_rtt_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            edge_lost_packets: Counter::default(),
            peers_up: Gauge::default(),
            peers_refused: Family::default(),
            claims_refused: Family::default(),
            edges_moved: Counter::default(),
            streams_open_any: Gauge::default(),
            relayed_streams: Family::default(),
            relayed_bytes: ByteCounters::default(),
            relays_refused: Family::default(),
            route_lookups: Family::default(),
            stale_routes: Counter::default(),
            route_waits: Family::default(),
            remote_edges: Gauge::default(),
            copies: CopyCounters::default(),
        };
        let r = registry.sub_registry_with_prefix("tether_cloud");
        m.copies.register(r);
        m.copies.register_relayed(r);
        r.register(
            "edges_connected",
            "Edges with a live QUIC connection",
            m.edges_connected.clone(),
        );
        r.register(
            "edges_moved",
            "Edges told to move to another replica while this one drained (SIGTERM)",
            m.edges_moved.clone(),
        );
        r.register(
            "sessions",
            "Edge sessions (connected or within their grace period)",
            m.sessions.clone(),
        );
        r.register(
            "streams_open",
            "Open logical streams by kind",
            m.streams_open.clone(),
        );
        r.register(
            "streams",
            "Logical streams opened, by kind",
            m.streams_total.clone(),
        );
        r.register(
            "bytes_to_apiserver",
            "Bytes relayed from edges to the apiserver",
            m.bytes.received.clone(),
        );
        r.register(
            "bytes_to_edge",
            "Bytes relayed from the apiserver to edges",
            m.bytes.sent.clone(),
        );
        r.register(
            "replayed_bytes",
            "Bytes sent again to edges after their streams were re-attached (resume)",
            m.bytes.replayed.clone(),
        );
        r.register(
            "resumes",
            "Sessions resumed with a resume token",
            m.resumes.clone(),
        );
        r.register(
            "migrations",
            "Edge address changes under a live connection",
            m.migrations.clone(),
        );
        r.register(
            "refused_requests",
            "Apiserver requests answered by the cloud itself, by reason",
            m.refused.clone(),
        );
        r.register(
            "edges_refused",
            "Edge connections refused before their handshake, by reason (max_edges, handshake_backlog, waiting_full, replaced_waiting: an older Initial of a waiting source, duplicate_attempt: a waiting Initial of a source with a connection, retry, source_rate, draining)",
            m.edges_refused.clone(),
        );
        r.register(
            "edge_tls_handshakes",
            "Edge TLS handshakes completed, by kind (full: certificates and signatures; resumed: a session ticket)",
            m.edge_handshakes.clone(),
        );
        r.register(
            "stream_open_seconds",
            "Time from the apiserver's request to the kubelet's response head",
            m.stream_open_seconds.clone(),
        );
        r.register(
            "edge_rtt_seconds",
            "QUIC RTT of connected edges, sampled every 10 s",
            m.edge_rtt_seconds.clone(),
        );
        r.register(
            "edge_lost_packets",
            "QUIC packets lost on edge connections",
            m.edge_lost_packets.clone(),
        );
        r.register(
            "peers_up",
            "Peer replicas with a live peer link from this replica",
            m.peers_up.clone(),
        );
        r.register(
            "peers_refused",
            "Peer connections refused, by reason (tls, not_a_peer, bad_hello)",
            m.peers_refused.clone(),
        );
        r.register(
            "claims_refused",
            "Edge claims of a pod (pod report) or address (hello) the apiserver gives to another node, by kind",
            m.claims_refused.clone(),
        );
        r.register(
            "relayed_streams",
            "Streams relayed over the peer link, by role (entry: landed here; holder: edge held here)",
            m.relayed_streams.clone(),
        );
        r.register(
            "relayed_bytes_to_holder",
            "Bytes this replica sent over relays to the replicas holding the edges",
            m.relayed_bytes.sent.clone(),
        );
        r.register(
            "relayed_bytes_from_holder",
            "Bytes this replica received over relays from the replicas holding the edges",
            m.relayed_bytes.received.clone(),
        );
        r.register(
            "relays_refused",
            "Relays refused as holder, by reason (not_here, too_many_streams, ended)",
            m.relays_refused.clone(),
        );
        r.register(
            "route_lookups",
            "Routing decisions, by result (local, relayed, unroutable)",
            m.route_lookups.clone(),
        );
        r.register(
            "stale_routes",
            "Relays the peer answered not-here: the route had gone stale",
            m.stale_routes.clone(),
        );
        r.register(
            "route_waits",
            "Requests that waited for an edge between replicas, by outcome (found, timed_out)",
            m.route_waits.clone(),
        );
        r.register(
            "remote_edges",
            "Edges held by peer replicas, as known here",
            m.remote_edges.clone(),
        );
        m
    }

    /// Counts a relay refused as holder.
    pub fn relay_refused(&self, reason: &'static str) {
        self.relays_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Counts a routing decision.
    pub fn lookup(&self, result: &'static str) {
        self.route_lookups
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Counts a new stream and returns the guard that keeps it in `streams_open`.
    pub fn stream_opened(&self, kind: StreamKind) -> OpenStream {
        let label = KindLabel {
            kind: kind.as_str(),
        };
        self.streams_total.get_or_create(&label).inc();
        let gauge = self.streams_open.get_or_create(&label).clone();
        gauge.inc();
        self.streams_open_any.inc();
        OpenStream(gauge, self.streams_open_any.clone())
    }

    pub fn refuse(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts a refused peer connection.
    pub fn refuse_peer(&self, reason: &'static str) {
        self.peers_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Counts an edge connection refused before its handshake.
    pub fn refuse_edge(&self, reason: &'static str) {
        self.edges_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// What counts the edge listener's completed TLS handshakes, by kind.
    pub fn edge_handshake_counter(&self) -> crate::slim_tls::OnHandshake {
        let family = self.edge_handshakes.clone();
        std::sync::Arc::new(move |resumed| {
            let kind = if resumed { "resumed" } else { "full" };
            family.get_or_create(&KindLabel { kind }).inc();
        })
    }
}

/// Keeps a request that is still being routed in `streams_open_any` (see
/// [`CloudMetrics::request_pending`]).
pub struct Pending(Gauge);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl CloudMetrics {
    /// Counts an apiserver request from its arrival until its handler
    /// returns (by then its stream, if any, is counted): a drain does not
    /// stop under a request that is still waiting for its route.
    pub fn request_pending(&self) -> Pending {
        self.streams_open_any.inc();
        Pending(self.streams_open_any.clone())
    }
}

/// Decrements `streams_open` (and `streams_open_any`) when the stream's relay ends.
pub struct OpenStream(Gauge, Gauge);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.dec();
        self.1.dec();
    }
}
