#!/usr/bin/env bash
# Rendezvous benchmark (scripts/bench.sh rdzv).
# 1. Scale (bench/rdzv_scale): N simulated agents, event-driven (no thread per agent), run trun's
#    c10d join protocol over real TCP connections against a real store; the agent drawing ticket 1
#    runs the real leader. N = 64 .. 100,000; above what one process may hold (a descriptor per
#    connection) the agents go through store relays (store/relay.h). Then a round of
#    10,000 nodes in which one leaves: time until every survivor has the next round.
#    Targets: 2048 nodes < 1 s, 100,000 < 30 s, <= 5 requests per agent.
#    Peer in the same run: PyTorch 1.13's dynamic rendezvous (c10d backend, one process per
#    agent), N = 8, 16, 32, 64, 128, 256 until a size takes over 60 s or fails.
# 2. The etcd backend (bench/rdzv_bench, agents as threads) against an etcd of our own on
#    loopback (v2 API enabled for the peer), N = 8, 16, 32, 64, 256, with PyTorch 1.13's etcd-v2
#    rendezvous (python3-etcd) as the peer at N = 8, 16, 32.
# The RESULT lines of both come last.
# Options (environment): RDZV_NODES (64,128,256,1024,2048,4096,16384,32768,65536,100000),
# RDZV_LEAVE (10000; 0: no leave scenario), RDZV_PEER_NODES (8 16 32 64 128 256),
# RDZV_PEER_BUDGET (60 s), RDZV_ETCD_NODES (8,16,32,64,256), RDZV_ETCD_PEER_NODES (8 16 32),
# RDZV_PROCS (etcd agent processes, 4); RDZV_ETCD=0 leaves the etcd part out.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD_DIR=${TRUN_BUILD_DIR:-build}
bench_build "$BUILD_DIR" rdzv_bench rdzv_scale

peer_file=$(mktemp /tmp/trun-rdzv-peer.XXXXXX)
results=$(mktemp /tmp/trun-rdzv-results.XXXXXX)
etcd_dir="" etcd_pid=""
cleanup() {
  if [[ -n "$etcd_pid" ]]; then kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true; fi
  rm -rf "$peer_file" "$results" ${etcd_dir:+"$etcd_dir"}
}
trap cleanup EXIT

# Runs rdzv_bench with ARGS: its table now, its RESULT lines kept for the end.
run_bench() {
  local out rc=0
  out=$("$BUILD_DIR/bench/rdzv_bench" "$@") || rc=$?
  grep -v '^RESULT ' <<<"$out" || true
  grep '^RESULT ' <<<"$out" >>"$results" || true
  return $rc
}
peer_nodes=${RDZV_PEER_NODES:-8 16 32 64 128 256}
if /usr/bin/python3 -c "import torch.distributed.elastic" 2>/dev/null; then
  echo "peer: PyTorch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)') c10d rendezvous, N = $peer_nodes until one takes over ${RDZV_PEER_BUDGET:-60} s ..." >&2
  # shellcheck disable=SC2086
  /usr/bin/python3 bench/rdzv_torch_peer.py --budget "${RDZV_PEER_BUDGET:-60}" $peer_nodes \
    >"$peer_file" 2> >(grep '^peer' >&2) || echo "peer: failed (its numbers are left out)" >&2
  grep '^peer' "$peer_file" >&2 || true
else
  echo "peer: /usr/bin/python3 has no torch; no peer figures" >&2
fi
echo "trun: N = ${RDZV_NODES:-64,128,256,1024,2048,4096,16384,32768,65536,100000} simulated agents" >&2
status=0
scale_out=$(mktemp /tmp/trun-rdzv-scale.XXXXXX)
"$BUILD_DIR/bench/rdzv_scale" --nodes "${RDZV_NODES:-64,128,256,1024,2048,4096,16384,32768,65536,100000}" \
  --leave "${RDZV_LEAVE:-10000}" --peer-file "$peer_file" >"$scale_out" &
scale_pid=$!
tail -f --pid="$scale_pid" "$scale_out" | grep --line-buffered -v '^RESULT ' || true
wait "$scale_pid" || status=$?
grep '^RESULT ' "$scale_out" >>"$results" || true
rm -f "$scale_out"

if [[ "${RDZV_ETCD:-1}" != 0 && -x /usr/bin/etcd ]]; then
  echo
  etcd_dir=$(mktemp -d /tmp/trun-rdzv-etcd.XXXXXX)
  client_port=$(free_port)
  peer_port=$(free_port)
  /usr/bin/etcd --name bench --data-dir "$etcd_dir/data" --enable-v2 \
    --listen-client-urls "http://127.0.0.1:$client_port" \
    --advertise-client-urls "http://127.0.0.1:$client_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "bench=http://127.0.0.1:$peer_port" >"$etcd_dir/log" 2>&1 &
  etcd_pid=$!
  for _ in $(seq 100); do
    grep -q "serving insecure client requests on 127.0.0.1:$client_port" "$etcd_dir/log" && break
    sleep 0.1
  done
  echo "etcd backend: etcd $(/usr/bin/etcd --version | head -1 | awk '{print $3}') on 127.0.0.1:$client_port" >&2
  : >"$peer_file"
  if "$TORCH_PY" -c "import etcd, torch.distributed.elastic" 2>/dev/null; then
    echo "peer: PyTorch's etcd-v2 rendezvous, N = ${RDZV_ETCD_PEER_NODES:-8 16 32} ..." >&2
    # shellcheck disable=SC2086
    "$TORCH_PY" bench/rdzv_torch_etcd_peer.py "$client_port" ${RDZV_ETCD_PEER_NODES:-8 16 32} \
      >"$peer_file" 2>/dev/null || echo "peer: failed (its numbers are left out)" >&2
  else
    echo "peer: $TORCH_PY lacks torch or python3-etcd (scripts/setup.sh installs it); no peer figures" >&2
  fi
  echo "trun etcd backend: N = ${RDZV_ETCD_NODES:-8,16,32,64,256}" >&2
  run_bench --etcd "$client_port" --nodes "${RDZV_ETCD_NODES:-8,16,32,64,256}" \
    --procs "${RDZV_PROCS:-4}" --peer-file "$peer_file" || status=$?
elif [[ "${RDZV_ETCD:-1}" != 0 ]]; then
  echo "etcd backend: /usr/bin/etcd is missing (scripts/setup.sh installs etcd-server); left out" >&2
fi
echo
cat "$results"
exit $status
