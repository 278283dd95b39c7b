#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, checks
# formatting and lints, builds every binary, runs every test. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== build (binaries are needed by the end-to-end tests)"
cargo build --workspace --bins --tests

echo "== deploy/: manifests, scripts, units, DNAT helper (in network namespaces)"
scripts/check-deploy.sh </dev/null

echo "== clippy"
cargo clippy --workspace --all-targets -- -D warnings

echo "== tests"
# Not under -e: a failing test must still leave the fuzz step and the totals line.
status=0
cargo test --workspace --no-fail-fast 2>&1 | tee target/test-output.txt || status=$?

echo "== kubectl e2e again with three cloud replicas (every case served locally and relayed)"
if ! TETHER_E2E_REPLICAS=3 cargo test -p tether-tests --test kubectl_e2e 2>&1 | tee -a target/test-output.txt; then status=1; fi

echo "== kubectl e2e again with apiserver-sim passing exec/attach WebSockets through (kubectl 1.33; the default run translates them to SPDY like kube-apiserver)"
if ! TETHER_E2E_APISERVER_STREAMS=passthrough KUBECTL=/usr/lib/google-cloud-sdk/bin/kubectl.1.33 cargo test -p tether-tests --test kubectl_e2e 2>&1 | tee -a target/test-output.txt; then status=1; fi

echo "== kubectl e2e again against real containers: cri-kubelet on a private containerd, every case (kubectl 1.28 and 1.33)"
if ! TETHER_E2E_KUBELET=cri cargo test -p tether-tests --test kubectl_e2e 2>&1 | tee -a target/test-output.txt; then status=1; fi

echo "== fuzz: corpus and crash-regression replay, then a short AFL++ pass per target"
if ! (cd fuzz && cargo test 2>&1) | tee -a target/test-output.txt; then status=1; fi
if ! scripts/fuzz.sh --seconds "${FUZZ_SECONDS:-15}"; then status=1; fi

# Closing line: totals across every test binary.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "all test binaries: %d passed, %d failed, %d ignored\n", p, f, i }' target/test-output.txt
exit "$status"
