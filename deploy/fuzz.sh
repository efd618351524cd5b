#!/usr/bin/env bash
# Fuzzes pgoutbox's sans-IO decoders with cargo-fuzz (libFuzzer), one target at a time:
#
#   bash deploy/fuzz.sh --smoke                  # each target a fixed number of inputs (what .ci/run does)
#   bash deploy/fuzz.sh [SECONDS] [TARGET...]    # each target SECONDS (default 600)
#   bash deploy/fuzz.sh --build-only             # build the targets and stop
#   bash deploy/fuzz.sh --smoke --no-build       # run what --build-only built (.ci/run: the build
#                                                # holds cargo's lock on target/, so it is not
#                                                # left running beside the tests' own cargo)
#
# The smoke runs a fixed number of inputs per target (SMOKE_RUNS below: what about 30 s of
# fuzzing did on a busy 2-core machine, 2026-12-03; FUZZ_SMOKE_RUNS overrides it for every
# target), not a fixed time: CI runs it beside the tests at the lowest CPU priority, where a
# time limit would test fewer inputs the busier the machine is.
#
# Targets (fuzz/fuzz_targets/): pgoutput, copy_data, envelope, startup, amqp_frames,
# stream_frames. Each is
# a libFuzzer binary (libfuzzer-sys), an example of this package behind the `fuzz` feature
# (`fuzz_<target>`), built by cargo in the test build's profile and target directory with the
# coverage instrumentation cargo-fuzz would add, on the stable toolchain. The instrumentation
# reaches this package's crates only (deploy/fuzz-rustc.sh, a RUSTC_WORKSPACE_WRAPPER), so
# the dependencies `cargo test` compiled are linked as they are: on a fresh machine the build
# is this package's library and the targets, not a second compile of every dependency plus
# cargo-fuzz (about 22 minutes of CPU together). Nothing to install, never skipped for want
# of a nightly. Each target runs on a scratch corpus in fuzz/corpus/<target>/ (not committed)
# seeded from the committed fuzz/seeds/<target>/; a crash is saved under
# fuzz/artifacts/<target>/ and makes the script exit 1 after the other targets ran. Runs
# under `nice -n 19` (FUZZ_NICE to change): the machine may be shared.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL_TARGETS=(pgoutput copy_data envelope startup amqp_frames stream_frames)
# Inputs per target in --smoke: four times what about 30 s of each took under cargo-fuzz's
# AddressSanitizer build (2026-12-03); without the sanitizer the instrumented targets run
# 15 to 40 times faster (pgoutput 750,000 inputs a second on a quiet machine, 2026-12-06), so
# the whole smoke is about a minute of CPU.
declare -A SMOKE_RUNS=([pgoutput]=6000000 [copy_data]=480000 [envelope]=1920000 [startup]=2800000 [amqp_frames]=1520000 [stream_frames]=1520000)
seconds=600
runs=
build=yes
targets=()
for arg in "$@"; do
  case "$arg" in
    --smoke) runs=smoke ;;
    --build-only) build=only ;;
    --no-build) build=no ;;
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
# What cargo-fuzz passes to rustc for libFuzzer's coverage feedback (the build profile keeps
# debug assertions and overflow checks on).
export PGOUTBOX_FUZZ_RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
budget_of "${targets[0]}"
[[ -n "$runs" ]] && budget="a fixed number of inputs (FUZZ_SMOKE_RUNS or SMOKE_RUNS)"
echo "fuzz: $(cargo --version), ${budget} per target: ${targets[*]}"

nice_level="${FUZZ_NICE:-19}"
start=$(date +%s)
# Built first, so the run time is the fuzzing time.
examples=()
for t in "${targets[@]}"; do examples+=(--example "fuzz_$t"); done
bin_dir=target/debug/examples
if [[ $build != no ]]; then
  # This package's crates at opt-level 1 (the test build compiles them at 0, Cargo.toml):
  # unoptimised, the targets ran 5 to 20 times fewer inputs a second, and the smoke ended a
  # minute after the tests it runs beside (CI, 2026-12-06). The dependencies keep their own
  # opt-level from Cargo.toml, so the test build's are linked as they are.
  CARGO_PROFILE_TEST_OPT_LEVEL=1 RUSTC_WORKSPACE_WRAPPER="$PWD/deploy/fuzz-rustc.sh" \
    nice -n "$nice_level" cargo build --profile test --features fuzz "${examples[@]}"
  echo "fuzz: built in $(( $(date +%s) - start )) s"
fi
[[ $build == only ]] && exit 0

mkdir -p target/fuzz-logs
failed=()
summary=()
for t in "${targets[@]}"; do
  corpus="fuzz/corpus/$t"
  mkdir -p "$corpus"
  cp -n fuzz/seeds/"$t"/* "$corpus"/ 2>/dev/null || true
  log="target/fuzz-logs/$t.log"
  budget_of "$t"
  echo "fuzz: $t for ${budget} (log: $log)"
  # -timeout: an input taking over 10 s is a hang; -rss_limit_mb (libFuzzer's default, also the
  # malloc limit): a single allocation or a peak over 2 GiB is a crash (found one, see
  # replication::connect::tests::a_huge_declared_length_is_refused_before_any_allocation).
  mkdir -p "fuzz/artifacts/$t"
  if nice -n "$nice_level" "$bin_dir/fuzz_$t" "$corpus" \
      "${limit[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1; then
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
  echo "fuzz: FAILED targets: ${failed[*]}; inputs in fuzz/artifacts/<target>/, replay with: $bin_dir/fuzz_<target> <file>" >&2
  exit 1
fi
