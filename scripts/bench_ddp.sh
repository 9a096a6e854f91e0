#!/usr/bin/env bash
# DDP benchmark: step time of a ~10M-parameter MLP (examples/train_mlp's model) on 2 ranks with
# libtrun_worker's DDP at bucket caps 1, 5, 25, 100 MB, vs the same step without communication;
# the peer is PyTorch 1.13 DDP (gloo) on the same layer sizes under torchrun, in the same run.
# Also DDP with the fp16 compression hook (trun's fp16_compress_hook() vs PyTorch's
# default_hooks.fp16_compress_hook) at the FP16_CAPS bucket caps.
# Usage: scripts/bench_ddp.sh [build dir]
#   (env: SIZES=1024,2560,2048,1024 BATCH=8 STEPS=12 CAPS=1,5,25,100 FP16_CAPS=25 RANKS=2)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD=${1:-build}
SIZES=${SIZES:-1024,2560,2048,1024}
BATCH=${BATCH:-8}
STEPS=${STEPS:-12}
CAPS=${CAPS:-1,5,25,100}
FP16_CAPS=${FP16_CAPS-25}
RANKS=${RANKS:-2}
PY=$TORCH_PY

bench_build "$BUILD" ddp_bench

out=$(mktemp /tmp/trun-bench-ddp-XXXXXX)
trap 'rm -f "$out"' EXIT

echo "== trun DDP, $RANKS ranks, layers $SIZES, batch $BATCH per rank" >&2
"$BUILD/bench/ddp_bench" --ranks "$RANKS" --sizes "$SIZES" --batch "$BATCH" --steps "$STEPS" \
  --caps "$CAPS" --fp16-caps "$FP16_CAPS" | tee -a "$out" >&2
echo "== PyTorch 1.13 DDP (gloo), $RANKS ranks" >&2
peer_note=""
if [[ -x $TORCHRUN ]] && $PY -c 'import torch' 2>/dev/null; then
  if ! torch_peer "$out" "$RANKS" bench/ddp_torch.py "$SIZES" "$BATCH" "$STEPS" "$CAPS" "$FP16_CAPS"; then
    peer_note="PyTorch run failed: $torch_peer_error"
  fi
else
  peer_note="PyTorch (/usr/bin/python3 + torch, /usr/bin/torchrun) not available"
fi

$PY - "$out" "$peer_note" <<'PYEOF'
import sys
rows = {"trun": {}, "torch": {}}
fp16 = {"trun": {}, "torch": {}}
for line in open(sys.argv[1]):
    who = line.split()[0]
    f = dict(kv.split("=", 1) for kv in line.split()[1:])
    if f["mode"] == "ddp_fp16":
        fp16[who][float(f["cap_mb"])] = f
        continue
    key = "local" if f["mode"] == "local" else float(f["cap_mb"])
    rows[who][key] = f
note = sys.argv[2]
t, p = rows["trun"], rows["torch"]
params = t["local"]["params"]
print()
print(f"DDP step time, {t['local']['ranks']} ranks, {int(params) / 1e6:.1f}M parameters (ms; "
      "overhead = DDP step / local step)")
print(f"{'cap MB':>7} | {'trun step':>9} {'overhead':>8} {'added':>7} | {'torch step':>10} "
      f"{'overhead':>8} {'added':>7}")
def fmt(x, spec):
    return format(x, spec) if x is not None else format("-", spec.rstrip("f").split(".")[0])
tl = float(t["local"]["step_ms"])
pl = float(p["local"]["step_ms"]) if "local" in p else None
print(f"{'local':>7} | {tl:>9.1f} {'':>8} {'':>7} | {fmt(pl, '>10.1f')} {'':>8} {'':>7}")
for cap in sorted(k for k in t if k != "local"):
    ts = float(t[cap]["step_ms"])
    ps = float(p[cap]["step_ms"]) if cap in p else None
    print(f"{cap:>7g} | {ts:>9.1f} {ts / tl:>8.2f} {ts - tl:>7.1f} | {fmt(ps, '>10.1f')} "
          f"{fmt(ps / pl if ps else None, '>8.2f')} {fmt(ps - pl if ps else None, '>7.1f')}")
if note:
    print(f"peer: none ({note})")
print("Note: an overhead ratio depends on how fast the local step is (trun's MLP is plain C++")
print("loops, PyTorch's uses its own kernels); 'added' (DDP step - local step, ms) compares the")
print("cost of communication itself. Both run one thread per rank on the same cores.")
if fp16["trun"]:
    print()
    print("fp16 compression hook (gradients sent as float16), ms per step")
    print(f"{'cap MB':>7} | {'trun none':>9} {'trun fp16':>9} {'fp16/none':>9} | "
          f"{'torch none':>10} {'torch fp16':>10} {'fp16/none':>9}")
    for cap in sorted(fp16["trun"]):
        tf = float(fp16["trun"][cap]["step_ms"])
        tn = float(t[cap]["step_ms"]) if cap in t else None
        pf = float(fp16["torch"][cap]["step_ms"]) if cap in fp16["torch"] else None
        pn = float(p[cap]["step_ms"]) if cap in p else None
        print(f"{cap:>7g} | {fmt(tn, '>9.1f')} {tf:>9.1f} {fmt(tf / tn if tn else None, '>9.2f')} | "
              f"{fmt(pn, '>10.1f')} {fmt(pf, '>10.1f')} {fmt(pf / pn if pf and pn else None, '>9.2f')}")
print()
for cap in sorted(k for k in t if k != "local"):
    ts = float(t[cap]["step_ms"])
    ov = ts / tl
    if cap in p and pl:
        pov = float(p[cap]["step_ms"]) / pl
        print(f"RESULT name=ddp_overhead_cap{cap:g}MB value={ov:.3f} unit=x peer={pov:.3f} "
              f"ratio={pov / ov:.2f}")
    else:
        print(f"RESULT name=ddp_overhead_cap{cap:g}MB value={ov:.3f} unit=x peer=none ratio=none")
for cap in sorted(k for k in t if k != "local"):
    added = float(t[cap]["step_ms"]) - tl
    if cap in p and pl:
        padded = float(p[cap]["step_ms"]) - pl
        ratio = f"{padded / added:.2f}" if added > 0 else "none"
        print(f"RESULT name=ddp_added_ms_cap{cap:g}MB value={added:.1f} unit=ms "
              f"peer={padded:.1f} ratio={ratio}")
for cap in sorted(fp16["trun"]):
    tf = float(fp16["trun"][cap]["step_ms"])
    pf = float(fp16["torch"][cap]["step_ms"]) if cap in fp16["torch"] else None
    peer = f"peer={pf:.2f} ratio={pf / tf:.2f}" if pf else "peer=none ratio=none"
    print(f"RESULT name=ddp_fp16_hook_step_ms_cap{cap:g}MB value={tf:.2f} unit=ms {peer}")
    if cap in t:
        tn = float(t[cap]["step_ms"])
        pn = float(p[cap]["step_ms"]) if cap in p else None
        ppeer = (f"peer={pf / pn:.3f} ratio={(pf / pn) / (tf / tn):.2f}" if pf and pn
                 else "peer=none ratio=none")
        print(f"RESULT name=ddp_fp16_vs_none_cap{cap:g}MB value={tf / tn:.3f} unit=x {ppeer}")
PYEOF
