//! The quick benchmark (clean link, small sizes, 5 s outage, one outage cycle per way the
//! link comes back, 30 s of idle cellular data, 100 concurrent sessions,
//! no idle-edge scale) as a test, so CI keeps the harness from rotting. It fails only
//! when the harness breaks — a bed that cannot start, a peer missing, a measurement that
//! errors, a run past its time bound — never on slow figures: benchmarks print, they do
//! not assert speed.
//!
//! Needs root (network namespaces), the workspace binaries next to this test's
//! (`cargo build --workspace --bins`) and every peer: `sshd`/`ssh` and `rathole`
//! (`scripts/setup.sh` installs them, as `scripts/test.sh` does). A missing peer fails
//! the test (`--require-peers`) rather than leaving its part of the harness untried.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn quick_benchmark_runs() {
    let out = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether-bench"))
        .arg("--quick")
        .arg("--require-peers")
        .arg("--out")
        .arg(out.path())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning tether-bench");
    let limit = Duration::from_secs(420);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for tether-bench") {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tether-bench --quick ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.success(), "tether-bench --quick failed: {status}");
    let md = std::fs::read_to_string(out.path().join("results-quick.md")).expect("results");
    for section in [
        "### Link: clean",
        "### Outage",
        "### Outage cycles",
        "### Address change",
        "### Edge footprint",
        "### Cellular data",
        "### Concurrent sessions",
    ] {
        assert!(md.contains(section), "no {section:?} in the results:\n{md}");
    }
    for peer in ["| direct |", "| ssh -R |", "| rathole |", "| tether |"] {
        assert!(md.contains(peer), "no {peer} row:\n{md}");
    }
}
