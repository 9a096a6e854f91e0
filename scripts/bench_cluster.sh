#!/usr/bin/env bash
# Cross-node restart latency (scripts/bench.sh cluster): 3 network namespaces, one trun agent each
# (--rdzv-backend c10d, 2 workers per node); a worker dies on node 1 and we time from its exit to
# the last replacement worker running on any node, BENCH_REPS times (default 5); then the store
# failover time (SIGKILL of the store host's agent -> the survivors' replacements running). Needs
# root.
# Peer: torchrun 1.13 with the same c10d setup when LAUNCHER=torchrun works here (BENCH_PEER=1 to
# try it; off by default, see the reason printed below).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD_DIR=${TRUN_BUILD_DIR:-build}
bench_build "$BUILD_DIR" trun
out=$(LAUNCHER=trun bash tests/cluster/cluster.sh "$BUILD_DIR" bench 2>&1) || {
  echo "$out" | tail -n 30 >&2
  echo "bench_cluster: the namespace cluster run failed" >&2
  exit 1
}
mapfile -t lat < <(echo "$out" | awk '/^latency_ms/ {print $2}')
peer=none
reason="torchrun 1.13 c10d agents inside the namespaces fail in rendezvous (AttributeError: 'NoneType' object has no attribute 'get'); not measured"
if [ "${BENCH_PEER:-0}" = 1 ]; then
  pout=$(LAUNCHER=torchrun BENCH_REPS=3 timeout 300 bash tests/cluster/cluster.sh "$BUILD_DIR" bench 2>&1) &&
    peer=$(echo "$pout" | awk '/^latency_ms/ {print $2}' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}') &&
    reason="measured"
fi
median=$(printf '%s\n' "${lat[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
printf '%-28s %s\n' "repetition" "restart latency (ms)"
for i in "${!lat[@]}"; do printf '%-28s %s\n' "$((i + 1))" "${lat[$i]}"; done
printf '%-28s %s\n' "trun median" "$median" "torchrun" "$peer ($reason)"
ratio=none
[ "$peer" != none ] && ratio=$(echo "$peer / $median" | bc -l | xargs printf '%.2f')

# Store failover (issue 15): SIGKILL of the store host's agent -> every survivor's replacement
# workers running. torchrun has no failover (the other agents exit when the store host dies:
# pytorch/pytorch#67742), so there is no peer figure.
fout=$(BENCH_REPS=${BENCH_REPS:-3} bash tests/cluster/cluster.sh "$BUILD_DIR" failover_bench 2>&1) || {
  echo "$fout" | tail -n 30 >&2
  echo "bench_cluster: the failover run failed" >&2
  exit 1
}
mapfile -t fo < <(echo "$fout" | awk '/^failover_ms/ {print $2}')
fmedian=$(printf '%s\n' "${fo[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo
printf '%-28s %s\n' "repetition" "store failover (ms)"
for i in "${!fo[@]}"; do printf '%-28s %s\n' "$((i + 1))" "${fo[$i]}"; done
printf '%-28s %s\n' "trun median" "$fmedian" "torchrun" "none (no failover: the job ends)"
# Spare takeover (issue 37): a 3:3 job with a spare waiting; a member's agent SIGKILLed, then a
# member partitioned. torchrun's c10d agents do not run in these namespaces (above): no peer.
sout=$(bash tests/cluster/cluster.sh "$BUILD_DIR" spare 2>&1) || {
  echo "$sout" | tail -n 30 >&2
  echo "bench_cluster: the spare run failed" >&2
  exit 1
}
skill=$(echo "$sout" | awk '/^spare_kill_ms/ {print $2}')
spart=$(echo "$sout" | awk '/^spare_partition_ms/ {print $2}')
echo
printf '%-28s %s\n' "spare takeover" "ms (fault -> 3 workers running, one on the spare)"
printf '%-28s %s\n' "agent SIGKILLed" "$skill" "node partitioned" "$spart (keep-alives: $(grep -o 'keep_alive[^,"]*' tests/cluster/lib.sh | head -2 | tr '\n' ' '))"
echo "RESULT name=cluster_restart_latency value=$median unit=ms peer=$peer ratio=$ratio"
echo "RESULT name=cluster_store_failover value=$fmedian unit=ms peer=none ratio=none"
echo "RESULT name=cluster_spare_takeover_kill value=$skill unit=ms peer=none ratio=none"
echo "RESULT name=cluster_spare_takeover_partition value=$spart unit=ms peer=none ratio=none"
