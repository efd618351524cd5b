#!/usr/bin/env bash
# The project's test command (README: `bash deploy/test.sh`).
# Installs PostgreSQL + RabbitMQ if missing, then fmt, clippy, tests.
# Integration tests start their own private servers on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/stack.sh install

cargo fmt --all -- --check
cargo clippy --all-targets -- -D warnings
# 2 cores: a few test threads is plenty (servers are shared per process).
cargo test -- --test-threads="${PGOUTBOX_TEST_THREADS:-3}"
