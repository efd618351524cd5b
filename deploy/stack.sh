#!/usr/bin/env bash
# Local throwaway stack for pgoutbox: a private PostgreSQL cluster (logical
# replication enabled) and a private RabbitMQ node, both on free ports, both
# living entirely under one directory. Never touches system instances.
#
#   deploy/stack.sh install          install postgresql + rabbitmq-server (apt) if missing
#   deploy/stack.sh start DIR        start both, write DIR/env (source-able), print it
#                                    (PGOUTBOX_STACK_PLUGINS=a,b: RabbitMQ plugins on from boot;
#                                    with rabbitmq_stream, a stream listener on a free port too:
#                                    RABBITMQ_STREAM_PORT in DIR/env)
#   deploy/stack.sh stop DIR         stop both, leave nothing running
#   deploy/stack.sh ctl DIR ARGS...  run rabbitmqctl against DIR's node
#   deploy/stack.sh plugins DIR ARGS...
#                                    run rabbitmq-plugins against DIR's node, e.g.
#                                    `plugins DIR enable rabbitmq_consistent_hash_exchange`
#                                    (never the system broker's enabled-plugins file)
#   deploy/stack.sh psql DIR ARGS... run psql against DIR's cluster (as postgres)
set -euo pipefail

PG_VERSION_HINT="${PG_VERSION_HINT:-}"

die() { echo "stack.sh: $*" >&2; exit 1; }
log() { echo "stack.sh: $*" >&2; }

pg_bin_dir() {
    if [[ -n "${PG_BIN_DIR:-}" ]]; then echo "$PG_BIN_DIR"; return; fi
    local d
    if [[ -n "$PG_VERSION_HINT" && -x "/usr/lib/postgresql/$PG_VERSION_HINT/bin/initdb" ]]; then
        echo "/usr/lib/postgresql/$PG_VERSION_HINT/bin"; return
    fi
    # Highest installed version.
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [[ -x "$d/initdb" && -x "$d/postgres" ]]; then echo "$d"; return; fi
    done
    if command -v pg_config >/dev/null 2>&1 && [[ -x "$(pg_config --bindir)/initdb" ]]; then
        pg_config --bindir; return
    fi
    return 1
}

rabbit_bin_dir() {
    if [[ -n "${RABBITMQ_BIN_DIR:-}" ]]; then echo "$RABBITMQ_BIN_DIR"; return; fi
    if [[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]]; then echo /usr/lib/rabbitmq/bin; return; fi
    return 1
}

epmd_bin() {
    if command -v epmd >/dev/null 2>&1; then command -v epmd; return; fi
    local e
    for e in /usr/lib/erlang/bin/epmd /usr/lib/erlang/erts-*/bin/epmd; do
        [[ -x "$e" ]] && { echo "$e"; return; }
    done
    return 1
}

cmd_install() {
    local missing=()
    pg_bin_dir >/dev/null 2>&1 || missing+=(postgresql)
    rabbit_bin_dir >/dev/null 2>&1 || missing+=(rabbitmq-server)
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "postgresql and rabbitmq-server already installed"
        return 0
    fi
    log "installing: ${missing[*]}"
    local sudo=()
    [[ "$(id -u)" -ne 0 ]] && sudo=(sudo)
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        postgresql rabbitmq-server procps iproute2
    pg_bin_dir >/dev/null || die "postgres binaries still missing after install"
    rabbit_bin_dir >/dev/null || die "rabbitmq binaries still missing after install"
}

# Free TCP port on 127.0.0.1 (not in the exclusion list given as args).
free_port() {
    local p tries=0
    while :; do
        p=$(( (RANDOM << 15 | RANDOM) % 20000 + 20000 ))
        tries=$((tries + 1))
        [[ $tries -gt 500 ]] && die "no free port found"
        local skip=0 x
        for x in "$@"; do [[ "$x" == "$p" ]] && skip=1; done
        [[ $skip -eq 1 ]] && continue
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            if command -v ss >/dev/null 2>&1; then
                ss -Htan "( sport = :$p )" 2>/dev/null | grep -q . && continue
            fi
            echo "$p"; return
        fi
    done
}

# Run a command as the postgres OS user when we are root (initdb/postgres
# refuse to run as root); otherwise as ourselves.
as_pg() {
    if [[ "$(id -u)" -eq 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

wait_tcp() { # port timeout_s
    local port=$1 deadline=$(( $(date +%s) + $2 ))
    while ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
        [[ $(date +%s) -ge $deadline ]] && return 1
        sleep 0.1
    done
}

rabbit_env() { # DIR -> exports env for the node in DIR (needs DIR/rabbit/ports)
    local dir=$1 r="$1/rabbit"
    [[ -f "$r/ports" ]] || die "no rabbit node in $dir"
    # shellcheck disable=SC1091
    source "$r/ports"
    export HOME="$r/home"
    export RABBITMQ_NODENAME="$NODENAME"
    export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
    export RABBITMQ_NODE_PORT="$AMQP_PORT"
    export RABBITMQ_DIST_PORT="$DIST_PORT"
    export ERL_EPMD_PORT="$EPMD_PORT"
    export ERL_EPMD_ADDRESS=127.0.0.1
    export RABBITMQ_CTL_DIST_PORT_MIN="$CTL_PORT_MIN"
    export RABBITMQ_CTL_DIST_PORT_MAX="$CTL_PORT_MAX"
    export RABBITMQ_MNESIA_BASE="$r/mnesia"
    export RABBITMQ_LOG_BASE="$r/log"
    export RABBITMQ_ENABLED_PLUGINS_FILE="$r/enabled_plugins"
    export RABBITMQ_CONFIG_FILE="$r/rabbitmq.conf"
    export RABBITMQ_ADVANCED_CONFIG_FILE="$r/advanced.config"
    export RABBITMQ_CONF_ENV_FILE="$r/rabbitmq-env.conf"
    export RABBITMQ_PID_FILE="$r/pid"
    # Scheduler busy-waiting off (+sbwt none ...): RabbitMQ's runtime-tuning advice for a node
    # that shares its cores with other processes, as this one does with Postgres, the streamer
    # and the tests. Busy-waiting Erlang schedulers spin on a core after each bit of work; on
    # 2 cores at 2,000-4,000 msg/s that took ~6 points of the machine's busy share from the rest
    # of the pipeline (bench scenario 4, 2026-12-02). PGOUTBOX_STACK_RABBIT_ERL_ARGS is appended
    # (e.g. "+sbwt medium" to compare).
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} +sbwt none +sbwtdcpu none +sbwtdio none ${PGOUTBOX_STACK_RABBIT_ERL_ARGS:-}"
    export RABBITMQ_PLUGINS_EXPAND_DIR="$r/plugins-expand"
}

start_pg() {
    local dir=$1 bin pg="$1/pg" port sock
    bin=$(pg_bin_dir) || die "postgres not installed (run: $0 install)"
    port=$(free_port 2>/dev/null)
    mkdir -p "$pg"
    # Unix socket paths are limited to ~107 bytes.
    sock="$pg"
    if [[ ${#sock} -gt 80 ]]; then
        sock=$(mktemp -d /tmp/pgoutbox-sock.XXXXXX)
    fi
    if [[ "$(id -u)" -eq 0 ]]; then
        chown postgres: "$pg" "$sock"
        runuser -u postgres -- test -w "$pg" \
            || die "$pg is not reachable by the postgres OS user (parent dir permissions); use a DIR under /tmp"
    fi
    as_pg "$bin/initdb" -D "$pg/data" -U postgres --auth=trust -E UTF8 --locale=C --no-sync >"$pg/initdb.log" 2>&1 \
        || { cat "$pg/initdb.log" >&2; die "initdb failed"; }
    as_pg tee -a "$pg/data/postgresql.conf" >/dev/null <<EOF

# --- pgoutbox stack.sh ---
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$sock'
wal_level = logical
max_replication_slots = 32
max_wal_senders = 32
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
log_line_prefix = '%m [%p] %q%u@%d '
EOF
    as_pg "$bin/pg_ctl" -D "$pg/data" -l "$pg/postgres.log" -w -t 60 start >/dev/null \
        || { tail -50 "$pg/postgres.log" >&2; die "postgres failed to start"; }
    cat >"$pg/ports" <<EOF
PG_BIN_DIR=$bin
PG_PORT=$port
PG_SOCKET_DIR=$sock
EOF
}

stop_pg() {
    local dir=$1 pg="$1/pg"
    [[ -f "$pg/ports" ]] || return 0
    # shellcheck disable=SC1091
    source "$pg/ports"
    [[ -f "$pg/data/postmaster.pid" ]] || return 0
    as_pg "$PG_BIN_DIR/pg_ctl" -D "$pg/data" -m fast -t 20 -w stop >/dev/null 2>&1 \
        || as_pg "$PG_BIN_DIR/pg_ctl" -D "$pg/data" -m immediate -t 20 -w stop >/dev/null 2>&1 \
        || true
    if [[ "$PG_SOCKET_DIR" == /tmp/pgoutbox-sock.* ]]; then rm -rf "$PG_SOCKET_DIR"; fi
}

start_rabbit() {
    local dir=$1 r="$1/rabbit" bin amqp dist epmd ctl name
    bin=$(rabbit_bin_dir) || die "rabbitmq not installed (run: $0 install)"
    amqp=$(free_port)
    dist=$(free_port "$amqp")
    epmd=$(free_port "$amqp" "$dist")
    ctl=$(free_port "$amqp" "$dist" "$epmd")
    name="pgoutbox-stack-$$-$amqp@localhost"
    mkdir -p "$r/home" "$r/mnesia" "$r/log"
    chmod 700 "$r/home"
    # PGOUTBOX_STACK_PLUGINS: plugins enabled from the node's first boot (comma-separated,
    # e.g. rabbitmq_consistent_hash_exchange); later, `stack.sh plugins DIR enable NAME`.
    echo "[${PGOUTBOX_STACK_PLUGINS:-}]." >"$r/enabled_plugins"
    : >"$r/rabbitmq-env.conf"
    # The stream plugin listens on a port of its own (5552 by default, which may be taken):
    # a free one, and what its Metadata answers name as this node's address. Only with the
    # plugin: without it these keys are unknown and the node refuses to boot.
    local stream=0 stream_conf=""
    if [[ ",${PGOUTBOX_STACK_PLUGINS:-}," == *,rabbitmq_stream,* ]]; then
        stream=$(free_port "$amqp" "$dist" "$epmd" "$ctl")
        stream_conf="stream.listeners.tcp.1 = 127.0.0.1:$stream
stream.advertised_host = 127.0.0.1
stream.advertised_port = $stream"
    fi
    # cluster_name: the node's own name (RabbitMQ's default would put the machine's host name
    # in it, not localhost), which `pgoutbox declare-topology` reads to name this node in the
    # command that enables a plugin.
    cat >"$r/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$amqp
cluster_name = $name
loopback_users.guest = true
log.file.level = info
log.console = false
$stream_conf
EOF
    cat >"$r/ports" <<EOF
RABBIT_BIN_DIR=$bin
NODENAME=$name
AMQP_PORT=$amqp
DIST_PORT=$dist
EPMD_PORT=$epmd
CTL_PORT_MIN=$ctl
CTL_PORT_MAX=$((ctl + 10))
STREAM_PORT=$stream
EOF
    (
        rabbit_env "$dir"
        cd "$r"
        # setsid: detach from our terminal/process group so ^C in the caller does not kill it.
        setsid "$bin/rabbitmq-server" >"$r/server.out" 2>&1 </dev/null &
        echo $! >"$r/launcher.pid"
    )
    if ! wait_tcp "$amqp" 60; then
        tail -50 "$r/server.out" >&2 || true
        die "rabbitmq did not open AMQP port $amqp"
    fi
    (rabbit_env "$dir"; "$bin/rabbitmqctl" -q await_startup --timeout 60 >/dev/null) \
        || die "rabbitmq did not finish startup"
    if [[ $stream -ne 0 ]] && ! wait_tcp "$stream" 60; then
        tail -50 "$r/server.out" >&2 || true
        die "rabbitmq did not open the stream port $stream"
    fi
}

stop_rabbit() {
    local dir=$1 r="$1/rabbit"
    [[ -f "$r/ports" ]] || return 0
    (
        rabbit_env "$dir"
        local pid=""
        [[ -f "$r/pid" ]] && pid=$(cat "$r/pid" 2>/dev/null || true)
        if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
            timeout 30 "$RABBIT_BIN_DIR/rabbitmqctl" -q stop "$r/pid" >/dev/null 2>&1 || true
            if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
        fi
        if [[ -f "$r/launcher.pid" ]]; then kill -9 "$(cat "$r/launcher.pid")" 2>/dev/null || true; fi
        # Our private epmd (on EPMD_PORT) outlives the node: kill it.
        local e
        if e=$(epmd_bin); then "$e" -port "$EPMD_PORT" -kill >/dev/null 2>&1 || true; fi
    )
}

write_env() {
    local dir=$1
    # shellcheck disable=SC1091
    source "$dir/pg/ports"
    # shellcheck disable=SC1091
    source "$dir/rabbit/ports"
    cat >"$dir/env" <<EOF
PGOUTBOX_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres
PGOUTBOX_AMQP_URL=amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f
PGOUTBOX_STACK_DIR=$dir
PGHOST=$PG_SOCKET_DIR
PGPORT=$PG_PORT
PGUSER=postgres
PG_PORT=$PG_PORT
PG_SOCKET_DIR=$PG_SOCKET_DIR
PG_BIN_DIR=$PG_BIN_DIR
RABBITMQ_NODENAME=$NODENAME
RABBITMQ_AMQP_PORT=$AMQP_PORT
RABBITMQ_DIST_PORT=$DIST_PORT
RABBITMQ_EPMD_PORT=$EPMD_PORT
EOF
    if [[ ${STREAM_PORT:-0} -ne 0 ]]; then
        echo "RABBITMQ_STREAM_PORT=$STREAM_PORT" >>"$dir/env"
    fi
}

cmd_start() {
    local dir=${1:?usage: stack.sh start DIR}
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [[ -f "$dir/pg/data/postmaster.pid" || -f "$dir/rabbit/pid" ]]; then
        die "$dir already holds a running (or unclean) stack; run: $0 stop $dir"
    fi
    rm -rf "${dir:?}/pg" "${dir:?}/rabbit" "$dir/env"
    STACK_STARTED=0
    STACK_DIR=$dir
    trap 'if [[ $STACK_STARTED -eq 0 ]]; then log "start failed, cleaning up"; stop_rabbit "$STACK_DIR"; stop_pg "$STACK_DIR"; fi' EXIT
    start_pg "$dir" &
    local pgjob=$!
    start_rabbit "$dir"
    wait "$pgjob" || die "postgres start failed"
    STACK_STARTED=1
    write_env "$dir"
    cat "$dir/env"
}

cmd_stop() {
    local dir=${1:?usage: stack.sh stop DIR}
    [[ -d "$dir" ]] || { log "$dir does not exist"; return 0; }
    dir=$(cd "$dir" && pwd)
    stop_rabbit "$dir" &
    local rj=$!
    stop_pg "$dir"
    wait "$rj" || true
    rm -f "$dir/rabbit/pid" "$dir/rabbit/launcher.pid"
    log "stopped stack in $dir"
}

cmd_ctl() {
    local dir=${1:?usage: stack.sh ctl DIR ARGS...}
    shift
    dir=$(cd "$dir" && pwd)
    rabbit_env "$dir"
    exec "$RABBIT_BIN_DIR/rabbitmqctl" "$@"
}

# rabbitmq-plugins for the stack's node. Sourcing DIR/env and running rabbitmq-plugins does not
# do this: the CLI cannot reach the node (its epmd port and Erlang cookie are the stack's own),
# falls back to an "Offline change" and edits the system broker's enabled-plugins file
# (/etc/rabbitmq/enabled_plugins). Here the CLI runs with the node's own environment (node
# name, epmd port, cookie, RABBITMQ_ENABLED_PLUGINS_FILE=DIR/rabbit/enabled_plugins), and
# enable/disable go --online: applied to the running node at once, or an error if it cannot
# be reached, never an offline edit elsewhere. A stopped node's file is edited with
# `plugins DIR enable --offline NAME`.
cmd_plugins() {
    local dir=${1:?usage: stack.sh plugins DIR ARGS...}
    shift
    dir=$(cd "$dir" && pwd)
    rabbit_env "$dir"
    local args=("$@")
    if [[ ${1:-} == enable || ${1:-} == disable ]]; then
        local a mode=--online
        for a in "$@"; do [[ $a == --offline || $a == --online ]] && mode=""; done
        [[ -n $mode ]] && args+=("$mode")
    fi
    exec "$RABBIT_BIN_DIR/rabbitmq-plugins" -n "$NODENAME" "${args[@]}"
}

cmd_psql() {
    local dir=${1:?usage: stack.sh psql DIR ARGS...}
    shift
    dir=$(cd "$dir" && pwd)
    # shellcheck disable=SC1091
    source "$dir/pg/ports"
    exec "$PG_BIN_DIR/psql" -h "$PG_SOCKET_DIR" -p "$PG_PORT" -U postgres "$@"
}

sub=${1:-}
[[ $# -gt 0 ]] && shift
case "$sub" in
    install) cmd_install "$@" ;;
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    ctl) cmd_ctl "$@" ;;
    plugins) cmd_plugins "$@" ;;
    psql) cmd_psql "$@" ;;
    *) echo "usage: $0 {install|start DIR|stop DIR|ctl DIR args...|plugins DIR args...|psql DIR args...}" >&2; exit 2 ;;
esac
