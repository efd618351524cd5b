#!/usr/bin/env bash
# The project's test command (README: `bash deploy/test.sh`).
# Installs PostgreSQL + RabbitMQ if missing, then fmt, clippy, tests.
# Integration tests start their own private servers on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/stack.sh install

t0=$SECONDS
cargo fmt --all -- --check
cargo clippy --all-targets -- -D warnings
t1=$SECONDS
# Compiled apart from the run, so the time of each is known (where CI's time goes).
cargo test --no-run
t2=$SECONDS
# 2 cores: a few test threads is plenty (servers are shared per process).
cargo test -- --test-threads="${PGOUTBOX_TEST_THREADS:-3}"
echo "test.sh: fmt+clippy $((t1 - t0)) s, test build $((t2 - t1)) s, tests $((SECONDS - t2)) s" >&2
