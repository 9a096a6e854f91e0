#!/usr/bin/env bash
# catch_discover_tests registers each Catch2 test case as a CTest test named after it, and CTest
# splits a name at ';' into two entries whose filters match no test case: such a case silently
# never runs. This fails, naming them, when a TEST_CASE name (on its own line or the next) holds
# a ';'. Usage: check_test_names.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: check_test_names.sh SOURCE_DIR}
bad=$(grep -rn --include='*.cpp' -A1 'TEST_CASE(' "$src/tests" |
  grep -E '(TEST_CASE\(|^[^:]*-[0-9]+-)[[:space:]]*"[^"]*;[^"]*"' || true)
if [[ -n $bad ]]; then
  echo "test case names with ';' (CTest would split them and run nothing):"
  echo "$bad"
  exit 1
fi
# A name that starts with '-' reaches Catch2 from CTest as an option: the case always fails.
dash=$(grep -rn --include='*.cpp' -A1 'TEST_CASE(' "$src/tests" |
  grep -E '(TEST_CASE\(|^[^:]*-[0-9]+-)[[:space:]]*"-' || true)
if [[ -n $dash ]]; then
  echo "test case names starting with '-' (Catch2 would read them as options):"
  echo "$dash"
  exit 1
fi
n=$(grep -rc --include='*.cpp' 'TEST_CASE(' "$src/tests" | awk -F: '{s += $2} END {print s}')
echo "ok: $n test case names, none with ';' or a leading '-'"
