//! A minimal HTTPS client that speaks to a kubelet API (the cloud's front, or a kubelet
//! simulator in direct mode) the way the apiserver does: TLS with the apiserver's
//! kubelet-client certificate, ALPN `http/1.1`, one request per connection. The harness
//! uses it to wait until the cloud can route every pod, and to check which kubelet
//! answered (`X-Kubelet-Sim-Node`).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Bound on one probe request, connect to last body byte.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The header kubelet-sim puts on every response, naming its node.
pub const NODE_HEADER: &str = "x-kubelet-sim-node";

/// A response read in full.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// The node named by `X-Kubelet-Sim-Node`, if any.
    pub fn node(&self) -> Option<&str> {
        self.headers.get(NODE_HEADER).and_then(|v| v.to_str().ok())
    }
}

/// An HTTPS client with a client certificate.
#[derive(Clone)]
pub struct KubeletClient {
    connector: TlsConnector,
}

impl KubeletClient {
    /// A client presenting `cert_pem`/`key_pem` and trusting servers signed by `ca_pem`.
    pub fn new(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
            roots
                .add(c.context("parsing the CA certificate")?)
                .context("adding the CA certificate")?;
        }
        let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut cert_pem.as_bytes())
            .collect::<std::result::Result<_, _>>()
            .context("parsing the client certificate")?;
        let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut key_pem.as_bytes())
            .context("parsing the client key")?
            .context("no private key in the client key PEM")?;
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .context("client certificate")?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(KubeletClient {
            connector: TlsConnector::from(Arc::new(config)),
        })
    }

    /// `GET path` on `addr`, with TLS server name `server_name` (a DNS name is sent as
    /// SNI, an IP address is not) and `Host: host`; bounded by 5 s.
    pub async fn get(
        &self,
        addr: SocketAddr,
        server_name: &str,
        host: &str,
        path: &str,
    ) -> Result<Reply> {
        self.get_from(None, addr, server_name, host, path).await
    }

    /// [`KubeletClient::get`] with the TCP connection made from inside network
    /// namespace `netns` (`None`: this process's), e.g. towards a service address that
    /// only exists there.
    pub async fn get_from(
        &self,
        netns: Option<&str>,
        addr: SocketAddr,
        server_name: &str,
        host: &str,
        path: &str,
    ) -> Result<Reply> {
        let request = Request::get(path)
            .header(http::header::HOST, host)
            .body(Empty::<Bytes>::new())
            .with_context(|| format!("building GET {path}"))?;
        let fut = async {
            let tls = self.connect_from(netns, addr, server_name).await?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .context("HTTP/1.1 handshake")?;
            tokio::spawn(conn);
            let resp = sender
                .send_request(request)
                .await
                .with_context(|| format!("GET {path} on {addr}"))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .with_context(|| format!("reading the body of GET {path}"))?
                .to_bytes();
            Ok(Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(PROBE_TIMEOUT, fut)
            .await
            .map_err(|_| anyhow!("GET {path} on {addr}: no full answer in {PROBE_TIMEOUT:?}"))?
    }

    /// A TLS connection to `addr` with TLS server name `server_name` (as
    /// [`KubeletClient::get`]), the TCP connection made from inside network namespace
    /// `netns` (`None`: this process's). Not bounded in time: the caller bounds it.
    pub async fn connect_from(
        &self,
        netns: Option<&str>,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let name = match server_name.parse::<IpAddr>() {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(server_name.to_string())
                .map_err(|e| anyhow!("bad server name {server_name:?}: {e}"))?,
        };
        let tcp = match netns {
            None => TcpStream::connect(addr).await,
            Some(ns) => {
                let ns = ns.to_string();
                tokio::task::spawn_blocking(move || {
                    linkemu::netns::run_in(&ns, || std::net::TcpStream::connect(addr))
                        .map_err(std::io::Error::other)?
                })
                .await
                .map_err(std::io::Error::other)
                .and_then(|r| r)
                .and_then(|t| {
                    t.set_nonblocking(true)?;
                    TcpStream::from_std(t)
                })
            }
        }
        .with_context(|| format!("connecting to {addr}"))?;
        self.connector
            .connect(name, tcp)
            .await
            .with_context(|| format!("TLS handshake with {addr} as {server_name}"))
    }
}
