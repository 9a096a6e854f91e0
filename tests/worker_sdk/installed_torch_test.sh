#!/usr/bin/env bash
# Installs a trun build into a temporary prefix, builds tests/worker_sdk/torch_consumer (a program
# that links the installed libtrun_worker and libtorch) against it, and runs two ranks of it
# under the installed trun: one process holds both libraries, which must not bind to each
# other's symbols (libtorch carries its own Gloo).
# Usage: installed_torch_test.sh <trun build dir> <consumer source dir> <TRUN_HAVE_TORCH: 0 or 1>
set -euo pipefail
build=$1
consumer=$2
have_torch=$3
SKIP_TEST_NAME="worker_sdk.installed_sdk_with_libtorch (installed_torch_test.sh)"
# shellcheck source=tests/skip.sh
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
if [[ $have_torch != 1 ]]; then
  skip setup "libtorch not found when trun was configured (scripts/setup.sh installs libtorch-dev)"
fi

tmp=$(mktemp -d /tmp/trun-torch-consumer-XXXXXX)
trun_pid=
cleanup() {
  if [[ -n $trun_pid ]] && kill -0 "$trun_pid" 2>/dev/null; then
    kill -KILL "$trun_pid" 2>/dev/null || true
    wait "$trun_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log"
cmake -S "$consumer" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }

# The program resolves libtrun_worker from the prefix (its RPATH), nothing from the build tree.
ldd "$tmp/build/torch_consumer" >"$tmp/ldd.txt"
grep -q "libtrun_worker.so.* => $tmp/prefix/lib/" "$tmp/ldd.txt" ||
  { cat "$tmp/ldd.txt"; echo "FAIL: libtrun_worker does not come from the install prefix"; exit 1; }
grep -q 'libtorch_cpu.so' "$tmp/ldd.txt" ||
  { cat "$tmp/ldd.txt"; echo "FAIL: the program does not load libtorch"; exit 1; }

# Two ranks under the installed trun, in the background so the trap can end it by its pid.
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u LOCAL_RANK -u LOCAL_WORLD_SIZE \
  -u GROUP_RANK "$tmp/prefix/bin/trun" --standalone --nproc-per-node=2 \
  "$tmp/build/torch_consumer" >"$tmp/run.log" 2>&1 &
trun_pid=$!
deadline=$((SECONDS + 120))
while kill -0 "$trun_pid" 2>/dev/null && ((SECONDS < deadline)); do
  sleep 0.2
done
if kill -0 "$trun_pid" 2>/dev/null; then
  cat "$tmp/run.log"
  echo "FAIL: trun still running after 120 s"
  exit 1
fi
rc=0
wait "$trun_pid" || rc=$?
trun_pid=
cat "$tmp/run.log"
[[ $rc == 0 ]] || { echo "FAIL: trun exited with $rc"; exit 1; }
for r in 0 1; do
  grep -q "torch consumer rank $r/2 sum=3 expected=3 store_timeout_caught=1 torch " \
    "$tmp/run.log" || { echo "FAIL: rank $r: no correct allreduce, no StoreTimeoutError caught"; exit 1; }
done
echo "PASS: the installed libtrun_worker and libtorch work in one process"
