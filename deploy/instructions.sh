#!/usr/bin/env bash
# Instructions per message of `pgoutbox run`, counted by valgrind's callgrind: stable on a busy
# machine, where CPU seconds are not (docs/src/internals/benchmarks.md#instructions-per-message).
#
#   bash deploy/instructions.sh [N] [SHAPE] [PARTITIONS] [SINK]
#
# N (default 10000) messages in transactions of 100, emitted before `run` starts, drained by
# the release binary under callgrind, then SIGTERM; the same with 2N. Instructions per message =
# (Ir(2N) - Ir(N)) / N, so start-up, connections and shutdown cancel out. SHAPE is
# `--publish-properties` (full or minimal, default full); PARTITIONS is `--partitions` (default
# 1); SINK is `amqp` (default: the exchange path) or `stream` (`run --stream-url --stream`
# into a fresh stream per drain, on a RabbitMQ node with the stream plugin; PARTITIONS then
# stays 1). The 2N run's profile is kept in target/instructions/ (callgrind_annotate reads it: where
# the instructions go, function by function). Starts its own throwaway stack (deploy/stack.sh)
# and removes it.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-10000}
shape=${2:-full}
partitions=${3:-1}
sink=${4:-amqp}
case "$sink" in
    amqp) plugins="" ;;
    stream) plugins=rabbitmq_stream ;;
    *) echo "instructions.sh: SINK is amqp or stream, not $sink" >&2; exit 2 ;;
esac
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is missing (apt-get install valgrind)" >&2; exit 2; }
bash deploy/stack.sh install
if [ -z "${PGOUTBOX_BENCH_SKIP_BUILD:-}" ]; then
    cargo build --release --bin pgoutbox --example consume
fi
out=target/instructions
mkdir -p "$out"
dir=$(mktemp -d /tmp/pgoutbox-instr-XXXXXX)
chmod 755 "$dir"
trap 'bash deploy/stack.sh stop "$dir" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
PGOUTBOX_STACK_PLUGINS=$plugins bash deploy/stack.sh start "$dir" >/dev/null
set -a
# shellcheck disable=SC1091
source "$dir/env"
set +a
psql_() { bash deploy/stack.sh psql "$dir" -qAt "$@"; }

target/release/pgoutbox setup >/dev/null
if [ "$sink" = amqp ]; then
    target/release/examples/consume "$PGOUTBOX_AMQP_URL" pgoutbox instr 0 >/dev/null
fi

# Ir of one drain of `count` messages (emitted first, in transactions of 100): the total on
# stdout.
drain() {
    local count=$1 tag=$2
    psql_ -c "DO \$\$ BEGIN FOR b IN 0..$((count / 100 - 1)) LOOP PERFORM count(outbox.emit('instr.t', jsonb_build_object('n', b * 100 + g, 'pad', repeat('x', 60)))) FROM generate_series(1, 100) g; COMMIT; END LOOP; END \$\$" >/dev/null
    local last
    last=$(psql_ -c "SELECT pg_current_wal_lsn()")
    local sink_env=()
    if [ "$sink" = stream ]; then
        # The stream replaces the exchange: no AMQP URL (giving both is refused).
        sink_env=(-u PGOUTBOX_AMQP_URL
            "PGOUTBOX_STREAM_URL=rabbitmq-stream://guest:guest@127.0.0.1:$RABBITMQ_STREAM_PORT/%2f"
            "PGOUTBOX_STREAM=instr-$tag")
    fi
    env "${sink_env[@]}" valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.$tag.out" \
        target/release/pgoutbox run --publish-properties "$shape" --partitions "$partitions" \
        --http-addr off >"$out/run.$tag.log" 2>&1 &
    local pid=$! waited=0
    until [ "$(psql_ -c "SELECT confirmed_flush_lsn >= '$last' FROM pg_replication_slots WHERE slot_name = 'pgoutbox'")" = t ]; do
        sleep 1
        waited=$((waited + 1))
        if [ $waited -gt 900 ] || ! kill -0 $pid 2>/dev/null; then
            echo "instructions.sh: the $count-message drain did not finish; see $out/run.$tag.log" >&2
            kill $pid 2>/dev/null || true
            exit 1
        fi
    done
    kill -TERM $pid
    wait $pid || true
    local got
    if [ "$sink" = stream ]; then
        # The stream's messages are not counted by list_queues: the final log line's count.
        got=$(grep -o 'confirmed=[0-9]*' "$out/run.$tag.log" | tail -1 | cut -d= -f2)
        if [ "$got" != "$count" ]; then
            echo "instructions.sh: run confirmed ${got:-nothing} into the stream, not $count" >&2
            exit 1
        fi
        grep -m1 -E '^(summary|totals):' "$out/callgrind.$tag.out" | awk '{print $2}'
        return
    fi
    got=$(bash deploy/stack.sh ctl "$dir" -q list_queues name messages --no-table-headers | awk '$1 == "instr" {print $2}')
    if [ "$got" != "$count" ]; then
        echo "instructions.sh: queue instr holds ${got:-nothing}, not $count" >&2
        exit 1
    fi
    bash deploy/stack.sh ctl "$dir" -q purge_queue instr >/dev/null
    grep -m1 -E '^(summary|totals):' "$out/callgrind.$tag.out" | awk '{print $2}'
}

one=$(drain "$n" n)
two=$(drain $((2 * n)) 2n)
per=$(((two - one) / n))
echo "instructions per message: $per (Ir $one for $n messages, $two for $((2 * n)); shape $shape, partitions $partitions, sink $sink)"
echo "profile of the $((2 * n))-message run: callgrind_annotate $out/callgrind.2n.out | head -40"
