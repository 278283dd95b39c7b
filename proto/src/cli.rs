//! Flag groups both binaries share: protocol limits, QUIC tuning, logging.
//!
//! Each flag also reads an environment variable (`TETHER_<FLAG>`), so a
//! binary's configuration is parsed once in `main` and passed down as typed
//! values ([`Limits`], [`QuicSettings`]).

use std::time::Duration;

use clap::Args;

use crate::limits::Limits;
use crate::quic::QuicSettings;
use crate::units::{parse_bytes, parse_bytes_u32, parse_duration};

/// Protocol limits (see [`Limits`]).
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Largest frame accepted on a QUIC stream.
    #[arg(long, env = "TETHER_MAX_FRAME_BYTES", default_value = "1MiB", value_parser = parse_bytes_u32)]
    pub max_frame_bytes: u32,
    /// Largest data payload in one frame.
    #[arg(long, env = "TETHER_MAX_DATA_PAYLOAD", default_value = "32KiB", value_parser = parse_bytes_u32)]
    pub max_data_payload: u32,
    /// Largest request or response head (headers) carried through the tunnel.
    #[arg(long, env = "TETHER_MAX_HEAD_BYTES", default_value = "256KiB", value_parser = parse_bytes_u32)]
    pub max_head_bytes: u32,
    /// Unacknowledged bytes kept for replay per stream direction (backpressure point).
    #[arg(long, env = "TETHER_REPLAY_BUFFER_BYTES", default_value = "2MiB", value_parser = parse_bytes_u32)]
    pub replay_buffer_bytes: u32,
    /// Received bytes not yet delivered locally, per stream direction.
    #[arg(long, env = "TETHER_RECV_BUFFER_BYTES", default_value = "1MiB", value_parser = parse_bytes_u32)]
    pub recv_buffer_bytes: u32,
    /// Concurrent streams per edge.
    #[arg(long, env = "TETHER_MAX_STREAMS_PER_EDGE", default_value_t = 1024)]
    pub max_streams_per_edge: u32,
}

impl LimitArgs {
    /// The validated limits.
    pub fn limits(&self) -> Result<Limits, String> {
        let l = Limits {
            max_frame_bytes: self.max_frame_bytes,
            max_data_payload: self.max_data_payload,
            max_head_bytes: self.max_head_bytes,
            replay_buffer_bytes: self.replay_buffer_bytes,
            recv_buffer_bytes: self.recv_buffer_bytes,
            max_streams_per_edge: self.max_streams_per_edge,
        };
        l.validate()?;
        Ok(l)
    }
}

/// QUIC tuning (see README, "QUIC tuning").
#[derive(Debug, Clone, Args)]
pub struct QuicArgs {
    /// Keep-alive interval (the edge's adaptive one starts here).
    // The edge learns the NAT's binding timeout from here, see
    // `--keep-alive-min/max`; the cloud sends none.
    #[arg(long, env = "TETHER_KEEP_ALIVE", default_value = "20s", value_parser = parse_duration)]
    pub keep_alive: Duration,
    /// A connection silent this long is dead.
    // Its streams then wait for a resume. Must exceed the edge's longest
    // keep-alive interval (110 s by default) by a margin for a lost
    // keep-alive's retransmission.
    #[arg(long, env = "TETHER_IDLE_TIMEOUT", default_value = "150s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// RTT assumed before the first sample (cellular: a few hundred ms).
    #[arg(long, env = "TETHER_INITIAL_RTT", default_value = "300ms", value_parser = parse_duration)]
    pub initial_rtt: Duration,
    /// Per-stream QUIC receive window.
    // How much of one stream may be in flight towards us. One stream's
    // throughput is at most this per round trip, and after a loss the data
    // behind the hole waits in it for an extra round trip or two; keep it at
    // least `--replay-buffer-bytes`.
    #[arg(long, env = "TETHER_STREAM_WINDOW", default_value = "4MiB", value_parser = parse_bytes_u32)]
    pub stream_window: u32,
    /// UDP socket buffer size [default: 32MiB on the cloud, 4MiB on the edge].
    // The cloud's one socket takes every edge's datagrams: after a restart
    // thousands of edges' handshakes arrive at once, and a datagram the
    // kernel drops for want of buffer costs its edge a retransmission timer
    // inflated by the storm (seconds). Beyond `net.core.rmem_max` it needs
    // `CAP_NET_ADMIN`, else a warning says what was granted.
    #[arg(long, env = "TETHER_UDP_BUFFER", value_parser = parse_bytes)]
    pub udp_buffer: Option<u64>,
    /// Congestion controller.
    // `bbr` is loss-tolerant, for lossy cellular links.
    #[arg(long, env = "TETHER_CONGESTION", default_value = "bbr", value_parser = ["bbr", "cubic", "newreno"])]
    pub congestion: String,
    /// Interactive writes up to this size also go as a datagram copy (0: none).
    // Writes of an upgraded exec, attach or port-forward stream up to this
    // size also go once more as a QUIC datagram padded to a full packet, so a
    // lost packet does not hold a keystroke or its echo for a loss-detection
    // round trip; each copied write costs one packet more on the wire. 0
    // sends no copies (they are still received).
    #[arg(long, env = "TETHER_INTERACTIVE_COPY_BYTES", default_value = "256", value_parser = parse_bytes)]
    pub interactive_copy_bytes: u64,
    /// Copies one stream may send per second; its further writes go once.
    #[arg(long, env = "TETHER_INTERACTIVE_COPIES_PER_SEC", default_value_t = 200)]
    pub interactive_copies_per_sec: u32,
    /// QUIC datagrams buffered per connection each way (at least 2KiB).
    #[arg(long, env = "TETHER_DATAGRAM_BUFFER", default_value = "64KiB", value_parser = parse_bytes)]
    pub datagram_buffer: u64,
    /// Path-MTU search step in bytes (at most 252; 0: no search).
    // After each handshake the packet size is searched from 1,200 up to
    // 1,452 bytes by bisection, probing 1,452 last once a bisection would
    // move less than this. 64 takes two probes on a 1,500-byte path (20,
    // quinn's own, four); a smaller step takes more probes (each a padded
    // packet and its acknowledgement) and ends closer to an odd path's size.
    // 0: no search, 1,200-byte packets.
    #[arg(long, env = "TETHER_MTU_PROBE_STEP", default_value_t = crate::quic::DEFAULT_MTU_PROBE_STEP)]
    pub mtu_probe_step: u16,
    /// How long a path-MTU search stands before the path is searched again.
    // 1s to 30 days. On a path that silently drops packets above its MTU,
    // every search loses six probes of up to 1,452 bytes from each end
    // (about 17 KB on the wire); quinn's default, 10 minutes, made that
    // 2.4 MiB a day per idle edge. Every new connection searches anew
    // regardless, and so does the cloud when an edge's address changes; a
    // path whose MTU shrinks is caught by quinn's black-hole detection.
    #[arg(long, env = "TETHER_MTU_RESEARCH_INTERVAL", default_value = "6h", value_parser = parse_duration)]
    pub mtu_research_interval: Duration,
    /// Packets the peer may receive before it must acknowledge (0-100; 0: QUIC's own).
    // Instead of acknowledging every second one (QUIC's acknowledgement-
    // frequency extension; both ends speak it). Fewer acknowledgements to
    // send, receive and route, and larger bursts per system call; a lone
    // packet is acknowledged after the peer's 25 ms delay either way. 0:
    // QUIC's own cadence, no extension frame.
    #[arg(long, env = "TETHER_ACK_ELICITING_THRESHOLD", default_value_t = crate::quic::DEFAULT_ACK_THRESHOLD)]
    pub ack_eliciting_threshold: u32,
}

/// Which end of the tunnel a QUIC configuration is for: it decides how many
/// streams the peer may open (the cloud opens the logical streams; the edge
/// opens only its control stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Cloud,
    Edge,
}

/// Bidirectional streams an edge may open to the cloud at once: the control
/// stream, with one to spare. quinn keeps an entry per allowed stream for
/// every connection, so the cloud allowing 1,024 here would cost each idle
/// edge tens of KiB for nothing.
pub const EDGE_OPENED_STREAMS: u32 = 2;

/// The cloud's default `--udp-buffer`: 10,000 edges dialling back after a
/// restart overflowed 4 and 8 MiB on 2 cores (thousands of datagrams dropped),
/// not 32 MiB (`tether-bench --only edges --scale 10000`).
pub const CLOUD_UDP_BUFFER: u64 = 32 * 1024 * 1024;
/// The edge's default `--udp-buffer`: one connection's bursts.
pub const EDGE_UDP_BUFFER: u64 = 4 * 1024 * 1024;

impl QuicArgs {
    /// The QUIC settings of `role`, with stream limits taken from `limits`.
    pub fn settings(&self, limits: &Limits, role: Role) -> Result<QuicSettings, String> {
        let s = QuicSettings {
            keep_alive: self.keep_alive,
            idle_timeout: self.idle_timeout,
            initial_rtt: self.initial_rtt,
            max_bidi_streams: match role {
                Role::Cloud => EDGE_OPENED_STREAMS,
                // The cloud's logical streams (their QUIC streams; a re-attach
                // opens a new one after the old connection is gone).
                Role::Edge => limits.max_streams_per_edge,
            },
            stream_window: self.stream_window,
            udp_buffer: usize::try_from(self.udp_buffer.unwrap_or(match role {
                Role::Cloud => CLOUD_UDP_BUFFER,
                Role::Edge => EDGE_UDP_BUFFER,
            }))
            .map_err(|_| "udp-buffer too large".to_string())?,
            congestion: match self.congestion.as_str() {
                "bbr" => crate::quic::Congestion::Bbr,
                "newreno" => crate::quic::Congestion::NewReno,
                _ => crate::quic::Congestion::Cubic,
            },
            datagram_buffer: usize::try_from(self.datagram_buffer)
                .map_err(|_| "datagram-buffer too large".to_string())?,
            mtu_probe_step: self.mtu_probe_step,
            mtu_research: self.mtu_research_interval,
            ack_threshold: (self.ack_eliciting_threshold > 0)
                .then_some(self.ack_eliciting_threshold),
            copies: crate::copies::CopySettings {
                max_payload: usize::try_from(self.interactive_copy_bytes)
                    .map_err(|_| "interactive-copy-bytes too large".to_string())?,
                per_sec: self.interactive_copies_per_sec,
                ..crate::copies::CopySettings::default()
            },
            ..QuicSettings::default()
        };
        s.transport()?;
        Ok(s)
    }
}

/// Logging.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log format: `text` or `json`.
    #[arg(long, env = "TETHER_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Log filter, e.g. `info,tether_cloud=debug`.
    // A default level and `target=level` pairs, comma-separated (tracing's
    // `Targets` syntax: no regex engine in the binaries, which keeps the edge
    // small).
    #[arg(long, env = "TETHER_LOG", default_value = "info")]
    pub log: String,
}

impl LogArgs {
    /// The parsed `--log` filter.
    pub fn filter(&self) -> Result<tracing_subscriber::filter::Targets, String> {
        self.log
            .parse()
            .map_err(|e| format!("--log {:?}: {e}", self.log))
    }

    /// Installs the global tracing subscriber (logs go to stderr).
    pub fn init(&self) -> Result<(), String> {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        let filter = self.filter()?;
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi);
        let r = if self.log_format == "json" {
            tracing_subscriber::registry()
                .with(fmt.json())
                .with(filter)
                .try_init()
        } else {
            tracing_subscriber::registry()
                .with(fmt)
                .with(filter)
                .try_init()
        };
        r.map_err(|e| format!("installing the logger: {e}"))
    }
}

/// Environment variable naming the configuration file (also `--config`).
pub const CONFIG_ENV: &str = "TETHER_CONFIG";

/// Finds `--config FILE` / `--config=FILE` in `argv`, else `TETHER_CONFIG`.
fn config_path(argv: &[std::ffi::OsString]) -> Option<std::path::PathBuf> {
    let mut it = argv.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--config" {
            return it.next().map(std::path::PathBuf::from);
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(v.into());
        }
    }
    std::env::var_os(CONFIG_ENV).map(std::path::PathBuf::from)
}

/// The TOML value as the flag's text.
fn toml_text(key: &str, v: &toml::Value) -> Result<String, String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Array(items) => items
            .iter()
            .map(|i| toml_text(key, i))
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        other => return Err(format!("{key}: unsupported value {other}")),
    })
}

/// Applies an optional TOML configuration file beneath flags and environment
/// variables: each `key = value` (keys are the long flag names, e.g.
/// `tunnel-listen = "0.0.0.0:10004"`) becomes the flag's environment variable
/// unless that variable is already set. So the precedence is flag > env >
/// file > default. Unknown keys, and keys of flags without an environment
/// variable, are rejected with a message naming them. Returns the file used.
pub fn apply_config_file(
    cmd: &clap::Command,
    argv: &[std::ffi::OsString],
) -> Result<Option<std::path::PathBuf>, String> {
    let Some(path) = config_path(argv) else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    for (key, value) in &table {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()))
            .ok_or_else(|| format!("config file {}: unknown setting {key:?}", path.display()))?;
        let env = arg.get_env().ok_or_else(|| {
            format!(
                "config file {}: {key:?} cannot be set from a file",
                path.display()
            )
        })?;
        let text =
            toml_text(key, value).map_err(|e| format!("config file {}: {e}", path.display()))?;
        if std::env::var_os(env).is_none() {
            // Before any thread starts (called first thing in `main`).
            std::env::set_var(env, text);
        }
    }
    Ok(Some(path))
}

/// Renders the effective configuration as TOML, each value commented with
/// where it came from; values of settings whose name suggests a secret are
/// redacted (not a switch's: `--authentication-token-webhook` holds no
/// token, only `true` or `false`). The output is itself a configuration file:
/// given back through `--config`, every value shown comes back the same.
pub fn render_config(cmd: &clap::Command, matches: &clap::ArgMatches) -> String {
    let mut out = String::new();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "version" | "print-config" | "config") {
            continue;
        }
        let id = arg.get_id().as_str();
        let values: Vec<String> = matches
            .get_raw(id)
            .map(|vs| vs.map(|v| v.to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let source = match matches.value_source(id) {
            Some(clap::parser::ValueSource::CommandLine) => "flag",
            Some(clap::parser::ValueSource::EnvVariable) => "env or file",
            Some(clap::parser::ValueSource::DefaultValue) => "default",
            _ => "unset",
        };
        let secret = arg.get_action().takes_values()
            && ["token", "secret", "password"]
                .iter()
                .any(|s| long.contains(s));
        let shown = if secret && !values.is_empty() {
            "\"<redacted>\"".to_string()
        } else if values.is_empty() {
            "# (unset)".to_string()
        } else if values.len() == 1 {
            format!("{:?}", values[0])
        } else {
            format!("{values:?}")
        };
        if values.is_empty() {
            out.push_str(&format!("# {long} {shown}\n"));
        } else {
            out.push_str(&format!("{long} = {shown}  # {source}\n"));
        }
    }
    out
}

/// What a binary's flags give the shared start-up in [`start`].
pub trait BinaryArgs: clap::Parser {
    /// The validated configuration.
    type Config;
    /// Whether `--print-config` was given.
    fn wants_print_config(&self) -> bool;
    /// The logging flags.
    fn log_args(&self) -> &LogArgs;
    /// Checks the flags and builds the configuration.
    fn validate(self) -> Result<Self::Config, String>;
}

/// A binary's start-up: applies the configuration file beneath flags and
/// environment (call before any thread exists), parses and validates the
/// flags, then either prints the effective configuration (`Ok(None)`) or
/// installs the logger and returns the configuration.
pub fn start<A: BinaryArgs>(argv: &[std::ffi::OsString]) -> Result<Option<A::Config>, String> {
    apply_config_file(&A::command(), argv)?;
    let matches = A::command().get_matches_from(argv);
    let args = A::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let print = args.wants_print_config();
    let log = args.log_args().clone();
    let cfg = args
        .validate()
        .map_err(|e| format!("invalid configuration: {e}"))?;
    if print {
        print!("{}", render_config(&A::command(), &matches));
        return Ok(None);
    }
    log.init()?;
    Ok(Some(cfg))
}

#[cfg(test)]
mod tests {
    #[derive(Debug, Parser)]
    struct QuicOnly {
        #[command(flatten)]
        quic: QuicArgs,
    }

    #[test]
    fn udp_buffer_defaults_by_role_and_a_flag_overrides_both() {
        let limits = crate::limits::Limits::default();
        let quic = |argv: &[&str]| QuicOnly::try_parse_from(argv).unwrap().quic;
        let defaults = quic(&["t"]);
        let cloud = defaults.settings(&limits, Role::Cloud).unwrap();
        let edge = defaults.settings(&limits, Role::Edge).unwrap();
        assert_eq!(cloud.udp_buffer as u64, CLOUD_UDP_BUFFER);
        assert_eq!(edge.udp_buffer as u64, EDGE_UDP_BUFFER);
        let set = quic(&["t", "--udp-buffer", "1MiB"]);
        for role in [Role::Cloud, Role::Edge] {
            assert_eq!(set.settings(&limits, role).unwrap().udp_buffer, 1 << 20);
        }
    }

    #[test]
    fn ack_threshold_defaults_to_ten_zero_turns_it_off_and_101_is_refused() {
        let limits = crate::limits::Limits::default();
        let quic = |argv: &[&str]| QuicOnly::try_parse_from(argv).unwrap().quic;
        for role in [Role::Cloud, Role::Edge] {
            let d = quic(&["t"]).settings(&limits, role).unwrap();
            assert_eq!(d.ack_threshold, Some(crate::quic::DEFAULT_ACK_THRESHOLD));
            let off = quic(&["t", "--ack-eliciting-threshold", "0"]);
            assert_eq!(off.settings(&limits, role).unwrap().ack_threshold, None);
            let max = quic(&["t", "--ack-eliciting-threshold", "100"]);
            assert_eq!(
                max.settings(&limits, role).unwrap().ack_threshold,
                Some(100)
            );
            let e = quic(&["t", "--ack-eliciting-threshold", "101"])
                .settings(&limits, role)
                .unwrap_err();
            assert!(e.contains("ACK-eliciting threshold (101)"), "{e}");
        }
    }

    #[test]
    fn interactive_copy_flags_reach_the_settings() {
        let limits = crate::limits::Limits::default();
        let quic = |argv: &[&str]| QuicOnly::try_parse_from(argv).unwrap().quic;
        let d = quic(&["t"]).settings(&limits, Role::Edge).unwrap();
        assert_eq!(d.copies, crate::copies::CopySettings::default());
        assert_eq!(d.datagram_buffer, 64 * 1024);
        let s = quic(&[
            "t",
            "--interactive-copy-bytes",
            "0",
            "--interactive-copies-per-sec",
            "7",
            "--datagram-buffer",
            "8KiB",
        ])
        .settings(&limits, Role::Cloud)
        .unwrap();
        assert_eq!(s.copies.max_payload, 0);
        assert_eq!(s.copies.per_sec, 7);
        assert_eq!(s.datagram_buffer, 8192);
        assert!(quic(&["t", "--datagram-buffer", "1KiB"])
            .settings(&limits, Role::Edge)
            .is_err());
    }

    #[test]
    fn mtu_probe_step_reaches_the_settings_and_is_bounded() {
        let limits = crate::limits::Limits::default();
        let quic = |argv: &[&str]| QuicOnly::try_parse_from(argv).unwrap().quic;
        let d = quic(&["t"]).settings(&limits, Role::Edge).unwrap();
        assert_eq!(d.mtu_probe_step, crate::quic::DEFAULT_MTU_PROBE_STEP);
        let s = quic(&["t", "--mtu-probe-step", "0"])
            .settings(&limits, Role::Cloud)
            .unwrap();
        assert_eq!(s.mtu_probe_step, 0);
        let e = quic(&["t", "--mtu-probe-step", "253"])
            .settings(&limits, Role::Edge)
            .unwrap_err();
        assert!(e.contains("MTU probe step"), "{e}");
    }

    #[test]
    fn mtu_research_interval_reaches_the_settings_and_is_bounded() {
        let limits = crate::limits::Limits::default();
        let quic = |argv: &[&str]| QuicOnly::try_parse_from(argv).unwrap().quic;
        let d = quic(&["t"]).settings(&limits, Role::Edge).unwrap();
        assert_eq!(d.mtu_research, crate::quic::DEFAULT_MTU_RESEARCH);
        assert_eq!(d.mtu_research, Duration::from_secs(6 * 3600));
        let s = quic(&["t", "--mtu-research-interval", "90s"])
            .settings(&limits, Role::Cloud)
            .unwrap();
        assert_eq!(s.mtu_research, Duration::from_secs(90));
        for bad in ["500ms", "721h"] {
            let e = quic(&["t", "--mtu-research-interval", bad])
                .settings(&limits, Role::Edge)
                .unwrap_err();
            assert!(e.contains("MTU search interval"), "{bad}: {e}");
        }
        quic(&["t", "--mtu-research-interval", "720h"])
            .settings(&limits, Role::Edge)
            .unwrap();
    }

    #[test]
    fn log_filter_takes_levels_and_targets_and_rejects_nonsense() {
        let args = |log: &str| LogArgs {
            log_format: "text".into(),
            log: log.into(),
        };
        let f = args("info,tether_cloud=debug").filter().unwrap();
        assert!(f.would_enable("tether_cloud::tunnel", &tracing::Level::DEBUG));
        assert!(!f.would_enable("quinn", &tracing::Level::DEBUG));
        assert!(f.would_enable("quinn", &tracing::Level::INFO));
        assert!(args("tether_cloud=loud").filter().is_err());
    }

    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};

    #[derive(Debug, Parser)]
    struct Demo {
        #[arg(long, env = "TETHER_TEST_CFG_LISTEN", default_value = "0.0.0.0:1")]
        listen: String,
        #[arg(long, env = "TETHER_TEST_CFG_GRACE", default_value = "5m")]
        grace: String,
        #[arg(long, env = "TETHER_TEST_CFG_TIMEOUT", default_value = "1s")]
        timeout: String,
        #[arg(long, env = "TETHER_TEST_CFG_JOIN_TOKEN")]
        join_token: Option<String>,
        /// A switch whose name says "token" but which holds none.
        #[arg(long, env = "TETHER_TEST_CFG_TOKEN_WEBHOOK")]
        token_webhook: bool,
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        #[arg(long)]
        print_config: bool,
    }

    fn os(v: &[&str]) -> Vec<std::ffi::OsString> {
        v.iter().map(|s| s.into()).collect()
    }

    #[test]
    fn precedence_is_flag_env_file_default_and_unknown_keys_are_rejected() {
        let dir = std::env::temp_dir().join(format!("tether-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(
            &file,
            "listen = \"1.1.1.1:1\"\ngrace = \"9m\"\ntimeout = 7\njoin-token = \"abc.def\"\n",
        )
        .unwrap();
        std::env::set_var("TETHER_TEST_CFG_GRACE", "8m");
        let argv = os(&[
            "demo",
            "--config",
            file.to_str().unwrap(),
            "--listen",
            "2.2.2.2:2",
        ]);
        apply_config_file(&Demo::command(), &argv).unwrap();
        let m = Demo::command().get_matches_from(argv);
        let d = Demo::from_arg_matches(&m).unwrap();
        assert_eq!(d.listen, "2.2.2.2:2", "flag beats file");
        assert_eq!(d.grace, "8m", "env beats file");
        assert_eq!(d.timeout, "7", "file beats default");
        let shown = render_config(&Demo::command(), &m);
        assert!(shown.contains("listen = \"2.2.2.2:2\"  # flag"), "{shown}");
        assert!(shown.contains("join-token = \"<redacted>\""), "{shown}");
        assert!(!shown.contains("abc.def"), "{shown}");
        assert!(
            shown.contains("token-webhook = \"false\"  # default"),
            "a switch is shown: {shown}"
        );

        std::fs::write(&file, "listne = \"x\"\n").unwrap();
        let err = apply_config_file(
            &Demo::command(),
            &os(&["demo", "--config", file.to_str().unwrap()]),
        )
        .unwrap_err();
        assert!(err.contains("unknown setting \"listne\""), "{err}");
        std::fs::write(&file, "print-config = true\n").unwrap();
        let err = apply_config_file(
            &Demo::command(),
            &os(&["demo", "--config", file.to_str().unwrap()]),
        )
        .unwrap_err();
        assert!(err.contains("cannot be set from a file"), "{err}");
        std::fs::write(&file, "listen = [\n").unwrap();
        assert!(apply_config_file(
            &Demo::command(),
            &os(&["demo", "--config", file.to_str().unwrap()])
        )
        .is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
