#!/usr/bin/env bash
# Hang recovery (issue 36, "Hangs are failures"): scripts/bench.sh hang [options]
#
# For one node of 4 ranks and for two network-namespace nodes of 2 ranks, rank 3 of a training
# job hangs in one of three ways: SIGSTOP (sent by the bench to its pid), a spin loop in user
# code, a collective mismatch (it broadcasts where the others allreduce). Measured: the time
# from the fault to the replacement group's first step, and whether the launcher names rank 3.
#   trun (nothing configured)      build/examples/train_mlp under build/launcher/trun
#   torchrun, default timeout      bench/hang_torch.py (the DDP tutorial's ToyModel, gloo) under
#                                  /usr/bin/torchrun 1.13; gloo's default timeout is 30 min, so
#                                  these rows stop waiting at --default-cap (60 s) and say so
#   torchrun, short timeout        the same with init_process_group(timeout=2 s) (--torch-timeout;
#                                  the shortest whole second without false positives here)
# Every job runs with --max-restarts 3 and checkpoints every 20 steps (steps of about 50 ms).
# Prints a table, then RESULT lines: hang_recovery_<fault>_<topology> (value: trun's median
# seconds; peer: torchrun with the short timeout; ratio = peer/value, bigger is better) and
# hang_culprit_named (trials where trun's verdict named rank 3). Target (issue 36): within
# max(10 s, 3 x p99 step time) + 1 s, culprit named in 20 of 20 trials (--trials 20).
#
# A fault that does not hang is reported as what it led to. Under trun a mismatch among the ranks
# of one node is no hang: libtrun_worker's shared-memory path compares the ranks' calls and every
# local rank fails at once with a CollectiveError naming the local ranks whose call differs from
# the majority's; those rows say "no hang verdict; ..." and count the culprit it names (turned
# into a global rank with the node's "hangbench start" lines).
#
# Options (bench/hang_bench.py):
#   --trials N          trials per trun and short-timeout row (default 3; torchrun-default rows 1)
#   --quick             1 trial per row, default-timeout rows capped at 30 s (about 10 minutes)
#   --cap S             give up on a row's trial S seconds after the fault (default 90): ">S"
#   --default-cap S     the same for torchrun with its default timeout (default 60)
#   --torch-timeout S   the short timeout (default 2)
#   --launchers L,...   trun,torch_default,torch_short   --kinds sigstop,spin,mismatch
#   --topos 1x4,2x2     (2x2 needs root for the namespaces; skipped otherwise)
# Env: TRUN_BUILD_DIR (default build), TORCH_PY, TORCHRUN, HANG_BENCH_KEEP=1 keeps the logs.
# Cleans up what it starts (processes by pid, namespaces hb<pid>*) also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD=${TRUN_BUILD_DIR:-build}
if [[ ! -f "$BUILD/build.ninja" ]]; then
  flock /tmp/trun-build.lock cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
log=$(flock /tmp/trun-build.lock cmake --build "$BUILD" -j2 --target trun train_mlp 2>&1) ||
  { echo "$log" | tail -n 40 >&2; echo "bench_hang: building trun and train_mlp failed" >&2; exit 1; }
exec "$TORCH_PY" bench/hang_bench.py --trun "$BUILD/launcher/trun" \
  --train-mlp "$BUILD/examples/train_mlp" --python "$TORCH_PY" --torchrun "$TORCHRUN" \
  --hang-torch bench/hang_torch.py "$@"
