#!/usr/bin/env bash
# Installs what Tether's build and tests need on a fresh Debian machine, and fails
# loudly when a required tool cannot be had. Idempotent; safe without stdin (CI).
set -euo pipefail

need_apt=()
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)
command -v iptables >/dev/null 2>&1 || need_apt+=(iptables)
command -v script >/dev/null 2>&1 || need_apt+=(bsdutils)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v tar >/dev/null 2>&1 || need_apt+=(tar)
# The CRI-backed kubelet stand-in: containerd (CRI plugin) and runc run the pods; the
# image is built from the static busybox; k8s-cri's build compiles the CRI protos.
command -v containerd >/dev/null 2>&1 || need_apt+=(containerd)
command -v runc >/dev/null 2>&1 || need_apt+=(runc)
dpkg -s busybox-static >/dev/null 2>&1 || need_apt+=(busybox-static)
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
# A real scraper for the kubelet-auth tests (issue 17): Debian's Prometheus.
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)

KUBECTL_DIR=/usr/lib/google-cloud-sdk/bin
have_kubectl=0
for v in 1.28 1.33; do
  [ -x "$KUBECTL_DIR/kubectl.$v" ] && have_kubectl=1
done
if [ -n "${KUBECTL:-}" ]; then
  [ -x "$KUBECTL" ] || { echo "setup: KUBECTL=$KUBECTL is not an executable" >&2; exit 1; }
  have_kubectl=1
fi
if [ "$have_kubectl" = 0 ] && ! command -v kubectl >/dev/null 2>&1; then
  need_apt+=(kubernetes-client)
fi

if [ "${#need_apt[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing ${need_apt[*]} and not root to install them" >&2
    exit 1
  fi
  echo "setup: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

for tool in ip nft iptables script cargo containerd ctr runc protoc busybox prometheus; do
  command -v "$tool" >/dev/null 2>&1 || { echo "setup: required tool '$tool' is still missing" >&2; exit 1; }
done
# AFL++ for stable Rust (the fuzz pass in scripts/test.sh, scripts/fuzz.sh).
if ! cargo afl --version >/dev/null 2>&1; then
  echo "setup: installing cargo-afl"
  cargo install --locked cargo-afl >/dev/null
fi
cargo afl --version >/dev/null 2>&1 || { echo "setup: cargo-afl is still missing" >&2; exit 1; }
# Builds AFL++ and its runtime for this toolchain once (says so when already done).
cargo afl config --build >/dev/null 2>&1 || cargo afl --version >/dev/null
# Benchmark peers (the quick benchmark runs in the suite with every peer).
"$(dirname "$0")/install-peers.sh"
echo "setup: ok ($(cargo --version))"
