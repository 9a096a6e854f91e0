#!/usr/bin/env bash
# allreduce benchmark: libtrun_worker's CPU backend vs PyTorch 1.13 gloo (same machine, same
# run) vs single-thread memcpy, float32, 1..256 MiB, 2 and 4 ranks on one node.
# Usage: scripts/bench_allreduce.sh [build dir]    (env: SIZES_MIB=1,4,16,64,256 RANKS="2 4")
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
SIZES=${SIZES_MIB:-1,4,16,64,256}
RANKS=${RANKS:-2 4}
PY=/usr/bin/python3
TORCHRUN=/usr/bin/torchrun

if [[ ! -x "$BUILD/bench/allreduce_bench" ]]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
ninja -C "$BUILD" allreduce_bench >/dev/null

out=$(mktemp /tmp/trun-bench-allreduce-XXXXXX)
trap 'rm -f "$out"' EXIT

free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

for n in $RANKS; do
  echo "== trun, $n ranks" >&2
  "$BUILD/bench/allreduce_bench" --ranks "$n" --sizes-mib "$SIZES" | tee -a "$out" >&2
  echo "== PyTorch gloo, $n ranks" >&2
  if [[ -x $TORCHRUN ]] && $PY -c 'import torch' 2>/dev/null; then
    # torchrun 1.13 on Python 3.11 crashes with the default --redirects/--tee; 9:1 names a local
    # rank that does not exist and keeps the plain console (see docs/worker_sdk.md).
    OMP_NUM_THREADS=1 $PY $TORCHRUN --nnodes 1 --nproc_per_node "$n" --master_addr 127.0.0.1 \
      --master_port "$(free_port)" --monitor_interval 0.1 --redirects 9:1 --tee 9:1 \
      bench/allreduce_torch.py "$SIZES" 2>/dev/null | grep '^torch ' | tee -a "$out" >&2 || true
  else
    echo "(PyTorch not available: peer column empty)" >&2
  fi
done

$PY - "$out" <<'PYEOF'
import sys
rows, mem = {}, {}
nan = float("nan")
for line in open(sys.argv[1]):
    words = line.split()
    if not words:
        continue
    f = dict(kv.split("=", 1) for kv in words[1:] if "=" in kv)
    if words[0] == "memcpy":
        mem[int(f["size_mib"])] = (float(f["memcpy_gbps"]), float(f.get("cpu_memcpy_gbps", nan)))
    elif words[0] in ("trun", "torch"):
        rows.setdefault((int(f["ranks"]), int(f["size_mib"])), {})[words[0]] = (
            float(f["algbw_gbps"]), float(f["busbw_gbps"]), float(f.get("cpu_busbw_gbps", nan)))

def div(a, b):
    return a / b if b == b and b else nan

print()
print("GB/s; 'cpu' columns use CPU time instead of wall-clock time (what an idle machine with a core")
print("per rank would show; informative only, the RESULT lines use wall-clock time)")
print(f"{'ranks':>5} {'MiB':>5} | {'trun algbw':>10} {'busbw':>7} | {'gloo algbw':>10} {'busbw':>7} |"
      f" {'memcpy':>7} | {'vs gloo':>7} {'vs memcpy':>9} | {'cpu busbw':>9} {'cpu memcpy':>10} {'ratio':>6}")
for (n, mib), r in sorted(rows.items()):
    t = r.get("trun", (nan,) * 3)
    g = r.get("torch", (nan,) * 3)
    m = mem.get(mib, (nan, nan))
    print(f"{n:>5} {mib:>5} | {t[0]:>10.2f} {t[1]:>7.2f} | {g[0]:>10.2f} {g[1]:>7.2f} |"
          f" {m[0]:>7.2f} | {div(t[1], g[1]):>7.2f} {div(t[1], m[0]):>9.2f} |"
          f" {t[2]:>9.2f} {m[1]:>10.2f} {div(t[2], m[1]):>6.2f}")
print()
for (n, mib), r in sorted(rows.items()):
    if mib != 64 or "trun" not in r:
        continue
    busbw = r["trun"][1]
    peer = r.get("torch", (None, None))[1]
    print(f"RESULT name=allreduce_busbw_64MiB_{n}ranks_vs_torch_gloo value={busbw:.3f} unit=GB/s "
          f"peer={f'{peer:.3f}' if peer else 'none'} ratio={f'{busbw / peer:.2f}' if peer else 'none'}")
    if mib in mem:
        m = mem[mib][0]
        print(f"RESULT name=allreduce_busbw_64MiB_{n}ranks_vs_memcpy value={busbw:.3f} unit=GB/s "
              f"peer={m:.3f} ratio={busbw / m:.2f}")
PYEOF
