//! TLS 1.3 session tickets of the edge listener: stateless, under a key every
//! replica derives from the shared `--reset-key-file`, so an edge that lost
//! its connection resumes its TLS session on any replica, and after any
//! restart, without a signature or a certificate check on either side.
//!
//! A full handshake costs each side an ECDSA signature and two or three
//! verifications (the peer's chain and its `CertificateVerify`); when a
//! fleet dials back after a restart these are most of the new cloud's CPU.
//! A resumed handshake (`psk_dhe_ke`, the only TLS 1.3 resumption rustls
//! serves) still agrees a fresh X25519 key, so the resumed connection's
//! traffic is forward secret as before; what it skips is authentication:
//! the ticket carries the edge's certificate chain, sealed when the full
//! handshake verified it. Hence what is checked again on every connection:
//! the certificate's revocation (`tunnel`, from the join store) and its
//! validity period ([`lapsed`], called by `tunnel`); and, here, the edge CAs:
//! they are bound into the ticket key, so a replica trusting other edge CAs
//! opens none of the tickets sealed before, and no ticket opens once one of
//! them has expired.
//!
//! The ticket: `version (1) ‖ issued, Unix seconds (8) ‖ nonce (12) ‖
//! AES-256-GCM(rustls' session state) with the first two fields as additional
//! data`. A ticket older than the lifetime, or issued more than
//! [`CLOCK_SKEW`] in the future, does not open. Nonces are random: one key
//! seals far fewer than the 2^32 tickets random 96-bit nonces allow.
//!
//! Whoever holds the key can seal a ticket naming any edge certificate of
//! the edge CA, so the reset-key file is as secret as the edge CA's key.
//! Without the file the key is random per process: edges resume only on the
//! replica, and within the run, that issued their ticket.

use std::time::Duration;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use rustls::pki_types::CertificateDer;

/// The longest lifetime a TLS 1.3 ticket may have (RFC 8446, 4.6.1).
pub const MAX_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// How far in the future a ticket's issue time may lie (another replica's
/// clock running ahead).
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);

const VERSION: u8 = 1;
const HEADER: usize = 1 + 8;
const TAG: usize = 16;

/// Seals and opens the edge listener's session tickets (see the module
/// documentation).
pub struct SessionTickets {
    key: LessSafeKey,
    lifetime: Duration,
    /// Unix seconds after which no ticket opens: the earliest end of the
    /// edge CAs' validity.
    cas_valid_until: u64,
    rng: SystemRandom,
}

impl std::fmt::Debug for SessionTickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTickets")
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}

/// Why tickets could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TicketError {
    #[error("the system's random source failed")]
    Random,
    #[error("a session-ticket lifetime of {0:?} is more than TLS 1.3's 7 days")]
    Lifetime(Duration),
    #[error("an edge CA certificate cannot be read: {0}")]
    Ca(String),
}

impl SessionTickets {
    /// Tickets under the key derived from the replicas' shared secret and the
    /// edge CA certificates this replica trusts (in the order of the file).
    pub fn shared(
        secret: &ring::hmac::Key,
        edge_cas: &[CertificateDer<'_>],
        lifetime: Duration,
    ) -> Result<SessionTickets, TicketError> {
        let mut msg = b"tether TLS session-ticket key v1\0".to_vec();
        for ca in edge_cas {
            msg.extend_from_slice(&(ca.len() as u64).to_be_bytes());
            msg.extend_from_slice(ca);
        }
        let tag = ring::hmac::sign(secret, &msg);
        Self::with_key(tag.as_ref(), edge_cas, lifetime)
    }

    /// Tickets under a key of this process only.
    pub fn random(
        edge_cas: &[CertificateDer<'_>],
        lifetime: Duration,
    ) -> Result<SessionTickets, TicketError> {
        let mut k = [0u8; 32];
        SystemRandom::new()
            .fill(&mut k)
            .map_err(|_| TicketError::Random)?;
        Self::with_key(&k, edge_cas, lifetime)
    }

    fn with_key(
        key: &[u8],
        edge_cas: &[CertificateDer<'_>],
        lifetime: Duration,
    ) -> Result<SessionTickets, TicketError> {
        if lifetime > MAX_LIFETIME {
            return Err(TicketError::Lifetime(lifetime));
        }
        let mut cas_valid_until = u64::MAX;
        for ca in edge_cas {
            let (_, cert) = x509_parser::parse_x509_certificate(ca.as_ref())
                .map_err(|e| TicketError::Ca(e.to_string()))?;
            let end = u64::try_from(cert.validity().not_after.timestamp()).unwrap_or(0);
            cas_valid_until = cas_valid_until.min(end);
        }
        // 32 bytes, AES-256-GCM's key length: cannot fail.
        let key = UnboundKey::new(&AES_256_GCM, &key[..32]).map_err(|_| TicketError::Random)?;
        Ok(SessionTickets {
            key: LessSafeKey::new(key),
            lifetime,
            cas_valid_until,
            rng: SystemRandom::new(),
        })
    }

    fn seal_at(&self, plain: &[u8], now: u64) -> Option<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(HEADER + NONCE_LEN + plain.len() + TAG);
        out.push(VERSION);
        out.extend_from_slice(&now.to_be_bytes());
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&out[..HEADER]),
                &mut body,
            )
            .ok()?;
        out.extend_from_slice(&body);
        Some(out)
    }

    fn open_at(&self, ticket: &[u8], now: u64) -> Option<Vec<u8>> {
        if ticket.len() < HEADER + NONCE_LEN + TAG || ticket[0] != VERSION {
            return None;
        }
        let (header, rest) = ticket.split_at(HEADER);
        let issued = u64::from_be_bytes(header[1..].try_into().ok()?);
        if issued > now.saturating_add(CLOCK_SKEW.as_secs())
            || now.saturating_sub(issued) > self.lifetime.as_secs()
            || now > self.cas_valid_until
        {
            return None;
        }
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut body = sealed.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(header), &mut body)
            .ok()?;
        let n = plain.len();
        body.truncate(n);
        Some(body)
    }
}

/// Why `leaf`, the certificate a connection's TLS session names, is not valid
/// at `now` (Unix seconds), if it is not. A full handshake checked this; a
/// resumed one checked it when its ticket was sealed, perhaps days ago.
pub fn lapsed(leaf: &CertificateDer<'_>, now: u64) -> Option<String> {
    let now = i64::try_from(now).unwrap_or(i64::MAX);
    let (_, cert) = match x509_parser::parse_x509_certificate(leaf.as_ref()) {
        Ok(c) => c,
        Err(e) => return Some(format!("unreadable certificate: {e}")),
    };
    let v = cert.validity();
    if now > v.not_after.timestamp() {
        Some(format!("the certificate expired at {}", v.not_after))
    } else if now < v.not_before.timestamp() {
        Some(format!(
            "the certificate is valid only from {}",
            v.not_before
        ))
    } else {
        None
    }
}

/// Unix seconds, as tickets carry them and [`lapsed`] takes them.
pub fn unix_now() -> u64 {
    tether_proto::ticket::unix_ms() / 1000
}

impl rustls::server::ProducesTickets for SessionTickets {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        u32::try_from(self.lifetime.as_secs()).unwrap_or(u32::MAX)
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.seal_at(plain, unix_now())
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.open_at(cipher, unix_now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_certs::mint::Ca;
    use tether_certs::pem::certs_from_pem;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn secret(b: u8) -> ring::hmac::Key {
        ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[b; 32])
    }

    fn der(pem: &str) -> CertificateDer<'static> {
        certs_from_pem(pem, "test").unwrap().remove(0)
    }

    struct Cas {
        a: CertificateDer<'static>,
        b: CertificateDer<'static>,
        /// Unix seconds within both CAs' validity.
        now: u64,
    }

    fn cas() -> Cas {
        let a = Ca::new("edge-ca-a", 30 * DAY).unwrap();
        let b = Ca::new("edge-ca-b", 30 * DAY).unwrap();
        Cas {
            a: der(&a.cert_pem),
            b: der(&b.cert_pem),
            now: unix_now(),
        }
    }

    #[test]
    fn a_ticket_opens_at_every_replica_with_the_same_secret_and_cas() {
        let c = cas();
        let a = SessionTickets::shared(&secret(1), std::slice::from_ref(&c.a), DAY).unwrap();
        let b = SessionTickets::shared(&secret(1), std::slice::from_ref(&c.a), DAY).unwrap();
        let t = a.seal_at(b"session state", c.now).unwrap();
        assert_eq!(t.len(), HEADER + NONCE_LEN + 13 + TAG);
        assert_eq!(b.open_at(&t, c.now).as_deref(), Some(&b"session state"[..]));
        // Two tickets of one state differ (random nonces).
        assert_ne!(a.seal_at(b"session state", c.now).unwrap(), t);
    }

    #[test]
    fn another_secret_or_other_edge_cas_open_nothing() {
        let c = cas();
        let a = SessionTickets::shared(&secret(1), std::slice::from_ref(&c.a), DAY).unwrap();
        let t = a.seal_at(b"state", c.now).unwrap();
        for other in [
            SessionTickets::shared(&secret(2), std::slice::from_ref(&c.a), DAY).unwrap(),
            SessionTickets::shared(&secret(1), std::slice::from_ref(&c.b), DAY).unwrap(),
            SessionTickets::shared(&secret(1), &[c.a.clone(), c.b.clone()], DAY).unwrap(),
            SessionTickets::random(std::slice::from_ref(&c.a), DAY).unwrap(),
        ] {
            assert_eq!(other.open_at(&t, c.now), None);
        }
    }

    #[test]
    fn a_ticket_lives_its_lifetime_and_no_longer() {
        let c = cas();
        let a = SessionTickets::shared(&secret(1), std::slice::from_ref(&c.a), DAY).unwrap();
        let t = a.seal_at(b"state", c.now).unwrap();
        assert!(a.open_at(&t, c.now + DAY.as_secs()).is_some());
        assert_eq!(a.open_at(&t, c.now + 1 + DAY.as_secs()), None);
        // Issued by a replica whose clock runs ahead: within the skew only.
        assert!(a.open_at(&t, c.now - CLOCK_SKEW.as_secs()).is_some());
        assert_eq!(a.open_at(&t, c.now - 1 - CLOCK_SKEW.as_secs()), None);
        assert_eq!(rustls::server::ProducesTickets::lifetime(&a), 86_400);
    }

    #[test]
    fn no_ticket_opens_once_an_edge_ca_expired() {
        let c = cas();
        let short = Ca::new("edge-ca-short", 2 * DAY).unwrap();
        let a = SessionTickets::shared(&secret(1), &[c.a.clone(), der(&short.cert_pem)], 7 * DAY)
            .unwrap();
        let t = a.seal_at(b"state", c.now).unwrap();
        assert!(a.open_at(&t, c.now + DAY.as_secs()).is_some());
        assert_eq!(a.open_at(&t, c.now + 3 * DAY.as_secs()), None);
        let e = SessionTickets::random(&[CertificateDer::from(vec![0x30, 0x03])], DAY).unwrap_err();
        assert!(matches!(e, TicketError::Ca(_)), "{e}");
    }

    #[test]
    fn a_changed_or_cut_ticket_does_not_open() {
        let c = cas();
        let a = SessionTickets::shared(&secret(1), std::slice::from_ref(&c.a), DAY).unwrap();
        let t = a.seal_at(b"state", c.now).unwrap();
        for i in 0..t.len() {
            let mut bad = t.clone();
            bad[i] ^= 0x01;
            assert_eq!(a.open_at(&bad, c.now), None, "byte {i} flipped");
        }
        for n in 0..t.len() {
            assert_eq!(a.open_at(&t[..n], c.now), None, "cut to {n}");
        }
    }

    #[test]
    fn the_lifetime_is_at_most_seven_days() {
        let c = cas();
        assert!(SessionTickets::random(std::slice::from_ref(&c.a), MAX_LIFETIME).is_ok());
        let e = SessionTickets::random(&[c.a], MAX_LIFETIME + Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("7 days"), "{e}");
    }

    #[test]
    fn a_certificate_outside_its_validity_has_lapsed() {
        let ca = Ca::new("edge-ca", 30 * DAY).unwrap();
        let edge = ca.issue_edge("edge-1", DAY).unwrap();
        let leaf = der(&edge.cert_pem);
        let now = unix_now();
        assert_eq!(lapsed(&leaf, now), None);
        let later = now + 2 * DAY.as_secs();
        assert!(lapsed(&leaf, later).unwrap().contains("expired"));
        let before = now - 30 * DAY.as_secs();
        assert!(lapsed(&leaf, before).unwrap().contains("valid only from"));
        assert!(lapsed(&CertificateDer::from(vec![1, 2, 3]), now)
            .unwrap()
            .contains("unreadable"));
    }
}
