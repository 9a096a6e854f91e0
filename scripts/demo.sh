#!/usr/bin/env bash
# The README's main job. Builds trun, then runs it.
# Today: the standalone rendezvous store on 127.0.0.1 (port from $PORT, default 29500) until
# Ctrl-C. The elastic training demo replaces this once the launcher and worker SDK land.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec build/launcher/trun store --host 127.0.0.1 --port "${PORT:-29500}"
