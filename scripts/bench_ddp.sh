#!/usr/bin/env bash
# DDP benchmark: step time of a ~10M-parameter MLP (examples/train_mlp's model) on 2 ranks with
# libtrun_worker's DDP at bucket caps 1, 5, 25, 100 MB, vs the same step without communication;
# the peer is PyTorch 1.13 DDP (gloo) on the same layer sizes under torchrun, in the same run.
# Also DDP with the fp16 compression hook (trun's fp16_compress_hook() vs PyTorch's
# default_hooks.fp16_compress_hook) at the FP16_CAPS bucket caps, and with trun's
# bf16_compress_hook() at the BF16_CAPS caps (no peer: PyTorch 1.13's gloo has no bfloat16 sum).
# Also the cost of hang detection's progress hooks (issue 36, docs/hangs.md): the same DDP step at
# cap 25 MB without and with a progress board (TRUN_PROGRESS_SHM, as trun gives its workers),
# PROGRESS_PAIRS runs of each, alternating, the fastest of each compared (these machines' step
# times jump between two levels ~30 % apart, which no median of a few runs hides), and the cost
# computed from its parts: the progress events per step that the board saw times the most
# expensive hook's cost per call (tests/hang/progress_hook_bench), over the step time. That one is
# the headline: the difference sits far below the A/B noise (0: skipped).
# Then, as a second part, the same hooks across 2 nodes on a rate-limited link
# (scripts/bench_ddp_net.sh: network namespaces, so root only; it says so and skips otherwise).
# Usage: scripts/bench_ddp.sh [build dir]
#   (env: SIZES=1024,2560,2048,1024 BATCH=8 STEPS=12 CAPS=1,5,25,100 FP16_CAPS=25 BF16_CAPS=25
#    RANKS=2 PROGRESS_PAIRS=5 DDP_NET=1 (0: skip the cross-node part), and bench_ddp_net.sh's)
# Quick form, the hooks only against no hook at cap 25 MB, without the PyTorch peer (NET_PEER=0:
# none in the cross-node part either; DDP_NET=0 leaves that part out):
#   CAPS=25 PROGRESS_PAIRS=0 TORCHRUN=/nonexistent NET_PEER=0 scripts/bench.sh ddp
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD=${1:-build}
SIZES=${SIZES:-1024,2560,2048,1024}
BATCH=${BATCH:-8}
STEPS=${STEPS:-12}
CAPS=${CAPS:-1,5,25,100}
FP16_CAPS=${FP16_CAPS-25}
BF16_CAPS=${BF16_CAPS-25}
RANKS=${RANKS:-2}
PROGRESS_PAIRS=${PROGRESS_PAIRS:-5}
PY=$TORCH_PY

bench_build "$BUILD" ddp_bench progress_board_hold progress_hook_bench

out=$(mktemp /tmp/trun-bench-ddp-XXXXXX)
hold_in=$out.hold-in
hold_out=$out.hold-out
trap 'rm -f "$out" "$hold_in" "$hold_out"' EXIT

echo "== trun DDP, $RANKS ranks, layers $SIZES, batch $BATCH per rank" >&2
"$BUILD/bench/ddp_bench" --ranks "$RANKS" --sizes "$SIZES" --batch "$BATCH" --steps "$STEPS" \
  --caps "$CAPS" --fp16-caps "$FP16_CAPS" --bf16-caps "$BF16_CAPS" | tee -a "$out" >&2
if ((PROGRESS_PAIRS > 0)); then
  echo "== trun DDP at cap 25 MB without and with a progress board, $PROGRESS_PAIRS runs each" >&2
  for ((i = 0; i < PROGRESS_PAIRS; ++i)); do
    "$BUILD/bench/ddp_bench" --ranks "$RANKS" --sizes "$SIZES" --batch "$BATCH" --steps "$STEPS" \
      --caps 25 --fp16-caps "" --bf16-caps "" | sed -n 's/^trun mode=ddp /board off mode=ddp /p' |
      tee -a "$out" >&2
    # The board, held as the agent holds it, for the ranks that ddp_bench spawns: its name on the
    # first line of $hold_out, and at the end (a line on its stdin) what the ranks reported.
    rm -f "$hold_in" && mkfifo "$hold_in"
    "$BUILD/tests/hang/progress_board_hold" "trun-bench-ddp-$$" "$RANKS" dump <"$hold_in" \
      >"$hold_out" &
    hold_pid=$!
    exec {hold_w}>"$hold_in"
    for _ in $(seq 100); do [[ -s $hold_out ]] && break; sleep 0.05; done
    board=$(head -1 "$hold_out")
    TRUN_PROGRESS_SHM=$board "$BUILD/bench/ddp_bench" --ranks "$RANKS" --sizes "$SIZES" \
      --batch "$BATCH" --steps "$STEPS" --caps 25 --fp16-caps "" --bf16-caps "" |
      sed -n 's/^trun mode=ddp /board on mode=ddp /p' | tee -a "$out" >&2
    echo >&"$hold_w"
    exec {hold_w}>&-
    wait "$hold_pid"
    # The ranks reported to it (a board nobody attached to would measure nothing).
    beats=$(grep -o 'heartbeat=[0-9]*' "$hold_out" | head -1 | cut -d= -f2)
    echo "board beats=${beats:-0}" | tee -a "$out" >&2
  done
  "$BUILD/tests/hang/progress_hook_bench" | sed -n 's/^RESULT progress_hook_\([a-z]*\) \([0-9.]*\) ns$/hook \1=\2/p' |
    tee -a "$out" >&2
fi
echo "== PyTorch 1.13 DDP (gloo), $RANKS ranks" >&2
peer_note=""
if [[ -x $TORCHRUN ]] && $PY -c 'import torch' 2>/dev/null; then
  if ! torch_peer "$out" "$RANKS" bench/ddp_torch.py "$SIZES" "$BATCH" "$STEPS" "$CAPS" "$FP16_CAPS"; then
    peer_note="PyTorch run failed: $torch_peer_error"
  fi
else
  peer_note="PyTorch (/usr/bin/python3 + torch, /usr/bin/torchrun) not available"
fi

$PY - "$out" "$peer_note" "$STEPS" <<'PYEOF'
import sys
rows = {"trun": {}, "torch": {}}
fp16 = {"trun": {}, "torch": {}}
bf16 = {}
board = {"off": [], "on": []}
beats = []
hook_ns = {}
for line in open(sys.argv[1]):
    if line.startswith("hook "):
        k, v = line.split()[1].split("=")
        hook_ns[k] = float(v)
        continue
    if line.startswith("board beats="):
        beats.append(int(line.split("=")[1]))
        continue
    if line.startswith("board "):
        f = dict(kv.split("=", 1) for kv in line.split()[2:])
        board[line.split()[1]].append(float(f["step_ms"]))
        continue
    who = line.split()[0]
    f = dict(kv.split("=", 1) for kv in line.split()[1:])
    if f["mode"] == "ddp_bf16":
        bf16[float(f["cap_mb"])] = f
        continue
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
if bf16:
    print()
    print("bf16 compression hook (gradients sent as bfloat16), ms per step")
    print(f"{'cap MB':>7} | {'trun none':>9} {'trun bf16':>9} {'bf16/none':>9}")
    for cap in sorted(bf16):
        tb = float(bf16[cap]["step_ms"])
        tn = float(t[cap]["step_ms"]) if cap in t else None
        print(f"{cap:>7g} | {fmt(tn, '>9.1f')} {tb:>9.1f} {fmt(tb / tn if tn else None, '>9.2f')}")
def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
computed = None
if board["off"] and board["on"]:
    off, on = min(board["off"]), min(board["on"])
    print()
    print(f"Progress hooks (hang detection), DDP step at cap 25 MB, {len(board['off'])} runs each, "
          "alternating (ms)")
    print(f"{'board':>6} | {'fastest':>7} {'median':>7} {'slowest':>7}")
    for k in ("off", "on"):
        print(f"{k:>6} | {min(board[k]):>7.2f} {median(board[k]):>7.2f} {max(board[k]):>7.2f}")
    print(f"measured: fastest with the board {100 * (on / off - 1):+.2f} % against fastest without; "
          f"spread of the runs without it: {100 * (max(board['off']) - min(board['off'])) / off:.1f} %")
    if beats and min(beats) > 0 and "collective" in hook_ns:
        # ddp_bench's DDP mode: 2 untimed and STEPS timed steps, all of them on the board.
        per_step = min(beats) / (int(sys.argv[3]) + 2)
        worst_ns = max(hook_ns.values())
        computed = 100 * per_step * worst_ns * 1e-6 / off
        print(f"computed: {per_step:.1f} progress events per step x {worst_ns:.1f} ns (the dearest "
              f"hook) = {per_step * worst_ns / 1000:.2f} us of a {off:.1f} ms step: {computed:.4f} %")
    else:
        print("computed: no progress event reached the board (nothing was measured)")
print()
if computed is not None:
    print(f"RESULT name=ddp_progress_hooks_cost_cap25MB value={computed:.4f} unit=% peer=none "
          "ratio=none")
    print(f"RESULT name=ddp_progress_board_ab_cap25MB value={100 * (on / off - 1):.2f} unit=% "
          "peer=none ratio=none")
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
for cap in sorted(bf16):
    tb = float(bf16[cap]["step_ms"])
    print(f"RESULT name=ddp_bf16_hook_step_ms_cap{cap:g}MB value={tb:.2f} unit=ms peer=none "
          "ratio=none")
    if cap in t:
        print(f"RESULT name=ddp_bf16_vs_none_cap{cap:g}MB value={tb / float(t[cap]['step_ms']):.3f} "
              "unit=x peer=none ratio=none")
PYEOF

# The cross-node part (issue 41): compression on a rate-limited link between 2 namespaces.
if [[ ${DDP_NET:-1} != 0 ]]; then
  echo
  bash scripts/bench_ddp_net.sh "$BUILD"
fi
