#!/usr/bin/env bash
# libtorch DDP benchmark: step time of a ~10M-parameter libtorch MLP on 2 CPU ranks with
# trun::libtorch::DistributedDataParallel (under trun), vs the same step without communication
# (under no_sync(), alternating with the DDP steps so both see the same machine load), vs PyTorch
# 1.13's Python DistributedDataParallel (gloo, under torchrun) in the same run.
# One thread per rank on both sides (torch::set_num_threads(1) / torch.set_num_threads(1)).
# Usage: scripts/bench_libtorch.sh [build dir]
#   (env: SIZES=1024,2560,2048,1024 BATCH=8 STEPS=12 WARMUP=2 RANKS=2 CAPS=25,5)
# CAPS: bucket caps in MB, one run of each side per cap (25: PyTorch's default).
# Also the cost of hang detection's progress hooks (issue 36, docs/hangs.md): PROGRESS_PAIRS (3)
# alternating runs at cap 25 MB under trun with its default (a progress board, which the ranks
# report to: progress=1) and with --hang-detection=off (progress=0), the fastest of each compared
# (0: skipped). scripts/bench.sh ddp computes the same hooks' cost from their parts.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD=${1:-build}
SIZES=${SIZES:-1024,2560,2048,1024}
BATCH=${BATCH:-8}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-2}
RANKS=${RANKS:-2}
CAPS=${CAPS:-25,5}
PROGRESS_PAIRS=${PROGRESS_PAIRS:-3}
PY=$TORCH_PY

bench_build "$BUILD" trun libtorch_bench

out=$(mktemp /tmp/trun-bench-libtorch-XXXXXX)
trap 'rm -f "$out"' EXIT

IFS=, read -ra caps <<<"$CAPS"
for cap in "${caps[@]}"; do
  echo "== trun::libtorch, $RANKS ranks, layers $SIZES, batch $BATCH per rank, cap $cap MB" >&2
  OMP_NUM_THREADS=1 "$BUILD/launcher/trun" --standalone --nproc-per-node="$RANKS" \
    "$BUILD/bench/libtorch_bench" --sizes "$SIZES" --batch "$BATCH" --steps "$STEPS" \
    --warmup "$WARMUP" --cap-mb "$cap" | grep '^trun ' | tee -a "$out" >&2
done
for ((i = 0; i < PROGRESS_PAIRS; ++i)); do
  for hang in on off; do
    echo "== trun::libtorch at cap 25 MB, --hang-detection=$hang (run $((i + 1)) of $PROGRESS_PAIRS)" >&2
    OMP_NUM_THREADS=1 "$BUILD/launcher/trun" --standalone --nproc-per-node="$RANKS" \
      --hang-detection="$hang" "$BUILD/bench/libtorch_bench" --sizes "$SIZES" --batch "$BATCH" \
      --steps "$STEPS" --warmup "$WARMUP" --cap-mb 25 |
      sed -n "s/^trun mode=ddp /board$hang mode=ddp /p" | tee -a "$out" >&2
  done
done
peer_note=""
if [[ -x $TORCHRUN ]] && $PY -c 'import torch' 2>/dev/null; then
  for cap in "${caps[@]}"; do
    echo "== PyTorch 1.13 DistributedDataParallel (gloo), $RANKS ranks, cap $cap MB" >&2
    if ! torch_peer "$out" "$RANKS" bench/ddp_libtorch.py "$SIZES" "$BATCH" "$STEPS" "$WARMUP" "$cap"; then
      peer_note="PyTorch run failed: $torch_peer_error"
    fi
  done
else
  peer_note="PyTorch (/usr/bin/python3 + torch, /usr/bin/torchrun) not available"
fi

$PY - "$out" "$peer_note" <<'PYEOF'
import sys
rows = {}
board = {"on": [], "off": []}
reported = {"on": set(), "off": set()}
for line in open(sys.argv[1]):
    if line.startswith("board"):
        f = dict(kv.split("=", 1) for kv in line.split()[1:])
        side = line.split()[0][len("board"):]
        board[side].append(float(f["step_ms"]))
        reported[side].add(f.get("progress", "?"))
        continue
    who = line.split()[0]
    f = dict(kv.split("=", 1) for kv in line.split()[1:])
    rows[(who, f["mode"], float(f["cap_mb"]))] = f
note = sys.argv[2]
caps = []
for (_, _, c) in rows:
    if c not in caps:
        caps.append(c)
first = next(iter(rows.values()))
print()
print(f"libtorch DDP step time, {first['ranks']} ranks, {int(first['params']) / 1e6:.1f}M parameters, "
      "1 thread per rank")
print(f"{'':>22} {'cap MB':>6} | {'local step':>10} | {'DDP step':>8} | {'overhead':>8}")
def ms(who, mode, cap):
    r = rows.get((who, mode, cap))
    return float(r["step_ms"]) if r else None
for cap in caps:
    for who, label in (("trun", "trun::libtorch (C++)"), ("torch", "PyTorch DDP (Python)")):
        l, d = ms(who, "local", cap), ms(who, "ddp", cap)
        if l and d:
            print(f"{label:>22} {cap:>6g} | {l:>10.1f} | {d:>8.1f} | {100 * (d / l - 1):>7.1f}%")
if note:
    print(f"peer: none ({note})")
print("overhead = DDP step / local step - 1 (target <= 20 %); local = the same step under no_sync(),")
print("alternating with the DDP steps; times in ms, median of the slowest rank")
ab = None
if board["on"] and board["off"]:
    on, off = min(board["on"]), min(board["off"])
    print()
    print(f"Progress hooks (hang detection), trun::libtorch DDP step at cap 25 MB, "
          f"{len(board['on'])} runs each, alternating (ms)")
    print(f"{'hang detection':>14} | {'fastest':>7} {'slowest':>7} | ranks reported progress")
    for k in ("on", "off"):
        print(f"{k:>14} | {min(board[k]):>7.2f} {max(board[k]):>7.2f} | "
              f"{'yes' if reported[k] == {'1'} else 'no' if reported[k] == {'0'} else 'mixed'}")
    spread = 100 * (max(board["off"]) - min(board["off"])) / off
    print(f"fastest with the board {100 * (on / off - 1):+.2f} % against fastest without; spread "
          f"of the runs without it: {spread:.1f} %")
    if reported["on"] == {"1"} and reported["off"] == {"0"}:
        ab = 100 * (on / off - 1)
    else:
        print("(not compared: the runs did not report progress as expected)")
print()
if ab is not None:
    print(f"RESULT name=libtorch_progress_board_ab_cap25MB value={ab:.2f} unit=% peer=none "
          "ratio=none")
for cap in caps:
    tl, td = ms("trun", "local", cap), ms("trun", "ddp", cap)
    pl, pd = ms("torch", "local", cap), ms("torch", "ddp", cap)
    peer = f"{pd:.2f}" if pd else "none"
    ratio = f"{pd / td:.2f}" if pd else "none"
    print(f"RESULT name=libtorch_ddp_step_cap{cap:g}MB value={td:.2f} unit=ms peer={peer} "
          f"ratio={ratio}")
    ov = td / tl - 1
    if pd and pl and ov > 0 and pd / pl - 1 > 0:
        pov = pd / pl - 1
        print(f"RESULT name=libtorch_ddp_overhead_cap{cap:g}MB value={ov:.3f} unit=fraction "
              f"peer={pov:.3f} ratio={pov / ov:.2f}")
    else:
        print(f"RESULT name=libtorch_ddp_overhead_cap{cap:g}MB value={ov:.3f} unit=fraction "
              "peer=none ratio=none")
PYEOF
