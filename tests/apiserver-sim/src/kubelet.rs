//! Dialling kubelets like the apiserver: where a request goes (node address, port, path,
//! query), what TLS server name / SNI is used, the optional `--kubelet-dial` override
//! (emulating a DNAT), and sending one HTTP/1.1 request over a fresh TLS connection.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use http::{header, Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::body::Body;
use crate::cluster::Node;

/// `--kubelet-timeout` default of the apiserver: bounds TCP connect + TLS handshake.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on waiting for the kubelet's response head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(60);

/// A kubelet URL: node, path and already-encoded query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub node: Node,
    pub path: String,
    pub query: String,
}

impl Location {
    pub fn new(node: &Node, path: String, query: String) -> Self {
        Location {
            node: node.clone(),
            path,
            query,
        }
    }

    /// Origin-form request target.
    pub fn path_and_query(&self) -> String {
        if self.query.is_empty() {
            self.path.clone()
        } else {
            format!("{}?{}", self.path, self.query)
        }
    }

    /// `https://host:port/path?query`.
    pub fn url(&self) -> String {
        format!("https://{}{}", self.node.host_port(), self.path_and_query())
    }

    /// [`Location::url`] shortened for log lines and error messages.
    pub fn log_url(&self) -> String {
        clip(&self.url())
    }
}

/// The TLS server name for a node address: an IP address (rustls, like Go, then sends no
/// SNI) or a DNS name (sent as SNI).
pub fn server_name(address: &str) -> Result<ServerName<'static>> {
    if let Ok(ip) = address.parse::<IpAddr>() {
        return Ok(ServerName::IpAddress(ip.into()));
    }
    ServerName::try_from(address.to_string())
        .map_err(|e| anyhow!("{address:?} is not a valid DNS name for TLS: {e}"))
}

/// The SNI the dial will carry for `address`, if any.
pub fn sni(address: &str) -> Option<String> {
    match server_name(address) {
        Ok(ServerName::DnsName(d)) => Some(d.as_ref().to_string()),
        _ => None,
    }
}

/// Dials kubelets with the kubelet-client TLS configuration.
#[derive(Clone)]
pub struct Kubelets {
    connector: TlsConnector,
    /// `--kubelet-dial`: every connection goes to one of these instead of the
    /// node's address, each in turn (a DNAT spreading over several replicas).
    dial_override: Vec<String>,
    next: Arc<std::sync::atomic::AtomicUsize>,
}

impl Kubelets {
    pub fn new(config: Arc<rustls::ClientConfig>, dial_override: Vec<String>) -> Self {
        Kubelets {
            connector: TlsConnector::from(config),
            dial_override,
            next: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        }
    }

    /// Where the next connection for `node` goes.
    fn target(&self, node: &Node) -> String {
        if self.dial_override.is_empty() {
            return node.host_port();
        }
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.dial_override[i % self.dial_override.len()].clone()
    }

    /// TCP + TLS to the node's kubelet (or the override), bounded by 5 s.
    pub async fn dial(&self, node: &Node) -> Result<TlsStream<TcpStream>> {
        let name = server_name(&node.address)?;
        let target = self.target(node);
        if self.dial_override.len() > 1 {
            eprintln!("apiserver-sim: dialling {target} for node {}", node.name);
        }
        let fut = async {
            let tcp = TcpStream::connect(target.as_str())
                .await
                .with_context(|| format!("dialing kubelet at {target}"))?;
            let _ = tcp.set_nodelay(true);
            self.connector
                .connect(name, tcp)
                .await
                .with_context(|| format!("TLS handshake with kubelet at {target}"))
        };
        tokio::time::timeout(DIAL_TIMEOUT, fut)
            .await
            .map_err(|_| anyhow!("dialing kubelet at {target}: timed out after {DIAL_TIMEOUT:?}"))?
    }

    /// Sends `req` (its URI is replaced by `loc`'s path and query) on a fresh connection
    /// and returns the response head; the body streams. Upgrades are enabled so a 101's
    /// connection can be taken with `hyper::upgrade::on`. Logs the request to stderr.
    pub async fn send(&self, loc: &Location, mut req: Request<Body>) -> Result<Response<Incoming>> {
        *req.uri_mut() = loc
            .path_and_query()
            .parse()
            .with_context(|| format!("kubelet path {:?}", loc.path_and_query()))?;
        let host = req
            .headers()
            .get(header::HOST)
            .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
            .unwrap_or_default();
        eprintln!(
            "apiserver-sim: proxy {} {} Host={} SNI={} dial={}",
            req.method(),
            loc.log_url(),
            clip(&host),
            sni(&loc.node.address).unwrap_or_else(|| "-".into()),
            if self.dial_override.is_empty() {
                loc.node.host_port()
            } else {
                self.dial_override.join(",")
            },
        );
        let tls = self.dial(&loc.node).await?;
        let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
            .title_case_headers(true)
            .handshake::<_, Body>(TokioIo::new(tls))
            .await
            .context("HTTP/1.1 handshake with kubelet")?;
        let url = loc.log_url();
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                eprintln!("apiserver-sim: kubelet connection for {url}: {e}");
            }
        });
        tokio::time::timeout(HEAD_TIMEOUT, sender.send_request(req))
            .await
            .map_err(|_| {
                anyhow!(
                    "kubelet {} sent no response head in {HEAD_TIMEOUT:?}",
                    loc.log_url()
                )
            })?
            .with_context(|| format!("request to kubelet {}", loc.log_url()))
    }
}

/// Shortens very long strings for log lines.
pub fn clip(s: &str) -> String {
    const MAX: usize = 300;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &s[..end], s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sni_only_for_dns_names() {
        assert_eq!(sni("10.1.2.3"), None);
        assert_eq!(sni("fd00::1"), None);
        assert_eq!(sni("edge-1.example"), Some("edge-1.example".into()));
        assert_eq!(sni("edge-1"), Some("edge-1".into()));
        assert!(server_name("bad name!").is_err());
    }

    #[test]
    fn location_urls() {
        let n = Node::parse("e=[fd00::1]:10350").unwrap();
        let l = Location::new(&n, "/exec/ns/p/c".into(), "command=ls".into());
        assert_eq!(l.url(), "https://[fd00::1]:10350/exec/ns/p/c?command=ls");
        let l = Location::new(&n, "/metrics".into(), String::new());
        assert_eq!(l.path_and_query(), "/metrics");
    }
}
