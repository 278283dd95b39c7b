//! The HTTP(S) server: shared state, TLS setup (rustls/ring, optional client
//! certificates), the accept loop (one task per connection, HTTP/1.1 with
//! upgrades), routing of kubelet paths to their handlers, and the
//! `X-Kubelet-Sim-Node` header on every response.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::config::Cli;
use crate::http_util::{self, percent_decode, query_flag, query_pairs, Body};
use crate::pods::Pods;
use crate::remotecommand::{Kind, Target};
use crate::{attach, debug, logs, metrics, nodelogs, portforward, remotecommand};

/// Header naming the node that served a response.
pub const NODE_HEADER: &str = "x-kubelet-sim-node";

/// State shared by all connections.
pub struct AppState {
    pub node: String,
    pub pods: Pods,
    pub log_dir: PathBuf,
    pub work_dir: Option<PathBuf>,
    pub attach: attach::Registry,
    pub logs: logs::LogIndex,
    pub started: Instant,
    pub port: u16,
}

impl AppState {
    /// Working directory of processes in a container.
    pub fn container_cwd(&self, ns: &str, pod: &str, container: &str) -> PathBuf {
        match &self.work_dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir()
                .join(format!("kubelet-sim-{}", self.node))
                .join(format!("{ns}_{pod}_{container}")),
        }
    }
}

fn load_tls(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<tokio_rustls::TlsAcceptor> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut std::io::BufReader::new(
        std::fs::File::open(cert).with_context(|| format!("open {}", cert.display()))?,
    ))
    .collect::<std::result::Result<_, _>>()
    .with_context(|| format!("parse certificates in {}", cert.display()))?;
    let key = rustls_pemfile::private_key(&mut std::io::BufReader::new(
        std::fs::File::open(key).with_context(|| format!("open {}", key.display()))?,
    ))
    .with_context(|| format!("parse private key in {}", key.display()))?
    .with_context(|| format!("no private key in {}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in rustls_pemfile::certs(&mut std::io::BufReader::new(
                std::fs::File::open(ca).with_context(|| format!("open {}", ca.display()))?,
            )) {
                roots
                    .add(c.with_context(|| format!("parse {}", ca.display()))?)
                    .context("add client CA")?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .context("client certificate verifier")?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .context("TLS certificate/key")?;
    // Upgrades need HTTP/1.1; that is all we speak.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Bind, print the bound address on stdout, and serve forever.
pub async fn run(cli: Cli) -> Result<()> {
    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(c), Some(k)) => Some(load_tls(c, k, cli.client_ca.as_deref())?),
        _ => None,
    };
    std::fs::create_dir_all(&cli.log_dir)
        .with_context(|| format!("create log dir {}", cli.log_dir.display()))?;
    let listener = TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("bind {}", cli.listen))?;
    let local = listener.local_addr().context("local address")?;
    let state = Arc::new(AppState {
        node: cli.node_name.clone(),
        pods: Pods::new(cli.node_name.clone(), cli.pods.clone()),
        log_dir: cli.log_dir.clone(),
        work_dir: cli.work_dir.clone(),
        attach: attach::Registry::default(),
        logs: logs::LogIndex::default(),
        started: Instant::now(),
        port: local.port(),
    });
    println!(
        "kubelet-sim listening on {}://{local} node={}",
        if tls.is_some() { "https" } else { "http" },
        cli.node_name
    );
    tracing::info!("listening on {local}");
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let state = state.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                Some(acceptor) => {
                    match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await
                    {
                        Ok(Ok(s)) => serve_connection(s, state, peer).await,
                        Ok(Err(e)) => tracing::debug!("TLS handshake with {peer}: {e}"),
                        Err(_) => tracing::debug!("TLS handshake with {peer} timed out"),
                    }
                }
                None => serve_connection(tcp, state, peer).await,
            }
        });
    }
}

async fn serve_connection<IO>(io: IO, state: Arc<AppState>, peer: SocketAddr)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = service_fn(move |req| {
        let state = state.clone();
        async move {
            let node = state.node.clone();
            let mut resp = route(state, req).await;
            if let Ok(v) = node.parse() {
                resp.headers_mut().insert(NODE_HEADER, v);
            }
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .max_buf_size(1 << 20)
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades();
    if let Err(e) = conn.await {
        tracing::debug!("connection from {peer}: {e}");
    }
}

fn method_not_allowed() -> Response<Body> {
    http_util::text(StatusCode::METHOD_NOT_ALLOWED, "405 method not allowed\n")
}

fn page_not_found() -> Response<Body> {
    http_util::text(StatusCode::NOT_FOUND, "404 page not found\n")
}

/// Dispatch one request.
pub async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let get_or_post = method == Method::GET || method == Method::POST;
    let segs: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    let s: Vec<&str> = segs.iter().map(String::as_str).collect();
    match s.as_slice() {
        [verb @ ("exec" | "attach"), ns, pod, rest @ ..] if !rest.is_empty() && rest.len() <= 2 => {
            if !get_or_post {
                return method_not_allowed();
            }
            let (uid, container) = match rest {
                [c] => (None, *c),
                [u, c] => (Some(u.to_string()), *c),
                _ => return page_not_found(),
            };
            let kind = if *verb == "exec" {
                Kind::Exec
            } else {
                Kind::Attach
            };
            let target = Target {
                namespace: ns.to_string(),
                pod: pod.to_string(),
                uid,
                container: container.to_string(),
            };
            remotecommand::handle(state, req, kind, target).await
        }
        ["portForward", ns, pod] | ["portForward", ns, pod, ""] => {
            if !get_or_post {
                return method_not_allowed();
            }
            let (ns, pod) = (ns.to_string(), pod.to_string());
            portforward::handle(state, req, &ns, &pod, None).await
        }
        ["portForward", ns, pod, uid] => {
            if !get_or_post {
                return method_not_allowed();
            }
            let (ns, pod, uid) = (ns.to_string(), pod.to_string(), uid.to_string());
            portforward::handle(state, req, &ns, &pod, Some(&uid)).await
        }
        ["containerLogs", ns, pod, container] => {
            if method != Method::GET {
                return method_not_allowed();
            }
            logs::handle(state.clone(), req.uri().query(), ns, pod, container).await
        }
        ["logs"] => nodelogs::serve(&state.log_dir, "").await,
        ["logs", ..] => {
            let rel = percent_decode(path.trim_start_matches("/logs/"));
            nodelogs::serve(&state.log_dir, &rel).await
        }
        ["metrics"] => http_util::prometheus(metrics::kubelet_metrics(
            &state.node,
            state.pods.all(),
            state.started,
        )),
        ["metrics", "cadvisor"] => {
            http_util::prometheus(metrics::cadvisor_metrics(state.pods.all(), state.started))
        }
        ["metrics", "resource"] => {
            http_util::prometheus(metrics::resource_metrics(state.pods.all(), state.started))
        }
        ["metrics", "probes"] => http_util::prometheus(metrics::probe_metrics(state.pods.all())),
        ["metrics", "slis"] => http_util::prometheus(metrics::sli_metrics()),
        ["stats", "summary"] | ["stats", "summary", ""] => {
            if !get_or_post {
                return method_not_allowed();
            }
            let q = query_pairs(req.uri().query());
            http_util::json(
                StatusCode::OK,
                &metrics::stats_summary(
                    &state.node,
                    state.pods.all(),
                    state.started,
                    query_flag(&q, "only_cpu_and_memory"),
                ),
            )
        }
        ["pods"] | ["pods", ""] => http_util::json(StatusCode::OK, &state.pods.pod_list()),
        ["runningpods"] | ["runningpods", ""] => {
            http_util::json(StatusCode::OK, &state.pods.running_pods())
        }
        ["healthz"] | ["healthz", "ping" | "log" | "syncloop" | ""] => {
            http_util::text(StatusCode::OK, "ok")
        }
        ["configz"] => http_util::json(StatusCode::OK, &metrics::configz(&state.node, state.port)),
        ["debug", "echo-headers"] => debug::echo_headers(&req),
        ["debug", "echo-body"] => {
            if method != Method::POST && method != Method::PUT {
                return method_not_allowed();
            }
            debug::echo_body(req)
        }
        _ => page_not_found(),
    }
}
