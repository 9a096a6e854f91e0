#!/usr/bin/env bash
# The dependency rules of docs/ARCHITECTURE.md, checked on the #include lines of the sources:
#
#   launcher -> agent -> rendezvous -> store -> base
#   worker_sdk -> store -> base        examples -> the SDK's public headers (<trun/...>) only
#
# A module may include its own headers and those of the modules below it, never one above or
# beside it (worker_sdk never includes launcher/, agent/ or rendezvous/). Includes are rooted at
# the repository ("store/store.h"); <...> includes are not checked here (system and libraries).
#
#   scripts/check-layering.sh [ROOT]     exit 0 when every rule holds, else 1 and one line per
#                                        offending include: FILE:LINE: MODULE may not include X
#   scripts/check-layering.sh --self-test  checks that a planted upward include is reported
set -euo pipefail

allowed() {  # the top-level folders module $1 may include from
  case "$1" in
    base) echo "base" ;;
    store) echo "store base" ;;
    rendezvous) echo "rendezvous store base" ;;
    agent) echo "agent rendezvous store base" ;;
    launcher) echo "launcher agent rendezvous store base" ;;
    worker_sdk) echo "worker_sdk trun store base" ;;
    examples) echo "examples trun" ;;
  esac
}

check() {
  local root=$1 bad=0 module file line target
  for module in base store rendezvous agent launcher worker_sdk examples; do
    [[ -d $root/$module ]] || continue
    local ok
    ok=" $(allowed "$module") "
    while IFS= read -r hit; do
      file=${hit%%:*}
      line=${hit#*:}
      line=${line%%:*}
      target=${hit#*#include \"}
      target=${target%%\"*}
      [[ $target == */* ]] || continue  # a file beside this one
      if [[ $ok != *" ${target%%/*} "* ]]; then
        echo "${file#"$root"/}:$line: $module may not include $target (allowed: $(allowed "$module"))"
        bad=1
      fi
    done < <(grep -rnE --include='*.h' --include='*.cpp' --include='*.h.in' '^\s*#\s*include\s+"' \
               "$root/$module" || true)
  done
  return $bad
}

if [[ ${1:-} == --self-test ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp"/{base,store,worker_sdk/src}
  printf '#include "base/check.h"\n' >"$tmp/store/ok.cpp"
  printf '#include "launcher/slurm.h"\n' >"$tmp/worker_sdk/src/env.cpp"
  printf '#include "store/store.h"\n' >"$tmp/base/up.h"
  out=$(check "$tmp") && { echo "self-test: planted upward includes were not reported"; exit 1; }
  grep -q '^worker_sdk/src/env.cpp:1: worker_sdk may not include launcher/slurm.h' <<<"$out" || {
    echo "self-test: the SDK including launcher/ was not reported: $out"; exit 1; }
  grep -q '^base/up.h:1: base may not include store/store.h' <<<"$out" || {
    echo "self-test: base including store/ was not reported: $out"; exit 1; }
  if grep -q 'store/ok.cpp' <<<"$out"; then echo "self-test: a downward include was reported"; exit 1; fi
  echo "self-test: ok"
  exit 0
fi

root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
if check "$root"; then
  echo "layering: every include goes down (launcher -> agent -> rendezvous -> store -> base, worker_sdk -> store -> base)"
else
  exit 1
fi
