#!/usr/bin/env bash
# catch_discover_tests registers each Catch2 test case as a CTest test named after it, and CTest
# splits a name at ';' into two entries whose filters match no test case: such a case silently
# never runs. This fails, naming them, when a TEST_CASE name (on its own line or the next) holds
# a ';'. Usage: check_test_names.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: check_test_names.sh SOURCE_DIR}
# refuse PATTERN WHAT: fails, listing them, when a TEST_CASE name (on its line or the next)
# matches PATTERN (an ERE for the opening quote and what follows).
refuse() {
  local found
  found=$(grep -rn --include='*.cpp' -A1 'TEST_CASE(' "$src/tests" |
    grep -E "(TEST_CASE\(|^[^:]*-[0-9]+-)[[:space:]]*$1" || true)
  if [[ -n $found ]]; then
    echo "$2"
    echo "$found"
    exit 1
  fi
}
refuse '"[^"]*;[^"]*"' "test case names with ';' (CTest would split them and run nothing):"
# A name that starts with '-' reaches Catch2 from CTest as an option: the case always fails.
refuse '"-' "test case names starting with '-' (Catch2 would read them as options):"
n=$(grep -rc --include='*.cpp' 'TEST_CASE(' "$src/tests" | awk -F: '{s += $2} END {print s}')
echo "ok: $n test case names, none with ';' or a leading '-'"
