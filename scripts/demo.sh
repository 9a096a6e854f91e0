#!/usr/bin/env bash
# The README's main job: an elastic training demo on one machine with the embedded store.
# Builds trun, then trains examples/train_mlp (a C++ MLP with DDP and checkpoints) with 4 workers
# under `trun --standalone`, restarting up to 3 times; a restarted group resumes from the newest
# checkpoint. Environment: NPROC (4), EPOCHS (20), CKPT_DIR (a fresh temporary directory, removed
# at the end unless you set it), STEP_SLEEP_MS (20: slows training so you can kill a worker).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ckpt=${CKPT_DIR:-}
# The checkpoints belong to this training: a second run on the same CKPT_DIR resumes it.
export TRUN_JOB_ID=${TRUN_JOB_ID:-trun-demo}
if [[ -z "$ckpt" ]]; then
  ckpt=$(mktemp -d /tmp/trun-demo-ckpt.XXXXXX)
  trap 'rm -rf "$ckpt"' EXIT
fi
echo "demo: checkpoints in $ckpt; kill a worker (kill -9 <pid from a [pid] prefix>) to see a restart"
build/launcher/trun --standalone --nproc-per-node="${NPROC:-4}" --max-restarts=3 \
  build/examples/train_mlp --ckpt-dir "$ckpt" --epochs "${EPOCHS:-20}" \
  --step-sleep-ms "${STEP_SLEEP_MS:-20}"
