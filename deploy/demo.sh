#!/usr/bin/env bash
# The main job on a local throwaway stack (README: `bash deploy/demo.sh`).
#
# Installs PostgreSQL and RabbitMQ if missing, starts a private cluster (wal_level=logical)
# and a private RabbitMQ node under $DEMO_DIR on free ports, builds pgoutbox, runs
# `pgoutbox setup`, starts a consumer (a durable queue bound with '#') and `pgoutbox run`,
# emits sample events inside one transaction (plus one rolled back), shows them arriving,
# shows `pgoutbox status`, stops `pgoutbox run` (SIGTERM: it drains and logs its counters),
# prints the last lines of its log (kept in $RUN_LOG), then removes the stack.
set -euo pipefail
cd "$(dirname "$0")/.."

DEMO_DIR=${DEMO_DIR:-/tmp/pgoutbox-demo}
KEEP=${KEEP:-0}   # KEEP=1 leaves the stack running for you to play with
RUN_LOG=${RUN_LOG:-/tmp/pgoutbox-demo-run.log}   # survives the stack's removal

bash deploy/stack.sh install
echo "== building pgoutbox"
cargo build --release --bin pgoutbox --example consume
BIN=target/release/pgoutbox

rm -rf "$DEMO_DIR"
bash deploy/stack.sh start "$DEMO_DIR" >/dev/null
# shellcheck disable=SC1091
source "$DEMO_DIR/env"
export PGOUTBOX_DATABASE_URL PGOUTBOX_AMQP_URL
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [[ -f "$DEMO_DIR/run.log" ]]; then
        cp "$DEMO_DIR/run.log" "$RUN_LOG"
        echo "== what pgoutbox run logged (last lines; the whole log is in $RUN_LOG)"
        tail -n 15 "$RUN_LOG"
    fi
    if [[ "$KEEP" != 1 ]]; then
        bash deploy/stack.sh stop "$DEMO_DIR" >/dev/null 2>&1 || true
        rm -rf "$DEMO_DIR"
    else
        echo "stack left running: source $DEMO_DIR/env; bash deploy/stack.sh stop $DEMO_DIR"
    fi
}
trap cleanup EXIT

echo "== pgoutbox setup"
"$BIN" setup

echo "== consumer: queue pgoutbox-demo bound to exchange pgoutbox with '#'"
target/release/examples/consume "$PGOUTBOX_AMQP_URL" pgoutbox pgoutbox-demo 3 30 \
    > "$DEMO_DIR/consumer.log" 2>&1 &
consumer=$!
pids+=("$consumer")

echo "== pgoutbox run (log: $DEMO_DIR/run.log)"
"$BIN" run > "$DEMO_DIR/run.log" 2>&1 &
pids+=($!)

echo "== producers emit inside their transactions"
psql_() { bash deploy/stack.sh psql "$DEMO_DIR" -v ON_ERROR_STOP=1 -q "$@"; }
psql_ <<'SQL'
CREATE TABLE IF NOT EXISTS orders (id int PRIMARY KEY, total numeric);
BEGIN;
INSERT INTO orders VALUES (1, 9.99);
SELECT outbox.emit('orders.created', '{"order_id": 1, "total": 9.99}');
SELECT outbox.emit('orders.paid', '{"order_id": 1}', '{"tenant": "acme"}', 'order-1-paid');
SELECT outbox.emit_bytes('orders.invoice', '\x25504446'::bytea, 'application/pdf');
COMMIT;
BEGIN;
SELECT outbox.emit('orders.never', '{"rolled": "back"}');
ROLLBACK;
SQL

echo "== what arrived in RabbitMQ"
wait "$consumer" || true
cat "$DEMO_DIR/consumer.log"

echo "== pgoutbox status"
"$BIN" status
