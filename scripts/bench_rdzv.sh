#!/usr/bin/env bash
# Rendezvous benchmark (scripts/bench.sh rdzv): N simulated agents run trun's real c10d
# rendezvous over real TCP connections to a real store (threads in a few processes), N = 8, 16,
# 32, 64, 512, 2048: time until every agent has its rank, and store requests per agent. Peer in
# the same run: PyTorch 1.13's dynamic rendezvous with the c10d backend, one process per agent,
# N = 8, 16, 32 (what fits on this machine). Target: 2048 nodes in under 2 s.
# Then the etcd backend against an etcd of our own on loopback (v2 API enabled for the peer),
# N = 8, 16, 32, 64, 256, with PyTorch 1.13's etcd-v2 rendezvous (python3-etcd) as the peer at
# N = 8, 16, 32. The RESULT lines of both come last.
# Options (environment): RDZV_NODES (default 8,16,32,64,512,2048), RDZV_PEER_NODES (8 16 32),
# RDZV_PROCS (agent processes for trun, default 4), RDZV_ETCD_NODES (8,16,32,64,256),
# RDZV_ETCD_PEER_NODES (8 16 32); RDZV_ETCD=0 leaves the etcd part out.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD_DIR=${TRUN_BUILD_DIR:-build}
bench_build "$BUILD_DIR" rdzv_bench

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
if /usr/bin/python3 -c "import torch.distributed.elastic" 2>/dev/null; then
  echo "peer: PyTorch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)') c10d rendezvous, N = ${RDZV_PEER_NODES:-8 16 32} ..." >&2
  # shellcheck disable=SC2086
  /usr/bin/python3 bench/rdzv_torch_peer.py ${RDZV_PEER_NODES:-8 16 32} >"$peer_file" 2>/dev/null ||
    echo "peer: failed (its numbers are left out)" >&2
else
  echo "peer: /usr/bin/python3 has no torch; no peer figures" >&2
fi
echo "trun: N = ${RDZV_NODES:-8,16,32,64,512,2048}, agents in ${RDZV_PROCS:-4} processes" >&2
status=0
run_bench --nodes "${RDZV_NODES:-8,16,32,64,512,2048}" --procs "${RDZV_PROCS:-4}" \
  --peer-file "$peer_file" || status=$?

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
