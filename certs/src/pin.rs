//! Pinning the CA by the hash of its public key, and the TLS verifier that
//! lets a new edge trust the cloud on the strength of that pin alone.
//!
//! A pin is `sha256:<hex>` of the DER SubjectPublicKeyInfo of the CA
//! certificate — the same form `kubeadm join --discovery-token-ca-cert-hash`
//! uses, so `openssl x509 -pubkey | openssl pkey -pubin -outform der |
//! sha256sum` computes it too. It names the key, not the certificate: a CA
//! re-issued with the same key keeps its pin.
//!
//! [`PinnedCaVerifier`] is a rustls [`ServerCertVerifier`] for the join
//! connection. A joining edge has no CA file yet, so the cloud sends its CA
//! certificate in its TLS chain (the CLI writes the tunnel certificate as
//! leaf + CA). The verifier looks for a certificate in the presented chain
//! whose public key hashes to the pin, then verifies the leaf against that
//! certificate as the only trust anchor with webpki (signature, validity,
//! server-auth EKU, the name dialled). The pin authenticates the CA; the CA
//! authenticates the leaf; the TLS handshake proves the cloud holds the
//! leaf's key. If any step fails the handshake fails, so the edge never sends
//! its token to a cloud that does not match the pin.

use std::fmt;
use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};
use x509_parser::prelude::*;

use crate::CertError;

/// The prefix of every pin.
pub const PIN_PREFIX: &str = "sha256:";

/// SHA-256 of a certificate's DER SubjectPublicKeyInfo.
pub fn spki_sha256(der: &[u8]) -> Result<[u8; 32], CertError> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| CertError::Parse(e.to_string()))?;
    Ok(Sha256::digest(cert.tbs_certificate.subject_pki.raw).into())
}

/// The pin (`sha256:<hex>`) of the first certificate in a PEM text.
pub fn ca_pin(ca_cert_pem: &str) -> Result<String, CertError> {
    let certs = crate::pem::certs_from_pem(ca_cert_pem, "CA certificate")?;
    Ok(format!(
        "{PIN_PREFIX}{}",
        hex::encode(spki_sha256(certs[0].as_ref())?)
    ))
}

/// A parsed CA pin.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CaPin([u8; 32]);

impl CaPin {
    /// Parses `sha256:<64 hex digits>` (hex in either case).
    pub fn parse(s: &str) -> Result<CaPin, CertError> {
        let bad = |what: &str| CertError::Content {
            path: "CA pin".into(),
            what: format!(
                "{what}; expected sha256:<64 hex digits> as printed by `tether-certs token create`"
            ),
        };
        let hex_part = s
            .trim()
            .strip_prefix(PIN_PREFIX)
            .ok_or_else(|| bad("does not start with sha256:"))?;
        let bytes = hex::decode(hex_part).map_err(|_| bad("is not hexadecimal"))?;
        let arr: [u8; 32] = bytes.try_into().map_err(|_| bad("is not 32 bytes long"))?;
        Ok(CaPin(arr))
    }

    /// Whether a certificate's public key matches this pin.
    pub fn matches(&self, cert_der: &[u8]) -> bool {
        spki_sha256(cert_der).is_ok_and(|h| h == self.0)
    }
}

impl fmt::Display for CaPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PIN_PREFIX}{}", hex::encode(self.0))
    }
}

impl fmt::Debug for CaPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Trusts a server whose chain contains the pinned CA and whose leaf that CA
/// signed. Remembers the CA it matched, so the caller can save exactly the
/// certificate it verified against.
pub struct PinnedCaVerifier {
    pin: CaPin,
    provider: Arc<CryptoProvider>,
    matched: Mutex<Option<CertificateDer<'static>>>,
}

impl fmt::Debug for PinnedCaVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedCaVerifier")
            .field("pin", &self.pin)
            .finish()
    }
}

impl PinnedCaVerifier {
    /// A verifier for `pin`, verifying signatures with `provider`.
    pub fn new(pin: CaPin, provider: Arc<CryptoProvider>) -> PinnedCaVerifier {
        PinnedCaVerifier {
            pin,
            provider,
            matched: Mutex::new(None),
        }
    }

    /// The CA certificate that matched the pin in the last successful
    /// verification.
    pub fn matched_ca(&self) -> Option<CertificateDer<'static>> {
        self.matched.lock().ok().and_then(|m| m.clone())
    }
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(ca) = intermediates.iter().find(|c| self.pin.matches(c.as_ref())) else {
            return Err(rustls::Error::General(format!(
                "the cloud's certificate chain holds no CA matching {} \
                 (wrong --ca-pin, wrong cloud, or the cloud's tunnel certificate file lacks its CA)",
                self.pin
            )));
        };
        let ca = ca.clone().into_owned();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(ca.clone())
            .map_err(|e| rustls::Error::General(format!("pinned CA is not usable: {e}")))?;
        let inner =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(format!("pinned CA verifier: {e}")))?;
        let verified =
            inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        if let Ok(mut m) = self.matched.lock() {
            *m = Some(ca);
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mint::Ca;
    use std::time::Duration;

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn der(pem: &str) -> CertificateDer<'static> {
        crate::pem::certs_from_pem(pem, "t").unwrap().remove(0)
    }

    #[test]
    fn pin_round_trips_and_names_the_key() {
        let ca = Ca::new("pin ca", Duration::from_secs(3600)).unwrap();
        let pin = ca_pin(&ca.cert_pem).unwrap();
        assert!(pin.starts_with("sha256:") && pin.len() == 7 + 64);
        let parsed = CaPin::parse(&pin).unwrap();
        assert_eq!(parsed.to_string(), pin);
        assert!(parsed.matches(der(&ca.cert_pem).as_ref()));
        let other = Ca::new("other", Duration::from_secs(3600)).unwrap();
        assert!(!parsed.matches(der(&other.cert_pem).as_ref()));
        assert!(CaPin::parse("sha1:00").is_err());
        assert!(CaPin::parse("sha256:zz").is_err());
        assert!(CaPin::parse("sha256:abcd").is_err());
    }

    #[test]
    fn verifier_needs_the_pinned_ca_in_the_chain_and_a_leaf_it_signed() {
        let ca = Ca::new("pin ca", Duration::from_secs(3600)).unwrap();
        let other = Ca::new("other", Duration::from_secs(3600)).unwrap();
        let leaf = ca
            .issue_server(&["cloud.example"], &[], Duration::from_secs(3600))
            .unwrap();
        let forged = other
            .issue_server(&["cloud.example"], &[], Duration::from_secs(3600))
            .unwrap();
        let v = PinnedCaVerifier::new(
            CaPin::parse(&ca_pin(&ca.cert_pem).unwrap()).unwrap(),
            provider(),
        );
        let name = ServerName::try_from("cloud.example").unwrap();
        let now = UnixTime::now();

        // Leaf + pinned CA: accepted, and the CA is remembered.
        v.verify_server_cert(&der(&leaf.cert_pem), &[der(&ca.cert_pem)], &name, &[], now)
            .unwrap();
        assert_eq!(v.matched_ca().unwrap(), der(&ca.cert_pem));
        // No CA in the chain: refused.
        assert!(v
            .verify_server_cert(&der(&leaf.cert_pem), &[], &name, &[], now)
            .is_err());
        // Another CA's leaf and that CA: the pin does not match.
        assert!(v
            .verify_server_cert(
                &der(&forged.cert_pem),
                &[der(&other.cert_pem)],
                &name,
                &[],
                now
            )
            .is_err());
        // Another CA's leaf presented with the pinned CA: the leaf does not chain.
        assert!(v
            .verify_server_cert(
                &der(&forged.cert_pem),
                &[der(&ca.cert_pem)],
                &name,
                &[],
                now
            )
            .is_err());
        // The right chain for another name: refused.
        let wrong_name = ServerName::try_from("elsewhere.example").unwrap();
        assert!(v
            .verify_server_cert(
                &der(&leaf.cert_pem),
                &[der(&ca.cert_pem)],
                &wrong_name,
                &[],
                now
            )
            .is_err());
        // A client-auth certificate from the pinned CA is not a server.
        let edge = ca
            .issue_edge("cloud.example", Duration::from_secs(3600))
            .unwrap();
        assert!(v
            .verify_server_cert(&der(&edge.cert_pem), &[der(&ca.cert_pem)], &name, &[], now)
            .is_err());
    }
}
