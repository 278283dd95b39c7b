#!/usr/bin/env bash
# Size of tether-edge as shipped (the `edge` profile) and where it goes, by crate:
# builds the profile unstripped into target/edge-size (so the shipped build is not
# touched), prints the stripped size and the symbol sizes (nm) grouped by the first
# non-std crate named in each symbol. Usage: scripts/edge-size.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_PROFILE_EDGE_STRIP=false
cargo build --profile edge -p tether-edge --target-dir target/edge-size
bin=target/edge-size/edge/tether-edge
strip -o "$bin.stripped" "$bin"
echo "stripped: $(stat -c %s "$bin.stripped") bytes"
nm --print-size --size-sort -C "$bin" | python3 -c '
import re, sys, collections
ident = re.compile(r"(?:^|[<\s(&*,\[])([A-Za-z_][A-Za-z0-9_]*)::")
std = {"core", "alloc", "std", "__rustc", "compiler_builtins", "std_detect", "impl", "_", "dyn"}
by = collections.Counter()
for line in sys.stdin:
    p = line.split(None, 3)
    if len(p) < 4:
        continue
    size, kind, name = int(p[1], 16), p[2], p[3].strip()
    if kind.lower() not in "tw":
        by["(read-only data with symbols)"] += size
        continue
    crates = ident.findall(name)
    other = [c for c in crates if c not in std]
    by[other[0] if other else ("std/core/alloc" if crates else "C and assembly")] += size
total = sum(by.values())
print(f"| crate | KiB | % of {total / 1048576:.2f} MiB of symbols |")
print("|---|---|---|")
for k, v in by.most_common(30):
    print(f"| {k} | {v / 1024:.0f} | {100 * v / total:.1f} |")
'
