#!/usr/bin/env bash
# The worker tests/container/container_test.sh runs under the installed trun, as PID 1 of a PID
# namespace: `worker.sh DIR MODE`, MODE stop (exit 0 on SIGTERM/SIGINT) or stubborn (ignore
# SIGTERM, so trun has to SIGKILL it when the shutdown timeout runs out).
#
# It leaves two orphaned grandchildren, whose parent exits at once so that they are reparented to
# trun (PID 1 and subreaper):
# - a short-lived one: waits until the worker wrote DIR/go_<rank> (by then its parent is gone and
#   reaped), writes its parent pid (1 when trun adopted it) to DIR/orphan_<rank>, and exits: PID 1
#   must reap it or it stays a zombie;
# - a long-lived one in the worker's process group: writes DIR/orphan_sig_<rank> when trun's
#   forwarded signal reaches it (the kernel's SIGKILL at namespace teardown would write nothing).
# Then it writes DIR/running_<rank> and waits (at most 300 s) for a signal, writing its name to
# DIR/sig_<rank>.
set -euo pipefail
dir=$1
mode=$2
rank=${LOCAL_RANK:?}

# The short-lived orphan. Its parent subshell exits right after starting it.
(
  (
    for _ in $(seq 200); do
      [[ -e $dir/go_$rank ]] && break
      sleep 0.05
    done
    read -r -a stat </proc/"$BASHPID"/stat
    echo "${stat[3]}" >"$dir/orphan_$rank.tmp"
    mv "$dir/orphan_$rank.tmp" "$dir/orphan_$rank"
  ) &
)
: >"$dir/go_$rank"

# The long-lived orphan.
(
  (
    trap 'echo stopped >"$dir/orphan_sig_$rank"; exit 0' TERM INT
    for _ in $(seq 600); do
      sleep 0.5 &
      wait $! || true
    done
  ) &
)

# shellcheck disable=SC2317  # invoked by the traps below
on_signal() {
  echo "$1" >"$dir/sig_$rank"
  if [[ $mode == stop ]]; then exit 0; fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
echo "$$" >"$dir/running_$rank"
for _ in $(seq 600); do
  sleep 0.5 &
  wait $! || true
done
exit 1
