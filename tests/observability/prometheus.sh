#!/usr/bin/env bash
# /metrics scraped by a real Prometheus (Debian `prometheus` 2.42): `prometheus.sh TRUN_BINARY_DIR`.
#
# Starts Prometheus on 127.0.0.1 (a free port, a temp --storage.tsdb.path) with a 1 s scrape of
# two agents' --metrics-port endpoints (a 2-node c10d job on 127.0.0.1, one worker each), waits
# until its HTTP API (/api/v1/query) reports trun_restarts_total 0 for both instances, makes node
# a's worker exit 3 (a counted restart of the whole group), and waits until Prometheus reports
# the increase for both instances. `promtool check metrics` validates a /metrics scrape of each
# agent after the crash (exit 0, no lint problem). Then the workers exit 0 and both agents must
# exit 0. Every loop is bounded; prometheus and the agents are ended by pid, the temp dir removed.
# Prometheus or promtool absent: a setup skip (tests/skip.sh: a failure in strict mode).
set -uo pipefail
BIN=$1
SRC=$(cd "$(dirname "$0")" && pwd)
TRUN=$BIN/launcher/trun
WORKER=$BIN/tests/bin/trun_test_worker
SKIP_TEST_NAME="observability.prometheus (prometheus.sh)"
# shellcheck source=tests/skip.sh
source "$SRC/../skip.sh"

command -v prometheus >/dev/null && command -v promtool >/dev/null ||
  skip setup "no prometheus/promtool (Debian package prometheus; scripts/setup.sh installs it)"
command -v curl >/dev/null || skip setup "no curl"

# shellcheck source=tests/observability/lib.sh
source "$SRC/lib.sh"
obs_setup prometheus

PROM_PORT=$(free_port)
STORE_PORT=$(free_port)
M1=$(free_port)
M2=$(free_port)
cat >"$TMP/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: trun
    static_configs:
      - targets: ["127.0.0.1:$M1", "127.0.0.1:$M2"]
EOF
promtool check config "$TMP/prometheus.yml" >"$TMP/promtool-config.out" 2>&1 ||
  fail "promtool check config: $(cat "$TMP/promtool-config.out")"
prometheus --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/data" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$TMP/prometheus.out" 2>&1 &
PROM=$!
PIDS+=("$PROM")
API=http://127.0.0.1:$PROM_PORT
for ((i = 0; i < 300; i++)); do
  curl -sf "$API/-/ready" >/dev/null 2>&1 && break
  kill -0 "$PROM" 2>/dev/null || fail "prometheus exited"
  sleep 0.1
done
curl -sf "$API/-/ready" >/dev/null || fail "prometheus not ready within 30 s"
echo "prometheus ready on $API"

common=(--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "--rdzv-endpoint=127.0.0.1:$STORE_PORT"
  --rdzv-id=prom --max-restarts=3 --monitor-interval=0.1 --rdzv-conf=join_timeout=30)
# Node a's worker waits for $TMP/crash and exits 3 in its first attempt; every worker then waits
# for $TMP/done (at most 20 s, the helper's bound) and exits 0.
timeout -k 5 120 "$TRUN" "${common[@]}" --metrics-port="$M1" "$WORKER" \
  on-attempt 0 wait-file "$TMP/crash" on-attempt 0 exit 3 wait-file "$TMP/done" exit 0 \
  >"$TMP/a.out" 2>&1 &
PIDS+=($!)
A=$!
timeout -k 5 120 "$TRUN" "${common[@]}" --metrics-port="$M2" "$WORKER" \
  wait-file "$TMP/done" exit 0 >"$TMP/b.out" 2>&1 &
PIDS+=($!)
B=$!

# restarts: prints "INSTANCE VALUE" per series of trun_restarts_total that Prometheus has now.
restarts() {
  curl -sf --max-time 5 "$API/api/v1/query" --data-urlencode 'query=trun_restarts_total' |
    python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["status"] == "success", d
for r in d["data"]["result"]:
    print(r["metric"]["instance"], r["value"][1])
'
}
# wait_restarts MIN SECONDS: until both instances report trun_restarts_total >= MIN.
wait_restarts() {
  local min=$1 limit=$2 i out
  for ((i = 0; i < limit * 2; i++)); do
    out=$(restarts 2>/dev/null)
    if [ "$(awk -v m="$min" -v a="127.0.0.1:$M1" -v b="127.0.0.1:$M2" \
      '($1 == a || $1 == b) && $2 + 0 >= m { n++ } END { print n + 0 }' <<<"$out")" = 2 ]; then
      echo "prometheus: trun_restarts_total >= $min on both: $(tr '\n' ' ' <<<"$out")"
      return 0
    fi
    kill -0 "$A" 2>/dev/null && kill -0 "$B" 2>/dev/null || fail "an agent ended early"
    sleep 0.5
  done
  fail "prometheus did not report trun_restarts_total >= $min for both instances within $limit s: $out"
}
wait_restarts 0 40
before=$(restarts)
[ "$(grep -c -E " 0$" <<<"$before")" = 2 ] || fail "restarts before the crash are not 0 on both: $before"
touch "$TMP/crash"
wait_restarts 1 40
for m in "$M1" "$M2"; do
  curl -sf --max-time 5 "http://127.0.0.1:$m/metrics" >"$TMP/metrics_$m.txt" ||
    fail "no /metrics from 127.0.0.1:$m"
  promtool check metrics <"$TMP/metrics_$m.txt" >"$TMP/promtool_$m.out" 2>&1 ||
    fail "promtool check metrics failed for 127.0.0.1:$m: $(cat "$TMP/promtool_$m.out")"
  [ -s "$TMP/promtool_$m.out" ] && fail "promtool lint for 127.0.0.1:$m: $(cat "$TMP/promtool_$m.out")"
  echo "ok: promtool check metrics: 127.0.0.1:$m ($(grep -c -v '^#' "$TMP/metrics_$m.txt") samples)"
done
grep -q '^trun_worker_exits_total{exit_code="3"} 1$' "$TMP/metrics_$M1.txt" ||
  fail "node a's /metrics does not count the exit 3: $(grep worker_exits "$TMP/metrics_$M1.txt")"
touch "$TMP/done"
wait "$A" || fail "node a exited $?"
wait "$B" || fail "node b exited $?"
echo "PASS"
