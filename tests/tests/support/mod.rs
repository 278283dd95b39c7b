//! Shared pieces of the tunnel integration tests: an in-process kubelet
//! stand-in (a `head-bytes=N` query pads its response head by N bytes), an
//! HTTPS client holding the apiserver's client certificate, and a small
//! environment that starts `tether-cloud` and `tether-edge` as real
//! processes on loopback.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tether_tests::pki::{self, Pki};
use tether_tests::process::{Proc, SpawnOptions};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

pub type Body = BoxBody<Bytes, std::io::Error>;

fn full(s: impl Into<Bytes>) -> Body {
    Full::new(s.into())
        .map_err(|n: Infallible| match n {})
        .boxed()
}

/// A kubelet stand-in: plain HTTP, answers as node `node`, runs `pods`.
pub struct Kubelet {
    pub addr: SocketAddr,
    pub node: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Kubelet {
    pub async fn start(node: &str, pods: &[&str]) -> Result<Kubelet> {
        Self::start_on(std::net::TcpListener::bind("127.0.0.1:0")?, node, pods)
    }

    /// Serves on an already bound listener (e.g. one made inside a network namespace).
    pub fn start_on(listener: std::net::TcpListener, node: &str, pods: &[&str]) -> Result<Kubelet> {
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let node = node.to_string();
        let pods: Arc<Vec<String>> = Arc::new(pods.iter().map(|s| s.to_string()).collect());
        let n = node.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let node = n.clone();
                let pods = pods.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        serve(req, node.clone(), pods.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Ok(Kubelet { addr, node, task })
    }
}

async fn serve(
    mut req: Request<Incoming>,
    node: String,
    pods: Arc<Vec<String>>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let mut resp = if req.headers().contains_key("upgrade") {
        // Any upgrade: 101, then echo every byte until the client half-closes.
        let proto = req
            .headers()
            .get("upgrade")
            .cloned()
            .unwrap_or(hyper::header::HeaderValue::from_static("x"));
        tether_tests::netns::spawn_echo(hyper::upgrade::on(&mut req));
        Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("connection", "Upgrade")
            .header("upgrade", proto)
            .header("x-stream-protocol-version", "v4.channel.k8s.io")
            .body(full(""))
            .unwrap()
    } else if path == "/pods" {
        Response::new(full(tether_tests::netns::pod_list_json(&pods)))
    } else if let Some(n) = padded_head(&req) {
        // `?head-bytes=N`: a response head carrying an N-byte header.
        let mut r = Response::new(full("padded\n"));
        r.headers_mut()
            .insert("x-padding", "a".repeat(n).parse().unwrap());
        r
    } else if path.starts_with("/containerLogs/") {
        let follow = req.uri().query().unwrap_or("").contains("follow=true");
        let node2 = node.clone();
        let stream = futures_util::stream::unfold(0u64, move |i| {
            let node = node2.clone();
            async move {
                if !follow && i >= 5 {
                    return None;
                }
                if i > 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Some((
                    Ok::<_, std::io::Error>(Frame::data(Bytes::from(format!("{node} line {i}\n")))),
                    i + 1,
                ))
            }
        });
        Response::new(StreamBody::new(stream).boxed())
    } else if path == "/metrics" || path == "/metrics/resource" {
        Response::new(full(format!("node_name{{node=\"{node}\"}} 1\n")))
    } else if path == "/metrics/cadvisor" {
        Response::new(full(format!(
            "container_cpu_usage_seconds_total{{node=\"{node}\",container=\"c\"}} 1.5\n"
        )))
    } else if path == "/metrics/probes" {
        let mut r = Response::new(full("probe failure\n"));
        *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        r
    } else if path == "/stats/summary" {
        // Echo the request body (POST) to prove request bodies travel.
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Response::new(full(body))
    } else if path == "/healthz" {
        Response::new(full("ok"))
    } else {
        let mut r = Response::new(full(format!("kubelet {node}: no such path {path}\n")));
        *r.status_mut() = StatusCode::NOT_FOUND;
        r
    };
    resp.headers_mut()
        .insert("x-kubelet-node", node.parse().unwrap());
    Ok(resp)
}

/// The `N` of a `head-bytes=N` query: the kubelet stand-in then answers
/// with a response head padded by an N-byte header.
fn padded_head(req: &Request<Incoming>) -> Option<usize> {
    req.uri()
        .query()?
        .split('&')
        .find_map(|kv| kv.strip_prefix("head-bytes=")?.parse().ok())
}

/// An HTTPS client that dials the cloud's kubelet API as the apiserver does.
#[derive(Clone)]
pub struct Client {
    pub addr: SocketAddr,
    /// How TCP connections are made (default: from this process's namespace).
    dial: Option<Arc<Dial>>,
    tls: Arc<rustls::ClientConfig>,
    tls_h2: Arc<rustls::ClientConfig>,
    /// Offers no ALPN protocol at all.
    tls_bare: Arc<rustls::ClientConfig>,
}

/// Makes a TCP connection to an address (e.g. from inside a network namespace).
pub type Dial = dyn Fn(SocketAddr) -> std::io::Result<std::net::TcpStream> + Send + Sync;

pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

fn client_config(pki: &Pki, with_cert: bool, alpn: &[&[u8]]) -> Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in tether_certs::pem::certs_from_pem(&pki.tether_ca_pem, "ca")? {
        roots.add(c)?;
    }
    let b = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut cfg = if with_cert {
        b.with_client_auth_cert(
            tether_certs::pem::certs_from_pem(&pki.apiserver_client.cert_pem, "client")?,
            tether_certs::pem::key_from_pem(&pki.apiserver_client.key_pem, "client")?,
        )?
    } else {
        b.with_no_client_auth()
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(cfg)
}

/// A response read whole.
pub struct Reply {
    pub status: StatusCode,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn node(&self) -> Option<&str> {
        self.headers
            .get("x-kubelet-node")
            .and_then(|v| v.to_str().ok())
    }
}

impl Client {
    pub fn new(pki: &Pki, addr: SocketAddr) -> Result<Client> {
        Ok(Client {
            addr,
            dial: None,
            tls: Arc::new(client_config(pki, true, &[b"http/1.1"])?),
            tls_h2: Arc::new(client_config(pki, true, &[b"h2"])?),
            tls_bare: Arc::new(client_config(pki, true, &[])?),
        })
    }

    /// A client presenting no certificate (a bearer-token caller such as
    /// metrics-server or Prometheus).
    pub fn without_cert(pki: &Pki, addr: SocketAddr) -> Result<Client> {
        Ok(Client {
            addr,
            dial: None,
            tls: Arc::new(client_config(pki, false, &[b"http/1.1"])?),
            tls_h2: Arc::new(client_config(pki, false, &[b"h2"])?),
            tls_bare: Arc::new(client_config(pki, false, &[])?),
        })
    }

    /// The same client, dialling with `dial`.
    pub fn with_dial(mut self, dial: Arc<Dial>) -> Client {
        self.dial = Some(dial);
        self
    }

    /// A TLS connection with the given SNI (`None`: an IP, so no SNI is sent).
    pub async fn connect(
        &self,
        sni: Option<&str>,
        h2: bool,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let cfg = if h2 { &self.tls_h2 } else { &self.tls };
        self.connect_with(sni, cfg.clone()).await
    }

    /// As [`Client::connect`], offering no ALPN protocol at all (the server
    /// then speaks HTTP/1.1, as the kubelet).
    pub async fn connect_without_alpn(
        &self,
        sni: Option<&str>,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
        self.connect_with(sni, self.tls_bare.clone()).await
    }

    async fn connect_with(
        &self,
        sni: Option<&str>,
        cfg: Arc<rustls::ClientConfig>,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = match &self.dial {
            None => TcpStream::connect(self.addr).await?,
            Some(dial) => {
                let (dial, addr) = (dial.clone(), self.addr);
                let std = tokio::task::spawn_blocking(move || dial(addr)).await??;
                std.set_nonblocking(true)?;
                TcpStream::from_std(std)?
            }
        };
        let name = match sni {
            Some(s) => ServerName::try_from(s.to_string())?,
            None => ServerName::IpAddress(self.addr.ip().into()),
        };
        Ok(tokio_rustls::TlsConnector::from(cfg)
            .connect(name, tcp)
            .await?)
    }

    /// Sends a request over HTTP/1.1 and returns the response with a streaming body.
    pub async fn send(&self, sni: Option<&str>, req: Request<Body>) -> Result<Response<Incoming>> {
        let tls = self.connect(sni, false).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(conn.with_upgrades());
        Ok(sender.send_request(req).await?)
    }

    /// Opens `kubectl logs -f`'s request for `ns/pod` (container `c`): a
    /// follow stream whose body grows until someone closes it.
    pub async fn follow_log(&self, pod: &str) -> Result<Response<Incoming>> {
        let req = Request::get(format!("/containerLogs/{pod}/c?follow=true"))
            .header("host", "edge-1")
            .body(empty())?;
        self.send(None, req).await
    }

    /// GET `path` with `Host: host` (and the given SNI and extra headers); body read whole.
    pub async fn get(
        &self,
        path: &str,
        host: &str,
        sni: Option<&str>,
        extra: &[(&str, &str)],
    ) -> Result<Reply> {
        let mut b = Request::get(path).header("host", host);
        for (k, v) in extra {
            b = b.header(*k, *v);
        }
        let resp = self.send(sni, b.body(empty())?).await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
            .await
            .context("reading body")??
            .to_bytes();
        Ok(Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// An upgrade request (`Upgrade: SPDY/3.1`) to `path`; returns the upgraded connection.
    pub async fn upgrade(
        &self,
        path: &str,
        host: &str,
    ) -> Result<(Reply, hyper::upgrade::Upgraded)> {
        let req = Request::post(path)
            .header("host", host)
            .header("connection", "Upgrade")
            .header("upgrade", "SPDY/3.1")
            .header("x-stream-protocol-version", "v4.channel.k8s.io")
            .body(empty())?;
        let mut resp = self.send(None, req).await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        if status != StatusCode::SWITCHING_PROTOCOLS {
            let body = resp.into_body().collect().await?.to_bytes();
            bail!(
                "upgrade answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let up = hyper::upgrade::on(&mut resp).await?;
        Ok((
            Reply {
                status,
                headers,
                body: String::new(),
            },
            up,
        ))
    }
}

pub fn empty() -> Body {
    Empty::new().map_err(|n: Infallible| match n {}).boxed()
}

/// One edge node of an environment.
pub struct Node {
    pub name: String,
    pub kubelet: Kubelet,
    pub edge: Proc,
}

/// A cloud, its edges and their kubelets, as processes.
pub struct Env {
    /// Edges dial this relay instead of the cloud when set (outage tests).
    pub relay: Option<UdpRelay>,
    /// Extra flags for every edge.
    pub edge_args: Vec<String>,
    /// The cloud's flags beyond the PKI's and the listeners'.
    pub cloud_args: Vec<String>,
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    pub cloud: Proc,
    pub tunnel: SocketAddr,
    pub kubelet_api: SocketAddr,
    /// The cloud's operations listener.
    pub metrics: SocketAddr,
    pub nodes: Vec<Node>,
    pub client: Client,
}

/// A cloud's `tether-cloud ready` line, which names its listeners.
pub struct ReadyLine(String);

impl ReadyLine {
    /// Waits at most 20 s for `cloud` to print it.
    pub async fn wait(cloud: &mut Proc) -> Result<ReadyLine> {
        cloud
            .wait_line("cloud ready line", Duration::from_secs(20), |l| {
                l.starts_with("tether-cloud ready")
            })
            .await
            .map(ReadyLine)
    }

    /// The address after `<key>=` (`tunnel`, `kubelet-api`, `metrics`, `peer`).
    pub fn addr(&self, key: &str) -> Result<SocketAddr> {
        let v = self
            .0
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")))
            .with_context(|| format!("no {key}= in {:?}", self.0))?;
        Ok(v.parse()?)
    }
}

/// What one node runs and announces.
pub struct NodeSpec<'a> {
    pub name: &'a str,
    pub pods: &'a [&'a str],
    pub announce: &'a [&'a str],
}

impl Env {
    /// Starts a cloud (with `cloud_args` added) and one edge per spec.
    pub async fn start(specs: &[NodeSpec<'_>], cloud_args: &[&str]) -> Result<Env> {
        Self::start_with(specs, cloud_args, &[], false).await
    }

    /// As [`Env::start`], with extra edge flags and optionally a relay
    /// between the edges and the cloud.
    pub async fn start_with(
        specs: &[NodeSpec<'_>],
        cloud_args: &[&str],
        edge_args: &[&str],
        relay: bool,
    ) -> Result<Env> {
        let dir = tempfile::tempdir()?;
        let mut names: Vec<&str> = specs.iter().map(|s| s.name).collect();
        names.push("edge-intruder");
        let pki = pki::mint(dir.path(), &names)?;
        let cloud_args: Vec<String> = cloud_args.iter().map(|s| s.to_string()).collect();
        let (cloud, [tunnel, kubelet_api, metrics]) =
            Self::spawn_cloud(&pki, dir.path(), "tether-cloud", "127.0.0.1:0", &cloud_args).await?;
        let client = Client::new(&pki, kubelet_api)?;
        let relay = if relay {
            Some(UdpRelay::start(tunnel).await?)
        } else {
            None
        };
        let edge_args = edge_args.iter().map(|s| s.to_string()).collect();
        let mut env = Env {
            relay,
            edge_args,
            cloud_args,
            dir,
            pki,
            cloud,
            tunnel,
            kubelet_api,
            metrics,
            nodes: Vec::new(),
            client,
        };
        for s in specs {
            let kubelet = Kubelet::start(s.name, s.pods).await?;
            let edge = env
                .spawn_edge(s.name, &format!("http://{}", kubelet.addr), s.announce, &[])
                .await?;
            env.nodes.push(Node {
                name: s.name.to_string(),
                kubelet,
                edge,
            });
        }
        for s in specs {
            for p in s.pods {
                env.wait_routable(p).await?;
            }
        }
        Ok(env)
    }

    /// A cloud with the test PKI and `cloud_args`, its edge listener on
    /// `tunnel`, waited for until ready; and its tunnel, kubelet-API and
    /// operations addresses.
    async fn spawn_cloud(
        pki: &Pki,
        dir: &std::path::Path,
        name: &str,
        tunnel: &str,
        cloud_args: &[String],
    ) -> Result<(Proc, [SocketAddr; 3])> {
        let mut cmd = tokio::process::Command::new(tether_tests::bins::binary("tether-cloud")?);
        cmd.args(["--tunnel-listen", tunnel])
            .args(&tether_tests::LOOPBACK_LISTENS[2..])
            // With an apiserver to watch, drop the opt-in to route by edge reports.
            .args(pki.cloud_flags().into_iter().filter(|f| {
                !(f == "--insecure-trust-edge-reports"
                    && cloud_args.iter().any(|a| a == "--apiserver-kubeconfig"))
            }))
            .args(cloud_args)
            .env("TETHER_LOG", "info,tether_cloud=debug")
            .env("RUST_BACKTRACE", "0");
        let mut cloud = Proc::spawn(name, cmd, dir, SpawnOptions::default())?;
        let ready = ReadyLine::wait(&mut cloud).await?;
        Ok((
            cloud,
            [
                ready.addr("tunnel")?,
                ready.addr("kubelet-api")?,
                ready.addr("metrics")?,
            ],
        ))
    }

    /// Stops the cloud (SIGTERM) and starts another, named `name`, on the
    /// same edge listener address with the first one's flags and `extra`;
    /// the client then talks to the new one.
    #[allow(dead_code)]
    pub async fn restart_cloud(&mut self, name: &str, extra: &[&str]) -> Result<()> {
        self.cloud.terminate(Duration::from_secs(10)).await;
        let mut args = self.cloud_args.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        let tunnel = self.tunnel.to_string();
        let (cloud, [_, kubelet_api, metrics]) =
            Self::spawn_cloud(&self.pki, self.dir.path(), name, &tunnel, &args).await?;
        self.cloud = cloud;
        self.kubelet_api = kubelet_api;
        self.metrics = metrics;
        self.client = Client::new(&self.pki, kubelet_api)?;
        Ok(())
    }

    /// Spawns an edge for `node` and waits for it to connect.
    pub async fn spawn_edge(
        &self,
        node: &str,
        kubelet_url: &str,
        announce: &[&str],
        extra: &[&str],
    ) -> Result<Proc> {
        let pair = self
            .pki
            .edges
            .get(node)
            .with_context(|| format!("no certificate for {node}"))?;
        let mut p = self.edge_process(node, &pair.cert, &pair.key, kubelet_url, announce, extra)?;
        p.wait_connected("edge connected line", Duration::from_secs(20))
            .await?;
        Ok(p)
    }

    /// An edge process with the given certificate (not waited for).
    pub fn edge_process(
        &self,
        name: &str,
        cert: &PathBuf,
        key: &PathBuf,
        kubelet_url: &str,
        announce: &[&str],
        extra: &[&str],
    ) -> Result<Proc> {
        let mut cmd = tokio::process::Command::new(tether_tests::bins::binary("tether-edge")?);
        let cloud = self.relay.as_ref().map(|r| r.addr).unwrap_or(self.tunnel);
        cmd.arg("--cloud")
            .arg(cloud.to_string())
            .args(["--server-name", pki::CLOUD_SERVER_NAME])
            .arg("--ca")
            .arg(&self.pki.tether_ca)
            .arg("--cert")
            .arg(cert)
            .arg("--key")
            .arg(key)
            .args([
                "--kubelet-url",
                kubelet_url,
                "--pods-refresh",
                "200ms",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            .args(extra)
            .args(&self.edge_args)
            .env("TETHER_LOG", "info,tether_edge=debug")
            .env("RUST_BACKTRACE", "0");
        if !announce.is_empty() {
            cmd.arg("--announce-address").arg(announce.join(","));
        } else {
            cmd.args(["--announce-address", &format!("{name}.invalid")]);
        }
        Proc::spawn(
            &format!("tether-edge-{name}"),
            cmd,
            self.dir.path(),
            SpawnOptions::default(),
        )
    }

    /// Waits until the cloud routes `ns/pod` (the edge's pod report arrived).
    pub async fn wait_routable(&self, pod: &str) -> Result<()> {
        let (ns, name) = pod.split_once('/').unwrap_or(("default", pod));
        let path = format!("/containerLogs/{ns}/{name}/c");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let r = self
                .client
                .get(&path, "apiserver.example:6443", None, &[])
                .await?;
            // 409: reported by several edges — reported all the same.
            if r.status == StatusCode::OK || r.status == StatusCode::CONFLICT {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "pod {pod} never became routable: last {} {}",
                    r.status,
                    r.body
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The cloud's log so far.
    /// The current cloud's log (after [`Env::restart_cloud`], the new one's).
    pub fn cloud_log(&self) -> String {
        std::fs::read_to_string(self.cloud.log_path()).unwrap_or_default()
    }
}

/// Echo `data` through an upgraded connection: writes all, half-closes, reads
/// everything back. Returns what came back.
pub async fn echo<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: T,
    data: Vec<u8>,
) -> Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut r, mut w) = tokio::io::split(io);
    let writer = tokio::spawn(async move {
        for chunk in data.chunks(64 * 1024) {
            w.write_all(chunk).await?;
        }
        w.shutdown().await?;
        Ok::<_, std::io::Error>(w)
    });
    let mut back = Vec::new();
    r.read_to_end(&mut back).await?;
    let _w = writer.await??;
    Ok(back)
}

/// A UDP relay between edges and the cloud on loopback that can drop every
/// packet (an outage) while the processes on both sides keep running.
pub struct UdpRelay {
    pub addr: SocketAddr,
    blackhole: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl UdpRelay {
    pub async fn start(upstream: SocketAddr) -> Result<UdpRelay> {
        use std::collections::HashMap;
        use std::sync::atomic::Ordering;
        let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await?);
        let addr = front.local_addr()?;
        let blackhole = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let bh = blackhole.clone();
        let task = tokio::spawn(async move {
            let mut backs: HashMap<SocketAddr, Arc<tokio::net::UdpSocket>> = HashMap::new();
            let mut tasks = Vec::new();
            let mut buf = vec![0u8; 65536];
            loop {
                let Ok((n, from)) = front.recv_from(&mut buf).await else {
                    return;
                };
                if bh.load(Ordering::Relaxed) {
                    continue;
                }
                let back = match backs.get(&from) {
                    Some(b) => b.clone(),
                    None => {
                        let Ok(b) = tokio::net::UdpSocket::bind("127.0.0.1:0").await else {
                            continue;
                        };
                        if b.connect(upstream).await.is_err() {
                            continue;
                        }
                        let b = Arc::new(b);
                        backs.insert(from, b.clone());
                        let (b2, f2, bh2) = (b.clone(), front.clone(), bh.clone());
                        tasks.push(tokio::spawn(async move {
                            let mut buf = vec![0u8; 65536];
                            while let Ok(n) = b2.recv(&mut buf).await {
                                if !bh2.load(Ordering::Relaxed) {
                                    let _ = f2.send_to(&buf[..n], from).await;
                                }
                            }
                        }));
                        b
                    }
                };
                let _ = back.send(&buf[..n]).await;
            }
        });
        Ok(UdpRelay {
            addr,
            blackhole,
            task,
        })
    }

    /// Drops every packet both ways while `on`.
    pub fn set_outage(&self, on: bool) {
        self.blackhole
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

/// GET over plain HTTP (the operations listeners): status and body.
pub async fn plain_get(addr: SocketAddr, path: &str) -> Result<(StatusCode, String)> {
    let tcp = TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let resp = sender
        .send_request(Request::get(path).header("host", "ops").body(empty())?)
        .await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The value of one sample line (`name{labels} value`) in Prometheus text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.trim().split(' ').next()?.parse().ok())
    })
}

/// Reads a response body to its end: `Some(Ok(()))` for a clean end,
/// `Some(Err(_))` for an aborted one, `None` if it did not end within `limit`.
pub async fn body_end(body: &mut Incoming, limit: Duration) -> Option<Result<(), hyper::Error>> {
    tokio::time::timeout(limit, async {
        loop {
            match body.frame().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            }
        }
    })
    .await
    .ok()
}

// Not every test binary that includes this module uses both.
#[allow(unused_imports)]
pub use tether_tests::netns::{API, TUNNEL_PORT};

/// `tether-cloud` in the cloud namespace of `link`.
pub fn cloud_cmd(
    link: &linkemu::Link,
    pki: &tether_tests::pki::Pki,
    extra: &[String],
) -> tokio::process::Command {
    tether_tests::netns::cloud_cmd(link, pki, extra, "info,tether_cloud=debug").unwrap()
}

/// `tether-cloud` in the cloud namespace of `link`, waited for until ready; also
/// returns its ready line (which names its listeners).
#[allow(dead_code)]
pub async fn spawn_cloud(
    name: &str,
    link: &linkemu::Link,
    pki: &tether_tests::pki::Pki,
    dir: &std::path::Path,
    extra: &[String],
) -> (Proc, String) {
    let mut cloud = Proc::spawn(
        name,
        cloud_cmd(link, pki, extra),
        dir,
        SpawnOptions::default(),
    )
    .unwrap();
    let ready = cloud
        .wait_line("cloud ready", Duration::from_secs(20), |l| {
            l.starts_with("tether-cloud ready")
        })
        .await
        .unwrap();
    (cloud, ready)
}

/// A kubelet stand-in for `edge-1` running `default/p1`, listening inside the edge
/// namespace of `link`; returns it and its port.
#[allow(dead_code)]
pub fn kubelet_in_edge(link: &linkemu::Link) -> (Kubelet, u16) {
    let listener = link
        .in_edge(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap()
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    (
        Kubelet::start_on(listener, "edge-1", &["default/p1"]).unwrap(),
        port,
    )
}

/// A client of the cloud's kubelet-API listener that dials from inside the cloud
/// namespace of `link` (where the apiserver would be).
#[allow(dead_code)]
pub fn client_in_cloud(link: &Arc<linkemu::Link>, pki: &tether_tests::pki::Pki) -> Client {
    let l2 = link.clone();
    Client::new(pki, API.parse().unwrap())
        .unwrap()
        .with_dial(Arc::new(move |a| {
            l2.in_cloud(|| std::net::TcpStream::connect(a))
                .map_err(std::io::Error::other)?
        }))
}

/// GETs a log of `default/p1` through the tunnel until it answers 200
/// (bounded by `limit`); the last answer or error otherwise.
#[allow(dead_code)]
pub async fn get_ok(client: &Client, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let r = client
            .get("/containerLogs/default/p1/c", "10.96.0.1:6443", None, &[])
            .await;
        match &r {
            Ok(r) if r.status == StatusCode::OK => return Ok(()),
            _ if Instant::now() > deadline => {
                return Err(format!("{:?}", r.map(|r| (r.status, r.body))))
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// `tether-edge` in the edge namespace of `link`, waited for until connected;
/// it announces `edge-1.invalid`.
pub async fn spawn_edge(
    link: &linkemu::Link,
    pki: &tether_tests::pki::Pki,
    dir: &std::path::Path,
    kubelet_port: u16,
    extra: &[&str],
) -> Proc {
    spawn_edge_announcing(link, pki, dir, kubelet_port, Some("edge-1.invalid"), extra).await
}

/// [`spawn_edge`] announcing `announce`, or with `None` what an edge
/// announces by default: the addresses of the edge namespace.
pub async fn spawn_edge_announcing(
    link: &linkemu::Link,
    pki: &tether_tests::pki::Pki,
    dir: &std::path::Path,
    kubelet_port: u16,
    announce: Option<&str>,
    extra: &[&str],
) -> Proc {
    let mut cmd = link.exec_in_edge(tether_tests::bins::binary("tether-edge").unwrap());
    cmd.arg("--cloud")
        .arg(format!("{}:{TUNNEL_PORT}", link.cloud_ip()))
        .args(pki.edge_flags("edge-1").expect("the test PKI has edge-1"))
        .args([
            "--kubelet-url",
            &format!("http://127.0.0.1:{kubelet_port}"),
            "--pods-refresh",
            "500ms",
        ])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .args(
            announce
                .map(|a| ["--announce-address", a])
                .into_iter()
                .flatten(),
        )
        .args(extra)
        .env("TETHER_LOG", "info,tether_edge=debug")
        .env("RUST_BACKTRACE", "0");
    let mut edge = Proc::spawn(
        "tether-edge",
        tokio::process::Command::from(cmd),
        dir,
        SpawnOptions::default(),
    )
    .unwrap();
    edge.wait_connected("edge connected", Duration::from_secs(30))
        .await
        .unwrap();
    edge
}

/// An edge driven by hand (a compromised edge, or one whose certificate an operator is
/// revoking): QUIC with mutual TLS, the hello, the welcome and the commit, then its frames
/// are the test's to write.
pub struct RawEdge {
    pub endpoint: quinn::Endpoint,
    pub conn: quinn::Connection,
    /// The control stream.
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
    pub reader: tether_proto::io::FrameReader,
}

impl RawEdge {
    /// Connects to `tunnel` with the edge certificate `cert_pem`/`key_pem` (trusting
    /// `ca_pem`), says hello as `node` and commits to the new session.
    pub async fn connect(
        tunnel: SocketAddr,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
        node: &str,
    ) -> Result<RawEdge> {
        Self::connect_announcing(tunnel, ca_pem, cert_pem, key_pem, node, vec![]).await
    }

    /// [`RawEdge::connect`] with `addresses` announced in the hello; an
    /// answer other than a welcome (a refusal) is the error, with its code
    /// and message.
    pub async fn connect_announcing(
        tunnel: SocketAddr,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
        node: &str,
        addresses: Vec<String>,
    ) -> Result<RawEdge> {
        use tether_proto::handshake::{Hello, PROTOCOL_VERSION};
        use tether_proto::io::{write_frame, FrameReader};
        use tether_proto::Frame as Wire;
        let (endpoint, conn) = Self::handshake(tunnel, ca_pem, cert_pem, key_pem).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        let hello = Hello {
            versions: vec![PROTOCOL_VERSION],
            node: node.into(),
            addresses,
            resume: tether_proto::token::ResumeToken(rand::random()),
            instance: 1,
            attempt: 1,
            limits: tether_proto::Limits::default(),
            ticket: None,
        };
        write_frame(&mut send, &Wire::Hello(hello), 1 << 20).await?;
        let mut reader = FrameReader::new(1 << 20);
        let welcome = tokio::time::timeout(Duration::from_secs(10), reader.next(&mut recv))
            .await
            .context("a welcome within 10 s")??;
        let Some(Wire::Welcome(w)) = welcome else {
            bail!("expected a welcome, got {welcome:?}");
        };
        write_frame(&mut send, &Wire::Commit { session: w.session }, 1 << 20).await?;
        Ok(RawEdge {
            endpoint,
            conn,
            send,
            recv,
            reader,
        })
    }

    /// Only the QUIC/TLS handshake an edge starts (no hello yet).
    pub async fn handshake(
        tunnel: SocketAddr,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<(quinn::Endpoint, quinn::Connection)> {
        let endpoint = Self::endpoint(ca_pem, cert_pem, key_pem)?;
        let conn = tokio::time::timeout(
            Duration::from_secs(10),
            endpoint.connect(tunnel, pki::CLOUD_SERVER_NAME)?,
        )
        .await
        .context("QUIC handshake within 10 s")??;
        Ok((endpoint, conn))
    }

    /// An edge's QUIC endpoint (one UDP socket: every connection it dials
    /// comes from the same source address and port).
    pub fn endpoint(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<quinn::Endpoint> {
        Self::endpoint_with(ca_pem, cert_pem, key_pem, None)
    }

    /// [`RawEdge::endpoint`] whose connections use `transport` (quinn's
    /// defaults when `None`).
    pub fn endpoint_with(
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
        transport: Option<quinn::TransportConfig>,
    ) -> Result<quinn::Endpoint> {
        use tether_proto::handshake::ALPN_TUNNEL;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in tether_certs::pem::certs_from_pem(ca_pem, "ca")? {
            roots.add(c)?;
        }
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_client_auth_cert(
                tether_certs::pem::certs_from_pem(cert_pem, "edge certificate")?,
                tether_certs::pem::key_from_pem(key_pem, "edge key")?,
            )?;
        tls.alpn_protocols = vec![ALPN_TUNNEL.to_vec()];
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        if let Some(t) = transport {
            config.transport_config(Arc::new(t));
        }
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
        endpoint.set_default_client_config(config);
        Ok(endpoint)
    }
}
