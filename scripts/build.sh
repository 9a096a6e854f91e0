#!/usr/bin/env bash
# Installs dependencies (scripts/setup.sh) and builds trun into $TRUN_BUILD_DIR (default build/,
# RelWithDebInfo).
#
#   scripts/build.sh [--progress] [--no-setup] [TARGET...]
#
# TARGETs are CMake target names (`cmake --build build --target help` lists them), e.g.
# `scripts/build.sh trun train_mlp`; without any, everything is built, the tests included.
# Progress (setup's output and ninja's [N/M] lines) shows when stdout is a terminal, with
# --progress, or with TRUN_BUILD_PROGRESS=1; otherwise the script prints only a final line, and
# on a failure the end of the build's output. --no-setup leaves scripts/setup.sh out (a caller
# that ran it already).
set -euo pipefail
cd "$(dirname "$0")/.."

progress=${TRUN_BUILD_PROGRESS:-}
if [[ -z $progress ]]; then
  if [[ -t 1 ]]; then progress=1; else progress=0; fi
fi
setup=1
targets=()
for arg in "$@"; do
  case $arg in
    --progress) progress=1 ;;
    --no-setup) setup=0 ;;
    -*)
      echo "build: unknown option $arg (usage: scripts/build.sh [--progress] [--no-setup] [TARGET...])" >&2
      exit 2
      ;;
    *) targets+=("$arg") ;;
  esac
done

BUILD_DIR=${TRUN_BUILD_DIR:-build}
JOBS=${TRUN_BUILD_JOBS:-$(nproc)}
build_args=(--build "$BUILD_DIR" -j "$JOBS")
if ((${#targets[@]} > 0)); then build_args+=(--target "${targets[@]}"); fi

if ((progress)); then
  if ((setup)); then bash scripts/setup.sh; fi
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake "${build_args[@]}"
else
  log=$(mktemp /tmp/trun-build.XXXXXX)
  trap 'rm -f "$log"' EXIT
  # Quiet, but a failure shows what failed (ninja prints compiler errors on stdout).
  quiet() {
    if ! "$@" >"$log" 2>&1; then
      tail -n 60 "$log" >&2
      echo "build: failed: $*" >&2
      exit 1
    fi
  }
  if ((setup)); then quiet bash scripts/setup.sh; fi
  quiet cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
  quiet cmake "${build_args[@]}"
fi
echo "build: ${targets[*]:-every target} in $BUILD_DIR/ is up to date"
