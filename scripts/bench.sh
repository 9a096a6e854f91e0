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
  ddp_net) exec bash scripts/bench_ddp_net.sh "${@:2}" ;;
  libtorch) exec bash scripts/bench_libtorch.sh "${@:2}" ;;
  checkpoint) exec bash scripts/bench_checkpoint.sh "${@:2}" ;;
  cluster) exec bash scripts/bench_cluster.sh "${@:2}" ;;
  soak) exec bash scripts/soak.sh "${@:2}" ;;
  observability) exec bash scripts/bench_observability.sh "${@:2}" ;;
  hang) exec bash scripts/bench_hang.sh "${@:2}" ;;
  straggler) exec bash scripts/bench_straggler.sh "${@:2}" ;;
  goodput) exec bash scripts/bench_goodput.sh "${@:2}" ;;
  recover) exec bash scripts/bench_recover.sh "${@:2}" ;;
  launch)
    # trun vs torchrun 1.13 in the same run: launch latency (N=1,2,4,8), restart latency (N=4),
    # the agent's RSS/CPU over 10 s with idle workers. Extra arguments go to launch_bench
    # (--quick, --reps N, --torchrun PATH). Builds in $TRUN_BUILD_DIR (default build/).
    build=${TRUN_BUILD_DIR:-build}
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRUN_BUILD_BENCH=ON >/dev/null
    cmake --build "$build" --target trun launch_probe launch_bench
    exec "$build/bench/launch_bench" --trun "$build/launcher/trun" \
      --probe "$build/bench/launch_probe" "${@:2}"
    ;;
  *)
    echo "usage: scripts/bench.sh NAME   (NAME: store, launch, rdzv, cluster, observability, hang, straggler, goodput, recover, allreduce, ddp, ddp_net, libtorch, checkpoint, soak)" >&2
    exit 2
    ;;
esac
