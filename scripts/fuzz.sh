#!/usr/bin/env bash
# Builds the store decoder's libFuzzer target with clang and runs it for a bounded time.
# Usage: scripts/fuzz.sh [SECONDS]   (default 20)
#
# Everything it writes stays in build-fuzz/: the binary, the growing corpus (seeded from the
# checked-in tests/fuzz/corpus/, which is only read), and any crash reproducer. Exits non-zero if
# the fuzzer finds a crash, a sanitizer error or a broken decoder invariant.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-20}
if ! [[ $SECONDS_TO_RUN =~ ^[0-9]+$ ]] || ((SECONDS_TO_RUN < 1)); then
  echo "fuzz: SECONDS must be a positive whole number, got '$SECONDS_TO_RUN'" >&2
  exit 2
fi

CXX=${FUZZ_CXX:-clang++}
if ! command -v "$CXX" >/dev/null; then
  echo "fuzz: $CXX not found (Debian: clang, libclang-rt-14-dev; scripts/setup.sh installs them)" >&2
  exit 1
fi

OUT=build-fuzz
mkdir -p "$OUT/corpus" "$OUT/artifacts"
BIN="$OUT/store_decoder_fuzz"
SOURCES=(tests/fuzz/store_decoder_fuzz.cpp rendezvous/store/wire.cpp)

# Rebuild only when a source or header changed.
if [[ ! -x $BIN ]] || [[ -n $(find "${SOURCES[@]}" rendezvous/store/wire.h -newer "$BIN") ]]; then
  echo "fuzz: building $BIN"
  "$CXX" -std=c++17 -g -O1 -fno-omit-frame-pointer -Wall -Wextra \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I. "${SOURCES[@]}" -o "$BIN"
fi

echo "fuzz: running the store decoder for ${SECONDS_TO_RUN}s"
# New inputs go to the first corpus folder (ours); the checked-in seeds are only read.
# -timeout: one input taking over 10 s counts as a hang (a failure).
"$BIN" "$OUT/corpus" tests/fuzz/corpus \
  -max_total_time="$SECONDS_TO_RUN" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -artifact_prefix="$OUT/artifacts/" -print_final_stats=1
echo "fuzz: no crash in ${SECONDS_TO_RUN}s; corpus $(ls "$OUT/corpus" | wc -l) inputs"
