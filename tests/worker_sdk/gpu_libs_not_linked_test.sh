#!/usr/bin/env bash
# libtrun_worker does not link NCCL or the CUDA runtime: no DT_NEEDED on libnccl or libcudart, so
# it loads on a machine without them (a CPU-only host, a Debian package or image). The NCCL
# backend loads them with dlopen on first use (worker_sdk/src/nccl/gpu_libs.h), searching
# libtrun_worker's RUNPATH after LD_LIBRARY_PATH: with the backend built, that RUNPATH must name
# the directories where CMake found them, so that the library finds them on the build machine.
# Usage: gpu_libs_not_linked_test.sh <path of libtrun_worker.so> [<libnccl path> <libcudart path>]
# (the two paths CMake found, when the NCCL backend is built).
set -euo pipefail
lib=$1
dynamic=$(readelf -d "$lib")
needed=$(sed -nE 's/.*\(NEEDED\).*\[(.*)\]$/\1/p' <<<"$dynamic")
echo "$lib needs: $(tr '\n' ' ' <<<"$needed")"
fail=0

# Every program needs libc: without it the list was not read at all.
if ! grep -qx 'libc.so.6' <<<"$needed"; then
  echo "FAIL: no libc.so.6 among the NEEDED entries: readelf's output was not understood"
  fail=1
fi
if gpu=$(grep -E '^lib(nccl|cudart)' <<<"$needed"); then
  echo "FAIL: libtrun_worker has DT_NEEDED on $(tr '\n' ' ' <<<"$gpu")(loaded with dlopen instead)"
  fail=1
fi

if [[ $# -ge 3 ]]; then
  runpath=$(sed -nE 's/.*\((RUNPATH|RPATH)\).*\[(.*)\]$/\2/p' <<<"$dynamic")
  echo "$lib RUNPATH: $runpath"
  for found in "$2" "$3"; do
    dir=$(dirname "$found")
    if ! tr ':' '\n' <<<"$runpath" | grep -qxF "$dir"; then
      echo "FAIL: the RUNPATH lacks $dir, where CMake found $(basename "$found")"
      fail=1
    fi
  done
fi

if [[ $fail == 0 ]]; then
  echo "PASS: libtrun_worker does not link NCCL or the CUDA runtime"
fi
exit $fail
