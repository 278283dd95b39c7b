//! The one TLS crypto provider every Tether configuration is built with
//! (the QUIC tunnel on both ends, the peer links, the cloud's kubelet-API
//! listener, the edge's client to its kubelet): ring, preferring AES-128-GCM.
//!
//! ring's default order puts AES-256-GCM with SHA-384 first, and a rustls
//! server follows the client's order, so every Tether connection negotiated
//! it. AES-128-GCM is as standard (the suite every QUIC stack must support,
//! the one browsers prefer on AES hardware) and cheaper on both ends: ten AES
//! rounds instead of fourteen for every byte of every stream, and SHA-256
//! (SHA-NI in hardware) instead of SHA-384 (software) for every handshake's
//! transcript and key schedule. The other suites stay, after it.

use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::{CipherSuite, SupportedCipherSuite};

/// Whether Tether prefers `suite` (AES-128-GCM, TLS 1.3 and 1.2).
fn preferred(suite: &SupportedCipherSuite) -> bool {
    matches!(
        suite.suite(),
        CipherSuite::TLS13_AES_128_GCM_SHA256
            | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
    )
}

/// ring with the AES-128-GCM suites first (the rest in ring's order).
pub fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    // Stable: within each group ring's order is kept.
    p.cipher_suites.sort_by_key(|s| !preferred(s));
    Arc::new(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aes_128_gcm_comes_first_and_no_suite_is_lost() {
        let p = provider();
        let ring = rustls::crypto::ring::default_provider();
        assert_eq!(
            p.cipher_suites.first().map(|s| s.suite()),
            Some(CipherSuite::TLS13_AES_128_GCM_SHA256)
        );
        assert_eq!(p.cipher_suites.len(), ring.cipher_suites.len());
        for s in &ring.cipher_suites {
            assert!(p.cipher_suites.iter().any(|t| t.suite() == s.suite()));
        }
        // TLS 1.2 (the kubelet-API listener allows it): AES-128-GCM first too.
        let first12 = p
            .cipher_suites
            .iter()
            .find(|s| s.version() == &rustls::version::TLS12)
            .map(|s| s.suite());
        assert!(matches!(
            first12,
            Some(
                CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                    | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
            )
        ));
    }

    /// A client and a server built with it agree on AES-128-GCM.
    #[test]
    fn a_handshake_between_two_tether_ends_negotiates_aes_128_gcm() {
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".into()])
            .map(|c| (c.cert.der().clone(), c.signing_key.serialize_der()));
        let Ok((cert, key)) = ca else {
            panic!("rcgen could not make a certificate");
        };
        let key = rustls::pki_types::PrivateKeyDer::try_from(key).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut c = rustls::ClientConnection::new(Arc::new(client), name).unwrap();
        let mut s = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets().unwrap();
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets().unwrap();
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
        }
        assert!(!c.is_handshaking());
        assert_eq!(
            c.negotiated_cipher_suite().map(|s| s.suite()),
            Some(CipherSuite::TLS13_AES_128_GCM_SHA256)
        );
    }
}
