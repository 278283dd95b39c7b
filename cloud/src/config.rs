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

use crate::identity::AllowedIdentity;

/// Bounds of `--peer-max-streams`: at least the route subscription and a few
/// relays; at most what QUIC's stream-count field and a peer link's memory
/// (~70 bytes per allowed stream) bear.
const MIN_PEER_STREAMS: u32 = 4;
const MAX_PEER_STREAMS: u32 = 1 << 20;
/// Most runtime threads `--worker-threads` accepts.
const MAX_WORKER_THREADS: usize = 1024;
/// Longest `--apiserver-read-timeout` accepted: a day is no bound in
/// practice, and the HTTP client's timer adds the value to the clock
/// unchecked (a value near `u64::MAX` seconds would panic there).
const MAX_APISERVER_READ_TIMEOUT: Duration = Duration::from_secs(86_400);
/// The longest `--shutdown-close-wait`: a replica that must go should not
/// linger for peers that may never answer.
const MAX_SHUTDOWN_CLOSE_WAIT: Duration = Duration::from_secs(60);
/// TLS 1.3 tickets an edge keeps per server (rustls' client cache).
const MAX_TICKETS_PER_HANDSHAKE: usize = 8;
/// Default of `--max-pods-per-report`: ninety times kubelet's default
/// `--max-pods` (110), a tenth of what the protocol allows.
pub const DEFAULT_MAX_PODS_PER_REPORT: usize = 10_000;
/// Most TCP keep-alive probes `--apiserver-keep-alive-probes` accepts
/// (Linux's bound on `TCP_KEEPCNT`).
const MAX_KEEP_ALIVE_PROBES: u32 = 127;

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
    /// Client-certificate identities allowed to use the kubelet-API front:
    /// `CN=<user>` or `O=<group>`, comma-separated or repeated. Any other
    /// certificate from `--apiserver-client-ca` (on kubeadm that CA signs every
    /// user's and node's certificate too) gets 403. The default is kubeadm's
    /// `--kubelet-client-certificate` identity.
    #[arg(
        long,
        env = "TETHER_APISERVER_ALLOWED_IDENTITY",
        value_delimiter = ',',
        default_value = "CN=kube-apiserver-kubelet-client"
    )]
    pub apiserver_allowed_identity: Vec<String>,
    /// Authenticate bearer tokens (metrics-server, Prometheus) with a
    /// TokenReview against the apiserver, as a kubelet with
    /// `--authentication-token-webhook`. Needs `--authorization-webhook`.
    #[arg(
        long,
        env = "TETHER_AUTHENTICATION_TOKEN_WEBHOOK",
        requires = "authorization_webhook"
    )]
    pub authentication_token_webhook: bool,
    /// Authorise every caller that is not one of `--apiserver-allowed-identity`
    /// with a SubjectAccessReview (resource `nodes`, subresource
    /// proxy/stats/metrics/log/spec, the node's name), as a kubelet with
    /// `--authorization-mode=Webhook`. Off: such callers get 403.
    #[arg(long, env = "TETHER_AUTHORIZATION_WEBHOOK")]
    pub authorization_webhook: bool,
    /// Serve requests with neither certificate nor token as `system:anonymous`
    /// (still authorised by a SubjectAccessReview). Off: 401.
    #[arg(
        long,
        env = "TETHER_ANONYMOUS_AUTH",
        requires = "authorization_webhook"
    )]
    pub anonymous_auth: bool,
    /// Kubeconfig for the TokenReviews and SubjectAccessReviews only (default:
    /// `--apiserver-kubeconfig`, else the in-cluster service account).
    #[arg(long, env = "TETHER_REVIEW_KUBECONFIG")]
    pub review_kubeconfig: Option<PathBuf>,
    /// How long a TokenReview answer is cached (kubelet: 2m).
    #[arg(long, env = "TETHER_AUTHENTICATION_CACHE_TTL", default_value = "2m", value_parser = parse_duration)]
    pub authentication_cache_ttl: Duration,
    /// How long an allowing SubjectAccessReview answer is cached (kubelet: 5m).
    #[arg(long, env = "TETHER_AUTHORIZATION_CACHE_TTL", default_value = "5m", value_parser = parse_duration)]
    pub authorization_cache_ttl: Duration,
    /// How long a denying SubjectAccessReview answer is cached (kubelet: 30s).
    #[arg(long, env = "TETHER_AUTHORIZATION_DENIED_CACHE_TTL", default_value = "30s", value_parser = parse_duration)]
    pub authorization_denied_cache_ttl: Duration,
    /// How long a review may take before the request fails with 503.
    #[arg(long, env = "TETHER_REVIEW_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub review_timeout: Duration,
    /// Answers kept per review cache (TokenReviews; SubjectAccessReviews)
    /// before expired ones are swept, and all of them if it is still full.
    #[arg(long, env = "TETHER_REVIEW_CACHE_ENTRIES", default_value_t = crate::authz::DEFAULT_CACHE_ENTRIES)]
    pub review_cache_entries: usize,
    /// Accept apiserver connections without a client certificate. Local development only.
    #[arg(long, env = "TETHER_INSECURE_SKIP_CLIENT_AUTH")]
    pub insecure_skip_client_auth: bool,
    /// Kubeconfig for the apiserver whose pods and nodes decide routing, and for
    /// the TokenReviews and SubjectAccessReviews of the webhook checks (default:
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
    /// How long the first list of pods and nodes from the apiserver may take at start;
    /// a later list that takes longer is logged as stalled and asked again.
    #[arg(long, env = "TETHER_APISERVER_SYNC_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub apiserver_sync_timeout: Duration,
    /// Longest silence on a connection to the apiserver of the pod and node
    /// watches before its request fails and is asked again. Below 295s an
    /// idle watch is cut too (warned about at start; it resumes, no re-list).
    #[arg(long, env = "TETHER_APISERVER_READ_TIMEOUT", default_value = "300s", value_parser = parse_duration)]
    pub apiserver_read_timeout: Duration,
    /// How long to wait for the kubelet's response head before answering 504.
    #[arg(long, env = "TETHER_RESPONSE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub response_timeout: Duration,
    /// How long a disconnected edge's streams wait for it to resume before they end
    /// (and how long a re-attach on a live connection waits for the edge's answer).
    #[arg(long, env = "TETHER_GRACE", default_value = "5m", value_parser = parse_duration)]
    pub grace: Duration,
    /// Time allowed for an edge's QUIC handshake and hello.
    #[arg(long, env = "TETHER_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,
    /// Time a control frame to an attached edge (a fresh resume ticket, the
    /// answer to a certificate renewal, a nudge after a migration) may take
    /// to leave: an edge that grants no stream credit on its control stream
    /// for this long is closed (it reconnects and resumes its streams).
    #[arg(long, env = "TETHER_CONTROL_WRITE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub control_write_timeout: Duration,
    /// How often the cloud looks at every edge connection's address whatever
    /// arrives (a NAT rebinding is noticed from the first packet sent from the
    /// new address; this sweep is the fallback).
    #[arg(long, env = "TETHER_MIGRATION_SWEEP_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    pub migration_sweep_interval: Duration,
    /// The least time between two looks at every edge connection's address:
    /// bounds what packets from unknown sources (spoofed ones too) can cost.
    #[arg(long, env = "TETHER_MIGRATION_SWEEP_MIN_GAP", default_value = "200ms", value_parser = parse_duration)]
    pub migration_sweep_min_gap: Duration,
    /// Time allowed for an apiserver's TLS handshake and request head (on
    /// HTTP/2, its preface and first request).
    #[arg(long, env = "TETHER_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,
    /// Largest HTTP request head from the apiserver (at least 8KiB).
    #[arg(long, env = "TETHER_MAX_HTTP_HEADER_BYTES", default_value = "64KiB", value_parser = parse_bytes_u32)]
    pub max_http_header_bytes: u32,
    /// Concurrent apiserver connections.
    #[arg(long, env = "TETHER_MAX_APISERVER_CONNECTIONS", default_value_t = 4096)]
    pub max_apiserver_connections: usize,
    /// Concurrent HTTP/2 streams (requests) one apiserver connection may
    /// have open (its SETTINGS_MAX_CONCURRENT_STREAMS); a stream opened past
    /// it is refused (REFUSED_STREAM) and may be retried: Go's HTTP/2 client
    /// (the apiserver's) waits for a free stream or dials another connection.
    #[arg(
        long,
        env = "TETHER_MAX_APISERVER_STREAMS_PER_CONNECTION",
        default_value_t = 200
    )]
    pub max_apiserver_streams_per_connection: u32,
    /// Keep-alive of apiserver connections: an HTTP/2 PING this often (the
    /// connection is closed when one goes unanswered this long), and TCP
    /// keep-alive probes after this long of silence, then this often.
    #[arg(long, env = "TETHER_APISERVER_KEEP_ALIVE", default_value = "30s", value_parser = parse_duration)]
    pub apiserver_keep_alive: Duration,
    /// Unanswered TCP keep-alive probes (one every --apiserver-keep-alive)
    /// after which an idle apiserver connection is dropped (1 to 127).
    #[arg(long, env = "TETHER_APISERVER_KEEP_ALIVE_PROBES", default_value_t = 3)]
    pub apiserver_keep_alive_probes: u32,
    /// Address of the operations listener (`/metrics`, `/healthz`, `/readyz`, `/status`).
    #[arg(long, env = "TETHER_METRICS_LISTEN", default_value = "0.0.0.0:9090")]
    pub metrics_listen: SocketAddr,
    /// On SIGTERM, how long open streams may finish before edges are disconnected.
    #[arg(long, env = "TETHER_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// On SIGTERM, edges are told to move to another replica spread evenly
    /// over this long (so the other replicas are not stormed); their open
    /// streams move with them. `0s`: all at once.
    #[arg(long, env = "TETHER_DRAIN_SPREAD", default_value = "10s", value_parser = parse_duration)]
    pub drain_spread: Duration,
    /// With peers, on SIGTERM, the least time the replica keeps serving (not
    /// ready) before it exits, so load balancers and the DNAT helpers stop
    /// sending it new connections first (a preStop delay built in).
    #[arg(long, env = "TETHER_SHUTDOWN_DELAY", default_value = "5s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,
    /// On SIGTERM, once the edge connections are closed, how long the replica
    /// waits for the closes to finish (quinn keeps each closed connection for
    /// three probe timeouts, to answer a peer whose own close was lost) before
    /// it exits anyway. `0s`: exit at once. At most 60s.
    #[arg(long, env = "TETHER_SHUTDOWN_CLOSE_WAIT", default_value = "2s", value_parser = parse_duration)]
    pub shutdown_close_wait: Duration,
    /// Secret file (at least 32 bytes of key material, e.g. from
    /// `tether-certs reset-key`) shared by every replica: the stateless-reset
    /// key of the edge listener, so any replica answers a packet for an edge
    /// connection it does not know (its holder crashed) with a stateless
    /// reset the edge accepts, and the edge reconnects at once instead of
    /// after the idle timeout. Unset: a random key per process.
    #[arg(long, env = "TETHER_RESET_KEY_FILE")]
    pub reset_key_file: Option<PathBuf>,
    /// How long the TLS session ticket an edge gets at each handshake lets
    /// it resume (no signatures or certificate checks; its certificate's
    /// revocation and validity are still checked): sealed under a key derived
    /// from `--reset-key-file` and the edge CAs, so any replica resumes it,
    /// after any restart. `0s`: no tickets. At most 168h (7 days, TLS 1.3's
    /// bound).
    #[arg(long, env = "TETHER_TLS_TICKET_LIFETIME", default_value = "168h", value_parser = parse_duration)]
    pub tls_ticket_lifetime: Duration,
    /// TLS session tickets an edge gets at each full or resumed handshake
    /// (each about 0.7 KB on the wire). An edge spends one per connection
    /// attempt, also on attempts no cloud answers (while a restarted cloud
    /// is down) or that a storm drops; once it has none left, its next
    /// handshake is a full one. More than one make the flight that carries
    /// them several datagrams, and quinn then keeps a send buffer of a whole
    /// segmentation batch (~13 KB) for the connection's life. 1 to 8 (what
    /// an edge keeps).
    #[arg(long, env = "TETHER_TLS_TICKETS_PER_HANDSHAKE", default_value_t = 1)]
    pub tls_tickets_per_handshake: usize,
    /// Least time between two stateless resets this replica sends (quinn's
    /// own default, 20 ms, resets at most 50 edges a second: after a crash
    /// of a replica that held thousands, the last would learn it only after
    /// the idle timeout). A reset is always smaller than the packet that drew
    /// it, and only packets whose connection ID carries the replicas' keyed
    /// signature draw one.
    #[arg(long, env = "TETHER_RESET_INTERVAL", default_value = "1ms", value_parser = parse_duration)]
    pub reset_interval: Duration,
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
    /// How long a joining edge may take to send its request after the handshake.
    #[arg(long, env = "TETHER_JOIN_REQUEST_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub join_request_timeout: Duration,
    /// How long a joining edge's QUIC may take to accept the answer (stream credit).
    #[arg(long, env = "TETHER_JOIN_ANSWER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub join_answer_timeout: Duration,
    /// How long the answer to a join may take to be acknowledged before the close.
    #[arg(long, env = "TETHER_JOIN_LINGER", default_value = "5s", value_parser = parse_duration)]
    pub join_linger: Duration,
    /// Largest join request read from a joining (not yet authenticated)
    /// edge; a larger one is refused unread, the edge told why. At least what
    /// the largest real request takes (a 253-character node name and its CSR).
    #[arg(long, env = "TETHER_JOIN_MAX_MESSAGE_BYTES", default_value = "64KiB", value_parser = parse_bytes_u32)]
    pub join_max_message_bytes: u32,
    /// How long a join waits for another process (`tether-certs`) holding
    /// the join-token store's lock before it fails.
    #[arg(long, env = "TETHER_JOIN_STORE_LOCK_WAIT", default_value = "5s", value_parser = parse_duration)]
    pub join_store_lock_wait: Duration,
    /// Lifetime of certificates issued to joining edges.
    #[arg(long, env = "TETHER_JOIN_CERT_VALIDITY", default_value = "720h", value_parser = parse_duration)]
    pub join_cert_validity: Duration,
    /// Least time between two certificate renewals of one node; a repeated
    /// request for the same key within it gets the certificate already issued.
    #[arg(long, env = "TETHER_RENEWAL_MIN_INTERVAL", default_value = "10m", value_parser = parse_duration)]
    pub renewal_min_interval: Duration,
    /// Concurrent edge connections (handshaking or established; an Initial
    /// waiting for a handshake slot is not counted yet).
    #[arg(long, env = "TETHER_MAX_EDGES", default_value_t = 20000)]
    pub max_edges: usize,
    /// Addresses one edge may announce in its hello (the names the
    /// apiserver may know its node by); a hello with more is refused
    /// (`BadHello`, naming this flag). Edges announce at most their own
    /// `--max-announced-addresses` (64 by default).
    #[arg(long, env = "TETHER_MAX_ANNOUNCED_ADDRESSES", default_value_t = 64)]
    pub max_announced_addresses: usize,
    /// Pods remembered for nodes that went away (so that a request for one is "its
    /// node is not connected", 502, rather than "unknown pod", 404). Beyond this, the
    /// nodes that left first are forgotten first.
    #[arg(long, env = "TETHER_MAX_DEPARTED_PODS", default_value_t = crate::registry::DEFAULT_MAX_DEPARTED_PODS)]
    pub max_departed_pods: usize,
    /// Least time between two warnings about one node's pod claims the
    /// apiserver contradicts (an edge reporting another node's pods), and
    /// apart from them between two about its refused addresses (a hello
    /// announcing another node's address): the claims in between are counted
    /// (`tether_cloud_claims_refused_total`) and summed up in the next
    /// warning. `0s`: every new pod claim, and every hello with a refused
    /// address, is logged.
    #[arg(long, env = "TETHER_CLAIM_WARNING_INTERVAL", default_value = "1m", value_parser = parse_duration)]
    pub claim_warning_interval: Duration,
    /// Pod reports one edge connection may send per second on average; an
    /// edge reports on change, at most once per its `--pods-refresh`. Past
    /// it (and `--pod-report-burst`) the connection is closed.
    #[arg(long, env = "TETHER_POD_REPORTS_PER_SEC", default_value_t = 10)]
    pub pod_reports_per_sec: u32,
    /// Pod reports one edge connection may send at once, beyond
    /// `--pod-reports-per-sec`.
    #[arg(long, env = "TETHER_POD_REPORT_BURST", default_value_t = 20)]
    pub pod_report_burst: u32,
    /// Pods one report may list (1 to 100,000, the protocol's bound); a
    /// report with more keeps its first this many (edges sort them by
    /// namespace and name), logged once per connection naming the node.
    #[arg(long, env = "TETHER_MAX_PODS_PER_REPORT", default_value_t = DEFAULT_MAX_PODS_PER_REPORT)]
    pub max_pods_per_report: usize,
    /// Threads of the async runtime (1 to 1024). Unset: one per CPU the process
    /// may use (its cgroup's CPU quota counts). An edge's packets, its streams and
    /// the apiserver's connections are handed between these threads, so a replica
    /// moving bulk data through few edges spends less CPU per byte with fewer;
    /// more serve more edges and handshakes at once (README, "Configuration").
    #[arg(long, env = "TETHER_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// Edge QUIC/TLS handshakes in progress at once; the Initials of
    /// further edges wait for a slot (first come, first served, one per
    /// source address and port: a newer attempt of the same edge takes its
    /// older one's place) until the newest has waited half
    /// --handshake-timeout, then are dropped (their QUIC retransmits them
    /// later). Keeps a reconnect storm (every edge after a cloud restart) from
    /// spending the CPU on handshakes the edges abandon after their timeout,
    /// or on several attempts of one edge.
    #[arg(long, env = "TETHER_MAX_PENDING_HANDSHAKES", default_value_t = 512)]
    pub max_pending_handshakes: usize,
    /// Sources (address and port) whose Initial may wait for a handshake
    /// slot at once; beyond it, Initials are dropped (their QUIC retransmits
    /// them later). Waiting Initials do not count against --max-edges.
    #[arg(long, env = "TETHER_MAX_WAITING_HANDSHAKES", default_value_t = 20000)]
    pub max_waiting_handshakes: usize,
    /// Edge handshakes one source IP may start per second (and at once).
    /// Its further Initials are dropped; its QUIC retransmits them later.
    /// Once a quarter of the handshake slots are in use, edges must also
    /// prove their address with a QUIC Retry first.
    #[arg(long, env = "TETHER_HANDSHAKES_PER_SOURCE", default_value_t = 20)]
    pub handshakes_per_source: u32,
    /// Source IPs whose --handshakes-per-source budget is remembered; past
    /// it, idle sources are forgotten, then all (a forgotten source starts
    /// with a full budget).
    #[arg(long, env = "TETHER_HANDSHAKE_RATE_SOURCES", default_value_t = crate::gate::DEFAULT_MAX_SOURCES)]
    pub handshake_rate_sources: usize,
    /// UDP address of the peer listener other replicas dial (QUIC, mutual
    /// TLS with peer certificates only). Unset: this replica runs alone.
    #[arg(long, env = "TETHER_PEER_LISTEN", requires_all = ["peer_cert", "peer_key", "peer_ca"])]
    pub peer_listen: Option<SocketAddr>,
    /// Peer certificate (PEM) this replica presents to its peers
    /// (`tether-certs issue peer`; all replicas may share one).
    #[arg(long, env = "TETHER_PEER_CERT")]
    pub peer_cert: Option<PathBuf>,
    /// Private key (PEM) of the peer certificate.
    #[arg(long, env = "TETHER_PEER_KEY")]
    pub peer_key: Option<PathBuf>,
    /// CA (PEM) that signs peer certificates; keep it apart from the edge CA.
    #[arg(long, env = "TETHER_PEER_CA")]
    pub peer_ca: Option<PathBuf>,
    /// Static peers, `HOST:PORT` of their peer listeners (comma-separated or
    /// repeated); this replica's own address may be listed and is skipped.
    #[arg(long, env = "TETHER_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// A DNS name whose every A/AAAA record is a replica (a headless
    /// Service), `NAME:PORT`; re-resolved every `--peer-resolve-interval`.
    #[arg(long, env = "TETHER_PEER_DNS")]
    pub peer_dns: Option<String>,
    /// How often the peer list is re-resolved and missing links re-dialled.
    #[arg(long, env = "TETHER_PEER_RESOLVE_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    pub peer_resolve_interval: Duration,
    /// Bound on every wait on a peer: resolving, dialling, its hello; a peer
    /// link silent for this long is down.
    #[arg(long, env = "TETHER_PEER_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub peer_timeout: Duration,
    /// Largest route update a peer may send (and this replica sends); a
    /// larger one ends that peer's subscription (logged).
    #[arg(long, env = "TETHER_PEER_MAX_MESSAGE_BYTES", default_value = "1MiB", value_parser = parse_bytes_u32)]
    pub peer_max_message_bytes: u32,
    /// Concurrent streams a peer may open on its link to this replica: one per
    /// request relayed to an edge held here (a `logs -f` or `exec` holds its
    /// stream for as long as it runs), plus the route subscription. The
    /// default matches `--max-apiserver-connections`, so the link does not
    /// bind before the peer's own limit; quinn keeps an entry per allowed
    /// stream (4096: ~0.3 MiB per peer link) and hands freed ones back in
    /// batches of an eighth. A relay past it waits `--peer-timeout`, then
    /// fails with a 502 that names this flag.
    #[arg(long, env = "TETHER_PEER_MAX_STREAMS", default_value_t = 4096)]
    pub peer_max_streams: u32,
    /// Sends of the hello that asks a dialled peer for relayed copies of
    /// interactive writes, the first included; a peer that answers none gets no copies.
    #[arg(long, env = "TETHER_PEER_COPY_HELLO_TRIES", default_value_t = 5)]
    pub peer_copy_hello_tries: u32,
    /// Wait before the first resend of an unanswered relayed-copy hello; doubled after each.
    #[arg(long, env = "TETHER_PEER_COPY_HELLO_RESEND", default_value = "1s", value_parser = parse_duration)]
    pub peer_copy_hello_resend: Duration,
    /// With peers: how long a request for an edge that is known but
    /// connected to no replica (moving between replicas) waits for it before
    /// the 502; also bounds re-routing after a stale route.
    #[arg(long, env = "TETHER_ROUTE_WAIT", default_value = "10s", value_parser = parse_duration)]
    pub route_wait: Duration,
    /// This replica's name as its peers and `/status` show it (in
    /// Kubernetes, the pod name). Default: the host name.
    #[arg(long, env = "TETHER_REPLICA_NAME")]
    pub replica_name: Option<String>,
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
    /// `--join-request-timeout`, `--join-answer-timeout`, `--join-linger`.
    pub waits: crate::join::JoinWaits,
    /// Largest join request read (`--join-max-message-bytes`).
    pub max_message_bytes: usize,
    /// How long a change of the store waits for another process's lock
    /// (`--join-store-lock-wait`).
    pub store_lock_wait: Duration,
    pub validity: Duration,
    /// Least time between two renewals of one node's certificate.
    pub renewal_min_interval: Duration,
}

impl JoinConfig {
    /// Why these settings would let edges' certificates lapse, if they
    /// would: a certificate issued for `validity` is due for renewal again
    /// before `renewal_min_interval` has passed, so the cloud refuses that
    /// renewal (another key within the interval) and the edge retries only
    /// once the interval has passed, maybe after the certificate expired. (A
    /// certificate presented with a shorter life is renewed for that life;
    /// the cloud logs each refusal.)
    /// The edge's own warning, per connection, is the tunnel's: a
    /// certificate presented with a shorter life than this (see
    /// [`renewal_shortfall`]).
    pub fn renewal_warning(&self) -> Option<String> {
        let short = renewal_shortfall(self.validity, self.renewal_min_interval)?;
        Some(format!(
            "--join-cert-validity {:?}: a certificate is due for renewal {:?} after it is issued, \
             within --renewal-min-interval ({:?}), so its renewal is refused and it may expire; \
             give at least {}s of validity or a shorter --renewal-min-interval",
            self.validity,
            short.due,
            self.renewal_min_interval,
            short.least.as_secs()
        ))
    }
}

/// How a certificate validity falls short of `--renewal-min-interval`
/// ([`renewal_shortfall`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenewalShortfall {
    /// How long after it is issued a certificate of that validity is due
    /// for renewal (less than the interval).
    pub due: Duration,
    /// The least validity, in whole seconds, whose certificate is due no
    /// sooner than the interval.
    pub least: Duration,
}

/// Whether a certificate issued for `validity` (as the cloud renews:
/// back-dated, due at two thirds of its life,
/// [`tether_certs::rotation::due_after_issue`]) is due for renewal again
/// within `min_interval` of being issued. Its next renewal would then be
/// refused (another key within the interval) and the edge would ask again
/// only once the interval has passed, maybe after the certificate expired.
/// One piece of arithmetic for both warnings: `--join-cert-validity` at
/// start-up ([`JoinConfig::renewal_warning`]) and a shorter-lived
/// certificate an edge presents (the tunnel's, once per connection).
pub fn renewal_shortfall(validity: Duration, min_interval: Duration) -> Option<RenewalShortfall> {
    let due = tether_certs::rotation::due_after_issue(validity);
    if due >= min_interval {
        return None;
    }
    // validity >= 3/2 (interval + backdate) - backdate, rounded up to the
    // second; in nanoseconds, where no `Duration` overflows.
    let back = tether_certs::mint::NOT_BEFORE_BACKDATE.as_nanos();
    let need = ((min_interval.as_nanos() + back) * 3).div_ceil(2) - back;
    let least = u64::try_from(need.div_ceil(1_000_000_000)).unwrap_or(u64::MAX);
    Some(RenewalShortfall {
        due,
        least: Duration::from_secs(least),
    })
}

/// How this replica finds and talks to the others.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// `HOST:PORT` strings, resolved on every round.
    pub static_peers: Vec<String>,
    /// `NAME:PORT` of the headless Service.
    pub dns: Option<String>,
    pub resolve_interval: Duration,
    pub timeout: Duration,
    pub replica_name: String,
    /// Largest route update on the peer link.
    pub max_message_bytes: usize,
    /// Concurrent streams a peer may open on its link here (`--peer-max-streams`).
    pub max_streams: u32,
    /// Bounds of the relayed copies this replica sends on its peer links
    /// (`--interactive-copy-bytes`, `--interactive-copies-per-sec`) and of
    /// its hellos asking for them (`--peer-copy-hello-tries`, `--peer-copy-hello-resend`).
    pub copies: tether_proto::copies::CopySettings,
    /// QUIC datagrams buffered per peer link each way (`--datagram-buffer`).
    pub datagram_buffer: usize,
}

/// Bounds on one edge connection's pod reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodReportLimits {
    /// `--pod-reports-per-sec`.
    pub per_sec: u32,
    /// `--pod-report-burst`.
    pub burst: u32,
    /// `--max-pods-per-report`.
    pub max_pods: usize,
}

/// Webhook authentication and authorisation of callers other than the apiserver.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Bearer tokens are checked with a TokenReview.
    pub tokens: bool,
    /// Requests without credentials are reviewed as `system:anonymous`.
    pub anonymous: bool,
    /// `None`: in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    pub reviews: crate::authz::ReviewSettings,
}

/// Where the pods and addresses routing trusts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthoritySource {
    /// The apiserver, through this kubeconfig (`None`: in-cluster).
    Apiserver {
        kubeconfig: Option<PathBuf>,
        sync_timeout: Duration,
        /// Longest silence on an apiserver connection (`--apiserver-read-timeout`).
        read_timeout: Duration,
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
    /// Client-certificate identities the front serves (never empty).
    pub apiserver_allowed_identities: Vec<AllowedIdentity>,
    /// Kubelet-style webhook authentication/authorisation, when enabled.
    pub webhook: Option<WebhookConfig>,
    /// Where routing's truth comes from.
    pub authority: AuthoritySource,
    pub response_timeout: Duration,
    /// With peers: how long a request waits for an edge between replicas.
    pub route_wait: Duration,
    pub grace: Duration,
    pub handshake_timeout: Duration,
    /// Bound on each control-stream write to an attached edge.
    pub control_write_timeout: Duration,
    /// When the migration sweep runs (`--migration-sweep-interval`,
    /// `--migration-sweep-min-gap`).
    pub migration_sweeps: crate::migration::Schedule,
    pub http_header_timeout: Duration,
    pub max_http_header_bytes: usize,
    pub max_apiserver_connections: usize,
    /// HTTP/2 streams one apiserver connection may have open at once.
    pub max_apiserver_streams_per_connection: u32,
    /// HTTP/2 PING interval and timeout, TCP keep-alive idle time and interval.
    pub apiserver_keep_alive: Duration,
    /// TCP keep-alive probes before an apiserver connection is dropped.
    pub apiserver_keep_alive_probes: u32,
    pub max_edges: usize,
    /// Addresses a hello may announce (`--max-announced-addresses`).
    pub max_announced_addresses: usize,
    pub max_departed_pods: usize,
    /// How often and how large an edge's pod reports may be.
    pub pod_reports: PodReportLimits,
    /// Least time between two warnings about one node's refused pod claims.
    pub claim_warning_interval: Duration,
    /// `None`: one per available CPU.
    pub worker_threads: Option<usize>,
    pub max_pending_handshakes: usize,
    pub max_waiting_handshakes: usize,
    pub handshakes_per_source: u32,
    /// Sources the Initial rate gate remembers (`--handshake-rate-sources`).
    pub handshake_rate_sources: usize,
    pub metrics_listen: SocketAddr,
    pub shutdown_grace: Duration,
    pub drain_spread: Duration,
    pub shutdown_delay: Duration,
    pub shutdown_close_wait: Duration,
    /// The shared stateless-reset key's file, when set.
    pub reset_key_file: Option<PathBuf>,
    /// Lifetime of the edge listener's TLS session tickets; zero: none.
    pub tls_ticket_lifetime: Duration,
    /// Tickets sent at each handshake.
    pub tls_tickets_per_handshake: usize,
    pub reset_interval: Duration,
    /// Join settings, when joins are enabled.
    pub join: Option<JoinConfig>,
    /// Peer settings, when this replica has peers.
    pub peer: Option<PeerConfig>,
    pub limits: Limits,
    pub quic: QuicSettings,
}

impl CloudConfig {
    /// Why, with peers and routing by edge reports, an edge's route record
    /// with a full pod report (a frame of `--max-frame-bytes`) might not fit
    /// in `--peer-max-message-bytes`, if it might: such an edge is published
    /// without its pods and the other replicas answer 404 for them. With an
    /// apiserver no warning is due: replicas route pods by the apiserver,
    /// never by the pods in route records.
    pub fn route_record_warning(&self) -> Option<String> {
        let peer = self.peer.as_ref()?;
        if self.authority != AuthoritySource::EdgeReports {
            return None;
        }
        let pods = crate::routes::largest_pods_len(
            self.limits.max_frame_bytes as usize,
            self.pod_reports.max_pods,
        );
        let full = crate::routes::largest_record_message(self.max_announced_addresses, pods);
        (peer.max_message_bytes < full).then(|| {
            format!(
                "--peer-max-message-bytes {}: an edge's route record with a full pod report \
                 (--max-frame-bytes {}) takes up to {full} bytes; such an edge is published to \
                 the other replicas without its pods (a warning names it), and routing by edge \
                 reports (--insecure-trust-edge-reports) they answer 404 for them. Give at least \
                 {full} to publish every report whole",
                peer.max_message_bytes, self.limits.max_frame_bytes
            )
        })
    }
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
    fn peer_config(
        &self,
        quic: &tether_proto::quic::QuicSettings,
    ) -> Result<Option<PeerConfig>, String> {
        let Some(listen) = self.peer_listen else {
            if !self.peers.is_empty() || self.peer_dns.is_some() {
                return Err("--peers and --peer-dns need --peer-listen".into());
            }
            return Ok(None);
        };
        let (Some(cert), Some(key), Some(ca)) = (
            self.peer_cert.clone(),
            self.peer_key.clone(),
            self.peer_ca.clone(),
        ) else {
            return Err("--peer-listen needs --peer-cert, --peer-key and --peer-ca".into());
        };
        for p in self.peers.iter().chain(self.peer_dns.iter()) {
            match p.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
                _ => return Err(format!("peer {p:?} is not HOST:PORT")),
            }
        }
        if self.peer_timeout.is_zero() || self.peer_resolve_interval.is_zero() {
            return Err("--peer-timeout and --peer-resolve-interval must be positive".into());
        }
        if self.peer_copy_hello_tries == 0 {
            return Err("--peer-copy-hello-tries must be at least 1".into());
        }
        if self.peer_copy_hello_resend.is_zero() {
            return Err("--peer-copy-hello-resend must be more than 0".into());
        }
        if self.peer_max_message_bytes < 4096 {
            return Err("--peer-max-message-bytes must be at least 4KiB".into());
        }
        // Every edge this replica holds must fit in one route message, its
        // pods left out if need be (see `routes`).
        let least = crate::routes::largest_record_message(self.max_announced_addresses, 1);
        if (self.peer_max_message_bytes as usize) < least {
            return Err(format!(
                "--peer-max-message-bytes {} cannot carry one edge's route record: with \
                 --max-announced-addresses {} a record takes up to {least} bytes without its \
                 pods; give at least {least}",
                self.peer_max_message_bytes, self.max_announced_addresses
            ));
        }
        if !(MIN_PEER_STREAMS..=MAX_PEER_STREAMS).contains(&self.peer_max_streams) {
            return Err(format!(
                "--peer-max-streams must be {MIN_PEER_STREAMS}..={MAX_PEER_STREAMS}"
            ));
        }
        let replica_name = match &self.replica_name {
            Some(n) if !n.is_empty() => n.clone(),
            _ => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "tether-cloud".into()),
        };
        Ok(Some(PeerConfig {
            listen,
            cert,
            key,
            ca,
            static_peers: self.peers.clone(),
            dns: self.peer_dns.clone(),
            resolve_interval: self.peer_resolve_interval,
            timeout: self.peer_timeout,
            replica_name,
            max_message_bytes: self.peer_max_message_bytes as usize,
            max_streams: self.peer_max_streams,
            copies: tether_proto::copies::CopySettings {
                hello_tries: self.peer_copy_hello_tries,
                hello_resend: self.peer_copy_hello_resend,
                ..quic.copies
            },
            datagram_buffer: quic.datagram_buffer,
        }))
    }

    /// Checks the flags and builds the configuration.
    pub fn into_config(self) -> Result<CloudConfig, String> {
        let limits = self.limits.limits()?;
        let quic = self
            .quic
            .settings(&limits, tether_proto::cli::Role::Cloud)?;
        if self.handshakes_per_source == 0 {
            return Err("--handshakes-per-source must be at least 1".into());
        }
        if self
            .worker_threads
            .is_some_and(|n| !(1..=MAX_WORKER_THREADS).contains(&n))
        {
            return Err(format!(
                "--worker-threads must be 1 to {MAX_WORKER_THREADS}"
            ));
        }
        // A zero limit or timeout would refuse everything or spin: refuse it.
        for (flag, n) in [
            ("--max-edges", self.max_edges),
            ("--max-announced-addresses", self.max_announced_addresses),
            ("--max-departed-pods", self.max_departed_pods),
            ("--pod-reports-per-sec", self.pod_reports_per_sec as usize),
            ("--pod-report-burst", self.pod_report_burst as usize),
            ("--max-pods-per-report", self.max_pods_per_report),
            ("--review-cache-entries", self.review_cache_entries),
            ("--max-pending-handshakes", self.max_pending_handshakes),
            ("--max-waiting-handshakes", self.max_waiting_handshakes),
            ("--handshake-rate-sources", self.handshake_rate_sources),
            (
                "--max-apiserver-connections",
                self.max_apiserver_connections,
            ),
            (
                "--max-apiserver-streams-per-connection",
                self.max_apiserver_streams_per_connection as usize,
            ),
        ] {
            if n == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        for (flag, d) in [
            ("--response-timeout", self.response_timeout),
            ("--handshake-timeout", self.handshake_timeout),
            ("--control-write-timeout", self.control_write_timeout),
            ("--migration-sweep-interval", self.migration_sweep_interval),
            ("--migration-sweep-min-gap", self.migration_sweep_min_gap),
            ("--http-header-timeout", self.http_header_timeout),
            ("--apiserver-keep-alive", self.apiserver_keep_alive),
            ("--join-cert-validity", self.join_cert_validity),
            ("--renewal-min-interval", self.renewal_min_interval),
            ("--join-request-timeout", self.join_request_timeout),
            ("--join-answer-timeout", self.join_answer_timeout),
            ("--join-linger", self.join_linger),
            ("--join-store-lock-wait", self.join_store_lock_wait),
        ] {
            if d.is_zero() {
                return Err(format!("{flag} must be more than 0"));
            }
        }
        let least = tether_certs::join::LEAST_REQUEST_BYTES;
        if (self.join_max_message_bytes as usize) < least {
            return Err(format!(
                "--join-max-message-bytes {} is below the {least} bytes of the largest request \
                 a tether-edge sends (a 253-character node name and its CSR); give at least {least}",
                self.join_max_message_bytes
            ));
        }
        if !(1..=MAX_KEEP_ALIVE_PROBES).contains(&self.apiserver_keep_alive_probes) {
            return Err(format!(
                "--apiserver-keep-alive-probes must be 1 to {MAX_KEEP_ALIVE_PROBES}"
            ));
        }
        if self.max_pods_per_report > tether_proto::limits::MAX_POD_REPORT {
            return Err(format!(
                "--max-pods-per-report must be at most {} (the protocol's bound)",
                tether_proto::limits::MAX_POD_REPORT
            ));
        }
        if self.max_http_header_bytes < 8192 {
            return Err("--max-http-header-bytes must be at least 8KiB".into());
        }
        if self.shutdown_close_wait > MAX_SHUTDOWN_CLOSE_WAIT {
            return Err(format!(
                "--shutdown-close-wait must be at most {}s",
                MAX_SHUTDOWN_CLOSE_WAIT.as_secs()
            ));
        }
        if self.tls_ticket_lifetime > crate::session_tickets::MAX_LIFETIME {
            return Err(
                "--tls-ticket-lifetime must be at most 168h (7 days, TLS 1.3's bound)".into(),
            );
        }
        if !(1..=MAX_TICKETS_PER_HANDSHAKE).contains(&self.tls_tickets_per_handshake) {
            return Err(format!(
                "--tls-tickets-per-handshake must be 1 to {MAX_TICKETS_PER_HANDSHAKE} (the tickets an edge keeps)"
            ));
        }
        let peer = self.peer_config(&quic)?;
        let apiserver_client_ca = if self.insecure_skip_client_auth {
            None
        } else {
            self.apiserver_client_ca
        };
        let apiserver_allowed_identities = self
            .apiserver_allowed_identity
            .iter()
            .map(|s| AllowedIdentity::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        if self.review_timeout.is_zero() {
            return Err("--review-timeout must be more than 0".into());
        }
        let webhook = self.authorization_webhook.then(|| WebhookConfig {
            tokens: self.authentication_token_webhook,
            anonymous: self.anonymous_auth,
            kubeconfig: self
                .review_kubeconfig
                .clone()
                .or_else(|| self.apiserver_kubeconfig.clone()),
            reviews: crate::authz::ReviewSettings {
                authn_ttl: self.authentication_cache_ttl,
                allowed_ttl: self.authorization_cache_ttl,
                denied_ttl: self.authorization_denied_cache_ttl,
                timeout: self.review_timeout,
                cache_entries: self.review_cache_entries,
            },
        });
        if webhook.is_some() && self.insecure_skip_client_auth {
            return Err(
                "--authorization-webhook and --insecure-skip-client-auth exclude each other".into(),
            );
        }
        if apiserver_allowed_identities.is_empty() {
            return Err("--apiserver-allowed-identity: at least one CN=<user> or O=<group>".into());
        }
        Ok(CloudConfig {
            tunnel_listen: self.tunnel_listen,
            tunnel_cert: self.tunnel_cert,
            tunnel_key: self.tunnel_key,
            edge_ca: self.edge_ca,
            kubelet_listen: self.kubelet_listen,
            kubelet_cert: self.kubelet_cert,
            kubelet_key: self.kubelet_key,
            apiserver_client_ca,
            apiserver_allowed_identities,
            webhook,
            authority: if self.insecure_trust_edge_reports {
                AuthoritySource::EdgeReports
            } else {
                if self.apiserver_sync_timeout.is_zero() {
                    return Err("--apiserver-sync-timeout must be more than 0".into());
                }
                if self.apiserver_read_timeout.is_zero()
                    || self.apiserver_read_timeout > MAX_APISERVER_READ_TIMEOUT
                {
                    return Err(
                        "--apiserver-read-timeout must be more than 0 and at most 24h".into(),
                    );
                }
                AuthoritySource::Apiserver {
                    kubeconfig: self.apiserver_kubeconfig,
                    sync_timeout: self.apiserver_sync_timeout,
                    read_timeout: self.apiserver_read_timeout,
                }
            },
            response_timeout: self.response_timeout,
            route_wait: self.route_wait,
            grace: self.grace,
            handshake_timeout: self.handshake_timeout,
            control_write_timeout: self.control_write_timeout,
            migration_sweeps: crate::migration::Schedule {
                interval: self.migration_sweep_interval,
                min_gap: self.migration_sweep_min_gap,
            },
            http_header_timeout: self.http_header_timeout,
            max_http_header_bytes: self.max_http_header_bytes as usize,
            max_apiserver_connections: self.max_apiserver_connections,
            max_apiserver_streams_per_connection: self.max_apiserver_streams_per_connection,
            apiserver_keep_alive: self.apiserver_keep_alive,
            apiserver_keep_alive_probes: self.apiserver_keep_alive_probes,
            max_edges: self.max_edges,
            max_announced_addresses: self.max_announced_addresses,
            max_departed_pods: self.max_departed_pods,
            claim_warning_interval: self.claim_warning_interval,
            pod_reports: PodReportLimits {
                per_sec: self.pod_reports_per_sec,
                burst: self.pod_report_burst,
                max_pods: self.max_pods_per_report,
            },
            worker_threads: self.worker_threads,
            max_pending_handshakes: self.max_pending_handshakes,
            max_waiting_handshakes: self.max_waiting_handshakes,
            handshakes_per_source: self.handshakes_per_source,
            handshake_rate_sources: self.handshake_rate_sources,
            metrics_listen: self.metrics_listen,
            shutdown_grace: self.shutdown_grace,
            drain_spread: self.drain_spread,
            shutdown_delay: self.shutdown_delay,
            shutdown_close_wait: self.shutdown_close_wait,
            reset_key_file: self.reset_key_file,
            tls_ticket_lifetime: self.tls_ticket_lifetime,
            tls_tickets_per_handshake: self.tls_tickets_per_handshake,
            reset_interval: self.reset_interval,
            join: match (self.join_store, self.join_ca_cert, self.join_ca_key) {
                (Some(store), Some(ca_cert), Some(ca_key)) => Some(JoinConfig {
                    store,
                    ca_cert,
                    ca_key,
                    waits: crate::join::JoinWaits {
                        request: self.join_request_timeout,
                        answer: self.join_answer_timeout,
                        linger: self.join_linger,
                    },
                    max_message_bytes: self.join_max_message_bytes as usize,
                    store_lock_wait: self.join_store_lock_wait,
                    validity: self.join_cert_validity,
                    renewal_min_interval: self.renewal_min_interval,
                }),
                (None, _, _) => None,
                _ => return Err("--join-store needs --join-ca-cert and --join-ca-key".into()),
            },
            peer,
            limits,
            quic,
        })
    }
}

/// A configuration for unit tests: the required file flags (never read
/// here) and `--insecure-skip-client-auth`, then `extra`.
#[cfg(test)]
pub(crate) fn test_config(extra: &[&str]) -> Result<CloudConfig, String> {
    test_config_with_auth(&["--insecure-skip-client-auth"], extra)
}

/// [`test_config`] with `auth` instead of `--insecure-skip-client-auth`.
#[cfg(test)]
pub(crate) fn test_config_with_auth(auth: &[&str], extra: &[&str]) -> Result<CloudConfig, String> {
    let mut args = vec![
        "tether-cloud",
        "--tunnel-cert=t.crt",
        "--tunnel-key=t.key",
        "--edge-ca=e.crt",
        "--kubelet-cert=k.crt",
        "--kubelet-key=k.key",
    ];
    args.extend_from_slice(auth);
    args.extend_from_slice(extra);
    CloudArgs::try_parse_from(args)
        .map_err(|e| e.to_string())?
        .into_config()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_spread_and_reset_key_file() {
        let c = test_config(&[]).unwrap();
        assert_eq!(c.drain_spread, Duration::from_secs(10));
        assert_eq!(c.reset_key_file, None);
        assert_eq!(c.reset_interval, Duration::from_millis(1));
        let c = test_config(&["--drain-spread", "0s", "--reset-key-file", "/s/reset.key"]).unwrap();
        assert_eq!(c.drain_spread, Duration::ZERO);
        assert_eq!(c.reset_key_file, Some(PathBuf::from("/s/reset.key")));
    }

    #[test]
    fn tls_ticket_lifetime_is_bounded() {
        let c = test_config(&[]).unwrap();
        assert_eq!(c.tls_ticket_lifetime, crate::session_tickets::MAX_LIFETIME);
        let c = test_config(&["--tls-ticket-lifetime", "0s"]).unwrap();
        assert_eq!(c.tls_ticket_lifetime, Duration::ZERO);
        let c = test_config(&["--tls-ticket-lifetime", "12h"]).unwrap();
        assert_eq!(c.tls_ticket_lifetime, Duration::from_secs(12 * 3600));
        let err = test_config(&["--tls-ticket-lifetime", "169h"]).unwrap_err();
        assert!(err.contains("at most 168h"), "{err}");
        assert_eq!(c.tls_tickets_per_handshake, 1);
        for n in ["1", "8"] {
            let c = test_config(&["--tls-tickets-per-handshake", n]).unwrap();
            assert_eq!(c.tls_tickets_per_handshake.to_string(), n);
        }
        for n in ["0", "9"] {
            let err = test_config(&["--tls-tickets-per-handshake", n]).unwrap_err();
            assert!(err.contains("must be 1 to 8"), "{err}");
        }
    }

    #[test]
    fn shutdown_close_wait_is_bounded() {
        let c = test_config(&[]).unwrap();
        assert_eq!(c.shutdown_close_wait, Duration::from_secs(2));
        let c = test_config(&["--shutdown-close-wait", "0s"]).unwrap();
        assert_eq!(c.shutdown_close_wait, Duration::ZERO);
        let c = test_config(&["--shutdown-close-wait", "60s"]).unwrap();
        assert_eq!(c.shutdown_close_wait, MAX_SHUTDOWN_CLOSE_WAIT);
        let err = test_config(&["--shutdown-close-wait", "61s"]).unwrap_err();
        assert!(
            err.contains("--shutdown-close-wait must be at most 60s"),
            "{err}"
        );
    }

    #[test]
    fn zero_limits_and_timeouts_are_refused() {
        assert!(test_config(&[]).is_ok());
        for (flag, zero) in [
            ("--max-edges", "0"),
            ("--max-announced-addresses", "0"),
            ("--max-departed-pods", "0"),
            ("--pod-reports-per-sec", "0"),
            ("--pod-report-burst", "0"),
            ("--max-pods-per-report", "0"),
            ("--max-pending-handshakes", "0"),
            ("--max-apiserver-connections", "0"),
            ("--max-apiserver-streams-per-connection", "0"),
            ("--handshakes-per-source", "0"),
            ("--response-timeout", "0s"),
            ("--handshake-timeout", "0s"),
            ("--control-write-timeout", "0s"),
            ("--http-header-timeout", "0s"),
            ("--apiserver-keep-alive", "0s"),
            ("--join-cert-validity", "0s"),
            ("--renewal-min-interval", "0s"),
            ("--worker-threads", "0"),
            ("--review-cache-entries", "0"),
            ("--handshake-rate-sources", "0"),
            ("--apiserver-read-timeout", "0s"),
            ("--join-request-timeout", "0s"),
            ("--join-answer-timeout", "0s"),
            ("--join-linger", "0s"),
            ("--migration-sweep-interval", "0s"),
            ("--migration-sweep-min-gap", "0s"),
        ] {
            let e = test_config(&[flag, zero]).expect_err(flag);
            assert!(e.contains(flag), "{flag}: {e}");
        }
    }

    #[test]
    fn the_migration_sweep_schedule_has_its_defaults_and_takes_its_flags() {
        let c = test_config(&[]).unwrap();
        assert_eq!(
            c.migration_sweeps,
            crate::migration::Schedule {
                interval: Duration::from_secs(5),
                min_gap: Duration::from_millis(200),
            }
        );
        let c = test_config(&[
            "--migration-sweep-interval=30s",
            "--migration-sweep-min-gap=1s",
        ])
        .unwrap();
        assert_eq!(
            c.migration_sweeps,
            crate::migration::Schedule {
                interval: Duration::from_secs(30),
                min_gap: Duration::from_secs(1),
            }
        );
    }

    #[test]
    fn bounds_on_edges_and_apiserver_connections_have_their_defaults() {
        let c = test_config(&[]).unwrap();
        assert_eq!(c.control_write_timeout, Duration::from_secs(30));
        assert_eq!(c.max_announced_addresses, 64);
        // hyper's own default, made explicit.
        assert_eq!(c.max_apiserver_streams_per_connection, 200);
        assert_eq!(c.apiserver_keep_alive_probes, 3);
        for bad in ["0", "128"] {
            let e = test_config(&["--apiserver-keep-alive-probes", bad]).unwrap_err();
            assert!(
                e.contains("--apiserver-keep-alive-probes must be 1 to 127"),
                "{e}"
            );
        }
        let c = test_config(&[
            "--control-write-timeout",
            "2s",
            "--max-announced-addresses",
            "3",
            "--max-apiserver-streams-per-connection",
            "8",
        ])
        .unwrap();
        assert_eq!(c.control_write_timeout, Duration::from_secs(2));
        assert_eq!(c.max_announced_addresses, 3);
        assert_eq!(c.max_apiserver_streams_per_connection, 8);
    }

    /// `--renewal-min-interval` (was a fixed 600 s): the default, a value,
    /// nonsense and zero. It reaches the join settings, where the limiter
    /// is made (`tunnel::renewal_tests` checks the limiter with it).
    #[test]
    fn renewal_min_interval_has_its_default_and_nonsense_is_refused() {
        let join = [
            "--join-store=s.json",
            "--join-ca-cert=ca.crt",
            "--join-ca-key=ca.key",
        ];
        let c = test_config(&join).unwrap();
        assert_eq!(
            c.join.unwrap().renewal_min_interval,
            Duration::from_secs(600)
        );
        let mut flags = join.to_vec();
        flags.push("--renewal-min-interval=90s");
        let c = test_config(&flags).unwrap();
        assert_eq!(
            c.join.unwrap().renewal_min_interval,
            Duration::from_secs(90)
        );
        for bad in ["ten minutes", "5 fortnights", "0s"] {
            let e = test_config(&["--renewal-min-interval", bad]).unwrap_err();
            assert!(e.contains("renewal-min-interval"), "{bad}: {e}");
        }
    }

    /// A certificate validity so short that a renewed certificate is due
    /// again within --renewal-min-interval is warned about at start-up,
    /// naming the least validity that is not; the defaults are not.
    #[test]
    fn a_validity_due_again_within_the_renewal_interval_is_warned_about() {
        let join = |extra: &[&str]| {
            let mut flags = vec!["--join-store=s.json", "--join-ca-cert=c", "--join-ca-key=k"];
            flags.extend_from_slice(extra);
            test_config(&flags).unwrap().join.unwrap().renewal_warning()
        };
        assert_eq!(join(&[]), None);
        // Due 2/3 x (1,050 + 300) - 300 = 600 s after issue: just enough.
        assert_eq!(join(&["--join-cert-validity=1050s"]), None);
        let w = join(&["--join-cert-validity=1049s"]).unwrap();
        assert!(
            w.contains("at least 1050s") && w.contains("--renewal-min-interval"),
            "{w}"
        );
        let w = join(&["--join-cert-validity=18s"]).unwrap();
        assert!(w.contains("due for renewal 0ns after"), "{w}");
        assert_eq!(
            join(&["--join-cert-validity=10m", "--renewal-min-interval=1m"]),
            None
        );
        let w = join(&["--join-cert-validity=10m", "--renewal-min-interval=601s"]).unwrap();
        assert!(w.contains("at least 1052s"), "{w}");
    }

    /// The arithmetic both renewal warnings share: for the start-up one,
    /// `--join-cert-validity` against `--renewal-min-interval` (the
    /// defaults, 1,050 s just enough for 600 s); for the tunnel's, a
    /// presented certificate's own lifetime (1 h due again within a 1 h
    /// interval, 2 h not). The least validity named is exact, to the second.
    #[test]
    fn a_renewal_shortfall_names_when_due_and_the_least_renewable_validity() {
        let s = Duration::from_secs;
        // The start-up warning's cases.
        assert_eq!(renewal_shortfall(s(720 * 3600), s(600)), None);
        assert_eq!(renewal_shortfall(s(1050), s(600)), None);
        let short = renewal_shortfall(s(1049), s(600)).unwrap();
        assert_eq!(short.least, s(1050));
        assert!(short.due < s(600), "{short:?}");
        assert_eq!(renewal_shortfall(s(18), s(600)).unwrap().due, s(0));
        // A presented certificate's: 2/3 x (3,600 + 300) - 300 = 2,300 s.
        assert_eq!(
            renewal_shortfall(s(3600), s(3600)),
            Some(RenewalShortfall {
                due: s(2300),
                least: s(5550)
            })
        );
        assert_eq!(renewal_shortfall(s(7200), s(3600)), None);
        // Exact: the least validity is renewable, a second less is not.
        for interval in [
            s(1),
            s(599),
            s(600),
            s(601),
            s(3600),
            s(86400),
            Duration::from_millis(600_500),
        ] {
            let least = renewal_shortfall(s(1), interval).unwrap().least;
            assert_eq!(renewal_shortfall(least, interval), None, "{interval:?}");
            assert!(
                renewal_shortfall(least - s(1), interval).is_some(),
                "{interval:?}: {least:?}"
            );
        }
        // The largest interval does not overflow.
        let huge = renewal_shortfall(s(1), Duration::MAX).unwrap();
        assert!(huge.least > s(u64::MAX / 2), "{huge:?}");
    }

    /// The limits and waits that were constants have their old values by
    /// default and take others.
    #[test]
    fn former_constants_have_their_defaults_and_take_other_values() {
        // The reviews need a client CA (test_config has none).
        let reviews = |extra: &[&str]| {
            test_config_with_auth(
                &["--apiserver-client-ca=ca.crt", "--authorization-webhook"],
                extra,
            )
            .map(|c| c.webhook.unwrap().reviews.cache_entries)
        };
        assert_eq!(reviews(&[]), Ok(10_000));
        assert_eq!(reviews(&["--review-cache-entries=8"]), Ok(8));
        assert!(reviews(&["--review-cache-entries=0"])
            .unwrap_err()
            .contains("--review-cache-entries"));
        let c = test_config(&[]).unwrap();
        assert_eq!(c.handshake_rate_sources, 65_536);
        let apiserver = |extra: &[&str]| match test_config(extra).map(|c| c.authority) {
            Ok(AuthoritySource::Apiserver { read_timeout, .. }) => Ok(read_timeout),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        assert_eq!(apiserver(&[]), Ok(Duration::from_secs(300)));
        assert_eq!(
            apiserver(&["--apiserver-read-timeout", "10s"]),
            Ok(Duration::from_secs(10))
        );
        assert_eq!(
            apiserver(&["--apiserver-read-timeout", "24h"]),
            Ok(Duration::from_secs(86_400))
        );
        for bad in ["0s", "86401s"] {
            assert!(apiserver(&["--apiserver-read-timeout", bad])
                .unwrap_err()
                .contains("--apiserver-read-timeout must be more than 0 and at most 24h"));
        }
        let join = ["--join-store=s", "--join-ca-cert=c", "--join-ca-key=k"];
        let j = test_config(&join).unwrap().join.unwrap();
        assert_eq!(j.waits, crate::join::JoinWaits::default());
        assert_eq!(
            (j.waits.request, j.waits.answer, j.waits.linger),
            (
                Duration::from_secs(10),
                Duration::from_secs(10),
                Duration::from_secs(5)
            )
        );
        let mut flags = join.to_vec();
        flags.extend([
            "--handshake-rate-sources=16",
            "--join-request-timeout=1s",
            "--join-answer-timeout=2s",
            "--join-linger=3s",
        ]);
        let c = test_config(&flags).unwrap();
        assert_eq!(c.handshake_rate_sources, 16);
        let w = c.join.unwrap().waits;
        assert_eq!(
            (w.request, w.answer, w.linger),
            (
                Duration::from_secs(1),
                Duration::from_secs(2),
                Duration::from_secs(3)
            )
        );
    }

    /// `--join-max-message-bytes` and `--join-store-lock-wait` (were the
    /// fixed 64 KiB and 5 s): their defaults, values reaching the join
    /// settings, and nonsense refused at start — a zero wait, and a bound
    /// below the largest real request (0 included), naming the least value.
    #[test]
    fn join_message_bound_and_store_lock_wait_have_defaults_and_floors() {
        let join = ["--join-store=s", "--join-ca-cert=c", "--join-ca-key=k"];
        let j = test_config(&join).unwrap().join.unwrap();
        assert_eq!(j.max_message_bytes, 64 << 10);
        assert_eq!(j.store_lock_wait, Duration::from_secs(5));
        let least = tether_certs::join::LEAST_REQUEST_BYTES;
        let at_least = format!("--join-max-message-bytes={least}");
        let mut flags = join.to_vec();
        flags.extend([at_least.as_str(), "--join-store-lock-wait=200ms"]);
        let j = test_config(&flags).unwrap().join.unwrap();
        assert_eq!(j.max_message_bytes, least);
        assert_eq!(j.store_lock_wait, Duration::from_millis(200));
        for bad in ["0".to_string(), (least - 1).to_string()] {
            let flag = format!("--join-max-message-bytes={bad}");
            let e = test_config(&[flag.as_str()]).unwrap_err();
            assert!(
                e.contains("--join-max-message-bytes") && e.contains(&format!("at least {least}")),
                "{bad}: {e}"
            );
        }
        let e = test_config(&["--join-store-lock-wait=0s"]).unwrap_err();
        assert!(e.contains("--join-store-lock-wait"), "{e}");
    }

    /// `TETHER_JOIN_STORE_LOCK_WAIT` sets `tether-cloud --join-store-lock-wait`
    /// and `tether-certs --store-lock-wait` (whose parser is
    /// [`tether_certs::token::parse_lock_wait`]): both take the same strings,
    /// as the same wait, and refuse the same (0 included: both need more).
    #[test]
    fn the_store_lock_wait_variable_is_parsed_alike_by_cloud_and_certs() {
        let join = ["--join-store=s", "--join-ca-cert=c", "--join-ca-key=k"];
        let taken = ["250ms", "5s", "2m", "1h", "5", "5 s", "1.5s"];
        let refused = ["0s", "", "-1s", "99999999999h"];
        let mut differ = Vec::new();
        for s in taken.iter().chain(&refused) {
            let flag = format!("--join-store-lock-wait={s}");
            let mut flags = join.to_vec();
            flags.push(flag.as_str());
            let cloud = test_config(&flags).map(|c| c.join.map(|j| j.store_lock_wait));
            let cloud = cloud.ok().flatten();
            let certs = tether_certs::token::parse_lock_wait(s).ok();
            if cloud != certs || cloud.is_some() != taken.contains(s) {
                differ.push(format!("{s:?}: cloud {cloud:?}, certs {certs:?}"));
            }
        }
        assert!(differ.is_empty(), "{differ:#?}");
    }

    #[test]
    fn worker_threads_default_to_the_cpus_and_are_bounded() {
        assert_eq!(test_config(&[]).unwrap().worker_threads, None);
        assert_eq!(
            test_config(&["--worker-threads", "1"])
                .unwrap()
                .worker_threads,
            Some(1)
        );
        assert_eq!(
            test_config(&["--worker-threads", "1024"])
                .unwrap()
                .worker_threads,
            Some(1024)
        );
        let e = test_config(&["--worker-threads", "1025"]).unwrap_err();
        assert!(e.contains("--worker-threads must be 1 to 1024"), "{e}");
    }

    const PEER: &[&str] = &[
        "--peer-listen=127.0.0.1:7000",
        "--peer-cert=p.crt",
        "--peer-key=p.key",
        "--peer-ca=pca.crt",
    ];

    #[test]
    fn peers_are_optional_and_checked() {
        assert!(test_config(&[]).unwrap().peer.is_none());
        let mut flags = PEER.to_vec();
        flags.extend([
            "--peers=10.0.0.1:7000,tether-1.tether-peers:7000",
            "--peer-dns=tether-peers.tether.svc:7000",
            "--replica-name=tether-0",
            "--peer-timeout=2s",
        ]);
        let p = test_config(&flags).unwrap().peer.unwrap();
        assert_eq!(p.static_peers.len(), 2);
        assert_eq!(p.dns.as_deref(), Some("tether-peers.tether.svc:7000"));
        assert_eq!(p.replica_name, "tether-0");
        assert_eq!(p.timeout, Duration::from_secs(2));
        assert_eq!(p.resolve_interval, Duration::from_secs(5));
        assert_eq!(p.copies.hello_tries, 5);
        assert_eq!(p.copies.hello_resend, Duration::from_secs(1));
        let mut flags = PEER.to_vec();
        flags.extend([
            "--peer-copy-hello-tries=2",
            "--peer-copy-hello-resend=100ms",
            "--interactive-copy-bytes=64",
        ]);
        let copies = test_config(&flags).unwrap().peer.unwrap().copies;
        assert_eq!(
            (copies.hello_tries, copies.hello_resend, copies.max_payload),
            (2, Duration::from_millis(100), 64)
        );
        for bad in ["--peer-copy-hello-tries=0", "--peer-copy-hello-resend=0s"] {
            let mut flags = PEER.to_vec();
            flags.push(bad);
            let e = test_config(&flags).unwrap_err();
            assert!(e.contains(bad.split('=').next().unwrap()), "{bad}: {e}");
        }
        // Peers without a peer listener, a listener without its certificate,
        // a peer without a port: refused at start.
        assert!(test_config(&["--peers=10.0.0.1:7000"]).is_err());
        assert!(test_config(&["--peer-listen=127.0.0.1:7000"]).is_err());
        let mut bad = PEER.to_vec();
        bad.push("--peer-dns=tether-peers");
        assert!(test_config(&bad).unwrap_err().contains("HOST:PORT"));
        let mut bad = PEER.to_vec();
        bad.push("--peers=:7000");
        assert!(test_config(&bad).is_err());
    }

    #[test]
    fn peer_stream_limit_defaults_to_the_apiserver_connection_limit_and_is_bounded() {
        let p = test_config(PEER).unwrap().peer.unwrap();
        assert_eq!(p.max_streams, 4096);
        let mut flags = PEER.to_vec();
        flags.push("--peer-max-streams=16");
        assert_eq!(test_config(&flags).unwrap().peer.unwrap().max_streams, 16);
        for bad in ["--peer-max-streams=3", "--peer-max-streams=1048577"] {
            let mut flags = PEER.to_vec();
            flags.push(bad);
            assert!(
                test_config(&flags)
                    .unwrap_err()
                    .contains("--peer-max-streams"),
                "{bad}"
            );
        }
    }

    /// Every edge record must fit in one route message (pods left out if
    /// need be): a `--peer-max-message-bytes` below the widest record
    /// without pods (64 addresses of 253 bytes by default) is refused at
    /// start naming both flags and the least value, which is accepted.
    /// One too small for a full pod report is only warned about, and only
    /// when routing by edge reports (with an apiserver the pods in route
    /// records route nothing).
    #[test]
    fn a_peer_message_bound_too_small_for_one_edge_record_is_refused() {
        let peer = |extra: &[&str]| {
            let mut flags = PEER.to_vec();
            flags.extend_from_slice(extra);
            test_config(&flags)
        };
        let least = crate::routes::largest_record_message(64, 1);
        assert!(least > 4096 && least < 20_000, "{least}");
        let e = peer(&["--peer-max-message-bytes=4KiB"]).unwrap_err();
        assert!(
            e.contains("--peer-max-message-bytes 4096")
                && e.contains("--max-announced-addresses 64")
                && e.contains(&format!("at least {least}")),
            "{e}"
        );
        let at = format!("--peer-max-message-bytes={least}");
        assert!(peer(&[&at]).is_ok());
        let below = format!("--peer-max-message-bytes={}", least - 1);
        assert!(peer(&[&below]).is_err());
        // Fewer addresses, smaller records: 4 KiB will do.
        assert!(peer(&[
            "--peer-max-message-bytes=4KiB",
            "--max-announced-addresses=4"
        ])
        .is_ok());
        // The full-report warning: only routing by edge reports.
        assert_eq!(peer(&[]).unwrap().route_record_warning(), None);
        let w = peer(&["--insecure-trust-edge-reports"])
            .unwrap()
            .route_record_warning()
            .expect("1 MiB frames do not fit in 1 MiB messages with the record around them");
        assert!(
            w.contains("--peer-max-message-bytes 1048576") && w.contains("--max-frame-bytes"),
            "{w}"
        );
        assert_eq!(
            peer(&[
                "--insecure-trust-edge-reports",
                "--peer-max-message-bytes=2MiB"
            ])
            .unwrap()
            .route_record_warning(),
            None
        );
    }

    /// The pod-report bounds (were fixed at 10/s, burst 20, and the
    /// protocol's 100,000 pods): their defaults, other values, and a pod
    /// bound beyond the protocol's refused.
    #[test]
    fn pod_report_bounds_have_their_defaults_and_take_other_values() {
        assert_eq!(
            test_config(&[]).unwrap().pod_reports,
            PodReportLimits {
                per_sec: 10,
                burst: 20,
                max_pods: 10_000
            }
        );
        let c = test_config(&[
            "--pod-reports-per-sec=2",
            "--pod-report-burst=5",
            "--max-pods-per-report=100000",
        ])
        .unwrap();
        assert_eq!(
            c.pod_reports,
            PodReportLimits {
                per_sec: 2,
                burst: 5,
                max_pods: 100_000
            }
        );
        let e = test_config(&["--max-pods-per-report=100001"]).unwrap_err();
        assert!(
            e.contains("--max-pods-per-report must be at most 100000"),
            "{e}"
        );
    }

    #[test]
    fn claim_warning_interval_has_its_default_and_takes_zero() {
        assert_eq!(
            test_config(&[]).unwrap().claim_warning_interval,
            Duration::from_secs(60)
        );
        assert_eq!(
            test_config(&["--claim-warning-interval=0s"])
                .unwrap()
                .claim_warning_interval,
            Duration::ZERO
        );
        assert!(test_config(&["--claim-warning-interval=soon"])
            .unwrap_err()
            .contains("claim-warning-interval"));
    }
}
