#!/usr/bin/env bash
# The Python client the tests read and write RabbitMQ streams with, a client pgoutbox did not
# write (tests/support/stream.rs, tests/support/read_stream.py): `rstream` from PyPI, pinned
# with its dependencies, in a virtual environment of the repository's own. Prints the
# environment's python on stdout (progress on stderr); installs only when the pins changed.
#
#   bash deploy/test-python.sh      # -> /path/to/repo/target/python/bin/python
#
# deploy/test.sh runs it; the tests run it too (once per test process), so a plain
# `cargo nextest run` installs it as well. Two runs at once wait for each other (flock).
#   PGOUTBOX_TEST_PYTHON_VENV   the environment's directory (default: target/python)
# python3 comes from the system; on a fresh Debian machine the venv module (python3-venv) is
# installed through apt when missing, as root.
set -euo pipefail
cd "$(dirname "$0")/.."

# The pins: rstream and what it needs (mmh3, a C extension, installs from a prebuilt wheel
# of PyPI's for Linux; seen on CPython 3.11).
pins="rstream==1.1.1 mmh3==5.3.1 typing_extensions==4.16.0"

venv="${PGOUTBOX_TEST_PYTHON_VENV:-target/python}"
mkdir -p "$(dirname "$venv")"
venv="$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")"
stamp="$venv/.pins"

if [[ -x "$venv/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "$pins" ]]; then
    echo "$venv/bin/python"
    exit 0
fi

exec 9>"$venv.lock"
flock 9
# Another run may have installed it while this one waited.
if [[ -x "$venv/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "$pins" ]]; then
    echo "$venv/bin/python"
    exit 0
fi

if ! command -v python3 >/dev/null 2>&1; then
    [[ "$(id -u)" == 0 ]] || { echo "test-python.sh: python3 is missing and only root can install it (apt-get install python3 python3-venv)" >&2; exit 1; }
    echo "test-python.sh: installing python3 through apt" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >&2
fi
rm -rf "$venv"
# Debian's python3 has no ensurepip without python3-venv: `python3 -m venv` fails.
if ! python3 -m venv "$venv" >&2; then
    rm -rf "$venv"
    [[ "$(id -u)" == 0 ]] || { echo "test-python.sh: python3 -m venv failed and only root can install python3-venv (apt-get install python3-venv)" >&2; exit 1; }
    echo "test-python.sh: installing python3-venv through apt" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
    python3 -m venv "$venv" >&2
fi
echo "test-python.sh: installing $pins into $venv" >&2
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input $pins >&2
"$venv/bin/python" -c 'import rstream' >&2
echo "$pins" >"$stamp"
echo "$venv/bin/python"
