//! The relay: one apiserver request carried over the peer link from the
//! replica it landed on (the *entry*) to the replica that holds the edge (the
//! *holder*), bytes untouched.
//!
//! The entry opens one bidirectional QUIC stream on the peer link it dialled
//! to the holder and writes a [`RelayHeader`] (magic, stream kind, node name);
//! the holder answers with one [`Answer`]: `Open`, then the stream is a byte
//! pipe between the entry and a logical stream of the holder's own session
//! with the edge; or `NotHere` / `TooManyStreams` / `Ended` with a message,
//! and the entry answers the apiserver itself. Everything after the answer is
//! the request head, body and upgraded bytes the entry writes and the response
//! the edge sends, copied as they come: QUIC's flow control on the peer link
//! and on the edge's stream give backpressure end to end.
//!
//! **Never relayed twice, by construction.** The holder serves a relay only
//! from its *local* sessions ([`crate::registry::Registry::local_session`]),
//! never from what it learnt about other replicas: a relay for an edge it does
//! not hold itself is answered `NotHere`, whatever its routes say. The entry
//! then decides again from its own table (a stale route, counted) — one hop,
//! always.
//!
//! Resets cross the link as QUIC stream resets whose code carries the
//! [`ResetCode`] (`0x100 + code`), so the entry maps an edge's reset to the
//! same HTTP outcome as for a local stream. The entry side's stream is
//! [`RelayIo`]; [`EdgeIo`] and [`Resetter`] are what [`crate::forward`]
//! writes to and resets, local or relayed alike.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tether_proto::frame::ResetCode;
use tether_proto::io::{ResumableIo, SharedStream, StreamReset};
use tether_proto::ops::ByteCounters;
use tether_proto::route::StreamKind;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tracing::{debug, info, Instrument};

use crate::metrics::CloudMetrics;
use crate::registry::Registry;
use crate::session::OpenError;

/// First bytes of a relay stream.
pub const RELAY_MAGIC: &[u8; 4] = b"TPR1";
/// Longest node name in a relay header (a DNS subdomain name).
const MAX_NODE: usize = 253;
/// Longest message in an answer.
const MAX_MESSAGE: usize = 1024;
/// Copy buffer of the holder's pipe.
const PIPE_BUF: usize = 64 * 1024;

/// What the entry asks the holder for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayHeader {
    pub kind: StreamKind,
    pub node: String,
}

fn kind_code(k: StreamKind) -> u8 {
    match k {
        StreamKind::Exec => 1,
        StreamKind::Attach => 2,
        StreamKind::PortForward => 3,
        StreamKind::Logs => 4,
        StreamKind::Metrics => 5,
        StreamKind::Other => 6,
    }
}

fn kind_of(c: u8) -> Option<StreamKind> {
    Some(match c {
        1 => StreamKind::Exec,
        2 => StreamKind::Attach,
        3 => StreamKind::PortForward,
        4 => StreamKind::Logs,
        5 => StreamKind::Metrics,
        6 => StreamKind::Other,
        _ => return None,
    })
}

/// Why a relay header or answer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("not a relay stream")]
    BadMagic,
    #[error("unknown stream kind {0}")]
    BadKind(u8),
    #[error("node name of {0} bytes (at most {MAX_NODE})")]
    NodeTooLong(usize),
    #[error("a name or message that is not UTF-8")]
    NotUtf8,
    #[error("unknown answer {0}")]
    BadAnswer(u8),
    #[error("message of {0} bytes (at most {MAX_MESSAGE})")]
    MessageTooLong(usize),
    #[error("peer link: {0}")]
    Io(#[from] io::Error),
    #[error("opening a stream on the peer link: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("replica {replica} did not answer within {timeout:?} (--peer-timeout)")]
    Timeout { replica: String, timeout: Duration },
}

impl RelayHeader {
    /// The header's bytes: magic, kind (u8), name length (u16 BE), name.
    pub fn encode(&self) -> Vec<u8> {
        let name = self.node.as_bytes();
        let mut v = Vec::with_capacity(7 + name.len());
        v.extend_from_slice(RELAY_MAGIC);
        v.push(kind_code(self.kind));
        v.extend_from_slice(&(name.len().min(u16::MAX as usize) as u16).to_be_bytes());
        v.extend_from_slice(name);
        v
    }

    /// Reads a header whose magic has already been read.
    pub async fn read_after_magic<R: AsyncRead + Unpin>(r: &mut R) -> Result<Self, RelayError> {
        let mut b = [0u8; 3];
        r.read_exact(&mut b).await?;
        let kind = kind_of(b[0]).ok_or(RelayError::BadKind(b[0]))?;
        let len = u16::from_be_bytes([b[1], b[2]]) as usize;
        if len > MAX_NODE {
            return Err(RelayError::NodeTooLong(len));
        }
        let mut name = vec![0u8; len];
        r.read_exact(&mut name).await?;
        let node = String::from_utf8(name).map_err(|_| RelayError::NotUtf8)?;
        Ok(RelayHeader { kind, node })
    }
}

/// The holder's answer to a relay header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The stream to the edge is open: bytes follow.
    Open,
    /// This replica does not hold the edge (a stale route at the entry).
    NotHere(String),
    /// The edge is at `--max-streams-per-edge`.
    TooManyStreams(String),
    /// The edge's session here has ended.
    Ended(String),
}

impl Answer {
    /// Status byte, then (not for `Open`) a u16 BE length and the message.
    pub fn encode(&self) -> Vec<u8> {
        let (code, msg) = match self {
            Answer::Open => return vec![0],
            Answer::NotHere(m) => (1, m),
            Answer::TooManyStreams(m) => (2, m),
            Answer::Ended(m) => (3, m),
        };
        let mut m = msg.as_bytes();
        if m.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !msg.is_char_boundary(end) {
                end -= 1;
            }
            m = &m[..end];
        }
        let mut v = vec![code];
        v.extend_from_slice(&(m.len() as u16).to_be_bytes());
        v.extend_from_slice(m);
        v
    }

    /// Reads one answer.
    pub async fn read<R: AsyncRead + Unpin>(r: &mut R) -> Result<Self, RelayError> {
        let code = r.read_u8().await?;
        if code == 0 {
            return Ok(Answer::Open);
        }
        if code > 3 {
            return Err(RelayError::BadAnswer(code));
        }
        let len = r.read_u16().await? as usize;
        if len > MAX_MESSAGE {
            return Err(RelayError::MessageTooLong(len));
        }
        let mut m = vec![0u8; len];
        r.read_exact(&mut m).await?;
        let m = String::from_utf8(m).map_err(|_| RelayError::NotUtf8)?;
        Ok(match code {
            1 => Answer::NotHere(m),
            2 => Answer::TooManyStreams(m),
            _ => Answer::Ended(m),
        })
    }
}

const RESET_BASE: u32 = 0x100;
const RESET_CODES: [ResetCode; 9] = [
    ResetCode::Cancelled,
    ResetCode::KubeletUnreachable,
    ResetCode::Refused,
    ResetCode::ProtocolError,
    ResetCode::SessionLost,
    ResetCode::UnknownStream,
    ResetCode::Shutdown,
    ResetCode::LimitExceeded,
    ResetCode::Internal,
];

/// The QUIC stream error code that carries `code` over the peer link.
pub fn reset_varint(code: ResetCode) -> quinn::VarInt {
    let i = RESET_CODES.iter().position(|c| *c == code).unwrap_or(8) as u32;
    quinn::VarInt::from_u32(RESET_BASE + i)
}

/// The reset code a QUIC stream error code from a peer carries (an unknown
/// one is `Internal`).
pub fn reset_of(v: quinn::VarInt) -> ResetCode {
    v.into_inner()
        .checked_sub(RESET_BASE as u64)
        .and_then(|i| RESET_CODES.get(i as usize).copied())
        .unwrap_or(ResetCode::Internal)
}

/// Entry side: asks the holder on `conn` for a stream to `node`. Bounded by
/// `timeout` up to the answer.
pub async fn open(
    conn: &quinn::Connection,
    replica: &str,
    header: &RelayHeader,
    timeout: Duration,
    counters: ByteCounters,
) -> Result<Result<RelayIo, Answer>, RelayError> {
    let attempt = async {
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&header.encode())
            .await
            .map_err(io::Error::from)?;
        let answer = Answer::read(&mut recv).await?;
        Ok::<_, RelayError>(match answer {
            Answer::Open => Ok(RelayIo {
                send,
                recv,
                reset: Arc::new(Resetting::default()),
                finished: false,
                counters,
            }),
            other => Err(other),
        })
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| RelayError::Timeout {
            replica: replica.to_string(),
            timeout,
        })?
}

/// A reset asked for on a relayed stream; it goes out when the stream is dropped.
#[derive(Debug, Default)]
pub struct Resetting(Mutex<Option<ResetCode>>);

/// The entry side of a relayed stream.
pub struct RelayIo {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    reset: Arc<Resetting>,
    finished: bool,
    counters: ByteCounters,
}

impl AsyncRead for RelayIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.recv).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = (buf.filled().len() - before) as u64;
                self.counters.received.inc_by(n);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(map_read_error(e))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A peer's stream reset becomes the [`StreamReset`] the edge's reset would
/// have been, so a relayed request fails exactly like a local one.
fn map_read_error(e: io::Error) -> io::Error {
    let code = match e
        .get_ref()
        .and_then(|i| i.downcast_ref::<quinn::ReadError>())
    {
        Some(quinn::ReadError::Reset(code)) => reset_of(*code),
        Some(quinn::ReadError::ConnectionLost(_)) => ResetCode::SessionLost,
        _ => return e,
    };
    StreamReset::io_error(code, &format!("over the peer link: {e}"))
}

impl AsyncWrite for RelayIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.send).poll_write(cx, buf);
        match r {
            Poll::Ready(Ok(n)) => {
                self.counters.sent.inc_by(n as u64);
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e.into())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.send).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.send).poll_shutdown(cx);
        if let Poll::Ready(Ok(())) = r {
            self.finished = true;
        }
        r
    }
}

impl Drop for RelayIo {
    fn drop(&mut self) {
        let asked = *self.reset.0.lock().unwrap_or_else(|p| p.into_inner());
        match asked {
            Some(code) => {
                let v = reset_varint(code);
                let _ = self.send.reset(v);
                let _ = self.recv.stop(v);
            }
            None if !self.finished => {
                let _ = self.send.reset(reset_varint(ResetCode::Cancelled));
            }
            None => {}
        }
    }
}

/// The stream [`crate::forward`] talks to: a local logical stream or a relayed one.
pub enum EdgeIo {
    Local(ResumableIo),
    Relayed(RelayIo),
}

/// Resets an [`EdgeIo`] from anywhere (the stream's halves may be elsewhere).
#[derive(Clone)]
pub enum Resetter {
    Local(Arc<SharedStream>),
    Relayed(Arc<Resetting>),
}

impl Resetter {
    /// Resets the stream: at once for a local one; for a relayed one when
    /// its last half is dropped (the holder then resets the edge's stream).
    pub fn reset(&self, code: ResetCode, message: impl Into<String>) {
        match self {
            Resetter::Local(s) => s.reset(code, message),
            Resetter::Relayed(r) => {
                debug!(code = ?code, message = %message.into(), "resetting a relayed stream");
                *r.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(code);
            }
        }
    }
}

impl EdgeIo {
    /// The handle that resets this stream.
    pub fn resetter(&self) -> Resetter {
        match self {
            EdgeIo::Local(io) => Resetter::Local(io.shared().clone()),
            EdgeIo::Relayed(r) => Resetter::Relayed(r.reset.clone()),
        }
    }
}

impl AsyncRead for EdgeIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EdgeIo::Local(io) => Pin::new(io).poll_read(cx, buf),
            EdgeIo::Relayed(io) => Pin::new(io).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for EdgeIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            EdgeIo::Local(io) => Pin::new(io).poll_write(cx, buf),
            EdgeIo::Relayed(io) => Pin::new(io).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EdgeIo::Local(io) => Pin::new(io).poll_flush(cx),
            EdgeIo::Relayed(io) => Pin::new(io).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EdgeIo::Local(io) => Pin::new(io).poll_shutdown(cx),
            EdgeIo::Relayed(io) => Pin::new(io).poll_shutdown(cx),
        }
    }
}

/// Holder side: serves one relay stream whose magic has been read, from this
/// replica's **local** sessions only.
pub async fn serve(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    registry: Arc<Registry>,
    metrics: CloudMetrics,
    peer: String,
    timeout: Duration,
) {
    let header = match tokio::time::timeout(timeout, RelayHeader::read_after_magic(&mut recv)).await
    {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            info!(%peer, error = %e, "refusing a bad relay stream from a peer");
            let _ = send.reset(reset_varint(ResetCode::ProtocolError));
            return;
        }
        Err(_) => {
            info!(%peer, ?timeout, "no relay header in time");
            let _ = send.reset(reset_varint(ResetCode::ProtocolError));
            return;
        }
    };
    let span =
        tracing::info_span!("relayed", %peer, node = %header.node, kind = header.kind.as_str());
    async move {
        let answer = |a: Answer| a.encode();
        let session = match registry.local_session(&header.node) {
            Some(s) => s,
            None => {
                metrics.relay_refused("not_here");
                debug!("relay for an edge this replica does not hold");
                let _ = send
                    .write_all(&answer(Answer::NotHere(format!(
                        "edge {} is not connected to this replica",
                        header.node
                    ))))
                    .await;
                let _ = send.finish();
                return;
            }
        };
        let io = match session.open_stream(header.kind) {
            Ok((_, io)) => io,
            Err(e) => {
                let a = match &e {
                    OpenError::TooManyStreams { .. } => Answer::TooManyStreams(e.to_string()),
                    OpenError::Ended { .. } => Answer::Ended(e.to_string()),
                    // The entry routes again and finds the edge where it went.
                    OpenError::Moving { .. } => Answer::NotHere(e.to_string()),
                };
                metrics.relay_refused(match a {
                    Answer::TooManyStreams(_) => "too_many_streams",
                    Answer::NotHere(_) => "moving",
                    _ => "ended",
                });
                let _ = send.write_all(&answer(a)).await;
                let _ = send.finish();
                return;
            }
        };
        if send.write_all(&answer(Answer::Open)).await.is_err() {
            io.shared()
                .reset(ResetCode::Cancelled, "the entry replica went away");
            return;
        }
        metrics
            .relayed_streams
            .get_or_create(&crate::metrics::RoleLabel { role: "holder" })
            .inc();
        let _open = metrics.stream_opened(header.kind);
        pipe(io.with_counters(metrics.bytes.clone()), send, recv).await;
    }
    .instrument(span)
    .await
}

/// Copies both ways between the edge's logical stream and the peer's relay
/// stream until both directions end; a reset on either side resets the other.
async fn pipe(io: ResumableIo, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
    let shared = io.shared().clone();
    let (mut lr, mut lw) = tokio::io::split(io);
    let up = {
        let shared = shared.clone();
        async move {
            let mut buf = vec![0u8; PIPE_BUF];
            loop {
                match recv.read(&mut buf).await {
                    Ok(Some(n)) => {
                        if let Err(e) = lw.write_all(&buf[..n]).await {
                            debug!(error = %e, "edge stream closed while relaying");
                            let _ = recv.stop(reset_varint(ResetCode::Cancelled));
                            return;
                        }
                    }
                    Ok(None) => {
                        let _ = lw.shutdown().await;
                        return;
                    }
                    Err(quinn::ReadError::Reset(code)) => {
                        shared.reset(reset_of(code), "the entry replica reset the relayed stream");
                        return;
                    }
                    Err(e) => {
                        shared.reset(ResetCode::Cancelled, format!("peer link: {e}"));
                        return;
                    }
                }
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; PIPE_BUF];
        loop {
            match lr.read(&mut buf).await {
                Ok(0) => {
                    let _ = send.finish();
                    return;
                }
                Ok(n) => {
                    if let Err(e) = send.write_all(&buf[..n]).await {
                        shared.reset(ResetCode::Cancelled, format!("peer link: {e}"));
                        return;
                    }
                }
                Err(e) => {
                    let code = StreamReset::from_io(&e)
                        .map(|r| r.code)
                        .unwrap_or(ResetCode::Internal);
                    let _ = send.reset(reset_varint(code));
                    return;
                }
            }
        }
    };
    tokio::join!(up, down);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn header_and_answer_round_trip_and_garbage_is_refused() {
        let h = RelayHeader {
            kind: StreamKind::Exec,
            node: "edge-1".into(),
        };
        let b = h.encode();
        assert_eq!(&b[..4], RELAY_MAGIC);
        let got = RelayHeader::read_after_magic(&mut &b[4..]).await.unwrap();
        assert_eq!(got, h);
        let mut bad = b.clone();
        bad[4] = 99;
        assert!(matches!(
            RelayHeader::read_after_magic(&mut &bad[4..]).await,
            Err(RelayError::BadKind(99))
        ));
        let mut long = b[..5].to_vec();
        long.extend_from_slice(&1000u16.to_be_bytes());
        assert!(matches!(
            RelayHeader::read_after_magic(&mut &long[4..]).await,
            Err(RelayError::NodeTooLong(1000))
        ));
        assert!(RelayHeader::read_after_magic(&mut &b[4..6]).await.is_err());

        for a in [
            Answer::Open,
            Answer::NotHere("edge-1 is not here".into()),
            Answer::TooManyStreams("x".into()),
            Answer::Ended(String::new()),
        ] {
            let e = a.encode();
            assert_eq!(Answer::read(&mut &e[..]).await.unwrap(), a);
        }
        assert!(matches!(
            Answer::read(&mut &[9u8][..]).await,
            Err(RelayError::BadAnswer(9))
        ));
        let huge = Answer::NotHere("é".repeat(2000)).encode();
        assert!(matches!(
            Answer::read(&mut &huge[..]).await,
            Ok(Answer::NotHere(m)) if m.len() <= MAX_MESSAGE
        ));
    }

    #[test]
    fn every_reset_code_crosses_the_link() {
        for c in RESET_CODES {
            assert_eq!(reset_of(reset_varint(c)), c);
        }
        assert_eq!(reset_of(quinn::VarInt::from_u32(7)), ResetCode::Internal);
        assert_eq!(
            reset_of(quinn::VarInt::from_u32(0x1ff)),
            ResetCode::Internal
        );
    }
}

/// A QUIC connection pair on loopback, for tests of what crosses the peer link.
#[cfg(test)]
pub(crate) mod testlink {
    use std::sync::Arc;

    use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

    /// (dialler's connection, listener's connection), kept alive by the endpoints.
    pub async fn pair() -> (quinn::Connection, quinn::Connection, Vec<quinn::Endpoint>) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
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
}

#[cfg(test)]
mod link_tests {
    use std::sync::Arc;
    use std::time::Duration;

    use prometheus_client::registry::Registry as Prom;
    use tether_proto::Limits;

    use super::*;
    use crate::admission::Claim;
    use crate::peer::{PeerLink, ReplicaId};
    use crate::registry::{Holder, Registry};
    use crate::routes::{EdgeRecord, Update};
    use crate::session::Session;

    fn record(node: &str, pods: &[&str], attached: bool, since_ms: u64) -> EdgeRecord {
        EdgeRecord {
            node: node.into(),
            session: "s".into(),
            attached,
            since_ms,
            pods: pods
                .iter()
                .map(|p| ("default".to_string(), p.to_string()))
                .collect(),
            addresses: vec![],
        }
    }

    fn session(node: &str) -> Arc<Session> {
        let claim = Claim {
            token: tether_proto::token::ResumeToken([1; 16]),
            instance: 1,
            attempt: 1,
        };
        Session::new(node.into(), vec![], Limits::default(), &claim).unwrap()
    }

    /// Serves one relay for `node` from `registry` and returns the answer.
    async fn ask(
        entry: &quinn::Connection,
        holder: &quinn::Connection,
        registry: Arc<Registry>,
        node: &str,
    ) -> Answer {
        let metrics = CloudMetrics::register(&mut Prom::default());
        let holder = holder.clone();
        tokio::spawn(async move {
            let (send, mut recv) = holder.accept_bi().await.unwrap();
            let mut magic = [0u8; 4];
            recv.read_exact(&mut magic).await.unwrap();
            assert_eq!(&magic, RELAY_MAGIC);
            serve(
                send,
                recv,
                registry,
                metrics,
                "entry".into(),
                Duration::from_secs(5),
            )
            .await;
        });
        let header = RelayHeader {
            kind: StreamKind::Logs,
            node: node.into(),
        };
        match open(
            entry,
            "holder",
            &header,
            Duration::from_secs(5),
            ByteCounters::default(),
        )
        .await
        .unwrap()
        {
            Ok(_) => Answer::Open,
            Err(a) => a,
        }
    }

    #[tokio::test]
    async fn a_replica_relays_only_what_it_holds_itself_never_a_second_hop() {
        let (entry, holder, _eps) = testlink::pair().await;
        // The holder side's registry knows edge-x only from a third replica.
        let registry = Arc::new(Registry::new(Duration::from_secs(60)));
        let (third, _third_side, _eps2) = testlink::pair().await;
        let link = PeerLink {
            addr: third.remote_address(),
            replica: ReplicaId::new("third"),
            conn: third,
        };
        registry.apply_remote(
            &link,
            Update::Upsert(vec![record("edge-x", &["p"], true, 1)]),
        );
        assert!(matches!(
            registry.route_pod("default", "p").unwrap().holder,
            Holder::Remote { .. }
        ));
        let a = ask(&entry, &holder, registry.clone(), "edge-x").await;
        assert!(matches!(a, Answer::NotHere(_)), "{a:?}");
        // What it holds itself it serves.
        registry.insert(session("edge-y"));
        assert_eq!(ask(&entry, &holder, registry, "edge-y").await, Answer::Open);
    }

    #[tokio::test]
    async fn routes_learnt_from_peers_share_the_indices_and_prefer_a_live_holder() {
        let (c1, _s1, _e1) = testlink::pair().await;
        let (c2, _s2, _e2) = testlink::pair().await;
        let peer = |name: &str, conn: quinn::Connection| PeerLink {
            addr: conn.remote_address(),
            replica: ReplicaId::new(name),
            conn,
        };
        let (a, b) = (peer("a", c1), peer("b", c2));
        let r = Registry::new(Duration::from_secs(60));
        // A pod claimed by edges held on two different replicas: 409, as on one.
        r.apply_remote(
            &a,
            Update::Upsert(vec![record("edge-1", &["dup", "p1"], true, 1)]),
        );
        r.apply_remote(
            &b,
            Update::Upsert(vec![record("edge-2", &["dup"], true, 1)]),
        );
        assert!(matches!(
            r.route_pod("default", "dup"),
            Err(crate::registry::RouteError::AmbiguousPod { .. })
        ));
        // ... and a local edge claiming it too.
        let local = session("edge-3");
        r.insert(local.clone());
        r.report_pods(
            &local,
            vec![tether_proto::handshake::PodRef {
                namespace: "default".into(),
                name: "p1".into(),
                uid: String::new(),
            }],
        );
        assert!(matches!(
            r.route_pod("default", "p1"),
            Err(crate::registry::RouteError::AmbiguousPod { .. })
        ));
        assert!(matches!(
            r.route_pod("default", "nope"),
            Err(crate::registry::RouteError::UnknownPod { .. })
        ));
        // The same node on two peers (it moved): the attached holder wins,
        // the newest if both are.
        r.apply_remote(
            &b,
            Update::Upsert(vec![record("edge-1", &["p9"], false, 5)]),
        );
        let who = |r: &Registry| match r.route_node(None, Some("edge-1"), None).unwrap().holder {
            Holder::Remote { replica, .. } => replica.name,
            Holder::Local(_) => "local".into(),
        };
        assert_eq!(who(&r), "a");
        r.apply_remote(&b, Update::Upsert(vec![record("edge-1", &["p9"], true, 5)]));
        assert_eq!(who(&r), "b");
        // A detached local session loses to a live remote holder of the node.
        r.apply_remote(&a, Update::Upsert(vec![record("edge-3", &[], true, 9)]));
        assert!(matches!(
            r.route_node(None, Some("edge-3"), None).unwrap().holder,
            Holder::Remote { .. }
        ));
        // Both "live": the newer attach wins, here or there (an edge killed
        // without a word still looks attached to its old holder).
        let (c3, _s3, _e3) = testlink::pair().await;
        let live = session("edge-4");
        let claim = Claim {
            token: tether_proto::token::ResumeToken([1; 16]),
            instance: 1,
            attempt: 1,
        };
        live.attach_connection(c3, &claim).unwrap();
        r.insert(live.clone());
        let attached_ms = live
            .connected_since()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        r.apply_remote(
            &a,
            Update::Upsert(vec![record("edge-4", &[], true, attached_ms - 1000)]),
        );
        assert!(matches!(
            r.route_node(None, Some("edge-4"), None).unwrap().holder,
            Holder::Local(_)
        ));
        r.apply_remote(
            &a,
            Update::Upsert(vec![record("edge-4", &[], true, attached_ms + 1000)]),
        );
        assert!(matches!(
            r.route_node(None, Some("edge-4"), None).unwrap().holder,
            Holder::Remote { .. }
        ));
        // Everything learnt from a peer goes with it; counts stay right.
        r.drop_remote(b.replica.instance);
        assert_eq!(who(&r), "a");
        assert!(
            r.route_pod("default", "dup").is_ok(),
            "edge-1 alone claims it now"
        );
        r.apply_remote(&a, Update::Remove(vec!["edge-1".into()]));
        // Held nowhere now: its pods are "edge not connected" (502), not unknown.
        assert!(matches!(
            r.route_pod("default", "dup"),
            Err(crate::registry::RouteError::PodNodeGone { .. })
        ));
        assert_eq!(r.remote_len(), 2, "edge-3 and edge-4 from a");
    }
}
