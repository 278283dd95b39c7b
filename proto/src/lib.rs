//! # tether-proto — Tether's wire protocol
//!
//! Everything the cloud and the edge must agree on, and nothing that does I/O
//! except the thin adapters in [`io`] and [`quic`]:
//!
//! - [`frame`]: the one frame type that travels on every QUIC stream, its
//!   length-delimited postcard encoding and the hard size limit on decoding.
//! - [`handshake`]: the control stream's messages (edge hello, cloud welcome,
//!   pod reports, go-away) and the protocol version.
//! - [`head`]: the HTTP request head the cloud sends at the start of a logical
//!   stream and the response head the edge answers with.
//! - [`route`]: which kubelet API paths Tether forwards, and how a path names
//!   its pod; shared so that the edge refuses exactly what the cloud refuses.
//! - [`stream`]: the sans-IO state of one *resumable* logical stream: offsets
//!   written, sent, acknowledged, received and delivered; the replay buffer;
//!   what to transmit next and what to replay after a re-attach.
//! - [`token`]: resume tokens and session ids.
//! - [`ticket`]: resume tickets any replica can verify (shared key, node, generation, expiry).
//! - [`limits`]: every bound, with its default.
//! - [`units`]: parsing durations and sizes in configuration (re-exported
//!   from `tether-units`, which `tether-certs` shares).
//! - [`copies`]: datagram copies of small interactive writes (a lost
//!   keystroke does not wait for QUIC's loss detection).
//! - [`io`]: the tokio adapter that makes a [`stream::StreamState`] an
//!   `AsyncRead + AsyncWrite` and drives it over a QUIC stream.
//! - [`quic`]: QUIC transport settings both binaries share.
//! - [`tls`]: the TLS crypto provider every configuration uses (AES-128-GCM first).
//! - `testing` (tests, feature `test-util`): a loopback QUIC pair.
//! - [`cli`]: flag groups both binaries share (limits, QUIC tuning, logging).
//! - [`ops`]: the operations listener both binaries serve (`/metrics`,
//!   `/healthz`, `/readyz`, `/status`).

pub mod cli;
pub mod copies;
pub mod frame;
pub mod handshake;
pub mod head;
pub mod io;
pub mod limits;
pub mod ops;
pub mod pump;
pub mod quic;
pub mod route;
pub mod stream;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod ticket;
pub mod tls;
pub mod token;
pub mod units;

pub use frame::{Frame, FrameError, StreamId};
pub use limits::Limits;
