//! The peer link between cloud replicas: its listener, its TLS, and the
//! hello that tells each side who the other is.
//!
//! Replicas talk over QUIC on a listener of their own (`--peer-listen`), apart
//! from the edges' tunnel listener and the apiserver's kubelet-API listener, so
//! neither edges nor the apiserver have a port into it. Both directions use
//! mutual TLS with **peer certificates**: signed by the peer CA (`--peer-ca`)
//! and, checked explicitly after the handshake, carrying the peer identity of
//! [`tether_certs::identity::check_peer_cert`] — so an edge or apiserver
//! certificate cannot pass for a peer even if an operator signs everything
//! with one CA. Every replica dials the others with the fixed TLS server name
//! [`tether_certs::mint::PEER_SERVER_NAME`], whatever address it found them at.
//!
//! After the handshake the dialling side opens one bidirectional stream and
//! both sides exchange a [`Hello`]: the replica's name and a random instance
//! number drawn at start, by which a replica that dialled itself (its own
//! address in the DNS answer or the static list) recognises itself.
//! A connection that fails any of this is refused, logged with the remote
//! address and the reason, and counted in `tether_cloud_peers_refused`.
//! Every wait here is bounded by `--peer-timeout`; a link silent for that long
//! is closed by QUIC's idle timeout (keep-alives go out three times as often).
//!
//! After the hello, the side that was dialled serves the streams the dialler
//! opens on the link, each starting with a magic: a route subscription
//! ([`crate::routes`]) or a relayed request ([`crate::relay`]). So each
//! replica learns a peer's edges and relays to it over the link it dialled
//! itself, and a link's loss drops exactly what was learnt over it. The
//! link's datagrams carry the relayed copies of the interactive writes of
//! relayed streams ([`tether_proto::copies`]): the dialler asks for them
//! with a `hello`, the dialled side answers, and each side then sends them
//! for its part of a relay (the owner towards the edge, the holder back).
//!
//! Which peers to dial and what is known about them is [`crate::members`]'s job.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rustls::pki_types::CertificateDer;
use rustls::server::WebPkiClientVerifier;
use tether_certs::mint::PEER_SERVER_NAME;
use tether_certs::pem::{load_certs, load_key, load_roots};
use tether_proto::copies::{CopyCounters, CopyLink, CopySettings};
use tokio::io::AsyncReadExt;
use tracing::{debug, info, warn};

use crate::config::PeerConfig;
use crate::metrics::CloudMetrics;
use crate::registry::Registry;
use crate::relay::{self, RELAY_MAGIC};
use crate::routes::{self, SUBSCRIBE_MAGIC};

/// ALPN of the peer link.
pub const ALPN_PEER: &[u8] = b"tether-peer/1";
/// First bytes of a hello.
const HELLO_MAGIC: &[u8; 4] = b"TPH1";
/// Longest replica name in a hello.
const MAX_NAME: usize = 253;

/// QUIC application close codes on the peer link.
pub mod close_code {
    /// The certificate is not a peer certificate.
    pub const NOT_A_PEER: u32 = 0x501;
    /// No valid hello in time.
    pub const BAD_HELLO: u32 = 0x502;
    /// The replica dialled itself.
    pub const SELF: u32 = 0x503;
    /// The peer is no longer a member (left DNS / the list).
    pub const LEFT: u32 = 0x504;
}

/// Who a replica is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaId {
    /// Its name (pod name), for people.
    pub name: String,
    /// Random per process start: tells a replica apart from its own restart
    /// and from itself.
    pub instance: u64,
}

impl ReplicaId {
    /// This process's identity under `name`.
    pub fn new(name: &str) -> ReplicaId {
        ReplicaId {
            name: name.chars().take(MAX_NAME).collect(),
            instance: rand::random(),
        }
    }
}

/// The hello both ends send: magic, instance (u64 BE), name length (u16 BE), name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello(pub ReplicaId);

impl Hello {
    /// The hello's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let name = self.0.name.as_bytes();
        let mut v = Vec::with_capacity(14 + name.len());
        v.extend_from_slice(HELLO_MAGIC);
        v.extend_from_slice(&self.0.instance.to_be_bytes());
        v.extend_from_slice(&(name.len() as u16).to_be_bytes());
        v.extend_from_slice(name);
        v
    }

    /// Reads one hello from `r`.
    async fn read<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> Result<Hello, String> {
        let mut head = [0u8; 14];
        r.read_exact(&mut head)
            .await
            .map_err(|e| format!("reading the hello: {e}"))?;
        if &head[..4] != HELLO_MAGIC {
            return Err("not a peer hello".into());
        }
        let instance = u64::from_be_bytes(head[4..12].try_into().unwrap_or_default());
        let len = u16::from_be_bytes([head[12], head[13]]) as usize;
        if len > MAX_NAME {
            return Err(format!("replica name of {len} bytes (at most {MAX_NAME})"));
        }
        let mut name = vec![0u8; len];
        r.read_exact(&mut name)
            .await
            .map_err(|e| format!("reading the hello: {e}"))?;
        let name = String::from_utf8(name).map_err(|_| "replica name is not UTF-8".to_string())?;
        Ok(Hello(ReplicaId { name, instance }))
    }
}

/// Why a peer connection failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("connecting: {0}")]
    Connect(String),
    #[error("refused: {0}")]
    Refused(String),
    #[error("that address is this replica")]
    IsSelf,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    tether_proto::tls::provider()
}

fn transport(cfg: &PeerConfig) -> anyhow::Result<Arc<quinn::TransportConfig>> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(cfg.timeout).context("--peer-timeout too large")?,
    ));
    t.keep_alive_interval(Some(cfg.timeout / 3));
    // One stream per relayed request for as long as it runs (quinn's default
    // of 100 made the 101st concurrent relay to one peer wait and fail).
    t.max_concurrent_bidi_streams(cfg.max_streams.into());
    // Relayed copies of interactive writes ([`tether_proto::copies`]).
    t.datagram_receive_buffer_size(Some(cfg.datagram_buffer));
    t.datagram_send_buffer_size(cfg.datagram_buffer);
    Ok(Arc::new(t))
}

/// Binds the peer listener: one QUIC endpoint that accepts peers and dials them.
pub fn bind(cfg: &PeerConfig) -> anyhow::Result<quinn::Endpoint> {
    let chain = load_certs(&cfg.cert).context("loading --peer-cert")?;
    let key = load_key(&cfg.key).context("loading --peer-key")?;
    let roots = Arc::new(load_roots(&cfg.ca).context("loading --peer-ca")?);
    let transport = transport(cfg)?;

    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .context("building the peer certificate verifier")?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with ring")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .context("--peer-cert and --peer-key do not match")?;
    server.alpn_protocols = vec![ALPN_PEER.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(server)
        .context("QUIC TLS configuration of the peer listener")?;
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    sc.transport_config(transport.clone());
    sc.migration(false);

    let mut client = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with ring")?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .context("--peer-cert and --peer-key do not match")?;
    client.alpn_protocols = vec![ALPN_PEER.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(client)
        .context("QUIC TLS configuration of the peer dialler")?;
    let mut cc = quinn::ClientConfig::new(Arc::new(crypto));
    cc.transport_config(transport);

    let mut endpoint = quinn::Endpoint::server(sc, cfg.listen)
        .with_context(|| format!("binding the peer listener UDP {}", cfg.listen))?;
    endpoint.set_default_client_config(cc);
    Ok(endpoint)
}

/// Checks that the other end of `conn` presented a peer certificate.
fn check_identity(conn: &quinn::Connection) -> Result<(), String> {
    let certs = conn
        .peer_identity()
        .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or_else(|| "no certificate".to_string())?;
    let leaf = certs.first().ok_or_else(|| "no certificate".to_string())?;
    tether_certs::identity::check_peer_cert(leaf).map_err(|e| e.to_string())
}

/// A live, identified link to another replica.
#[derive(Debug, Clone)]
pub struct PeerLink {
    pub addr: SocketAddr,
    pub replica: ReplicaId,
    pub conn: quinn::Connection,
    /// `conn`'s copy path: relayed copies of interactive writes.
    pub copies: Arc<CopyLink>,
}

impl PeerLink {
    /// For tests: the link over `conn` to a replica named `name`, at the
    /// connection's remote address, with default copy settings.
    #[cfg(test)]
    pub(crate) fn for_test(name: &str, conn: quinn::Connection) -> PeerLink {
        PeerLink::new(
            conn.remote_address(),
            ReplicaId::new(name),
            conn,
            Default::default(),
            Default::default(),
        )
    }

    /// The link over `conn` to `replica` at `addr`, its relayed copies sent
    /// within `copies` and counted in `counters`.
    pub fn new(
        addr: SocketAddr,
        replica: ReplicaId,
        conn: quinn::Connection,
        copies: CopySettings,
        counters: CopyCounters,
    ) -> PeerLink {
        PeerLink {
            addr,
            replica,
            copies: CopyLink::new(conn.clone(), copies, counters),
            conn,
        }
    }
}

/// Dials the replica at `addr`: handshake, identity check, hello; all within
/// `timeout`. The link's relayed copies are sent within `copies`.
pub async fn dial(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    me: &ReplicaId,
    timeout: Duration,
    copies: CopySettings,
    metrics: &CloudMetrics,
) -> Result<PeerLink, PeerError> {
    let attempt = async {
        let conn = endpoint
            .connect(addr, PEER_SERVER_NAME)
            .map_err(|e| PeerError::Connect(e.to_string()))?
            .await
            .map_err(|e| PeerError::Connect(e.to_string()))?;
        if let Err(why) = check_identity(&conn) {
            metrics.refuse_peer("not_a_peer");
            conn.close(close_code::NOT_A_PEER.into(), b"not a peer certificate");
            return Err(PeerError::Refused(format!("its certificate: {why}")));
        }
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| PeerError::Connect(e.to_string()))?;
        send.write_all(&Hello(me.clone()).encode())
            .await
            .map_err(|e| PeerError::Connect(e.to_string()))?;
        let _ = send.finish();
        let Hello(replica) = match Hello::read(&mut recv).await {
            Ok(h) => h,
            Err(why) => {
                metrics.refuse_peer("bad_hello");
                conn.close(close_code::BAD_HELLO.into(), b"bad hello");
                return Err(PeerError::Refused(why));
            }
        };
        if replica.instance == me.instance {
            conn.close(close_code::SELF.into(), b"self");
            return Err(PeerError::IsSelf);
        }
        Ok(PeerLink::new(
            addr,
            replica,
            conn,
            copies,
            metrics.copies.clone(),
        ))
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| PeerError::Timeout(timeout))?
}

/// Accepts peer connections until the endpoint closes. A connection that is
/// not a peer's is refused and logged; a peer's streams are served until it
/// closes.
/// Told who dialled from where, after its hello.
pub type OnHello = Arc<dyn Fn(SocketAddr, &ReplicaId) + Send + Sync>;

/// `on_hello` is told who dialled from where (so a restarted peer is seen at once).
pub async fn serve(
    endpoint: quinn::Endpoint,
    me: ReplicaId,
    cfg: PeerConfig,
    registry: Arc<Registry>,
    metrics: CloudMetrics,
    on_hello: OnHello,
) -> anyhow::Result<()> {
    let timeout = cfg.timeout;
    while let Some(incoming) = endpoint.accept().await {
        let me = me.clone();
        let metrics = metrics.clone();
        let registry = registry.clone();
        let on_hello = on_hello.clone();
        let max = cfg.max_message_bytes;
        let copy_settings = cfg.copies;
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            match tokio::time::timeout(timeout, accept(incoming, &me, &metrics)).await {
                Ok(Ok((replica, conn))) => {
                    if replica.instance != me.instance {
                        info!(%remote, peer = %replica.name, "peer connected");
                        on_hello(remote, &replica);
                    }
                    let copies = CopyLink::new(conn.clone(), copy_settings, metrics.copies.clone());
                    let reg = registry.clone();
                    let copies_in = copies.serve(move |c| reg.copy_to_edge(c), &replica.name);
                    let streams = serve_streams(
                        &conn,
                        &replica.name,
                        &copies,
                        registry,
                        metrics,
                        max,
                        timeout,
                    );
                    // Both end with the connection.
                    tokio::join!(copies_in, streams);
                    let why = conn.closed().await;
                    debug!(%remote, peer = %replica.name, reason = %why, "peer connection closed");
                }
                Ok(Err(why)) => warn!(%remote, reason = %why, "refused a peer connection"),
                Err(_) => {
                    metrics.refuse_peer("timeout");
                    warn!(%remote, ?timeout, "refused a peer connection: no hello in time")
                }
            }
        });
    }
    Ok(())
}

/// Serves the streams a peer opens on the link it dialled: route
/// subscriptions and relays, told apart by their magic.
async fn serve_streams(
    conn: &quinn::Connection,
    peer: &str,
    copies: &Arc<CopyLink>,
    registry: Arc<Registry>,
    metrics: CloudMetrics,
    max: usize,
    timeout: Duration,
) {
    while let Ok((send, mut recv)) = conn.accept_bi().await {
        let registry = registry.clone();
        let metrics = metrics.clone();
        let peer = peer.to_string();
        let copies = copies.clone();
        tokio::spawn(async move {
            let mut magic = [0u8; 4];
            match tokio::time::timeout(timeout, recv.read_exact(&mut magic)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return debug!(%peer, error = %e, "peer stream ended before its magic")
                }
                Err(_) => return info!(%peer, ?timeout, "peer stream sent no magic in time"),
            }
            if &magic == SUBSCRIBE_MAGIC {
                if let Err(e) = routes::publish(send, registry, max, timeout, peer.clone()).await {
                    info!(%peer, error = %e, "route subscription of a peer ended");
                }
            } else if &magic == RELAY_MAGIC {
                relay::serve(send, recv, registry, metrics, copies, peer, timeout).await;
            } else {
                warn!(%peer, magic = ?magic, "refusing a peer stream of unknown kind");
                let mut send = send;
                let _ = send.reset(quinn::VarInt::from_u32(close_code::BAD_HELLO));
            }
        });
    }
}

/// One incoming peer connection up to its hello.
async fn accept(
    incoming: quinn::Incoming,
    me: &ReplicaId,
    metrics: &CloudMetrics,
) -> Result<(ReplicaId, quinn::Connection), String> {
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            metrics.refuse_peer("tls");
            return Err(format!(
                "handshake failed (certificate not from the peer CA?): {e}"
            ));
        }
    };
    if let Err(why) = check_identity(&conn) {
        metrics.refuse_peer("not_a_peer");
        conn.close(close_code::NOT_A_PEER.into(), b"not a peer certificate");
        return Err(format!("not a peer certificate: {why}"));
    }
    let (mut send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("waiting for the hello: {e}"))?;
    let Hello(replica) = match Hello::read(&mut recv).await {
        Ok(h) => h,
        Err(why) => {
            metrics.refuse_peer("bad_hello");
            conn.close(close_code::BAD_HELLO.into(), b"bad hello");
            return Err(why);
        }
    };
    send.write_all(&Hello(me.clone()).encode())
        .await
        .map_err(|e| format!("answering the hello: {e}"))?;
    let _ = send.finish();
    Ok((replica, conn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hello_round_trips_and_rejects_garbage() {
        let h = Hello(ReplicaId::new("tether-cloud-0"));
        let bytes = h.encode();
        assert_eq!(Hello::read(&mut &bytes[..]).await.unwrap(), h);
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(Hello::read(&mut &bad[..]).await.is_err());
        let mut long = bytes[..12].to_vec();
        long.extend_from_slice(&1000u16.to_be_bytes());
        assert!(Hello::read(&mut &long[..]).await.is_err());
        assert!(Hello::read(&mut &bytes[..5]).await.is_err());
    }
}
