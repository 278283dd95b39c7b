//! # tether-edge — the edge end of the tunnel
//!
//! Read in order:
//! - [`dial`]: connect to the cloud over QUIC with mutual TLS, say hello
//!   (resuming the session with its token when it has one), report pods,
//!   accept the streams the cloud opens, and reconnect with capped
//!   exponential backoff and jitter when the connection dies;
//! - [`backoff`]: the reconnect schedule (sans-IO): how long to wait before
//!   the next round of attempts, given how the last one ended;
//! - [`streams`]: the logical streams of the edge's session, which survive
//!   reconnections, and how an incoming QUIC stream is attached to one;
//! - [`forward`]: one logical stream → one request replayed against the
//!   kubelet, upgrade-aware;
//! - [`kubelet`]: the one kubelet endpoint the edge may reach (plain HTTP
//!   edged-style or HTTPS with its own client certificate), and its `/pods`;
//! - [`keepalive`]: the adaptive keep-alive (learns the NAT's binding
//!   timeout from the rebindings the cloud reports; sans-IO);
//! - [`join`]: `tether-edge join`: obtain this edge's certificate with a
//!   join token, the cloud's CA pinned by hash, the key made locally;
//! - [`addrs`]: the addresses the edge announces by default;
//! - [`metrics`]: the Prometheus metrics (served by [`tether_proto::ops`]);
//! - [`config`]: the typed configuration `main` parses once;
//! - [`timer`]: exact sleeps (timerfd) for the idle edge's long timers.

pub mod addrs;
pub mod backoff;
pub mod config;
pub mod dial;
pub mod forward;
pub mod join;
pub mod keepalive;
pub mod kubelet;
pub mod metrics;
pub mod streams;
pub mod timer;
