#!/usr/bin/env bash
# Slow ranks (issue 37, docs/health.md): scripts/bench.sh straggler [REPS]
#
# 1. Detection: build/examples/train_mlp, 4 ranks on one node, steps of about 20 ms, under trun
#    with the default --straggler-threshold (20 %) and --straggler-window (30 s). After 5 s the
#    bench stops rank 2 for 300 ms of every second (a 30 % duty cycle) and measures the time until
#    trun prints its slow-rank line, and whether the line names rank 2. Repeated REPS times
#    (default 1: each run is about a minute).
# 2. Cost of the scoring. In the worker it is the progress board's hooks (a collective's issue,
#    start and finish, now with the time it took added to RankRecord::collective_ns), measured by
#    tests/hang/progress_hook_bench in ns per collective; train_mlp runs 2 collectives per step
#    (one gradient bucket, one stop agreement), so the cost per step is twice that, against the
#    step time of train_mlp with no sleep (2 ranks, 100000 steps, hang detection off: the shortest
#    steps, the worst case). The agent's side (a snapshot per rank per second, a store write every
#    5 s) runs off the workers' path. The table also shows the whole job's wall time with hang
#    detection on and off (alternating, 7 runs each), which this 2-core machine's noise swamps.
#    torchrun has no straggler detection: there is no peer.
#
# RESULT lines: straggler_detection_s (median seconds from the slowdown to the flag; ratio 60/value:
# above 1 meets the 60 s target), straggler_named (runs whose flag named rank 2, of REPS),
# straggler_scoring_cost_pct (2 x the hook cost per collective over the shortest step, in percent;
# ratio 1/value against the 1 % target).
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-1}
build=${TRUN_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target trun train_mlp progress_hook_bench >/dev/null
trun=$build/launcher/trun
mlp=$build/examples/train_mlp
work=$(mktemp -d /tmp/trun-bench-straggler-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# The child of $1 whose environment has LOCAL_RANK=$2.
worker_of() {
  local c
  for c in $(pgrep -P "$1"); do
    tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx "LOCAL_RANK=$2" && { echo "$c"; return 0; }
  done
  return 1
}

detections=()
named=0
for ((r = 1; r <= reps; r++)); do
  log=$work/detect_$r.log
  OMP_NUM_THREADS=1 "$trun" --standalone --nproc-per-node=4 "$mlp" --no-ckpt --dataset-size 10000000 \
    --epochs 1000 --step-sleep-ms 20 >"$log" 2>&1 &
  agent=$!
  pids+=("$agent")
  victim=""
  for ((k = 0; k < 300; k++)); do victim=$(worker_of "$agent" 2) && break; sleep 0.1; done
  [ -n "$victim" ] || { echo "bench: rank 2 never started" >&2; cat "$log" >&2; exit 1; }
  sleep 5
  t0=$(date +%s.%N)
  flagged=""
  for ((k = 0; k < 120; k++)); do  # at most 2 minutes of duty cycle
    kill -STOP "$victim"
    sleep 0.3
    kill -CONT "$victim"
    sleep 0.7
    if grep -q "trun: slow rank: " "$log"; then flagged=1; break; fi
  done
  t1=$(date +%s.%N)
  kill -TERM "$agent"
  wait "$agent" || true
  if [ -n "$flagged" ]; then
    detections+=("$(echo "$t1 - $t0" | bc)")
    grep -q "trun: slow rank: rank 2 (local_rank 2)" "$log" && named=$((named + 1))
    echo "run $r: $(grep -h "trun: slow rank: " "$log")"
  else
    detections+=(999)
    echo "run $r: no flag within 120 s"
  fi
done

median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }

# Cost: wall seconds of a 100000-step job of 2 ranks, hang detection on (board + scoring) and off.
timed() {
  local t0 t1
  t0=$(date +%s.%N)
  OMP_NUM_THREADS=1 "$trun" --standalone --nproc-per-node=2 --hang-detection="$1" "$mlp" --no-ckpt \
    --dataset-size 100000 --epochs 1000 --stop-after-steps 100000 >"$work/cost.log" 2>&1
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
on=()
off=()
for ((i = 0; i < 7; i++)); do
  on+=("$(timed on)")
  off+=("$(timed off)")
done
m_on=$(median "${on[@]}")
m_off=$(median "${off[@]}")
job_cost=$(echo "scale=2; ($m_on / $m_off - 1) * 100" | bc)
hook_ns=$("$build/tests/hang/progress_hook_bench" | awk '/^RESULT progress_hook_collective/ {print $3}')
step_ns=$(echo "scale=1; $m_off * 1000000000 / 100000" | bc)
cost=$(echo "scale=4; 2 * $hook_ns * 100 / $step_ns" | bc)
m_det=$(median "${detections[@]}")

printf '\n%-44s %s\n' "what" "value"
printf '%-44s %s\n' "detection (default 20 %, 30 s), median s" "$m_det (runs: ${detections[*]})"
printf '%-44s %s\n' "flags naming rank 2" "$named of $reps"
printf '%-44s %s\n' "2 ranks x 100000 steps, board on (s, median)" "$m_on (${on[*]})"
printf '%-44s %s\n' "2 ranks x 100000 steps, board off (s, median)" "$m_off (${off[*]})"
printf '%-44s %s\n' "  whole job, on/off - 1 (%, noise-bound)" "$job_cost"
printf '%-44s %s\n' "board hooks per collective (ns)" "$hook_ns"
printf '%-44s %s\n' "shortest step (ns, board off)" "$step_ns"
printf '%-44s %s\n' "scoring cost: 2 x hooks / step (%)" "$cost"
echo
ratio_det=$(echo "scale=3; 60 / $m_det" | bc)
ratio_cost=$(awk -v c="$cost" 'BEGIN { if (c <= 0) print "inf"; else printf "%.1f", 1 / c }')
echo "RESULT name=straggler_detection_s value=$m_det unit=s peer=none ratio=$ratio_det"
echo "RESULT name=straggler_named value=$named unit=runs peer=none ratio=$(echo "scale=3; $named / $reps" | bc)"
echo "RESULT name=straggler_scoring_cost_pct value=$cost unit=percent peer=none ratio=$ratio_cost"
