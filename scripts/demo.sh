#!/usr/bin/env bash
# The README's main job: an elastic training demo on one machine with the embedded store.
# Installs what is missing (scripts/setup.sh), builds the two targets it runs (trun and
# examples/train_mlp, into $TRUN_BUILD_DIR, default build/), then trains examples/train_mlp (a C++
# MLP with DDP and checkpoints) with 4 workers under `trun --standalone`, restarting up to 3
# times. The workers run the resilient loop (docs/worker_sdk.md): KILL_AFTER seconds into the
# training (5; 0: never) the demo SIGKILLs local rank 1's worker, and trun replaces it alone while
# the other workers keep training and hand it their state (no checkpoint is read). Every stage
# says what it does and shows its progress. Environment: NPROC (4), EPOCHS (20), CKPT_DIR (a fresh
# temporary directory, removed at the end unless you set it), STEP_SLEEP_MS (20: slows training so
# you can kill a worker yourself too), KILL_AFTER (5), TRUN_BUILD_DIR (build).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${TRUN_BUILD_DIR:-build}

echo "demo: installing packages (first run only, ~3 min)..."
bash scripts/setup.sh
echo "demo: building trun and examples/train_mlp into $BUILD_DIR/ (a first build takes a few minutes)..."
bash scripts/build.sh --progress --no-setup trun train_mlp

ckpt=${CKPT_DIR:-}
# The checkpoints belong to this training: a second run on the same CKPT_DIR resumes it.
export TRUN_JOB_ID=${TRUN_JOB_ID:-trun-demo}
if [[ -z "$ckpt" ]]; then
  ckpt=$(mktemp -d /tmp/trun-demo-ckpt.XXXXXX)
  trap 'rm -rf "$ckpt"' EXIT
fi
workers=${NPROC:-4}
echo "demo: running $BUILD_DIR/launcher/trun --standalone --nproc-per-node=$workers --max-restarts=3 $BUILD_DIR/examples/train_mlp"
echo "demo: checkpoints in $ckpt; kill a worker (kill -9 <pid from a [pid] prefix>) to see it replaced"
kill_after=${KILL_AFTER:-5}
if [[ $kill_after != 0 ]]; then
  # In the background: after KILL_AFTER s, SIGKILL the worker of local rank 1 (a child of this
  # script's trun whose environment says LOCAL_RANK=1). Bounded: it looks once, then exits.
  script_pid=$$
  (
    sleep "$kill_after"
    for t in $(cat /proc/"$script_pid"/task/*/children 2>/dev/null); do
      [[ $(cat /proc/"$t"/comm 2>/dev/null) == trun ]] || continue
      for w in $(cat /proc/"$t"/task/*/children 2>/dev/null); do
        if tr '\0' '\n' <"/proc/$w/environ" 2>/dev/null | grep -qx LOCAL_RANK=1; then
          echo "demo: SIGKILL to the worker of local rank 1 (pid $w): trun replaces it alone"
          kill -KILL "$w" 2>/dev/null || true
        fi
      done
    done
  ) &
fi
"$BUILD_DIR/launcher/trun" --standalone --nproc-per-node="$workers" --max-restarts=3 \
  "$BUILD_DIR/examples/train_mlp" --ckpt-dir "$ckpt" --epochs "${EPOCHS:-20}" \
  --step-sleep-ms "${STEP_SLEEP_MS:-20}"
