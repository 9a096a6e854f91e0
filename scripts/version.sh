#!/usr/bin/env bash
# Prints trun's version, from its one place (CMakeLists.txt's project()), for the scripts and
# tests that name files or images after it without a build (scripts/container.sh,
# scripts/package.sh, tests/container, tests/package).
set -euo pipefail
version=$(sed -n 's/^project(trun VERSION \([0-9.]*\).*/\1/p' "$(dirname "$0")/../CMakeLists.txt")
[[ -n $version ]] || { echo "version.sh: no 'project(trun VERSION ...)' in CMakeLists.txt" >&2; exit 1; }
echo "$version"
