#!/usr/bin/env bash
# The pgoutbox benchmark, one command:
#
#   bash deploy/bench.sh [--quick] [--runs N] [--scenarios 1,2,3,4] [--s4-rate R1,R2,...]
#
# Installs postgresql + rabbitmq-server if missing (deploy/stack.sh install), builds the
# release binary and the bench, then runs examples/bench.rs, which starts its own throwaway
# stack under /tmp, prints a Markdown table and writes target/bench/results-<timestamp>.json.
# When node and npm are installed, the Node relay of ../shared/peers/node (or
# $PGOUTBOX_BENCH_NODE_PEER) runs next to pgoutbox: copied to target/peer-node, `npm ci` there
# when its package-lock.json changed; without node its rows are skipped with a note.
# Scenario 5 (streams) needs the rabbitmq_stream plugin: the bench starts its stack with it.
# Full mode takes about 18 minutes on 2 cores; --quick about 3 (CI runs --quick).
#
# Then the scaling curve of `run --partitions N` (examples/scaling.rs, issue 31): drains
# with N = 1, 2, 4 against real RabbitMQ, and a simulation against a fake broker that
# confirms at most R msg/s per connection for N = 1, 2, 4, 8, 16; tables on stdout, JSON and
# an SVG of the curve in target/bench/ (about 2 minutes; --quick passes on; skipped with
# PGOUTBOX_BENCH_SCALING=0; PGOUTBOX_BENCH_SCALING_ARGS adds arguments, e.g. "--rate 2000").
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/stack.sh install
# One cargo invocation for both: built apart, the binary alone and the example (with the
# dev-dependencies) unify features differently, and each build recompiles the library.
#
# PGOUTBOX_BENCH_PROFILE=dev (CI's smoke, after `cargo test` built the dev profile) runs the
# dev build instead of compiling everything a second time with optimisations: it checks
# that the benchmark runs end to end, and its figures are not the release build's.
scaling_args=()
for a in "$@"; do [ "$a" = --quick ] && scaling_args+=(--quick); done
# shellcheck disable=SC2206
scaling_args+=(${PGOUTBOX_BENCH_SCALING_ARGS:-})
if [ "${PGOUTBOX_BENCH_PROFILE:-release}" = dev ]; then
    cargo build --bin pgoutbox --example bench --example scaling
    export PGOUTBOX_BENCH_BIN="$PWD/target/debug/pgoutbox" PGOUTBOX_BENCH_SKIP_BUILD=1
    out=target/debug/examples
else
    cargo build --release --bin pgoutbox --example bench --example scaling
    export PGOUTBOX_BENCH_SKIP_BUILD=1
    out=target/release/examples
fi
"$out/bench" "$@"
if [ "${PGOUTBOX_BENCH_SCALING:-1}" != 0 ]; then
    "$out/scaling" "${scaling_args[@]}"
fi
