//! Certificate signing requests for edge bootstrap: the edge's side (make a
//! key and a CSR naming the node) and the cloud's signing policy.
//!
//! The policy ([`sign_edge_csr`]) trusts nothing in the CSR except its
//! public key, and even that only after checking it:
//! - the key must be ECDSA P-256, ECDSA P-384 or Ed25519 — RSA (of any
//!   size), other curves and other algorithms are refused, since the tunnel
//!   runs TLS 1.3 with ring and the fleet should not carry weak keys;
//! - the CSR's signature must verify (the requester holds the key);
//! - the subject may only hold CN `system:node:<node>` (or `<node>`) and O
//!   `system:nodes`; SANs may only be DNS `<node>`; a CSR naming another node,
//!   carrying any other SAN, asking to be a CA or carrying an unknown
//!   extension is refused rather than silently trimmed, so a confused or
//!   malicious edge learns exactly why.
//!
//! The certificate is then built from scratch: CN `system:node:<node>`, O
//! `system:nodes`, SAN DNS `<node>`, digital-signature key usage, client-auth
//! EKU, a random serial and a validity the cloud chooses.

use std::time::Duration;

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose, SanType, PKCS_ECDSA_P256_SHA256,
    PKCS_ECDSA_P384_SHA384, PKCS_ED25519,
};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::oid_registry::{
    Oid, OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_PKCS1_RSAENCRYPTION,
    OID_SIG_ED25519, OID_X509_COMMON_NAME, OID_X509_ORGANIZATION_NAME,
};
use x509_parser::prelude::FromDer;

use crate::identity::valid_node_name;
use crate::join::JoinError;
use crate::mint::{random_serial, set_validity, Ca};
use crate::token::IssuedCert;

/// The organisation every edge certificate carries.
pub const NODES_ORG: &str = "system:nodes";

/// An edge's new private key and the CSR for it, both PEM, and the public
/// key's bits (to recognise the certificate that answers this request, see
/// [`crate::identity::certifies_key`]).
pub struct EdgeRequest {
    pub key_pem: String,
    pub csr_pem: String,
    pub public_key: Vec<u8>,
}

/// Makes a P-256 key and a CSR naming `node`, on the edge. The key stays
/// with the caller; only the CSR is sent.
pub fn make_edge_csr(node: &str) -> Result<EdgeRequest, JoinError> {
    if !valid_node_name(node) {
        return Err(JoinError::InvalidNodeName(node.to_string()));
    }
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(JoinError::Sign)?;
    let mut p = CertificateParams::default();
    p.distinguished_name = edge_subject(node);
    p.subject_alt_names = vec![SanType::DnsName(node.try_into().map_err(JoinError::Sign)?)];
    let csr = p.serialize_request(&key).map_err(JoinError::Sign)?;
    Ok(EdgeRequest {
        key_pem: key.serialize_pem(),
        csr_pem: csr.pem().map_err(JoinError::Sign)?,
        public_key: key.public_key_raw().to_vec(),
    })
}

fn edge_subject(node: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("system:node:{node}"));
    dn.push(DnType::OrganizationName, NODES_ORG);
    dn
}

/// The accepted key kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyKind {
    P256,
    P384,
    Ed25519,
}

fn csr_err(what: impl Into<String>) -> JoinError {
    JoinError::Csr(what.into())
}

fn check_key(csr: &X509CertificationRequest<'_>) -> Result<KeyKind, JoinError> {
    let spki = &csr.certification_request_info.subject_pki;
    let alg = &spki.algorithm.algorithm;
    let key_len = spki.subject_public_key.data.len();
    if *alg == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve: Option<Oid> = spki
            .algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok());
        return match curve {
            Some(c) if c == OID_EC_P256 && key_len == 65 => Ok(KeyKind::P256),
            Some(c) if c == OID_NIST_EC_P384 && key_len == 97 => Ok(KeyKind::P384),
            Some(c) if c == OID_EC_P256 || c == OID_NIST_EC_P384 => Err(JoinError::WeakKey(
                "the EC public key is not an uncompressed point of its curve".into(),
            )),
            Some(c) => Err(JoinError::WeakKey(format!(
                "EC curve {c} is not accepted; use P-256, P-384 or Ed25519"
            ))),
            None => Err(JoinError::WeakKey(
                "EC key without a named curve is not accepted".into(),
            )),
        };
    }
    if *alg == OID_SIG_ED25519 {
        return if key_len == 32 {
            Ok(KeyKind::Ed25519)
        } else {
            Err(JoinError::WeakKey("Ed25519 key is not 32 bytes".into()))
        };
    }
    if *alg == OID_PKCS1_RSAENCRYPTION {
        let bits = spki.parsed().map(|k| k.key_size()).unwrap_or(0);
        return Err(JoinError::WeakKey(format!(
            "RSA keys are not accepted (this one has {bits} bits); use ECDSA P-256, P-384 or Ed25519"
        )));
    }
    Err(JoinError::WeakKey(format!(
        "key algorithm {alg} is not accepted; use ECDSA P-256, P-384 or Ed25519"
    )))
}

fn check_subject_and_extensions(
    csr: &X509CertificationRequest<'_>,
    node: &str,
) -> Result<(), JoinError> {
    let info = &csr.certification_request_info;
    let full_cn = format!("system:node:{node}");
    for attr in info.subject.iter_attributes() {
        let value = attr
            .as_str()
            .map_err(|_| csr_err("a subject attribute is not a string"))?;
        if *attr.attr_type() == OID_X509_COMMON_NAME {
            if value != full_cn && value != node {
                return Err(JoinError::OtherNode {
                    node: node.to_string(),
                    asked: format!("CN {value:?}"),
                });
            }
        } else if *attr.attr_type() == OID_X509_ORGANIZATION_NAME {
            if value != NODES_ORG {
                return Err(csr_err(format!(
                    "subject O {value:?} is not allowed (only {NODES_ORG:?})"
                )));
            }
        } else {
            return Err(csr_err(format!(
                "subject attribute {} is not allowed (only CN and O)",
                attr.attr_type()
            )));
        }
    }
    if let Some(exts) = csr.requested_extensions() {
        for ext in exts {
            match ext {
                ParsedExtension::SubjectAlternativeName(san) => {
                    for name in &san.general_names {
                        match name {
                            GeneralName::DNSName(d) if *d == node => {}
                            GeneralName::DNSName(d) if valid_node_name(d) => {
                                return Err(JoinError::OtherNode {
                                    node: node.to_string(),
                                    asked: format!("DNS SAN {d:?}"),
                                })
                            }
                            other => {
                                return Err(JoinError::ExtraSans {
                                    node: node.to_string(),
                                    san: other.to_string(),
                                })
                            }
                        }
                    }
                }
                ParsedExtension::BasicConstraints(bc) if bc.ca => {
                    return Err(csr_err("the CSR asks to be a CA"));
                }
                ParsedExtension::BasicConstraints(_)
                | ParsedExtension::KeyUsage(_)
                | ParsedExtension::ExtendedKeyUsage(_) => {
                    // Replaced by the policy's own below.
                }
                _ => return Err(csr_err("the CSR requests an unsupported extension")),
            }
        }
    }
    Ok(())
}

/// The DER of a CSR in PEM. Its size is bounded where it arrives: a join
/// request by the cloud's `--join-max-message-bytes`, a renewal request by
/// the control frame's `--max-frame-bytes`; the text is already in memory
/// and is parsed once, in linear time.
fn csr_der(csr_pem: &str) -> Result<Vec<u8>, JoinError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(csr_pem.as_bytes())
        .map_err(|_| csr_err("not PEM text"))?;
    if pem.label != "CERTIFICATE REQUEST" && pem.label != "NEW CERTIFICATE REQUEST" {
        return Err(csr_err(format!(
            "PEM block is {:?}, not CERTIFICATE REQUEST",
            pem.label
        )));
    }
    Ok(pem.contents)
}

fn parse_csr(der: &[u8]) -> Result<X509CertificationRequest<'_>, JoinError> {
    X509CertificationRequest::from_der(der)
        .map(|(_, parsed)| parsed)
        .map_err(|e| csr_err(format!("not a PKCS#10 request: {e}")))
}

/// The public key a CSR asks to have certified, as
/// [`EdgeRequest::public_key`] holds it and [`crate::certifies_key`]
/// compares it: the cloud tells a repeated renewal request (same key) from
/// a new one by it. Only parses; [`sign_edge_csr`] applies the policy.
pub fn csr_public_key(csr_pem: &str) -> Result<Vec<u8>, JoinError> {
    let der = csr_der(csr_pem)?;
    let parsed = parse_csr(&der)?;
    Ok(parsed
        .certification_request_info
        .subject_pki
        .subject_public_key
        .data
        .to_vec())
}

/// Checks an edge's CSR against the policy (module docs) and signs it for
/// `node`, valid for `valid_for` from now.
pub fn sign_edge_csr(
    ca: &Ca,
    csr_pem: &str,
    node: &str,
    valid_for: Duration,
) -> Result<IssuedCert, JoinError> {
    if !valid_node_name(node) {
        return Err(JoinError::InvalidNodeName(node.to_string()));
    }
    let der = csr_der(csr_pem)?;
    let parsed = parse_csr(&der)?;
    let kind = check_key(&parsed)?;
    check_subject_and_extensions(&parsed, node)?;
    // rcgen verifies the signature (proof the requester holds the key) and
    // takes the public key over.
    let mut req =
        CertificateSigningRequestParams::from_der(&der.as_slice().into()).map_err(|e| match e {
            rcgen::Error::InvalidCertificationRequestSignature => {
                csr_err("the CSR's signature does not verify")
            }
            other => csr_err(format!("rcgen refused the CSR: {other}")),
        })?;
    // rcgen names the key by the CSR's signature algorithm; make sure that
    // agrees with the key itself, or the certificate's key would be mislabelled.
    let expected = match kind {
        KeyKind::P256 => &PKCS_ECDSA_P256_SHA256,
        KeyKind::P384 => &PKCS_ECDSA_P384_SHA384,
        KeyKind::Ed25519 => &PKCS_ED25519,
    };
    if req.public_key.algorithm() != expected {
        return Err(csr_err(
            "the CSR's signature algorithm does not match its key \
             (sign P-256 with SHA-256 and P-384 with SHA-384)",
        ));
    }
    let mut p = CertificateParams::default();
    p.distinguished_name = edge_subject(node);
    p.subject_alt_names = vec![SanType::DnsName(node.try_into().map_err(JoinError::Sign)?)];
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    set_validity(&mut p, valid_for).map_err(|e| JoinError::Invalid(e.to_string()))?;
    let serial = random_serial();
    p.serial_number = Some(serial.clone());
    p.use_authority_key_identifier_extension = true;
    let expires_unix = p.not_after.unix_timestamp();
    req.params = p;
    let cert = req.signed_by(ca.issuer()).map_err(JoinError::Sign)?;
    Ok(IssuedCert {
        cert_pem: cert.pem(),
        serial: hex::encode(serial.as_ref()),
        expires_unix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, UnixTime};
    use rustls::server::danger::ClientCertVerifier;
    use rustls::server::WebPkiClientVerifier;
    use std::sync::Arc;

    const DAY: Duration = Duration::from_secs(86400);

    /// An RSA-1024 CSR for CN=system:node:edge-1, made once with
    /// `openssl req -new -newkey rsa:1024 -nodes -subj /CN=system:node:edge-1`
    /// (rcgen with ring cannot make RSA keys).
    const RSA_1024_CSR: &str = include_str!("../tests/data/rsa1024.csr");

    fn csr_with(alg: &'static rcgen::SignatureAlgorithm, params: CertificateParams) -> String {
        let key = KeyPair::generate_for(alg).unwrap();
        params.serialize_request(&key).unwrap().pem().unwrap()
    }

    fn params(cn: &str, sans: &[SanType]) -> CertificateParams {
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cn);
        p.distinguished_name = dn;
        p.subject_alt_names = sans.to_vec();
        p
    }

    fn dns(s: &str) -> SanType {
        SanType::DnsName(s.try_into().unwrap())
    }

    fn ca() -> Ca {
        Ca::new("csr test ca", DAY).unwrap()
    }

    fn client_verifier(ca: &Ca) -> Arc<dyn ClientCertVerifier> {
        let mut roots = rustls::RootCertStore::empty();
        for c in crate::pem::certs_from_pem(&ca.cert_pem, "ca").unwrap() {
            roots.add(c).unwrap();
        }
        WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap()
    }

    fn der(pem: &str) -> CertificateDer<'static> {
        crate::pem::certs_from_pem(pem, "t").unwrap().remove(0)
    }

    /// The cloud recognises a repeated renewal request by the CSR's key:
    /// the same bits the edge keeps and the signed certificate carries;
    /// another request's key differs; a CSR that does not parse is an error.
    #[test]
    fn a_csrs_public_key_is_the_one_its_certificate_certifies() {
        let (req, other) = (
            make_edge_csr("edge-1").unwrap(),
            make_edge_csr("edge-1").unwrap(),
        );
        let key = csr_public_key(&req.csr_pem).unwrap();
        assert_eq!(key, req.public_key);
        assert_ne!(key, csr_public_key(&other.csr_pem).unwrap());
        let issued = sign_edge_csr(&ca(), &req.csr_pem, "edge-1", DAY).unwrap();
        assert!(crate::certifies_key(&der(&issued.cert_pem), &key));
        assert!(csr_public_key("not a csr").is_err());
        let cert = ca().issue_edge("edge-1", DAY).unwrap();
        assert!(csr_public_key(&cert.cert_pem)
            .unwrap_err()
            .to_string()
            .contains("not CERTIFICATE REQUEST"));
    }

    /// The renewing edge tells the answer to its request from a late answer
    /// to an earlier one by the key the certificate carries.
    #[test]
    fn a_certificate_certifies_its_requests_key_and_no_other() {
        let ca = ca();
        let (req, other) = (
            make_edge_csr("edge-1").unwrap(),
            make_edge_csr("edge-1").unwrap(),
        );
        let cert = der(&sign_edge_csr(&ca, &req.csr_pem, "edge-1", DAY)
            .unwrap()
            .cert_pem);
        assert_eq!(req.public_key.len(), 65, "an uncompressed P-256 point");
        assert!(crate::certifies_key(&cert, &req.public_key));
        assert!(!crate::certifies_key(&cert, &other.public_key));
        assert!(!crate::certifies_key(&cert, &[]));
        let garbage = CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x00]);
        assert!(!crate::certifies_key(&garbage, &req.public_key));
    }

    #[test]
    fn edge_csr_is_signed_and_accepted_by_its_ca_only() {
        let ca = ca();
        let req = make_edge_csr("edge-1").unwrap();
        let issued = sign_edge_csr(&ca, &req.csr_pem, "edge-1", DAY).unwrap();
        let cert = der(&issued.cert_pem);
        assert_eq!(crate::node_name_from_cert(&cert).unwrap(), "edge-1");
        assert!(!issued.serial.is_empty());
        // The certificate carries the edge's key, not one made by the cloud.
        let key = KeyPair::from_pem(&req.key_pem).unwrap();
        let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref()).unwrap();
        assert_eq!(
            x.tbs_certificate
                .subject_pki
                .subject_public_key
                .data
                .as_ref(),
            key.public_key_raw()
        );
        let now = UnixTime::now();
        client_verifier(&ca)
            .verify_client_cert(&cert, &[], now)
            .unwrap();
        let other = Ca::new("other", DAY).unwrap();
        assert!(client_verifier(&other)
            .verify_client_cert(&cert, &[], now)
            .is_err());
    }

    #[test]
    fn p384_and_ed25519_keys_are_accepted() {
        let ca = ca();
        for alg in [&PKCS_ECDSA_P384_SHA384, &PKCS_ED25519] {
            let csr = csr_with(alg, params("system:node:edge-2", &[dns("edge-2")]));
            let issued = sign_edge_csr(&ca, &csr, "edge-2", DAY).unwrap();
            client_verifier(&ca)
                .verify_client_cert(&der(&issued.cert_pem), &[], UnixTime::now())
                .unwrap();
        }
    }

    #[test]
    fn a_csr_for_another_node_is_refused() {
        let ca = ca();
        let csr = make_edge_csr("edge-2").unwrap().csr_pem;
        let e = sign_edge_csr(&ca, &csr, "edge-1", DAY).unwrap_err();
        assert!(matches!(e, JoinError::OtherNode { .. }), "{e}");
        let csr = csr_with(
            &PKCS_ECDSA_P256_SHA256,
            params("system:node:edge-1", &[dns("edge-2")]),
        );
        let e = sign_edge_csr(&ca, &csr, "edge-1", DAY).unwrap_err();
        assert!(matches!(e, JoinError::OtherNode { .. }), "{e}");
        assert!(e.to_string().contains("edge-2"));
    }

    #[test]
    fn extra_sans_are_refused() {
        let ca = ca();
        for extra in [
            SanType::IpAddress("10.0.0.1".parse().unwrap()),
            dns("*.example.com"),
            SanType::URI("spiffe://x/y".try_into().unwrap()),
        ] {
            let csr = csr_with(
                &PKCS_ECDSA_P256_SHA256,
                params("system:node:edge-1", &[dns("edge-1"), extra]),
            );
            let e = sign_edge_csr(&ca, &csr, "edge-1", DAY).unwrap_err();
            assert!(matches!(e, JoinError::ExtraSans { .. }), "{e}");
        }
    }

    #[test]
    fn other_subject_attributes_and_ca_requests_are_refused() {
        let ca = ca();
        let mut p = params("system:node:edge-1", &[]);
        p.distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        let e =
            sign_edge_csr(&ca, &csr_with(&PKCS_ECDSA_P256_SHA256, p), "edge-1", DAY).unwrap_err();
        assert!(e.to_string().contains("system:masters"), "{e}");
        let mut p = params("system:node:edge-1", &[]);
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let e =
            sign_edge_csr(&ca, &csr_with(&PKCS_ECDSA_P256_SHA256, p), "edge-1", DAY).unwrap_err();
        assert!(e.to_string().contains("CA"), "{e}");
    }

    #[test]
    fn rsa_and_garbage_are_refused() {
        let ca = ca();
        let e = sign_edge_csr(&ca, RSA_1024_CSR, "edge-1", DAY).unwrap_err();
        assert!(matches!(e, JoinError::WeakKey(_)), "{e}");
        assert!(e.to_string().contains("1024"), "{e}");
        for junk in [
            "",
            "hello",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        ] {
            assert!(matches!(
                sign_edge_csr(&ca, junk, "edge-1", DAY),
                Err(JoinError::Csr(_))
            ));
        }
        let big = "A".repeat(64 * 1024);
        assert!(sign_edge_csr(&ca, &big, "edge-1", DAY).is_err());
    }

    #[test]
    fn a_tampered_csr_is_refused() {
        let ca = ca();
        let csr = make_edge_csr("edge-1").unwrap().csr_pem;
        let (_, pem) = x509_parser::pem::parse_x509_pem(csr.as_bytes()).unwrap();
        let mut der = pem.contents.clone();
        let last = der.len() - 1;
        der[last] ^= 0x01;
        let text = format!(
            "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
            base64(&der)
        );
        let e = sign_edge_csr(&ca, &text, "edge-1", DAY).unwrap_err();
        assert!(matches!(e, JoinError::Csr(_)), "{e}");
    }

    fn base64(data: &[u8]) -> String {
        const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in data.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    #[test]
    fn expired_and_server_only_certificates_are_refused_as_clients() {
        let ca = ca();
        let v = client_verifier(&ca);
        // Expired: signed for one second, checked a day later.
        let req = make_edge_csr("edge-1").unwrap();
        let issued = sign_edge_csr(&ca, &req.csr_pem, "edge-1", Duration::from_secs(1)).unwrap();
        let later = UnixTime::since_unix_epoch(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                + DAY,
        );
        assert!(v
            .verify_client_cert(&der(&issued.cert_pem), &[], later)
            .is_err());
        // Server-auth only EKU: not a client.
        let server = ca.issue_server(&["edge-1"], &[], DAY).unwrap();
        assert!(v
            .verify_client_cert(&der(&server.cert_pem), &[], UnixTime::now())
            .is_err());
    }
}
