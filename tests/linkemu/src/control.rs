//! The control protocol between a router and its clients (the library's
//! [`crate::Link`] and the `linkemu` CLI).
//!
//! Transport: the Unix stream socket `<state dir>/ctl.sock` (see
//! [`crate::naming::ctl_path`]). Pathname Unix sockets are not bound to a
//! network namespace, so any process on the host can reach any router by tag.
//! Each connection carries one exchange: one JSON [`Request`] line in, one
//! JSON [`Response`] line out. Both directions have timeouts, so a wedged
//! router makes a client fail instead of hang.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::impairment::{Direction, Impairment, ImpairmentPatch};
use crate::naming;
use crate::shaper::DirStats;

/// Largest request or response line accepted.
pub const MAX_LINE: u64 = 1024 * 1024;

/// A request to a router.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    /// Change the impairment of one or both directions.
    Set {
        /// Which direction(s).
        dir: Direction,
        /// Fields to change.
        patch: ImpairmentPatch,
    },
    /// Read the counters and the configuration.
    Stats,
    /// Zero the counters.
    ResetStats,
    /// Give the edge a new address (`to`, or the next free one).
    ChangeEdgeAddress {
        /// The new address; `None` picks [`naming::next_edge_ip`].
        to: Option<Ipv4Addr>,
    },
    /// Install (first call) or change (later calls) the edge's source NAT so
    /// that the cloud sees a new source port for every flow.
    RebindNat,
    /// Take the edge's interface down (`up: false`) or bring it back up,
    /// restoring its default route: what a modem losing and regaining its
    /// bearer looks like to the edge (netlink link events, routes gone).
    EdgeLink {
        /// The new state.
        up: bool,
    },
    /// Describe the link.
    Info,
    /// Tear the link down and exit.
    Shutdown,
}

/// A router's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    /// Done.
    Ok,
    /// Failed, with the reason.
    Error {
        /// What went wrong.
        message: String,
    },
    /// Answer to [`Request::Stats`].
    Stats(Box<Stats>),
    /// Answer to [`Request::Info`].
    Info(Info),
    /// Answer to [`Request::ChangeEdgeAddress`].
    EdgeAddress {
        /// The address given up.
        old: Ipv4Addr,
        /// The address now in use.
        new: Ipv4Addr,
    },
    /// Answer to [`Request::RebindNat`].
    NatRebound {
        /// How many rebinds so far (1 after the first call).
        generation: u32,
        /// First port of the range new mappings now use.
        port_low: u16,
        /// Last port of that range.
        port_high: u16,
    },
}

/// Counters and configuration of a link.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    /// Edge → cloud.
    pub up: DirStats,
    /// Cloud → edge.
    pub down: DirStats,
    /// Impairment of edge → cloud.
    pub up_config: Impairment,
    /// Impairment of cloud → edge.
    pub down_config: Impairment,
    /// The edge's current address.
    pub edge_ip: Option<Ipv4Addr>,
    /// Address changes done.
    pub address_changes: u32,
    /// NAT rebinds done (the NAT's generation; 0 = no NAT).
    pub nat_rebinds: u32,
    /// Whether the edge's interface is up.
    pub edge_link_up: bool,
    /// Milliseconds since the router started.
    pub uptime_ms: u64,
}

/// What a link is made of: everything a client needs to use it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Info {
    /// The link's tag.
    pub tag: String,
    /// The cloud's network namespace.
    pub cloud_ns: String,
    /// The edge's network namespace.
    pub edge_ns: String,
    /// The cloud's address.
    pub cloud_ip: Ipv4Addr,
    /// The edge's current address.
    pub edge_ip: Ipv4Addr,
    /// The TUN device's name in both namespaces.
    pub tun: String,
    /// The router's process id.
    pub router_pid: u32,
    /// The control socket.
    pub ctl: PathBuf,
}

/// A client of one router's control socket.
#[derive(Clone, Debug)]
pub struct Control {
    path: PathBuf,
    timeout: Duration,
}

impl Control {
    /// The client of the router of `tag`.
    pub fn for_tag(tag: &str) -> Self {
        Control::at(naming::ctl_path(tag))
    }

    /// The client of the socket at `path`.
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Control {
            path: path.into(),
            timeout: Duration::from_secs(10),
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Change the per-call timeout (default 10 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Send one request and read the response. A [`Response::Error`] from the
    /// router is returned as `Ok`; see [`Control::expect_ok`] for the rest.
    pub fn call(&self, req: &Request) -> anyhow::Result<Response> {
        let mut stream = UnixStream::connect(&self.path).with_context(|| {
            format!(
                "connecting to router control socket {} (is the link up?)",
                self.path.display()
            )
        })?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        let mut line = serde_json::to_vec(req)?;
        line.push(b'\n');
        stream.write_all(&line)?;
        let mut reader = BufReader::new(stream.take(MAX_LINE));
        let mut buf = String::new();
        reader
            .read_line(&mut buf)
            .context("reading router response")?;
        if buf.trim().is_empty() {
            bail!("router closed the control connection without answering");
        }
        serde_json::from_str(buf.trim()).context("parsing router response")
    }

    /// Send a request; turn a [`Response::Error`] into an error.
    pub fn expect_ok(&self, req: &Request) -> anyhow::Result<Response> {
        match self.call(req)? {
            Response::Error { message } => bail!("router: {message}"),
            other => Ok(other),
        }
    }

    /// Change one or both directions.
    pub fn set(&self, dir: Direction, patch: ImpairmentPatch) -> anyhow::Result<()> {
        self.expect_ok(&Request::Set { dir, patch }).map(drop)
    }

    /// Counters and configuration.
    pub fn stats(&self) -> anyhow::Result<Stats> {
        match self.expect_ok(&Request::Stats)? {
            Response::Stats(s) => Ok(*s),
            other => bail!("unexpected response to stats: {other:?}"),
        }
    }

    /// Zero the counters.
    pub fn reset_stats(&self) -> anyhow::Result<()> {
        self.expect_ok(&Request::ResetStats).map(drop)
    }

    /// Description of the link.
    pub fn info(&self) -> anyhow::Result<Info> {
        match self.expect_ok(&Request::Info)? {
            Response::Info(i) => Ok(i),
            other => bail!("unexpected response to info: {other:?}"),
        }
    }

    /// Give the edge a new address; returns it.
    pub fn change_edge_address(&self, to: Option<Ipv4Addr>) -> anyhow::Result<Ipv4Addr> {
        match self.expect_ok(&Request::ChangeEdgeAddress { to })? {
            Response::EdgeAddress { new, .. } => Ok(new),
            other => bail!("unexpected response to change_edge_address: {other:?}"),
        }
    }

    /// Rebind the edge's NAT; returns the new port range.
    pub fn rebind_nat(&self) -> anyhow::Result<(u16, u16)> {
        match self.expect_ok(&Request::RebindNat)? {
            Response::NatRebound {
                port_low,
                port_high,
                ..
            } => Ok((port_low, port_high)),
            other => bail!("unexpected response to rebind_nat: {other:?}"),
        }
    }

    /// Take the edge's interface down or up.
    pub fn edge_link(&self, up: bool) -> anyhow::Result<()> {
        self.expect_ok(&Request::EdgeLink { up }).map(drop)
    }

    /// Ask the router to tear the link down and exit.
    pub fn shutdown(&self) -> anyhow::Result<()> {
        self.expect_ok(&Request::Shutdown).map(drop)
    }
}
