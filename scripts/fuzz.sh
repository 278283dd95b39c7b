#!/usr/bin/env bash
# Coverage-guided fuzzing of Tether's parsers and stream state machine with
# AFL++ on stable Rust (the `afl` crate; see fuzz/README.md).
#
#   scripts/fuzz.sh [--execs N | --seconds S] [--save] [TARGET...]
#
# Runs each target (default: all) until it has made N executions (default
# 10^7) or for S seconds, from fuzz/corpus/<target>, then prints one line per
# target: executions, execs/s, corpus size, crashes and hangs. With --save
# the run's new queue entries join fuzz/corpus/<target> (named by content).
# Crashing inputs are copied to fuzz/crashes/<target>/ and make the script
# exit 1 (fix the bug, then move the input to fuzz/regressions/<target>/,
# which fuzz/tests/corpus.rs replays). Work files: fuzz/target/afl-out/.
set -euo pipefail
cd "$(dirname "$0")/.."

execs=10000000
seconds=""
save=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --execs) execs="$2"; shift 2 ;;
    --seconds) seconds="$2"; execs=""; shift 2 ;;
    --save) save=1; shift ;;
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
all=(frame_decode head_decode hello_welcome route stream config csr token)
[ "${#targets[@]}" -gt 0 ] || targets=("${all[@]}")

if ! cargo afl --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-afl (AFL++ for stable Rust)"
  cargo install --locked cargo-afl
fi
cargo afl --version >/dev/null 2>&1 || { echo "fuzz: cargo-afl is still missing" >&2; exit 1; }
# Builds AFL++ and its runtime once per toolchain (a no-op when done).
cargo afl config --build >/dev/null 2>&1 || true

(cd fuzz && cargo afl build --release --features afl)

export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 \
  AFL_QUIET=1 AFL_NO_AFFINITY=1
failed=0
summary=()
for t in "${targets[@]}"; do
  out="fuzz/target/afl-out/$t"
  rm -rf "$out"
  mkdir -p "$out"
  limit=()
  if [ -n "$execs" ]; then limit=(-E "$execs"); else limit=(-V "$seconds"); fi
  echo "== fuzz $t (${execs:+$execs execs}${seconds:+$seconds s})"
  # -E / -V bound the run; timeout(1) is a backstop.
  timeout --kill-after=30 "$(( ${seconds:-7200} + 600 ))" \
    cargo afl fuzz -i "fuzz/corpus/$t" -o "$out" "${limit[@]}" -t 1000 -m none \
      "fuzz/target/release/$t" >"$out/afl.log" 2>&1 || true
  stats="$out/default/fuzzer_stats"
  if [ ! -f "$stats" ]; then
    echo "fuzz: $t did not run; its log:" >&2
    tail -20 "$out/afl.log" >&2
    exit 1
  fi
  get() { awk -F' *: *' -v k="$1" '$1==k {print $2}' "$stats"; }
  crashes=$(get saved_crashes)
  hangs=$(get saved_hangs)
  # Keep what the run found: new queue entries join the corpus.
  [ "$save" = 1 ] && for f in "$out"/default/queue/id:*; do
    [ -f "$f" ] || continue
    sum=$(sha256sum "$f" | cut -c1-16)
    [ -e "fuzz/corpus/$t/q-$sum" ] || cp "$f" "fuzz/corpus/$t/q-$sum"
  done
  if [ "${crashes:-0}" != 0 ]; then
    mkdir -p "fuzz/crashes/$t"
    cp "$out"/default/crashes/id:* "fuzz/crashes/$t/" 2>/dev/null || true
    failed=1
  fi
  summary+=("$(printf '%-14s execs %-10s execs/s %-8s corpus %-5s crashes %s hangs %s' \
    "$t" "$(get execs_done)" "$(get execs_per_sec)" "$(get corpus_count)" "$crashes" "$hangs")")
done
echo "== fuzz summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
