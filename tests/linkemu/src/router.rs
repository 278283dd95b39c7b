//! The router process (`linkemu route`): builds a link, forwards its packets
//! through two [`Shaper`]s, obeys the control socket, and tears everything
//! down when it stops.
//!
//! Lifecycle, all in [`run`]:
//! 1. claim the tag (create the state directory atomically; a taken tag is
//!    reported as [`TAG_IN_USE`] so the library can pick another);
//! 2. create `<tag>-cloud` and `<tag>-edge`, a TUN device in each (opened from
//!    a thread that entered the namespace), addresses and default routes, and
//!    optionally the edge's source NAT;
//! 3. print one line on stdout — `ready <Info JSON>` or `error <message>` —
//!    the only thing ever written there;
//! 4. run the I/O loop until a `shutdown` request, SIGTERM/SIGINT/SIGHUP, the
//!    time-to-live running out, or the parent process dying (its pid is
//!    polled every 100 ms: `PR_SET_PDEATHSIG` fires when the parent *thread*
//!    exits, which in a test harness is any test thread, so it is not used);
//! 5. tear down: close the TUNs, SIGKILL every process left in the two
//!    namespaces, delete them, remove the state directory.
//!
//! The I/O loop is a single thread around `ppoll(2)` on the two TUN files and
//! a wake-up pipe, with a timeout equal to the next packet's due time (capped
//! at 100 ms so the parent, TTL and stop checks stay prompt). Control requests
//! are served by a second thread: impairment changes and counter reads go to
//! the loop over a channel (the loop owns the shapers), while address changes
//! and NAT rebinds run `ip`/`nft` (and a conntrack flush) on the control thread so that
//! packet forwarding never waits for a subprocess.

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::control::{Info, Request, Response, Stats, MAX_LINE};
use crate::impairment::{Direction, Impairment, ImpairmentPatch};
use crate::naming::{self, CLOUD_IP, EDGE_IP, TUN_NAME};
use crate::netns;
use crate::shaper::Shaper;
use crate::tun;

/// Marker in the `error` ready line when the tag is taken.
pub const TAG_IN_USE: &str = "tag-in-use";

/// How often the parent's liveness is checked, and the longest `ppoll` wait.
const TICK: Duration = Duration::from_millis(100);

/// Packets read from one TUN per wake-up before the other side gets a turn.
const READ_BATCH: usize = 256;

/// Name of the nftables table of the edge's source NAT.
const NAT_TABLE: &str = "linkemu_nat";

/// Everything a router needs to build and run one link.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// The link's tag (see [`crate::naming`]).
    pub tag: String,
    /// Exit (and tear down) when this process is no longer our parent.
    pub parent_pid: Option<i32>,
    /// Exit (and tear down) after this long, whatever happens.
    pub ttl: Duration,
    /// Seed for loss and jitter.
    pub seed: u64,
    /// Initial impairment edge → cloud.
    pub up: Impairment,
    /// Initial impairment cloud → edge.
    pub down: Impairment,
    /// Install the edge's source NAT from the start.
    pub nat: bool,
    /// With `nat`: idle bindings expire after this (see
    /// [`crate::LinkOptions::nat_binding`]).
    pub nat_binding: Option<Duration>,
    /// MTU of both TUN devices.
    pub mtu: u32,
    /// Run the forwarding thread at real-time priority (`SCHED_FIFO` 10)
    /// so that a loaded machine does not add its scheduling delays to the
    /// emulated ones; like netem, which runs in softirq context.
    pub realtime: bool,
}

/// Set by the signal handler; checked by the loop and the control thread.
static STOP: AtomicBool = AtomicBool::new(false);
/// Write end of the wake-up pipe, for the signal handler (-1 when unset).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(_sig: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
    wake(WAKE_FD.load(Ordering::SeqCst));
}

/// Nudge the loop out of `ppoll` (async-signal-safe: a bare `write`).
fn wake(fd: i32) {
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: writing one byte from a valid buffer; errors (pipe full)
        // are fine because the loop only needs one pending byte.
        unsafe {
            libc::write(fd, &b as *const u8 as *const libc::c_void, 1);
        }
    }
}

fn install_signal_handlers() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: the handler only touches atomics and calls write(2).
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

/// Why the loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopReason {
    Requested,
    Signal,
    Ttl,
    ParentGone,
}

/// Work the control thread hands to the loop, which owns the shapers.
enum LoopCmd {
    Set(Direction, ImpairmentPatch, SyncSender<Result<(), String>>),
    Stats(SyncSender<Stats>),
    ResetStats(SyncSender<()>),
    Shutdown,
}

/// State owned by the control thread (the edge's address and NAT).
struct EdgeState {
    ip: Ipv4Addr,
    address_changes: u32,
    nat_generation: u32,
    link_up: bool,
}

/// What the control thread shares with the loop.
struct Shared {
    info: Mutex<Info>,
    edge: Mutex<EdgeState>,
    /// Write end of the wake-up pipe; owned here so that it stays open as
    /// long as any thread may write to it.
    wake: OwnedFd,
    started: Instant,
}

/// Tracks what this router created, so a failed setup removes exactly that
/// and never a namespace that belongs to someone else.
struct Created {
    tag: String,
    dir: bool,
    namespaces: Vec<String>,
}

impl Created {
    fn teardown(&mut self) -> anyhow::Result<()> {
        let mut errors = Vec::new();
        for ns in self.namespaces.drain(..).rev() {
            let left = netns::kill_all_in(&ns, Duration::from_secs(3));
            if !left.is_empty() {
                errors.push(format!("processes {left:?} survived SIGKILL in {ns}"));
            }
            if let Err(e) = netns::delete(&ns) {
                errors.push(format!("{e:#}"));
            }
        }
        if self.dir {
            self.dir = false;
            match std::fs::remove_dir_all(naming::state_dir(&self.tag)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => errors.push(format!("removing state dir: {e}")),
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("teardown of {}: {}", self.tag, errors.join("; "))
        }
    }
}

/// Tear down whatever exists of link `tag`, by name: kill processes in its
/// namespaces, delete them, remove the state directory. Idempotent. Used by
/// the library when a router could not do it itself, and by `cleanup`.
pub fn teardown_tag(tag: &str) -> anyhow::Result<()> {
    naming::validate_tag(tag)?;
    Created {
        tag: tag.to_string(),
        dir: naming::state_dir(tag).exists(),
        namespaces: [naming::cloud_ns(tag), naming::edge_ns(tag)]
            .into_iter()
            .filter(|ns| netns::exists(ns))
            .collect(),
    }
    .teardown()
}

/// Check that this process can build links: root, `ip`, `/dev/net/tun`.
pub fn preflight() -> anyhow::Result<()> {
    if !netns::is_root() {
        bail!("linkemu needs root (network namespaces, TUN devices); run as root");
    }
    let ip_ok = Command::new("ip")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ip_ok {
        bail!("linkemu needs the `ip` command: apt-get install iproute2");
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        bail!("linkemu needs /dev/net/tun (TUN support)");
    }
    Ok(())
}

/// Build the link described by `cfg`, report on `ready`, serve until told to
/// stop, tear down. Returns an error if setup or teardown failed.
pub fn run(cfg: RouterConfig, ready: &mut dyn Write) -> anyhow::Result<()> {
    let mut created = Created {
        tag: cfg.tag.clone(),
        dir: false,
        namespaces: Vec::new(),
    };
    let mut sent_ready = false;
    let outcome = run_inner(&cfg, &mut created, ready, &mut sent_ready);
    let torn = created.teardown();
    if let Err(e) = &outcome {
        if !sent_ready {
            // Best effort: the reader may be gone already.
            let _ = writeln!(ready, "error {e:#}");
            let _ = ready.flush();
        }
    }
    outcome.and(torn)
}

fn run_inner(
    cfg: &RouterConfig,
    created: &mut Created,
    ready: &mut dyn Write,
    sent_ready: &mut bool,
) -> anyhow::Result<()> {
    naming::validate_tag(&cfg.tag)?;
    cfg.up.validate().context("up impairment")?;
    cfg.down.validate().context("down impairment")?;
    preflight()?;
    claim(cfg, created)?;

    // Signals and the wake-up pipe exist before anything can block.
    let (wake_rd, wake_wr) = pipe()?;
    WAKE_FD.store(wake_wr.as_raw_fd(), Ordering::SeqCst);
    install_signal_handlers();
    // SAFETY: prctl with an integer argument; 1 µs timer slack makes ppoll
    // wake close to the packets' due times.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0);
    }

    let cloud_ns = naming::cloud_ns(&cfg.tag);
    let edge_ns = naming::edge_ns(&cfg.tag);
    let cloud_tun = build_side(cfg, &cloud_ns, CLOUD_IP, created)?;
    let edge_tun = build_side(cfg, &edge_ns, EDGE_IP, created)?;
    if cfg.nat {
        install_nat(&edge_ns, 1)?;
        if let Some(b) = cfg.nat_binding {
            set_binding_timeout(&edge_ns, b)?;
        }
    }

    let ctl = naming::ctl_path(&cfg.tag);
    let listener =
        UnixListener::bind(&ctl).with_context(|| format!("binding {}", ctl.display()))?;
    let info = Info {
        tag: cfg.tag.clone(),
        cloud_ns,
        edge_ns,
        cloud_ip: CLOUD_IP,
        edge_ip: EDGE_IP,
        tun: TUN_NAME.to_string(),
        router_pid: std::process::id(),
        ctl,
    };
    write_info(&info)?;
    let shared = Arc::new(Shared {
        info: Mutex::new(info.clone()),
        edge: Mutex::new(EdgeState {
            ip: EDGE_IP,
            address_changes: 0,
            nat_generation: u32::from(cfg.nat),
            link_up: true,
        }),
        wake: wake_wr,
        started: Instant::now(),
    });
    let (tx, rx) = mpsc::channel();
    {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("linkemu-control".into())
            .spawn(move || control_thread(listener, tx, shared))
            .context("spawning control thread")?;
    }

    writeln!(ready, "ready {}", serde_json::to_string(&info)?)?;
    ready.flush()?;
    *sent_ready = true;

    let reason = forward(cfg, [edge_tun, cloud_tun], wake_rd, rx, &shared)?;
    if reason != StopReason::Requested {
        eprintln!("linkemu[{}]: stopping: {reason:?}", cfg.tag);
    }
    // The signal handler must not write to the pipe once `shared` may be
    // the last owner of it.
    WAKE_FD.store(-1, Ordering::SeqCst);
    drop(shared);
    Ok(())
}

/// Claim the tag: create its state directory (atomic) and check that its
/// namespaces do not exist yet.
fn claim(cfg: &RouterConfig, created: &mut Created) -> anyhow::Result<()> {
    let root = naming::state_root();
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let dir = naming::state_dir(&cfg.tag);
    match std::fs::create_dir(&dir) {
        Ok(()) => created.dir = true,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            bail!("{TAG_IN_USE}: {} exists", dir.display())
        }
        Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
    }
    std::fs::write(
        naming::pid_path(&cfg.tag),
        format!("{}\n", std::process::id()),
    )
    .context("writing pid file")?;
    for ns in [naming::cloud_ns(&cfg.tag), naming::edge_ns(&cfg.tag)] {
        if netns::exists(&ns) {
            bail!("{TAG_IN_USE}: namespace {ns} exists (leftover? `linkemu cleanup`)");
        }
    }
    Ok(())
}

/// Create one namespace with its TUN device, address and default route.
fn build_side(
    cfg: &RouterConfig,
    ns: &str,
    addr: Ipv4Addr,
    created: &mut Created,
) -> anyhow::Result<File> {
    netns::add(ns)?;
    created.namespaces.push(ns.to_string());
    let tun = netns::run_in(ns, || -> anyhow::Result<File> {
        let file = tun::open(TUN_NAME)?;
        // IPv6 off on the TUN: no router solicitations or MLD reports
        // crossing the link and muddying the counters. /proc/sys/net
        // follows the calling thread's namespace.
        std::fs::write(
            format!("/proc/sys/net/ipv6/conf/{TUN_NAME}/disable_ipv6"),
            "1",
        )
        .context("disabling IPv6 on the TUN")?;
        Ok(file)
    })??;
    let mtu = cfg.mtu.to_string();
    netns::ip(&[
        "-n",
        ns,
        "link",
        "set",
        TUN_NAME,
        "mtu",
        &mtu,
        "txqueuelen",
        "1000",
        "up",
    ])?;
    let cidr = format!("{addr}/32");
    let src = addr.to_string();
    netns::ip(&["-n", ns, "addr", "add", &cidr, "dev", TUN_NAME])?;
    netns::ip(&[
        "-n", ns, "route", "add", "default", "dev", TUN_NAME, "src", &src,
    ])?;
    Ok(tun)
}

fn write_info(info: &Info) -> anyhow::Result<()> {
    let path = naming::info_path(&info.tag);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(info)?)?;
    std::fs::rename(&tmp, &path)?;
    Ok(())
}

fn pipe() -> anyhow::Result<(File, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two fds into the array.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("pipe2");
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    unsafe { Ok((File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

/// The forwarding loop. `tuns[0]` is the edge's TUN (read for `up`, written
/// for `down`), `tuns[1]` the cloud's.
fn forward(
    cfg: &RouterConfig,
    tuns: [File; 2],
    mut wake_rd: File,
    rx: Receiver<LoopCmd>,
    shared: &Shared,
) -> anyhow::Result<StopReason> {
    if cfg.realtime {
        set_realtime(&cfg.tag);
    }
    let start = Instant::now();
    let ttl_deadline = start + cfg.ttl;
    // shapers[0]: up (edge → cloud), shapers[1]: down (cloud → edge).
    let mut shapers = [
        Shaper::new(cfg.up, cfg.seed, start),
        Shaper::new(cfg.down, cfg.seed ^ 0x9e37_79b9_7f4a_7c15, start),
    ];
    let ins = [&tuns[0], &tuns[1]];
    let outs = [&tuns[1], &tuns[0]];
    let mut buf = vec![0u8; 65_536];
    let mut next_parent_check = start;
    loop {
        let now = Instant::now();
        if STOP.load(Ordering::SeqCst) {
            return Ok(StopReason::Signal);
        }
        if now >= ttl_deadline {
            return Ok(StopReason::Ttl);
        }
        if let Some(parent) = cfg.parent_pid {
            if now >= next_parent_check {
                // SAFETY: getppid has no preconditions.
                if unsafe { libc::getppid() } != parent {
                    return Ok(StopReason::ParentGone);
                }
                next_parent_check = now + TICK;
            }
        }
        loop {
            match rx.try_recv() {
                Ok(LoopCmd::Shutdown) => return Ok(StopReason::Requested),
                Ok(cmd) => handle_cmd(cmd, &mut shapers, shared, now),
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => break,
            }
        }
        for (shaper, mut out) in shapers.iter_mut().zip(outs) {
            while let Some(packet) = shaper.poll_release(now) {
                if out.write(&packet).is_err() {
                    shaper.note_write_error();
                }
            }
        }

        let mut wait = TICK.min(ttl_deadline.saturating_duration_since(now));
        for shaper in &shapers {
            if let Some(due) = shaper.next_deadline() {
                wait = wait.min(due.saturating_duration_since(now));
            }
        }
        let mut fds = [poll_fd(ins[0]), poll_fd(ins[1]), poll_fd(&wake_rd)];
        let ts = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        // SAFETY: fds is a valid array of pollfd for the duration of the call.
        let rc = unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            )
        };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(err).context("ppoll");
        }
        if fds[2].revents & libc::POLLIN != 0 {
            let mut sink = [0u8; 64];
            while matches!(wake_rd.read(&mut sink), Ok(n) if n > 0) {}
        }
        let now = Instant::now();
        for (d, (shaper, mut input)) in shapers.iter_mut().zip(ins).enumerate() {
            let revents = fds[d].revents;
            if revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                bail!("TUN device failed (revents {revents:#x})");
            }
            if revents & libc::POLLIN == 0 {
                continue;
            }
            for _ in 0..READ_BATCH {
                match input.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => shaper.ingress(buf[..n].to_vec(), now),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e).context("reading TUN"),
                }
            }
        }
    }
}

/// Move the calling thread (only) to `SCHED_FIFO` priority 10. The loop
/// sleeps in `ppoll` between packets, and the kernel keeps 5 % of each CPU
/// for normal tasks (`sched_rt_runtime_us`), so this cannot lock a machine.
fn set_realtime(tag: &str) {
    let param = libc::sched_param { sched_priority: 10 };
    // SAFETY: sched_setscheduler on the calling thread (pid 0) with a valid
    // sched_param.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc != 0 {
        eprintln!(
            "linkemu[{tag}]: real-time priority unavailable ({}); timing may suffer under load",
            std::io::Error::last_os_error()
        );
    }
}

fn poll_fd(file: &File) -> libc::pollfd {
    libc::pollfd {
        fd: file.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

fn handle_cmd(cmd: LoopCmd, shapers: &mut [Shaper; 2], shared: &Shared, now: Instant) {
    match cmd {
        LoopCmd::Set(dir, patch, reply) => {
            let mut result = Ok(());
            let mut next = [*shapers[0].impairment(), *shapers[1].impairment()];
            for (i, selected) in [dir.has_up(), dir.has_down()].into_iter().enumerate() {
                if selected {
                    next[i].apply(&patch);
                    if let Err(e) = next[i].validate() {
                        result = Err(format!("{e:#}"));
                    }
                }
            }
            if result.is_ok() {
                for (shaper, imp) in shapers.iter_mut().zip(next) {
                    shaper.configure(imp, now);
                }
            }
            let _ = reply.send(result);
        }
        LoopCmd::Stats(reply) => {
            let (edge_ip, address_changes, nat_rebinds, edge_link_up) = match shared.edge.lock() {
                Ok(e) => (Some(e.ip), e.address_changes, e.nat_generation, e.link_up),
                Err(_) => (None, 0, 0, false),
            };
            let _ = reply.send(Stats {
                up: shapers[0].stats(),
                down: shapers[1].stats(),
                up_config: *shapers[0].impairment(),
                down_config: *shapers[1].impairment(),
                edge_ip,
                address_changes,
                nat_rebinds,
                edge_link_up,
                uptime_ms: shared.started.elapsed().as_millis() as u64,
            });
        }
        LoopCmd::ResetStats(reply) => {
            for shaper in shapers.iter_mut() {
                shaper.reset_stats();
            }
            let _ = reply.send(());
        }
        LoopCmd::Shutdown => {}
    }
}

/// Serve control connections, one exchange each, until the process exits.
fn control_thread(listener: UnixListener, tx: Sender<LoopCmd>, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let shutdown = serve_one(stream, &tx, &shared);
        if shutdown {
            return;
        }
    }
}

/// Handle one connection; returns true after a shutdown request.
fn serve_one(stream: UnixStream, tx: &Sender<LoopCmd>, shared: &Shared) -> bool {
    let timeout = Some(Duration::from_secs(5));
    if stream.set_read_timeout(timeout).is_err() || stream.set_write_timeout(timeout).is_err() {
        return false;
    }
    let mut line = String::new();
    let read = match stream.try_clone() {
        Ok(s) => BufReader::new(s.take(MAX_LINE)).read_line(&mut line),
        Err(e) => Err(e),
    };
    let mut shutdown = false;
    let response = match read {
        Err(e) => Response::Error {
            message: format!("reading request: {e}"),
        },
        Ok(_) => match serde_json::from_str::<Request>(line.trim()) {
            Err(e) => Response::Error {
                message: format!("bad request: {e}"),
            },
            Ok(Request::Shutdown) => {
                shutdown = true;
                let _ = tx.send(LoopCmd::Shutdown);
                wake(shared.wake.as_raw_fd());
                Response::Ok
            }
            Ok(req) if STOP.load(Ordering::SeqCst) => Response::Error {
                message: format!("router is shutting down; {req:?} ignored"),
            },
            Ok(req) => dispatch(req, tx, shared).unwrap_or_else(|e| Response::Error {
                message: format!("{e:#}"),
            }),
        },
    };
    if let Ok(mut text) = serde_json::to_string(&response) {
        text.push('\n');
        let mut stream = stream;
        let _ = stream.write_all(text.as_bytes());
    }
    shutdown
}

fn dispatch(req: Request, tx: &Sender<LoopCmd>, shared: &Shared) -> anyhow::Result<Response> {
    let wait = Duration::from_secs(5);
    match req {
        Request::Set { dir, patch } => {
            let (reply, answer) = mpsc::sync_channel(1);
            tx.send(LoopCmd::Set(dir, patch, reply))
                .context("router loop gone")?;
            wake(shared.wake.as_raw_fd());
            match answer
                .recv_timeout(wait)
                .context("router loop did not answer")?
            {
                Ok(()) => Ok(Response::Ok),
                Err(message) => Ok(Response::Error { message }),
            }
        }
        Request::Stats => {
            let (reply, answer) = mpsc::sync_channel(1);
            tx.send(LoopCmd::Stats(reply)).context("router loop gone")?;
            wake(shared.wake.as_raw_fd());
            let stats = answer
                .recv_timeout(wait)
                .context("router loop did not answer")?;
            Ok(Response::Stats(Box::new(stats)))
        }
        Request::ResetStats => {
            let (reply, answer) = mpsc::sync_channel(1);
            tx.send(LoopCmd::ResetStats(reply))
                .context("router loop gone")?;
            wake(shared.wake.as_raw_fd());
            answer
                .recv_timeout(wait)
                .context("router loop did not answer")?;
            Ok(Response::Ok)
        }
        Request::Info => {
            let info = shared
                .info
                .lock()
                .map_err(|_| anyhow::anyhow!("info lock poisoned"))?
                .clone();
            Ok(Response::Info(info))
        }
        Request::ChangeEdgeAddress { to } => change_edge_address(shared, to),
        Request::RebindNat => rebind_nat(shared),
        Request::EdgeLink { up } => set_edge_link(shared, up),
        Request::Shutdown => Ok(Response::Ok),
    }
}

/// Replace the edge's address: add the new one, point the default route's
/// source at it, delete the old one. Sockets bound to 0.0.0.0 keep working
/// and send from the new address; sockets bound to the old one break.
fn change_edge_address(shared: &Shared, to: Option<Ipv4Addr>) -> anyhow::Result<Response> {
    let mut edge = shared
        .edge
        .lock()
        .map_err(|_| anyhow::anyhow!("edge lock poisoned"))?;
    let old = edge.ip;
    let new = to.unwrap_or_else(|| naming::next_edge_ip(old));
    let [a, b, c, d] = new.octets();
    let [ea, eb, ec, _] = EDGE_IP.octets();
    if (a, b, c) != (ea, eb, ec) || !(2..=254).contains(&d) {
        bail!("edge addresses stay within {ea}.{eb}.{ec}.2-254, got {new}");
    }
    if new == old {
        bail!("edge already has address {new}");
    }
    let ns = {
        let info = shared
            .info
            .lock()
            .map_err(|_| anyhow::anyhow!("info lock poisoned"))?;
        info.edge_ns.clone()
    };
    let (new_cidr, old_cidr, src) = (format!("{new}/32"), format!("{old}/32"), new.to_string());
    netns::ip(&["-n", &ns, "addr", "add", &new_cidr, "dev", TUN_NAME])?;
    if edge.link_up {
        // (While the interface is down there is no route; bringing it up
        // adds one from the then-current address.)
        netns::ip(&[
            "-n", &ns, "route", "replace", "default", "dev", TUN_NAME, "src", &src,
        ])?;
    }
    netns::ip(&["-n", &ns, "addr", "del", &old_cidr, "dev", TUN_NAME])?;
    edge.ip = new;
    edge.address_changes += 1;
    if let Ok(mut info) = shared.info.lock() {
        info.edge_ip = new;
        write_info(&info)?;
    }
    Ok(Response::EdgeAddress { old, new })
}

/// Take the edge's TUN down or up. Down removes its routes (the kernel does
/// that), so up restores the default route from the current address.
/// Packets the router delivers to a down interface fail and are counted as
/// `write_errors`.
fn set_edge_link(shared: &Shared, up: bool) -> anyhow::Result<Response> {
    let mut edge = shared
        .edge
        .lock()
        .map_err(|_| anyhow::anyhow!("edge lock poisoned"))?;
    let ns = {
        let info = shared
            .info
            .lock()
            .map_err(|_| anyhow::anyhow!("info lock poisoned"))?;
        info.edge_ns.clone()
    };
    if up {
        let src = edge.ip.to_string();
        netns::ip(&["-n", &ns, "link", "set", TUN_NAME, "up"])?;
        netns::ip(&[
            "-n", &ns, "route", "replace", "default", "dev", TUN_NAME, "src", &src,
        ])?;
    } else {
        netns::ip(&["-n", &ns, "link", "set", TUN_NAME, "down"])?;
    }
    edge.link_up = up;
    Ok(Response::Ok)
}

/// Port range used by NAT generation `gen`: alternating halves of
/// 40000–49999, so consecutive generations never share a port.
fn nat_ports(gen: u32) -> (u16, u16) {
    if gen % 2 == 1 {
        (40_000, 44_999)
    } else {
        (45_000, 49_999)
    }
}

/// Install or replace (atomically, one nft transaction) the edge's source
/// NAT: every TCP/UDP flow leaving the edge is masqueraded to its own
/// address with a random port from the generation's range.
fn install_nat(edge_ns: &str, gen: u32) -> anyhow::Result<()> {
    let (lo, hi) = nat_ports(gen);
    let script = format!(
        "add table ip {NAT_TABLE}\n\
         delete table ip {NAT_TABLE}\n\
         table ip {NAT_TABLE} {{\n\
           chain postrouting {{\n\
             type nat hook postrouting priority srcnat; policy accept;\n\
             oifname \"{TUN_NAME}\" meta l4proto {{ tcp, udp }} masquerade to :{lo}-{hi} random\n\
           }}\n\
         }}\n"
    );
    let mut child = netns::command_in(edge_ns, "nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft (apt-get install nftables)")?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The NAT's binding timeout: connection tracking's timeouts are per network
/// namespace, so the edge namespace's UDP (unreplied and "stream") and TCP
/// established timeouts are set to `timeout`. When a flow's entry expires the
/// next packet creates a new one, and the masquerade picks a new random port:
/// the cloud sees the flow from a new address, as behind a carrier NAT.
fn set_binding_timeout(edge_ns: &str, timeout: Duration) -> anyhow::Result<()> {
    let secs = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
    if secs == 0 {
        bail!("--nat-binding must be at least 1s");
    }
    netns::run_in(edge_ns, move || -> anyhow::Result<()> {
        for name in [
            "nf_conntrack_udp_timeout",
            "nf_conntrack_udp_timeout_stream",
            "nf_conntrack_tcp_timeout_established",
        ] {
            let path = format!("/proc/sys/net/netfilter/{name}");
            std::fs::write(&path, secs.to_string())
                .with_context(|| format!("writing {path} in the edge namespace"))?;
        }
        Ok(())
    })?
}

/// NAT rebinding: switch the NAT to the next port range and flush the edge's
/// connection tracking table, so every flow gets a new mapping (new source
/// port as seen by the cloud) with its next packet.
fn rebind_nat(shared: &Shared) -> anyhow::Result<Response> {
    let mut edge = shared
        .edge
        .lock()
        .map_err(|_| anyhow::anyhow!("edge lock poisoned"))?;
    let ns = {
        let info = shared
            .info
            .lock()
            .map_err(|_| anyhow::anyhow!("info lock poisoned"))?;
        info.edge_ns.clone()
    };
    let gen = edge.nat_generation + 1;
    install_nat(&ns, gen)?;
    netns::run_in(&ns, crate::conntrack::flush_ipv4)??;
    edge.nat_generation = gen;
    let (port_low, port_high) = nat_ports(gen);
    Ok(Response::NatRebound {
        generation: gen,
        port_low,
        port_high,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nat_generations_alternate() {
        let (a, b) = (nat_ports(1), nat_ports(2));
        assert!(a.1 < b.0 || b.1 < a.0);
        assert_eq!(nat_ports(3), a);
    }
}
