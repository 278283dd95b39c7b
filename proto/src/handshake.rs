//! The control stream's messages and the protocol version.
//!
//! A connection's life: the edge opens the first bidirectional QUIC stream and
//! sends [`Hello`]; the cloud checks the node name against the edge's
//! certificate and answers [`Welcome`] (or [`Refusal`] and closes). The edge
//! may have several connection attempts in flight; it takes the first welcome
//! and answers it with `Commit` on that connection only, and the cloud attaches
//! the session to a connection only when its commit arrives (an attempt the
//! edge abandoned is never attached). After that
//! the edge sends a [`PodReport`] whenever its kubelet's pod list changes,
//! asks for a renewed certificate (`RenewCert` → `RenewedCert`) when two
//! thirds of its certificate's lifetime have passed, the cloud refreshes the
//! edge's resume [`Ticket`] (`Frame::Ticket`), and either side may send
//! `GoAway`. Logical streams travel on their own QUIC
//! streams (see [`frame`](crate::frame)).

use serde::{Deserialize, Serialize};

use crate::limits::Limits;
use crate::ticket::Ticket;
use crate::token::{ResumeToken, SessionId};

/// The protocol version this build speaks. Version 2: the edge draws its
/// resume token, hellos carry the attempt order, and the edge commits to the
/// connection whose welcome it takes. Version 3: resume tickets any replica
/// verifies, session generations, stream ids unique across owning replicas.
pub const PROTOCOL_VERSION: u16 = 3;

/// ALPN of the tunnel connection between edge and cloud. It names the
/// protocol version, so an edge and a cloud of incompatible versions fail in
/// the TLS handshake with a clear "no application protocol" error.
pub const ALPN_TUNNEL: &[u8] = b"tether/3";

/// QUIC application close codes.
pub mod close_code {
    /// Normal close (shutdown of a stream-free connection).
    pub const NORMAL: u32 = 0;
    /// A newer connection of the same node replaced this one, or this one
    /// was older than the one attached when its commit arrived.
    pub const REPLACED: u32 = 1;
    /// The hello was refused.
    pub const REFUSED: u32 = 2;
    /// The peer is shutting down; reconnect (to another replica).
    pub const SHUTDOWN: u32 = 3;
    /// The peer broke the protocol on the control stream.
    pub const PROTOCOL: u32 = 4;
    /// Cloud → edge: this replica is draining (SIGTERM of a rolling
    /// upgrade). Reconnect at once, without backoff or spread, from a new
    /// UDP source port, so the load balancer (whose connection tracking pins
    /// the old port to this replica) picks another replica.
    pub const MOVE: u32 = 5;
}

/// QUIC stream error codes on an edge's connection (what a replica that only
/// splices a stream for its owner resets the edge's end with).
pub mod stream_code {
    /// The stream's transport broke but its owner lives: the edge keeps the
    /// stream and waits for the owner to re-attach it.
    pub const DETACHED: u32 = 0x10;
    /// The replica that owned the stream is gone (its peer link died): no one
    /// will re-attach it, so the edge ends it at once.
    pub const OWNER_GONE: u32 = 0x11;
}

/// Picks the version both sides speak: the highest of the edge's offers that
/// this build supports.
pub fn negotiate_version(offered: &[u16]) -> Option<u16> {
    offered
        .iter()
        .copied()
        .filter(|v| *v == PROTOCOL_VERSION)
        .max()
}

/// Edge → cloud, first frame on the control stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol versions the edge speaks.
    pub versions: Vec<u16>,
    /// The node name; must equal the name in the edge's certificate.
    pub node: String,
    /// Addresses (IPs or DNS names) by which the apiserver may know this node.
    pub addresses: Vec<String>,
    /// Names the edge's current state (its open streams): drawn by the edge
    /// when it starts and again whenever it discards its streams. Every
    /// attempt of one state carries the same token, so any of them resumes
    /// the session that state belongs to; a new token starts a new session.
    pub resume: ResumeToken,
    /// Random, drawn once per edge process: attempts are ordered only
    /// against attempts of the same process.
    pub instance: u64,
    /// Counts the process's connection attempts (1, 2, …): of two
    /// connections of one process, the higher attempt is the newer, and an
    /// older one never displaces it.
    pub attempt: u64,
    /// The edge's own limits (what it accepts).
    pub limits: Limits,
    /// The last resume ticket the cloud gave this state of the edge (none
    /// for a new state): with it any replica resumes the session.
    pub ticket: Option<Ticket>,
}

/// Cloud → edge, answer to an accepted hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub version: u16,
    /// The session this connection belongs to (new, or the resumed one).
    pub session: SessionId,
    /// True if the hello's token or ticket resumed an existing session (the
    /// edge itself decides by comparing `session` with the one it had).
    pub resumed: bool,
    /// The generation this connection gets when the edge commits to it.
    pub gen: u64,
    /// The ticket to present in the next hello (refreshed by
    /// `Frame::Ticket` while the connection lives).
    pub ticket: Ticket,
    /// How long the cloud keeps a disconnected session's streams, in ms.
    pub grace_ms: u64,
    /// The cloud's limits (what it accepts).
    pub limits: Limits,
}

/// Why a hello was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalCode {
    /// No common protocol version.
    Version,
    /// The hello's node name is not the certificate's.
    NodeMismatch,
    /// The hello broke the protocol or a limit.
    BadHello,
    /// The cloud is shutting down; try another replica.
    Shutdown,
    /// A newer connection of this edge is already attached; this attempt is
    /// obsolete (not an error of the edge: it takes the newer one).
    Superseded,
    /// The hello's resume ticket does not verify (another node's, expired,
    /// or not from this cloud): the edge starts over with a new state.
    Ticket,
}

/// Cloud → edge, answer to a refused hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub code: RefusalCode,
    pub message: String,
}

/// One pod the edge's kubelet runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// Edge → cloud: the complete list of the kubelet's pods.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodReport {
    pub pods: Vec<PodRef>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiates_only_known_versions() {
        assert_eq!(
            negotiate_version(&[PROTOCOL_VERSION, 99]),
            Some(PROTOCOL_VERSION)
        );
        assert_eq!(negotiate_version(&[99]), None);
        assert_eq!(negotiate_version(&[]), None);
    }
}
