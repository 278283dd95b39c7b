//! The library API: [`Link::create`] builds an emulated link for a test and
//! dropping the [`Link`] removes it.
//!
//! A `Link` owns one router child process (`linkemu route`, see
//! [`crate::router`]) and talks to it over its control socket. The router is
//! a separate process rather than a thread of the test so that it can clean up
//! after the test whatever happens to the test: if the test process is
//! SIGKILLed (a CI timeout, `panic = "abort"`, `process::exit`), the router
//! notices its parent is gone within 100 ms, kills every process left in the
//! link's namespaces (the cloud and edge binaries the test started there) and
//! deletes the namespaces. It also keeps the forwarding loop out of the test's
//! own threads and runtimes, and is the same code `linkemu up` runs for
//! interactive use and benchmarks.
//!
//! The router binary is found by [`find_router_bin`]: an explicit path in
//! [`LinkOptions::router_bin`], `$LINKEMU_BIN`, a `linkemu` next to the running
//! executable or one directory up (where cargo puts it relative to test
//! binaries in `target/*/deps/`), then `$PATH`.

use std::ffi::OsStr;
use std::io::{ErrorKind, Read};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};

use crate::control::{Control, Info, Stats};
use crate::impairment::{Direction, Impairment, ImpairmentPatch};
use crate::naming;
use crate::netns;
use crate::router::{self, TAG_IN_USE};

/// How a [`Link`] is built.
#[derive(Clone, Debug)]
pub struct LinkOptions {
    /// Tag to use; `None` picks a fresh default tag (retrying if taken).
    pub tag: Option<String>,
    /// Path of the `linkemu` binary; `None` searches (see [`find_router_bin`]).
    pub router_bin: Option<PathBuf>,
    /// Initial impairment edge → cloud.
    pub up: Impairment,
    /// Initial impairment cloud → edge.
    pub down: Impairment,
    /// Put a source NAT in the edge namespace from the start (needed for
    /// [`Link::rebind_nat`] to be a pure port change).
    pub nat: bool,
    /// With [`LinkOptions::nat`]: drop a NAT binding (UDP, and TCP
    /// established) idle for longer than this, as a carrier NAT does; the
    /// flow's next packet then gets a new public port. `None`: the kernel's
    /// defaults (UDP 30 s / 120 s once replied, TCP 5 days).
    pub nat_binding: Option<Duration>,
    /// Seed for loss and jitter; `None` picks one from the clock.
    pub seed: Option<u64>,
    /// The router tears the link down by itself after this long.
    pub ttl: Duration,
    /// MTU of the link.
    pub mtu: u32,
    /// Run the router's forwarding thread at real-time priority (default on;
    /// see [`crate::router::RouterConfig::realtime`]).
    pub realtime: bool,
    /// How long to wait for the router to report ready.
    pub startup_timeout: Duration,
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions {
            tag: None,
            router_bin: None,
            up: Impairment::clean(),
            down: Impairment::clean(),
            nat: false,
            nat_binding: None,
            seed: None,
            ttl: Duration::from_secs(30 * 60),
            mtu: 1500,
            realtime: true,
            startup_timeout: Duration::from_secs(15),
        }
    }
}

impl LinkOptions {
    /// Options for a clean link.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same impairment in both directions.
    pub fn with_impairment(mut self, imp: Impairment) -> Self {
        self.up = imp;
        self.down = imp;
        self
    }

    /// Use this router binary.
    pub fn with_router_bin(mut self, path: impl Into<PathBuf>) -> Self {
        self.router_bin = Some(path.into());
        self
    }

    /// Use this tag.
    pub fn with_tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = Some(tag.into());
        self
    }

    /// Install the edge's NAT from the start.
    pub fn with_nat(mut self, nat: bool) -> Self {
        self.nat = nat;
        self
    }

    /// A NAT (see [`LinkOptions::with_nat`]) whose idle bindings expire
    /// after `timeout` (whole seconds, rounded up).
    pub fn with_nat_binding(mut self, timeout: Duration) -> Self {
        self.nat = true;
        self.nat_binding = Some(timeout);
        self
    }

    /// Fix the random seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

/// An emulated link between a cloud namespace and an edge namespace.
/// Dropping it tears everything down (see [`Link::shutdown`]).
pub struct Link {
    info: Info,
    edge_ip: Mutex<Ipv4Addr>,
    ctl: Control,
    child: Mutex<Option<Child>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("info", &self.info).finish()
    }
}

impl Link {
    /// Build a link: start the router, wait until it reports ready.
    ///
    /// Fails with a clear message when not root, `ip` is missing, or the
    /// router binary cannot be found.
    pub fn create(opts: LinkOptions) -> anyhow::Result<Link> {
        router::preflight()?;
        opts.up.validate().context("up impairment")?;
        opts.down.validate().context("down impairment")?;
        let bin = find_router_bin(opts.router_bin.as_deref())?;
        let attempts = if opts.tag.is_some() { 1 } else { 8 };
        let mut last_err = None;
        for _ in 0..attempts {
            let tag = opts.tag.clone().unwrap_or_else(naming::default_tag);
            naming::validate_tag(&tag)?;
            match start_router(&bin, &tag, &opts) {
                Ok(link) => return Ok(link),
                Err(e) if format!("{e:#}").contains(TAG_IN_USE) => last_err = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("no free tag")))
    }

    /// The link's tag.
    pub fn tag(&self) -> &str {
        &self.info.tag
    }

    /// Everything about the link, as the router reported it at start.
    pub fn info(&self) -> &Info {
        &self.info
    }

    /// The cloud's network namespace (for `ip netns exec`).
    pub fn cloud_ns(&self) -> &str {
        &self.info.cloud_ns
    }

    /// The edge's network namespace.
    pub fn edge_ns(&self) -> &str {
        &self.info.edge_ns
    }

    /// The cloud's address.
    pub fn cloud_ip(&self) -> Ipv4Addr {
        self.info.cloud_ip
    }

    /// The edge's current address.
    pub fn edge_ip(&self) -> Ipv4Addr {
        match self.edge_ip.lock() {
            Ok(ip) => *ip,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// The control client of this link's router.
    pub fn control(&self) -> &Control {
        &self.ctl
    }

    /// Set the same impairment in both directions (every field replaced).
    pub fn set(&self, imp: Impairment) -> anyhow::Result<()> {
        self.set_dir(Direction::Both, imp)
    }

    /// Set the impairment of one direction (every field replaced).
    pub fn set_dir(&self, dir: Direction, imp: Impairment) -> anyhow::Result<()> {
        imp.validate()?;
        self.ctl.set(dir, ImpairmentPatch::from(imp))
    }

    /// Change only the fields `patch` names.
    pub fn patch(&self, dir: Direction, patch: ImpairmentPatch) -> anyhow::Result<()> {
        self.ctl.set(dir, patch)
    }

    /// Start (`true`) or end (`false`) a total outage in both directions,
    /// leaving the other settings alone.
    pub fn outage(&self, on: bool) -> anyhow::Result<()> {
        self.patch(
            Direction::Both,
            ImpairmentPatch {
                outage: Some(on),
                ..Default::default()
            },
        )
    }

    /// Take the edge's interface down (`false`) or back up (`true`, with its
    /// default route restored): unlike [`Link::outage`], the edge sees it
    /// (netlink link and route events, `ENETUNREACH` on send).
    pub fn edge_link(&self, up: bool) -> anyhow::Result<()> {
        self.ctl.edge_link(up)
    }

    /// Give the edge its next address (`10.231.2.2` → `.3` → …): add the new
    /// one, switch the default route's source, delete the old one. Returns
    /// the new address.
    pub fn change_edge_address(&self) -> anyhow::Result<Ipv4Addr> {
        self.change_edge_address_to(None)
    }

    /// Like [`Link::change_edge_address`] with a chosen address (within
    /// `10.231.2.2-254`).
    pub fn change_edge_address_to(&self, to: Option<Ipv4Addr>) -> anyhow::Result<Ipv4Addr> {
        let new = self.ctl.change_edge_address(to)?;
        match self.edge_ip.lock() {
            Ok(mut ip) => *ip = new,
            Err(poisoned) => *poisoned.into_inner() = new,
        }
        Ok(new)
    }

    /// NAT rebinding: every flow from the edge gets a new source port as seen
    /// by the cloud (the first call installs the NAT if
    /// [`LinkOptions::nat`] was off). Returns the new port range. Needs `nft`.
    pub fn rebind_nat(&self) -> anyhow::Result<(u16, u16)> {
        self.ctl.rebind_nat()
    }

    /// Counters and configuration.
    pub fn stats(&self) -> anyhow::Result<Stats> {
        self.ctl.stats()
    }

    /// Zero the counters.
    pub fn reset_stats(&self) -> anyhow::Result<()> {
        self.ctl.reset_stats()
    }

    /// A command running `program` in the cloud namespace
    /// (`ip netns exec <tag>-cloud program`); add arguments and spawn it.
    pub fn exec_in_cloud(&self, program: impl AsRef<OsStr>) -> Command {
        netns::command_in(&self.info.cloud_ns, program)
    }

    /// A command running `program` in the edge namespace.
    pub fn exec_in_edge(&self, program: impl AsRef<OsStr>) -> Command {
        netns::command_in(&self.info.edge_ns, program)
    }

    /// Run `f` on a thread inside the cloud namespace; sockets it creates stay
    /// there (e.g. `link.in_cloud(|| UdpSocket::bind("0.0.0.0:7000"))`).
    pub fn in_cloud<F, T>(&self, f: F) -> anyhow::Result<T>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        netns::run_in(&self.info.cloud_ns, f)
    }

    /// Run `f` on a thread inside the edge namespace.
    pub fn in_edge<F, T>(&self, f: F) -> anyhow::Result<T>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        netns::run_in(&self.info.edge_ns, f)
    }

    /// Tear the link down now and report problems (dropping does the same
    /// and prints them). The router is asked to stop; if it does not within
    /// 10 s it is killed and the namespaces are removed from here. Processes
    /// still running in the namespaces are SIGKILLed.
    pub fn shutdown(self) -> anyhow::Result<()> {
        self.close()
    }

    fn close(&self) -> anyhow::Result<()> {
        let child = match self.child.lock() {
            Ok(mut c) => c.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        let Some(mut child) = child else {
            return Ok(());
        };
        // The router may already be gone (e.g. `linkemu down`); then the
        // request fails and we fall through to the checks below.
        let _ = self
            .ctl
            .clone()
            .with_timeout(Duration::from_secs(3))
            .shutdown();
        let exited = wait_bounded(&mut child, Duration::from_secs(10));
        if !exited {
            let _ = child.kill();
            let _ = child.wait();
        }
        let tag = &self.info.tag;
        let leftover = netns::exists(&self.info.cloud_ns)
            || netns::exists(&self.info.edge_ns)
            || naming::state_dir(tag).exists();
        if leftover {
            router::teardown_tag(tag)?;
        }
        if !exited {
            bail!("router of {tag} did not exit within 10 s; killed it and cleaned up");
        }
        Ok(())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            eprintln!("linkemu: tearing down {}: {e:#}", self.info.tag);
        }
    }
}

/// Wait for a child up to `timeout`; true if it exited.
fn wait_bounded(child: &mut Child, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return true,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => return false,
            Err(_) => return false,
        }
    }
}

fn start_router(bin: &Path, tag: &str, opts: &LinkOptions) -> anyhow::Result<Link> {
    let seed = opts.seed.unwrap_or_else(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        nanos ^ (u64::from(std::process::id()) << 32)
    });
    let mut cmd = Command::new(bin);
    cmd.arg("route")
        .arg("--tag")
        .arg(tag)
        .arg("--parent-pid")
        .arg(std::process::id().to_string())
        .arg("--ttl")
        .arg(format!("{}ms", opts.ttl.as_millis()))
        .arg("--seed")
        .arg(seed.to_string())
        .arg("--mtu")
        .arg(opts.mtu.to_string())
        .arg("--up")
        .arg(serde_json::to_string(&opts.up)?)
        .arg("--down")
        .arg(serde_json::to_string(&opts.down)?)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if opts.nat {
        cmd.arg("--nat");
    }
    if let Some(b) = opts.nat_binding {
        cmd.arg("--nat-binding").arg(format!("{}ms", b.as_millis()));
    }
    if !opts.realtime {
        cmd.arg("--no-realtime");
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting router {}", bin.display()))?;
    let line = match child.stdout.as_mut() {
        Some(out) => read_line_bounded(out, opts.startup_timeout),
        None => Err(anyhow::anyhow!("router stdout not captured")),
    };
    let line = match line {
        Ok(l) => l,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            // It may have claimed the tag before hanging: remove what is ours.
            if router_pid_of(tag) == Some(child.id()) {
                let _ = router::teardown_tag(tag);
            }
            return Err(e.context(format!("router for {tag} did not report ready")));
        }
    };
    if let Some(json) = line.strip_prefix("ready ") {
        let info: Info = serde_json::from_str(json.trim()).context("parsing router info")?;
        return Ok(Link {
            edge_ip: Mutex::new(info.edge_ip),
            ctl: Control::at(info.ctl.clone()),
            info,
            child: Mutex::new(Some(child)),
        });
    }
    let exited = wait_bounded(&mut child, Duration::from_secs(10));
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    match line.strip_prefix("error ") {
        Some(msg) => bail!("router for {tag}: {}", msg.trim()),
        None => bail!(
            "router for {tag} exited without reporting ready ({:?}); see its stderr above",
            line.trim()
        ),
    }
}

/// The pid recorded in the state directory of `tag`, if any.
pub fn router_pid_of(tag: &str) -> Option<u32> {
    std::fs::read_to_string(naming::pid_path(tag))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Read one line from a child's stdout, giving up after `timeout`. Returns
/// what was read (possibly empty) if the child closes its stdout first.
pub fn read_line_bounded(out: &mut ChildStdout, timeout: Duration) -> anyhow::Result<String> {
    let deadline = Instant::now() + timeout;
    let mut data = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(pos) = data.iter().position(|&b| b == b'\n') {
            data.truncate(pos);
            return Ok(String::from_utf8_lossy(&data).into_owned());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("timed out after {timeout:?}");
        }
        let mut pfd = libc::pollfd {
            fd: out.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(err).context("poll");
        }
        if rc == 0 {
            continue;
        }
        match out.read(&mut chunk) {
            Ok(0) => return Ok(String::from_utf8_lossy(&data).into_owned()),
            Ok(n) => data.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("reading router stdout"),
        }
    }
}

/// Find the `linkemu` binary: `explicit`, `$LINKEMU_BIN`, next to the running
/// executable or one directory up, then `$PATH`.
pub fn find_router_bin(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!("router binary {} does not exist", p.display());
    }
    if let Some(p) = std::env::var_os("LINKEMU_BIN") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("LINKEMU_BIN={} does not exist", p.display());
    }
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            candidates.push(dir.join("linkemu"));
            if let Some(up) = dir.parent() {
                candidates.push(up.join("linkemu"));
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("linkemu")));
    }
    candidates.into_iter().find(|p| p.is_file()).context(
        "cannot find the `linkemu` router binary: build it (`cargo build -p linkemu`), \
             or set LINKEMU_BIN or LinkOptions::router_bin",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_can_be_shared_across_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Link>();
    }

    #[test]
    fn explicit_router_bin_must_exist() {
        let err =
            find_router_bin(Some(Path::new("/nonexistent/linkemu"))).expect_err("missing binary");
        assert!(format!("{err:#}").contains("does not exist"));
    }
}
