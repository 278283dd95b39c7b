//! Test support shared by the workspace's crates (feature `test-util`, and
//! this crate's own tests): a QUIC connection pair on loopback.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

/// Why a loopback pair could not be made.
pub type PairError = Box<dyn std::error::Error + Send + Sync>;

/// (dialler's connection, listener's connection) over loopback with a
/// self-signed certificate, kept alive by the returned endpoints (the
/// dialler's first).
pub async fn quic_pair(
) -> Result<(quinn::Connection, quinn::Connection, Vec<quinn::Endpoint>), PairError> {
    quic_pair_with(Arc::new(quinn::TransportConfig::default())).await
}

/// [`quic_pair`] with `transport` on both ends.
pub async fn quic_pair_with(
    transport: Arc<quinn::TransportConfig>,
) -> Result<(quinn::Connection, quinn::Connection, Vec<quinn::Endpoint>), PairError> {
    quic_pair_wrapped(transport, |s| s).await
}

/// The listener's UDP socket as the listener's endpoint is given it.
pub type Socket = Arc<dyn quinn::AsyncUdpSocket>;

/// [`quic_pair_with`], the listener's socket wrapped by `wrap` (to watch or
/// change what it receives).
pub async fn quic_pair_wrapped(
    transport: Arc<quinn::TransportConfig>,
    wrap: impl FnOnce(Socket) -> Socket,
) -> Result<(quinn::Connection, quinn::Connection, Vec<quinn::Endpoint>), PairError> {
    let provider = crate::tls::provider();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])?;
    let der = CertificateDer::from(cert.cert.der().to_vec());
    let key = PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der());
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key.into())?;
    server.alpn_protocols = vec![b"t".to_vec()];
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(server)?,
    ));
    sc.transport_config(transport.clone());
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let runtime = quinn::default_runtime().ok_or("no async runtime for QUIC")?;
    let socket = runtime.wrap_udp_socket(std::net::UdpSocket::bind(loopback)?)?;
    let listener = quinn::Endpoint::new_with_abstract_socket(
        quinn::EndpointConfig::default(),
        Some(sc),
        wrap(socket),
        runtime,
    )?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der)?;
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"t".to_vec()];
    let mut dialler = quinn::Endpoint::client(loopback)?;
    let mut cc = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(client)?,
    ));
    cc.transport_config(transport);
    dialler.set_default_client_config(cc);
    let addr = listener.local_addr()?;
    let connecting = dialler.connect(addr, "localhost")?;
    let (a, b) = tokio::join!(connecting, async {
        match listener.accept().await {
            Some(incoming) => incoming.await,
            None => Err(quinn::ConnectionError::LocallyClosed),
        }
    });
    Ok((a?, b?, vec![dialler, listener]))
}
