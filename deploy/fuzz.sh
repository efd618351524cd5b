#!/usr/bin/env bash
# Fuzzes pgoutbox's sans-IO decoders with cargo-fuzz (libFuzzer), one target at a time:
#
#   bash deploy/fuzz.sh --smoke                  # each target a fixed number of inputs (what .ci/run does)
#   bash deploy/fuzz.sh [SECONDS] [TARGET...]    # each target SECONDS (default 600)
#
# The smoke runs a fixed number of inputs per target (SMOKE_RUNS below: what about 30 s of
# fuzzing did on a busy 2-core machine, 2026-12-03; FUZZ_SMOKE_RUNS overrides it for every
# target), not a fixed time: CI runs it beside the tests at the lowest CPU priority, where a
# time limit would test fewer inputs the busier the machine is.
#
# Targets (fuzz/fuzz_targets/): pgoutput, copy_data, envelope, startup, amqp_frames. cargo-fuzz needs a
# nightly toolchain: without one this prints that it skipped and why, and exits 0. It installs
# cargo-fuzz from crates.io when missing. Each target runs on a scratch corpus in
# fuzz/corpus/<target>/ (not committed) seeded from the committed fuzz/seeds/<target>/; a
# crash is saved under fuzz/artifacts/<target>/ and makes the script exit 1 after the other
# targets ran. Runs under `nice -n 19` (FUZZ_NICE to change): the machine may be shared.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL_TARGETS=(pgoutput copy_data envelope startup amqp_frames)
# Inputs per target in --smoke (measured rates: 50,000, 4,100, 15,800, 23,000 and 12,500
# inputs a second, with two builds beside it).
declare -A SMOKE_RUNS=([pgoutput]=1500000 [copy_data]=120000 [envelope]=480000 [startup]=700000 [amqp_frames]=380000)
seconds=600
runs=
targets=()
for arg in "$@"; do
  case "$arg" in
    --smoke) runs=smoke ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    ''|*[!0-9]*)
      if [[ " ${ALL_TARGETS[*]} " == *" $arg "* ]]; then
        targets+=("$arg")
      else
        echo "fuzz: unknown argument '$arg': expected --smoke, a duration in seconds or a target (${ALL_TARGETS[*]})" >&2
        exit 2
      fi ;;
    *) seconds="$arg" ;;
  esac
done
[[ ${#targets[@]} -gt 0 ]] || targets=("${ALL_TARGETS[@]}")

if ! nightly=$(cargo +nightly --version 2>/dev/null); then
  echo "fuzz: SKIPPED: no nightly Rust toolchain ('cargo +nightly --version' failed); cargo fuzz needs one (rustup toolchain install nightly)"
  exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz from crates.io"
  cargo install cargo-fuzz --locked
fi
# The budget of target $1, as libFuzzer arguments and in words.
budget_of() {
  if [[ -n "$runs" ]]; then
    local n="${FUZZ_SMOKE_RUNS:-${SMOKE_RUNS[$1]}}"
    budget="$n inputs"
    limit=(-runs="$n")
  else
    budget="${seconds} s"
    limit=(-max_total_time="$seconds")
  fi
}
budget_of "${targets[0]}"
[[ -n "$runs" ]] && budget="a fixed number of inputs (FUZZ_SMOKE_RUNS or SMOKE_RUNS)"
echo "fuzz: $nightly, $(cargo +nightly fuzz --version), ${budget} per target: ${targets[*]}"

nice_level="${FUZZ_NICE:-19}"
start=$(date +%s)
# Built first, so the run time is the fuzzing time; `fuzz run` below then finds them built.
# `fuzz build` takes one target or none (= all of them, in one cargo invocation).
if [[ ${#targets[@]} -eq ${#ALL_TARGETS[@]} ]]; then
  nice -n "$nice_level" cargo +nightly fuzz build --fuzz-dir fuzz
else
  for t in "${targets[@]}"; do
    nice -n "$nice_level" cargo +nightly fuzz build --fuzz-dir fuzz "$t"
  done
fi
built=$(date +%s)
echo "fuzz: built in $((built - start)) s"

mkdir -p fuzz/target/logs
failed=()
summary=()
for t in "${targets[@]}"; do
  corpus="fuzz/corpus/$t"
  mkdir -p "$corpus"
  cp -n fuzz/seeds/"$t"/* "$corpus"/ 2>/dev/null || true
  log="fuzz/target/logs/$t.log"
  budget_of "$t"
  echo "fuzz: $t for ${budget} (log: $log)"
  # -timeout: an input taking over 10 s is a hang; -rss_limit_mb (libFuzzer's default, also the
  # malloc limit): a single allocation or a peak over 2 GiB is a crash (found one, see
  # replication::connect::tests::a_huge_declared_length_is_refused_before_any_allocation).
  if nice -n "$nice_level" cargo +nightly fuzz run --fuzz-dir fuzz "$t" "$corpus" -- \
      "${limit[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      >"$log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed+=("$t")
    grep -E -A1 "^thread .* panicked at" "$log" | head -n 2 || true
    grep -E "^(==[0-9]+== ERROR|SUMMARY|artifact_prefix)" "$log" | head -n 3 || true
  fi
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
  execs=$(grep -oE 'stat::number_of_executed_units: +[0-9]+' "$log" | grep -oE '[0-9]+$' || echo '?')
  rate=$(grep -oE 'stat::average_exec_per_sec: +[0-9]+' "$log" | grep -oE '[0-9]+$' || echo '?')
  cov=$(grep -oE 'cov: [0-9]+' <<<"$last" | grep -oE '[0-9]+' || echo '?')
  ft=$(grep -oE 'ft: [0-9]+' <<<"$last" | grep -oE '[0-9]+' || echo '?')
  files=$(find "$corpus" -type f | wc -l)
  summary+=("$(printf '%-10s %-6s execs=%-10s exec/s=%-7s cov=%-5s ft=%-5s corpus=%s files' \
    "$t" "$status" "$execs" "$rate" "$cov" "$ft" "$files")")
done

per_target="${seconds} s"
[[ -n "$runs" ]] && per_target="the inputs shown"
echo "fuzz: summary (${per_target} per target, total $(( $(date +%s) - start )) s with the build):"
printf '  %s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz: FAILED targets: ${failed[*]}; inputs in fuzz/artifacts/<target>/, replay with: cargo +nightly fuzz run --fuzz-dir fuzz <target> <file>" >&2
  exit 1
fi
