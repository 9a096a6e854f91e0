# Visible skips for shell tests (the C++ tests' tests/skip.h; tests/CMakeLists.txt, "skips are
# visible"). Source it after setting SKIP_TEST_NAME (the test's CTest name and script, e.g.
# "slurm.c10d (slurm.sh)"), then call
#
#   skip KIND REASON...
#
# KIND setup: something scripts/setup.sh installs or the test machine provides (root, `ip netns`,
# etcd, SLURM): a failure in strict mode (CI=true or TRUN_STRICT_SKIPS=1). KIND environment never
# fails. A skip that does not fail appends its line to $TRUN_SKIP_LOG (when set) and exits 77, the
# tests' SKIP_RETURN_CODE, which CTest reports as skipped.
skip() {
  local kind=$1
  shift
  if [[ $kind == setup && (${CI:-} == true || ${TRUN_STRICT_SKIPS:-} == 1) ]]; then
    echo "FAIL: $* (this test machine should provide it, so no skip in strict mode: CI=true or TRUN_STRICT_SKIPS=1)"
    exit 1
  fi
  if [[ -n ${TRUN_SKIP_LOG:-} ]]; then
    printf '%s: %s [%s]\n' "$SKIP_TEST_NAME" "$*" "$kind" >>"$TRUN_SKIP_LOG"
  fi
  echo "SKIP: $*"
  exit 77
}
