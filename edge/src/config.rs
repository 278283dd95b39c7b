//! The edge's configuration: flags and `TETHER_*` environment variables,
//! parsed once in `main` and passed down as [`EdgeConfig`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tether_proto::cli::{LimitArgs, LogArgs, QuicArgs};
use tether_proto::quic::QuicSettings;
use tether_proto::units::{parse_bytes, parse_bytes_u32, parse_duration};
use tether_proto::Limits;

/// Command-line flags of `tether-edge`.
// Each flag's `///` line is its `--help` text and ships in the edge binary
// (every flag costs it over a kilobyte): keep it to one short line, with the
// details for readers in `//` comments and for operators in the README.
#[derive(Debug, Parser)]
#[command(
    name = "tether-edge",
    version,
    args_override_self = true,
    about = "Tether edge: dials tether-cloud over QUIC and replays the apiserver's kubelet requests against the local kubelet"
)]
pub struct EdgeArgs {
    /// The cloud's tunnel address, HOST:PORT (UDP).
    #[arg(long, env = "TETHER_CLOUD")]
    pub cloud: String,
    /// Name to verify in the cloud's certificate (default: the host part of --cloud).
    #[arg(long, env = "TETHER_SERVER_NAME")]
    pub server_name: Option<String>,
    /// CA (PEM) that signed the cloud's tunnel certificate.
    #[arg(long, env = "TETHER_CA")]
    pub ca: PathBuf,
    /// This edge's certificate (PEM); it names the node.
    #[arg(long, env = "TETHER_CERT")]
    pub cert: PathBuf,
    /// This edge's private key (PEM).
    #[arg(long, env = "TETHER_KEY")]
    pub key: PathBuf,
    /// The one kubelet endpoint streams are replayed against.
    // Edged-style `http://127.0.0.1:10350` or a kubelet's `https://127.0.0.1:10250`.
    #[arg(
        long,
        env = "TETHER_KUBELET_URL",
        default_value = "http://127.0.0.1:10350"
    )]
    pub kubelet_url: String,
    /// CA (PEM) to verify an HTTPS kubelet's serving certificate.
    #[arg(long, env = "TETHER_KUBELET_CA")]
    pub kubelet_ca: Option<PathBuf>,
    /// Do not verify an HTTPS kubelet's certificate.
    // Kubelets often serve a self-signed one: an explicit opt-in.
    #[arg(long, env = "TETHER_KUBELET_INSECURE_SKIP_TLS_VERIFY")]
    pub kubelet_insecure_skip_tls_verify: bool,
    /// Client certificate (PEM) presented to an HTTPS kubelet.
    #[arg(
        long,
        env = "TETHER_KUBELET_CLIENT_CERT",
        requires = "kubelet_client_key"
    )]
    pub kubelet_client_cert: Option<PathBuf>,
    /// Client key (PEM) presented to an HTTPS kubelet.
    #[arg(
        long,
        env = "TETHER_KUBELET_CLIENT_KEY",
        requires = "kubelet_client_cert"
    )]
    pub kubelet_client_key: Option<PathBuf>,
    /// Time allowed to connect to the kubelet.
    #[arg(long, env = "TETHER_KUBELET_CONNECT_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub kubelet_connect_timeout: Duration,
    /// Time allowed for one read of the kubelet's pod list (`GET /pods`).
    #[arg(long, env = "TETHER_KUBELET_PODS_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub kubelet_pods_timeout: Duration,
    /// Largest kubelet pod list read.
    #[arg(long, env = "TETHER_KUBELET_PODS_MAX_BYTES", default_value = "64MiB", value_parser = parse_bytes)]
    pub kubelet_pods_max_bytes: u64,
    /// Time allowed for a new stream's attach and request head.
    // The cloud sends the head right behind the attach. A stream whose attach
    // does not come is dropped, one whose head does not come is reset,
    // freeing its slot.
    #[arg(long, env = "TETHER_REQUEST_HEAD_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub request_head_timeout: Duration,
    /// Ended stream ids kept to refuse late re-attaches.
    #[arg(long, env = "TETHER_ENDED_STREAMS_REMEMBERED", default_value = "4096")]
    pub ended_streams_remembered: usize,
    /// Addresses the apiserver may know this node by (repeatable; default: the host's IPs).
    #[arg(
        long = "announce-address",
        env = "TETHER_ANNOUNCE_ADDRESSES",
        value_delimiter = ','
    )]
    pub announce_addresses: Vec<String>,
    /// Addresses announced at most (1-1024; at most the cloud's own setting).
    // The host's beyond it are left out (IPv4 first), more
    // --announce-address values refused at start-up.
    #[arg(long, env = "TETHER_MAX_ANNOUNCED_ADDRESSES", default_value = "64")]
    pub max_announced_addresses: usize,
    /// How often the kubelet's pod list is read and reported.
    // The kubelet API has no watch, so this bounds how long a new pod may be
    // unknown to the cloud (404 `no connected edge reports pod`): at most
    // this after the kubelet lists it, usually while its containers are still
    // starting. Each read wakes an idle edge (and the kubelet): 20 s keeps an
    // idle edge under 30 wake-ups a minute; lower it where new pods must be
    // reachable sooner.
    #[arg(long, env = "TETHER_PODS_REFRESH", default_value = "20s", value_parser = parse_duration)]
    pub pods_refresh: Duration,
    /// Shortest adaptive keep-alive interval (default: 10s, or --keep-alive if shorter).
    // The edge learns how long the NAT keeps an idle UDP binding and settles
    // just below it, within these bounds; it starts at --keep-alive.
    #[arg(long, env = "TETHER_KEEP_ALIVE_MIN", value_parser = parse_duration)]
    pub keep_alive_min: Option<Duration>,
    /// Longest adaptive keep-alive interval (default: 110s).
    // At least 20s below --idle-timeout and never below --keep-alive-min;
    // equal to --keep-alive-min for a fixed keep-alive.
    #[arg(long, env = "TETHER_KEEP_ALIVE_MAX", value_parser = parse_duration)]
    pub keep_alive_max: Option<Duration>,
    /// Silence after sending that takes the link for dead.
    // Once the edge has sent something (data, a keep-alive) and nothing has
    // come back for this long, the edge reconnects and resumes the session.
    // (QUIC's --idle-timeout must outlast the longest keep-alive interval,
    // so it cannot be this quick.)
    #[arg(long, env = "TETHER_SILENCE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub silence_timeout: Duration,
    /// Threads of the async runtime.
    // One is plenty for an edge's handful of streams and wakes the device
    // least when idle; more help only a busy edge moving bulk data through
    // many streams at once.
    #[arg(long, env = "TETHER_WORKER_THREADS", default_value = "1")]
    pub worker_threads: usize,
    /// First reconnect delay; doubles up to --reconnect-max, with jitter.
    #[arg(long, env = "TETHER_RECONNECT_MIN", default_value = "100ms", value_parser = parse_duration)]
    pub reconnect_min: Duration,
    /// Largest reconnect delay (kept low so the edge is back soon after the link).
    #[arg(long, env = "TETHER_RECONNECT_MAX", default_value = "1s", value_parser = parse_duration)]
    pub reconnect_max: Duration,
    /// After the cloud shut down (a restart reaches every edge at once), wait a
    /// random time up to this before reconnecting, so the fleet's handshakes are
    /// spread out instead of arriving as one storm. `0s` disables it.
    #[arg(long, env = "TETHER_RECONNECT_SPREAD", default_value = "5s", value_parser = parse_duration)]
    pub reconnect_spread: Duration,
    /// Once the cloud has not answered for this long, probe it one attempt
    /// at a time every --reconnect-patient-interval (default: the session's
    /// grace period the cloud's welcome gives, or 300s if that is shorter).
    // Within the grace period every second counts: the cloud holds the
    // session's streams for a resume. After it they are lost, and an edge
    // whose link is up but whose cloud is down (an outage of hours) spent
    // ~70 KB a minute probing at the --reconnect-max pace.
    #[arg(long, env = "TETHER_RECONNECT_PATIENT_AFTER", value_parser = parse_duration)]
    pub reconnect_patient_after: Option<Duration>,
    /// Nominal wait between probes of a cloud that has not answered for
    /// --reconnect-patient-after (each a random part between half and all
    /// of it). `0s` disables it: probe at the --reconnect-max pace for good.
    #[arg(long, env = "TETHER_RECONNECT_PATIENT_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub reconnect_patient_interval: Duration,
    /// On SIGTERM, time allowed for the connection's close to reach the cloud.
    // quinn keeps a closed connection for three probe timeouts, answering
    // the cloud's packets with the close again (RFC 9000 §10.2): the cloud
    // then ends the session at once instead of keeping it for a resume.
    // This bounds that wait (the close may take longer on a slow link).
    #[arg(long, env = "TETHER_SHUTDOWN_DRAIN", default_value = "2s", value_parser = parse_duration)]
    pub shutdown_drain: Duration,
    /// Address of the operations listener (`/metrics`, `/healthz`, `/readyz`).
    #[arg(long, env = "TETHER_METRICS_LISTEN", default_value = "127.0.0.1:9091")]
    pub metrics_listen: std::net::SocketAddr,
    /// Time allowed for one connection attempt (QUIC handshake and welcome).
    // After a round in which every attempt timed out, the next round allows
    // twice as long, up to --handshake-timeout-max, so a link slower than
    // this still gets in (an attempt that has heard nothing from the cloud
    // is replaced after --unanswered-attempt-max all the same).
    #[arg(long, env = "TETHER_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,
    /// Cap of --handshake-timeout's doubling (default: 8x --handshake-timeout).
    #[arg(long, env = "TETHER_HANDSHAKE_TIMEOUT_MAX", value_parser = parse_duration)]
    pub handshake_timeout_max: Option<Duration>,
    /// Longest an attempt that has heard nothing from the cloud waits before
    /// a new one replaces it, whatever the round's handshake limit.
    // QUIC doubles an unanswered Initial's retransmission timer (Initials
    // at 0, 0.9, 2.7, 6.3, 13.5, 27.9 s from a 300 ms initial RTT): an
    // attempt left 40 or 80 s on a dead link sends its last Initials 14 and
    // 29 s apart, and the edge came back up to 28 s after the link.
    // Replaced after 20 s, the round's attempts keep them at most ~6 s
    // apart, for 2.5x the datagrams of a cloud that does not answer; 10 s
    // halves the wait again for 4x. An attempt that heard from the cloud
    // keeps the round's limit.
    #[arg(long, env = "TETHER_UNANSWERED_ATTEMPT_MAX", default_value = "20s", value_parser = parse_duration)]
    pub unanswered_attempt_max: Duration,
    /// Connection attempts at once (1-8).
    #[arg(long, env = "TETHER_MAX_HANDSHAKES_IN_FLIGHT", default_value = "2")]
    pub max_handshakes_in_flight: usize,
    /// Time allowed for the cloud's answer to a certificate renewal.
    // Unanswered, the edge asks again a minute later (with a new key).
    #[arg(long, env = "TETHER_RENEWAL_ANSWER_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub renewal_answer_timeout: Duration,
    /// Sends of the copy hello to the cloud, the first included (at least 1).
    // The datagram with which the edge asks the cloud for copies of
    // interactive writes (`tether_proto::copies`); a cloud that answers none
    // gets and sends no copies on this connection.
    #[arg(long, env = "TETHER_COPY_HELLO_TRIES", default_value = "5")]
    pub copy_hello_tries: u32,
    /// First resend of an unanswered copy hello; doubled after each.
    #[arg(long, env = "TETHER_COPY_HELLO_RESEND", default_value = "1s", value_parser = parse_duration)]
    pub copy_hello_resend: Duration,
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

/// Flags of `tether-edge join`.
#[derive(Debug, Parser)]
#[command(
    name = "tether-edge join",
    about = "Obtain this edge's certificate from the cloud with a join token (the key never leaves the device)"
)]
pub struct JoinArgs {
    /// The cloud's tunnel address, HOST:PORT (UDP).
    #[arg(long, env = "TETHER_CLOUD")]
    pub cloud: String,
    /// The join token, `id.secret` (from `tether-certs token create`).
    #[arg(long, env = "TETHER_JOIN_TOKEN")]
    pub token: String,
    /// The cloud CA's pin, `sha256:<hex>` (printed by `tether-certs`); checked before the token is sent.
    #[arg(long, env = "TETHER_CA_PIN")]
    pub ca_pin: String,
    /// This node's name (must match the token's node pattern).
    #[arg(long, env = "TETHER_NODE_NAME")]
    pub node: String,
    /// Name to verify in the cloud's certificate (default: the host part of --cloud).
    #[arg(long, env = "TETHER_SERVER_NAME")]
    pub server_name: Option<String>,
    /// Where `node.key`, `node.crt` and `ca.crt` are written.
    #[arg(long, env = "TETHER_STATE_DIR", default_value = "/var/lib/tether-edge")]
    pub out_dir: PathBuf,
    /// Time allowed for the whole join.
    #[arg(long, env = "TETHER_JOIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub join_timeout: Duration,
    /// Largest answer read from the cloud.
    // At least what a grant for a 253-character node name from a CA of
    // `tether-certs ca create` takes (`tether_certs::join::LEAST_ANSWER_BYTES`).
    // A `u32`, as the cloud's flag of the same name: over 4 GiB is refused.
    #[arg(long, env = "TETHER_JOIN_MAX_MESSAGE_BYTES", default_value = "64KiB", value_parser = parse_bytes_u32)]
    pub join_max_message_bytes: u32,
}

impl JoinArgs {
    /// Checks the values clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.join_timeout.is_zero() {
            return Err("--join-timeout must be more than 0".into());
        }
        let least = tether_certs::join::LEAST_ANSWER_BYTES;
        if (self.join_max_message_bytes as usize) < least {
            return Err(format!(
                "--join-max-message-bytes {} is below the {least} bytes of a grant for a \
                 253-character node name from a CA of `tether-certs ca create`; give at least {least}",
                self.join_max_message_bytes
            ));
        }
        Ok(())
    }

    /// `--join-max-message-bytes` as a length (validated: at least
    /// [`tether_certs::join::LEAST_ANSWER_BYTES`]).
    pub fn max_answer_bytes(&self) -> usize {
        usize::try_from(self.join_max_message_bytes).unwrap_or(usize::MAX)
    }
}

/// How to reach the kubelet.
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    pub url: http::Uri,
    pub ca: Option<PathBuf>,
    pub insecure_skip_tls_verify: bool,
    pub client_cert: Option<(PathBuf, PathBuf)>,
    pub connect_timeout: Duration,
    pub pods_timeout: Duration,
    /// Largest `/pods` body read (`--kubelet-pods-max-bytes`).
    pub pods_max_bytes: usize,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    pub cloud: String,
    pub server_name: String,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub kubelet: KubeletConfig,
    pub request_head_timeout: Duration,
    /// Ended stream ids remembered (`--ended-streams-remembered`).
    pub ended_streams_remembered: usize,
    pub announce_addresses: Option<Vec<String>>,
    /// Addresses a hello carries at most (`--max-announced-addresses`).
    pub max_announced_addresses: usize,
    pub pods_refresh: Duration,
    /// The adaptive keep-alive's bounds.
    pub keep_alive: crate::keepalive::Bounds,
    pub worker_threads: usize,
    pub silence_timeout: Duration,
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    pub reconnect_spread: Duration,
    /// How long the cloud may not answer before the edge probes patiently
    /// (`--reconnect-patient-after`; `None`: the session's grace period, at least 300 s).
    pub reconnect_patient_after: Option<Duration>,
    /// The patient probes' nominal interval (`--reconnect-patient-interval`;
    /// zero: never patient).
    pub reconnect_patient_interval: Duration,
    /// On SIGTERM, the wait for the connection's close (`--shutdown-drain`).
    pub shutdown_drain: Duration,
    pub handshake_timeout: Duration,
    /// What `handshake_timeout` doubles up to after rounds that timed out
    /// (`--handshake-timeout-max`).
    pub handshake_timeout_max: Duration,
    /// The longest an attempt that heard nothing from the cloud waits
    /// (`--unanswered-attempt-max`).
    pub unanswered_attempt_max: Duration,
    /// Connection attempts in flight at once (`--max-handshakes-in-flight`).
    pub max_handshakes_in_flight: usize,
    /// Wait for the answer to a renewal request (`--renewal-answer-timeout`).
    pub renewal_answer_timeout: Duration,
    pub metrics_listen: std::net::SocketAddr,
    pub limits: Limits,
    pub quic: QuicSettings,
}

impl tether_proto::cli::BinaryArgs for EdgeArgs {
    type Config = EdgeConfig;
    fn wants_print_config(&self) -> bool {
        self.print_config
    }
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
    fn validate(self) -> Result<EdgeConfig, String> {
        self.into_config()
    }
}

impl EdgeArgs {
    /// Checks the flags and builds the configuration.
    pub fn into_config(self) -> Result<EdgeConfig, String> {
        let limits = self.limits.limits()?;
        let mut quic = self.quic.settings(&limits, tether_proto::cli::Role::Edge)?;
        let keep_alive = keep_alive_bounds(
            quic.keep_alive,
            quic.idle_timeout,
            self.keep_alive_min,
            self.keep_alive_max,
        )?;
        // quinn's own keep-alive only as a backstop at the longest interval:
        // the adaptive one (dial.rs) goes first and resets quinn's timer.
        quic.keep_alive = keep_alive.max;
        let url: http::Uri = self
            .kubelet_url
            .parse()
            .map_err(|e| format!("--kubelet-url {:?}: {e}", self.kubelet_url))?;
        match url.scheme_str() {
            Some("http") | Some("https") => {}
            _ => {
                return Err(format!(
                    "--kubelet-url {:?} must be http:// or https://",
                    self.kubelet_url
                ))
            }
        }
        if url.host().is_none() {
            return Err(format!("--kubelet-url {:?} has no host", self.kubelet_url));
        }
        if url.scheme_str() == Some("https")
            && self.kubelet_ca.is_none()
            && !self.kubelet_insecure_skip_tls_verify
        {
            return Err("an https --kubelet-url needs --kubelet-ca, or the explicit --kubelet-insecure-skip-tls-verify".into());
        }
        let host = self
            .cloud
            .rsplit_once(':')
            .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']').to_string())
            .ok_or_else(|| format!("--cloud {:?} must be HOST:PORT", self.cloud))?;
        if !(1..=1024).contains(&self.max_announced_addresses) {
            return Err("--max-announced-addresses must be 1 to 1024".into());
        }
        if self.announce_addresses.len() > self.max_announced_addresses {
            return Err(format!(
                "--announce-address given {} times; a hello carries at most {} (--max-announced-addresses)",
                self.announce_addresses.len(),
                self.max_announced_addresses
            ));
        }
        // A zero interval would spin (a busy loop), a zero timeout fail everything.
        for (flag, d) in [
            ("--pods-refresh", self.pods_refresh),
            ("--kubelet-connect-timeout", self.kubelet_connect_timeout),
            ("--kubelet-pods-timeout", self.kubelet_pods_timeout),
            ("--request-head-timeout", self.request_head_timeout),
            ("--handshake-timeout", self.handshake_timeout),
            ("--unanswered-attempt-max", self.unanswered_attempt_max),
            ("--silence-timeout", self.silence_timeout),
            ("--renewal-answer-timeout", self.renewal_answer_timeout),
            ("--shutdown-drain", self.shutdown_drain),
            ("--copy-hello-resend", self.copy_hello_resend),
        ] {
            if d.is_zero() {
                return Err(format!("{flag} must be more than 0"));
            }
        }
        let handshake_timeout_max = self.handshake_timeout_max.unwrap_or(
            self.handshake_timeout
                .saturating_mul(DEFAULT_HANDSHAKE_DOUBLING),
        );
        if handshake_timeout_max < self.handshake_timeout {
            return Err(format!(
                "--handshake-timeout-max ({handshake_timeout_max:?}) must be at least --handshake-timeout ({:?})",
                self.handshake_timeout
            ));
        }
        if self.copy_hello_tries == 0 {
            return Err("--copy-hello-tries must be at least 1".into());
        }
        // The edge asks its cloud for copies (the cloud only answers): the
        // hello's schedule is the edge's, not in the shared QUIC flags.
        quic.copies.hello_tries = self.copy_hello_tries;
        quic.copies.hello_resend = self.copy_hello_resend;
        if self.worker_threads == 0 || self.worker_threads > 64 {
            return Err("--worker-threads must be 1 to 64".into());
        }
        if !(1..=8).contains(&self.max_handshakes_in_flight) {
            return Err("--max-handshakes-in-flight must be 1 to 8".into());
        }
        if !(1..=1 << 20).contains(&self.ended_streams_remembered) {
            return Err("--ended-streams-remembered must be 1 to 1048576".into());
        }
        let pods_max_bytes = usize::try_from(self.kubelet_pods_max_bytes)
            .ok()
            .filter(|&b| b > 0)
            .ok_or("--kubelet-pods-max-bytes must be more than 0")?;
        if self.reconnect_min > self.reconnect_max || self.reconnect_min.is_zero() {
            return Err("--reconnect-min must be positive and at most --reconnect-max".into());
        }
        if self.reconnect_patient_after.is_some_and(|d| d.is_zero()) {
            return Err("--reconnect-patient-after must be more than 0".into());
        }
        let patient = self.reconnect_patient_interval;
        if !patient.is_zero() && patient < self.reconnect_max {
            return Err(format!(
                "--reconnect-patient-interval ({patient:?}) must be 0s (off) or at least --reconnect-max ({:?})",
                self.reconnect_max
            ));
        }
        Ok(EdgeConfig {
            server_name: self.server_name.unwrap_or(host),
            cloud: self.cloud,
            ca: self.ca,
            cert: self.cert,
            key: self.key,
            kubelet: KubeletConfig {
                url,
                ca: self.kubelet_ca,
                insecure_skip_tls_verify: self.kubelet_insecure_skip_tls_verify,
                client_cert: self.kubelet_client_cert.zip(self.kubelet_client_key),
                connect_timeout: self.kubelet_connect_timeout,
                pods_timeout: self.kubelet_pods_timeout,
                pods_max_bytes,
            },
            request_head_timeout: self.request_head_timeout,
            ended_streams_remembered: self.ended_streams_remembered,
            announce_addresses: if self.announce_addresses.is_empty() {
                None
            } else {
                Some(self.announce_addresses)
            },
            max_announced_addresses: self.max_announced_addresses,
            pods_refresh: self.pods_refresh,
            keep_alive,
            worker_threads: self.worker_threads,
            silence_timeout: self.silence_timeout,
            reconnect_min: self.reconnect_min,
            reconnect_max: self.reconnect_max,
            reconnect_spread: self.reconnect_spread,
            reconnect_patient_after: self.reconnect_patient_after,
            reconnect_patient_interval: self.reconnect_patient_interval,
            shutdown_drain: self.shutdown_drain,
            handshake_timeout: self.handshake_timeout,
            handshake_timeout_max,
            unanswered_attempt_max: self.unanswered_attempt_max,
            max_handshakes_in_flight: self.max_handshakes_in_flight,
            renewal_answer_timeout: self.renewal_answer_timeout,
            metrics_listen: self.metrics_listen,
            limits,
            quic,
        })
    }
}

/// `--handshake-timeout-max` by default: this many times `--handshake-timeout`
/// (three doublings).
pub const DEFAULT_HANDSHAKE_DOUBLING: u32 = 8;

/// Default shortest keep-alive interval.
pub const DEFAULT_KEEP_ALIVE_MIN: Duration = Duration::from_secs(10);

/// Default longest keep-alive interval: below the 120 s that RFC 4787 asks
/// of NATs for UDP bindings, with room for RTT and timer jitter.
pub const DEFAULT_KEEP_ALIVE_MAX: Duration = Duration::from_secs(110);

/// The keep-alive must stay this far below the idle timeout, so a lost
/// keep-alive is retransmitted before the connection is declared dead.
pub const IDLE_SLACK: Duration = Duration::from_secs(20);

/// The adaptive keep-alive's bounds from the flags: it starts at
/// `--keep-alive`; the minimum defaults to [`DEFAULT_KEEP_ALIVE_MIN`] (or
/// `--keep-alive` if shorter), the maximum to
/// [`DEFAULT_KEEP_ALIVE_MAX`] but at least [`IDLE_SLACK`] below the idle
/// timeout (so a short `--idle-timeout` keeps the keep-alive fixed).
pub fn keep_alive_bounds(
    start: Duration,
    idle_timeout: Duration,
    min: Option<Duration>,
    max: Option<Duration>,
) -> Result<crate::keepalive::Bounds, String> {
    let min = min.unwrap_or(DEFAULT_KEEP_ALIVE_MIN.min(start));
    let max = match max {
        Some(m) => {
            if m >= idle_timeout {
                return Err(format!(
                    "--keep-alive-max ({m:?}) must be below --idle-timeout ({idle_timeout:?})"
                ));
            }
            m
        }
        None => DEFAULT_KEEP_ALIVE_MAX
            .min(idle_timeout.saturating_sub(IDLE_SLACK))
            .max(min),
    };
    if min >= idle_timeout {
        return Err(format!(
            "--keep-alive-min ({min:?}) must be below --idle-timeout ({idle_timeout:?})"
        ));
    }
    crate::keepalive::Bounds::new(min, max, start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &[&str]) -> Result<EdgeConfig, String> {
        let mut args = vec![
            "tether-edge",
            "--cloud",
            "cloud.example:10004",
            "--ca",
            "ca.crt",
            "--cert",
            "n.crt",
            "--key",
            "n.key",
            "--kubelet-url",
            "http://127.0.0.1:10250",
        ];
        args.extend_from_slice(extra);
        EdgeArgs::try_parse_from(args)
            .map_err(|e| e.to_string())?
            .into_config()
    }

    #[test]
    fn zero_intervals_and_timeouts_are_refused() {
        config(&[]).unwrap();
        for flag in [
            "--pods-refresh",
            "--kubelet-connect-timeout",
            "--kubelet-pods-timeout",
            "--request-head-timeout",
            "--handshake-timeout",
            "--unanswered-attempt-max",
            "--silence-timeout",
            "--renewal-answer-timeout",
            "--shutdown-drain",
            "--copy-hello-resend",
        ] {
            let e = config(&[flag, "0s"]).expect_err(flag);
            assert!(e.contains(flag), "{flag}: {e}");
        }
    }

    #[test]
    fn edge_limits_have_their_defaults_and_nonsense_is_refused() {
        let c = config(&[]).unwrap();
        assert_eq!(c.kubelet.pods_max_bytes, 64 << 20);
        assert_eq!(c.ended_streams_remembered, 4096);
        assert_eq!(c.max_handshakes_in_flight, 2);
        assert_eq!(c.renewal_answer_timeout, Duration::from_secs(30));
        assert_eq!(c.max_announced_addresses, 64);
        assert_eq!(c.handshake_timeout_max, Duration::from_secs(80));
        assert_eq!(c.unanswered_attempt_max, Duration::from_secs(20));
        assert_eq!(c.shutdown_drain, Duration::from_secs(2));
        let c = config(&[
            "--kubelet-pods-max-bytes",
            "1KiB",
            "--ended-streams-remembered",
            "1",
            "--max-handshakes-in-flight",
            "8",
            "--renewal-answer-timeout",
            "5s",
            "--max-announced-addresses",
            "1024",
            "--handshake-timeout-max",
            "10s",
            "--shutdown-drain",
            "200ms",
        ])
        .unwrap();
        assert_eq!(c.kubelet.pods_max_bytes, 1024);
        assert_eq!(c.ended_streams_remembered, 1);
        assert_eq!(c.max_handshakes_in_flight, 8);
        assert_eq!(c.renewal_answer_timeout, Duration::from_secs(5));
        assert_eq!(c.max_announced_addresses, 1024);
        assert_eq!(c.handshake_timeout_max, Duration::from_secs(10));
        assert_eq!(c.shutdown_drain, Duration::from_millis(200));
        for (flag, bad) in [
            ("--kubelet-pods-max-bytes", "0"),
            ("--ended-streams-remembered", "0"),
            ("--ended-streams-remembered", "1048577"),
            ("--max-handshakes-in-flight", "0"),
            ("--max-handshakes-in-flight", "9"),
            ("--renewal-answer-timeout", "0s"),
            ("--max-announced-addresses", "0"),
            ("--max-announced-addresses", "1025"),
            ("--handshake-timeout-max", "9s"),
            ("--handshake-timeout-max", "0s"),
            ("--shutdown-drain", "0s"),
        ] {
            let e = config(&[flag, bad]).expect_err(flag);
            assert!(e.contains(flag), "{flag} {bad}: {e}");
        }
        // The default follows --handshake-timeout; the largest one accepted
        // does not overflow it.
        let c = config(&["--handshake-timeout", "3s"]).unwrap();
        assert_eq!(c.handshake_timeout_max, Duration::from_secs(24));
        let c = config(&["--handshake-timeout", "1000000000s"]).unwrap();
        assert_eq!(c.handshake_timeout_max, Duration::from_secs(8_000_000_000));
        // --announce-address values beyond --max-announced-addresses.
        let three = ["--announce-address", "a.example,b.example,c.example"];
        let c = config(&[&three[..], &["--max-announced-addresses", "3"]].concat()).unwrap();
        assert_eq!(c.announce_addresses.map(|a| a.len()), Some(3));
        let e = config(&[&three[..], &["--max-announced-addresses", "2"]].concat()).unwrap_err();
        assert!(
            e.contains("given 3 times") && e.contains("at most 2 (--max-announced-addresses)"),
            "{e}"
        );
        let many: Vec<String> = (0..65).map(|i| format!("10.0.0.{i}")).collect();
        let e = config(&["--announce-address", &many.join(",")]).unwrap_err();
        assert!(e.contains("at most 64"), "{e}");
        let join = |t: &str| {
            JoinArgs::try_parse_from([
                "join",
                "--cloud",
                "c:1",
                "--token",
                "t",
                "--ca-pin",
                "p",
                "--node",
                "n",
                "--join-timeout",
                t,
            ])
            .unwrap()
        };
        assert_eq!(join("2s").join_timeout, Duration::from_secs(2));
        let e = join("0s").validate().unwrap_err();
        assert!(e.contains("--join-timeout"), "{e}");
    }

    /// `--reconnect-patient-after` follows the session's grace period unless
    /// given; `--reconnect-patient-interval` is 30 s, `0s` turns it off, and
    /// an interval below `--reconnect-max` (probing faster when patient) or
    /// a zero wait before patience is refused.
    #[test]
    fn patient_probing_has_its_defaults_and_bounds() {
        let c = config(&[]).unwrap();
        assert_eq!(c.reconnect_patient_after, None);
        assert_eq!(c.reconnect_patient_interval, Duration::from_secs(30));
        let c = config(&[
            "--reconnect-patient-after",
            "90s",
            "--reconnect-patient-interval",
            "0s",
        ])
        .unwrap();
        assert_eq!(c.reconnect_patient_after, Some(Duration::from_secs(90)));
        assert_eq!(c.reconnect_patient_interval, Duration::ZERO);
        let c = config(&["--reconnect-patient-interval", "1s"]).unwrap();
        assert_eq!(c.reconnect_patient_interval, Duration::from_secs(1));
        for (flags, named) in [
            (
                &["--reconnect-patient-interval", "999ms"][..],
                "--reconnect-patient-interval",
            ),
            (
                &[
                    "--reconnect-max",
                    "5s",
                    "--reconnect-patient-interval",
                    "4s",
                ][..],
                "at least --reconnect-max (5s)",
            ),
            (
                &["--reconnect-patient-after", "0s"][..],
                "--reconnect-patient-after",
            ),
        ] {
            let e = config(flags).expect_err(named);
            assert!(e.contains(named), "{flags:?}: {e}");
        }
    }

    /// `tether-edge join --join-max-message-bytes` (was the fixed 64 KiB):
    /// its default, a size in the units of the other sizes, and a bound
    /// below a real grant (or 0) refused at start, naming the least value.
    /// A `u32` like the cloud's flag of the same name: over 4 GiB is refused
    /// as the cloud refuses it (it was a `u64` here, and 5 GiB was taken).
    #[test]
    fn the_join_answer_bound_has_its_default_and_a_floor() {
        let try_join = |extra: &[&str]| {
            let mut args = vec![
                "join", "--cloud", "c:1", "--token", "t", "--ca-pin", "p", "--node", "n",
            ];
            args.extend_from_slice(extra);
            JoinArgs::try_parse_from(args).map_err(|e| e.to_string())
        };
        let join = |extra: &[&str]| try_join(extra).unwrap();
        let a = join(&[]);
        assert_eq!(a.max_answer_bytes(), 64 << 10);
        a.validate().unwrap();
        let least = tether_certs::join::LEAST_ANSWER_BYTES;
        let a = join(&["--join-max-message-bytes", &least.to_string()]);
        a.validate().unwrap();
        assert_eq!(a.max_answer_bytes(), least);
        assert_eq!(
            join(&["--join-max-message-bytes", "1MiB"]).max_answer_bytes(),
            1 << 20
        );
        for bad in ["0", &(least - 1).to_string()] {
            let e = join(&["--join-max-message-bytes", bad])
                .validate()
                .unwrap_err();
            assert!(
                e.contains("--join-max-message-bytes") && e.contains(&format!("at least {least}")),
                "{bad}: {e}"
            );
        }
        let most = u32::MAX.to_string();
        assert_eq!(
            join(&["--join-max-message-bytes", &most]).max_answer_bytes(),
            u32::MAX as usize
        );
        for over in ["4294967296", "5GiB"] {
            let e = try_join(&["--join-max-message-bytes", over]).unwrap_err();
            assert!(
                e.contains("--join-max-message-bytes") && e.contains("at most 4GiB"),
                "{over}: {e}"
            );
        }
    }

    /// `--copy-hello-tries`, `--copy-hello-resend` (were the fixed 5 and
    /// 1 s): the schedule of the hello with which the edge asks its cloud
    /// for interactive copies, in the settings its copy link is made with
    /// (`dial.rs` hands `quic.copies` to `CopyLink::new`; its test
    /// `the_copy_hello_goes_its_configured_tries_on_the_edges_connection`
    /// counts them on a connection); 0 is refused.
    /// The other copy bounds stay the shared flags'.
    #[test]
    fn the_copy_hello_schedule_comes_from_its_flags() {
        let c = config(&[]).unwrap();
        assert_eq!(
            (c.quic.copies.hello_tries, c.quic.copies.hello_resend),
            (5, Duration::from_secs(1))
        );
        let c = config(&[
            "--copy-hello-tries",
            "2",
            "--copy-hello-resend",
            "150ms",
            "--interactive-copy-bytes",
            "64",
        ])
        .unwrap();
        assert_eq!(
            (
                c.quic.copies.hello_tries,
                c.quic.copies.hello_resend,
                c.quic.copies.max_payload
            ),
            (2, Duration::from_millis(150), 64)
        );
        for (flag, bad) in [("--copy-hello-tries", "0"), ("--copy-hello-resend", "0s")] {
            let e = config(&[flag, bad]).expect_err(flag);
            assert!(e.contains(flag), "{flag} {bad}: {e}");
        }
    }

    #[test]
    fn keep_alive_bounds_defaults_and_limits() {
        let s = Duration::from_secs;
        // Defaults: adaptive from 10 s to 110 s, starting at --keep-alive (20 s).
        let c = config(&[]).unwrap();
        assert_eq!((c.keep_alive.min, c.keep_alive.max), (s(10), s(110)));
        assert_eq!(c.keep_alive.start, s(20));
        assert_eq!(c.quic.keep_alive, s(110));
        // A short idle timeout keeps a short keep-alive fixed (as before).
        let c = config(&["--keep-alive", "1s", "--idle-timeout", "3s"]).unwrap();
        assert_eq!((c.keep_alive.min, c.keep_alive.max), (s(1), s(1)));
        assert!(!c.keep_alive.adaptive());
        // Explicit bounds.
        let c = config(&["--keep-alive-min", "20s", "--keep-alive-max", "60s"]).unwrap();
        assert_eq!(
            (c.keep_alive.min, c.keep_alive.max, c.keep_alive.start),
            (s(20), s(60), s(20))
        );
        for bad in [
            &["--keep-alive-max", "200s"][..],
            &["--keep-alive-min", "60s", "--keep-alive-max", "30s"],
            &["--keep-alive-min", "0s"],
        ] {
            assert!(config(bad).is_err(), "{bad:?}");
        }
    }
}
