#!/usr/bin/env bash
# The cluster tests' worker: appends one line describing its environment to $CLUSTER_LOG, then
# waits. Control files in $CLUSTER_CTRL (created by the test):
#   crash_<node>_<restart>  local rank 0 on node <node> exits 1 (once per restart count)
#   crash_<node>_any        local rank 0 on node <node> exits 1 on every attempt
#   stop                    every worker exits 0
# Bounded: exits 0 after 120 s at most.
set -u
echo "t=$(date +%s.%N) node=${CLUSTER_NODE} rank=${RANK} world=${WORLD_SIZE}" \
  "local_rank=${LOCAL_RANK} group_rank=${GROUP_RANK} group_world=${GROUP_WORLD_SIZE}" \
  "restart=${TORCHELASTIC_RESTART_COUNT} master=${MASTER_ADDR}:${MASTER_PORT} pid=$$" \
  >>"${CLUSTER_LOG}"
for _ in $(seq 1 1200); do
  if [ "${LOCAL_RANK}" = 0 ]; then
    if [ -e "${CLUSTER_CTRL}/crash_${CLUSTER_NODE}_${TORCHELASTIC_RESTART_COUNT}" ] ||
      [ -e "${CLUSTER_CTRL}/crash_${CLUSTER_NODE}_any" ]; then
      echo "worker on ${CLUSTER_NODE} crashing on purpose" >&2
      echo "t=$(date +%s.%N) node=${CLUSTER_NODE} crash restart=${TORCHELASTIC_RESTART_COUNT}" >>"${CLUSTER_LOG}"
      exit 1
    fi
  fi
  [ -e "${CLUSTER_CTRL}/stop" ] && exit 0
  sleep 0.1
done
exit 0
