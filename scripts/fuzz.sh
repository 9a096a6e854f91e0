#!/usr/bin/env bash
# Builds the store decoder's libFuzzer target with clang and runs it for a bounded time.
# Usage: scripts/fuzz.sh [SECONDS]   (default 20)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-20}
echo "fuzz: not built yet"
