#!/usr/bin/env bash
# Runs one benchmark by name: scripts/bench.sh NAME. Each builds what it needs, prints a table,
# and ends with RESULT lines (name, value, unit, peer, ratio where bigger is better).
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-}
case "$name" in
  store) exec bash scripts/bench_store.sh "${@:2}" ;;
  *)
    echo "usage: scripts/bench.sh NAME   (NAME: store)" >&2
    exit 2
    ;;
esac
