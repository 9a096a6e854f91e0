#!/usr/bin/env bash
# `trun timeline` black-box tests: `timeline.sh TRUN_BINARY_DIR CASE`.
#
# CASE screenshot: a real run with a restart (a worker that exits 3 once) and a node join (a
#   second agent joins the --nnodes=1:2 c10d job on 127.0.0.1 later), both with --event-log;
#   `trun timeline` draws both logs; a real headless Chromium renders the page (--dump-dom and
#   --screenshot), and the test asserts on the DOM (lanes, bars by outcome, restart, re-form and
#   round markers) and on the PNG's pixels (png_lanes.py: the lane markers' colours counted in the
#   decoded image, the restart line, the failed, stopped and succeeded bars in the right lanes).
#   A missing lane, bar or restart fails it. TIMELINE_KEEP=DIR keeps timeline.png
#   there (docs/timeline.png is made so: docs/observability.md).
# CASE bad_input: a missing file, a directory, an unreadable file, garbage lines, no events, no -o.
#
# Chromium (Debian `chromium`) absent: a setup skip (tests/skip.sh: a failure in strict mode).
# Every process started here is ended by its pid (chromium by its process group's id: it was
# started with setsid); the temp dir (with Chromium's --user-data-dir) is removed on exit.
set -uo pipefail
BIN=$1
CASE=$2
SRC=$(cd "$(dirname "$0")" && pwd)
TRUN=$BIN/launcher/trun
WORKER=$BIN/tests/bin/trun_test_worker
SKIP_TEST_NAME="observability.timeline_$CASE (timeline.sh)"
# shellcheck source=tests/skip.sh
source "$SRC/../skip.sh"

# shellcheck source=tests/observability/lib.sh
source "$SRC/lib.sh"
obs_setup timeline

# count FILE TEXT: how many times TEXT occurs in FILE.
count() { grep -o -F -- "$2" "$1" | wc -l; }

# chromium_run SECONDS ARGS...: runs headless Chromium in a process group of its own with a
# private profile, waits at most SECONDS, then ends the whole group by its id.
chromium_run() {
  local limit=$1 i
  shift
  setsid chromium --headless --disable-gpu --no-sandbox --no-first-run --hide-scrollbars \
    --force-device-scale-factor=1 --user-data-dir="$TMP/profile" "$@" 2>>"$TMP/chromium.err" &
  CHROME_PGID=$!
  for ((i = 0; i < limit * 10; i++)); do
    kill -0 "$CHROME_PGID" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$CHROME_PGID" 2>/dev/null && echo "chromium still runs after ${limit} s: ending it"
  kill -KILL -- "-$CHROME_PGID" 2>/dev/null
  wait "$CHROME_PGID" 2>/dev/null
  CHROME_PGID=
}

case_bad_input() {
  local out rc
  expect() {  # expect RC PATTERN ARGS...: trun timeline ARGS exits RC and its stderr has PATTERN
    local want=$1 pattern=$2
    shift 2
    out=$("$TRUN" timeline "$@" 2>&1 >/dev/null)
    rc=$?
    [ "$rc" = "$want" ] || fail "trun timeline $* exited $rc, not $want: $out"
    grep -q -E -- "$pattern" <<<"$out" || fail "trun timeline $*: no '$pattern' in: $out"
    echo "ok: trun timeline $* -> $rc: $(head -n 1 <<<"$out")"
  }
  local good='{"name":"trun.agent.start","source":"AGENT","timestamp":1000,"metadata":{"run_id":"r","hostname":"h","pid":1}}'
  echo "$good" >"$TMP/good.jsonl"
  expect 1 "cannot read the event log $TMP/missing.jsonl: No such file" "$TMP/missing.jsonl" -o "$TMP/x.html"
  expect 1 "cannot read the event log $TMP: is a directory" "$TMP" -o "$TMP/x.html"
  if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
    # root reads any file: drop to nobody for the permission case
    chmod 600 "$TMP/good.jsonl"
    chmod 755 "$TMP"
    out=$(setpriv --reuid=65534 --regid=65534 --clear-groups "$TRUN" timeline "$TMP/good.jsonl" \
      -o /tmp/never-written.html 2>&1)
    rc=$?
    chmod 644 "$TMP/good.jsonl"
    [ "$rc" = 1 ] && grep -q "cannot read the event log $TMP/good.jsonl: Permission denied" <<<"$out" ||
      fail "unreadable file: exit $rc: $out"
    echo "ok: an unreadable file -> 1: $out"
  else
    chmod 000 "$TMP/good.jsonl"
    expect 1 "Permission denied" "$TMP/good.jsonl" -o "$TMP/x.html"
    chmod 644 "$TMP/good.jsonl"
  fi
  : >"$TMP/empty.jsonl"
  expect 1 "no event in $TMP/empty.jsonl" "$TMP/empty.jsonl" -o "$TMP/x.html"
  printf 'not json\n[1,2]\n{"name":"x"}\n' >"$TMP/garbage.jsonl"
  expect 1 "garbage.jsonl:3: not an event \(no integer \"timestamp\"\); skipped" "$TMP/garbage.jsonl" -o "$TMP/x.html"
  [ -e "$TMP/x.html" ] && fail "a failed trun timeline wrote its output"
  # Garbage lines around real events are skipped with a warning naming file and line; the page
  # is written.
  { echo 'garbage'; echo "$good"; printf '{"name":"trun.agent.st'; } >"$TMP/mixed.jsonl"
  expect 0 "mixed.jsonl:1: not an event \(not a JSON value\); skipped" "$TMP/mixed.jsonl" -o "$TMP/x.html"
  grep -q 'class="lane node"' "$TMP/x.html" || fail "the page from mixed.jsonl has no node lane"
  out=$("$TRUN" timeline "$TMP/mixed.jsonl" -o "$TMP/x.html" 2>&1)
  grep -q "mixed.jsonl:3: not an event" <<<"$out" || fail "no warning for the cut last line: $out"
  expect 2 "no output file given" "$TMP/good.jsonl"
  expect 2 "no event log given" -o "$TMP/x.html"
  expect 2 "unknown option --bogus" --bogus "$TMP/good.jsonl" -o "$TMP/x.html"
  expect 1 "cannot write $TMP/nodir/x.html" "$TMP/good.jsonl" -o "$TMP/nodir/x.html"
  echo "PASS"
}

case_screenshot() {
  command -v chromium >/dev/null || skip setup "no chromium (Debian package chromium; scripts/setup.sh installs it)"
  [ -x "$WORKER" ] || fail "no $WORKER (build trun_test_worker)"
  local port common a b i started
  port=$(free_port)
  common=(--nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d "--rdzv-endpoint=127.0.0.1:$port"
    --rdzv-id=timeline --max-restarts=2 --monitor-interval=0.1
    --rdzv-conf=last_call_timeout=0.5,join_timeout=30)
  mkdir "$TMP/b"
  # Node a: attempt 0 exits 3 (a counted restart); attempt 1 waits until node b's worker runs,
  # so it is stopped by the re-form that b's join causes; in the 2-node round it exits 0.
  timeout -k 5 90 "$TRUN" "${common[@]}" --event-log="$TMP/a.jsonl" "$WORKER" \
    sleep 0.5 on-attempt 0 exit 3 wait-file "$TMP/b/pid_0_0" sleep 1 exit 0 >"$TMP/a.out" 2>&1 &
  a=$!
  PIDS+=("$a")
  for ((i = 0; i < 300; i++)); do
    started=$(grep -c worker_started "$TMP/a.jsonl" 2>/dev/null)
    [ "${started:-0}" -ge 2 ] && break
    kill -0 "$a" 2>/dev/null || fail "node a ended before its second attempt"
    sleep 0.1
  done
  [ "${started:-0}" -ge 2 ] || fail "node a's second attempt did not start within 30 s"
  sleep 0.5
  timeout -k 5 90 "$TRUN" "${common[@]}" --event-log="$TMP/b.jsonl" "$WORKER" \
    pidfile "$TMP/b" sleep 1 exit 0 >"$TMP/b.out" 2>&1 &
  b=$!
  PIDS+=("$b")
  wait "$a" || fail "node a exited $?"
  wait "$b" || fail "node b exited $?"
  PIDS=()

  "$TRUN" timeline "$TMP/a.jsonl" "$TMP/b.jsonl" -o "$TMP/run.html" 2>"$TMP/timeline.out" ||
    fail "trun timeline exited $?"
  grep -q -E '(src|href)="(https?:)?//' "$TMP/run.html" && fail "the page loads an external resource"

  chromium_run 60 --dump-dom "file://$TMP/run.html" >"$TMP/dom.html"
  [ -s "$TMP/dom.html" ] || fail "chromium --dump-dom printed nothing: $(tail -n 5 "$TMP/chromium.err")"
  local want
  for want in 'class="lane node"=2' 'class="lane worker"=2' 'class="bar =4' \
    'class="bar failed"=1' 'class="bar stopped"=1' 'class="bar succeeded"=2' \
    'class="marker restart"=1' 'class="marker reform"=1' 'class="marker round"=3' \
    'data-local-rank="0"><title>=4'; do
    local got
    got=$(count "$TMP/dom.html" "${want%=*}")
    [ "$got" = "${want##*=}" ] || fail "the DOM has $got of ${want%=*}, not ${want##*=}"
  done
  echo "ok: DOM: 2 node lanes, 2 worker lanes, 4 bars (failed, stopped, 2 succeeded), 1 restart, 1 re-form, 3 rounds"

  chromium_run 60 --window-size=1320,420 --screenshot="$TMP/timeline.png" "file://$TMP/run.html" \
    >/dev/null
  [ -s "$TMP/timeline.png" ] || fail "no screenshot: $(tail -n 5 "$TMP/chromium.err")"
  local json
  json=$(python3 "$SRC/png_lanes.py" "$TMP/timeline.png" node=#0b3d91 worker=#5fa8d3 \
    restart=#ff7f0e reform=#17becf round=#1f4fd1 failed=#d62728 stopped=#8c8c8c \
    succeeded=#2ca02c) || fail "png_lanes.py failed"
  echo "pixels: $json"
  python3 - "$json" <<'EOF' || fail "the screenshot does not show the expected lanes"
import json, sys
d = json.loads(sys.argv[1])
ok = True
def check(cond, what):
    global ok
    print(("ok: " if cond else "MISSING: ") + what)
    ok = ok and cond
check(len(d["lanes"].get("node", [])) == 2, "2 node lanes (marker runs %s)" % d["lanes"].get("node"))
check(len(d["lanes"].get("worker", [])) == 2, "2 worker lanes (marker runs %s)" % d["lanes"].get("worker"))
g = d["groups"]
if len(g) == 2:
    a, b = g
    check(a["restart"]["runs"] == 1 and b["restart"]["runs"] == 0, "the restart line in node a's lanes only")
    check(a["reform"]["runs"] == 1, "the re-form line in node a's lanes")
    # In node b's lanes: in node a's, a restart line drawn over a round line formed within
    # the same 3 ms (one pixel) would hide it.
    check(b["round"]["runs"] == 3, "3 round lines across node b's lanes")
    check(a["failed"]["longest"] >= 20 and b["failed"]["longest"] == 0, "a failed bar in node a only")
    check(a["stopped"]["longest"] >= 20, "a stopped bar in node a")
    check(a["succeeded"]["longest"] >= 20 and b["succeeded"]["longest"] >= 20, "a succeeded bar in each node")
sys.exit(0 if ok else 1)
EOF
  if [ -n "${TIMELINE_KEEP:-}" ]; then
    cp "$TMP/timeline.png" "$TIMELINE_KEEP/timeline.png" && echo "kept $TIMELINE_KEEP/timeline.png"
  fi
  echo "PASS"
}

case "$CASE" in
  bad_input) case_bad_input ;;
  screenshot) case_screenshot ;;
  *) echo "unknown case $CASE"; exit 2 ;;
esac
