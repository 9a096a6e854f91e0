# The netns harness of the multi-node tests (tests/cluster/cluster.sh, tests/cluster/chaos.sh):
# sourced by a script that has set BIN (the build directory), TEST (the scenario's name, for
# messages and skips) and SRC (tests/cluster). See cluster.sh's header for what it creates and how
# it cleans up. What a sourcing script may use:
#   add_node I, addr I, start_agent I [trun options...], c10d, wait_for, log, fail, agent_exit,
#   finish_ok, lines_with, have_world, check_ranks, check_restart; variables TMP, HUB, TAG,
#   AGENT_PID[I], NODES, OTHER_PIDS, CONF, PORT, WORKER_CMD (the worker command line).
#   AGENT_LOG_APPEND=1 makes start_agent append to agent_I.log (an agent started again keeps the
#   earlier incarnations' output); C10D_ENDPOINT overrides c10d's --rdzv-endpoint value.
# shellcheck shell=bash
TRUN=$BIN/launcher/trun
WORKER_CMD=("$SRC/worker.sh")
TAG=t$$
HUB=${TAG}hub

# run_alive PID: PID is a running cluster.sh (a reused pid of another program does not count).
run_alive() {
  [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -Eq '(cluster|chaos)\.sh'
}
# Leftovers of dead runs (see the header). Bounded: one pass over what exists now.
remove_stale() {
  local d pid ns p
  for d in /tmp/trun-cluster-*-*; do
    [ -d "$d" ] || continue
    pid=${d#/tmp/trun-cluster-}
    pid=${pid%%-*}
    [[ $pid =~ ^[0-9]+$ ]] || continue
    run_alive "$pid" || { echo "removing $d (its run, pid $pid, is gone)"; rm -rf "$d"; }
  done
  [ "$(id -u)" = 0 ] || return 0
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns =~ ^t([0-9]+)(hub|n[0-9]+)$ ]] || continue
    pid=${BASH_REMATCH[1]}
    run_alive "$pid" && continue
    echo "removing namespace $ns (its run, pid $pid, is gone)"
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
}
remove_stale

TMP=$(mktemp -d "/tmp/trun-cluster-$$-XXXXXX")
export CLUSTER_LOG=$TMP/workers.log CLUSTER_CTRL=$TMP
: >"$CLUSTER_LOG"
declare -A AGENT_PID
OTHER_PIDS=()  # processes a test starts besides agents (etcd), ended in cleanup
NODES=()
WATCHDOG=
CONF="last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3,join_timeout=8,read_timeout=3"
PORT=29611

SKIP_TEST_NAME="cluster.$TEST ($(basename "$0"))"
# shellcheck source=tests/skip.sh
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
fail() {
  echo "FAIL: $*"
  echo "--- worker log"; cat "$CLUSTER_LOG"
  for n in "${NODES[@]}"; do echo "--- agent $n"; tail -n 25 "$TMP/agent_$n.log"; done
  exit 1
}
log() { echo "[$(date +%T.%N | cut -c1-12)] $*"; }

cleanup() {
  local p
  for n in "${!AGENT_PID[@]}"; do
    p=${AGENT_PID[$n]}
    kill -KILL "$p" 2>/dev/null
  done
  # Workers left behind by a SIGKILLed agent: their pids are in the log.
  for p in $(grep -o 'pid=[0-9]*' "$CLUSTER_LOG" 2>/dev/null | cut -d= -f2 | sort -u); do
    kill -KILL "$p" 2>/dev/null
  done
  for n in "${!AGENT_PID[@]}"; do wait "${AGENT_PID[$n]}" 2>/dev/null; done
  for p in "${OTHER_PIDS[@]}"; do
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  if [ -n "$WATCHDOG" ]; then
    kill -KILL "$WATCHDOG" 2>/dev/null
    wait "$WATCHDOG" 2>/dev/null
  fi
  # Anything else still inside this run's node namespaces (a worker of a killed agent), by pid.
  for n in "${NODES[@]}"; do
    for p in $(ip netns pids "${TAG}n$n" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  for n in "${NODES[@]}"; do ip netns del "${TAG}n$n" 2>/dev/null; done
  ip netns del "$HUB" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# The watchdog polls once a second so that it ends with this run: if this shell dies, the
# watchdog's parent changes and it exits without signalling a pid that may have been reused. It
# waits with `read -t 1` on a pipe it holds open (no sleep child that would outlive a kill).
LIMIT=${CLUSTER_TIME_LIMIT:-0}
[[ $LIMIT =~ ^[0-9]+$ ]] || { echo "CLUSTER_TIME_LIMIT must be a whole number of seconds, got '$LIMIT'"; exit 1; }
if [ "$LIMIT" -gt 0 ]; then
  trap 'fail "the run exceeded CLUSTER_TIME_LIMIT=${LIMIT}s (watchdog)"' USR1
  (
    trap - EXIT INT TERM USR1
    exec {tick}<> <(:)
    for ((s = 0; s < LIMIT; s++)); do
      read -r -t 1 -u "$tick"
      read -r _ _ _ ppid _ <"/proc/$BASHPID/stat" && [ "$ppid" = "$$" ] || exit 0
    done
    kill -USR1 "$$"
  ) &
  WATCHDOG=$!
fi

[ "$(id -u)" = 0 ] || skip setup "needs root to create network namespaces"
ip netns add "$HUB" 2>/dev/null || skip setup "cannot create network namespaces (ip netns add failed)"
ip -n "$HUB" link add br0 type bridge || fail "cannot create the bridge"
ip -n "$HUB" link set br0 up
ip -n "$HUB" link set lo up

add_node() {  # add_node I: namespace ${TAG}nI with 10.77.0.(I+1)
  local i=$1 ns=${TAG}n$1
  ip netns add "$ns" || fail "ip netns add $ns"
  NODES+=("$i")
  ip -n "$HUB" link add "h$i" type veth peer name eth0 netns "$ns" || fail "veth for node $i"
  ip -n "$HUB" link set "h$i" master br0
  ip -n "$HUB" link set "h$i" up
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
}
addr() { echo "10.77.0.$(($1 + 1))"; }

# start_agent I [trun options...]: the agent of node I in the background; output in agent_I.log.
start_agent() {
  local i=$1
  shift
  [ "${AGENT_LOG_APPEND:-0}" = 1 ] || : >"$TMP/agent_$i.log"
  # TMPDIR inside $TMP: an agent killed by a test cannot remove its own log directory.
  CLUSTER_NODE=n$i TMPDIR=$TMP ip netns exec "${TAG}n$i" "$TRUN" --local-addr "$(addr "$i")" "$@" \
    "${WORKER_CMD[@]}" >>"$TMP/agent_$i.log" 2>&1 &
  AGENT_PID[$i]=$!
}
c10d() {  # common options of a c10d agent
  echo --rdzv-backend c10d --rdzv-endpoint "${C10D_ENDPOINT:-$(addr 0):$PORT}" --rdzv-id "job-$TAG" --rdzv-conf "$CONF"
}
# wait_for SECONDS DESCRIPTION COMMAND...: polls COMMAND every 0.1 s.
wait_for() {
  local secs=$1 what=$2
  shift 2
  local n=$((secs * 10))
  for ((k = 0; k < n; k++)); do
    "$@" && return 0
    sleep 0.1
  done
  fail "timed out after ${secs}s waiting for: $what"
}
# count of worker lines with world=W (and restart=R when given)
lines_with() { grep -c " world=$1 .*restart=${2:-[0-9]*} " "$CLUSTER_LOG"; }
have_world() { [ "$(grep -c " world=$1 " "$CLUSTER_LOG")" -ge "$1" ]; }
# The ranks of the last W lines with world=W must be exactly 0..W-1.
check_ranks() {
  local w=$1 got want
  got=$(grep " world=$w " "$CLUSTER_LOG" | tail -n "$w" | grep -o ' rank=[0-9]*' | cut -d= -f2 | sort -n | tr '\n' ' ')
  want=$(seq 0 $((w - 1)) | tr '\n' ' ')
  [ "$got" = "$want" ] || fail "ranks for world=$w are '$got', expected '$want'"
}
check_restart() {  # all lines with world=W have restart=R
  local bad
  bad=$(grep " world=$1 " "$CLUSTER_LOG" | grep -vc " restart=$2 ")
  [ "$bad" = 0 ] || fail "workers with world=$1 saw a restart count other than $2"
}
agent_exit() {  # agent_exit I: waits (<= 30 s) for agent I; its exit status goes to RC
  local p=${AGENT_PID[$1]} k
  for ((k = 0; k < 300; k++)); do
    kill -0 "$p" 2>/dev/null || break
    sleep 0.1
  done
  wait "$p"
  RC=$?
  unset "AGENT_PID[$1]"
}
finish_ok() {  # stop the workers, every agent exits 0
  touch "$TMP/stop"
  for n in "${!AGENT_PID[@]}"; do
    agent_exit "$n"
    [ "$RC" = 0 ] || fail "agent $n exited $RC, expected 0"
  done
}
ns_pid_alive() { kill -0 "$1" 2>/dev/null; }

