#!/usr/bin/env bash
# The pgoutbox benchmark, one command:
#
#   bash deploy/bench.sh [--quick] [--runs N] [--scenarios 1,2,3,4] [--s4-rate MSGS_PER_S]
#
# Installs postgresql + rabbitmq-server if missing (deploy/stack.sh install), builds the
# release binary and the bench, then runs examples/bench.rs, which starts its own throwaway
# stack under /tmp, prints a Markdown table and writes target/bench/results-<timestamp>.json.
# Full mode takes about 11 minutes on 2 cores; --quick about 2-3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/stack.sh install
cargo build --release --bin pgoutbox
cargo build --release --example bench
PGOUTBOX_BENCH_SKIP_BUILD=1 exec target/release/examples/bench "$@"
