//! Resume tickets: what lets an edge resume its session on *any* cloud replica.
//!
//! The replica that attaches an edge's connection issues a [`Ticket`] in the
//! welcome and refreshes it on the control stream while the connection lives
//! (`Frame::Ticket`). It names the node, the session, the session's
//! *generation* (which grows with every connection attached, on whichever
//! replica) and an expiry (the grace period after the last refresh), and is
//! authenticated with HMAC-SHA256 under a key every replica shares
//! ([`TicketKey`], derived from the replicas' shared secret). The MAC also
//! covers the edge's own resume token ([`ResumeToken`]), so a ticket is only
//! good together with the edge state it was issued to.
//!
//! Verification ([`TicketKey::verify`]) is pure: the caller supplies the node
//! named in the connection's certificate and the time. Whether the ticket's
//! generation is still the newest is the registry's business.

use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::token::{ResumeToken, SessionId};

/// A resume ticket (see the module docs). Carries no secret itself: its MAC
/// proves a replica issued it for this node, session, generation and edge state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ticket {
    pub node: String,
    pub session: SessionId,
    /// The generation of the connection the ticket was issued on.
    pub gen: u64,
    /// Unix time in ms after which no replica accepts it.
    pub expires_ms: u64,
    pub mac: [u8; 32],
}

/// Why a ticket was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    #[error("the ticket was issued to node {issued:?}, not to {presented:?}")]
    WrongNode { issued: String, presented: String },
    #[error("the ticket expired {ago_ms} ms ago")]
    Expired { ago_ms: u64 },
    #[error(
        "the ticket's MAC does not verify (another cloud's key, another edge state, or forged)"
    )]
    BadMac,
}

/// The key replicas sign and check tickets with.
pub struct TicketKey(hmac::Key);

impl TicketKey {
    /// Derives the ticket key from the replicas' shared secret (a key used
    /// for nothing else directly: the derivation separates the purposes).
    pub fn derive(shared: &hmac::Key) -> TicketKey {
        let tag = hmac::sign(shared, b"tether resume-ticket key v1");
        TicketKey(hmac::Key::new(hmac::HMAC_SHA256, tag.as_ref()))
    }

    /// A key of this process only (no shared secret configured): tickets
    /// then resume sessions on the issuing replica only.
    pub fn random() -> Result<TicketKey, rand::rand_core::OsError> {
        use rand::TryRngCore;
        let mut b = [0u8; 32];
        rand::rngs::OsRng.try_fill_bytes(&mut b)?;
        Ok(TicketKey(hmac::Key::new(hmac::HMAC_SHA256, &b)))
    }

    /// The bytes the MAC covers (length-prefixed node, so no two field
    /// combinations encode alike).
    fn message(
        node: &str,
        session: SessionId,
        gen: u64,
        expires_ms: u64,
        state: &ResumeToken,
    ) -> Vec<u8> {
        let mut m = Vec::with_capacity(64 + node.len());
        m.extend_from_slice(b"tether ticket v1\0");
        m.extend_from_slice(&(node.len() as u64).to_be_bytes());
        m.extend_from_slice(node.as_bytes());
        m.extend_from_slice(&session.0.to_be_bytes());
        m.extend_from_slice(&gen.to_be_bytes());
        m.extend_from_slice(&expires_ms.to_be_bytes());
        m.extend_from_slice(&state.0);
        m
    }

    fn mac(
        &self,
        node: &str,
        session: SessionId,
        gen: u64,
        expires_ms: u64,
        state: &ResumeToken,
    ) -> [u8; 32] {
        let tag = hmac::sign(
            &self.0,
            &Self::message(node, session, gen, expires_ms, state),
        );
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Issues a ticket for `node`'s session at generation `gen`, bound to the
    /// edge state `state`, valid until `expires_ms`.
    pub fn issue(
        &self,
        node: &str,
        session: SessionId,
        gen: u64,
        expires_ms: u64,
        state: &ResumeToken,
    ) -> Ticket {
        Ticket {
            node: node.to_string(),
            session,
            gen,
            expires_ms,
            mac: self.mac(node, session, gen, expires_ms, state),
        }
    }

    /// Checks a ticket presented on a connection authenticated as `node`
    /// with the edge state `state`, at `now_ms`.
    pub fn verify(
        &self,
        t: &Ticket,
        node: &str,
        state: &ResumeToken,
        now_ms: u64,
    ) -> Result<(), TicketError> {
        if t.node != node {
            return Err(TicketError::WrongNode {
                issued: t.node.clone(),
                presented: node.to_string(),
            });
        }
        // ring compares in constant time: a forger learns nothing from timing.
        let msg = Self::message(&t.node, t.session, t.gen, t.expires_ms, state);
        if hmac::verify(&self.0, &msg, &t.mac).is_err() {
            return Err(TicketError::BadMac);
        }
        if now_ms > t.expires_ms {
            return Err(TicketError::Expired {
                ago_ms: now_ms - t.expires_ms,
            });
        }
        Ok(())
    }
}

/// Now, as Unix time in ms (0 if the clock is before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The generation of a connection attached now that follows `previous`
/// (0: none): it only grows along one session, and across sessions and
/// replicas it follows the wall clock (ms), so a session started later
/// outranks an older one on every replica.
pub fn next_generation(previous: u64, now_ms: u64) -> u64 {
    previous.saturating_add(1).max(now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> TicketKey {
        TicketKey::derive(&hmac::Key::new(hmac::HMAC_SHA256, &[b; 32]))
    }

    #[test]
    fn a_ticket_verifies_on_any_replica_with_the_shared_key_only() {
        let state = ResumeToken([7; 16]);
        let t = key(1).issue("edge-1", SessionId(9), 5, 1_000, &state);
        // Another replica, same shared secret.
        assert_eq!(key(1).verify(&t, "edge-1", &state, 999), Ok(()));
        assert_eq!(
            key(2).verify(&t, "edge-1", &state, 999),
            Err(TicketError::BadMac)
        );
        assert!(matches!(
            key(1).verify(&t, "edge-2", &state, 999),
            Err(TicketError::WrongNode { .. })
        ));
        assert_eq!(
            key(1).verify(&t, "edge-1", &state, 1_500),
            Err(TicketError::Expired { ago_ms: 500 })
        );
        // Bound to the edge state it was issued to.
        assert_eq!(
            key(1).verify(&t, "edge-1", &ResumeToken([8; 16]), 999),
            Err(TicketError::BadMac)
        );
    }

    #[test]
    fn every_field_is_covered_by_the_mac() {
        let state = ResumeToken([7; 16]);
        let k = key(1);
        let t = k.issue("edge-1", SessionId(9), 5, 1_000, &state);
        let mut a = t.clone();
        a.gen = 6;
        let mut b = t.clone();
        b.session = SessionId(10);
        let mut c = t.clone();
        c.expires_ms = 10_000;
        let mut d = t.clone();
        d.mac[0] ^= 1;
        for bad in [a, b, c, d] {
            assert_eq!(
                k.verify(&bad, "edge-1", &state, 0),
                Err(TicketError::BadMac)
            );
        }
    }

    #[test]
    fn generations_only_grow() {
        assert_eq!(next_generation(0, 1_000), 1_000);
        assert_eq!(next_generation(5_000, 1_000), 5_001);
        assert_eq!(next_generation(u64::MAX, 0), u64::MAX);
    }
}
