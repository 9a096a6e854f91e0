#!/usr/bin/env bash
# GPU check for libtrun_worker's NCCL backend: runs the NCCL tests (device buffers, every
# collective, world size 1 per GPU; 2 ranks when two GPUs are visible) and prints PASS/FAIL lines.
#
#   scripts/gpu-check.sh                 configure + build build-gpu here (CUDA + NCCL), then run
#   scripts/gpu-check.sh BUILD_DIR       use prebuilt binaries in BUILD_DIR (no build)
#   scripts/gpu-check.sh --bundle BUILD_DIR
#                                        (on the build machine) copy the shared libraries the
#                                        test binaries need into BUILD_DIR/gpu-libs, so that the
#                                        build dir can be carried to a GPU machine that has
#                                        CUDA 13 + NCCL in /usr/local/cuda (not bundled: too big)
# Exit status: 0 when every check passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ ${1:-} == --bundle ]]; then
  build=${2:?usage: gpu-check.sh --bundle BUILD_DIR}
  mkdir -p "$build/gpu-libs"
  for bin in "$build/tests/worker_sdk/worker_sdk_nccl_test" "$build/worker_sdk/libtrun_worker.so"; do
    ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
      case $(basename "$lib") in
        # glibc, the C++ runtime and CUDA/NCCL (hundreds of MiB) are expected on the GPU machine.
        libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux* | libcuda.so*) ;;
        libstdc++.so* | libgcc_s.so* | libnccl.so* | libcudart.so*) ;;
        libtrun_worker.so*) ;;
        *) cp -L "$lib" "$build/gpu-libs/" ;;
      esac
    done
  done
  echo "bundled $(ls "$build/gpu-libs" | wc -l) libraries into $build/gpu-libs"
  exit 0
fi

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
  if ! ninja -C "$build" worker_sdk_nccl_test; then echo "FAIL: build"; exit 1; fi
fi
test_bin="$build/tests/worker_sdk/worker_sdk_nccl_test"
[[ -x $test_bin ]] || { echo "FAIL: $test_bin not found"; exit 1; }

# Carried build dirs keep absolute RPATHs from the build machine: point the loader at them.
export LD_LIBRARY_PATH="$build/worker_sdk:$build/gpu-libs:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ldd "$test_bin" | grep -q "not found"; then
  ldd "$test_bin" | grep "not found"
  echo "FAIL: missing shared libraries (on the build machine run: scripts/gpu-check.sh --bundle $build)"
  exit 1
fi

echo "== devices"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "(no nvidia-smi)"; fi

status=0
gpu_ran=0
while IFS= read -r name; do
  [[ -z $name ]] && continue
  # Catch2 reads commas in a test spec as "or": escape them; -w NoTests fails on no match.
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
  echo "FAIL: no GPU test ran (no CUDA device visible to the process?)"
  status=1
fi
[[ $status -eq 0 ]] && echo "gpu-check: ALL PASS" || echo "gpu-check: FAILURES"
exit $status
