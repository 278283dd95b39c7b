//! The cloud's configuration: flags and `TETHER_*` environment variables,
//! parsed once in `main` and passed down as [`CloudConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tether_proto::cli::{LimitArgs, LogArgs, QuicArgs};
use tether_proto::quic::QuicSettings;
use tether_proto::units::{parse_bytes_u32, parse_duration};
use tether_proto::Limits;

/// Command-line flags of `tether-cloud`.
#[derive(Debug, Parser)]
#[command(
    name = "tether-cloud",
    version,
    args_override_self = true,
    about = "Tether cloud: serves the kubelet API to the kube-apiserver and forwards it to edge nodes over QUIC"
)]
pub struct CloudArgs {
    /// UDP address of the QUIC listener edges dial.
    #[arg(long, env = "TETHER_TUNNEL_LISTEN", default_value = "0.0.0.0:10004")]
    pub tunnel_listen: SocketAddr,
    /// Certificate (PEM chain) of the QUIC listener.
    #[arg(long, env = "TETHER_TUNNEL_CERT")]
    pub tunnel_cert: PathBuf,
    /// Private key (PEM) of the QUIC listener.
    #[arg(long, env = "TETHER_TUNNEL_KEY")]
    pub tunnel_key: PathBuf,
    /// CA (PEM) that signs edge certificates; the node name comes from the edge's certificate.
    #[arg(long, env = "TETHER_EDGE_CA")]
    pub edge_ca: PathBuf,
    /// TCP address of the kubelet-API listener the apiserver reaches (DNAT target).
    #[arg(long, env = "TETHER_KUBELET_LISTEN", default_value = "0.0.0.0:10003")]
    pub kubelet_listen: SocketAddr,
    /// Serving certificate (PEM chain) of the kubelet-API listener.
    #[arg(long, env = "TETHER_KUBELET_CERT")]
    pub kubelet_cert: PathBuf,
    /// Private key (PEM) of the kubelet-API listener.
    #[arg(long, env = "TETHER_KUBELET_KEY")]
    pub kubelet_key: PathBuf,
    /// CA (PEM) of the apiserver's kubelet-client certificate (`--kubelet-client-certificate`).
    #[arg(
        long,
        env = "TETHER_APISERVER_CLIENT_CA",
        required_unless_present = "insecure_skip_client_auth"
    )]
    pub apiserver_client_ca: Option<PathBuf>,
    /// Accept apiserver connections without a client certificate. Local development only.
    #[arg(long, env = "TETHER_INSECURE_SKIP_CLIENT_AUTH")]
    pub insecure_skip_client_auth: bool,
    /// Kubeconfig for the apiserver whose pods and nodes decide routing (default:
    /// the in-cluster service account). Needs get/list/watch on pods and nodes.
    #[arg(long, env = "TETHER_APISERVER_KUBECONFIG")]
    pub apiserver_kubeconfig: Option<PathBuf>,
    /// Route by the pods and addresses edges report, without an apiserver. Unsafe:
    /// an edge can then claim another node's pods and addresses. Development only.
    #[arg(
        long,
        env = "TETHER_INSECURE_TRUST_EDGE_REPORTS",
        conflicts_with = "apiserver_kubeconfig"
    )]
    pub insecure_trust_edge_reports: bool,
    /// How long the first list of pods and nodes from the apiserver may take at start.
    #[arg(long, env = "TETHER_APISERVER_SYNC_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub apiserver_sync_timeout: Duration,
    /// How long to wait for the kubelet's response head before answering 504.
    #[arg(long, env = "TETHER_RESPONSE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub response_timeout: Duration,
    /// How long a disconnected edge's streams wait for it to resume before they end.
    #[arg(long, env = "TETHER_GRACE", default_value = "5m", value_parser = parse_duration)]
    pub grace: Duration,
    /// Time allowed for an edge's QUIC handshake and hello.
    #[arg(long, env = "TETHER_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,
    /// Time allowed for an apiserver's TLS handshake and request head.
    #[arg(long, env = "TETHER_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,
    /// Largest HTTP request head from the apiserver (at least 8KiB).
    #[arg(long, env = "TETHER_MAX_HTTP_HEADER_BYTES", default_value = "64KiB", value_parser = parse_bytes_u32)]
    pub max_http_header_bytes: u32,
    /// Concurrent apiserver connections.
    #[arg(long, env = "TETHER_MAX_APISERVER_CONNECTIONS", default_value_t = 4096)]
    pub max_apiserver_connections: usize,
    /// Address of the operations listener (`/metrics`, `/healthz`, `/readyz`, `/status`).
    #[arg(long, env = "TETHER_METRICS_LISTEN", default_value = "0.0.0.0:9090")]
    pub metrics_listen: SocketAddr,
    /// On SIGTERM, how long open streams may finish before edges are disconnected.
    #[arg(long, env = "TETHER_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Join-token store written by `tether-certs token create`; enables the
    /// join ALPN (new edges obtain their certificate with a token).
    #[arg(long, env = "TETHER_JOIN_STORE", requires_all = ["join_ca_cert", "join_ca_key"])]
    pub join_store: Option<PathBuf>,
    /// CA certificate (PEM) that signs joining edges' certificates (normally the edge CA).
    #[arg(long, env = "TETHER_JOIN_CA_CERT")]
    pub join_ca_cert: Option<PathBuf>,
    /// CA private key (PEM) for signing joining edges' certificates.
    #[arg(long, env = "TETHER_JOIN_CA_KEY")]
    pub join_ca_key: Option<PathBuf>,
    /// Lifetime of certificates issued to joining edges.
    #[arg(long, env = "TETHER_JOIN_CERT_VALIDITY", default_value = "720h", value_parser = parse_duration)]
    pub join_cert_validity: Duration,
    /// Concurrent edge connections (handshaking or established).
    #[arg(long, env = "TETHER_MAX_EDGES", default_value_t = 20000)]
    pub max_edges: usize,
    /// Edge QUIC/TLS handshakes in progress at once; the Initial
    /// packets of further edges are dropped, and their QUIC retransmits them
    /// later. Keeps a reconnect storm (every edge after a cloud restart) from
    /// spending the CPU on handshakes the edges abandon after their timeout.
    #[arg(long, env = "TETHER_MAX_PENDING_HANDSHAKES", default_value_t = 512)]
    pub max_pending_handshakes: usize,
    /// A TOML file of settings (keys are the long flag names); flags and
    /// environment variables override it.
    #[arg(long, env = "TETHER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration (secrets redacted) and exit.
    #[arg(long)]
    pub print_config: bool,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub quic: QuicArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// Where joining edges' certificates come from.
#[derive(Debug, Clone)]
pub struct JoinConfig {
    pub store: PathBuf,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub validity: Duration,
}

/// Where the pods and addresses routing trusts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthoritySource {
    /// The apiserver, through this kubeconfig (`None`: in-cluster).
    Apiserver {
        kubeconfig: Option<PathBuf>,
        sync_timeout: Duration,
    },
    /// The edges' own reports (`--insecure-trust-edge-reports`).
    EdgeReports,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct CloudConfig {
    pub tunnel_listen: SocketAddr,
    pub tunnel_cert: PathBuf,
    pub tunnel_key: PathBuf,
    pub edge_ca: PathBuf,
    pub kubelet_listen: SocketAddr,
    pub kubelet_cert: PathBuf,
    pub kubelet_key: PathBuf,
    /// `None` only with the insecure opt-out.
    pub apiserver_client_ca: Option<PathBuf>,
    /// Where routing's truth comes from.
    pub authority: AuthoritySource,
    pub response_timeout: Duration,
    pub grace: Duration,
    pub handshake_timeout: Duration,
    pub http_header_timeout: Duration,
    pub max_http_header_bytes: usize,
    pub max_apiserver_connections: usize,
    pub max_edges: usize,
    pub max_pending_handshakes: usize,
    pub metrics_listen: SocketAddr,
    pub shutdown_grace: Duration,
    /// Join settings, when joins are enabled.
    pub join: Option<JoinConfig>,
    pub limits: Limits,
    pub quic: QuicSettings,
}

impl tether_proto::cli::BinaryArgs for CloudArgs {
    type Config = CloudConfig;
    fn wants_print_config(&self) -> bool {
        self.print_config
    }
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
    fn validate(self) -> Result<CloudConfig, String> {
        self.into_config()
    }
}

impl CloudArgs {
    /// Checks the flags and builds the configuration.
    pub fn into_config(self) -> Result<CloudConfig, String> {
        let limits = self.limits.limits()?;
        let quic = self
            .quic
            .settings(&limits, tether_proto::cli::Role::Cloud)?;
        if self.max_http_header_bytes < 8192 {
            return Err("--max-http-header-bytes must be at least 8KiB".into());
        }
        let apiserver_client_ca = if self.insecure_skip_client_auth {
            None
        } else {
            self.apiserver_client_ca
        };
        Ok(CloudConfig {
            tunnel_listen: self.tunnel_listen,
            tunnel_cert: self.tunnel_cert,
            tunnel_key: self.tunnel_key,
            edge_ca: self.edge_ca,
            kubelet_listen: self.kubelet_listen,
            kubelet_cert: self.kubelet_cert,
            kubelet_key: self.kubelet_key,
            apiserver_client_ca,
            authority: if self.insecure_trust_edge_reports {
                AuthoritySource::EdgeReports
            } else {
                if self.apiserver_sync_timeout.is_zero() {
                    return Err("--apiserver-sync-timeout must be more than 0".into());
                }
                AuthoritySource::Apiserver {
                    kubeconfig: self.apiserver_kubeconfig,
                    sync_timeout: self.apiserver_sync_timeout,
                }
            },
            response_timeout: self.response_timeout,
            grace: self.grace,
            handshake_timeout: self.handshake_timeout,
            http_header_timeout: self.http_header_timeout,
            max_http_header_bytes: self.max_http_header_bytes as usize,
            max_apiserver_connections: self.max_apiserver_connections,
            max_edges: self.max_edges,
            max_pending_handshakes: self.max_pending_handshakes,
            metrics_listen: self.metrics_listen,
            shutdown_grace: self.shutdown_grace,
            join: match (self.join_store, self.join_ca_cert, self.join_ca_key) {
                (Some(store), Some(ca_cert), Some(ca_key)) => Some(JoinConfig {
                    store,
                    ca_cert,
                    ca_key,
                    validity: self.join_cert_validity,
                }),
                (None, _, _) => None,
                _ => return Err("--join-store needs --join-ca-cert and --join-ca-key".into()),
            },
            limits,
            quic,
        })
    }
}
