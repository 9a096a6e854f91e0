#!/usr/bin/env bash
# Recovery without lost work (issue 38, docs/worker_sdk.md "Resilient loop"):
#   scripts/bench.sh recover [TRIALS]
#
# 1. One node of 4 ranks (build/examples/train_mlp, 20 ms steps, a checkpoint every 20 steps):
#    a worker SIGKILLed at a seeded step, with the resilient loop (the default: trun replaces the
#    killed worker alone and the others take it in) and with --classic (trun restarts the whole
#    group, which resumes from the checkpoint), alternating in the same run, TRIALS each (default
#    5). Measured: from the SIGKILL to rank 0's first completed step in the re-formed group, and
#    the steps rank 0 had completed that were trained again.
# 2. The state transfer of 1 GiB (build/bench/state_transfer): between two local ranks against
#    memcpy, and between two one-rank nodes on loopback (Gloo) against a loopback TCP stream.
#
# RESULT lines: recover_one_node_ms (the loop's median; peer: the classic path's median; ratio
# classic/loop), recover_steps_redone (the loop's most; peer: the classic path's mean; ratio
# (classic + 1) / (loop + 1)), state_transfer_local_gbps (peer memcpy; ratio transfer/memcpy, the
# target is 0.5), state_transfer_nodes_gbps (peer the TCP stream).
# Not measured yet: two network-namespace nodes of 2 (the loop re-forms on one node only so far:
# across nodes trun restarts the whole group, as the classic path does).
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-5}
build=${TRUN_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target trun train_mlp state_transfer >/dev/null
exec python3 bench/recover.py --trun "$build/launcher/trun" --train-mlp "$build/examples/train_mlp" \
  --state-transfer "$build/bench/state_transfer" --trials "$trials"
