#!/usr/bin/env bash
# Builds the libFuzzer targets in tests/fuzz/ with clang and runs each for a bounded time.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]   (SECONDS per target, default 20; every target
# by default; a TARGET is a file name without _fuzz.cpp, e.g. store_decoder)
#
# A target is tests/fuzz/NAME_fuzz.cpp. Its header names what it links, in two comment lines:
#   // fuzz-sources: store/wire.cpp store/kv_state.cpp
#   // fuzz-libs: -lspdlog -lfmt            (optional)
# Its checked-in seeds are tests/fuzz/corpus/NAME/ (only read). Everything the script writes stays
# in build-fuzz/: the binaries, each target's growing corpus and any crash reproducer. Exits
# non-zero if a fuzzer finds a crash, a sanitizer error, a hang or a broken invariant.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-20}
if ! [[ $SECONDS_TO_RUN =~ ^[0-9]+$ ]] || ((SECONDS_TO_RUN < 1)); then
  echo "fuzz: SECONDS must be a positive whole number, got '$SECONDS_TO_RUN'" >&2
  exit 2
fi
shift || true

CXX=${FUZZ_CXX:-clang++}
if ! command -v "$CXX" >/dev/null; then
  echo "fuzz: $CXX not found (Debian: clang, libclang-rt-14-dev; scripts/setup.sh installs them)" >&2
  exit 1
fi

targets=("$@")
if ((${#targets[@]} == 0)); then
  for f in tests/fuzz/*_fuzz.cpp; do
    n=${f##*/}
    targets+=("${n%_fuzz.cpp}")
  done
fi

OUT=build-fuzz
# header_field FILE FIELD: the words after "// FIELD:" in FILE's leading comment (empty if none).
header_field() { sed -n "s|^// $2: *||p" "$1" | head -n 1; }

FUZZ_JOBS=${FUZZ_JOBS:-$(nproc)}
# build_one BIN SRC [SOURCE...] -- [LIB...]: one clang of the target with its sources.
build_one() {
  local bin=$1 src=$2
  shift 2
  local sources=() libs=()
  while (($#)) && [[ $1 != -- ]]; do
    sources+=("$1")
    shift
  done
  (($#)) && shift
  libs=("$@")
  "$CXX" -std=c++17 -g -O1 -fno-omit-frame-pointer -Wall -Wextra -Wno-unused-parameter \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I. -Iworker_sdk/include "$src" "${sources[@]}" "${libs[@]}" -o "$bin"
}

# First every target that needs it is built, FUZZ_JOBS compilers at once (each is one clang of
# ASan code, 20-30 s on a CI machine: one after the other they took most of the step), then each
# runs for its time, one after the other.
building=()
failed=0
for name in "${targets[@]}"; do
  src=tests/fuzz/${name}_fuzz.cpp
  if [[ ! -f $src ]]; then
    echo "fuzz: no target '$name' ($src does not exist)" >&2
    exit 2
  fi
  read -r -a sources <<<"$(header_field "$src" fuzz-sources)"
  read -r -a libs <<<"$(header_field "$src" fuzz-libs)"
  bin=$OUT/${name}_fuzz
  mkdir -p "$OUT"
  # Rebuild when the target, one of its sources or any header of the project is newer.
  if [[ ! -x $bin ]] || [[ -n $({
    find "$src" "${sources[@]}" -newer "$bin"
    find rendezvous launcher agent worker_sdk -name '*.h' -newer "$bin"
  } | head -n 1) ]]; then
    echo "fuzz: building $bin"
    build_one "$bin" "$src" "${sources[@]}" -- "${libs[@]}" &
    building+=($!)
    if ((${#building[@]} >= FUZZ_JOBS)); then
      wait "${building[0]}" || failed=1
      building=("${building[@]:1}")
    fi
  fi
done
for pid in "${building[@]}"; do wait "$pid" || failed=1; done
if ((failed)); then
  echo "fuzz: a target did not build (the compiler's message is above)" >&2
  exit 1
fi

for name in "${targets[@]}"; do
  bin=$OUT/${name}_fuzz
  corpus=$OUT/corpus/$name
  artifacts=$OUT/artifacts/$name
  mkdir -p "$corpus" "$artifacts"
  seeds=()
  [[ -d tests/fuzz/corpus/$name ]] && seeds=("tests/fuzz/corpus/$name")
  echo "fuzz: running $name for ${SECONDS_TO_RUN}s"
  # New inputs go to the first corpus folder (ours); the checked-in seeds are only read.
  # -timeout: one input taking over 10 s counts as a hang (a failure).
  "$bin" "$corpus" "${seeds[@]}" \
    -max_total_time="$SECONDS_TO_RUN" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -artifact_prefix="$artifacts/" -print_final_stats=1
  echo "fuzz: $name: no crash in ${SECONDS_TO_RUN}s; corpus $(ls "$corpus" | wc -l) inputs"
done
