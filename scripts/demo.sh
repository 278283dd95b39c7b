#!/usr/bin/env bash
# Tether's one-command demo: builds the workspace, then runs `tether-demo`, which mints
# every certificate, starts tether-cloud, tether-edge, a kubelet stand-in (containerd via
# its CRI when containerd can run here, else the kubelet simulator) and the
# apiserver stand-in on loopback, runs `kubectl exec` and `kubectl logs` through the
# tunnel, and keeps running until Ctrl-C (which stops everything cleanly).
# kubectl: $KUBECTL, else /usr/lib/google-cloud-sdk/bin/kubectl.1.33, else `kubectl` on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo build --workspace --bins"
cargo build --workspace --bins

target_dir=$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
exec "${target_dir:-target}/debug/tether-demo" "$@"
