#!/usr/bin/env bash
# Installs what a runtime image holds, and nothing else, from a trun build into PREFIX:
#   PREFIX/bin/trun                  (component trun, stripped)
#   PREFIX/lib/libtrun_worker.so.*   (component worker, stripped: the shared library and its
#                                     soname link, without headers, CMake or pkg-config files)
# The Containerfile's runtime stage is exactly this; tests/container/container_test.sh runs the
# same script, so what the test checks is what the image gets.
#   scripts/install-runtime.sh BUILD_DIR PREFIX
set -euo pipefail
if (($# != 2)); then
  echo "usage: scripts/install-runtime.sh BUILD_DIR PREFIX" >&2
  exit 2
fi
build=$1
prefix=$2
for component in trun worker; do
  cmake --install "$build" --component "$component" --strip --prefix "$prefix"
done
