#!/usr/bin/env bash
# Cross-node DDP benchmark (issue 41; scripts/bench.sh ddp_net, and the second part of
# scripts/bench.sh ddp): do the fp16/bf16 compression hooks save time when the link is slow?
# Two network namespaces joined by one veth pair whose both ends are shaped with tc (tbf at RATE,
# default 2gbit), one trun agent per namespace (static rendezvous, --nnodes 2 --nproc-per-node 1,
# node 0 hosting the store on its veth address). The agents run bench/ddp_bench (one rank per
# node; the ~10M-parameter MLP of scripts/bench_ddp.sh at bucket cap CAP MB) without a hook, with
# fp16_compress_hook() and with bf16_compress_hook(); then two new agents, in the same
# namespaces, run PyTorch 1.13 DDP over gloo (bench/ddp_torch.py) without a hook and with
# default_hooks.fp16_compress_hook. PyTorch 1.13 has bf16_compress_hook, but its gloo cannot sum
# bfloat16 ("Invalid scalar type"), so the bf16 row has no peer.
# Needs root and `ip netns`; otherwise prints why and exits 0 (nothing measured).
# Usage: scripts/bench_ddp_net.sh [build dir]
#   (env: RATE=2gbit SIZES=1024,2560,2048,1024 BATCH=8 STEPS=16 CAP=25 NET_TIME_LIMIT=240
#    NET_PEER=1 (0: trun only, no PyTorch run))
# Cleanup: the agents are killed by pid, then anything left in the two namespaces (by pid), then
# the namespaces are deleted; names carry this script's pid (tbd<pid>n0, tbd<pid>n1; not the
# t<pid>... pattern whose leftovers tests/cluster/lib.sh removes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD=${1:-build}
RATE=${RATE:-2gbit}
SIZES=${SIZES:-1024,2560,2048,1024}
BATCH=${BATCH:-8}
STEPS=${STEPS:-16}
CAP=${CAP:-25}
LIMIT=${NET_TIME_LIMIT:-240}  # seconds for each of the two runs (trun's bench, PyTorch's)
PY=$TORCH_PY

if [[ $(id -u) != 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "bench_ddp_net: skipped (needs root, ip and tc for network namespaces)" >&2
  exit 0
fi

bench_build "$BUILD" trun ddp_bench
TRUN=$BUILD/launcher/trun

TAG=tbd$$
NS=("${TAG}n0" "${TAG}n1")
ADDR=(10.78.0.1 10.78.0.2)
PORT=29631
TMP=$(mktemp -d "/tmp/trun-bench-ddp-net-$$-XXXXXX")
AGENTS=()
cleanup() {
  local p ns
  for p in "${AGENTS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for p in "${AGENTS[@]}"; do wait "$p" 2>/dev/null || true; done
  for ns in "${NS[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
  done
  for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

if ! ip netns add "${NS[0]}" 2>/dev/null; then
  echo "bench_ddp_net: skipped (ip netns add failed)" >&2
  exit 0
fi
ip netns add "${NS[1]}"
ip -n "${NS[0]}" link add eth0 type veth peer name eth0 netns "${NS[1]}"
for i in 0 1; do
  ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev eth0
  ip -n "${NS[$i]}" link set eth0 up
  ip -n "${NS[$i]}" link set lo up
  # Each end shapes what it sends: RATE in both directions. burst above a 64 KiB GSO packet.
  ip netns exec "${NS[$i]}" tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency 100ms
done

# run_pair NAME CMD...: one agent per namespace runs CMD as its one worker; waits (bounded by
# LIMIT) for both; node 0's output in $TMP/NAME.0, node 1's in $TMP/NAME.1.
run_pair() {
  local name=$1 i rc=0
  shift
  AGENTS=()
  for i in 0 1; do
    # GLOO_SOCKET_IFNAME: PyTorch's gloo otherwise binds to the address the host name resolves to
    # (the host's /etc/hosts, not this namespace).
    GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 TMPDIR=$TMP timeout -s KILL "$LIMIT" \
      ip netns exec "${NS[$i]}" "$TRUN" --nnodes 2 --nproc-per-node 1 --node-rank "$i" \
      --master-addr "${ADDR[0]}" --master-port "$PORT" --local-addr "${ADDR[$i]}" --no-python \
      "$@" >"$TMP/$name.$i" 2>&1 &
    AGENTS+=($!)
  done
  for i in 0 1; do wait "${AGENTS[$i]}" || rc=$?; done
  AGENTS=()
  if ((rc != 0)); then
    echo "bench_ddp_net: the $name run failed (exit $rc); last lines of each node:" >&2
    tail -n 15 "$TMP/$name.0" "$TMP/$name.1" >&2
  fi
  return "$rc"
}

out=$TMP/rows
: >"$out"
echo "== trun DDP across 2 namespaces, link $RATE (tc tbf, both directions), cap $CAP MB" >&2
run_pair trun "$BUILD/bench/ddp_bench" --sizes "$SIZES" --batch "$BATCH" --steps "$STEPS" \
  --caps "$CAP" --fp16-caps "$CAP" --bf16-caps "$CAP" || exit 1
grep -o 'trun mode=.*' "$TMP/trun.0" | tee -a "$out" >&2
peer_note=""
if [[ ${NET_PEER:-1} == 0 ]]; then
  peer_note="NET_PEER=0"
elif "$PY" -c 'import torch' 2>/dev/null; then
  echo "== PyTorch 1.13 DDP (gloo) across the same namespaces, same link" >&2
  if run_pair torch "$PY" bench/ddp_torch.py "$SIZES" "$BATCH" "$STEPS" "$CAP" "$CAP"; then
    grep -o 'torch mode=.*' "$TMP/torch.0" | tee -a "$out" >&2
  else
    peer_note="PyTorch run failed"
  fi
else
  peer_note="no PyTorch at $PY"
fi

"$PY" - "$out" "$RATE" "$CAP" "$peer_note" <<'PYEOF'
import sys
path, rate, cap, note = sys.argv[1:5]
rows = {}
for line in open(path):
    who = line.split()[0]
    f = dict(kv.split("=", 1) for kv in line.split()[1:])
    rows[(who, f["mode"])] = float(f["step_ms"])
params = None
for line in open(path):
    if "params=" in line:
        params = int(line.split("params=")[1].split()[0])
        break
print()
print(f"DDP across 2 nodes (network namespaces, 1 rank each), link {rate} each way (tc tbf), "
      f"{params / 1e6:.1f}M parameters ({params * 4 / 1e6:.0f} MB of fp32 gradients), "
      f"bucket cap {cap} MB; ms per step (median)")
print(f"{'hook':>6} | {'trun step':>9} {'vs none':>7} | {'torch step':>10} {'vs none':>7}")
def fmt(x, spec):
    return format(x, spec) if x is not None else format("-", spec.rstrip("f").split(".")[0])
tn, pn = rows.get(("trun", "ddp")), rows.get(("torch", "ddp"))
for label, mode in (("local", "local"), ("none", "ddp"), ("fp16", "ddp_fp16"), ("bf16", "ddp_bf16")):
    t, p = rows.get(("trun", mode)), rows.get(("torch", mode))
    tv = t / tn if t and tn and mode != "local" else None
    pv = p / pn if p and pn and mode != "local" else None
    print(f"{label:>6} | {fmt(t, '>9.1f')} {fmt(tv, '>7.2f')} | {fmt(p, '>10.1f')} {fmt(pv, '>7.2f')}")
print("local = the step without communication; 'vs none' = step with the hook / step without "
      "(below 1: the hook saves time)")
print("torch bf16: none (PyTorch 1.13 has bf16_compress_hook, but its gloo cannot sum bfloat16)")
if note:
    print(f"peer: none ({note})")
print()
c = f"{float(cap):g}"
for hook in ("fp16", "bf16"):
    t = rows.get(("trun", "ddp_" + hook))
    if not (t and tn):
        continue
    v = t / tn
    p = rows.get(("torch", "ddp_" + hook))
    # ratio: the peer's hook/none over trun's; above 1, trun's hook saves more (bigger is better).
    peer = f"peer={p / pn:.3f} ratio={(p / pn) / v:.2f}" if p and pn else "peer=none ratio=none"
    print(f"RESULT name=ddp_net_{hook}_vs_none_cap{c}MB value={v:.3f} unit=x {peer}")
if tn:
    ratio = f"peer={pn:.1f} ratio={pn / tn:.2f}" if pn else "peer=none ratio=none"
    print(f"RESULT name=ddp_net_none_step_ms_cap{c}MB value={tn:.1f} unit=ms {ratio}")
PYEOF
