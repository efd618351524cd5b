#!/usr/bin/env bash
# The project's test command (README: `bash deploy/test.sh`).
# Installs PostgreSQL + RabbitMQ if missing, then fmt, clippy, tests.
# Integration tests start their own private servers on free ports.
#
# Clippy runs beside the test build and the tests, in its own target directory
# (target/clippy: a check build shares no artefact with the test build, and a second
# directory means neither waits for the other's lock) at the lowest CPU priority: the
# integration tests spend much of their time waiting on servers, and clippy takes that idle
# CPU instead of a step of its own. Its verdict is waited for at the end and fails the
# command like any test (PGOUTBOX_TEST_CLIPPY=serial runs it first, alone, as before).
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/stack.sh install

t0=$SECONDS
cargo fmt --all -- --check
mkdir -p target
clippy_log=target/clippy.log
clippy() {
    CARGO_TARGET_DIR=target/clippy cargo clippy --all-targets -- -D warnings
}
if [[ "${PGOUTBOX_TEST_CLIPPY:-beside}" == serial ]]; then
    clippy
    clippy_pid=
else
    nice -n 19 bash -c "$(declare -f clippy); clippy" >"$clippy_log" 2>&1 &
    clippy_pid=$!
fi
t1=$SECONDS
# Compiled apart from the run, so the time of each is known (where CI's time goes).
cargo test --no-run
t2=$SECONDS
# 2 cores: a few test threads is plenty (servers are shared per process).
cargo test -- --test-threads="${PGOUTBOX_TEST_THREADS:-3}"
t3=$SECONDS
if [[ -n "$clippy_pid" ]]; then
    if ! wait "$clippy_pid"; then
        cat "$clippy_log" >&2
        echo "test.sh: cargo clippy --all-targets -- -D warnings failed (above)" >&2
        exit 1
    fi
    echo "test.sh: clippy clean (beside the tests; its log: $clippy_log)" >&2
fi
echo "test.sh: fmt $((t1 - t0)) s, test build $((t2 - t1)) s, tests $((t3 - t2)) s, clippy's wait after the tests $((SECONDS - t3)) s" >&2
