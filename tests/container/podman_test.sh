#!/usr/bin/env bash
# The container image built and run for real, with podman (scripts/container.sh):
#   podman_test.sh CASE BUILD_DIR SOURCE_DIR
#
# CASE (one CTest test each, label container; tests/container/CMakeLists.txt):
#   build  scripts/container.sh build --from-build BUILD_DIR, tagged localhost/trun:ctest and
#          localhost/trun-demo:ctest (the fixture the others need; the base image is made with
#          mmdebstrap on a machine's first run and kept, as an apt cache would be)
#   run    trun --version and --help in the image; every ELF file of /usr/local loads (no
#          library not found); the packages and the size of the image, printed; the demo image
#          trains examples/train_mlp on 2 workers (--standalone) and exits 0
#   c10d   two containers on a podman network of their own (internal, static addresses) run one
#          c10d job of 2x2 workers with a shared checkpoint directory; the second container is
#          SIGKILLed mid-training: the first re-forms alone (world size 2, no restart spent), resumes
#          from the newest checkpoint and finishes with exit 0
#   stop   `podman stop` of a training container: SIGTERM, the workers save a checkpoint, trun exits
#          143 before podman's 10 s grace period ends (no SIGKILL: that would be 137), nothing runs
#   k8s    examples/k8s/pod.yaml with `podman kube play`: the Pod's trun trains and exits 0;
#          `podman kube down` removes it. examples/k8s/pytorchjob.yaml: the PET_* variables the
#          Kubeflow training operator derives from it, given to `trun --dry-run` in the image, give
#          the configuration the manifest asks for
#   docs   docs/containers.md shows examples/k8s/*.yaml verbatim
#   clean  removes the two images (the fixture's cleanup)
# Exit status: 0 pass, 1 fail, 77 skipped (podman missing or not root; a failure in strict mode,
# CI=true or TRUN_STRICT_SKIPS=1, since scripts/setup.sh installs podman).
set -euo pipefail
CASE=${1:?usage: podman_test.sh CASE BUILD_DIR SOURCE_DIR}
BUILD=$(cd "${2:?}" && pwd)
SRC=$(cd "${3:?}" && pwd)
export TRUN_IMAGE=localhost/trun:ctest
IMAGE=$TRUN_IMAGE
DEMO=localhost/trun-demo:ctest
TAG=trun-ctest-$$
TMP=$(mktemp -d /tmp/trun-podman-test-XXXXXX)
CONTAINERS=()
NETWORK=
KUBE_FILE=

SKIP_TEST_NAME="container.$CASE (podman_test.sh)"
# shellcheck source=tests/skip.sh
source "$SRC/tests/skip.sh"
# shellcheck source=tests/doc_block.sh
source "$SRC/tests/doc_block.sh"

pod() { bash "$SRC/scripts/container.sh" podman "$@"; }

cleanup() {
  # Containers by the names this run gave them (podman ends their processes), then the network
  # and the Pod; each is this run's own.
  local c
  for c in "${CONTAINERS[@]}"; do pod rm -f -t 0 "$c" >/dev/null 2>&1 || true; done
  if [[ -n $KUBE_FILE ]]; then pod kube down "$KUBE_FILE" >/dev/null 2>&1 || true; fi
  if [[ -n $NETWORK ]]; then pod network rm -f "$NETWORK" >/dev/null 2>&1 || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*"
  local c
  for c in "${CONTAINERS[@]}"; do
    echo "--- podman logs $c (the last 40 lines but the per-epoch ones):"
    pod logs "$c" 2>&1 | grep -v "^\[[0-9]*\] epoch [0-9]* (rank" | tail -40 || true
  done
  exit 1
}

# wait_for SECONDS DESCRIPTION COMMAND...: polls COMMAND every 0.2 s.
wait_for() {
  local secs=$1 what=$2 k
  shift 2
  for ((k = 0; k < secs * 5; k++)); do
    "$@" && return 0
    sleep 0.2
  done
  fail "timed out after ${secs} s waiting for: $what"
}

# Whole logs first: grep -q would stop reading early, and podman's SIGPIPE fail the pipeline.
logs_have() {
  local text
  text=$(pod logs "$1" 2>&1)
  grep -q -- "$2" <<<"$text"
}
running() { [[ $(pod inspect --format '{{.State.Running}}' "$1" 2>/dev/null) == true ]]; }
exited() { ! running "$1"; }
exit_code() { pod inspect --format '{{.State.ExitCode}}' "$1"; }

if [[ $CASE != docs ]]; then
  command -v podman >/dev/null || skip setup "podman is not installed (scripts/setup.sh installs it)"
  [[ $(id -u) == 0 ]] || skip setup "not root: these tests run podman as root (runc, cgroupfs)"
fi
if [[ $CASE != build && $CASE != clean && $CASE != docs ]]; then
  podman image exists "$IMAGE" && podman image exists "$DEMO" ||
    fail "$IMAGE or $DEMO is missing: the container.build test makes them (ctest -R container)"
fi

# A training container's common options: the demo image, a name this run owns, the checkpoint
# directory of the test mounted at /ckpt.
run_demo() {
  local name=$1
  shift
  CONTAINERS+=("$name")
  pod run -d --name "$name" -v "$TMP/ckpt:/ckpt" "$@" >/dev/null
}

case $CASE in
  build)
    bash "$SRC/scripts/container.sh" build --from-build "$BUILD" ||
      fail "scripts/container.sh build --from-build $BUILD"
    ;;

  run)
    out=$(pod run --rm "$IMAGE" --version) || fail "trun --version in the image"
    echo "$out"
    grep -qx "trun [0-9.]* (torchrun-compatible)" <<<"$out" || fail "--version's first line: $out"
    grep -q "^commit: [0-9a-f]\{12\}" <<<"$out" || fail "--version names no commit: $out"
    [[ $(pod run --rm "$IMAGE" --version) == "$("$BUILD/launcher/trun" --version)" ]] ||
      fail "the image's trun --version differs from $BUILD/launcher/trun's"
    pod run --rm "$IMAGE" --help >"$TMP/help" || fail "trun --help in the image (the image's CMD)"
    grep -q -- "--nproc-per-node" "$TMP/help" || fail "--help does not list --nproc-per-node"
    # Every ELF file under /usr/local loads: no library missing from the image.
    pod run --rm --entrypoint sh "$DEMO" -c \
      'for f in /usr/local/bin/* /usr/local/lib/*.so*; do echo "== $f"; ldd "$f"; done' >"$TMP/ldd" 2>&1 ||
      fail "ldd in the image: $(cat "$TMP/ldd")"
    if grep -q "not found" "$TMP/ldd"; then fail "libraries missing in the image: $(grep -B20 "not found" "$TMP/ldd")"; fi
    echo "ELF files checked: $(grep -c '^== ' "$TMP/ldd")"
    pod run --rm --entrypoint dpkg-query "$IMAGE" -W -f '${Package}\n' >"$TMP/packages"
    mb=$(($(podman image inspect --format '{{.Size}}' "$IMAGE") / 1000000))
    echo "image $IMAGE: $mb MB, $(wc -l <"$TMP/packages") Debian packages: $(tr '\n' ' ' <"$TMP/packages")"
    while read -r p; do
      grep -qx "$p" "$TMP/packages" || fail "runtime package $p is not installed in the image"
    done < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$SRC/scripts/runtime-packages.txt")
    for p in build-essential g++ cmake python3; do
      if grep -qx "$p" "$TMP/packages"; then fail "the runtime image holds $p"; fi
    done
    # The README's way to try it: the demo image trains on 2 workers.
    mkdir -p "$TMP/ckpt"
    run_demo "$TAG-demo" "$DEMO" --standalone --nproc-per-node=2 --no-python train_mlp \
      --ckpt-dir /ckpt --epochs 3
    wait_for 120 "the demo training ends" exited "$TAG-demo"
    [[ $(exit_code "$TAG-demo") == 0 ]] || fail "the demo training exited $(exit_code "$TAG-demo")"
    logs_have "$TAG-demo" "done: .* steps, world size 2" || fail "the demo training did not finish"
    pod logs "$TAG-demo" 2>&1 | grep "done: "
    ;;

  c10d)
    # A network of this run's own: internal (no route out), a /24 from the pid, addresses fixed
    # (podman's CNI setup here has no DNS plugin).
    subnet=10.89.$((100 + $$ % 150))
    NETWORK=$TAG
    pod network create --internal --subnet "$subnet.0/24" "$NETWORK" >/dev/null ||
      fail "podman network create $NETWORK ($subnet.0/24)"
    mkdir -p "$TMP/ckpt"
    # A lost node is declared dead after 5 missed keep-alives of 1 s.
    conf="last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=30,read_timeout=5"
    # --classic: this case checks the whole-group resume from the checkpoint after a node is lost
    # (with the resilient loop node 0's workers would keep running: cluster.reform_join).
    for i in 0 1; do
      run_demo "$TAG-n$i" --network "$NETWORK" --ip "$subnet.1$i" -e LOGLEVEL=INFO "$DEMO" \
        --nnodes=1:2 --nproc-per-node=2 --max-restarts=0 --rdzv-backend=c10d \
        --rdzv-endpoint="$subnet.10:29400" --rdzv-id=ctest --rdzv-conf="$conf" \
        --local-addr="$subnet.1$i" --no-python train_mlp --classic --ckpt-dir /ckpt --epochs 40 \
        --ckpt-every 4 --step-sleep-ms 20
    done
    for i in 0 1; do
      wait_for 60 "node $i joins a group of 4 workers" logs_have "$TAG-n$i" " world_size=4"
    done
    wait_for 60 "a checkpoint" compgen -G "$TMP/ckpt/step_*" >/dev/null
    echo "both nodes train (world size 4); SIGKILL to node 1's container"
    alone() {
      local text
      text=$(pod logs "$TAG-n0" 2>&1)
      grep -c " world_size=2" <<<"$text" || true
    }
    before=$(alone)
    pod kill -s KILL "$TAG-n1" >/dev/null
    reformed() { (($(alone) > before)); }
    wait_for 60 "node 0 re-forms alone" reformed
    wait_for 180 "node 0 ends" exited "$TAG-n0"
    [[ $(exit_code "$TAG-n0") == 0 ]] || fail "node 0 exited $(exit_code "$TAG-n0")"
    logs_have "$TAG-n0" "resumed from /ckpt/step_" || fail "node 0's new group did not resume from a checkpoint"
    logs_have "$TAG-n0" "done: .* steps, world size 2" || fail "node 0 did not finish training"
    echo "node 0 re-formed alone, resumed and finished: exit 0"
    ;;

  stop)
    mkdir -p "$TMP/ckpt"
    run_demo "$TAG-stop" "$DEMO" --standalone --nproc-per-node=2 --no-python train_mlp \
      --ckpt-dir /ckpt --epochs 100000 --step-sleep-ms 20
    wait_for 60 "training" logs_have "$TAG-stop" "epoch 1 "
    start=$(date +%s%N)
    pod stop -t 10 "$TAG-stop" >/dev/null
    ms=$((($(date +%s%N) - start) / 1000000))
    code=$(exit_code "$TAG-stop")
    echo "podman stop took $ms ms, exit $code"
    [[ $code == 143 ]] || fail "trun exited $code on podman stop, not 143 (137 = podman had to SIGKILL it)"
    ((ms < 10000)) || fail "podman stop took $ms ms: past the 10 s grace period"
    logs_have "$TAG-stop" "stopped on request (SIGTERM) at step .*checkpoint step_.* saved" ||
      fail "the workers did not save a checkpoint on SIGTERM"
    if pod top "$TAG-stop" >/dev/null 2>&1; then fail "processes still run in the stopped container"; fi
    ;;

  k8s)
    # The Pod: the manifest names localhost/trun-demo:<version>; this run's image stands in.
    version=$(bash "$SRC/scripts/version.sh")
    KUBE_FILE=$TMP/pod.yaml
    sed "s|image: localhost/trun-demo:$version|image: $DEMO|" "$SRC/examples/k8s/pod.yaml" >"$KUBE_FILE"
    grep -q "image: $DEMO" "$KUBE_FILE" || fail "examples/k8s/pod.yaml names no image localhost/trun-demo:$version"
    # On podman's default network: kube play would otherwise create a network of its own
    # (podman-default-kube-network) and keep it.
    pod kube play --network podman "$KUBE_FILE" >"$TMP/play.log" 2>&1 || fail "podman kube play: $(cat "$TMP/play.log")"
    ctr=$(podman ps -a --filter "pod=trun-mlp" --format '{{.Names}}' | grep -v -- '-infra$' | head -1)
    [[ -n $ctr ]] || fail "podman kube play started no container in Pod trun-mlp: $(cat "$TMP/play.log")"
    CONTAINERS+=("$ctr")
    wait_for 180 "the Pod's training ends" exited "$ctr"
    [[ $(exit_code "$ctr") == 0 ]] || fail "the Pod's trun exited $(exit_code "$ctr")"
    logs_have "$ctr" "done: .* steps, world size 2" || fail "the Pod's training did not finish"
    pod kube down "$KUBE_FILE" >/dev/null || fail "podman kube down"
    KUBE_FILE=
    CONTAINERS=()
    if podman pod exists trun-mlp; then fail "podman kube down left Pod trun-mlp"; fi
    echo "examples/k8s/pod.yaml: trained and exited 0; kube down removed the Pod"

    # The PyTorchJob: what the training operator sets from its elasticPolicy (the Kubeflow
    # training operator's elastic environment; docs/containers.md), read off the manifest.
    job=$SRC/examples/k8s/pytorchjob.yaml
    field() { sed -n "s/^ *$1: *\"\{0,1\}\([^\"]*\)\"\{0,1\}$/\1/p" "$job" | head -1; }
    name=$(field name) min=$(field minReplicas) max=$(field maxReplicas)
    nproc=$(field nprocPerNode) backend=$(field rdzvBackend) rdzv_id=$(field rdzvId)
    restarts=$(field maxRestarts) port=$(field containerPort)
    for v in name min max nproc backend rdzv_id restarts port; do
      [[ -n ${!v} ]] || fail "examples/k8s/pytorchjob.yaml: no $v"
    done
    env=(-e "PET_NNODES=$min:$max" -e "PET_NPROC_PER_NODE=$nproc" -e "PET_RDZV_BACKEND=$backend"
      -e "PET_RDZV_ENDPOINT=$name-worker-0:$port" -e "PET_RDZV_ID=$rdzv_id"
      -e "PET_MAX_RESTARTS=$restarts" -e PYTHONUNBUFFERED=0)
    # The container's args, as the manifest gives them.
    mapfile -t args < <(sed -n '/^ *args:/,/^ *[a-z]*:/p' "$job" | sed -n 's/^ *- *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p')
    ((${#args[@]} > 0)) || fail "examples/k8s/pytorchjob.yaml: no args"
    pod run --rm "${env[@]}" "$DEMO" --dry-run "${args[@]}" >"$TMP/dry.json" 2>"$TMP/dry.err" ||
      fail "trun --dry-run with the PyTorchJob's variables: $(cat "$TMP/dry.err")"
    python3 - "$TMP/dry.json" "$min" "$max" "$nproc" "$backend" "$name-worker-0:$port" "$rdzv_id" "$restarts" <<'EOF' || fail "the PyTorchJob's configuration"
import json, sys
c = json.load(open(sys.argv[1]))
mn, mx, nproc, backend, endpoint, rdzv_id, restarts = sys.argv[2:]
r = c["rendezvous"]
got = (c["nnodes"]["min"], c["nnodes"]["max"], c["nproc_per_node"], r["backend"], r["endpoint"],
       r["run_id"], c["max_restarts"], c["entrypoint"][0])
want = (int(mn), int(mx), int(nproc), backend, endpoint, rdzv_id, int(restarts), "train_mlp")
print("resolved:", got)
if got != want:
    print("FAIL: expected", want)
    sys.exit(1)
EOF
    echo "examples/k8s/pytorchjob.yaml: PET_* from its elasticPolicy resolve to what it asks for"
    ;;

  docs)
    for f in "$SRC"/examples/k8s/*.yaml; do
      name=examples/k8s/$(basename "$f")
      doc_block "$SRC/docs/containers.md" "$name" yaml >"$TMP/doc-block"
      [[ -s $TMP/doc-block ]] || fail "docs/containers.md shows no block for $name"
      diff -u "$f" "$TMP/doc-block" >"$TMP/doc-diff" ||
        fail "docs/containers.md's $name differs from the file: $(cat "$TMP/doc-diff")"
    done
    ;;

  clean)
    for image in "$IMAGE" "$DEMO"; do
      if podman image exists "$image"; then podman rmi "$image" >/dev/null; fi
    done
    ;;

  *) fail "unknown case $CASE" ;;
esac
echo "PASS: container.$CASE"
