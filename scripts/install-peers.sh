#!/usr/bin/env bash
# Installs the benchmark's peers from their registries (never vendored), idempotently:
# OpenSSH (Debian openssh-server/-client) for `ssh -R`, and rathole from crates.io
# into target/bench-tools (about 2.5 minutes on 2 cores, once). Fails loudly when a
# peer cannot be had. Used by scripts/setup.sh (the quick benchmark runs in the test
# suite with every peer) and scripts/bench.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

need_apt=()
[ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need_apt+=(openssh-client)
command -v ssh-keygen >/dev/null 2>&1 || need_apt+=(openssh-client)
command -v strip >/dev/null 2>&1 || need_apt+=(binutils)
if [ "${#need_apt[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-peers: missing ${need_apt[*]} and not root to install them" >&2
    exit 1
  fi
  echo "install-peers: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

tools="$root/target/bench-tools"
if [ ! -x "$tools/bin/rathole" ]; then
  mkdir -p "$tools"
  echo "install-peers: installing rathole from crates.io into $tools (a few minutes, once)"
  # rathole 0.5.0's lock file pins time 0.3.29, which no longer builds with current
  # rustc; fall back to a fresh resolution when the locked build fails.
  cargo install rathole --locked --root "$tools" >"$tools/install.log" 2>&1 \
    || cargo install rathole --root "$tools" >>"$tools/install.log" 2>&1 \
    || { tail -20 "$tools/install.log" >&2; echo "install-peers: cannot install rathole" >&2; exit 1; }
fi
for tool in /usr/sbin/sshd ssh ssh-keygen strip "$tools/bin/rathole"; do
  command -v "$tool" >/dev/null 2>&1 || { echo "install-peers: required peer '$tool' is still missing" >&2; exit 1; }
done
echo "install-peers: ok (rathole at $tools/bin/rathole)"
