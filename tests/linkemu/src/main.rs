//! The `linkemu` command: the same operations as the library, for shells,
//! benchmarks and debugging, plus the hidden `route` subcommand that is the
//! router process itself (started by `linkemu up` and by `Link::create`).
//!
//! ```text
//! linkemu up --tag demo --delay 50ms --loss 1      # create; router runs in background
//! linkemu set --tag demo --dir up --rate 10mbit    # change only what is named
//! linkemu set --tag demo --outage on
//! linkemu exec --tag demo edge -- ping -c 3 10.231.1.1
//! linkemu change-address --tag demo
//! linkemu edge-link --tag demo down                # the edge sees its interface go
//! linkemu stats --tag demo
//! linkemu down --tag demo
//! linkemu cleanup            # remove leftovers of dead routers (--all: every link)
//! ```

use std::ffi::OsString;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};

use linkemu::cleanup;
use linkemu::impairment::{self, Direction, Impairment, ImpairmentPatch};
use linkemu::link::{read_line_bounded, router_pid_of};
use linkemu::naming;
use linkemu::netns;
use linkemu::router::{self, RouterConfig};
use linkemu::Control;

#[derive(Parser)]
#[command(
    name = "linkemu",
    about = "Emulated cloud <-> edge link between two network namespaces (delay, jitter, loss, rate, outage, address change)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a link; its router keeps running in the background until
    /// `down`, `cleanup --all` or its time-to-live.
    Up {
        /// Tag (names `<tag>-cloud`, `<tag>-edge`); default `te<pid>-0`.
        #[arg(long)]
        tag: Option<String>,
        /// Tear the link down by itself after this long.
        #[arg(long, default_value = "1h", value_parser = impairment::parse_duration)]
        ttl: Duration,
        /// Put a source NAT in the edge namespace from the start.
        #[arg(long)]
        nat: bool,
        /// Seed for loss and jitter.
        #[arg(long)]
        seed: Option<u64>,
        /// MTU of the link.
        #[arg(long, default_value_t = 1500)]
        mtu: u32,
        /// Run the router at normal priority instead of SCHED_FIFO.
        #[arg(long)]
        no_realtime: bool,
        #[command(flatten)]
        imp: ImpArgs,
    },
    /// Change the impairment of a running link (only the options given).
    Set {
        /// The link's tag.
        #[arg(long)]
        tag: String,
        /// Which direction: up (edge→cloud), down (cloud→edge) or both.
        #[arg(long, default_value = "both")]
        dir: Direction,
        #[command(flatten)]
        imp: ImpArgs,
    },
    /// Print counters and configuration as JSON.
    Stats {
        /// The link's tag.
        #[arg(long)]
        tag: String,
        /// Zero the counters after printing them.
        #[arg(long)]
        reset: bool,
    },
    /// Print the link's description as JSON.
    Info {
        /// The link's tag.
        #[arg(long)]
        tag: String,
    },
    /// Give the edge a new address (next one, or --to).
    ChangeAddress {
        /// The link's tag.
        #[arg(long)]
        tag: String,
        /// The new address (10.231.2.2-254).
        #[arg(long)]
        to: Option<Ipv4Addr>,
    },
    /// Take the edge's interface down or bring it back up.
    EdgeLink {
        /// The link's tag.
        #[arg(long)]
        tag: String,
        /// up or down.
        state: LinkState,
    },
    /// NAT rebinding: every edge flow gets a new source port.
    RebindNat {
        /// The link's tag.
        #[arg(long)]
        tag: String,
    },
    /// Run a command in the cloud or edge namespace.
    Exec {
        /// The link's tag.
        #[arg(long)]
        tag: String,
        /// Which side.
        side: Side,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<OsString>,
    },
    /// Tear a link down.
    Down {
        /// The link's tag.
        #[arg(long)]
        tag: String,
    },
    /// Remove leftovers of links whose router is gone.
    Cleanup {
        /// Also stop links whose router is running.
        #[arg(long)]
        all: bool,
    },
    /// List links.
    List,
    /// The router process (internal; use `up` or the library).
    #[command(hide = true)]
    Route {
        #[arg(long)]
        tag: String,
        #[arg(long)]
        parent_pid: Option<i32>,
        #[arg(long, value_parser = impairment::parse_duration)]
        ttl: Duration,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 1500)]
        mtu: u32,
        #[arg(long)]
        nat: bool,
        /// With --nat: idle NAT bindings expire after this.
        #[arg(long, value_parser = impairment::parse_duration)]
        nat_binding: Option<Duration>,
        #[arg(long)]
        no_realtime: bool,
        /// Impairment edge → cloud, as JSON.
        #[arg(long, default_value = "{}")]
        up: String,
        /// Impairment cloud → edge, as JSON.
        #[arg(long, default_value = "{}")]
        down: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LinkState {
    Up,
    Down,
}

#[derive(Clone, Copy, ValueEnum)]
enum Side {
    Cloud,
    Edge,
}

/// Impairment options; each one given changes that field only.
#[derive(Args)]
struct ImpArgs {
    /// One-way delay, e.g. 50ms.
    #[arg(long, value_parser = impairment::parse_duration)]
    delay: Option<Duration>,
    /// Jitter: delay varies within ± this.
    #[arg(long, value_parser = impairment::parse_duration)]
    jitter: Option<Duration>,
    /// Random loss in percent.
    #[arg(long)]
    loss: Option<f64>,
    /// Rate limit: 10mbit, 500kbps, bytes/s, or off.
    #[arg(long, value_parser = impairment::parse_rate)]
    rate: Option<Option<u64>>,
    /// Rate limiter queue bound: 64k, 1m, bytes (0 = default 64k).
    #[arg(long, value_parser = impairment::parse_bytes)]
    queue: Option<u64>,
    /// Total outage on/off.
    #[arg(long, value_parser = impairment::parse_switch)]
    outage: Option<bool>,
    /// Allow jitter to reorder packets on/off.
    #[arg(long, value_parser = impairment::parse_switch)]
    reorder: Option<bool>,
}

impl ImpArgs {
    fn patch(&self) -> ImpairmentPatch {
        ImpairmentPatch {
            delay: self.delay,
            jitter: self.jitter,
            loss: self.loss,
            rate: self.rate.map(|r| r.unwrap_or(0)),
            queue: self.queue,
            outage: self.outage,
            reorder: self.reorder,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("linkemu: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Route {
            tag,
            parent_pid,
            ttl,
            seed,
            mtu,
            nat,
            nat_binding,
            no_realtime,
            up,
            down,
        } => {
            let cfg = RouterConfig {
                tag,
                parent_pid,
                ttl,
                seed,
                up: serde_json::from_str(&up).context("--up")?,
                down: serde_json::from_str(&down).context("--down")?,
                nat,
                nat_binding,
                mtu,
                realtime: !no_realtime,
            };
            let stdout = std::io::stdout();
            let mut out = stdout.lock();
            router::run(cfg, &mut out)
        }
        Cmd::Up {
            tag,
            ttl,
            nat,
            seed,
            mtu,
            no_realtime,
            imp,
        } => up(tag, ttl, nat, seed, mtu, no_realtime, &imp),
        Cmd::Set { tag, dir, imp } => {
            let patch = imp.patch();
            if patch == ImpairmentPatch::default() {
                bail!("nothing to set: give --delay, --jitter, --loss, --rate, --queue, --outage or --reorder");
            }
            Control::for_tag(&tag).set(dir, patch)?;
            let stats = Control::for_tag(&tag).stats()?;
            println!("up:   {}", stats.up_config);
            println!("down: {}", stats.down_config);
            Ok(())
        }
        Cmd::Stats { tag, reset } => {
            let ctl = Control::for_tag(&tag);
            let stats = ctl.stats()?;
            println!("{}", serde_json::to_string_pretty(&stats)?);
            if reset {
                ctl.reset_stats()?;
            }
            Ok(())
        }
        Cmd::Info { tag } => {
            let info = Control::for_tag(&tag).info()?;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(())
        }
        Cmd::ChangeAddress { tag, to } => {
            let new = Control::for_tag(&tag).change_edge_address(to)?;
            println!("{new}");
            Ok(())
        }
        Cmd::EdgeLink { tag, state } => {
            let up = matches!(state, LinkState::Up);
            Control::for_tag(&tag).edge_link(up)?;
            println!("edge interface {}", if up { "up" } else { "down" });
            Ok(())
        }
        Cmd::RebindNat { tag } => {
            let (lo, hi) = Control::for_tag(&tag).rebind_nat()?;
            println!("edge flows now leave from ports {lo}-{hi}");
            Ok(())
        }
        Cmd::Exec { tag, side, command } => {
            naming::validate_tag(&tag)?;
            let ns = match side {
                Side::Cloud => naming::cloud_ns(&tag),
                Side::Edge => naming::edge_ns(&tag),
            };
            if !netns::exists(&ns) {
                bail!("namespace {ns} does not exist (is link {tag} up?)");
            }
            let Some((program, args)) = command.split_first() else {
                bail!("no command given");
            };
            let err = netns::command_in(&ns, program).args(args).exec();
            Err(err).context("exec ip netns exec")
        }
        Cmd::Down { tag } => down(&tag),
        Cmd::Cleanup { all } => {
            let report = cleanup::cleanup(all);
            for tag in &report.removed {
                println!("removed {tag}");
            }
            for tag in &report.skipped_live {
                println!("left {tag} (router running; use --all)");
            }
            for e in &report.errors {
                eprintln!("error: {e}");
            }
            if report.errors.is_empty() {
                Ok(())
            } else {
                bail!("{} error(s) during cleanup", report.errors.len())
            }
        }
        Cmd::List => {
            for s in cleanup::list() {
                println!(
                    "{}\trouter={}\t{}\tnamespaces={}",
                    s.tag,
                    s.router_pid
                        .map(|p| p.to_string())
                        .unwrap_or_else(|| "-".into()),
                    if s.alive { "live" } else { "dead" },
                    s.namespaces.join(",")
                );
            }
            Ok(())
        }
    }
}

/// Start a detached router (own process group, no parent watch) and print
/// the link's description once it is ready.
fn up(
    tag: Option<String>,
    ttl: Duration,
    nat: bool,
    seed: Option<u64>,
    mtu: u32,
    no_realtime: bool,
    imp: &ImpArgs,
) -> anyhow::Result<()> {
    router::preflight()?;
    let tag = tag.unwrap_or_else(naming::default_tag);
    naming::validate_tag(&tag)?;
    let mut initial = Impairment::clean();
    initial.apply(&imp.patch());
    initial.validate()?;
    let json = serde_json::to_string(&initial)?;
    let exe = std::env::current_exe().context("locating linkemu")?;
    let mut cmd = Command::new(exe);
    cmd.arg("route")
        .arg("--tag")
        .arg(&tag)
        .arg("--ttl")
        .arg(format!("{}ms", ttl.as_millis()))
        .arg("--seed")
        .arg(
            seed.unwrap_or_else(|| u64::from(std::process::id()))
                .to_string(),
        )
        .arg("--mtu")
        .arg(mtu.to_string())
        .arg("--up")
        .arg(&json)
        .arg("--down")
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0);
    if nat {
        cmd.arg("--nat");
    }
    if no_realtime {
        cmd.arg("--no-realtime");
    }
    let mut child = cmd.spawn().context("starting router")?;
    let line = match child.stdout.as_mut() {
        Some(out) => read_line_bounded(out, Duration::from_secs(15))?,
        None => bail!("router stdout not captured"),
    };
    if let Some(json) = line.strip_prefix("ready ") {
        let info: linkemu::Info = serde_json::from_str(json.trim())?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string_pretty(&info)?)?;
        writeln!(
            out,
            "# linkemu exec --tag {tag} edge -- ping -c 3 {}",
            info.cloud_ip
        )?;
        writeln!(out, "# linkemu down --tag {tag}")?;
        return Ok(());
    }
    let _ = child.wait();
    match line.strip_prefix("error ") {
        Some(msg) => bail!("{}", msg.trim()),
        None => bail!("router exited without reporting ready"),
    }
}

/// Ask the router to stop and wait (10 s at most) until it has; remove what
/// is left if it could not.
fn down(tag: &str) -> anyhow::Result<()> {
    naming::validate_tag(tag)?;
    if !naming::state_dir(tag).exists()
        && !netns::exists(&naming::cloud_ns(tag))
        && !netns::exists(&naming::edge_ns(tag))
    {
        bail!("no link with tag {tag}");
    }
    let pid = router_pid_of(tag);
    let asked = Control::for_tag(tag)
        .with_timeout(Duration::from_secs(3))
        .shutdown();
    if let (Ok(()), Some(pid)) = (&asked, pid) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while cleanup::router_alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if let Some(pid) = pid {
        if cleanup::router_alive(pid) {
            bail!("router {pid} of {tag} did not stop; try `linkemu cleanup --all`");
        }
    }
    router::teardown_tag(tag)?;
    if let Err(e) = asked {
        eprintln!("note: router was not answering ({e:#}); removed leftovers");
    }
    println!("{tag} down");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
