//! apiserver-sim: a small, faithful kube-apiserver stand-in for Tether's tests. Real
//! kubectl talks to it over HTTPS; it serves discovery, pods and nodes from flags, and
//! proxies pods/exec|attach|portforward|log and nodes/proxy to kubelets the way
//! kube-apiserver does (same kubelet URLs, `Host` headers, SNI and client certificate;
//! exec/attach over WebSocket translated to SPDY by default, [`translate`]),
//! and answers TokenReview / SubjectAccessReview from a tokens-and-rules file.
//! This file owns the command line, start-up and the accept loop.

mod body;
mod clock;
mod cluster;
mod connect;
mod discovery;
mod headers;
mod kubeconfig;
mod kubelet;
mod logs;
mod nodeproxy;
mod pods;
mod query;
mod reverse;
mod reviews;
mod router;
mod status;
mod table;
mod tls;
mod translate;
mod upgrade;
mod watch;
mod wsbridge;
mod wsportforward;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::cluster::{Cluster, Node, Pod};
use crate::kubelet::Kubelets;
use crate::router::State;

/// Bound on concurrent client connections.
const MAX_CONNECTIONS: usize = 512;
/// Bound on a client's TLS handshake.
const TLS_ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on reading a request head.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A kube-apiserver stand-in that proxies kubectl's pod connect/log and node proxy
/// requests to kubelets like kube-apiserver does.
#[derive(Debug, Parser)]
#[command(name = "apiserver-sim", version)]
struct Cli {
    /// Address to serve HTTPS on (port 0 picks a free port; see --write-kubeconfig).
    #[arg(long, default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Serving certificate (PEM, chain allowed). Generated with a throw-away CA if omitted.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Serving private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA that signed --tls-cert, for the kubeconfig (default: --tls-cert itself).
    #[arg(long, requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// Extra DNS names / IPs for the generated serving certificate.
    #[arg(long = "tls-san")]
    tls_sans: Vec<String>,
    /// Write a kubeconfig (server URL, CA data, bearer token) here once listening.
    #[arg(long)]
    write_kubeconfig: Option<PathBuf>,
    /// Bearer token put in the kubeconfig (not checked).
    #[arg(long, default_value = "apiserver-sim-token")]
    token: String,
    /// Client certificate presented to kubelets (PEM).
    #[arg(long, requires = "kubelet_client_key")]
    kubelet_client_cert: Option<PathBuf>,
    /// Private key of --kubelet-client-cert (PEM).
    #[arg(long, requires = "kubelet_client_cert")]
    kubelet_client_key: Option<PathBuf>,
    /// Verify kubelet serving certificates against this CA (default: no verification,
    /// like kube-apiserver without --kubelet-certificate-authority).
    #[arg(long)]
    kubelet_ca: Option<PathBuf>,
    /// A node: NAME=ADDRESS[:PORT] (status address, IP or DNS name; kubelet port, default 10250).
    #[arg(long = "node", value_name = "NAME=ADDRESS[:PORT]")]
    nodes: Vec<String>,
    /// Dial every kubelet connection to HOST:PORT instead (emulates a DNAT); Host, SNI and
    /// URLs still name the node's address. A comma-separated list: each connection goes
    /// to the next in turn (a DNAT over several cloud replicas).
    #[arg(long, value_name = "HOST:PORT")]
    kubelet_dial: Option<String>,
    /// A pod: [NS/]NAME=NODE:CONTAINER[,CONTAINER...] (a container may be NAME@IMAGE).
    #[arg(long = "pod", value_name = "NS/NAME=NODE:CONTAINERS")]
    pods: Vec<String>,
    /// JSON array of pods: [{"namespace","name","node","containers":["c1"]}].
    #[arg(long)]
    pods_file: Option<PathBuf>,
    /// Tokens and rules for TokenReview / SubjectAccessReview:
    /// {"tokens":[{"token","username","uid","groups"}],
    ///  "rules":[{"name","user"|"group","verbs":[..],"resources":["nodes/metrics",..]}]}.
    #[arg(long)]
    auth_file: Option<PathBuf>,
    /// Answer every TokenReview and SubjectAccessReview only after this many
    /// milliseconds (a stalled apiserver).
    #[arg(long, default_value_t = 0)]
    review_delay_ms: u64,
    /// Longest watch, in seconds (a client's smaller `timeoutSeconds` wins).
    #[arg(long, default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..))]
    watch_timeout_secs: u64,
    /// After this many seconds the cluster's resourceVersion moves from 1 to 2 and the
    /// old one is compacted: open watches end, and resuming from 1 gets 410 Gone.
    #[arg(long)]
    compact_after_secs: Option<f64>,
    /// exec/attach requested over WebSocket with `v5.channel.k8s.io` offered: `translate`
    /// to SPDY towards the kubelet (kube-apiserver ≥1.30's default) or `passthrough` the
    /// WebSocket upgrade untouched. Port-forward is not affected.
    #[arg(long, value_enum, default_value = "translate")]
    stream_translation: translate::StreamTranslation,
}

fn build_cluster(cli: &Cli) -> Result<Cluster> {
    let nodes = cli
        .nodes
        .iter()
        .map(|s| Node::parse(s))
        .collect::<Result<Vec<_>>>()?;
    let mut pods = cli
        .pods
        .iter()
        .map(|s| Pod::parse(s))
        .collect::<Result<Vec<_>>>()?;
    if let Some(f) = &cli.pods_file {
        pods.extend(cluster::read_pods_file(f)?);
    }
    Cluster::new(nodes, pods)
}

fn serving_identity(cli: &Cli, bound: SocketAddr) -> Result<tls::ServingIdentity> {
    match (&cli.tls_cert, &cli.tls_key) {
        (Some(cert), Some(key)) => {
            let cert_pem = tls::read_pem(cert)?;
            let key_pem = tls::read_pem(key)?;
            let ca_pem = match &cli.tls_ca {
                Some(ca) => tls::read_pem(ca)?,
                None => cert_pem.clone(),
            };
            Ok(tls::ServingIdentity {
                ca_pem,
                cert_pem,
                key_pem,
            })
        }
        _ => {
            let mut hosts: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
            let ip = bound.ip();
            if !ip.is_unspecified() && !hosts.contains(&ip.to_string()) {
                hosts.push(ip.to_string());
            }
            hosts.extend(cli.tls_sans.iter().cloned());
            tls::generate_serving(&hosts)
        }
    }
}

fn kubelets(cli: &Cli) -> Result<Kubelets> {
    let ca = cli.kubelet_ca.as_deref().map(tls::read_pem).transpose()?;
    let config = match (&cli.kubelet_client_cert, &cli.kubelet_client_key) {
        (Some(c), Some(k)) => {
            tls::kubelet_client_config(&tls::read_pem(c)?, &tls::read_pem(k)?, ca.as_deref())?
        }
        _ => tls::kubelet_client_config_anonymous(ca.as_deref())?,
    };
    let mut dial = Vec::new();
    for d in cli.kubelet_dial.iter().flat_map(|d| d.split(',')) {
        if cluster::split_host_port(d)?.1.is_none() {
            bail!("--kubelet-dial {d:?}: expected HOST:PORT");
        }
        dial.push(d.to_string());
    }
    Ok(Kubelets::new(config, dial))
}

/// The address clients should use: the bound one, loopback if unspecified.
fn advertised(bound: SocketAddr) -> SocketAddr {
    if bound.ip().is_unspecified() {
        let ip: IpAddr = if bound.is_ipv4() {
            IpAddr::from([127, 0, 0, 1])
        } else {
            IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1])
        };
        SocketAddr::new(ip, bound.port())
    } else {
        bound
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("apiserver-sim: error: {e:#}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> Result<()> {
    clock::started();
    let cluster = build_cluster(&cli)?;
    let kubelets = kubelets(&cli)?;

    let listener = TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("binding {}", cli.listen))?;
    let bound = listener.local_addr().context("local address")?;
    let adv = advertised(bound);
    let identity = serving_identity(&cli, adv)?;
    let server_tls = tls::server_config(&identity)?;
    let server_url = format!("https://{adv}");
    if let Some(path) = &cli.write_kubeconfig {
        kubeconfig::write(path, &server_url, &identity.ca_pem, &cli.token)?;
        eprintln!("apiserver-sim: wrote kubeconfig {}", path.display());
    }
    for n in cluster.nodes.values() {
        eprintln!(
            "apiserver-sim: node {} kubelet https://{}",
            n.name,
            n.host_port()
        );
    }
    eprintln!(
        "apiserver-sim: listening on {server_url} ({} nodes, {} pods)",
        cluster.nodes.len(),
        cluster.pods.len()
    );

    let auth = match &cli.auth_file {
        Some(f) => reviews::AuthConfig::read(f)?,
        None => reviews::AuthConfig::default(),
    };
    eprintln!(
        "apiserver-sim: exec/attach over WebSocket: {:?}",
        cli.stream_translation
    );
    let state = Arc::new(State {
        stream_translation: cli.stream_translation,
        reviews: reviews::Reviews::new(auth, Duration::from_millis(cli.review_delay_ms)),
        cluster,
        kubelets,
        server_address: adv.to_string(),
        versions: watch::Versions::new(
            cli.compact_after_secs.map(Duration::from_secs_f64),
            Duration::from_secs(cli.watch_timeout_secs),
        ),
    });
    let acceptor = TlsAcceptor::from(server_tls);
    let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));

    loop {
        let permit = limit
            .clone()
            .acquire_owned()
            .await
            .context("semaphore closed")?;
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    eprintln!("apiserver-sim: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = tokio::signal::ctrl_c() => {
                eprintln!("apiserver-sim: interrupted, exiting");
                return Ok(());
            }
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let tls = match tokio::time::timeout(TLS_ACCEPT_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(t)) => t,
                Ok(Err(e)) => {
                    eprintln!("apiserver-sim: TLS from {peer}: {e}");
                    return;
                }
                Err(_) => {
                    eprintln!("apiserver-sim: TLS from {peer}: handshake timed out");
                    return;
                }
            };
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            let service = service_fn(move |req| router::handle(req, state.clone(), peer));
            if let Err(e) = builder
                .serve_connection_with_upgrades(TokioIo::new(tls), service)
                .await
            {
                let msg = e.to_string();
                if !msg.contains("connection closed") && !msg.contains("not connected") {
                    eprintln!("apiserver-sim: connection from {peer}: {msg}");
                }
            }
        });
    }
}
