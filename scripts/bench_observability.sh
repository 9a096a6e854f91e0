#!/usr/bin/env bash
# The agent's idle cost with its endpoint (scripts/bench.sh observability): one trun agent
# (--nnodes=1, c10d on loopback, --metrics-port, one worker that sleeps) measured over
# OBS_WINDOW seconds (default 20), once unscraped and once with GET /metrics and GET /healthz
# every second (the way Prometheus and a Kubernetes liveness probe would). CPU % is the agent
# process's utime+stime (/proc/PID/stat, all its threads) over the window's wall time, one core =
# 100 %, and the same from the threads' run time in nanoseconds (/proc/PID/task/*/schedstat, first
# field): an idle agent uses less than one 10 ms clock tick in 20 s, so the RESULT lines take the
# nanosecond figure (a thread that ended within the window would be missing from it; the agent's
# threads live as long as the agent, and the tick figure is printed beside it); RSS is
# its VmRSS at the end of the window (and VmHWM, its peak). Only the agent process counts: not
# its worker, not the guardian, not curl. Target: <= 1 % CPU and <= 10 MB RSS while scraped.
# No peer: torchrun's health-check server is a stub (peer=none). MB here is 10^6 bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD_DIR=${TRUN_BUILD_DIR:-build}
WINDOW=${OBS_WINDOW:-20}
bench_build "$BUILD_DIR" trun
TRUN=$BUILD_DIR/launcher/trun
CLK_TCK=$(getconf CLK_TCK)

agent_pid=""
cleanup() {
  if [[ -n "$agent_pid" ]]; then
    kill -TERM "$agent_pid" 2>/dev/null || true
    wait "$agent_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }  # utime + stime; the name has no spaces
run_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'; }
status_kb() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }

# measure MODE: prints "MODE CPU_PCT_NS CPU_PCT_TICKS RSS_MB HWM_MB SCRAPES".
measure() {
  local mode=$1 mport i t0 t1 n0 n1 w0 w1 scrapes=0 failed=0 next
  mport=$(free_port)
  "$TRUN" --nnodes=1 --nproc-per-node=1 --rdzv-backend=c10d \
    "--rdzv-endpoint=127.0.0.1:$(free_port)" --rdzv-id=obs --monitor-interval=0.1 \
    --metrics-port="$mport" /bin/sleep $((WINDOW + 30)) >/dev/null 2>&1 &
  agent_pid=$!
  for ((i = 0; i < 200; i++)); do
    curl -sf --max-time 1 "http://127.0.0.1:$mport/healthz" 2>/dev/null | grep -q '^ok: running' &&
      break
    sleep 0.1
  done
  curl -sf --max-time 1 "http://127.0.0.1:$mport/healthz" | grep -q '^ok: running' ||
    { echo "bench_observability: the agent did not reach running in 20 s" >&2; exit 1; }
  sleep 2  # start-up work done
  t0=$(ticks "$agent_pid")
  n0=$(run_ns "$agent_pid")
  w0=$(date +%s.%N)
  for ((i = 0; i < WINDOW; i++)); do
    next=$(awk -v w="$w0" -v i="$i" 'BEGIN { printf "%.3f", w + i + 1 }')
    if [[ $mode == scraped ]]; then
      if curl -sf --max-time 1 -o /dev/null "http://127.0.0.1:$mport/metrics" &&
        curl -sf --max-time 1 -o /dev/null "http://127.0.0.1:$mport/healthz"; then
        scrapes=$((scrapes + 1))
      else
        failed=$((failed + 1))
      fi
    fi
    # Sleep to the next whole second of the window, so the window stays WINDOW seconds long.
    sleep "$(awk -v n="$next" -v now="$(date +%s.%N)" 'BEGIN { d = n - now; printf "%.3f", (d > 0 ? d : 0) }')"
  done
  t1=$(ticks "$agent_pid")
  n1=$(run_ns "$agent_pid")
  w1=$(date +%s.%N)
  local rss hwm
  rss=$(status_kb "$agent_pid" VmRSS)
  hwm=$(status_kb "$agent_pid" VmHWM)
  kill -TERM "$agent_pid" 2>/dev/null || true
  wait "$agent_pid" 2>/dev/null || true
  agent_pid=""
  ((failed == 0)) || { echo "bench_observability: $failed scrape(s) failed" >&2; exit 1; }
  awk -v m="$mode" -v t="$((t1 - t0))" -v ns="$((n1 - n0))" -v hz="$CLK_TCK" -v w0="$w0" \
    -v w1="$w1" -v rss="$rss" -v hwm="$hwm" -v s="$scrapes" 'BEGIN {
      printf "%s %.4f %.3f %.2f %.2f %d\n", m, 100 * ns / 1e9 / (w1 - w0), 100 * t / hz / (w1 - w0),
        rss * 1.024 / 1000, hwm * 1.024 / 1000, s }'
}

echo "trun agent idle over ${WINDOW} s (1 local worker sleeping; CPU: one core = 100 %)"
rows=()
for mode in unscraped scraped; do rows+=("$(measure "$mode")"); done
printf '%-10s %10s %12s %10s %10s %8s\n' mode "cpu_%" "cpu_%_ticks" rss_MB peak_MB scrapes
for r in "${rows[@]}"; do
  read -r m cpu cput rss hwm s <<<"$r"
  printf '%-10s %10s %12s %10s %10s %8s\n' "$m" "$cpu" "$cput" "$rss" "$hwm" "$s"
done
for r in "${rows[@]}"; do
  read -r m cpu cput rss hwm s <<<"$r"
  # ratio: the target over the value (bigger is better; >= 1 meets it); a CPU figure of 0
  # counts as 0.001 %.
  awk -v m="$m" -v cpu="$cpu" -v rss="$rss" 'BEGIN {
    c = (cpu < 0.001 ? 0.001 : cpu)
    printf "RESULT name=agent_idle_cpu_%s value=%s unit=percent peer=none ratio=%.2f\n", m, cpu, 1 / c
    printf "RESULT name=agent_idle_rss_%s value=%s unit=MB peer=none ratio=%.2f\n", m, rss, 10 / rss
  }'
done
