//! The soak's short variant (issue "Hardening"): 100 exec sessions through one edge
//! for 2 minutes with a 40 s and a 5 s total outage (the first outlasts the QUIC idle
//! timeout, so the session is resumed over a new connection). `tether-bench --soak`
//! exits non-zero unless every session survives with every byte echoed exactly once
//! and both agents' RSS at the end is within 10 % of the reading after the first
//! minute. The full soak is `scripts/soak.sh` (1,000 sessions, 10 minutes).
//!
//! Needs root (network namespaces) and the workspace binaries next to this test's.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn short_soak_loses_no_session_and_no_byte() {
    let out = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether-bench"))
        .args(["--soak", "2", "--sessions", "100", "--out"])
        .arg(out.path())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning tether-bench --soak");
    let limit = Duration::from_secs(420);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for tether-bench") {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tether-bench --soak ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let md = std::fs::read_to_string(out.path().join("results-soak.md")).unwrap_or_default();
    println!("{md}");
    assert!(status.success(), "the soak failed: {status}\n{md}");
    assert!(md.contains("| 100 | 0 |"), "no session may be lost:\n{md}");
}
