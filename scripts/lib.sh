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

# torch_peer OUT RANKS SCRIPT ARGS...: PyTorch 1.13's torchrun runs SCRIPT ARGS on RANKS local
# ranks; its '^torch ' lines are appended to OUT (and shown on stderr). Returns 1 when it failed
# or printed none, with its last stderr line in $torch_peer_error. torchrun 1.13 on Python 3.11
# crashes with the default --redirects/--tee; 9:1 names a local rank that does not exist and
# keeps the plain console.
torch_peer() {
  local out=$1 ranks=$2 err rc=0
  shift 2
  err=$(mktemp /tmp/trun-bench-torch.XXXXXX)
  OMP_NUM_THREADS=1 "$TORCH_PY" "$TORCHRUN" --nnodes 1 --nproc_per_node "$ranks" \
    --master_addr 127.0.0.1 --master_port "$(free_port)" --monitor_interval 0.1 \
    --redirects 9:1 --tee 9:1 "$@" 2>"$err" | grep '^torch ' | tee -a "$out" >&2 || rc=1
  torch_peer_error=$(tail -1 "$err")
  rm -f "$err"
  return "$rc"
}
