#!/usr/bin/env bash
# Runs one benchmark by name: scripts/bench.sh NAME. Each builds what it needs, prints a table,
# and ends with RESULT lines (name, value, unit, peer, ratio where bigger is better).
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-}
case "$name" in
  store) exec bash scripts/bench_store.sh "${@:2}" ;;
  rdzv) exec bash scripts/bench_rdzv.sh "${@:2}" ;;
  allreduce) exec bash scripts/bench_allreduce.sh "${@:2}" ;;
  ddp) exec bash scripts/bench_ddp.sh "${@:2}" ;;
  checkpoint) exec bash scripts/bench_checkpoint.sh "${@:2}" ;;
  *)
    echo "usage: scripts/bench.sh NAME   (NAME: store, rdzv, allreduce, ddp, checkpoint)" >&2
    exit 2
    ;;
esac
