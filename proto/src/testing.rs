//! Test support shared by the workspace's crates (feature `test-util`, and
//! this crate's own tests): a QUIC connection pair on loopback.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

/// (dialler's connection, listener's connection) over loopback with a
/// self-signed certificate, kept alive by the returned endpoints. Panics on
/// failure: for tests only.
pub async fn quic_pair() -> (quinn::Connection, quinn::Connection, Vec<quinn::Endpoint>) {
    let provider = crate::tls::provider();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let der = CertificateDer::from(cert.cert.der().to_vec());
    let key = PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der());
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key.into())
        .unwrap();
    server.alpn_protocols = vec![b"t".to_vec()];
    let sc = quinn::ServerConfig::with_crypto(Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(server).unwrap(),
    ));
    let listener = quinn::Endpoint::server(sc, "127.0.0.1:0".parse().unwrap()).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der).unwrap();
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"t".to_vec()];
    let mut dialler = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    dialler.set_default_client_config(quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(client).unwrap(),
    )));
    let addr = listener.local_addr().unwrap();
    let (a, b) = tokio::join!(
        async { dialler.connect(addr, "localhost").unwrap().await.unwrap() },
        async { listener.accept().await.unwrap().await.unwrap() }
    );
    (a, b, vec![dialler, listener])
}
