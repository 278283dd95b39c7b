#!/usr/bin/env bash
# The soak (issue "Hardening"): 1,000 concurrent exec sessions through one edge for
# 10 minutes, each echoing a checksummed stream, with a 5–40 s total outage every
# minute on the emulated link. Exits non-zero unless 0 sessions are lost, 0 bytes
# lost or duplicated, and cloud and edge RSS at the end are within 10 % of the start.
# Release build; needs root. Options are passed on (e.g. --sessions 200, --out DIR);
# SOAK_MINUTES overrides the 10 minutes. The result is written to target/bench/results-soak.md.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --workspace --bins
exec target/release/tether-bench --soak "${SOAK_MINUTES:-10}" --sessions 1000 "$@"
