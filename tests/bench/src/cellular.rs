//! Scenario 7, cellular data: bytes on the wire per idle edge per day.
//!
//! Every tunnel is configured to hold a NAT binding of [`NAT_BINDING`] (its
//! keep-alive 5 s below it: ssh's `ServerAliveInterval`, rathole's heartbeat and
//! TCP keep-alive, `tether-edge --keep-alive`), connected, and left idle for a
//! window. nftables counters in the edge's namespace count every packet that
//! crosses the edge's link for each tunnel's transport (by port: Tether's QUIC
//! UDP 10004, ssh TCP 2222, rathole TCP 2333), both directions, IP and UDP/TCP
//! headers included (nft counts the IP packet). The figure is scaled to a day.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use linkemu::Impairment;

use crate::bed::{Bed, BedOptions, TETHER};
use crate::table::{Cell, Table};
use crate::Report;

/// The NAT binding every tunnel is configured to hold.
pub const NAT_BINDING: Duration = Duration::from_secs(30);

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

/// Runs the scenario: idle for `window` after the tunnels are up, then scales
/// each tunnel's bytes to a day.
pub async fn run(r: &mut Report, window: Duration) -> Result<()> {
    let bed = Bed::start(
        Impairment::clean(),
        BedOptions {
            nat_binding: Some(NAT_BINDING),
            ..BedOptions::default()
        },
    )
    .await?;
    let ns = bed.link.edge_ns().to_string();
    install(&ns)?;
    // Settle: the set-up's requests (routability checks) are done.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut before = Vec::new();
    for i in 0..FLOWS.len() {
        before.push((
            read(&ns, &format!("up{i}"))?,
            read(&ns, &format!("down{i}"))?,
        ));
    }
    tokio::time::sleep(window).await;
    let day = 86_400.0 / window.as_secs_f64();
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
        let up = read(&ns, &format!("up{i}"))?;
        let down = read(&ns, &format!("down{i}"))?;
        let (bu, bd) = (before[i].0, before[i].1);
        let up_b = up.1.saturating_sub(bu.1) as f64 * day;
        let down_b = down.1.saturating_sub(bd.1) as f64 * day;
        let pkts = (up.0.saturating_sub(bu.0) + down.0.saturating_sub(bd.0)) as f64 * day;
        t.row(
            peer,
            vec![
                Cell::Num(up_b / 1024.0),
                Cell::Num(down_b / 1024.0),
                Cell::Num((up_b + down_b) / 1024.0),
                Cell::Num(pkts),
            ],
        );
    }
    r.push(&format!(
        "\n### Cellular data: bytes on the wire per idle edge per day (NAT binding {} s)\n\n\
         Each tunnel connected and idle for {} s, its keep-alive set to hold a {} s NAT binding \
         (ssh ServerAliveInterval, rathole heartbeat and TCP keep-alive, tether-edge --keep-alive: {} s); \
         nftables counters on the edge's link, both directions, IP and UDP/TCP headers included, scaled to a day.\n\n",
        NAT_BINDING.as_secs(),
        window.as_secs(),
        NAT_BINDING.as_secs(),
        crate::bed::keepalive_for(NAT_BINDING).as_secs()
    ));
    r.push(&t.render());
    Ok(())
}
