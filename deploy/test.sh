#!/usr/bin/env bash
# The project's test command (README: `bash deploy/test.sh`), what CI runs through .ci/run:
#
#   bash deploy/test.sh            # fmt, clippy, every unit and integration test
#   bash deploy/test.sh --quick    # the inner loop: unit tests, the fake-broker tests and the
#                                  # integration tests that never start, stop, restart or block
#                                  # a server of their own (all but the test group `servers`
#                                  # of .config/nextest.toml); no clippy
#
# Installs PostgreSQL, RabbitMQ, cargo-nextest and the tests' Python stream client
# (deploy/test-python.sh) if missing. The tests run under
# cargo-nextest, one process per test, 8 at a time on any machine: they mostly wait on
# servers. The PostgreSQL cluster and the RabbitMQ node most tests use are shared by the whole
# run (the first test that needs one starts it; PGOUTBOX_TEST_SHARED_DIR), and the tests that
# stop, block or reconfigure a server start their own. The slowest tests start first
# (`priority` in .config/nextest.toml). At the end it prints the time of each test group
# (deploy/test-times.sh).
#
# Clippy runs beside the test build and the tests, in its own target directory (a check
# build shares no artefact with the test build, and a second directory means neither waits
# for the other's lock) at the lowest CPU priority, and its verdict fails the command at the
# end like a test (PGOUTBOX_TEST_CLIPPY=serial runs it first, alone).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=
case "${1:-}" in
    "") ;;
    --quick) quick=1 ;;
    -h | --help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown argument '$1': expected nothing or --quick" >&2; exit 2 ;;
esac

bash deploy/stack.sh install
# rstream, the stream client the tests read streams with (pinned, in target/python).
bash deploy/test-python.sh >/dev/null
export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "test.sh: installing cargo-nextest from crates.io (a few minutes, once)" >&2
    cargo install cargo-nextest --locked
fi

t0=$SECONDS
cargo fmt --all -- --check
mkdir -p target
clippy_log=target/clippy.log
clippy() {
    CARGO_TARGET_DIR=target/clippy cargo clippy --all-targets -- -D warnings
}
clippy_pid=
if [[ -n $quick ]]; then
    :
elif [[ "${PGOUTBOX_TEST_CLIPPY:-beside}" == serial ]]; then
    clippy
else
    nice -n 19 bash -c "$(declare -f clippy); clippy" >"$clippy_log" 2>&1 &
    clippy_pid=$!
fi

# The run's shared servers: their watchdogs stop them when this script exits.
PGOUTBOX_TEST_SHARED_DIR=$(mktemp -d /tmp/pgoutbox-run-XXXXXX)
export PGOUTBOX_TEST_SHARED_DIR PGOUTBOX_TEST_SHARED_OWNER=$$
trap 'rm -rf "$PGOUTBOX_TEST_SHARED_DIR"' EXIT

t1=$SECONDS
# Compiled apart from the run, so the time of each is known (where CI's time goes).
cargo test --no-run
t2=$SECONDS
status=0
args=()
[[ -n $quick ]] && args+=(-E 'not group(servers)')
[[ -n "${PGOUTBOX_TEST_THREADS:-}" ]] && args+=(--test-threads "$PGOUTBOX_TEST_THREADS")
cargo nextest run "${args[@]}" || status=$?
t3=$SECONDS
bash deploy/test-times.sh target/nextest/default/junit.xml >&2 || true
[[ $status -eq 0 ]] || { echo "test.sh: tests failed (above)" >&2; exit "$status"; }
if [[ -n "$clippy_pid" ]]; then
    if ! wait "$clippy_pid"; then
        cat "$clippy_log" >&2
        echo "test.sh: cargo clippy --all-targets -- -D warnings failed (above)" >&2
        exit 1
    fi
    echo "test.sh: clippy clean (beside the tests; its log: $clippy_log)" >&2
fi
echo "test.sh: fmt $((t1 - t0)) s, test build $((t2 - t1)) s, tests $((t3 - t2)) s, clippy's wait after the tests $((SECONDS - t3)) s" >&2
