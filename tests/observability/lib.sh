# shellcheck shell=bash
# Shared by tests/observability/*.sh (source it after tests/skip.sh): `obs_setup NAME` makes
#   TMP          a temp dir /tmp/trun-NAME-XXXXXX, removed on exit
#   PIDS         processes ended (SIGKILL, by pid) and reaped on exit
#   CHROME_PGID  a process group ended (SIGKILL, by its id) on exit, when set
# and the functions
#   fail MSG     prints "FAIL: MSG" and the last lines of every $TMP/*.out, exits 1
#   free_port    prints a loopback TCP port that was free a moment ago (scripts/lib.sh)

obs_setup() {
  TMP=$(mktemp -d "/tmp/trun-$1-XXXXXX")
  PIDS=()
  CHROME_PGID=
  trap obs_cleanup EXIT
  trap 'exit 1' TERM INT
}

obs_cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  [ -n "$CHROME_PGID" ] && kill -KILL -- "-$CHROME_PGID" 2>/dev/null
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$TMP"
}

fail() {
  echo "FAIL: $*"
  local f
  for f in "$TMP"/*.out; do [ -f "$f" ] && { echo "--- $f"; tail -n 20 "$f"; }; done
  exit 1
}

# free_port (and the benchmarks' other helpers, unused here).
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
