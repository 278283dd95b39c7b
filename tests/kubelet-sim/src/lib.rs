//! kubelet-sim: a faithful kubelet HTTP API simulator used as a Tether test
//! fixture. It serves the kubelet's routes for configured fake pods with real
//! behaviour — exec/attach run real processes over SPDY/3.1 or WebSocket,
//! port-forward dials real local ports, container logs are real files that
//! can be followed — so that real kubectl works against it through the
//! tunnel. The library target exists so integration tests can reuse the SPDY
//! and WebSocket framing code as a client.

pub mod attach;
pub mod config;
pub mod debug;
pub mod http_util;
pub mod logs;
pub mod metrics;
pub mod nodelogs;
pub mod pods;
pub mod portforward;
pub mod process;
pub mod remotecommand;
pub mod server;
pub mod spdy;
pub mod upgrade;
pub mod websocket;

pub use config::Cli;
pub use server::run;
