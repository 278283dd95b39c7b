//! The node identity in an edge certificate.
//!
//! An edge certificate names its node as CN `system:node:<name>` (the
//! Kubernetes convention, also KubeEdge's); a bare CN or a DNS SAN is accepted
//! when the CN has no such prefix. The name must be a valid Kubernetes node
//! name (DNS-1123 subdomain).
//!
//! A cloud replica's peer certificate is recognised by [`check_peer_cert`]:
//! exactly CN `tether-peer` and O `tether:peers` (see [`crate::mint`]).

use rustls::pki_types::CertificateDer;
use x509_parser::prelude::*;

use crate::CertError;

/// Longest node name: a DNS-1123 subdomain has at most 253 characters.
pub const MAX_NODE_NAME_LEN: usize = 253;

/// Whether `s` is a DNS-1123 subdomain (what Kubernetes allows as a node name).
pub fn valid_node_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NODE_NAME_LEN
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// The node name an edge certificate carries.
pub fn node_name_from_cert(der: &CertificateDer<'_>) -> Result<String, CertError> {
    let (_, cert) =
        X509Certificate::from_der(der.as_ref()).map_err(|e| CertError::Parse(e.to_string()))?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|c| c.as_str().ok())
        .map(str::to_string);
    let name = match cn {
        Some(cn) if cn.starts_with("system:node:") => cn["system:node:".len()..].to_string(),
        other => {
            let san = cert
                .subject_alternative_name()
                .ok()
                .flatten()
                .and_then(|s| {
                    s.value.general_names.iter().find_map(|g| match g {
                        GeneralName::DNSName(d) => Some(d.to_string()),
                        _ => None,
                    })
                });
            match san.or(other) {
                Some(n) => n,
                None => return Err(CertError::NoNode("no CN and no DNS name".into())),
            }
        }
    };
    if !valid_node_name(&name) {
        return Err(CertError::NoNode(format!(
            "{name:?} is not a valid node name"
        )));
    }
    Ok(name)
}

/// Whether certificate `der` certifies `public_key` (the subject public key's
/// bits, as [`crate::csr::EdgeRequest::public_key`] holds them). A certificate
/// that does not parse certifies nothing.
pub fn certifies_key(der: &CertificateDer<'_>, public_key: &[u8]) -> bool {
    X509Certificate::from_der(der.as_ref())
        .is_ok_and(|(_, cert)| cert.public_key().subject_public_key.data.as_ref() == public_key)
}

/// Checks that a certificate is a cloud replica's peer certificate: CN
/// [`crate::mint::PEER_COMMON_NAME`] and O [`crate::mint::PEER_ORGANIZATION`],
/// nothing else in the subject. Edge (`system:node:*`, `system:nodes`) and
/// apiserver client certificates fail this.
pub fn check_peer_cert(der: &CertificateDer<'_>) -> Result<(), CertError> {
    use crate::mint::{PEER_COMMON_NAME, PEER_ORGANIZATION};
    let (_, cert) =
        X509Certificate::from_der(der.as_ref()).map_err(|e| CertError::Parse(e.to_string()))?;
    let cns: Vec<&str> = cert
        .subject()
        .iter_common_name()
        .filter_map(|c| c.as_str().ok())
        .collect();
    let orgs: Vec<&str> = cert
        .subject()
        .iter_organization()
        .filter_map(|c| c.as_str().ok())
        .collect();
    if cns != [PEER_COMMON_NAME] || orgs != [PEER_ORGANIZATION] {
        return Err(CertError::NotPeer(format!(
            "subject CN {cns:?} O {orgs:?}; a peer has CN {PEER_COMMON_NAME:?} O {PEER_ORGANIZATION:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names() {
        assert!(valid_node_name("edge-1"));
        assert!(valid_node_name("a.b.c"));
        assert!(!valid_node_name("Edge"));
        assert!(!valid_node_name("-x"));
        assert!(!valid_node_name(""));
        assert!(!valid_node_name("a..b"));
    }
}
