#!/usr/bin/env bash
# Installs dependencies (scripts/setup.sh) and builds trun into build/ (RelWithDebInfo).
# Prints nothing but errors and a final line when everything is already up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
BUILD_DIR=${TRUN_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" >/dev/null
echo "build: $BUILD_DIR/ is up to date"
