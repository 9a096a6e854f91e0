#!/usr/bin/env bash
# What the Containerfile promises that can be checked without a container runtime (the image itself
# is built and run by tests/container/podman_test.sh):
#   container_test.sh TRUN_BUILD_DIR TRUN_SOURCE_DIR
#
# 1. The image's install: scripts/install-runtime.sh (the command the Containerfile runs) into a
#    temporary prefix gives bin/trun and lib/libtrun_worker.so.<major> only, stripped, with no
#    RPATH/RUNPATH into the build or source tree.
# 2. The runtime packages: ldd on every installed ELF file, each library mapped to its Debian
#    package (dpkg -S); fails with the list when scripts/runtime-packages.txt (which the
#    Containerfile installs) misses a package or lists one nothing needs. CUDA/NCCL libraries
#    from /usr/local/cuda* are not Debian packages: they come from a CUDA base image and are only
#    reported.
# 3. The Containerfile itself: installs that list, runs that install script, ENTRYPOINT
#    ["trun"], STOPSIGNAL SIGTERM, and a shutdown timeout that fits docker stop's 10 s.
# 4. trun as PID 1: the installed trun (LD_LIBRARY_PATH = the prefix's lib only, PATH without the
#    build tree, the image's environment) runs as PID 1 of a new PID namespace (unshare --pid
#    --fork --mount-proc) with 2 workers (tests/container/worker.sh), each of which leaves
#    orphaned grandchildren. Checked: the workers run, PID 1 reaps the orphans (no zombie stays in
#    the namespace), then
#    - SIGTERM to PID 1: every worker and the orphan in its process group gets SIGTERM, trun
#      exits 143;
#    - SIGINT (Ctrl-C): the same with SIGINT, exit 130;
#    - SIGTERM with workers that ignore it: trun SIGKILLs them when the shutdown timeout (1 s
#      here) runs out and exits 143;
#    and each time nothing is left in the namespace.
# Exit status: 0 pass, 1 fail, 77 skipped (not root, or unshare cannot make a PID namespace; a
# failure instead under CI=true or TRUN_STRICT_SKIPS=1, as in tests/cluster/cluster.sh).
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
TMP=$(mktemp -d /tmp/trun-container-test-XXXXXX)
PREFIX=$TMP/prefix
UNSHARE_PID=
INIT_PID=

cleanup() {
  # PID 1 of the namespace takes every process in it along when it dies.
  # unshare runs with --kill-child: killing it kills PID 1 too, when PID 1 was not found.
  if [[ -n $INIT_PID ]] && kill -0 "$INIT_PID" 2>/dev/null; then kill -KILL "$INIT_PID"; fi
  if [[ -n $UNSHARE_PID ]]; then
    kill -KILL "$UNSHARE_PID" 2>/dev/null || true
    wait "$UNSHARE_PID" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*"
  if [[ -s $TMP/trun.log ]]; then
    echo "--- trun's output:"
    cat "$TMP/trun.log"
  fi
  exit 1
}

SKIP_TEST_NAME="container.image (container_test.sh)"
# shellcheck source=tests/skip.sh
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"

# ---- 1. the install
bash "$SRC/scripts/install-runtime.sh" "$BUILD" "$PREFIX" >"$TMP/install.log" ||
  { cat "$TMP/install.log"; fail "scripts/install-runtime.sh"; }
mapfile -t installed < <(cd "$PREFIX" && find . -type f -o -type l | sed 's|^\./||' | sort)
echo "installed: ${installed[*]}"
[[ -x $PREFIX/bin/trun ]] || fail "bin/trun was not installed"
for f in "${installed[@]}"; do
  [[ $f == bin/trun || $f =~ ^lib/libtrun_worker\.so\.[0-9]+(\.[0-9]+\.[0-9]+)?$ ]] ||
    fail "$f is installed: the runtime components hold only bin/trun and lib/libtrun_worker.so.*"
done
compgen -G "$PREFIX/lib/libtrun_worker.so.[0-9]*" >/dev/null || fail "libtrun_worker was not installed"

elves=()
for f in "${installed[@]}"; do
  [[ -L $PREFIX/$f ]] && continue
  [[ $(head -c 4 "$PREFIX/$f" | od -An -c | tr -d ' ') == 177ELF ]] && elves+=("$PREFIX/$f")
done
((${#elves[@]} == 2)) || fail "expected 2 ELF files (trun, libtrun_worker), found ${#elves[@]}"
for e in "${elves[@]}"; do
  if readelf -S "$e" | grep -q '\.debug_info'; then fail "$e is not stripped"; fi
  if readelf -d "$e" | grep -E 'R(UN)?PATH' | grep -qE "$BUILD|$SRC"; then
    fail "$e has an RPATH/RUNPATH into the build or source tree: $(readelf -d "$e" | grep -E 'R(UN)?PATH')"
  fi
done

# ---- 2. the runtime packages
mapfile -t listed < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$SRC/scripts/runtime-packages.txt" |
  grep -v '^$' | sort -u)
((${#listed[@]} > 0)) || fail "scripts/runtime-packages.txt lists no package"
declare -A needed=()  # package -> the libraries that need it
# owner PATH: the Debian package holding PATH (usrmerge: ldd may say /lib/..., dpkg /usr/lib/...).
owner() {
  local p out
  for p in "$1" "/usr$1" "$(readlink -f "$1")"; do
    if out=$(dpkg -S "$p" 2>/dev/null); then
      out=${out%%: *}
      echo "${out%%:*}"
      return 0
    fi
  done
  return 1
}
unowned=()
for e in "${elves[@]}"; do
  ldd_out=$(LD_LIBRARY_PATH=$PREFIX/lib ldd "$e") || fail "ldd $e: $ldd_out"
  if grep -q 'not found' <<<"$ldd_out"; then fail "$e: missing libraries: $ldd_out"; fi
  while read -r lib path; do
    [[ -n $path ]] || continue
    [[ $path == "$PREFIX"/* ]] && continue  # libtrun_worker itself
    if pkg=$(owner "$path"); then
      needed[$pkg]+=" ${lib}(${e##*/})"
    elif [[ $(readlink -f "$path") == /usr/local/cuda* && $lib =~ ^lib(cudart|nccl|cuda)\. ]]; then
      echo "note: $lib ($path) comes from the CUDA toolkit, not a Debian package: a CUDA base image provides it"
    else
      unowned+=("$lib ($path, needed by ${e##*/})")
    fi
  done < <(awk '$2 == "=>" && $3 ~ /^\// {print $1, $3} $1 ~ /^\// {print $1, $1}' <<<"$ldd_out")
done
((${#unowned[@]} == 0)) || fail "libraries that belong to no Debian package: ${unowned[*]}"
missing=() extra=()
for pkg in "${!needed[@]}"; do
  printf '%s\n' "${listed[@]}" | grep -qxF "$pkg" || missing+=("$pkg (for${needed[$pkg]})")
done
for pkg in "${listed[@]}"; do [[ -n ${needed[$pkg]:-} ]] || extra+=("$pkg"); done
((${#missing[@]} == 0)) || fail "scripts/runtime-packages.txt misses: ${missing[*]}"
((${#extra[@]} == 0)) || fail "scripts/runtime-packages.txt lists packages nothing needs: ${extra[*]}"
echo "runtime packages: ${listed[*]} (each needed, none missing)"

# ---- 3. the Containerfile
CF=$SRC/Containerfile
grep -q 'runtime-packages\.txt' "$CF" || fail "the Containerfile does not install scripts/runtime-packages.txt"
grep -q 'scripts/install-runtime\.sh /build /opt/trun' "$CF" ||
  fail "the Containerfile does not install with scripts/install-runtime.sh"
grep -qx 'ENTRYPOINT \["trun"\]' "$CF" || fail 'the Containerfile has no ENTRYPOINT ["trun"]'
grep -qx 'STOPSIGNAL SIGTERM' "$CF" || fail "the Containerfile has no STOPSIGNAL SIGTERM"
image_timeout=$(sed -n 's/^ENV TORCH_ELASTIC_SHUTDOWN_TIMEOUT=\([0-9]*\)$/\1/p' "$CF")
[[ -n $image_timeout ]] || fail "the Containerfile sets no ENV TORCH_ELASTIC_SHUTDOWN_TIMEOUT=<seconds>"
# trun's final console flush takes at most 2 s (launcher/main.cpp): timeout + 2 < 10.
((image_timeout + 2 < 10)) ||
  fail "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$image_timeout does not fit docker stop's 10 s with 2 s to spare"

# ---- 4. trun as PID 1
[[ $(id -u) == 0 ]] || skip setup "not root: unshare --pid needs it"
unshare --pid --fork --mount-proc true 2>"$TMP/unshare.err" ||
  skip setup "unshare --pid --fork --mount-proc fails: $(cat "$TMP/unshare.err")"

# ns_pids INODE: the host pids of the processes in PID namespace INODE ("pid:[N]").
ns_pids() {
  local d
  for d in /proc/[0-9]*; do
    [[ $(readlink "$d/ns/pid" 2>/dev/null) == "$1" ]] && echo "${d#/proc/}"
  done
  return 0
}
# zombies INODE: "pid(comm)" of each zombie in the namespace.
zombies() {
  local p stat
  for p in $(ns_pids "$1"); do
    stat=$(cat "/proc/$p/stat" 2>/dev/null) || continue
    [[ ${stat##*) } == Z* ]] && echo "$p"
  done
  return 0
}
# wait_for PATH...: bounded (30 s), fails naming what is missing.
wait_for() {
  local f
  for f in "$@"; do
    for _ in $(seq 300); do
      [[ -e $f ]] && break
      kill -0 "$INIT_PID" 2>/dev/null || fail "trun exited before $f appeared"
      sleep 0.1
    done
    [[ -e $f ]] || fail "$f did not appear within 30 s"
  done
}

# run_case NAME SIGNAL MODE SHUTDOWN_TIMEOUT EXPECTED_STATUS
run_case() {
  local name=$1 sig=$2 mode=$3 timeout=$4 expected=$5 ctl=$TMP/$1 ns status r left=
  mkdir "$ctl"
  : >"$TMP/trun.log"
  # env: the image's environment only (ENTRYPOINT trun from /usr/local: PATH without the build
  # tree, the prefix's lib), SIGINT/SIGQUIT back to their defaults (bash starts background
  # commands with them ignored; a container's PID 1 starts with the defaults).
  env -i --default-signal=INT,QUIT PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LD_LIBRARY_PATH="$PREFIX/lib" TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$timeout" \
    unshare --pid --fork --mount-proc --kill-child "$PREFIX/bin/trun" --standalone --nproc-per-node=2 \
    "$SRC/tests/container/worker.sh" "$ctl" "$mode" >"$TMP/trun.log" 2>&1 &
  UNSHARE_PID=$!
  for _ in $(seq 100); do
    INIT_PID=$(ps -o pid= --ppid "$UNSHARE_PID" | tr -d ' ') || true
    [[ -n $INIT_PID ]] && break
    kill -0 "$UNSHARE_PID" 2>/dev/null || fail "$name: unshare (and trun) exited at once"
    sleep 0.1
  done
  [[ -n $INIT_PID ]] || fail "$name: unshare started no child"
  [[ $(awk '/^NSpid:/ {print $NF}' "/proc/$INIT_PID/status") == 1 ]] ||
    fail "$name: trun (host pid $INIT_PID) is not PID 1 of its namespace"
  ns=$(readlink "/proc/$INIT_PID/ns/pid")

  wait_for "$ctl/running_0" "$ctl/running_1" "$ctl/orphan_0" "$ctl/orphan_1"
  for r in 0 1; do
    [[ $(cat "$ctl/orphan_$r") == 1 ]] ||
      fail "$name: rank $r's orphan was not adopted by PID 1 (its parent was $(cat "$ctl/orphan_$r"))"
  done
  # An orphan is a zombie from its exit until PID 1 reaps it: wait (bounded) until none is left.
  local z
  for _ in $(seq 100); do
    z=$(zombies "$ns")
    [[ -z $z ]] && break
    sleep 0.1
  done
  [[ -z $z ]] || fail "$name: zombies in the namespace 10 s after the orphans exited: $z"
  echo "$name: trun is PID 1 (host pid $INIT_PID), 2 workers running, orphans reaped," \
    "$(ns_pids "$ns" | wc -l) processes in the namespace"

  kill "-$sig" "$INIT_PID"
  for _ in $(seq 600); do
    kill -0 "$UNSHARE_PID" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$UNSHARE_PID" 2>/dev/null && fail "$name: trun still runs 60 s after SIG$sig"
  status=0
  wait "$UNSHARE_PID" || status=$?
  UNSHARE_PID=
  ((status == expected)) || fail "$name: trun exited $status after SIG$sig, expected $expected"
  for r in 0 1; do
    [[ $(cat "$ctl/sig_$r" 2>/dev/null) == "$sig" ]] ||
      fail "$name: worker $r did not get SIG$sig (sig_$r: $(cat "$ctl/sig_$r" 2>/dev/null))"
    [[ -e $ctl/orphan_sig_$r ]] || fail "$name: rank $r's orphan in its process group did not get SIG$sig"
  done
  if [[ $mode == stubborn ]]; then
    grep -q 'after the stop signal; sending SIGKILL' "$TMP/trun.log" ||
      fail "$name: trun did not say it SIGKILLed the workers that ignored SIGTERM"
  fi
  # PID 1 gone means the kernel ends the namespace; still, nothing may be left (bounded).
  for _ in $(seq 100); do
    left=$(ns_pids "$ns")
    [[ -z $left ]] && break
    sleep 0.1
  done
  [[ -z $left ]] || fail "$name: processes left in the namespace: $left"
  INIT_PID=
  echo "$name: SIG$sig -> workers and orphans signalled, trun exited $status, nothing left"
}

run_case term TERM stop "$image_timeout" 143
run_case int INT stop "$image_timeout" 130
run_case stubborn TERM stubborn 1 143
echo "PASS: the runtime install, its packages, the Containerfile and trun as PID 1"
