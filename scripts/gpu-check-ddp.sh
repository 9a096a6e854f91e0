#!/usr/bin/env bash
# GPU check for the DDP reducer's CUDA path (CUDA parameters, NCCL group, averaging on the
# device): runs tests/worker_sdk_ddp/worker_sdk_ddp_cuda_test and prints PASS/FAIL/SKIP lines,
# like scripts/gpu-check.sh does for the NCCL collectives.
#
#   scripts/gpu-check-ddp.sh              configure + build build-gpu here (CUDA + NCCL), then run
#   scripts/gpu-check-ddp.sh BUILD_DIR    use prebuilt binaries in BUILD_DIR (no build); for a
#                                         carried build dir, bundle libraries first with
#                                         scripts/gpu-check.sh --bundle BUILD_DIR
# Exit status: 0 when every check passed and at least one GPU case ran, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

build=${1:-}
if [[ -z $build ]]; then
  build=build-gpu
  echo "== building $build (CUDA + NCCL)"
  if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRUN_BUILD_BENCH=OFF \
    >"$build.configure.log" 2>&1; then
    cat "$build.configure.log"
    echo "FAIL: configure"
    exit 1
  fi
  grep -q "NCCL backend ON" "$build.configure.log" || { echo "FAIL: NCCL backend not configured"; exit 1; }
  if ! ninja -C "$build" worker_sdk_ddp_cuda_test; then echo "FAIL: build"; exit 1; fi
fi
test_bin="$build/tests/worker_sdk_ddp/worker_sdk_ddp_cuda_test"
[[ -x $test_bin ]] || { echo "FAIL: $test_bin not found"; exit 1; }
export LD_LIBRARY_PATH="$build/worker_sdk:$build/gpu-libs:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ldd "$test_bin" | grep -q "not found"; then
  ldd "$test_bin" | grep "not found"
  echo "FAIL: missing shared libraries (on the build machine run: scripts/gpu-check.sh --bundle $build)"
  exit 1
fi

status=0
gpu_ran=0
while IFS= read -r name; do
  [[ -z $name ]] && continue
  out=$(timeout 300 "$test_bin" -w NoTests "${name//,/\\,}" 2>&1)
  rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "FAIL: $name (exit $rc)"
    echo "$out" | tail -30 | sed 's/^/    /'
    status=1
  elif grep -q "skipped:" <<<"$out"; then
    echo "SKIP: $name ($(grep -o 'skipped:.*' <<<"$out" | head -1))"
  else
    echo "PASS: $name"
    [[ $name == GPU:* ]] && gpu_ran=1
  fi
done < <("$test_bin" --list-test-names-only 2>/dev/null)

if [[ $gpu_ran -eq 0 ]]; then
  echo "FAIL: no GPU DDP test ran (no CUDA device visible to the process?)"
  status=1
fi
[[ $status -eq 0 ]] && echo "gpu-check-ddp: ALL PASS" || echo "gpu-check-ddp: FAILURES"
exit $status
