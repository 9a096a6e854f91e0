#!/usr/bin/env bash
# allreduce benchmark: libtrun_worker's CPU backend vs PyTorch 1.13 gloo (same machine, same
# run) vs single-thread memcpy, float32, 1..256 MiB, 2 and 4 ranks on one node.
# Usage: scripts/bench_allreduce.sh [build dir]
#   env: SIZES_MIB=1,4,16,64,256  RANKS="2 4"  TRIALS=5 (runs of the 64 MiB headline size)
#        P2P_MIB=64 (all_to_all and send/recv size, every trial; 0: skip them)
#        TORCH_PY=/usr/bin/python3 (the peer's Python: torchrun runs as its torch.distributed.run)
#
# Trial 1 is the whole sweep; trials 2..TRIALS repeat only 64 MiB, trun and gloo back to back.
# memcpy is timed inside each trun run, just before and after its allreduces (see
# bench/allreduce_bench.cpp).
# all_to_all and send/recv run twice in each trun run: with ordinary send buffers and with send
# buffers from ProcessGroup::shared_buffer (the *_shared rows and RESULT lines; gloo's peer
# figure is then its one run of the trial).
# A RESULT line reports the trial with the median ratio (its value, peer and ratio), so that
# one slow minute of this machine neither makes nor breaks the figure; every trial is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD=${1:-build}
SIZES=${SIZES_MIB:-1,4,16,64,256}
RANKS=${RANKS:-2 4}
TRIALS=${TRIALS:-5}
P2P_MIB=${P2P_MIB:-64}
[[ $P2P_MIB =~ ^[0-9]+$ ]] || { echo "P2P_MIB: expected a number, got '$P2P_MIB'" >&2; exit 2; }
HEADLINE_MIB=64
[[ $TRIALS =~ ^[1-9][0-9]?$ ]] || { echo "TRIALS: expected 1..99, got '$TRIALS'" >&2; exit 2; }

# A gpu-check bundle (scripts/gpu-check.sh --bundle) carries the binary but no build system.
if [[ -f "$BUILD/build.ninja" || ! -x "$BUILD/bench/allreduce_bench" ]]; then
  bench_build "$BUILD" allreduce_bench
fi

out=$(mktemp /tmp/trun-bench-allreduce-XXXXXX)
trap 'rm -f "$out"' EXIT

have_torch=0
if "$TORCH_PY" -c 'import torch.distributed.run' 2>/dev/null; then have_torch=1; fi

# run_trial TRIAL RANKS SIZES: one trun run and one gloo run, lines tagged with the trial.
run_trial() {
  local trial=$1 n=$2 sizes=$3
  echo "== trial $trial: trun, $n ranks, $sizes MiB" >&2
  "$BUILD/bench/allreduce_bench" --ranks "$n" --sizes-mib "$sizes" --p2p-mib "$P2P_MIB" | sed "s/^/trial=$trial /" |
    tee -a "$out" >&2
  echo "== trial $trial: PyTorch gloo, $n ranks, $sizes MiB" >&2
  if ((have_torch)); then
    # torchrun 1.13 on Python 3.11 crashes with the default --redirects/--tee; 9:1 names a local
    # rank that does not exist and keeps the plain console (see docs/worker_sdk.md).
    OMP_NUM_THREADS=1 "$TORCH_PY" -m torch.distributed.run --nnodes 1 --nproc_per_node "$n" \
      --master_addr 127.0.0.1 --master_port "$(free_port)" --monitor_interval 0.1 \
      --redirects 9:1 --tee 9:1 bench/allreduce_torch.py "$sizes" "$P2P_MIB" 2>/dev/null |
      grep '^torch' | sed "s/^/trial=$trial /" | tee -a "$out" >&2 || true
  else
    echo "(PyTorch not available: peer column empty)" >&2
  fi
}

for n in $RANKS; do run_trial 1 "$n" "$SIZES"; done
if [[ ",$SIZES," == *",$HEADLINE_MIB,"* ]]; then
  for ((t = 2; t <= TRIALS; ++t)); do
    for n in $RANKS; do run_trial "$t" "$n" "$HEADLINE_MIB"; done
  done
fi

"$TORCH_PY" - "$out" "$HEADLINE_MIB" <<'PYEOF'
import sys
nan = float("nan")
headline = int(sys.argv[2])
XCORE_APART_NS = 250  # see allreduce_bench.cpp: about 120 ns close, about 500 ns apart
runs = {}  # (trial, ranks, MiB) -> {"trun": {...}, "torch": {...}}
p2p = {}  # (op, ranks, MiB) -> [(trial, trun algbw, torch algbw or nan)]
p2p_lines = {}  # (op, trial, ranks, MiB) -> {"trun": algbw, "torch": algbw}
for line in open(sys.argv[1]):
    words = line.split()
    if len(words) >= 2 and "_" in words[1] and words[1].split("_", 1)[0] in ("trun", "torch"):
        who, op = words[1].split("_", 1)
        f = dict(kv.split("=", 1) for kv in words if "=" in kv)
        # X_shared: trun with its send buffers in shared memory (ProcessGroup::shared_buffer);
        # its peer is gloo's X of the same trial (PyTorch 1.13 has no such buffers).
        for o in (op, op + "_shared") if who == "torch" else (op,):
            key = (o, int(f["trial"]), int(f["ranks"]), int(f["size_mib"]))
            p2p_lines.setdefault(key, {})[who] = float(f["algbw_gbps"])
        continue
    if len(words) < 2 or words[1] not in ("trun", "torch"):
        continue
    f = dict(kv.split("=", 1) for kv in words if "=" in kv)
    key = (int(f["trial"]), int(f["ranks"]), int(f["size_mib"]))
    runs.setdefault(key, {})[words[1]] = {k: float(v) for k, v in f.items()
                                          if k.endswith("_gbps") or k.endswith("_ns")}

def get(r, who, field):
    return r.get(who, {}).get(field, nan)

def div(a, b):
    return a / b if b == b and b else nan

print()
print("GB/s; memcpy is timed by rank 0 just before and after the allreduces of its run. 'cpu' columns")
print("use CPU time instead of wall-clock time (what an idle machine with a core per rank would show;")
print("informative only, the RESULT lines use wall-clock time). 'xcore ns': the round trip of a cache")
print("line between the first two CPUs, timed next to memcpy (a VM whose vCPUs the host placed on")
print(f"different core complexes shows about 500 ns instead of about 120; over {XCORE_APART_NS} counts as apart)")
print(f"{'trial':>5} {'ranks':>5} {'MiB':>5} | {'trun algbw':>10} {'busbw':>7} | "
      f"{'gloo algbw':>10} {'busbw':>7} | {'memcpy':>7} | {'vs gloo':>7} {'vs memcpy':>9} | "
      f"{'cpu busbw':>9} {'cpu memcpy':>10} {'ratio':>6} | {'xcore ns':>8}")
for (trial, n, mib), r in sorted(runs.items(), key=lambda kv: (kv[0][0] > 1, kv[0])):
    tb, gb, mem = get(r, "trun", "busbw_gbps"), get(r, "torch", "busbw_gbps"), \
        get(r, "trun", "memcpy_gbps")
    cb, cm = get(r, "trun", "cpu_busbw_gbps"), get(r, "trun", "cpu_memcpy_gbps")
    print(f"{trial:>5} {n:>5} {mib:>5} | {get(r, 'trun', 'algbw_gbps'):>10.2f} {tb:>7.2f} | "
          f"{get(r, 'torch', 'algbw_gbps'):>10.2f} {gb:>7.2f} | {mem:>7.2f} | "
          f"{div(tb, gb):>7.2f} {div(tb, mem):>9.2f} | {cb:>9.2f} {cm:>10.2f} {div(cb, cm):>6.2f} | "
          f"{get(r, 'trun', 'xcore_ns'):>8.0f}")

def median_trial(pairs):
    """pairs: [(value, peer)] with a usable ratio; the pair whose ratio is the median (lower
    median for an even count)."""
    pairs = sorted(pairs, key=lambda p: p[0] / p[1])
    return pairs[(len(pairs) - 1) // 2]

print()
results = []  # the RESULT lines come last, after every summary line
for n in sorted({k[1] for k in runs}):
    trials = [r for (t, rn, mib), r in sorted(runs.items()) if rn == n and mib == headline
              and "trun" in r]
    if not trials:
        continue
    name = f"allreduce_busbw_{headline}MiB_{n}ranks"
    gloo = [(get(r, "trun", "busbw_gbps"), get(r, "torch", "busbw_gbps")) for r in trials
            if get(r, "torch", "busbw_gbps") > 0]
    mem = [(get(r, "trun", "busbw_gbps"), get(r, "trun", "memcpy_gbps")) for r in trials
           if get(r, "trun", "memcpy_gbps") > 0]
    print(f"{n} ranks, {headline} MiB, {len(trials)} trial(s): "
          f"vs gloo {sorted(round(v / p, 2) for v, p in gloo)}, "
          f"vs memcpy {sorted(round(v / p, 2) for v, p in mem)}")
    apart = [r for r in trials if get(r, "trun", "xcore_ns") > XCORE_APART_NS]
    if apart:
        together = [r for r in trials if r not in apart]
        ratios = lambda rs: sorted(round(div(get(r, "trun", "busbw_gbps"),
                                             get(r, "trun", "memcpy_gbps")), 2) for r in rs)
        print(f"  vs memcpy with the first two CPUs close: {ratios(together)}; "
              f"apart: {ratios(apart)} (informative; the RESULT lines use every trial)")
    if gloo:
        v, p = median_trial(gloo)
        results.append(f"RESULT name={name}_vs_torch_gloo value={v:.3f} unit=GB/s "
                       f"peer={p:.3f} ratio={v / p:.2f}")
    else:
        v = sorted(get(r, "trun", "busbw_gbps") for r in trials)[(len(trials) - 1) // 2]
        results.append(f"RESULT name={name}_vs_torch_gloo value={v:.3f} unit=GB/s peer=none "
                       f"ratio=none")
    if mem:
        v, p = median_trial(mem)
        results.append(f"RESULT name={name}_vs_memcpy value={v:.3f} unit=GB/s peer={p:.3f} "
                       f"ratio={v / p:.2f}")
if p2p_lines:
    print()
    print("all_to_all / send-recv, GB/s per rank (algbw):")
    print("(_shared: trun's send buffers from ProcessGroup::shared_buffer, one copy per byte;")
    print(" gloo's figure is its plain run of the same trial)")
    print(f"{'op':>17} {'trial':>5} {'ranks':>5} {'MiB':>5} | {'trun':>7} {'gloo':>7} {'ratio':>6}")
    for (op, trial, n, mib), r in sorted(p2p_lines.items()):
        t, g = r.get("trun", nan), r.get("torch", nan)
        print(f"{op:>17} {trial:>5} {n:>5} {mib:>5} | {t:>7.2f} {g:>7.2f} {div(t, g):>6.2f}")
    for op, n, mib in sorted({(k[0], k[2], k[3]) for k in p2p_lines}):
        trials = [r for k, r in p2p_lines.items() if (k[0], k[2], k[3]) == (op, n, mib)
                  and "trun" in r]
        name = f"{op}_algbw_{mib}MiB_{n}ranks_vs_torch_gloo"
        pairs = [(r["trun"], r["torch"]) for r in trials if r.get("torch", 0) > 0]
        if pairs:
            v, p = median_trial(pairs)
            results.append(f"RESULT name={name} value={v:.3f} unit=GB/s peer={p:.3f} "
                           f"ratio={v / p:.2f}")
        elif trials:
            v = sorted(r["trun"] for r in trials)[(len(trials) - 1) // 2]
            results.append(f"RESULT name={name} value={v:.3f} unit=GB/s peer=none ratio=none")
print("\n".join(results))
PYEOF
