# shellcheck shell=bash
# Shared by scripts/bench_*.sh: `source scripts/lib.sh` after `cd` to the repository root.
#
#   bench_build DIR TARGET...  configures DIR (Ninja, RelWithDebInfo) when it has no build.ninja
#                              yet, then builds TARGET... (output only on failure)
#   free_port                  prints a loopback TCP port that was free a moment ago
#   TORCH_PY                   the Python that has PyTorch 1.13 (/usr/bin/python3, not the one on
#                              PATH); TORCHRUN likewise. Both can be set from outside (a GPU
#                              machine's PyTorch lives elsewhere).

export TORCH_PY=${TORCH_PY:-/usr/bin/python3}
export TORCHRUN=${TORCHRUN:-/usr/bin/torchrun}

bench_build() {
  local dir=$1 log
  shift
  if [[ ! -f "$dir/build.ninja" ]]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null ||
      { echo "bench_build: configuring $dir failed" >&2; return 1; }
  fi
  log=$(cmake --build "$dir" --target "$@" 2>&1) ||
    { echo "$log" | tail -n 40 >&2; echo "bench_build: building $* in $dir failed" >&2; return 1; }
}

free_port() {
  "$TORCH_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
