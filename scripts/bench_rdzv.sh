#!/usr/bin/env bash
# Rendezvous benchmark (scripts/bench.sh rdzv): N simulated agents run trun's real c10d
# rendezvous over real TCP connections to a real store (threads in a few processes), N = 8, 16,
# 32, 64, 512, 2048: time until every agent has its rank, and store requests per agent. Peer in
# the same run: PyTorch 1.13's dynamic rendezvous with the c10d backend, one process per agent,
# N = 8, 16, 32 (what fits on this machine). Target: 2048 nodes in under 2 s.
# Options (environment): RDZV_NODES (default 8,16,32,64,512,2048), RDZV_PEER_NODES (8 16 32),
# RDZV_PROCS (agent processes for trun, default 4).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD_DIR=${TRUN_BUILD_DIR:-build}
bench_build "$BUILD_DIR" rdzv_bench

peer_file=$(mktemp /tmp/trun-rdzv-peer.XXXXXX)
trap 'rm -f "$peer_file"' EXIT
if /usr/bin/python3 -c "import torch.distributed.elastic" 2>/dev/null; then
  echo "peer: PyTorch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)') c10d rendezvous, N = ${RDZV_PEER_NODES:-8 16 32} ..." >&2
  # shellcheck disable=SC2086
  /usr/bin/python3 bench/rdzv_torch_peer.py ${RDZV_PEER_NODES:-8 16 32} >"$peer_file" 2>/dev/null ||
    echo "peer: failed (its numbers are left out)" >&2
else
  echo "peer: /usr/bin/python3 has no torch; no peer figures" >&2
fi
echo "trun: N = ${RDZV_NODES:-8,16,32,64,512,2048}, agents in ${RDZV_PROCS:-4} processes" >&2
"$BUILD_DIR/bench/rdzv_bench" --nodes "${RDZV_NODES:-8,16,32,64,512,2048}" \
  --procs "${RDZV_PROCS:-4}" --peer-file "$peer_file"
