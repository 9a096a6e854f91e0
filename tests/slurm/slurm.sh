#!/usr/bin/env bash
# trun and libtrun_worker on a real SLURM: `slurm.sh TRUN_BINARY_DIR CASE`.
#
# Starts a throw-away SLURM cluster (scripts/slurm-local.sh: munged, slurmctld and two slurmd
# nodes n1, n2 on this machine), submits the sbatch examples of examples/slurm/ (the scripts that
# docs/slurm.md shows; the `docs` case checks the two agree) and stops exactly what it started.
# trun and train_mlp are found on PATH, as docs/slurm.md tells users; sbatch exports this
# environment to the jobs. Both "nodes" are this machine, so checkpoints in a local directory are
# what a shared file system gives a real cluster.
#
# Exit status: 0 pass, 1 fail, 77 skipped (not root; a failure instead under CI=true or
# TRUN_STRICT_SKIPS=1, as in tests/cluster/cluster.sh).
set -uo pipefail
BIN=$(cd "$1" && pwd)
CASE=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
EXAMPLES=$SRC/examples/slurm
SLURM_LOCAL=$SRC/scripts/slurm-local.sh

SKIP_TEST_NAME="slurm.$CASE (slurm.sh)"
# shellcheck source=tests/skip.sh
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
# shellcheck source=tests/doc_block.sh
source "$(dirname "${BASH_SOURCE[0]}")/../doc_block.sh"
fail() {
  echo "FAIL: slurm.$CASE: $*"
  if [[ -n ${CLUSTER_DIR:-} ]]; then
    echo "--- the cluster's jobs and the end of slurmctld's log:"
    scontrol show job 2>&1 | grep -E 'JobId|JobState|Restarts|EligibleTime|ExitCode'
    tail -n 25 "$CLUSTER_DIR/log/slurmctld.log"
  fi
  exit 1
}

[[ $(id -u) == 0 ]] || skip setup "needs root (scripts/slurm-local.sh runs slurmctld, slurmd and munged as root)"
command -v sbatch >/dev/null || skip setup "sbatch is not installed (scripts/setup.sh installs SLURM)"

TMP=$(mktemp -d /tmp/trun-slurm-XXXXXX)
chmod 755 "$TMP"
CLUSTER_DIR=
OTHER_PIDS=()  # processes this test starts besides the cluster (etcd), ended by pid
cleanup() {
  local p
  for p in "${OTHER_PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  if [[ -n $CLUSTER_DIR ]]; then
    SLURM_CONF=$CLUSTER_DIR/slurm.conf bash "$SLURM_LOCAL" down "$CLUSTER_DIR" 2>"$TMP/down.log" ||
      { echo "slurm-local.sh down failed:"; cat "$TMP/down.log"; }
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# The cluster (in $TMP/cluster; its own port so that a cluster of a dead run cannot be in the way).
env_out=$(SLURMTEST_NODES=2 SLURMTEST_ADD_HOSTS=1 SLURMTEST_SKIP_INSTALL=1 \
  SLURMTEST_WORKDIR=$TMP/cluster SLURMTEST_PORT=${SLURM_TEST_PORT:-16917} \
  bash "$SLURM_LOCAL" up 2>"$TMP/up.log") || { cat "$TMP/up.log"; fail "the SLURM cluster did not start"; }
CLUSTER_DIR=$TMP/cluster
eval "$env_out"

export PATH=$BIN/launcher:$BIN/examples:$PATH
export CKPT_ROOT=$TMP/ckpt
mkdir -p "$CKPT_ROOT"
cd "$TMP" || fail "cd $TMP"

# job_state JOB: SLURM's state of JOB (PENDING, RUNNING, COMPLETED, FAILED, ...).
job_state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
# job_exit JOB: "rc:signal" of a finished job.
job_exit() { scontrol show job "$1" 2>/dev/null | sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p'; }
# wait_job JOB SECONDS: until JOB has ended (or fail).
wait_job() {
  local i
  for ((i = 0; i < $2 * 5; i++)); do
    case $(job_state "$1") in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | PREEMPTED) return 0 ;;
    esac
    sleep 0.2
  done
  fail "job $1 still $(job_state "$1") after $2 s; its output: $(cat "$TMP"/*.out 2>/dev/null)"
}
# wait_output FILE PATTERN SECONDS
wait_output() {
  local i
  for ((i = 0; i < $3 * 5; i++)); do
    grep -qE "$2" "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  fail "no line matching '$2' in $1 after $3 s: $(cat "$1" 2>/dev/null)"
}
# submit SCRIPT ARGS...: sbatch SCRIPT, its output in $TMP/<name>-<job>.out; prints the job id.
submit() {
  local script=$1
  shift
  sbatch --parsable --output="$TMP/$(basename "$script" .sbatch)-%j.out" "$script" "$@"
}

# trained WORLD FILE: FILE shows a finished training in one world of WORLD ranks.
trained() {
  grep -q "done: .* world size $1\$" "$2" || fail "no 'done: ... world size $1' in $2: $(cat "$2")"
  [[ $(grep -c "done: " "$2") == 1 ]] || fail "more than one training finished in $2: $(cat "$2")"
}
# exited JOB CODE: SLURM recorded JOB's exit as CODE ("rc:signal").
exited() {
  local got
  got=$(job_exit "$1")
  [[ $got == "$2" ]] || fail "job $1 exited $got, expected $2: $(cat "$TMP"/*-"$1".out)"
}
# stop_step FILE SIGNAL: the step at which rank 0 said it stopped on SIGNAL (fails if it did not).
stop_step() {
  local line
  line=$(grep -m1 "stopped on request ($2) at step" "$1") ||
    fail "no 'stopped on request ($2) at step' in $1: $(cat "$1")"
  sed -n 's/.*at step \([0-9]*\).*/\1/p' <<<"$line"
}
# start_etcd: an etcd of this test on free loopback ports; sets ETCD_ENDPOINT and ETCD_PID.
start_etcd() {
  local port peer i
  command -v etcd >/dev/null || skip setup "etcd is not installed (scripts/setup.sh installs etcd-server)"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  peer=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  etcd --data-dir "$TMP/etcd" --listen-client-urls "http://127.0.0.1:$port" \
    --advertise-client-urls "http://127.0.0.1:$port" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "default=http://127.0.0.1:$peer" >"$TMP/etcd.log" 2>&1 &
  ETCD_PID=$!
  OTHER_PIDS+=("$ETCD_PID")
  for ((i = 0; i < 100; i++)); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.1
  done
  export ETCD_ENDPOINT=127.0.0.1:$port
}
# requeue_now JOB: a requeued job waits 2 min to be eligible again (SLURM's rule); start it now.
# Not at once: a start in the same second as the requeue's kill fails ("Job credential revoked",
# the credential's times have 1 s resolution), so wait 2 s; an update while the requeue is still
# being completed does not stick, so repeat it (bounded) until the job leaves PENDING.
requeue_now() {
  local i
  for ((i = 0; i < 150; i++)); do
    [[ $(job_state "$1") == PENDING ]] && scontrol show job "$1" | grep -q 'Restarts=1' && break
    sleep 0.2
  done
  [[ $(job_state "$1") == PENDING ]] || fail "job $1 was not requeued: $(job_state "$1"), $(cat "$TMP"/*-"$1".out)"
  sleep 2
  for ((i = 0; i < 20; i++)); do
    [[ $(job_state "$1") == PENDING ]] || return 0
    scontrol update JobId="$1" StartTime=now || fail "scontrol update StartTime=now"
    sleep 1
  done
  fail "job $1 still pending 20 s after its requeue"
}
# The training of the stop tests: long enough (3 epochs of 16 steps at 60 ms) to be interrupted.
TRAIN=(--epochs 3 --step-sleep-ms 60 --ckpt-every 1000 --seed 11)

case $CASE in
  c10d | static)
    job=$(submit "$EXAMPLES/$CASE.sbatch" --epochs 2) || fail "sbatch"
    wait_job "$job" 120
    out=$TMP/$CASE-$job.out
    exited "$job" 0:0
    trained 4 "$out"
    # The derived-values line names what it took from SLURM.
    grep "from SLURM" "$out" | grep -q "SLURM_STEP_NODELIST" || fail "no derived-values line naming SLURM_STEP_NODELIST: $(cat "$out")"
    grep "from SLURM" "$out" | grep -q "SLURM_STEP_NUM_NODES" || fail "the derived-values line does not name SLURM_STEP_NUM_NODES: $(cat "$out")"
    if [[ $CASE == static ]]; then
      grep "from SLURM" "$out" | grep -q "SLURM_NODEID" || fail "the static backend's node rank does not come from SLURM_NODEID: $(cat "$out")"
    fi
    ;;
  etcd)
    start_etcd
    job=$(submit "$EXAMPLES/etcd.sbatch" --epochs 2) || fail "sbatch"
    wait_job "$job" 120
    exited "$job" 0:0
    trained 4 "$TMP/etcd-$job.out"
    ;;
  srun_n)
    job=$(submit "$EXAMPLES/srun-n.sbatch" --epochs 2) || fail "sbatch"
    wait_job "$job" 120
    exited "$job" 0:0
    trained 4 "$TMP/srun-n-$job.out"
    ;;
  preempt | preempt_batch)
    # The reference: the same training, never interrupted.
    # Its own directory (the last --ckpt-dir wins): in the script's, the job below would continue it.
    ref=$(submit "$EXAMPLES/preempt.sbatch" "${TRAIN[@]}" --final-params "$TMP/ref.params" \
      --ckpt-dir "$TMP/ref-ckpt") || fail "sbatch"
    wait_job "$ref" 120
    exited "$ref" 0:0
    job=$(submit "$EXAMPLES/preempt.sbatch" "${TRAIN[@]}" --final-params "$TMP/stopped.params") || fail "sbatch"
    out=$TMP/preempt-$job.out
    wait_output "$out" "epoch 1 " 60
    if [[ $CASE == preempt ]]; then
      scancel --signal=USR1 "$job" || fail "scancel --signal=USR1"  # to the step (trun, workers)
    else
      scancel --signal=USR1 --batch "$job" || fail "scancel --signal=USR1 --batch"  # as --signal=B:USR1@N
    fi
    requeue_now "$job"
    wait_output "$out" "step ended with [0-9]+ \\(run 2\\)" 120
    wait_job "$job" 60
    exited "$job" 0:0
    step=$(stop_step "$out" SIGUSR1)
    grep -q "step ended with 138 (run 1)" "$out" || fail "trun did not exit 138 on the forwarded USR1: $(cat "$out")"
    grep -q "resumed from .*/step_$step (step $step," "$out" || fail "the requeued run did not resume at step $step: $(cat "$out")"
    trained 4 "$out"
    cmp "$TMP/ref.params" "$TMP/stopped.params" ||
      fail "final parameters differ from the uninterrupted run's (stopped at step $step)"
    echo "stopped at step $step, resumed there, final parameters identical to the uninterrupted run"
    ;;
  scancel)
    # Plain scancel: SIGTERM to the step, SIGKILL KillWait (5 s here) later. The final checkpoint
    # must be written in between.
    job=$(submit "$EXAMPLES/c10d.sbatch" "${TRAIN[@]}") || fail "sbatch"
    out=$TMP/c10d-$job.out
    wait_output "$out" "epoch 1 " 60
    scancel "$job" || fail "scancel"
    wait_job "$job" 60
    step=$(stop_step "$out" SIGTERM)
    [[ -d $CKPT_ROOT/mlp-c10d/step_$step ]] || fail "no checkpoint step_$step in $CKPT_ROOT/mlp-c10d: $(ls "$CKPT_ROOT/mlp-c10d")"
    echo "stopped at step $step with its checkpoint saved"
    ;;
  again)
    # docs/slurm.md's "run it again to resume": the same script submitted twice in a row. The
    # second job (a new job id) continues the first's newest checkpoint and says so.
    first=$(submit "$EXAMPLES/c10d.sbatch" --epochs 2 --ckpt-every 4 --stop-after-steps 8) || fail "sbatch"
    wait_job "$first" 120
    exited "$first" 0:0
    [[ -d $CKPT_ROOT/mlp-c10d/step_8 ]] || fail "the first job saved no step_8: $(ls "$CKPT_ROOT/mlp-c10d")"
    second=$(submit "$EXAMPLES/c10d.sbatch" --epochs 2 --ckpt-every 4) || fail "sbatch"
    wait_job "$second" 120
    exited "$second" 0:0
    out=$TMP/c10d-$second.out
    grep -qF "continuing job '$first' from $CKPT_ROOT/mlp-c10d/step_8 (its owner is gone); this is job '$second'" "$out" ||
      fail "the second job does not say it continues job $first at step_8: $(cat "$out")"
    grep -qF "resumed from $CKPT_ROOT/mlp-c10d/step_8 (step 8," "$out" || fail "the second job did not resume at step 8: $(cat "$out")"
    trained 4 "$out"
    echo "job $second continued job $first from step 8"
    ;;
  docs)
    # Every example docs/slurm.md shows is one of the files the cases above run, verbatim: each
    # file's block follows a line naming it.
    for f in "$EXAMPLES"/*.sbatch; do
      name=examples/slurm/$(basename "$f")
      doc_block "$SRC/docs/slurm.md" "$name" bash >"$TMP/doc-block"
      [[ -s $TMP/doc-block ]] || fail "docs/slurm.md shows no block for $name"
      diff -u "$f" "$TMP/doc-block" >"$TMP/doc-diff" || fail "docs/slurm.md's $name differs from the file: $(cat "$TMP/doc-diff")"
    done
    ;;
  *) fail "unknown case $CASE" ;;
esac
echo "PASS: slurm.$CASE"
