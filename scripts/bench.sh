#!/usr/bin/env bash
# Benchmarks of Tether against real peers on emulated links (tests/bench, `tether-bench`):
# direct, ssh -R (OpenSSH), rathole and Tether, each across the same link — clean;
# 50 ms RTT + 1 % loss; 200 ms RTT + 3 % loss + 10 Mbit/s — plus outage, address change,
# scale and edge footprint. Installs the peers, builds release binaries, writes
# target/bench/results.md and prints it. Needs root (network namespaces).
#
#   scripts/bench.sh            the full run (about 60 minutes on 2 cores; the cellular scenario is ~20 of them)
#   scripts/bench.sh --quick    clean link, small sizes, 5 s outage, 100 sessions, no idle-edge scale (< 3 min)
#   scripts/bench.sh --only outage   (any tether-bench arguments pass through; --help lists them)
#   scripts/bench.sh --only edges --scale 10000   one scale figure
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

scripts/install-peers.sh
export RATHOLE="$root/target/bench-tools/bin/rathole"

# kubelet-sim and apiserver-sim: the replicas scenario runs a whole cluster (tests/src/cluster.rs).
cargo build --release -p tether-cloud -p tether-edge -p tether-certs -p linkemu -p tether-bench -p kubelet-sim -p apiserver-sim
# The edge as shipped (Containerfile, systemd): the `edge` profile.
cargo build --profile edge -p tether-edge
export TETHER_EDGE_BIN="${CARGO_TARGET_DIR:-$root/target}/edge/tether-edge"
"${CARGO_TARGET_DIR:-$root/target}/release/tether-bench" --out "$root/target/bench" "$@"
