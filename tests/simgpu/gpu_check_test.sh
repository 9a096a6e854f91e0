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
bash "$repo/scripts/gpu-check.sh" --simulate "$out/bundle"
