//! Scenario 7, cellular data: bytes on the wire per idle edge per day, behind
//! a NAT that drops idle bindings.
//!
//! The link's edge side sits behind a NAT whose UDP and TCP bindings expire
//! after [`NAT_BINDINGS`] (30 s, a common carrier value, and 120 s, the
//! RFC 4787 minimum). ssh's `ServerAliveInterval` and rathole's heartbeat and
//! TCP keep-alive are configured 5 s below the binding (they cannot learn
//! it); tether-edge runs with its defaults: its adaptive keep-alive learns the
//! binding from the rebindings the cloud reports and settles below it. The
//! scenario waits for it to settle (printing how long that took and how many
//! rebindings it cost), then leaves every tunnel idle for a window. nftables
//! counters in the edge's namespace count every packet that crosses the edge's
//! link for each tunnel's transport (by port: Tether's QUIC UDP 10004, ssh TCP
//! 2222, rathole TCP 2333), both directions, IP and UDP/TCP headers included
//! (nft counts the IP packet). The figure is scaled to a day. For comparison,
//! the same is measured for tether-edge with the fixed 10 s keep-alive it had
//! before (`--keep-alive-min 10s --keep-alive-max 10s`).
//!
//! Then the price of a binding that expired anyway (a failed probe, a NAT
//! that got stricter): the NAT drops every binding at once
//! ([`linkemu::Link::rebind_nat`]) and a request arrives through Tether right
//! away; it waits for the edge's next keep-alive to open a new binding, then
//! about an RTT (the cloud's nudge after a migration, cloud/src/tunnel.rs).
//! Its delay is printed with that bound.
//!
//! Last, [`mtu_searches`] (`--only mtu`): on a path that drops packets above
//! 1,400 bytes without a word, every path-MTU search loses its probes; what
//! that adds to an idle edge's day at quinn's interval and at Tether's.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use linkemu::Impairment;

use crate::bed::{Bed, BedOptions, TETHER};
use crate::table::{Cell, Table};
use crate::Report;

/// The NAT bindings measured.
pub const NAT_BINDINGS: [Duration; 2] = [Duration::from_secs(30), Duration::from_secs(120)];

/// How long tether-edge may take to settle its keep-alive (at 120 s with the
/// default bounds it takes about 8 minutes: 20, 40, 80, 110 s, each twice).
const SETTLE_LIMIT: Duration = Duration::from_secs(20 * 60);

/// (peer, protocol, port of the cloud end).
const FLOWS: [(&str, &str, u16); 3] = [
    (TETHER, "udp", tether_tests::netns::TUNNEL_PORT),
    ("ssh -R", "tcp", 2222),
    ("rathole", "tcp", 2333),
];

const TABLE: &str = "tether_bench_cellular";

fn nft(ns: &str, script: &str) -> Result<String> {
    use std::io::Write;
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running nft (scripts/setup.sh installs nftables)")?;
    child
        .stdin
        .take()
        .context("nft stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("nft failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Installs one counter per flow and direction in the edge namespace.
fn install(ns: &str) -> Result<()> {
    let mut rules = String::new();
    for i in 0..FLOWS.len() {
        rules.push_str(&format!("  counter up{i} {{}}\n  counter down{i} {{}}\n"));
    }
    let mut out_rules = String::new();
    let mut in_rules = String::new();
    for (i, (_, proto, port)) in FLOWS.iter().enumerate() {
        out_rules.push_str(&format!(
            "    oifname \"tl0\" {proto} dport {port} counter name up{i}\n"
        ));
        in_rules.push_str(&format!(
            "    iifname \"tl0\" {proto} sport {port} counter name down{i}\n"
        ));
    }
    nft(
        ns,
        &format!(
            "table inet {TABLE} {{\n{rules}  chain out {{\n    type filter hook output priority 0; policy accept;\n{out_rules}  }}\n  chain in {{\n    type filter hook input priority 0; policy accept;\n{in_rules}  }}\n}}\n"
        ),
    )?;
    Ok(())
}

/// (packets, bytes) of a named counter.
fn read(ns: &str, name: &str) -> Result<(u64, u64)> {
    let out = std::process::Command::new("ip")
        .args([
            "netns", "exec", ns, "nft", "list", "counter", "inet", TABLE, name,
        ])
        .output()
        .context("reading an nft counter")?;
    if !out.status.success() {
        bail!(
            "nft list counter {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |key: &str| -> Result<u64> {
        let rest = text
            .split(key)
            .nth(1)
            .with_context(|| format!("no {key} in {text}"))?;
        rest.split_whitespace()
            .next()
            .context("empty counter")?
            .parse()
            .context("counter value")
    };
    Ok((field("packets ")?, field("bytes ")?))
}

/// One flow's counters: ((packets, bytes) up, (packets, bytes) down).
type Reading = ((u64, u64), (u64, u64));

/// Counter readings of every flow.
fn snapshot(ns: &str) -> Result<Vec<Reading>> {
    let mut v = Vec::new();
    for i in 0..FLOWS.len() {
        v.push((read(ns, &format!("up{i}"))?, read(ns, &format!("down{i}"))?));
    }
    Ok(v)
}

/// (up bytes/day, down bytes/day, packets/day) of flow `i` between two snapshots.
fn per_day(before: &[Reading], after: &[Reading], i: usize, window: Duration) -> (f64, f64, f64) {
    let day = 86_400.0 / window.as_secs_f64();
    let ((bu, bd), (au, ad)) = (before[i], after[i]);
    (
        au.1.saturating_sub(bu.1) as f64 * day,
        ad.1.saturating_sub(bd.1) as f64 * day,
        (au.0.saturating_sub(bu.0) + ad.0.saturating_sub(bd.0)) as f64 * day,
    )
}

fn kib_cells((up, down, pkts): (f64, f64, f64)) -> Vec<Cell> {
    vec![
        Cell::Num(up / 1024.0),
        Cell::Num(down / 1024.0),
        Cell::Num((up + down) / 1024.0),
        Cell::Num(pkts),
    ]
}

/// Runs the scenario for every binding in [`NAT_BINDINGS`]; `quick` (the
/// harness check CI runs): the 30 s binding only, not waiting for the
/// keep-alive to settle (minutes) and one stream-open trial — the figures are
/// then those of the learning phase, and say so.
pub async fn run(r: &mut Report, window: Duration, quick: bool) -> Result<()> {
    let bindings: &[Duration] = if quick {
        &NAT_BINDINGS[..1]
    } else {
        &NAT_BINDINGS
    };
    for &b in bindings {
        run_binding(r, b, window, quick)
            .await
            .with_context(|| format!("NAT binding {} s", b.as_secs()))?;
    }
    Ok(())
}

/// One binding: settle, idle window, the fixed-keep-alive comparison, the
/// stream-open delay after an expiry.
async fn run_binding(
    r: &mut Report,
    binding: Duration,
    window: Duration,
    quick: bool,
) -> Result<()> {
    let mut bed = Bed::start(
        Impairment::clean(),
        BedOptions {
            nat_binding: Some(binding),
            ..BedOptions::default()
        },
    )
    .await?;
    let ns = bed.link.edge_ns().to_string();
    install(&ns)?;
    let started = std::time::Instant::now();
    let settled = if quick {
        "interval=(learning:quick-run) rebindings=?".to_string()
    } else {
        bed.edge
            .wait_line("tether-edge keep-alive settled", SETTLE_LIMIT, |l| {
                l.starts_with("tether-edge keep-alive settled")
            })
            .await?
    };
    let settle_time = started.elapsed();
    let field = |k: &str| -> String {
        settled
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or("?")
            .to_string()
    };
    let (interval, rebindings) = (field("interval="), field("rebindings="));
    let learning = snapshot(&ns)?;
    // Settle: the set-up's requests (routability checks) are done.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = snapshot(&ns)?;
    tokio::time::sleep(window).await;
    let after = snapshot(&ns)?;
    let _ = learning;
    let mut t = Table::new(
        &[
            "peer",
            "up KiB/day",
            "down KiB/day",
            "total KiB/day",
            "packets/day",
        ],
        0,
    );
    for (i, (peer, _, _)) in FLOWS.iter().enumerate() {
        if !bed.peers.iter().any(|p| p.name == *peer && p.dial.is_ok()) {
            t.row(peer, vec![Cell::text("n/a"); 4]);
            continue;
        }
        t.row(peer, kib_cells(per_day(&before, &after, i, window)));
    }
    let tether = &bed
        .peers
        .iter()
        .find(|p| p.name == TETHER)
        .context("tether peer")?;
    let dial = tether.dial.clone().map_err(anyhow::Error::msg)?;

    // The stream-open delay when the binding had expired: every binding
    // dropped at once, a request right away (a few times, at random points
    // of the keep-alive cycle).
    let trials = if binding <= Duration::from_secs(30) && !quick {
        3
    } else {
        1
    };
    let mut delays = Vec::new();
    for i in 0..trials {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(rand_ms(7_000))).await;
        }
        bed.link
            .rebind_nat()
            .context("dropping the NAT's bindings")?;
        let t0 = std::time::Instant::now();
        let s = tokio::time::timeout(
            Duration::from_secs(300),
            crate::measure::get(&dial, "/containerLogs/default/bulk/c?limitBytes=1"),
        )
        .await;
        match s {
            Ok(Ok(200)) => delays.push(t0.elapsed()),
            other => anyhow::bail!("request after the NAT dropped the binding: {other:?}"),
        }
    }
    drop(bed);

    // The keep-alive Tether had before: fixed at 10 s.
    let fixed_window = window.min(Duration::from_secs(120));
    let fixed = Bed::start(
        Impairment::clean(),
        BedOptions {
            nat_binding: Some(binding),
            tether_only: true,
            edge_args: vec![
                "--keep-alive-min".into(),
                "10s".into(),
                "--keep-alive-max".into(),
                "10s".into(),
            ],
            ..BedOptions::default()
        },
    )
    .await?;
    let fns = fixed.link.edge_ns().to_string();
    install(&fns)?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let fb = snapshot(&fns)?;
    tokio::time::sleep(fixed_window).await;
    let fa = snapshot(&fns)?;
    drop(fixed);
    let today = per_day(&fb, &fa, 0, fixed_window);
    t.row("tether, fixed 10 s keep-alive (before)", kib_cells(today));
    r.push(&format!(
        "\n### Cellular data: bytes on the wire per idle edge per day (NAT binding {b} s)\n\n\
         The edge behind a NAT that drops bindings idle for {b} s (UDP and TCP). ssh ServerAliveInterval, \
         rathole heartbeat and TCP keep-alive: {k} s (configured for the binding); tether-edge: default \
         settings, its adaptive keep-alive settled at {interval} after {settle:.0} s and {rebindings} \
         rebinding(s) (the learning's cost, not in the figures). Each tunnel then idle for {w} s; \
         nftables counters on the edge's link, both directions, IP and UDP/TCP headers included, scaled \
         to a day. The fixed-10 s row: a separate run of {fw} s.\n\n",
        b = binding.as_secs(),
        k = crate::bed::keepalive_for(binding).as_secs(),
        settle = settle_time.as_secs_f64(),
        w = window.as_secs(),
        fw = fixed_window.as_secs(),
    ));
    r.push(&t.render());
    let list: Vec<String> = delays
        .iter()
        .map(|d| format!("{:.1}", d.as_secs_f64()))
        .collect();
    let max = delays.iter().max().copied().unwrap_or_default();
    r.push(&format!(
        "\nStream open after the NAT dropped the binding (binding {b} s, keep-alive {interval}): {} s \
         (max {:.1} s). Bound: the edge's next keep-alive (at most its interval) opens a new binding; \
         the cloud notices the new address from its first packet (about 50 ms later; at the latest \
         at its next --migration-sweep-interval, 5 s) and sends a frame whose acknowledgement \
         makes QUIC resend the stream's first packet at once (an RTT).\n",
        list.join(", "),
        max.as_secs_f64(),
        b = binding.as_secs(),
    ));
    Ok(())
}

/// A random number of milliseconds below `n` (from the clock; no rand crate needed).
fn rand_ms(n: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    u64::from(nanos) % n.max(1)
}

/// The black hole of [`mtu_searches`]: a path of 1,400 bytes inside the
/// network, which quinn's search (1,200 to 1,452 bytes) overshoots.
const BLACK_HOLE_MTU: u32 = 1400;

/// quinn's own interval between searches of one path (RFC 8899's
/// PMTU_RAISE_TIMER): what Tether had before `--mtu-research-interval`.
const QUINN_RESEARCH: Duration = Duration::from_secs(600);

/// The searches' interval in the measurement: short, to see several.
const MEASURED_RESEARCH: Duration = Duration::from_secs(15);

/// Bursts of growth in a sampled counter: a rise after `quiet` without one
/// starts a new burst.
#[derive(Default)]
struct Bursts {
    last: u64,
    last_rise: Option<std::time::Instant>,
    count: u64,
}

impl Bursts {
    fn sample(&mut self, value: u64, quiet: Duration) {
        if value > self.last {
            let now = std::time::Instant::now();
            if self.last_rise.is_none_or(|t| now - t >= quiet) {
                self.count += 1;
            }
            self.last_rise = Some(now);
            self.last = value;
        }
    }
}

/// What path-MTU searches cost an idle edge on a path that drops packets
/// above 1,400 bytes without a word: the probes each search loses, measured
/// over several searches at a short interval, and that cost scaled to a day
/// at quinn's 10-minute interval (before) and at Tether's default.
pub async fn mtu_searches(r: &mut Report, quick: bool) -> Result<()> {
    let window = if quick {
        Duration::from_secs(35)
    } else {
        Duration::from_secs(95)
    };
    let flags = vec![
        "--mtu-research-interval".to_string(),
        format!("{}s", MEASURED_RESEARCH.as_secs()),
    ];
    let mut edge_args = flags.clone();
    // A due search starts when the connection next sends: a keep-alive
    // every 2 s keeps the searches on time.
    for a in [
        "--keep-alive",
        "2s",
        "--keep-alive-min",
        "2s",
        "--keep-alive-max",
        "2s",
    ] {
        edge_args.push(a.to_string());
    }
    let bed = Bed::start(
        Impairment::clean(),
        BedOptions {
            tether_only: true,
            path_mtu: Some(BLACK_HOLE_MTU),
            cloud_args: flags,
            edge_args,
            ..BedOptions::default()
        },
    )
    .await?;
    let hole = bed.black_hole.as_ref().context("the bed's black hole")?;
    // The first search (right after the handshake) is over once the drops
    // stop for a while.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut first = hole.dropped()?;
    let mut since = std::time::Instant::now();
    while since.elapsed() < Duration::from_secs(5) {
        if std::time::Instant::now() > deadline {
            bail!("the first path-MTU search never ended: {first:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = hole.dropped()?;
        if now != first {
            first = now;
            since = std::time::Instant::now();
        }
    }
    let (mut up, mut down) = (Bursts::default(), Bursts::default());
    up.last = first.up.0;
    down.last = first.down.0;
    let started = std::time::Instant::now();
    let mut after = first;
    while started.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = hole.dropped()?;
        up.sample(after.up.0, Duration::from_secs(3));
        down.sample(after.down.0, Duration::from_secs(3));
    }
    drop(bed);
    if up.count == 0 || down.count == 0 {
        bail!(
            "no search of the path in {window:?} at a {MEASURED_RESEARCH:?} interval \
             (dropped after the first {first:?}, at the end {after:?})"
        );
    }
    // Bytes a search loses, per end (the edge's probes going up, the cloud's down).
    let per = |a: (u64, u64), b: (u64, u64), n: u64| {
        ((a.0 - b.0) as f64 / n as f64, (a.1 - b.1) as f64 / n as f64)
    };
    let (up_pkts, up_bytes) = per(after.up, first.up, up.count);
    let (down_pkts, down_bytes) = per(after.down, first.down, down.count);
    let day =
        |interval: Duration| (up_bytes + down_bytes) * 86_400.0 / interval.as_secs_f64() / 1024.0;
    let default = tether_proto::quic::DEFAULT_MTU_RESEARCH;
    let mut t = Table::new(&["figure", "value"], 1);
    t.row(
        "first search, probes lost: edge / cloud (packets)",
        vec![Cell::text(format!("{} / {}", first.up.0, first.down.0))],
    );
    t.row(
        "first search, bytes lost: edge / cloud",
        vec![Cell::text(format!("{} / {}", first.up.1, first.down.1))],
    );
    t.row(
        &format!("searches again in {} s: edge / cloud", window.as_secs()),
        vec![Cell::text(format!("{} / {}", up.count, down.count))],
    );
    t.row(
        "each, probes lost: edge / cloud (packets)",
        vec![Cell::text(format!("{up_pkts:.1} / {down_pkts:.1}"))],
    );
    t.row(
        "each, bytes lost, both ends (KiB)",
        vec![Cell::Num((up_bytes + down_bytes) / 1024.0)],
    );
    t.row(
        &format!(
            "per idle edge per day, searching every {} min (quinn's default, before) (KiB)",
            QUINN_RESEARCH.as_secs() / 60
        ),
        vec![Cell::Num(day(QUINN_RESEARCH))],
    );
    t.row(
        &format!(
            "per idle edge per day, searching every {} h (Tether's default) (KiB)",
            default.as_secs() / 3600
        ),
        vec![Cell::Num(day(default))],
    );
    r.push(&format!(
        "\n### Cellular data: path-MTU searches on a path that drops packets above {BLACK_HOLE_MTU} bytes\n\n\
         Inside the network, silently (no ICMP), as a carrier's tunnel may; Tether only. Both ends search \
         the path's MTU after the handshake (1,200 to 1,452 bytes) and again after \
         `--mtu-research-interval`; every probe above the hole is lost. Measured: the probes dropped \
         (nftables, where they arrive) in the first search and in the searches of a {w} s window with \
         the interval at {m} s on both ends (edge keep-alive 2 s: a due search starts at the next \
         packet). The per-day rows scale the bytes each search lost to a day at each interval (the \
         figure the cellular tables would show on such a path, on top of theirs).\n\n",
        w = window.as_secs(),
        m = MEASURED_RESEARCH.as_secs(),
    ));
    r.push(&t.render());
    Ok(())
}
