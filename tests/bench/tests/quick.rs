//! The quick benchmark (clean link, small sizes, 5 s outage, one outage cycle per way the
//! link comes back, 30 s of idle cellular data at one NAT binding without waiting for the
//! keep-alive to settle, 40 s of two edges probing a cloud that does not answer, 100
//! concurrent sessions, the replicas and the rolling restart, no idle-edge scale) as a
//! test, so CI keeps the harness from rotting. It fails only
//! when the harness breaks — a bed that cannot start, a peer missing, a measurement that
//! errors, a run past its time bound — never on slow figures: benchmarks print, they do
//! not assert speed.
//!
//! Needs root (network namespaces), the workspace binaries next to this test's
//! (`cargo build --workspace --bins`) and every peer: `sshd`/`ssh` and `rathole`
//! (`scripts/setup.sh` installs them, as `scripts/test.sh` does). A missing peer fails
//! the test (`--require-peers`) rather than leaving its part of the harness untried.

mod common;

use std::time::Duration;

#[test]
fn quick_benchmark_runs() {
    let out = tempfile::tempdir().expect("temp dir");
    let status = common::run_bench(
        &["--quick", "--require-peers"],
        out.path(),
        Duration::from_secs(900),
    );
    assert!(status.success(), "tether-bench --quick failed: {status}");
    let md = std::fs::read_to_string(out.path().join("results-quick.md")).expect("results");
    for section in [
        "### Link: clean",
        "### Outage",
        "### Outage cycles",
        "### Address change",
        "### Edge footprint",
        "### Cellular data",
        "### Cellular data: path-MTU searches",
        "### Cellular data: a cloud that does not answer",
        "### Concurrent sessions",
    ] {
        assert!(md.contains(section), "no {section:?} in the results:\n{md}");
    }
    for peer in ["| direct |", "| ssh -R |", "| rathole |", "| tether |"] {
        assert!(md.contains(peer), "no {peer} row:\n{md}");
    }
    // The clean link's CPU per GiB: a figure in every cell of Tether's row, for its
    // two agents and the router, one stream and ten.
    let cpu = md
        .split_once("| 1 stream: edge s/GiB |")
        .unwrap_or_else(|| panic!("no CPU per GiB table:\n{md}"))
        .1;
    let row = cpu
        .lines()
        .find(|l| l.starts_with("| tether |"))
        .unwrap_or_else(|| panic!("no tether row in the CPU table:\n{cpu}"));
    let cells: Vec<f64> = row
        .trim_matches('|')
        .split('|')
        .skip(1)
        .map(|c| {
            c.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{c:?} in {row}"))
        })
        .collect();
    assert_eq!(cells.len(), 6, "{row}");
    assert!(cells.iter().sum::<f64>() > 0.0, "{row}");
}
