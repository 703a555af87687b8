#!/usr/bin/env bash
# Builds every fuzz target and runs each for SECONDS (libFuzzer -max_total_time), starting from the corpus kept in
# fuzz/corpus/<target>/ (read only: new inputs go to a scratch directory). Fails if any target finds a crash,
# a timeout or an out-of-memory input (libFuzzer leaves it in fuzz/artifacts/<target>/). Prints, per target, the
# inputs executed and the size of the corpus at the end.
#
# Works on the pinned stable toolchain: with `--sanitizer none` cargo-fuzz passes no -Z flag. FUZZ_SANITIZER=address
# adds AddressSanitizer, which needs -Zsanitizer: RUSTC_BOOTSTRAP=1 is set for it.
# FUZZ_PARALLEL: targets run at once (default: the number of CPUs). FUZZ_OUT: see below.
set -euo pipefail
cd "$(dirname "$0")"

seconds=${1:?usage: fuzz/run.sh SECONDS}
sanitizer=${FUZZ_SANITIZER:-none}
parallel=${FUZZ_PARALLEL:-$(nproc)}
if [ "$sanitizer" != none ]; then
  export RUSTC_BOOTSTRAP=1
fi
flags=(--sanitizer "$sanitizer")

t0=$(date +%s)
cargo fuzz build "${flags[@]}"
echo "fuzz build: $(( $(date +%s) - t0 )) s"

mapfile -t targets < <(cargo fuzz list)
# FUZZ_OUT: keep the inputs found (and the logs) there, e.g. to minimise them into the corpus with `cargo fuzz cmin`.
if [ -n "${FUZZ_OUT:-}" ]; then
  scratch=$FUZZ_OUT
  mkdir -p "$scratch"
else
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
fi

run_one() {
  local t=$1
  mkdir -p "$scratch/$t" "corpus/$t"
  # -timeout: one input may take 30 s (a hang is a failure); -rss_limit_mb: 2 GiB.
  cargo fuzz run "${flags[@]}" "$t" "$scratch/$t" "corpus/$t" -- \
    -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
    >"$scratch/$t.log" 2>&1
}

# Start up to $parallel targets at once; remember each one's pid.
declare -A pid_of=()
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do
    sleep 1
  done
  run_one "$t" &
  pid_of[$t]=$!
done

failed=()
printf '%-22s %12s %8s %10s\n' target executions corpus bytes
for t in "${targets[@]}"; do
  rc=0
  wait "${pid_of[$t]}" || rc=$?
  log="$scratch/$t.log"
  # libFuzzer's final stats; "Done N runs" as a fallback.
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
  [ -n "$execs" ] || execs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -n1)
  # The last status line's "corp: N/SIZE".
  corp=$(grep -o 'corp: [0-9]*/[0-9]*[bKM]*' "$log" | tail -n1 | sed 's/corp: //')
  printf '%-22s %12s %8s %10s\n' "$t" "${execs:-?}" "${corp%%/*}" "${corp#*/}"
  if [ "$rc" -ne 0 ]; then
    failed+=("$t")
    echo "---- $t failed (exit $rc); the end of its log:"
    tail -n 40 "$log"
  fi
done
echo "fuzz: $(( $(date +%s) - t0 )) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz targets failed: ${failed[*]} (inputs in fuzz/artifacts/)"
  exit 1
fi
