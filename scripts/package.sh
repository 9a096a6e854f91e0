#!/usr/bin/env bash
# Builds trun's Debian packages:
#
#   scripts/package.sh [--from-build BUILD_DIR] [--out DIR]
#
#   trun_<version>_amd64.deb      /usr/bin/trun, libtrun_worker (/usr/lib/libtrun_worker.so.0*),
#                                 the demo program /usr/libexec/trun/train_mlp, and the docs
#                                 (/usr/share/doc/trun)
#   trun-dev_<version>_amd64.deb  the SDK: headers (/usr/include/trun), the libtrun_worker.so
#                                 link, the CMake package (find_package(trun)) and trun.pc
#
# Depends: is computed from the binaries by dpkg-shlibdeps (the Debian packages that provide the
# shared libraries they need, with the lowest versions their symbols need); trun-dev depends on
# trun of the same version. NCCL and the CUDA runtime are not Debian packages: libtrun_worker
# loads them when a program first uses the NCCL backend, so the package installs and runs on a
# machine without them (docs/worker_sdk.md).
#
# Without --from-build, a RelWithDebInfo build of the packaged targets goes to build-deb/ (a
# few minutes on 2 cores). With it, BUILD_DIR's binaries are packaged (stripped): it must be a
# build without sanitizers. The packages go to DIR (default: the current directory).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=$(bash "$REPO/scripts/version.sh")
ARCH=$(dpkg --print-architecture)
build=""
out=$PWD

die() {
  echo "package.sh: $*" >&2
  exit 1
}

while (($# > 0)); do
  case $1 in
    --from-build) build=${2:?--from-build needs a build directory}; shift 2 ;;
    --from-build=*) build=${1#*=}; shift ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (--help)" ;;
  esac
done
command -v dpkg-shlibdeps >/dev/null || die "dpkg-shlibdeps is missing (apt-get install dpkg-dev)"
mkdir -p "$out"
out=$(cd "$out" && pwd)

if [[ -z $build ]]; then
  build=$REPO/build-deb
  cmake -S "$REPO" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTRUN_BUILD_TESTS=OFF -DTRUN_BUILD_BENCH=OFF -DTRUN_WITH_TORCH=OFF >/dev/null
  cmake --build "$build" --target trun trun_worker train_mlp
fi
build=$(cd "$build" && pwd)
[[ -x $build/launcher/trun && -x $build/examples/train_mlp ]] ||
  die "$build has no launcher/trun or examples/train_mlp (cmake --build $build --target trun trun_worker train_mlp)"
if grep -q '^TRUN_SANITIZE:STRING=.\+' "$build/CMakeCache.txt"; then
  die "$build is a sanitizer build: package a plain one"
fi

stage=$(mktemp -d /tmp/trun-package-XXXXXX)
trap 'rm -rf "$stage"' EXIT
# debian/<package>/ under a source directory: where dpkg-shlibdeps looks for the packages' files
# and for the shlibs file of a library built with them.
root=$stage/src/debian/trun
dev=$stage/src/debian/trun-dev

# ---- the files: one `cmake --install`, then the SDK's part moved to trun-dev
cmake --install "$build" --prefix "$root/usr" --strip >/dev/null
cmake --install "$build" --component demo --prefix "$root/usr" --strip >/dev/null
mkdir -p "$dev/usr/lib"
mv "$root/usr/include" "$dev/usr/include"
mv "$root/usr/lib/cmake" "$root/usr/lib/pkgconfig" "$dev/usr/lib/"
mv "$root/usr/lib/libtrun_worker.so" "$dev/usr/lib/"
doc=$root/usr/share/doc/trun
install -D -m 644 "$REPO/README.md" "$doc/README.md"
cp -r "$REPO/docs" "$doc/docs"
find "$doc" -type f -exec chmod 644 {} + -o -type d -exec chmod 755 {} +
cat >"$doc/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: trun
Source: the trun repository (commit $("$build/launcher/trun" --version | sed -n 's/^commit: //p'))

Files: *
Copyright: the trun authors
License: see the repository
EOF
mkdir -p "$dev/usr/share/doc"
ln -s trun "$dev/usr/share/doc/trun-dev"

# ---- Depends: from the binaries (dpkg-shlibdeps reads debian/control for the package names).
# libtrun_worker's shlibs entry says which package provides it (train_mlp links it); -x leaves
# the package itself out of its own Depends.
printf 'Source: trun\n\nPackage: trun\nArchitecture: any\n' >"$stage/src/debian/control"
mkdir -p "$root/DEBIAN"
echo "libtrun_worker ${VERSION%%.*} trun (>= $VERSION)" >"$root/DEBIAN/shlibs"
depends=$(cd "$stage/src" && dpkg-shlibdeps -O --warnings=0 -xtrun \
  -e"$root/usr/bin/trun" -e"$(echo "$root"/usr/lib/libtrun_worker.so.*.*.*)" \
  -e"$root/usr/libexec/trun/train_mlp" 2>"$stage/shlibdeps.err" |
  sed -n 's/^shlibs:Depends=//p') || true
[[ -n $depends ]] || die "dpkg-shlibdeps found no dependencies: $(cat "$stage/shlibdeps.err")"

size_kb() { du -sk --exclude=DEBIAN "$1" | cut -f1; }
control() {  # control DIR PACKAGE DEPENDS DESCRIPTION...
  local dir=$1 pkg=$2 deps=$3
  shift 3
  mkdir -p "$dir/DEBIAN"
  {
    echo "Package: $pkg"
    echo "Version: $VERSION"
    echo "Architecture: $ARCH"
    echo "Maintainer: trun developers <trun@localhost>"
    echo "Installed-Size: $(size_kb "$dir")"
    echo "Depends: $deps"
    [[ $pkg == trun ]] && echo "Suggests: libnccl2, python3-torch"
    echo "Section: utils"
    echo "Priority: optional"
    echo "Description: $1"
    shift
    for line in "$@"; do echo " $line"; done
  } >"$dir/DEBIAN/control"
}
control "$root" trun "$depends" \
  "elastic launcher for distributed training (torchrun-compatible)" \
  "trun runs once per node, joins a rendezvous, starts and supervises the" \
  "workers with torchrun's environment and restarts the group on a failure or a" \
  "membership change. libtrun_worker gives C++ programs collectives, data-parallel" \
  "gradient averaging and checkpoints."
control "$dev" trun-dev "trun (= $VERSION)" \
  "libtrun_worker SDK: headers, CMake package and pkg-config file" \
  "Build C++ training programs against libtrun_worker: find_package(trun) and" \
  "target_link_libraries(... trun::worker), or pkg-config trun."
# The shared library's trigger: ldconfig after install and removal.
echo "activate-noawait ldconfig" >"$root/DEBIAN/triggers"

for pkg in trun trun-dev; do
  deb=$out/${pkg}_${VERSION}_${ARCH}.deb
  dpkg-deb --root-owner-group -Zxz --build "$stage/src/debian/$pkg" "$deb" >/dev/null
  echo "package.sh: $deb ($(($(stat -c %s "$deb") / 1024)) KiB)"
done
echo "package.sh: trun Depends: $depends"
