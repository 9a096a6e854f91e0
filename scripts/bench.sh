#!/usr/bin/env bash
# Runs one benchmark by name, building what it needs first (RelWithDebInfo, in $TRUN_BUILD_DIR or
# build/). Each benchmark measures its peer in the same run, prints a table and ends with
# `RESULT name=... value=... unit=... peer=... ratio=...` lines.
# Usage: scripts/bench.sh NAME [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${TRUN_BUILD_DIR:-build}

configure() {
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRUN_BUILD_BENCH=ON >/dev/null
}

name=${1:-}
shift || true
case "$name" in
  launch)
    # trun vs torchrun 1.13: launch latency (N=1,2,4,8), restart latency, idle RSS/CPU.
    configure
    cmake --build "$BUILD" --target trun launch_probe launch_bench
    "$BUILD/bench/launch_bench" --trun "$BUILD/launcher/trun" --probe "$BUILD/bench/launch_probe" "$@"
    ;;
  *)
    echo "usage: scripts/bench.sh NAME [ARGS...]; NAME is one of: launch" >&2
    exit 2
    ;;
esac
