//! Minting a CA and the certificates Tether uses, with rcgen.
//!
//! Kinds (all ECDSA P-256):
//! - the **CA** that signs everything below;
//! - the cloud's **server** certificates (QUIC listener, kubelet-API front):
//!   DNS names and IPs as SANs, server-auth EKU;
//! - an **edge** certificate: CN `system:node:<name>`, O `system:nodes`, SAN
//!   DNS `<name>`, client-auth EKU — the node identity the cloud trusts;
//! - an **apiserver client** certificate (client-auth EKU) for tests and the
//!   demo, like the kube-apiserver's `--kubelet-client-certificate`.

use std::net::IpAddr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, PKCS_ECDSA_P256_SHA256,
};
use time::OffsetDateTime;

use crate::CertError;

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct CertKey {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A certificate authority that can sign.
pub struct Ca {
    pub cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn validity(p: &mut CertificateParams, valid_for: Duration) {
    let now = OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::minutes(5);
    p.not_after = now + time::Duration::seconds(valid_for.as_secs() as i64);
}

impl Ca {
    /// A new self-signed CA.
    pub fn new(common_name: &str, valid_for: Duration) -> Result<Ca, CertError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
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
        validity(&mut p, valid_for);
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

    fn sign(&self, mut p: CertificateParams, valid_for: Duration) -> Result<CertKey, CertError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        validity(&mut p, valid_for);
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
}
