#!/usr/bin/env bash
# Benchmarks against real peers (direct, ssh -R, Tether) on emulated links:
# clean; 50 ms RTT + 1 % loss; 200 ms RTT + 3 % loss + 10 Mbit/s. Release build.
# Prints markdown tables with Tether's ratio to each peer and writes them to
# target/bench/results.md. Needs root (network namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --workspace --bins
TETHER_BENCH=full cargo test --release -p tether-tests --test bench
echo "written: target/bench/results.md"
