#!/usr/bin/env bash
# Soak: CYCLES restart cycles (default 1000) of a 4-worker group whose workers crash, on a c10d
# rendezvous whose store is a separate `trun store` process. Every restart is a new rendezvous
# round on that store. The agent's and the store's open file descriptors, threads and RSS are
# sampled as the restarts go by and printed as a curve; the run fails when a count grows or when
# the agent's temporary folder or /dev/shm hold anything of the run afterwards.
#
#   scripts/soak.sh [CYCLES]       (builds trun and the test worker in $TRUN_BUILD_DIR, build/)
#
# Ends with RESULT lines: growth of the agent's and the store's fds, threads and RSS between the
# first sample after warm-up (CYCLES/10 restarts) and the end (for the agent, the lowest of its
# last 5 samples; for the store, a sample after the agent has exited).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

cycles=${1:-1000}
if ! [[ "$cycles" =~ ^[1-9][0-9]*$ ]] || ((cycles < 20)); then
  echo "usage: scripts/soak.sh [CYCLES]   (CYCLES: a whole number, at least 20)" >&2
  exit 2
fi
build=${TRUN_BUILD_DIR:-build}
bench_build "$build" trun trun_test_worker
trun=$build/launcher/trun
worker=$build/tests/bin/trun_test_worker

work=$(mktemp -d /tmp/trun-soak.XXXXXX)
store_pid="" agent_pid=""
cleanup() {
  [[ -n "$agent_pid" ]] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null
  [[ -n "$store_pid" ]] && kill "$store_pid" 2>/dev/null && wait "$store_pid" 2>/dev/null
  rm -rf "$work"
  true
}
trap cleanup EXIT

# What this run could leave behind: the agent's job-local folders (it gets a private TMPDIR) and
# shared-memory segments named after this run id (tests running at the same time make their own).
run_id=soak-$$
mkdir "$work/tmp"
leftovers() {
  ls "$work/tmp"
  find /dev/shm -maxdepth 1 -name "trun-$run_id-*" -printf "%f\n" 2>/dev/null || true
}

port=$(free_port)
"$trun" store --host 127.0.0.1 --port "$port" >"$work/store.log" 2>&1 &
store_pid=$!
for _ in $(seq 100); do
  grep -q listening "$work/store.log" && break
  sleep 0.05
done
grep -q listening "$work/store.log" || { echo "soak: trun store did not start:" >&2; cat "$work/store.log" >&2; exit 1; }

# Each attempt's workers run ~10 ms and crash; the last attempt's succeed. The same crash at
# every start is what the crash-loop guard stops (docs/health.md): off here, where it is the point.
TMPDIR=$work/tmp "$trun" --nnodes=1 --nproc-per-node=4 --max-restarts="$cycles" --monitor-interval=0.005 \
  --crash-loop-limit=0 \
  --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$port" --rdzv-id="$run_id" \
  "$worker" sleep 0.01 on-attempt "$cycles" exit 0 exit 1 >"$work/agent.log" 2>&1 &
agent_pid=$!

# sample PID: "fds threads rss_kb"
sample() {
  local fds threads rss
  fds=$(ls "/proc/$1/fd" 2>/dev/null | wc -l)
  threads=$(awk '/^Threads:/ {print $2}' "/proc/$1/status" 2>/dev/null)
  rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null)
  echo "${fds:-0} ${threads:-0} ${rss:-0}"
}

warm=$((cycles / 10))
step=$((cycles / 20))
next=0
first="" first_store=""
# The end value of each count is its lowest over the last 5 samples: a sample can catch a
# thread or descriptor that lives for a moment (the agent's counts go 4-5 threads and 13-15 fds
# from one sample to the next), while a leak raises every later sample. A run whose last sample
# alone was one thread above the first failed once under ctest -j2.
recent=()
printf '%9s | %6s %7s %9s | %6s %7s %9s | %6s\n' restarts "a.fds" "a.thr" "a.rss_kB" \
  "s.fds" "s.thr" "s.rss_kB" seconds
start=$SECONDS
deadline=$((SECONDS + 600))
while kill -0 "$agent_pid" 2>/dev/null && ((SECONDS < deadline)); do
  done_=$(grep -c "restarting the worker group" "$work/agent.log" || true)
  if ((done_ >= next)); then
    a=$(sample "$agent_pid") s=$(sample "$store_pid")
    # The agent may have exited between the check and the sample.
    if [[ "$a" != "0 0 0" ]]; then
      # shellcheck disable=SC2086
      printf '%9d | %6d %7d %9d | %6d %7d %9d | %6d\n' "$done_" $a $s $((SECONDS - start))
      if [[ -z "$first" ]] && ((done_ >= warm)); then first=$a first_store=$s; fi
      recent+=("$a")
      ((${#recent[@]} > 5)) && recent=("${recent[@]:1}")
    fi
    next=$((done_ + step))
  fi
  sleep 0.05
done
if kill -0 "$agent_pid" 2>/dev/null; then
  echo "soak: the agent still runs after 600 s" >&2
  exit 1
fi
rc=0
wait "$agent_pid" || rc=$?
agent_pid=""
restarts=$(grep -c "restarting the worker group" "$work/agent.log" || true)
echo "agent exit status $rc after $restarts restarts in $((SECONDS - start)) s"
if ((rc != 0 || restarts != cycles)); then
  echo "soak: expected exit 0 after $cycles restarts; the agent's last lines:" >&2
  tail -5 "$work/agent.log" >&2
  exit 1
fi
last_store=$(sample "$store_pid")
kill "$store_pid"
wait "$store_pid" 2>/dev/null || true
store_pid=""
new=$(leftovers)

read -r a_fd0 a_thr0 a_rss0 <<<"$first"
read -r a_fd1 a_thr1 a_rss1 <<<"$(printf '%s\n' "${recent[@]}" |
  awk 'NR == 1 || $1 < f { f = $1 } NR == 1 || $2 < t { t = $2 } NR == 1 || $3 < r { r = $3 }
       END { print f, t, r }')"
read -r s_fd0 s_thr0 s_rss0 <<<"$first_store"
read -r s_fd1 s_thr1 s_rss1 <<<"$last_store"
echo
printf '%-8s %-8s %10s %10s %8s\n' process what "after $warm" end growth
printf '%-8s %-8s %10d %10d %8d\n' agent fds "$a_fd0" "$a_fd1" $((a_fd1 - a_fd0)) \
  agent threads "$a_thr0" "$a_thr1" $((a_thr1 - a_thr0)) \
  agent rss_kB "$a_rss0" "$a_rss1" $((a_rss1 - a_rss0)) \
  store fds "$s_fd0" "$s_fd1" $((s_fd1 - s_fd0)) \
  store threads "$s_thr0" "$s_thr1" $((s_thr1 - s_thr0)) \
  store rss_kB "$s_rss0" "$s_rss1" $((s_rss1 - s_rss0))
if [[ -n "$new" ]]; then
  echo "soak: left behind:"
  echo "$new" | sed 's/^/  /'
fi
echo "RESULT name=soak_agent_fd_growth value=$((a_fd1 - a_fd0)) unit=fds peer=none ratio=none"
echo "RESULT name=soak_agent_thread_growth value=$((a_thr1 - a_thr0)) unit=threads peer=none ratio=none"
echo "RESULT name=soak_agent_rss_growth value=$((a_rss1 - a_rss0)) unit=kB peer=none ratio=none"
echo "RESULT name=soak_store_fd_growth value=$((s_fd1 - s_fd0)) unit=fds peer=none ratio=none"
echo "RESULT name=soak_store_rss_growth value=$((s_rss1 - s_rss0)) unit=kB peer=none ratio=none"
# Flat: no descriptor or thread more at the end; RSS within 2 MB (allocator noise).
if ((a_fd1 > a_fd0 || a_thr1 > a_thr0 || s_fd1 > s_fd0 || s_thr1 > s_thr0 ||
  a_rss1 - a_rss0 > 2048 || s_rss1 - s_rss0 > 2048)) || [[ -n "$new" ]]; then
  echo "soak: FAILED (a count grew, or something was left behind)" >&2
  exit 1
fi
echo "soak: flat"
