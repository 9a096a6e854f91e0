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
# 2. Two nodes of 2 ranks (4 ranks) in network namespaces (needs root and `ip netns`; skipped with
#    a line that says why otherwise): a hub namespace with a bridge, two node namespaces on veth
#    pairs (10.78.0.1, 10.78.0.2), one agent in each (c10d rendezvous on node 0, a fresh rdzv id
#    per trial). The same trials and measures as 1, the loop (the node whose worker died replaces
#    it alone; the other node's workers re-form through the round store's generation) against
#    --classic, alternating: a SIGKILL of local rank 1 on the node without rank 0, and of the
#    other rank on rank 0's node. The namespaces carry the bench's pid in their names
#    (trecover<PID>...) and are removed at the end, also on an error or SIGINT/SIGTERM/SIGHUP;
#    those of a dead run are removed at the next start.
# 3. The state transfer of 1 GiB (build/bench/state_transfer): between two local ranks against
#    memcpy, between two one-rank nodes on loopback (Gloo) against a loopback TCP stream, and
#    between two one-rank nodes in the namespaces of 2 against a TCP stream between them.
#
# RESULT lines: recover_one_node_ms (the loop's median; peer: the classic path's median; ratio
# classic/loop), recover_steps_redone (the loop's most; peer: the classic path's mean; ratio
# (classic + 1) / (loop + 1)); the same two for two nodes, a kill on the node without rank 0:
# recover_two_nodes_ms, recover_two_nodes_steps_redone, and on rank 0's node:
# recover_two_nodes_rank0_node_ms, recover_two_nodes_rank0_node_steps_redone;
# state_transfer_local_gbps (peer memcpy; ratio transfer/memcpy, the target is 0.5),
# state_transfer_nodes_gbps (peer the loopback TCP stream), state_transfer_netns_gbps (peer the TCP
# stream between the namespaces).
# Environment: TRUN_BUILD_DIR (default build). Extra arguments after TRIALS go to bench/recover.py
# (e.g. --parts two-nodes).
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-5}
build=${TRUN_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target trun train_mlp state_transfer >/dev/null
exec python3 bench/recover.py --trun "$build/launcher/trun" --train-mlp "$build/examples/train_mlp" \
  --state-transfer "$build/bench/state_transfer" --trials "$trials" "${@:2}"
