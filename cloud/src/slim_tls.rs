//! The edge listener's QUIC TLS sessions: rustls while the handshake runs,
//! then only what a connection still needs.
//!
//! quinn's own rustls session keeps the whole `rustls::quic::ServerConnection`
//! for the life of the connection: the handshake's state, its buffers and
//! the edge's certificate chain as rustls holds them. quinn also derives the
//! keys of the first key update as soon as the handshake ends (two AES-GCM
//! keys, ~1.1 KB with ring), for an update most connections never make. An
//! idle edge holds its connection for days and a cloud holds thousands.
//!
//! [`SlimServerConfig`] starts sessions that drop the rustls connection once
//! the handshake is over (no TLS bytes are left to read or write) and keep:
//! - the traffic secrets every later key update is derived from, with the
//!   next update's keys derived the first time they are used;
//! - what the cloud reads back from a connection: the ALPN, the SNI, the
//!   edge's certificate chain and its transport parameters.
//!
//! After the handshake a session refuses TLS data (a QUIC client sends none
//! then: QUIC has no TLS key-update message or post-handshake
//! authentication). Keying-material export is refused: the cloud uses none.
//! A QUIC version other than 1 gets quinn's own session. A rustls connection
//! that cannot start (a configuration rustls refuses, checked once in
//! [`SlimServerConfig::new`]) fails that one handshake with an error, never
//! the endpoint.

use std::any::Any;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::BytesMut;
use quinn::crypto::rustls::{HandshakeData, QuicServerConfig};
use quinn_proto::crypto::{
    self, CryptoError, ExportKeyingMaterialError, HeaderKey, KeyPair, Keys, UnsupportedVersion,
};
use quinn_proto::transport_parameters::TransportParameters;
use quinn_proto::{ConnectionId, Side, TransportError, TransportErrorCode};
use rustls::pki_types::CertificateDer;
use rustls::quic::{KeyChange, PacketKeySet, Secrets, Suite, Version};
use tracing::warn;

/// The QUIC version this module starts sessions for; others go to quinn's.
const QUIC_V1: u32 = 1;

/// Why a [`SlimServerConfig`] could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SlimTlsError {
    #[error("the TLS configuration has no TLS 1.3 AES-128-GCM suite for QUIC's initial keys")]
    NoInitialSuite,
    #[error("rustls refuses the configuration for a QUIC server: {0}")]
    Refused(rustls::Error),
}

/// A QUIC server crypto configuration whose sessions shed rustls after the
/// handshake (see the module documentation).
pub struct SlimServerConfig {
    /// quinn's configuration over the same rustls one: initial keys, Retry
    /// tags, and the session for what this module does not handle.
    quinn: Arc<QuicServerConfig>,
    tls: Arc<rustls::ServerConfig>,
    /// The suite of Initial packets (TLS_AES_128_GCM_SHA256).
    initial: Suite,
    /// Sessions started here that still hold a rustls connection.
    holding_tls: Arc<AtomicUsize>,
    /// Told of every handshake that ends: `true` when it resumed a session.
    on_done: Option<OnHandshake>,
}

/// Told, once per completed handshake, whether it resumed a TLS session.
pub type OnHandshake = Arc<dyn Fn(bool) + Send + Sync>;

impl SlimServerConfig {
    pub fn new(tls: rustls::ServerConfig) -> Result<Self, SlimTlsError> {
        let tls = Arc::new(tls);
        let initial = tls
            .crypto_provider()
            .cipher_suites
            .iter()
            .filter(|cs| cs.suite() == rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
            .find_map(|cs| cs.tls13().and_then(|s| s.quic_suite()))
            .ok_or(SlimTlsError::NoInitialSuite)?;
        let quinn = QuicServerConfig::with_initial(tls.clone(), initial)
            .map_err(|_| SlimTlsError::NoInitialSuite)?;
        // What rustls checks when a connection starts (TLS 1.3, QUIC's early
        // data sizes), once here rather than at every handshake.
        rustls::quic::ServerConnection::new(tls.clone(), Version::V1, Vec::new())
            .map_err(SlimTlsError::Refused)?;
        Ok(Self {
            quinn: Arc::new(quinn),
            tls,
            initial,
            holding_tls: Arc::new(AtomicUsize::new(0)),
            on_done: None,
        })
    }

    /// Tells `on_done` of every handshake that ends, full or resumed.
    pub fn counting(mut self, on_done: OnHandshake) -> Self {
        self.on_done = Some(on_done);
        self
    }

    /// How many sessions started here still hold a rustls connection: those
    /// whose handshake has not ended (and whose connection is not gone).
    pub fn sessions_holding_tls(&self) -> usize {
        self.holding_tls.load(Ordering::Relaxed)
    }
}

impl crypto::ServerConfig for SlimServerConfig {
    fn initial_keys(
        &self,
        version: u32,
        dst_cid: &ConnectionId,
    ) -> Result<Keys, UnsupportedVersion> {
        self.quinn.initial_keys(version, dst_cid)
    }

    fn retry_tag(&self, version: u32, orig_dst_cid: &ConnectionId, packet: &[u8]) -> [u8; 16] {
        self.quinn.retry_tag(version, orig_dst_cid, packet)
    }

    fn start_session(
        self: Arc<Self>,
        version: u32,
        params: &TransportParameters,
    ) -> Box<dyn crypto::Session> {
        if version != QUIC_V1 {
            return self.quinn.clone().start_session(version, params);
        }
        let mut encoded = Vec::new();
        params.write(&mut encoded);
        let stage =
            match rustls::quic::ServerConnection::new(self.tls.clone(), Version::V1, encoded) {
                Ok(conn) => Stage::Handshake(Box::new(Handshaking {
                    conn,
                    got_handshake_data: false,
                    _holding: Holding::new(&self.holding_tls),
                    on_done: self.on_done.clone(),
                })),
                Err(e) => {
                    warn!(error = %e, "a TLS session could not start; refusing the handshake");
                    Stage::Refused(e.to_string())
                }
            };
        Box::new(SlimSession::new(self.initial, stage))
    }
}

/// Counts a session in [`SlimServerConfig::sessions_holding_tls`] while it lives.
struct Holding(Arc<AtomicUsize>);

impl Holding {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count.clone())
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

struct SlimSession {
    initial: Suite,
    /// The secrets of the first key update, from the 1-RTT key change, until
    /// quinn asks for that update's keys.
    first_update: Option<Secrets>,
    /// The keys handed out for the latest key update: once derived, its
    /// secrets are those of the update after it.
    last_update: Option<Arc<UpdateKeys>>,
    stage: Stage,
}

enum Stage {
    Handshake(Box<Handshaking>),
    Done(Box<Finished>),
    /// rustls refused to start (why): the first TLS data fails the handshake.
    Refused(String),
}

struct Handshaking {
    conn: rustls::quic::ServerConnection,
    got_handshake_data: bool,
    _holding: Holding,
    on_done: Option<OnHandshake>,
}

/// What a connection still reads from its TLS session after the handshake.
struct Finished {
    alpn: Option<Vec<u8>>,
    server_name: Option<String>,
    peer_certs: Option<Vec<CertificateDer<'static>>>,
    transport_params: Option<Vec<u8>>,
}

impl SlimSession {
    fn new(initial: Suite, stage: Stage) -> Self {
        Self {
            initial,
            first_update: None,
            last_update: None,
            stage,
        }
    }

    /// Drops the rustls connection, keeping what [`Finished`] holds.
    fn finish(&mut self) {
        let Stage::Handshake(h) = &self.stage else {
            return;
        };
        let HandshakeData {
            protocol,
            server_name,
        } = handshake_data_of(&h.conn);
        let done = Finished {
            alpn: protocol,
            server_name,
            peer_certs: peer_chain_of(&h.conn),
            transport_params: h.conn.quic_transport_parameters().map(<[u8]>::to_vec),
        };
        if let Some(on_done) = &h.on_done {
            on_done(h.conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed));
        }
        self.stage = Stage::Done(Box::new(done));
    }

    fn transport_params_bytes(&self) -> Option<&[u8]> {
        match &self.stage {
            Stage::Handshake(h) => h.conn.quic_transport_parameters(),
            Stage::Done(d) => d.transport_params.as_deref(),
            Stage::Refused(_) => None,
        }
    }
}

/// The ALPN and SNI a rustls connection has read, as quinn hands them out.
fn handshake_data_of(conn: &rustls::quic::ServerConnection) -> HandshakeData {
    HandshakeData {
        protocol: conn.alpn_protocol().map(<[u8]>::to_vec),
        server_name: conn.server_name().map(str::to_owned),
    }
}

/// The peer's certificate chain, owned, as quinn's peer identity holds it.
fn peer_chain_of(conn: &rustls::quic::ServerConnection) -> Option<Vec<CertificateDer<'static>>> {
    conn.peer_certificates()
        .map(|chain| chain.iter().map(|c| c.clone().into_owned()).collect())
}

fn protocol_violation(reason: String) -> TransportError {
    TransportError {
        code: TransportErrorCode::PROTOCOL_VIOLATION,
        frame: None,
        reason,
    }
}

fn boxed_keys(keys: rustls::quic::Keys) -> Keys {
    Keys {
        header: KeyPair {
            local: Box::new(keys.local.header),
            remote: Box::new(keys.remote.header),
        },
        packet: KeyPair {
            local: Box::new(keys.local.packet),
            remote: Box::new(keys.remote.packet),
        },
    }
}

impl crypto::Session for SlimSession {
    fn initial_keys(&self, dst_cid: &ConnectionId, side: Side) -> Keys {
        boxed_keys(self.initial.keys(dst_cid, side.into(), Version::V1))
    }

    fn handshake_data(&self) -> Option<Box<dyn Any>> {
        let data = match &self.stage {
            Stage::Handshake(h) if !h.got_handshake_data => return None,
            Stage::Handshake(h) => handshake_data_of(&h.conn),
            Stage::Done(d) => HandshakeData {
                protocol: d.alpn.clone(),
                server_name: d.server_name.clone(),
            },
            Stage::Refused(_) => return None,
        };
        Some(Box::new(data))
    }

    /// As quinn's: a `Vec<CertificateDer<'static>>`, the edge's chain.
    fn peer_identity(&self) -> Option<Box<dyn Any>> {
        let chain = match &self.stage {
            Stage::Handshake(h) => peer_chain_of(&h.conn),
            Stage::Done(d) => d.peer_certs.clone(),
            Stage::Refused(_) => None,
        }?;
        Some(Box::new(chain))
    }

    fn early_crypto(&self) -> Option<(Box<dyn HeaderKey>, Box<dyn crypto::PacketKey>)> {
        let Stage::Handshake(h) = &self.stage else {
            return None;
        };
        let keys = h.conn.zero_rtt_keys()?;
        Some((Box::new(keys.header), Box::new(keys.packet)))
    }

    fn early_data_accepted(&self) -> Option<bool> {
        None
    }

    fn is_handshaking(&self) -> bool {
        match &self.stage {
            Stage::Handshake(h) => h.conn.is_handshaking(),
            Stage::Done(_) => false,
            Stage::Refused(_) => true,
        }
    }

    fn read_handshake(&mut self, buf: &[u8]) -> Result<bool, TransportError> {
        let h = match &mut self.stage {
            Stage::Handshake(h) => h,
            Stage::Done(_) => {
                return Err(protocol_violation(
                    "TLS handshake data after the handshake".into(),
                ))
            }
            Stage::Refused(why) => {
                return Err(TransportError {
                    code: TransportErrorCode::INTERNAL_ERROR,
                    frame: None,
                    reason: format!("the TLS session could not start: {why}"),
                })
            }
        };
        if let Err(e) = h.conn.read_hs(buf) {
            return Err(match h.conn.alert() {
                Some(alert) => TransportError {
                    code: TransportErrorCode::crypto(u8::from(alert)),
                    frame: None,
                    reason: e.to_string(),
                },
                None => protocol_violation(format!("TLS error: {e}")),
            });
        }
        // The handshake data (ALPN, SNI) is ready once rustls has read the
        // ClientHello; rustls has no explicit signal for it.
        if !h.got_handshake_data
            && (h.conn.alpn_protocol().is_some()
                || h.conn.server_name().is_some()
                || !h.conn.is_handshaking())
        {
            h.got_handshake_data = true;
            return Ok(true);
        }
        Ok(false)
    }

    fn transport_parameters(&self) -> Result<Option<TransportParameters>, TransportError> {
        let Some(bytes) = self.transport_params_bytes() else {
            return Ok(None);
        };
        let params = TransportParameters::read(Side::Server, &mut io::Cursor::new(bytes))?;
        Ok(Some(params))
    }

    fn write_handshake(&mut self, buf: &mut Vec<u8>) -> Option<Keys> {
        let Stage::Handshake(h) = &mut self.stage else {
            return None;
        };
        let before = buf.len();
        let keys = match h.conn.write_hs(buf) {
            Some(KeyChange::Handshake { keys }) => Some(keys),
            Some(KeyChange::OneRtt { keys, next }) => {
                self.first_update = Some(next);
                Some(keys)
            }
            None => None,
        };
        let one_rtt = self.first_update.is_some() || self.last_update.is_some();
        if keys.is_none() && buf.len() == before && one_rtt && !h.conn.is_handshaking() {
            // Nothing more to write and nothing more to read: the handshake
            // is over.
            self.finish();
        }
        keys.map(boxed_keys)
    }

    fn next_1rtt_keys(&mut self) -> Option<KeyPair<Box<dyn crypto::PacketKey>>> {
        let secrets = match self.last_update.take() {
            Some(last) => last.following(),
            None => self.first_update.take()?,
        };
        let update = Arc::new(UpdateKeys::new(secrets));
        self.last_update = Some(update.clone());
        Some(KeyPair {
            local: Box::new(LazyPacketKey {
                update: update.clone(),
                local: true,
            }),
            remote: Box::new(LazyPacketKey {
                update,
                local: false,
            }),
        })
    }

    fn is_valid_retry(
        &self,
        _orig_dst_cid: &ConnectionId,
        _header: &[u8],
        _payload: &[u8],
    ) -> bool {
        // Only a client receives a Retry.
        false
    }

    /// Refused: the cloud exports no keying material.
    fn export_keying_material(
        &self,
        _output: &mut [u8],
        _label: &[u8],
        _context: &[u8],
    ) -> Result<(), ExportKeyingMaterialError> {
        Err(ExportKeyingMaterialError)
    }
}

/// One key update's packet keys, derived on first use.
struct UpdateKeys {
    /// This update's secrets until the keys are derived; then the next
    /// update's (rustls advances them as it derives).
    secrets: Mutex<Secrets>,
    keys: OnceLock<PacketKeySet>,
}

impl UpdateKeys {
    fn new(secrets: Secrets) -> Self {
        Self {
            secrets: Mutex::new(secrets),
            keys: OnceLock::new(),
        }
    }

    fn keys(&self) -> &PacketKeySet {
        self.keys.get_or_init(|| {
            self.secrets
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .next_packet_keys()
        })
    }

    /// The secrets of the update after this one.
    fn following(&self) -> Secrets {
        self.keys();
        self.secrets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

/// One direction of a key update's packet keys (see [`UpdateKeys`]).
struct LazyPacketKey {
    update: Arc<UpdateKeys>,
    local: bool,
}

impl LazyPacketKey {
    // quinn implements its `PacketKey` for the box rustls hands out.
    #[allow(clippy::borrowed_box)]
    fn key(&self) -> &Box<dyn rustls::quic::PacketKey> {
        let keys = self.update.keys();
        if self.local {
            &keys.local
        } else {
            &keys.remote
        }
    }
}

impl crypto::PacketKey for LazyPacketKey {
    fn encrypt(&self, packet: u64, buf: &mut [u8], header_len: usize) {
        crypto::PacketKey::encrypt(self.key(), packet, buf, header_len)
    }

    fn decrypt(
        &self,
        packet: u64,
        header: &[u8],
        payload: &mut BytesMut,
    ) -> Result<(), CryptoError> {
        crypto::PacketKey::decrypt(self.key(), packet, header, payload)
    }

    fn tag_len(&self) -> usize {
        crypto::PacketKey::tag_len(self.key())
    }

    fn confidentiality_limit(&self) -> u64 {
        crypto::PacketKey::confidentiality_limit(self.key())
    }

    fn integrity_limit(&self) -> u64 {
        crypto::PacketKey::integrity_limit(self.key())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::time::Duration;
    use tether_certs::mint::Ca;
    use tether_certs::pem::{certs_from_pem, key_from_pem};

    const DAY: Duration = Duration::from_secs(86_400);

    struct Pair {
        edge: quinn::Connection,
        cloud: quinn::Connection,
        config: Arc<SlimServerConfig>,
        roots: Arc<rustls::RootCertStore>,
        listener: quinn::Endpoint,
        _dialler: quinn::Endpoint,
    }

    /// A dialler on loopback whose TLS trusts `roots` and presents
    /// `cert`, if any.
    fn dialler(
        roots: Arc<rustls::RootCertStore>,
        cert: Option<tether_certs::mint::CertKey>,
    ) -> quinn::Endpoint {
        let builder = rustls::ClientConfig::builder_with_provider(tether_proto::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots);
        let mut client = match cert {
            Some(c) => builder
                .with_client_auth_cert(
                    certs_from_pem(&c.cert_pem, "edge").unwrap(),
                    key_from_pem(&c.key_pem, "edge").unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        client.alpn_protocols = vec![b"tether-test".to_vec()];
        let mut dialler = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        dialler.set_default_client_config(quinn::ClientConfig::new(Arc::new(
            quinn::crypto::rustls::QuicClientConfig::try_from(client).unwrap(),
        )));
        dialler
    }

    /// An edge (quinn's own client session, with an edge certificate) and a
    /// cloud listener with [`SlimServerConfig`] requiring one, on loopback.
    async fn pair(node: &str) -> Pair {
        let ca = Ca::new("test CA", DAY).unwrap();
        let (tls, roots) = server_tls(&ca);
        let config = Arc::new(SlimServerConfig::new(tls).unwrap());
        let listener = quinn::Endpoint::server(
            quinn::ServerConfig::with_crypto(config.clone()),
            SocketAddr::from(([127, 0, 0, 1], 0)),
        )
        .unwrap();

        let dialler = dialler(roots.clone(), Some(ca.issue_edge(node, DAY).unwrap()));
        let (edge, cloud) = connect(&dialler, &listener).await;
        Pair {
            edge,
            cloud,
            config,
            roots,
            listener,
            _dialler: dialler,
        }
    }

    async fn connect(
        dialler: &quinn::Endpoint,
        listener: &quinn::Endpoint,
    ) -> (quinn::Connection, quinn::Connection) {
        let connecting = dialler
            .connect(listener.local_addr().unwrap(), "cloud.test")
            .unwrap();
        let (edge, cloud) =
            tokio::join!(connecting, async { listener.accept().await.unwrap().await });
        (edge.unwrap(), cloud.unwrap())
    }

    /// The cloud's TLS configuration (a server certificate of `ca`, edge
    /// certificates of `ca` required, no tickets) and the roots of `ca`.
    fn server_tls(ca: &Ca) -> (rustls::ServerConfig, Arc<rustls::RootCertStore>) {
        let provider = tether_proto::tls::provider();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(certs_from_pem(&ca.cert_pem, "ca").unwrap()[0].clone())
            .unwrap();
        let roots = Arc::new(roots);

        let server = ca.issue_server(&["cloud.test"], &[], DAY).unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .unwrap();
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                certs_from_pem(&server.cert_pem, "server").unwrap(),
                key_from_pem(&server.key_pem, "server").unwrap(),
            )
            .unwrap();
        tls.alpn_protocols = vec![b"tether-test".to_vec()];
        tls.send_tls13_tickets = 0;
        (tls, roots)
    }

    fn chain_of(conn: &quinn::Connection) -> Vec<CertificateDer<'static>> {
        *conn
            .peer_identity()
            .unwrap()
            .downcast::<Vec<CertificateDer<'static>>>()
            .unwrap()
    }

    /// With session tickets, an edge's second connection resumes its TLS
    /// session: counted as resumed, the ticket's certificate chain is the
    /// connection's peer identity, and the connection works and sheds rustls
    /// like a full one. A listener with another ticket key (another replica
    /// without the shared secret) falls back to a full handshake.
    #[tokio::test]
    async fn a_second_connection_resumes_with_the_ticket_of_the_first() {
        let ca = Ca::new("test CA", DAY).unwrap();
        let ca_der = certs_from_pem(&ca.cert_pem, "ca").unwrap();
        let secret = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[7; 32]);
        let kinds = Arc::new(Mutex::new(Vec::new()));
        let listen = |secret: &ring::hmac::Key| {
            let (mut tls, _) = server_tls(&ca);
            tls.ticketer = Arc::new(
                crate::session_tickets::SessionTickets::shared(secret, &ca_der, DAY).unwrap(),
            );
            tls.send_tls13_tickets = 1;
            let seen = kinds.clone();
            let config = Arc::new(
                SlimServerConfig::new(tls)
                    .unwrap()
                    .counting(Arc::new(move |resumed| seen.lock().unwrap().push(resumed))),
            );
            let listener = quinn::Endpoint::server(
                quinn::ServerConfig::with_crypto(config.clone()),
                SocketAddr::from(([127, 0, 0, 1], 0)),
            )
            .unwrap();
            (config, listener)
        };
        let (config, listener) = listen(&secret);
        let (_, roots) = server_tls(&ca);
        let dialler = dialler(roots.clone(), Some(ca.issue_edge("edge-9", DAY).unwrap()));
        let mut pairs = Vec::new();
        for _ in 0..2 {
            let (edge, cloud) = connect(&dialler, &listener).await;
            let p = Pair {
                edge,
                cloud,
                config: config.clone(),
                roots: roots.clone(),
                listener: listener.clone(),
                _dialler: dialler.clone(),
            };
            echo(&p, 1000).await;
            wait_shed(&config).await;
            pairs.push(p);
        }
        assert_eq!(*kinds.lock().unwrap(), vec![false, true]);
        let resumed = chain_of(&pairs[1].cloud);
        assert_eq!(resumed, chain_of(&pairs[0].cloud));
        assert_eq!(
            tether_certs::node_name_from_cert(&resumed[0]).unwrap(),
            "edge-9"
        );
        // A restarted listener with the same secret opens the ticket the
        // second connection got; one with another secret does not.
        drop(pairs);
        let other = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[8; 32]);
        for secret in [&secret, &other] {
            let (config, listener) = listen(secret);
            let (edge, cloud) = connect(&dialler, &listener).await;
            assert_eq!(chain_of(&cloud), resumed);
            let p = Pair {
                edge,
                cloud,
                config,
                roots: roots.clone(),
                listener,
                _dialler: dialler.clone(),
            };
            // The echo lets the edge take the ticket this listener sent.
            echo(&p, 10).await;
        }
        assert_eq!(*kinds.lock().unwrap(), vec![false, true, true, false]);
    }

    /// Sends `len` bytes edge → cloud and back on a new stream; checks them
    /// (within 10 s).
    async fn echo(p: &Pair, len: usize) {
        tokio::time::timeout(Duration::from_secs(10), echo_unbounded(p, len))
            .await
            .expect("echo within 10 s");
    }

    async fn echo_unbounded(p: &Pair, len: usize) {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let (mut send, mut recv) = p.edge.open_bi().await.unwrap();
        send.write_all(&data).await.unwrap();
        send.finish().unwrap();
        let (mut csend, mut crecv) = p.cloud.accept_bi().await.unwrap();
        let got = crecv.read_to_end(len + 1).await.unwrap();
        assert_eq!(got, data);
        csend.write_all(&got).await.unwrap();
        csend.finish().unwrap();
        assert_eq!(recv.read_to_end(len + 1).await.unwrap(), data);
    }

    async fn wait_shed(config: &SlimServerConfig) {
        for _ in 0..500 {
            if config.sessions_holding_tls() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "{} sessions still hold rustls 5 s after their handshake ended",
            config.sessions_holding_tls()
        );
    }

    #[tokio::test]
    async fn sheds_rustls_after_the_handshake_and_still_answers() {
        let p = pair("edge-7").await;
        echo(&p, 1000).await;
        wait_shed(&p.config).await;

        // What the cloud reads from a connection, after the rustls
        // connection is gone.
        let chain = p
            .cloud
            .peer_identity()
            .unwrap()
            .downcast::<Vec<CertificateDer<'static>>>()
            .unwrap();
        assert_eq!(chain.len(), 1);
        assert_eq!(
            tether_certs::node_name_from_cert(&chain[0]).unwrap(),
            "edge-7"
        );
        let hd = p
            .cloud
            .handshake_data()
            .unwrap()
            .downcast::<HandshakeData>()
            .unwrap();
        assert_eq!(hd.protocol.as_deref(), Some(&b"tether-test"[..]));
        assert_eq!(hd.server_name.as_deref(), Some("cloud.test"));
        let mut out = [0u8; 16];
        assert!(p
            .cloud
            .export_keying_material(&mut out, b"label", b"context")
            .is_err());
    }

    #[tokio::test]
    async fn key_updates_from_either_side_keep_the_data_flowing() {
        let p = pair("edge-8").await;
        echo(&p, 10).await;
        wait_shed(&p.config).await;
        // Several updates each way: each derives the next update's keys from
        // the secrets the last one advanced.
        for round in 0..4 {
            // quinn ignores an update while the keys before the last one are
            // kept (three PTOs after it, well under 500 ms on loopback).
            tokio::time::sleep(Duration::from_millis(500)).await;
            if round % 2 == 0 {
                p.cloud.force_key_update();
            } else {
                p.edge.force_key_update();
            }
            echo(&p, 64 * 1024).await;
        }
        assert!(p.cloud.close_reason().is_none());
        assert!(p.edge.close_reason().is_none());
    }

    #[tokio::test]
    async fn a_refused_handshake_leaves_no_session_holding_rustls() {
        let p = pair("edge-9").await;
        wait_shed(&p.config).await;
        // An edge with no certificate: the cloud requires one.
        let bare = dialler(p.roots.clone(), None);
        let addr = p.listener.local_addr().unwrap();
        let accept = async {
            match p.listener.accept().await {
                Some(incoming) => incoming.await.err(),
                None => None,
            }
        };
        let (dialled, refused) = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(bare.connect(addr, "cloud.test").unwrap(), accept)
        })
        .await
        .expect("the refused handshake ends within 10 s");
        let refused = refused.expect("the cloud's side of the handshake failed");
        assert!(
            refused.to_string().contains("certificate"),
            "refused for the missing certificate: {refused}"
        );
        // The edge may learn of it only once its connection is used.
        if let Ok(conn) = dialled {
            let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed())
                .await
                .expect("the edge's connection closes within 10 s");
            assert!(closed.to_string().contains("certificate"), "{closed}");
        }
        wait_shed(&p.config).await;
        // The first connection is untouched.
        echo(&p, 100).await;
    }

    #[test]
    fn a_configuration_rustls_refuses_is_an_error_at_start_up() {
        let ca = Ca::new("test CA", DAY).unwrap();
        let server = ca.issue_server(&["cloud.test"], &[], DAY).unwrap();
        let mut tls = rustls::ServerConfig::builder_with_provider(tether_proto::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                certs_from_pem(&server.cert_pem, "server").unwrap(),
                key_from_pem(&server.key_pem, "server").unwrap(),
            )
            .unwrap();
        // QUIC allows early data of 0 or u32::MAX bytes only.
        tls.max_early_data_size = 1000;
        let err = SlimServerConfig::new(tls).err().expect("refused");
        assert!(matches!(err, SlimTlsError::Refused(_)), "{err}");
    }

    #[test]
    fn a_session_rustls_would_not_start_fails_its_handshake_only() {
        let suite = tether_proto::tls::provider()
            .cipher_suites
            .iter()
            .find_map(|cs| cs.tls13().and_then(|s| s.quic_suite()))
            .unwrap();
        let mut session = SlimSession::new(suite, Stage::Refused("a test".into()));
        use crypto::Session as _;
        assert!(session.is_handshaking());
        assert!(session.handshake_data().is_none());
        assert!(session.peer_identity().is_none());
        let mut out = Vec::new();
        assert!(session.write_handshake(&mut out).is_none() && out.is_empty());
        let err = session.read_handshake(b"ClientHello").unwrap_err();
        assert_eq!(err.code, TransportErrorCode::INTERNAL_ERROR);
        assert!(err.reason.contains("a test"), "{err}");
    }
}
