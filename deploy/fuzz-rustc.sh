#!/usr/bin/env bash
# The RUSTC_WORKSPACE_WRAPPER of deploy/fuzz.sh: cargo calls it for this package's own crates
# only (the library and the fuzz targets), never for a dependency, so the dependencies are the
# ones the test build already compiled. It adds libFuzzer's coverage instrumentation
# (PGOUTBOX_FUZZ_RUSTFLAGS) to a compilation, and nothing to cargo's queries of rustc.
rustc=$1
shift
if [[ " $* " == *" --crate-name "* ]]; then
    # shellcheck disable=SC2086 # the flags are words
    exec "$rustc" "$@" $PGOUTBOX_FUZZ_RUSTFLAGS
fi
exec "$rustc" "$@"
