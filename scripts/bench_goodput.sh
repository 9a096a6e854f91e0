#!/usr/bin/env bash
# Goodput benchmark (issue 39; scripts/bench.sh goodput): the same elastic training on trun and on
# torchrun 1.13 under one seeded fault schedule; reports each side's ETTR (the share of the wall
# time that moved the model forward) and its badput by cause, in total and per fault.
#
# Setup: four network namespaces (gp<pid>n0..n3, 10.79.0.1-4, joined by a bridge in gp<pid>hub;
# each agent in a UTS namespace of its own named after its node, /etc/netns/<ns>/hosts resolving
# every node's name), 3 nodes of 2 ranks training (--nnodes 2:3) and a 4th agent waiting as the
# spare; node 0 hosts the c10d store. Sides, one after the other, in the same namespaces, under
# the same schedule (times relative to each side's start):
#   trun              examples/train_mlp with every feature on (see bench/goodput.py, trun_cmd)
#   torchrun_best     bench/goodput_torch.py (the same MLP, data, sampler, checkpoints, sample log)
#                     with the best settings torchrun's documentation offers: --monitor_interval
#                     0.1, --rdzv_conf join_timeout=30,last_call_timeout=1,close_timeout=5,
#                     read_timeout=5, init_process_group(timeout=20 s)
#   torchrun_default  the same with torchrun's defaults
# Each side first runs fault-free (GOODPUT_FAULT_FREE s; 0 skips it and takes the median step of
# the faulted run instead, the --short default) to measure its step time t0. Both
# programs sleep --step-sleep-ms per step (40 ms): the sleep stands in for accelerator compute, so
# a step takes tens of ms without saturating this machine's 2 cores.
# Supervisor rule (both sides): an agent that exits is started again after 1 s (a SLURM requeue,
# a Kubernetes restart policy), except one killed by an "agent killed" fault, which comes back at
# its scheduled time. A SIGKILLed torchrun agent leaves its workers running (no parent-death
# signal): torchrun's real behaviour, left as is; the namespace cleanup ends them.
# At the end of the wall time every agent gets SIGTERM: train_mlp and goodput_torch.py both agree
# on a step, save it and exit (the final checkpoint); a worker that cannot (a stopped rank, a
# group blocked in a collective) leaves the last periodic checkpoint as the final state. The
# committed steps are the chain of groups from that checkpoint back to the start.
# The faults, the accounting and the checks: bench/goodput.py (its header).
#
# Usage: scripts/bench_goodput.sh [--short] [build dir]
#   env: GOODPUT_SECONDS (300; --short: 60) GOODPUT_SEED (39) GOODPUT_FAULT_FREE (30; --short: 0)
#        GOODPUT_SIDES (trun,torchrun_best,torchrun_default; --short: trun)
#        TRUN_BUILD_DIR (build): trun and train_mlp come from there; GOODPUT_TRAIN_MLP overrides
#        the train_mlp binary; GOODPUT_OUT (the output directory; default
#        /tmp/trun-goodput-<date>-<pid>, kept and printed; --short removes it when every check
#        passes unless GOODPUT_KEEP=1).
# --short (the cluster.goodput_short test): trun only, 60 s, 3 faults (a worker kill, an agent
# kill with the spare taking over, a partition), then checks that the accounting adds up, every
# fault has badput, the final model verifies and the live metrics agree; exits 1 otherwise.
# Needs root, ip, tc and unshare (and PyTorch for the torchrun sides); without them it says why
# and exits 0 (77 with --short under a test runner: GOODPUT_SKIP_CODE).
# Cleanup (EXIT, INT, TERM): every pid in each namespace is killed, the namespaces and their
# /etc/netns entries deleted; leftovers of a dead earlier run (gp<pid>... of a pid that no longer
# runs this script) are removed at start.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

SHORT=0
if [[ ${1:-} == --short ]]; then
  SHORT=1
  shift
fi
BUILD=${1:-${TRUN_BUILD_DIR:-build}}
if ((SHORT)); then
  SECONDS_W=${GOODPUT_SECONDS:-60}
  # No fault-free run in the short form: t0 is the median step of the faulted run itself (the
  # live agents' own reference), which saves CI about 15 s.
  FAULT_FREE=${GOODPUT_FAULT_FREE:-0}
  SIDES=${GOODPUT_SIDES:-trun}
else
  SECONDS_W=${GOODPUT_SECONDS:-300}
  FAULT_FREE=${GOODPUT_FAULT_FREE:-30}
  SIDES=${GOODPUT_SIDES:-trun,torchrun_best,torchrun_default}
fi
SEED=${GOODPUT_SEED:-39}
SKIP_CODE=${GOODPUT_SKIP_CODE:-0}
PY=$TORCH_PY

skip() {
  echo "bench_goodput: skipped ($*)" >&2
  exit "$SKIP_CODE"
}
[[ $(id -u) == 0 ]] || skip "needs root for network namespaces"
for tool in ip tc unshare curl; do
  command -v "$tool" >/dev/null || skip "needs $tool"
done
[[ $SIDES == *torchrun* ]] && ! "$PY" -c 'import torch' 2>/dev/null &&
  skip "no PyTorch at $PY for the torchrun sides"

TRUN=$BUILD/launcher/trun
TRAIN_MLP=${GOODPUT_TRAIN_MLP:-$BUILD/examples/train_mlp}
if [[ ! -x $TRUN || ! -x $TRAIN_MLP ]]; then
  bench_build "$BUILD" trun train_mlp
fi

TAG=gp$$
HUB=${TAG}hub
NS=("${TAG}n0" "${TAG}n1" "${TAG}n2" "${TAG}n3")
OUT=${GOODPUT_OUT:-/tmp/trun-goodput-$(date +%Y%m%d-%H%M%S)-$$}
KEEP=1
((SHORT)) && KEEP=${GOODPUT_KEEP:-0}

# Leftovers of dead runs: namespaces gp<pid>hub/gp<pid>n<i> (and their /etc/netns entries) of a
# pid that no longer runs this script. One pass over what exists now.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
  [[ $ns =~ ^gp([0-9]+)(hub|n[0-9])$ ]] || continue
  pid=${BASH_REMATCH[1]}
  if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q bench_goodput; then
    continue
  fi
  echo "removing namespace $ns (its run, pid $pid, is gone)"
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "/etc/netns/$ns"
done

cleanup() {
  local ns p
  for ns in "${NS[@]}" "$HUB"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
  done
  for ns in "${NS[@]}" "$HUB"; do
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  if [[ $KEEP == 0 ]]; then rm -rf "$OUT"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

ip netns add "$HUB" 2>/dev/null || skip "ip netns add failed"
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" link set br0 up
for i in 0 1 2 3; do
  ns=${NS[$i]}
  ip netns add "$ns"
  ip -n "$HUB" link add "h$i" type veth peer name eth0 netns "$ns"
  ip -n "$HUB" link set "h$i" master br0
  ip -n "$HUB" link set "h$i" up
  ip -n "$ns" addr add "10.79.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  mkdir -p "/etc/netns/$ns"
  {
    echo "127.0.0.1 localhost"
    for j in 0 1 2 3; do echo "10.79.0.$((j + 1)) ${NS[$j]}"; done
  } >"/etc/netns/$ns/hosts"
done

mkdir -p "$OUT"
GP=(/usr/bin/python3 bench/goodput.py)
SHORT_FLAG=()
((SHORT)) && SHORT_FLAG=(--short)
"${GP[@]}" schedule --seed "$SEED" --seconds "$SECONDS_W" "${SHORT_FLAG[@]}" >"$OUT/schedule.txt"
"${GP[@]}" schedule --seed "$SEED" --seconds "$SECONDS_W" "${SHORT_FLAG[@]}" --json >"$OUT/schedule.json"
echo "goodput: seed $SEED, $SECONDS_W s per side, sides $SIDES; output in $OUT"
echo "goodput: trun $TRUN, train_mlp $TRAIN_MLP, torchrun $TORCHRUN ($PY)"
echo "goodput: schedule (seconds from each side's start, kind, node, local rank, duration):"
sed 's/^/  /' "$OUT/schedule.txt"

k=0
IFS=, read -r -a side_list <<<"$SIDES"
for side in "${side_list[@]}"; do
  port=$((29650 + 10 * k))
  for phase in faultfree main; do
    name=$side
    args=(--schedule "$OUT/schedule.json" --seconds "$SECONDS_W")
    if [[ $phase == faultfree ]]; then
      ((FAULT_FREE > 0)) || continue
      name=${side}_faultfree
      args=(--fault-free --seconds "$FAULT_FREE")
    fi
    echo "goodput: [$(date +%T)] $name ($( [[ $phase == faultfree ]] && echo "$FAULT_FREE" || echo "$SECONDS_W") s)"
    timeout -s KILL $((SECONDS_W + 120)) "${GP[@]}" run-side --side "$name" --launcher "$side" \
      --dir "$OUT" "${args[@]}" --ns-prefix "$TAG" --hub "$HUB" --subnet 10.79.0 \
      --port "$port" --metrics-port $((port + 1)) --rdzv-id "$TAG-$name" --trun "$TRUN" \
      --train-mlp "$TRAIN_MLP" --python "$PY" --torchrun "$TORCHRUN" \
      --torch-script bench/goodput_torch.py
    port=$((port + 5))
  done
  # The final checkpoint loads: one rank, no launcher, resumes from it (and trains at most one
  # step: train_mlp --stop-after-steps 1; goodput_torch.py --verify trains nothing).
  d=$OUT/$side
  mkdir -p "$d/verify"
  if [[ $side == trun ]]; then
    TRUN_JOB_ID="$TAG-verify" TMPDIR=$d/tmp timeout 60 "$TRAIN_MLP" --sizes 32,256,32 \
      --dataset-size 6144 --epochs 100000 --ckpt-dir "$d/ckpt" --step-sleep-ms 0 \
      --sample-log "$d/verify/v" --stop-after-steps 1 >"$d/verify.txt" 2>&1 || true
  else
    OMP_NUM_THREADS=1 timeout 60 "$PY" bench/goodput_torch.py --verify --sizes 32,256,32 \
      --ckpt-dir "$d/ckpt" >"$d/verify.txt" 2>&1 || true
  fi
  echo "goodput: verification of $side's final checkpoint: $(grep -E 'resumed from|verify ' "$d/verify.txt" | head -n 1)"
  k=$((k + 1))
done

rc=0
"${GP[@]}" report --dir "$OUT" --sides "$SIDES" "${SHORT_FLAG[@]}" | tee "$OUT/report.txt" || rc=$?
if ((rc != 0)); then
  KEEP=1
  echo "goodput: FAILED; everything is kept in $OUT"
else
  echo "goodput: everything (schedule, agent logs, event logs, sample logs, accounting.json) in $OUT$( [[ $KEEP == 0 ]] && echo ' (removed: pass; GOODPUT_KEEP=1 keeps it)')"
fi
exit "$rc"
