#!/usr/bin/env bash
# gpu_check.simulated: the GPU machine's procedure end to end, on the GPU simulator. Packs a
# bundle from BUILD_DIR into a temporary directory (scripts/gpu-check.sh --bundle, as for the
# device tool) and runs `scripts/gpu-check.sh --simulate` on the bundle, which finds its binaries
# by its own layout as it would there. The bundle is removed afterwards.
set -euo pipefail
build=${1:?usage: gpu_check_test.sh BUILD_DIR}
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mktemp -d /tmp/trun-gpu-check-XXXXXX)
trap 'rm -rf "$out"' EXIT
bash "$repo/scripts/gpu-check.sh" --bundle "$build" "$out/bundle"
# The cases that wait for a timeout (about 30 of the 40 s the two binaries take) are left out:
# they ran on the simulator already, as simgpu.* in the ASan+UBSan step; what this test adds is the
# bundle and the procedure, which every other case exercises.
GPU_CHECK_EXCLUDE='times? out|timeout|SIGKILLed mid-stream|agents SIGKILLed' \
  bash "$repo/scripts/gpu-check.sh" --simulate "$out/bundle"
