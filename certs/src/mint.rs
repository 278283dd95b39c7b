//! Minting a CA and the certificates Tether uses, with rcgen.
//!
//! Kinds (keys ECDSA P-256; the CA may also be Ed25519):
//! - the **CA** that signs everything below;
//! - the cloud's **server** certificates (QUIC listener, kubelet-API front):
//!   DNS names and IPs as SANs, server-auth EKU;
//! - an **edge** certificate: CN `system:node:<name>`, O `system:nodes`, SAN
//!   DNS `<name>`, client-auth EKU — the node identity the cloud trusts;
//! - an **apiserver client** certificate (client-auth EKU) for tests and the
//!   demo, like the kube-apiserver's `--kubelet-client-certificate`;
//! - a **peer** certificate that cloud replicas present to each other on the
//!   peer link: CN [`PEER_COMMON_NAME`], O [`PEER_ORGANIZATION`], SAN DNS
//!   [`PEER_SERVER_NAME`], server- and client-auth EKU. Sign it with a CA of
//!   its own (the peer CA); the cloud also checks the name explicitly, so an
//!   edge or apiserver certificate can never pass for a peer even when an
//!   operator reuses one CA.

use std::net::IpAddr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256, PKCS_ED25519,
};
use time::OffsetDateTime;

use crate::CertError;

/// The common name of every peer certificate.
pub const PEER_COMMON_NAME: &str = "tether-peer";
/// The organisation of every peer certificate (no Kubernetes group uses it).
pub const PEER_ORGANIZATION: &str = "tether:peers";
/// The DNS name in a peer certificate; replicas dial each other with it as
/// the TLS server name, whatever address they reach the peer at.
pub const PEER_SERVER_NAME: &str = "tether-peer";

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct CertKey {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The key algorithm of a CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyAlgorithm {
    /// ECDSA on NIST P-256 with SHA-256: what every TLS stack accepts.
    #[default]
    EcdsaP256,
    /// Ed25519: smaller and faster; accepted by rustls and recent OpenSSL.
    Ed25519,
}

impl KeyAlgorithm {
    fn rcgen(self) -> &'static rcgen::SignatureAlgorithm {
        match self {
            KeyAlgorithm::EcdsaP256 => &PKCS_ECDSA_P256_SHA256,
            KeyAlgorithm::Ed25519 => &PKCS_ED25519,
        }
    }
}

/// A random, positive 128-bit serial number. rcgen would otherwise derive the
/// serial from the public key, so a renewed certificate with the same key
/// would repeat its predecessor's serial.
pub(crate) fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from_slice(&bytes)
}

/// Sets `not_before` (five minutes back, for clock skew) and `not_after`.
pub(crate) fn set_validity(
    p: &mut CertificateParams,
    valid_for: Duration,
) -> Result<(), CertError> {
    validity(p, valid_for)
}

/// A certificate authority that can sign.
pub struct Ca {
    pub cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// How far before its issue a certificate's notBefore is set (clock skew).
pub const NOT_BEFORE_BACKDATE: Duration = Duration::from_secs(300);

/// The longest validity a certificate is given, in years of 365 days: far
/// beyond any CA's sensible life, and well inside what X.509's dates (to the
/// year 9999) can say.
pub const MAX_VALIDITY_YEARS: u64 = 1000;

/// [`MAX_VALIDITY_YEARS`] as a duration.
pub const MAX_VALIDITY: Duration = Duration::from_secs(MAX_VALIDITY_YEARS * 365 * 86_400);

/// Sets the validity: from [`NOT_BEFORE_BACKDATE`] ago for `valid_for`;
/// longer than [`MAX_VALIDITY`] is refused.
fn validity(p: &mut CertificateParams, valid_for: Duration) -> Result<(), CertError> {
    if valid_for > MAX_VALIDITY {
        return Err(CertError::ValidityTooLong(valid_for));
    }
    let now = OffsetDateTime::now_utc();
    // Both within MAX_VALIDITY: the conversions and sums cannot overflow.
    p.not_before = now - NOT_BEFORE_BACKDATE;
    p.not_after = now + valid_for;
    Ok(())
}

impl Ca {
    /// A new self-signed CA.
    pub fn new(common_name: &str, valid_for: Duration) -> Result<Ca, CertError> {
        Ca::new_with(common_name, valid_for, KeyAlgorithm::EcdsaP256)
    }

    /// A new self-signed CA with a key of the given algorithm.
    pub fn new_with(
        common_name: &str,
        valid_for: Duration,
        algorithm: KeyAlgorithm,
    ) -> Result<Ca, CertError> {
        let key = KeyPair::generate_for(algorithm.rcgen())?;
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        dn.push(DnType::OrganizationName, "Tether");
        p.distinguished_name = dn;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity(&mut p, valid_for)?;
        p.serial_number = Some(random_serial());
        let cert = p.self_signed(&key)?;
        Ok(Ca {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(p, key),
        })
    }

    /// A CA from its PEM certificate and key.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, CertError> {
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Ca {
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            issuer,
        })
    }

    /// The CA's private key, PEM.
    pub fn key_pem(&self) -> String {
        self.key_pem.clone()
    }

    /// The rcgen issuer, for signing CSRs.
    pub(crate) fn issuer(&self) -> &Issuer<'static, KeyPair> {
        &self.issuer
    }

    fn sign(&self, mut p: CertificateParams, valid_for: Duration) -> Result<CertKey, CertError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        validity(&mut p, valid_for)?;
        p.serial_number = Some(random_serial());
        p.use_authority_key_identifier_extension = true;
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok(CertKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A server certificate for the given DNS names and IP addresses.
    pub fn issue_server(
        &self,
        dns: &[&str],
        ips: &[IpAddr],
        valid_for: Duration,
    ) -> Result<CertKey, CertError> {
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            dns.first().copied().unwrap_or("tether-cloud"),
        );
        p.distinguished_name = dn;
        for d in dns {
            p.subject_alt_names.push(SanType::DnsName((*d).try_into()?));
        }
        for ip in ips {
            p.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(p, valid_for)
    }

    /// An edge certificate naming `node`.
    pub fn issue_edge(&self, node: &str, valid_for: Duration) -> Result<CertKey, CertError> {
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("system:node:{node}"));
        dn.push(DnType::OrganizationName, "system:nodes");
        p.distinguished_name = dn;
        p.subject_alt_names.push(SanType::DnsName(node.try_into()?));
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(p, valid_for)
    }

    /// A peer certificate for cloud replicas (see the module doc). All
    /// replicas may share one (a Kubernetes Secret).
    pub fn issue_peer(&self, valid_for: Duration) -> Result<CertKey, CertError> {
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, PEER_COMMON_NAME);
        dn.push(DnType::OrganizationName, PEER_ORGANIZATION);
        p.distinguished_name = dn;
        p.subject_alt_names
            .push(SanType::DnsName(PEER_SERVER_NAME.try_into()?));
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(p, valid_for)
    }

    /// A client certificate (e.g. the apiserver's kubelet-client certificate).
    pub fn issue_client(
        &self,
        common_name: &str,
        orgs: &[&str],
        valid_for: Duration,
    ) -> Result<CertKey, CertError> {
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        for o in orgs {
            dn.push(DnType::OrganizationName, *o);
        }
        p.distinguished_name = dn;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(p, valid_for)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_validity_beyond_the_bound_is_an_error_not_a_panic() {
        for long in [Duration::MAX, MAX_VALIDITY + Duration::from_secs(1)] {
            assert!(
                matches!(Ca::new("ca", long), Err(CertError::ValidityTooLong(_))),
                "{long:?}"
            );
        }
        let ca = Ca::new("ca", MAX_VALIDITY).unwrap();
        assert!(matches!(
            ca.issue_edge("edge-1", Duration::MAX),
            Err(CertError::ValidityTooLong(_))
        ));
        ca.issue_edge("edge-1", MAX_VALIDITY).unwrap();
    }

    #[test]
    fn edge_certificate_names_its_node() {
        let ca = Ca::new("test ca", Duration::from_secs(3600)).unwrap();
        let edge = ca.issue_edge("edge-1", Duration::from_secs(3600)).unwrap();
        let der = crate::pem::certs_from_pem(&edge.cert_pem, "edge").unwrap();
        assert_eq!(crate::node_name_from_cert(&der[0]).unwrap(), "edge-1");
        let again = Ca::from_pem(&ca.cert_pem, &ca.key_pem()).unwrap();
        again
            .issue_server(
                &["localhost"],
                &["127.0.0.1".parse().unwrap()],
                Duration::from_secs(60),
            )
            .unwrap();
    }

    #[test]
    fn only_a_peer_certificate_is_a_peer() {
        let ca = Ca::new("peer ca", Duration::from_secs(3600)).unwrap();
        let der = |ck: CertKey| crate::pem::certs_from_pem(&ck.cert_pem, "x").unwrap()[0].clone();
        let peer = der(ca.issue_peer(Duration::from_secs(60)).unwrap());
        crate::identity::check_peer_cert(&peer).unwrap();
        let edge = der(ca.issue_edge("edge-1", Duration::from_secs(60)).unwrap());
        assert!(crate::identity::check_peer_cert(&edge).is_err());
        let api = der(ca
            .issue_client(
                "kube-apiserver-kubelet-client",
                &["system:masters"],
                Duration::from_secs(60),
            )
            .unwrap());
        assert!(crate::identity::check_peer_cert(&api).is_err());
        // A client certificate that copies the CN but not the organisation.
        let fake = der(ca
            .issue_client(PEER_COMMON_NAME, &[], Duration::from_secs(60))
            .unwrap());
        assert!(crate::identity::check_peer_cert(&fake).is_err());
        // An edge cannot be named like a peer: its CN is system:node:<name>.
        let node = der(ca
            .issue_edge("tether-peer", Duration::from_secs(60))
            .unwrap());
        assert!(crate::identity::check_peer_cert(&node).is_err());
    }
}
