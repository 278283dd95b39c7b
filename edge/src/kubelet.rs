//! The one kubelet endpoint the edge may reach.
//!
//! [`KubeletTarget`] is built once from configuration: its scheme, address and
//! TLS settings are fixed, and [`KubeletTarget::connect`] can only ever open a
//! connection to that address. Requests from the cloud choose a path, never a
//! host, so the cloud cannot make the edge connect anywhere else.

use std::sync::Arc;

use anyhow::Context;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use serde::Deserialize;
use tether_proto::handshake::PodRef;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::config::KubeletConfig;

/// A connection to the kubelet, plain or TLS.
pub trait KubeletIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> KubeletIo for T {}

type PodsSender = hyper::client::conn::http1::SendRequest<Empty<bytes::Bytes>>;

/// Reads the kubelet's `/pods` over one kept-alive connection: a new
/// connection (a TLS handshake with an HTTPS kubelet) every few seconds would
/// cost the edge CPU and wake-ups. A connection the kubelet closed meanwhile is
/// replaced once per read.
pub struct PodReader {
    target: Arc<KubeletTarget>,
    sender: Option<PodsSender>,
}

impl PodReader {
    pub fn new(target: Arc<KubeletTarget>) -> PodReader {
        PodReader {
            target,
            sender: None,
        }
    }

    /// The kubelet's pods, sorted. Bounded by the pods timeout: a kubelet
    /// that accepts and never answers must not stall the edge's control loop
    /// (pod reports and certificate renewals run behind it).
    pub async fn pods(&mut self) -> anyhow::Result<Vec<PodRef>> {
        let limit = self.target.pods_timeout;
        match tokio::time::timeout(limit, self.read()).await {
            Ok(r) => r,
            Err(_) => {
                // The kept connection is in an unknown state: drop it.
                self.sender = None;
                anyhow::bail!(
                    "the kubelet at {} did not answer GET /pods within {limit:?}",
                    self.target.authority
                )
            }
        }
    }

    async fn read(&mut self) -> anyhow::Result<Vec<PodRef>> {
        if let Some(mut sender) = self.sender.take().filter(|s| !s.is_closed()) {
            match self.target.get_pods(&mut sender).await {
                Ok(pods) => {
                    self.sender = Some(sender);
                    return Ok(pods);
                }
                Err(e) => tracing::debug!(
                    error = format!("{e:#}"),
                    "kept /pods connection failed; reconnecting"
                ),
            }
        }
        let mut sender = self.target.pods_connection().await?;
        let pods = self.target.get_pods(&mut sender).await?;
        self.sender = Some(sender);
        Ok(pods)
    }

    /// Whether a kept connection is open.
    #[cfg(test)]
    fn is_connected(&self) -> bool {
        self.sender.as_ref().is_some_and(|s| !s.is_closed())
    }
}

/// The configured kubelet endpoint.
pub struct KubeletTarget {
    /// `host:port` to dial, and the `Host` header to send.
    pub authority: String,
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    connect_timeout: std::time::Duration,
    pods_timeout: std::time::Duration,
    /// Largest `/pods` body read (`--kubelet-pods-max-bytes`): a larger one
    /// fails the read, and the edge keeps its last report.
    pods_max_bytes: usize,
}

impl KubeletTarget {
    pub fn new(cfg: &KubeletConfig) -> anyhow::Result<KubeletTarget> {
        let host = cfg
            .url
            .host()
            .context("kubelet URL has no host")?
            .to_string();
        let https = cfg.url.scheme_str() == Some("https");
        let port = cfg.url.port_u16().unwrap_or(if https { 10250 } else { 80 });
        let authority = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let tls = if https {
            let provider = tether_proto::tls::provider();
            let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .context("TLS versions")?;
            let builder = if cfg.insecure_skip_tls_verify {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            } else {
                let ca = cfg
                    .ca
                    .as_ref()
                    .context("https kubelet without --kubelet-ca")?;
                builder.with_root_certificates(
                    tether_certs::pem::load_roots(ca).context("loading --kubelet-ca")?,
                )
            };
            let mut tls = match &cfg.client_cert {
                Some((cert, key)) => builder
                    .with_client_auth_cert(
                        tether_certs::pem::load_certs(cert)
                            .context("loading --kubelet-client-cert")?,
                        tether_certs::pem::load_key(key).context("loading --kubelet-client-key")?,
                    )
                    .context("kubelet client certificate and key do not match")?,
                None => builder.with_no_client_auth(),
            };
            tls.alpn_protocols = vec![b"http/1.1".to_vec()];
            let name = ServerName::try_from(
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string(),
            )
            .context("kubelet host is not a valid TLS server name")?;
            Some((tokio_rustls::TlsConnector::from(Arc::new(tls)), name))
        } else {
            None
        };
        Ok(KubeletTarget {
            authority,
            tls,
            connect_timeout: cfg.connect_timeout,
            pods_timeout: cfg.pods_timeout,
            pods_max_bytes: cfg.pods_max_bytes,
        })
    }

    /// Opens a connection to the kubelet (TLS if configured).
    pub async fn connect(&self) -> anyhow::Result<Box<dyn KubeletIo>> {
        let connect = async {
            let tcp = TcpStream::connect(&self.authority)
                .await
                .with_context(|| format!("connecting to the kubelet at {}", self.authority))?;
            let _ = tcp.set_nodelay(true);
            match &self.tls {
                None => Ok::<Box<dyn KubeletIo>, anyhow::Error>(Box::new(tcp)),
                Some((connector, name)) => {
                    let tls = connector
                        .connect(name.clone(), tcp)
                        .await
                        .with_context(|| {
                            format!("TLS handshake with the kubelet at {}", self.authority)
                        })?;
                    Ok(Box::new(tls) as Box<dyn KubeletIo>)
                }
            }
        };
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "connecting to the kubelet at {} timed out after {:?}",
                    self.authority,
                    self.connect_timeout
                )
            })?
    }

    /// A new HTTP/1.1 connection for `/pods` reads.
    async fn pods_connection(&self) -> anyhow::Result<PodsSender> {
        let io = self.connect().await?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .context("HTTP handshake with the kubelet")?;
        tokio::spawn(conn);
        Ok(sender)
    }

    /// `GET /pods` on `sender`, body read to the end (so the connection can
    /// carry the next one).
    async fn get_pods(&self, sender: &mut PodsSender) -> anyhow::Result<Vec<PodRef>> {
        sender
            .ready()
            .await
            .context("kubelet connection for /pods")?;
        let req = http::Request::get("/pods")
            .header(http::header::HOST, &self.authority)
            .header(http::header::ACCEPT, "application/json")
            .body(Empty::<bytes::Bytes>::new())
            .context("building the /pods request")?;
        let resp = sender
            .send_request(req)
            .await
            .context("GET /pods from the kubelet")?;
        if !resp.status().is_success() {
            anyhow::bail!("kubelet answered GET /pods with {}", resp.status());
        }
        let max = self.pods_max_bytes;
        let body = Limited::new(resp.into_body(), max)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading /pods (--kubelet-pods-max-bytes {max}): {e}"))?
            .to_bytes();
        parse_pods(&body)
    }
}

#[derive(Deserialize)]
struct PodList {
    #[serde(default)]
    items: Vec<Pod>,
}

#[derive(Deserialize)]
struct Pod {
    metadata: Meta,
}

#[derive(Deserialize)]
struct Meta {
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    uid: String,
}

/// Parses a v1 PodList into sorted pod references.
pub fn parse_pods(body: &[u8]) -> anyhow::Result<Vec<PodRef>> {
    let list: PodList = serde_json::from_slice(body).context("kubelet /pods is not a PodList")?;
    let mut pods: Vec<PodRef> = list
        .items
        .into_iter()
        .map(|p| PodRef {
            namespace: if p.metadata.namespace.is_empty() {
                "default".into()
            } else {
                p.metadata.namespace
            },
            name: p.metadata.name,
            uid: p.metadata.uid,
        })
        .collect();
    pods.sort();
    pods.dedup();
    Ok(pods)
}

/// Accepts any kubelet serving certificate (still checking handshake
/// signatures). Only with --kubelet-insecure-skip-tls-verify.
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A kubelet stand-in for the crate's tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::KubeletTarget;
    use crate::config::KubeletConfig;

    /// A target for the plain-HTTP kubelet at `addr`, reading `/pods` within
    /// `pods_timeout`.
    pub(crate) fn plain_target(addr: &str, pods_timeout: Duration) -> Arc<KubeletTarget> {
        plain_target_capped(addr, pods_timeout, 64 << 20)
    }

    /// As [`plain_target`], reading `/pods` bodies of at most `pods_max_bytes`.
    pub(crate) fn plain_target_capped(
        addr: &str,
        pods_timeout: Duration,
        pods_max_bytes: usize,
    ) -> Arc<KubeletTarget> {
        Arc::new(
            KubeletTarget::new(&KubeletConfig {
                url: format!("http://{addr}").parse().unwrap(),
                ca: None,
                insecure_skip_tls_verify: false,
                client_cert: None,
                connect_timeout: Duration::from_secs(5),
                pods_timeout,
                pods_max_bytes,
            })
            .unwrap(),
        )
    }

    /// A kubelet response whose head carries one header of `header_bytes`
    /// bytes; no body.
    pub(crate) fn big_head_response(header_bytes: usize) -> Vec<u8> {
        format!(
            "HTTP/1.1 200 OK\r\nx-big: {}\r\ncontent-length: 0\r\n\r\n",
            "a".repeat(header_bytes)
        )
        .into_bytes()
    }

    /// A plain-HTTP kubelet that answers the first request of every
    /// connection with the bytes `answer` (a whole HTTP response), then
    /// closes it. Returns its address.
    pub(crate) async fn answering_kubelet(answer: Vec<u8>) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let answer = Arc::new(answer);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                    }
                    let _ = s.write_all(&answer).await;
                });
            }
        });
        addr
    }

    /// A plain-HTTP kubelet that answers every request with `body` (a pod
    /// list), closing each connection after `per_conn` answers, as a
    /// kubelet closes an idle one. Returns its address and a count of the
    /// connections it took.
    pub(crate) async fn pods_kubelet(body: String, per_conn: usize) -> (String, Arc<AtomicUsize>) {
        let (addr, conns, _) = pods_kubelet_swappable(body, per_conn).await;
        (addr, conns)
    }

    /// A plain-HTTP kubelet that accepts connections, reads requests and
    /// never answers one (a hung kubelet); its connections stay open until
    /// the test ends. Returns its address and a count of the request heads
    /// it has read.
    pub(crate) async fn unanswering_kubelet() -> (String, Arc<AtomicUsize>) {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let requests = Arc::new(AtomicUsize::new(0));
        let r = requests.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let r = r.clone();
                tokio::spawn(async move {
                    let mut s = BufReader::new(s);
                    let mut line = String::new();
                    loop {
                        line.clear();
                        match s.read_line(&mut line).await {
                            Ok(n) if n > 0 => {}
                            _ => return,
                        }
                        // The blank line ending a request head (GET: no body).
                        if line == "\r\n" {
                            r.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        (addr, requests)
    }

    /// A pod list of `n` pods, as the kubelet serves it.
    pub(crate) fn pod_list(n: usize) -> String {
        let items: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"metadata":{{"name":"p{i}","namespace":"ns","uid":"u{i}"}}}}"#))
            .collect();
        format!(r#"{{"items":[{}]}}"#, items.join(","))
    }

    /// As [`pods_kubelet`], with a handle to change the body it answers with.
    pub(crate) async fn pods_kubelet_swappable(
        body: String,
        per_conn: usize,
    ) -> (String, Arc<AtomicUsize>, Arc<Mutex<Arc<String>>>) {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let conns = Arc::new(AtomicUsize::new(0));
        let c = conns.clone();
        let current = Arc::new(Mutex::new(Arc::new(body)));
        let handle = current.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                let current = current.clone();
                tokio::spawn(async move {
                    let mut s = BufReader::new(s);
                    for _ in 0..per_conn {
                        // Read one request head.
                        loop {
                            let mut line = String::new();
                            if s.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let body = current.lock().unwrap().clone();
                        let head =
                            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                        let w = s.get_mut();
                        if w.write_all(head.as_bytes()).await.is_err()
                            || w.write_all(body.as_bytes()).await.is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        (addr, conns, handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pod_lists() {
        let body = br#"{"kind":"PodList","items":[{"metadata":{"name":"b","namespace":"kube-system","uid":"2"}},{"metadata":{"name":"a","uid":"1"}}]}"#;
        let pods = parse_pods(body).unwrap();
        assert_eq!(pods.len(), 2);
        assert_eq!(pods[0].name, "a");
        assert_eq!(pods[0].namespace, "default");
        assert!(parse_pods(b"not json").is_err());
        assert!(parse_pods(b"{}").unwrap().is_empty());
    }

    /// A minimal kubelet: answers every request on a connection with a pod
    /// list; counts connections; closes each after `per_conn` answers.
    async fn kubelet(per_conn: usize) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let body = r#"{"items":[{"metadata":{"name":"p","namespace":"ns","uid":"u"}}]}"#;
        testing::pods_kubelet(body.to_string(), per_conn).await
    }

    fn target(addr: &str) -> Arc<KubeletTarget> {
        testing::plain_target(addr, std::time::Duration::from_secs(1))
    }

    #[tokio::test]
    async fn pod_reads_reuse_one_connection_and_survive_its_close() {
        let (addr, conns) = kubelet(3).await;
        let mut r = PodReader::new(target(&addr));
        for _ in 0..3 {
            let pods = r.pods().await.unwrap();
            assert_eq!(
                (pods[0].namespace.as_str(), pods[0].name.as_str()),
                ("ns", "p")
            );
        }
        assert_eq!(
            conns.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "three reads, one connection"
        );
        // The kubelet closed it after three answers: the next read reconnects.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(r.pods().await.unwrap().len(), 1);
        assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(r.is_connected());
    }

    #[tokio::test]
    async fn a_kubelet_that_never_answers_pods_is_given_up_on() {
        let (addr, requests) = testing::unanswering_kubelet().await;
        let mut r = PodReader::new(target(&addr));
        let t = std::time::Instant::now();
        let e = tokio::time::timeout(std::time::Duration::from_secs(10), r.pods())
            .await
            .expect("GET /pods hung")
            .unwrap_err();
        assert!(e.to_string().contains("did not answer"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(3));
        assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// A `/pods` body over `--kubelet-pods-max-bytes` fails the read with an
    /// error naming the flag and the bound (was a fixed 64 MiB); the reader
    /// goes on reading once the list fits again.
    #[tokio::test]
    async fn a_pod_list_over_the_configured_cap_fails_the_read_naming_it() {
        const CAP: usize = 1024;
        let small = testing::pod_list(2);
        let large = testing::pod_list(40);
        assert!(
            small.len() < CAP && large.len() > CAP,
            "{} {}",
            small.len(),
            large.len()
        );
        let (addr, _, body) = testing::pods_kubelet_swappable(small.clone(), usize::MAX).await;
        let target = testing::plain_target_capped(&addr, std::time::Duration::from_secs(5), CAP);
        let mut r = PodReader::new(target);
        assert_eq!(r.pods().await.unwrap().len(), 2);
        *body.lock().unwrap() = Arc::new(large);
        let e = format!("{:#}", r.pods().await.unwrap_err());
        assert!(
            e.contains("--kubelet-pods-max-bytes 1024): length limit exceeded"),
            "{e}"
        );
        *body.lock().unwrap() = Arc::new(small);
        assert_eq!(r.pods().await.unwrap().len(), 2);
    }
}
