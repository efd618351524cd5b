#!/usr/bin/env bash
# Builds the book (docs/, an mdBook) into docs/book/: `bash deploy/docs.sh`.
#
# Installs mdbook from crates.io when it is missing, with no default features: `watch`,
# `serve` and `search` are for writers and readers of a served copy, not for building, and
# leaving them out roughly halves the install. MDBOOK_VERSION pins the version installed.
# The link check is the test `docs_links::` in the integration binary (cargo test).
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=${MDBOOK_VERSION:-0.5.4}
export PATH="$HOME/.cargo/bin:$PATH"

if ! command -v mdbook >/dev/null 2>&1; then
    echo "docs.sh: installing mdbook $MDBOOK_VERSION from crates.io (a few minutes, once)" >&2
    # --debug: an unoptimised build compiles in roughly half the time, and builds this book
    # in about a second all the same.
    cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --debug
fi
# mdbook 0.5 logs some mistakes (an unknown key in book.toml) at ERROR and still exits 0:
# treat any ERROR or WARN line as a failure, so CI sees it.
log=$(mdbook build docs 2>&1) || { echo "$log" >&2; exit 1; }
echo "$log" >&2
if grep -Eq '^ *(ERROR|WARN)' <<<"$log"; then
    echo "docs.sh: mdbook reported an error or warning (above)" >&2
    exit 1
fi
echo "docs.sh: built docs/book/index.html" >&2
