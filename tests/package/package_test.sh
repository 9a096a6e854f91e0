#!/usr/bin/env bash
# The Debian packages (scripts/package.sh) installed with apt into a fresh Debian 12 root:
#   package_test.sh BUILD_DIR SOURCE_DIR
#
# 1. scripts/package.sh --from-build BUILD_DIR makes trun_<v>_<arch>.deb and trun-dev_<v>_<arch>.deb;
#    their Depends: name the Debian packages of every library the binaries need (read back with
#    ldd, mapped with dpkg -S, as tests/container/container_test.sh does for the image) and
#    nothing from /usr/local; the file lists are what package.sh promises.
# 2. In a container from the base image that scripts/container.sh makes with mmdebstrap (the
#    fixture trun_image; a fresh root each time, removed with the container), as a user would:
#    `apt-get install ./trun_*.deb ./trun-dev_*.deb` (apt fetches the Depends), `trun --version`,
#    the demo's training on 2 workers (/usr/libexec/trun/train_mlp under trun --standalone),
#    examples/find_package_consumer built with find_package(trun) and run on 2 workers, then
#    `apt-get purge trun trun-dev`: every file the packages installed is gone.
# Exit status: 0 pass, 1 fail, 77 skipped (no podman, or not root; a failure in strict mode).
set -euo pipefail
BUILD=$(cd "${1:?usage: package_test.sh BUILD_DIR SOURCE_DIR}" && pwd)
SRC=$(cd "${2:?}" && pwd)
TMP=$(mktemp -d /tmp/trun-package-test-XXXXXX)
NAME=trun-ctest-package-$$
STARTED=0
cleanup() {
  if ((STARTED)); then bash "$SRC/scripts/container.sh" podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
SKIP_TEST_NAME="package.deb (package_test.sh)"
# shellcheck source=tests/skip.sh
source "$SRC/tests/skip.sh"

# ---- 1. the packages
bash "$SRC/scripts/package.sh" --from-build "$BUILD" --out "$TMP/debs" >"$TMP/package.log" 2>&1 ||
  fail "scripts/package.sh: $(cat "$TMP/package.log")"
cat "$TMP/package.log"
version=$(bash "$SRC/scripts/version.sh")
arch=$(dpkg --print-architecture)
deb=$TMP/debs/trun_${version}_$arch.deb
devdeb=$TMP/debs/trun-dev_${version}_$arch.deb
[[ -f $deb && -f $devdeb ]] || fail "expected $(basename "$deb") and $(basename "$devdeb"): $(ls "$TMP/debs")"
depends=$(dpkg-deb -f "$deb" Depends)
[[ $(dpkg-deb -f "$devdeb" Depends) == "trun (= $version)" ]] ||
  fail "trun-dev's Depends: $(dpkg-deb -f "$devdeb" Depends)"
dpkg-deb -x "$deb" "$TMP/root"
for f in usr/bin/trun usr/lib/libtrun_worker.so.0 usr/libexec/trun/train_mlp usr/share/doc/trun/README.md; do
  [[ -e $TMP/root/$f ]] || fail "trun's package has no /$f"
done
dpkg-deb -c "$devdeb" >"$TMP/dev.list"
for f in usr/include/trun/worker.h usr/include/trun/config.h usr/lib/libtrun_worker.so \
  usr/lib/cmake/trun/trunConfig.cmake usr/lib/pkgconfig/trun.pc; do
  grep -q " \./$f\( \|$\)" "$TMP/dev.list" || fail "trun-dev's package has no /$f"
done
# Depends covers every library the binaries name (DT_NEEDED; what those need in turn is their
# packages' business), by package; nothing from /usr/local.
for elf in "$TMP/root/usr/bin/trun" "$TMP/root/usr/lib/libtrun_worker.so.0" \
  "$TMP/root/usr/libexec/trun/train_mlp"; do
  LD_LIBRARY_PATH=$TMP/root/usr/lib ldd "$elf" >"$TMP/ldd"
  readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | while read -r soname; do
    awk -v s="$soname" '$1 == s && $2 == "=>" {print $3}' "$TMP/ldd"
  done
done | sort -u >"$TMP/libs"
# Depends' package names, one a line, without versions or alternatives' bars.
sed 's/([^)]*)//g; s/[,|]/\n/g' <<<"$depends" | tr -d ' ' | sed '/^$/d' >"$TMP/depends"
while read -r lib; do
  [[ $lib == "$TMP"/* ]] && continue # the package's own libtrun_worker
  [[ $lib == /usr/local/* ]] && fail "a binary links $lib, which no Debian package provides"
  pkg=$(dpkg -S "$lib" 2>/dev/null | head -1 | cut -d: -f1) ||
    pkg=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null | head -1 | cut -d: -f1) || true
  [[ -n $pkg ]] || fail "no Debian package provides $lib"
  # The package, or a name it Provides (libspdlog1.10 provides libspdlog1.10-fmt9, which its
  # shlibs file names).
  names=("$pkg")
  read -r -a provides <<<"$(dpkg-query -W -f='${Provides}' "$pkg" | sed 's/([^)]*)//g; s/,/ /g')"
  names+=("${provides[@]}")
  found=0
  for n in "${names[@]}"; do
    if grep -qxF -- "$n" "$TMP/depends"; then found=1; fi
  done
  ((found)) || fail "$lib is from $pkg, which trun's Depends misses: $depends"
done <"$TMP/libs"
echo "Depends covers the $(wc -l <"$TMP/libs") libraries the binaries name: $depends"

# ---- 2. installed with apt into a fresh Debian 12 root
command -v podman >/dev/null || skip setup "podman is not installed (scripts/setup.sh installs it)"
[[ $(id -u) == 0 ]] || skip setup "not root: podman runs as root here"
base=${TRUN_BASE_IMAGE:-localhost/trun-base:bookworm}
podman image exists "$base" || fail "no base image $base: the container.build test makes it"
cp "$deb" "$devdeb" "$TMP/"
cat >"$TMP/inside.sh" <<'INSIDE'
set -eu
export DEBIAN_FRONTEND=noninteractive
cd /pkg
echo "== apt-get install ./trun_*.deb ./trun-dev_*.deb (and g++, cmake, make for the SDK check)"
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends ./trun_*.deb ./trun-dev_*.deb g++ cmake make >/tmp/apt.log 2>&1 ||
  { tail -30 /tmp/apt.log; exit 1; }
dpkg -L trun trun-dev | sort -u >/tmp/files
echo "== trun --version"
trun --version
echo "== the demo's training on 2 workers"
trun --standalone --nproc-per-node=2 /usr/libexec/trun/train_mlp --epochs 2 --ckpt-dir /tmp/ckpt >/tmp/demo.log 2>&1 ||
  { tail -30 /tmp/demo.log; exit 1; }
grep "done: .* world size 2" /tmp/demo.log
echo "== a program built with find_package(trun)"
cmake -S /consumer -B /tmp/consumer-build >/tmp/cmake.log 2>&1 && cmake --build /tmp/consumer-build >>/tmp/cmake.log 2>&1 ||
  { tail -30 /tmp/cmake.log; exit 1; }
trun --standalone --nproc-per-node=2 /tmp/consumer-build/consumer >/tmp/consumer.log 2>&1 ||
  { tail -30 /tmp/consumer.log; exit 1; }
grep "consumer rank" /tmp/consumer.log
echo "== apt-get purge trun trun-dev"
apt-get purge -y -q trun trun-dev >/tmp/purge.log 2>&1 || { tail -30 /tmp/purge.log; exit 1; }
left=0
while read -r f; do
  # Directories other packages share (/usr, /usr/bin) stay; every file and link must be gone.
  if [ -e "$f" ] && [ ! -d "$f" ] || [ -L "$f" ]; then echo "left behind: $f"; left=1; fi
  if [ -d "$f" ] && [ -z "$(ls -A "$f")" ]; then echo "empty directory left behind: $f"; left=1; fi
done </tmp/files
[ "$left" = 0 ] || exit 1
if [ -e /usr/bin/trun ]; then echo "/usr/bin/trun is still there"; exit 1; fi
echo "purged: none of the $(wc -l </tmp/files) paths the packages installed is left"
INSIDE
STARTED=1
start=$SECONDS
bash "$SRC/scripts/container.sh" podman run --name "$NAME" --rm -v "$TMP:/pkg:ro" \
  -v "$SRC/examples/find_package_consumer:/consumer:ro" --entrypoint sh "$base" /pkg/inside.sh \
  >"$TMP/inside.log" 2>&1 || fail "in a fresh Debian 12 root: $(cat "$TMP/inside.log")"
STARTED=0
cat "$TMP/inside.log"
grep -q "consumer rank 1/2" "$TMP/inside.log" || fail "the find_package(trun) program did not run on 2 ranks"
echo "install, demo, SDK build and purge in a fresh root: $((SECONDS - start)) s"
echo "PASS: package.deb"
