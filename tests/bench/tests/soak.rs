//! The soak's short variant (issue "Hardening"): 100 exec sessions through one edge
//! for 2 minutes with a 40 s total outage, the link back clean, and a 35 s one, the
//! link back slow (1 s RTT, 10 % loss) for 15 s, longer until the edge has
//! connected again (up to 60 s), and down again for 2 s 3 s into it. Both
//! outlast the QUIC idle timeout,
//! so every session is resumed over a new connection once on each kind of return;
//! the report says the edge connected again while the link was slow, and the test
//! checks it did (else the hard return was not exercised). `tether-bench --soak`
//! exits non-zero unless every session survives with every byte echoed exactly once
//! and both agents' RSS at the end is within 10 % of the reading after the first
//! minute. The full soak is `scripts/soak.sh` (1,000 sessions, 10 minutes).
//!
//! Needs root (network namespaces) and the workspace binaries next to this test's.

mod common;

use std::time::Duration;

#[test]
fn short_soak_loses_no_session_and_no_byte() {
    let out = tempfile::tempdir().expect("temp dir");
    let status = common::run_bench(
        &["--soak", "2", "--sessions", "100"],
        out.path(),
        Duration::from_secs(420),
    );
    let md = std::fs::read_to_string(out.path().join("results-soak.md")).unwrap_or_default();
    println!("{md}");
    assert!(status.success(), "the soak failed: {status}\n{md}");
    assert!(md.contains("| 100 | 0 |"), "no session may be lost:\n{md}");
    // The resume over the slow link happened while it was slow: the edge
    // connected again in minute 1 (its 35 s outage outlasts the idle timeout).
    let connects = md
        .split("minute 1: ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<u32>().ok());
    assert!(
        matches!(connects, Some(n) if n >= 1),
        "the edge did not connect again while the link was slow (minute 1: {connects:?}):\n{md}"
    );
}
