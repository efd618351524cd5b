#!/usr/bin/env bash
# The compatibility group on one PostgreSQL major version:
#
#   bash deploy/test-compat.sh 17            # 14, 15, 16, 17 or 18
#
# Runs the integration tests that touch what differs between PostgreSQL versions (the main job,
# faults, gaps, lockdown, standby takeover and failover slots, TLS to the broker and to
# PostgreSQL, and the harness's own smoke tests) against a server of that major: the system's
# when it has one, else the pinned npm build of deploy/pg-version.sh (cached). The whole suite
# runs on the default version through deploy/test.sh.
#   PGOUTBOX_TEST_THREADS   test threads (default 4: the tests mostly wait on servers)
#   PGOUTBOX_TEST_COMPAT_FILTERS the test-name filters (default: the group below)
# Prints the time of the install, the build and the tests; exits non-zero when a test fails.
set -euo pipefail
cd "$(dirname "$0")/.."

major="${1:-}"
[[ "$major" =~ ^1[4-8]$ ]] || {
    echo "usage: $0 14|15|16|17|18" >&2
    exit 2
}
filters=(${PGOUTBOX_TEST_COMPAT_FILTERS:-end_to_end:: faults:: gaps:: lockdown:: standby:: tls:: pg_tls:: harness_smoke::})

t0=$SECONDS
bash deploy/stack.sh install >&2 # RabbitMQ, and the Debian psql client the harness uses
if [[ ! -x "/usr/lib/postgresql/$major/bin/postgres" ]]; then
    bash deploy/pg-version.sh "$major" >/dev/null
fi
t1=$SECONDS
# Built apart from the run (the time of each is known), then the test binary is run directly.
exe=$(cargo test --test main --no-run --message-format=json |
    grep '"kind":\["test"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[[ -x "$exe" ]] || {
    echo "test-compat.sh: no test binary found" >&2
    exit 1
}
t2=$SECONDS
status=0
PGOUTBOX_TEST_PG="$major" "$exe" "${filters[@]}" --test-threads="${PGOUTBOX_TEST_THREADS:-4}" || status=$?
t3=$SECONDS
echo "test-compat.sh: PostgreSQL $major: install $((t1 - t0)) s, build $((t2 - t1)) s, tests $((t3 - t2)) s, exit $status" >&2
exit "$status"
