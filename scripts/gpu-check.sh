#!/usr/bin/env bash
# GPU check, one command: libtrun_worker's NCCL tests (device buffers, every collective, world
# size 1 per GPU; with two or more GPUs also ranks as threads, as processes, under trun and
# elastic: failures, timeouts, restarts, scale-down), the DDP reducer's CUDA tests (CUDA
# parameters, averaging on the device), and, where `python3` has PyTorch (2.x on GPU machines),
# the store's PyTorch-client compatibility scenario (PyTorch's own server as the oracle) and the
# DDP ToyModel script under trun. Prints PASS/FAIL/SKIP lines.
#
#   scripts/gpu-check.sh                 configure + build build-gpu here (CUDA + NCCL), then run
#   scripts/gpu-check.sh BUILD_DIR       use prebuilt binaries in BUILD_DIR (no build)
#   scripts/gpu-check.sh --simulate BUILD_DIR|OUT_DIR
#                                        a dry run of this script without a GPU: the GPU simulator
#                                        (tests/simgpu, four devices) stands in for CUDA and NCCL;
#                                        ctest runs it (gpu_check.simulated) so that the one command
#                                        a GPU machine gets keeps working
#   scripts/gpu-check.sh --bundle BUILD_DIR [OUT_DIR]
#                                        (on the build machine) copy what the checks run, with
#                                        debug info stripped, and the shared libraries they need
#                                        (not libnccl: 218 MB) into OUT_DIR (default .gpu, git-
#                                        ignored, about 7 MB): carry OUT_DIR to the GPU machine
#                                        and run `scripts/gpu-check.sh OUT_DIR` there. A build dir
#                                        itself is far too big to carry (~570 MB with debug info).
# GPU_CHECK_EXCLUDE=REGEX leaves out the test cases whose names match (each listed as EXCLUDED);
# gpu_check.simulated uses it for the cases that only wait for timeouts.
# Exit status: 0 when every check passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# The files a check run needs, relative to a build dir (and to a bundle, which keeps the layout).
check_bins=(tests/worker_sdk/worker_sdk_nccl_test tests/worker_sdk/worker_sdk_ddp_cuda_test
  tests/worker_sdk/pg_worker launcher/trun)
trun_lib=worker_sdk/libtrun_worker.so.0  # the SONAME the binaries ask for
# libtrun_worker loads NCCL and the CUDA runtime when first used (dlopen); the NCCL test binary
# links both, so its ldd says which ones this machine would give the checks.
nccl_probe=tests/worker_sdk/worker_sdk_nccl_test
bench_bin=bench/allreduce_bench           # bundled when built: the CPU allreduce on many cores

if [[ ${1:-} == --bundle ]]; then
  build=${2:?usage: gpu-check.sh --bundle BUILD_DIR [OUT_DIR]}
  out=${3:-.gpu}
  for f in "${check_bins[@]}" "$trun_lib"; do
    [[ -e $build/$f ]] || { echo "gpu-check --bundle: $build/$f not built (ninja -C $build)" >&2; exit 1; }
  done
  rm -rf "$out"
  mkdir -p "$out/gpu-libs"
  extra=()
  [[ -x $build/$bench_bin ]] && extra+=("$bench_bin")
  for f in "${check_bins[@]}" "$trun_lib" "${extra[@]}"; do
    mkdir -p "$out/$(dirname "$f")"
    # Debug info off (a stack trace still names functions); copies, not links.
    strip --strip-debug -o "$out/$f" "$(readlink -f "$build/$f")"
    ldd "$build/$f" | awk '/=> \// {print $3}' | while read -r lib; do
      case $(basename "$lib") in
        # glibc, the C++ runtime and the CUDA driver are expected on the GPU machine; the CUDA 13
        # runtime (0.7 MB) is carried.
        libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux* | libcuda.so*) ;;
        # libnccl (218 MB) is not carried: the GPU machine's PyTorch ships one (see below).
        libstdc++.so* | libgcc_s.so* | libnccl.so*) ;;
        libtrun_worker.so*) ;;
        *) cp -L "$lib" "$out/gpu-libs/" ;;
      esac
    done
  done
  # The GPU simulator too (1 MiB), so that `gpu-check.sh --simulate OUT_DIR` tries the bundle here.
  if [[ -e $build/tests/simgpu/lib/libnccl.so.2 ]]; then
    mkdir -p "$out/tests/simgpu/lib"
    for lib in libcudart.so.13 libnccl.so.2; do
      strip --strip-debug -o "$out/tests/simgpu/lib/$lib" "$build/tests/simgpu/lib/$lib"
    done
  fi
  kib=$(du -sk "$out" | cut -f1)
  echo "bundled $(find "$out" -type f | wc -l) files, $((kib / 1024)) MiB, into $out"
  if ((kib > 60 * 1024)); then
    echo "gpu-check --bundle: $out is over 60 MiB; the device tool carries at most 64 MiB" >&2
    exit 1
  fi
  exit 0
fi

simulate=0
if [[ ${1:-} == --simulate ]]; then
  simulate=1
  build=${2:?usage: gpu-check.sh --simulate BUILD_DIR}
fi
build=${build:-${1:-}}
if [[ -z $build ]]; then
  build="build-gpu"
  echo "== building $build (CUDA + NCCL)"
  if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRUN_BUILD_BENCH=OFF \
    >"$build.configure.log" 2>&1; then
    cat "$build.configure.log"
    echo "FAIL: configure"
    exit 1
  fi
  grep -q "NCCL backend ON" "$build.configure.log" || { echo "FAIL: NCCL backend not configured"; exit 1; }
  if ! ninja -C "$build" worker_sdk_nccl_test worker_sdk_ddp_cuda_test pg_worker trun; then
    echo "FAIL: build"
    exit 1
  fi
fi
[[ -d $build ]] || { echo "FAIL: $build is not a directory"; exit 1; }
build=$(cd "$build" && pwd)
# Carried build dirs keep absolute RPATHs from the build machine: point the loader at them.
export LD_LIBRARY_PATH="$build/worker_sdk:$build/gpu-libs:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ((simulate)); then
  sim_dir=$build/tests/simgpu/lib
  [[ -e $sim_dir/libnccl.so.2 && -e $sim_dir/libcudart.so.13 ]] ||
    { echo "FAIL: no GPU simulator in $sim_dir (ninja -C $build trun_simgpu_nccl)"; exit 1; }
  export LD_LIBRARY_PATH="$sim_dir:$LD_LIBRARY_PATH" TRUN_SIMGPU_DEVICES=4 TRUN_SIMGPU_EXPECTED=1
  echo "== SIMULATED: CUDA and NCCL are tests/simgpu's stand-ins; nothing here runs on a GPU"
fi
# No libnccl.so.2 here? Use the one PyTorch's pip packages ship (nvidia-nccl-*): same ABI.
# (nvidia-nccl-cu12 keeps it in nvidia/nccl/lib; later layouts may move it: search the package.)
if ldd "$build/$nccl_probe" 2>/dev/null | grep -q "libnccl.so.2 => not found"; then
  nccl_dir=$(${PYTHON_EXEC:-python3} - 2>/dev/null <<'PYEOF'
import glob, os
import nvidia
for root in nvidia.__path__:
    hits = sorted(glob.glob(os.path.join(root, "**", "libnccl.so.2"), recursive=True))
    if hits:
        print(os.path.dirname(hits[0]))
        break
PYEOF
  )
  if [[ -n $nccl_dir && -e $nccl_dir/libnccl.so.2 ]]; then
    echo "using NCCL from PyTorch's environment: $nccl_dir"
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_dir"
  else
    echo "no libnccl.so.2 here or in python3's nvidia packages: the NCCL checks will fail"
  fi
fi

# One run is all a borrowed GPU machine may get: say which libraries were picked, and let NCCL
# explain its own failures.
echo "== libraries"
ldd "$build/$nccl_probe" 2>&1 | grep -E "libnccl|libcudart|libgloo|not found" | sed 's/^[[:space:]]*/  /'
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

echo "== devices"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L
  nvidia-smi --query-gpu=driver_version --format=csv,noheader | sed 's/^/driver /'
else
  echo "(no nvidia-smi)"
fi

status=0
gpu_ran=0

# Runs every Catch2 test case of one binary on its own, with a PASS/FAIL/SKIP line each.
run_catch_binary() {
  local test_bin=$1
  if [[ ! -x $test_bin ]]; then
    echo "FAIL: $test_bin not found"
    status=1
    return
  fi
  if ldd "$test_bin" | grep -q "not found"; then
    ldd "$test_bin" | grep "not found"
    echo "FAIL: missing shared libraries (carry a bundle: on the build machine run scripts/gpu-check.sh --bundle BUILD_DIR)"
    status=1
    return
  fi
  local name out rc note
  while IFS= read -r name; do
    [[ -z $name ]] && continue
    if [[ -n ${GPU_CHECK_EXCLUDE:-} ]] && grep -qE -- "$GPU_CHECK_EXCLUDE" <<<"$name"; then
      echo "EXCLUDED: $name (GPU_CHECK_EXCLUDE)"
      continue
    fi
    # Catch2 reads commas in a test spec as "or": escape them; -w NoTests fails on no match.
    # The compact reporter keeps each message on one line (the console one wraps them).
    out=$(timeout 300 "$test_bin" -r compact -w NoTests "${name//,/\\,}" 2>&1)
    rc=$?
    if [[ $rc -ne 0 ]]; then
      echo "FAIL: $name (exit $rc)"
      echo "$out" | tail -30 | sed 's/^/    /'
      status=1
    elif grep -q "skipped:" <<<"$out"; then
      echo "SKIP: $name ($(grep -o "skipped:[^']*" <<<"$out" | head -1))"
    else
      # A case's WARN (the NCCL version in use, say) goes on its PASS line.
      note=$(grep -o "warning: '[^']*'" <<<"$out" | head -1 | sed "s/^warning: '//; s/'\$//")
      echo "PASS: $name${note:+ ($note)}"
      [[ $name == GPU:* ]] && gpu_ran=1
    fi
  done < <("$test_bin" --list-test-names-only 2>/dev/null)
}

echo "== NCCL collectives"
run_catch_binary "$build/tests/worker_sdk/worker_sdk_nccl_test"
echo "== DDP on CUDA"
run_catch_binary "$build/tests/worker_sdk/worker_sdk_ddp_cuda_test"

echo "== PyTorch clients"
py=${PYTHON_EXEC:-python3}
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "SKIP: PyTorch checks ($py has no torch)"
else
  echo "torch $("$py" -c 'import torch; print(torch.__version__, torch.cuda.is_available())')"
  tmp=$(mktemp -d)
  ops=tests/store/compat/torch_store_ops.py
  # The store scenario against PyTorch's own server (the oracle) and against `trun store`.
  coproc ORACLE { "$py" "$ops" serve; }
  read -r _ oracle_port <&"${ORACLE[0]}"
  "$build/launcher/trun" store --host 127.0.0.1 --port 0 >"$tmp/trun_store.out" 2>"$tmp/trun_store.err" &
  trun_store_pid=$!
  for _ in $(seq 50); do grep -q listening "$tmp/trun_store.out" && break; sleep 0.1; done
  trun_port=$(grep -o '[0-9]*$' "$tmp/trun_store.out")
  # Side by side: most of a run is waiting for timeouts.
  timeout 120 "$py" "$ops" client 127.0.0.1 "$oracle_port" >"$tmp/oracle.txt" 2>&1 &
  oracle_client_pid=$!
  timeout 120 "$py" "$ops" client 127.0.0.1 "$trun_port" >"$tmp/trun.txt" 2>&1
  wait "$oracle_client_pid"
  kill "$trun_store_pid" "$ORACLE_PID" 2>/dev/null
  wait "$trun_store_pid" "$ORACLE_PID" 2>/dev/null
  if grep -q '^END' "$tmp/oracle.txt" && diff "$tmp/oracle.txt" "$tmp/trun.txt" >"$tmp/diff.txt"; then
    echo "PASS: PyTorch $("$py" -c 'import torch; print(torch.__version__)') TCPStore clients get PyTorch's own results from trun's store ($(grep -c . "$tmp/oracle.txt") steps)"
  else
    echo "FAIL: PyTorch TCPStore scenario differs between PyTorch's server and trun's"
    head -40 "$tmp/diff.txt" | sed 's/^/    /'
    status=1
  fi
  # The DDP ToyModel under trun (gloo on CPU, as in the CPU tests; the NCCL path is covered above).
  if PYTHON_EXEC="$py" timeout 300 "$build/launcher/trun" --standalone --nproc-per-node=2 \
    tests/launcher/py/ddp_toy.py "$tmp" >"$tmp/ddp.log" 2>&1 && ls "$tmp"/result_*.json >/dev/null 2>&1; then
    echo "PASS: PyTorch DDP ToyModel under trun --standalone --nproc-per-node=2"
  else
    echo "FAIL: PyTorch DDP ToyModel under trun"
    tail -30 "$tmp/ddp.log" | sed 's/^/    /'
    status=1
  fi
  if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    ngpu=$("$py" -c 'import torch; print(min(torch.cuda.device_count(), 2))')
    rm -f "$tmp"/result_*.json
    if DDP_TOY_BACKEND=nccl PYTHON_EXEC="$py" timeout 300 "$build/launcher/trun" --standalone \
      --nproc-per-node="$ngpu" tests/launcher/py/ddp_toy.py "$tmp" >"$tmp/ddp_nccl.log" 2>&1 &&
      ls "$tmp"/result_*.json >/dev/null 2>&1; then
      echo "PASS: PyTorch DDP ToyModel with NCCL on $ngpu GPU(s) under trun --standalone"
    else
      echo "FAIL: PyTorch DDP ToyModel with NCCL under trun"
      tail -30 "$tmp/ddp_nccl.log" | sed 's/^/    /'
      status=1
    fi
  fi
  rm -rf "$tmp"
fi

# Informational, not part of the verdict: the CPU allreduce benchmark with a core per rank (this
# build machine has 2 cores), against the local PyTorch's gloo, 64 MiB, 3 trials.
if ((!simulate)) && [[ -x $build/$bench_bin ]] &&
  "$py" -c 'import torch.distributed.run' 2>/dev/null; then
  echo "== CPU allreduce benchmark, $(nproc) cores (informational)"
  TORCH_PY=$(command -v "$py") SIZES_MIB=64 TRIALS=3 RANKS="2 4 8" timeout 300 \
    bash scripts/bench_allreduce.sh "$build" 2>/dev/null | grep -E '^ *[0-9]|^RESULT|trial' ||
    echo "(allreduce benchmark failed or timed out)"
fi

if [[ $gpu_ran -eq 0 ]]; then
  echo "FAIL: no GPU test ran (no CUDA device visible to the process?)"
  status=1
fi
verdict="ALL PASS"
[[ $status -eq 0 ]] || verdict=FAILURES
((simulate)) && verdict="$verdict (simulated: no GPU was used)"
echo "gpu-check: $verdict"
exit $status
