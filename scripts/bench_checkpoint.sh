#!/usr/bin/env bash
# checkpoint benchmark: Checkpointer::save throughput (fsync on) vs `dd if=/dev/zero bs=4M
# conv=fsync` of the same size in the same directory, interleaved in the same run (the disk here
# is shared and noisy: interleaving gives both the same conditions), and how long the training
# loop is blocked per save in async mode.
# Usage: scripts/bench_checkpoint.sh [build dir]   (env: SIZE_MIB=256 REPEATS=7 BENCH_DIR=/tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
BUILD=${1:-build}
SIZE=${SIZE_MIB:-256}
REPEATS=${REPEATS:-7}
PY=$TORCH_PY

bench_build "$BUILD" checkpoint_bench

dir=$(mktemp -d "${BENCH_DIR:-/tmp}/trun-bench-ckpt-XXXXXX")
out=$(mktemp /tmp/trun-bench-ckpt-out-XXXXXX)
trap 'rm -rf "$dir" "$out"' EXIT

for ((i = 1; i <= REPEATS; i++)); do
  # dd prints "N bytes (...) copied, S s, R MB/s" on stderr.
  secs=$(LC_ALL=C dd if=/dev/zero of="$dir/dd.bin" bs=4M count=$((SIZE / 4)) conv=fsync 2>&1 |
    awk '/copied/ {for (i = 1; i <= NF; i++) if ($i == "s,") print $(i - 1)}')
  rm -f "$dir/dd.bin"
  echo "dd size_mib=$SIZE secs=$secs" | tee -a "$out" >&2
  "$BUILD/bench/checkpoint_bench" "$dir" --size-mib "$SIZE" --repeats 1 --mode sync |
    tee -a "$out" >&2
done
echo "== async mode" >&2
"$BUILD/bench/checkpoint_bench" "$dir" --size-mib "$SIZE" --repeats 3 --mode both |
  grep 'mode=async' | tee -a "$out" >&2

$PY - "$out" "$SIZE" <<'PYEOF'
import statistics, sys
dd, trun, asyn = [], [], None
size = int(sys.argv[2])
nbytes = (size << 20)
for line in open(sys.argv[1]):
    kind = line.split()[0]
    f = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    if kind == "dd":
        dd.append(nbytes / float(f["secs"]) / 1e6)
    elif kind == "ckpt" and f["mode"] == "sync":
        trun.append(float(f["mbps"]))
    elif kind == "ckpt" and f["mode"] == "async":
        asyn = {k: float(v) for k, v in f.items() if k != "mode"}
print()
print(f"{'run':>4} | {'trun save MB/s':>14} | {'dd conv=fsync MB/s':>18}")
for i, (t, d) in enumerate(zip(trun, dd)):
    print(f"{i + 1:>4} | {t:>14.1f} | {d:>18.1f}")
tm, dm = statistics.median(trun), statistics.median(dd)
print(f"{'med':>4} | {tm:>14.1f} | {dm:>18.1f}   ({size} MiB, fsync on, MB = 1e6 bytes)")
if asyn:
    print()
    print(f"async: training blocked {asyn['blocked_ms']:.1f} ms per save (median of saves 2-5; "
          f"max {asyn['blocked_max_ms']:.1f} ms): snapshot {asyn['snapshot_ms']:.1f} ms + waiting "
          f"for the previous write {asyn['wait_ms']:.1f} ms (medians), vs "
          f"{asyn['sync_save_ms']:.1f} ms for a sync save; the first save (allocating the staging "
          f"buffer) blocked {asyn['first_save_ms']:.1f} ms; 20-step loop {asyn['loop_ms']:.0f} ms "
          f"vs {asyn['baseline_loop_ms']:.0f} ms without checkpoints")
print()
print(f"RESULT name=checkpoint_save_{size}MiB_vs_dd value={tm:.1f} unit=MB/s peer={dm:.1f} "
      f"ratio={tm / dm:.2f}")
if asyn:
    b, s = asyn["blocked_ms"], asyn["sync_save_ms"]
    print(f"RESULT name=checkpoint_async_blocked_{size}MiB value={b:.1f} unit=ms peer={s:.1f} "
          f"ratio={s / b if b > 0 else float('inf'):.2f}")
PYEOF
