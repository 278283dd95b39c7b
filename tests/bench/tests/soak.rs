//! The soak's short variant (issue "Hardening"): 100 exec sessions through one edge
//! for 2 minutes with a 40 s and a 5 s total outage (the first outlasts the QUIC idle
//! timeout, so the session is resumed over a new connection). `tether-bench --soak`
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
}
