//! The edge's Prometheus metrics, registered in one place.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::{Gauge, Gauge as FloatGauge};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use tether_proto::copies::CopyCounters;
use tether_proto::ops::ByteCounters;

/// Every metric of `tether-edge`.
#[derive(Clone, Default)]
pub struct EdgeMetrics {
    pub connected: Gauge,
    pub connects: Counter,
    pub resumes: Counter,
    pub sessions_lost: Counter,
    pub streams_open: Gauge,
    pub streams_total: Counter,
    pub migrations: Counter,
    /// Drain requests (`MOVE` closes) from a cloud replica, obeyed.
    pub moves_obeyed: Counter,
    /// Connections ended by a stateless reset (their replica was gone).
    pub resets_seen: Counter,
    /// Reconnect rounds dialled from a new UDP source port.
    pub source_ports: Counter,
    /// 1 while the cloud has not answered for `--reconnect-patient-after`
    /// and the edge probes it at the patient interval.
    pub reconnect_patient: Gauge,
    pub rtt_seconds: FloatGauge<f64, AtomicU64>,
    /// The adaptive keep-alive's current interval.
    pub keepalive_seconds: FloatGauge<f64, AtomicU64>,
    /// 1 once the keep-alive settled (below the NAT's binding or at a bound).
    pub keepalive_settled: Gauge,
    /// NAT rebindings the cloud reported (path challenges after a keep-alive).
    pub nat_rebindings: Counter,
    pub bytes: ByteCounters,
    /// Datagram copies of interactive writes, both ways.
    pub copies: CopyCounters,
}

impl EdgeMetrics {
    pub fn register(registry: &mut Registry) -> EdgeMetrics {
        let m = EdgeMetrics::default();
        let r = registry.sub_registry_with_prefix("tether_edge");
        m.copies.register(r);
        r.register(
            "connected",
            "1 while connected to the cloud",
            m.connected.clone(),
        );
        r.register(
            "connects",
            "Connections established to the cloud (first and reconnects)",
            m.connects.clone(),
        );
        r.register(
            "resumes",
            "Reconnections that resumed the session",
            m.resumes.clone(),
        );
        r.register(
            "sessions_lost",
            "Sessions whose streams ended because they could not be resumed",
            m.sessions_lost.clone(),
        );
        r.register(
            "streams_open",
            "Open logical streams",
            m.streams_open.clone(),
        );
        r.register(
            "streams",
            "Logical streams started",
            m.streams_total.clone(),
        );
        r.register(
            "migrations",
            "Socket rebinds after local address changes",
            m.migrations.clone(),
        );
        r.register(
            "moves_obeyed",
            "Reconnections because a draining cloud replica told this edge to move",
            m.moves_obeyed.clone(),
        );
        r.register(
            "resets_seen",
            "Connections ended by a stateless reset (the replica holding them was gone)",
            m.resets_seen.clone(),
        );
        r.register(
            "source_port_changes",
            "Reconnect rounds dialled from a new UDP source port",
            m.source_ports.clone(),
        );
        r.register(
            "reconnect_patient",
            "1 while the cloud has not answered for --reconnect-patient-after and the edge probes it one attempt at a time every --reconnect-patient-interval",
            m.reconnect_patient.clone(),
        );
        r.register(
            "rtt_seconds",
            "QUIC RTT to the cloud",
            m.rtt_seconds.clone(),
        );
        r.register(
            "keepalive_seconds",
            "Current interval of the adaptive keep-alive",
            m.keepalive_seconds.clone(),
        );
        r.register(
            "keepalive_settled",
            "1 once the adaptive keep-alive has settled below the NAT's binding timeout (or at a bound)",
            m.keepalive_settled.clone(),
        );
        r.register(
            "nat_rebindings",
            "NAT rebindings after a keep-alive (the cloud saw a new address): failed probes of the adaptive keep-alive",
            m.nat_rebindings.clone(),
        );
        r.register(
            "bytes_to_cloud",
            "Bytes sent to the cloud through streams",
            m.bytes.sent.clone(),
        );
        r.register(
            "bytes_to_kubelet",
            "Bytes received from the cloud through streams",
            m.bytes.received.clone(),
        );
        r.register(
            "replayed_bytes",
            "Bytes sent again to the cloud after streams were re-attached (resume)",
            m.bytes.replayed.clone(),
        );
        m
    }
}
