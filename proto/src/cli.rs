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
    #[arg(long, env = "TETHER_REPLAY_BUFFER_BYTES", default_value = "1MiB", value_parser = parse_bytes_u32)]
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
    /// Keep-alive interval; keep it below carrier NAT UDP timeouts (often 30 s).
    #[arg(long, env = "TETHER_KEEP_ALIVE", default_value = "10s", value_parser = parse_duration)]
    pub keep_alive: Duration,
    /// A connection silent this long is dead (its streams then wait for a resume).
    #[arg(long, env = "TETHER_IDLE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// RTT assumed before the first sample (cellular: a few hundred ms).
    #[arg(long, env = "TETHER_INITIAL_RTT", default_value = "300ms", value_parser = parse_duration)]
    pub initial_rtt: Duration,
    /// UDP socket buffer size.
    #[arg(long, env = "TETHER_UDP_BUFFER", default_value = "4MiB", value_parser = parse_bytes)]
    pub udp_buffer: u64,
}

impl QuicArgs {
    /// The QUIC settings, with stream limits taken from `limits`.
    pub fn settings(&self, limits: &Limits) -> Result<QuicSettings, String> {
        let s = QuicSettings {
            keep_alive: self.keep_alive,
            idle_timeout: self.idle_timeout,
            initial_rtt: self.initial_rtt,
            // One control stream plus the logical streams.
            max_bidi_streams: limits.max_streams_per_edge.saturating_add(1),
            udp_buffer: usize::try_from(self.udp_buffer)
                .map_err(|_| "udp-buffer too large".to_string())?,
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
    /// Log filter (tracing `EnvFilter` syntax), e.g. `info,tether_cloud=debug`.
    #[arg(long, env = "TETHER_LOG", default_value = "info")]
    pub log: String,
}

impl LogArgs {
    /// Installs the global tracing subscriber (logs go to stderr).
    pub fn init(&self) -> Result<(), String> {
        let filter = tracing_subscriber::EnvFilter::try_new(&self.log)
            .map_err(|e| format!("--log {:?}: {e}", self.log))?;
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let r = if self.log_format == "json" {
            builder.json().try_init()
        } else {
            builder.try_init()
        };
        r.map_err(|e| format!("installing the logger: {e}"))
    }
}
