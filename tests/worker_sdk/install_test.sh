#!/usr/bin/env bash
# Installs a trun build into a temporary prefix, then builds and runs a program against the
# installed files only: once with find_package(trun) (CMake) and once with pkg-config.
# Usage: install_test.sh <trun build dir> <consumer source dir>
set -euo pipefail
build=$1
consumer=$2
tmp=$(mktemp -d /tmp/trun-install-test-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log"
for f in bin/trun lib/libtrun_worker.so include/trun/worker.h include/trun/process_group.h \
  include/trun/config.h include/trun/export.h include/trun/store/store.h \
  include/trun/store/dialect.h lib/cmake/trun/trunConfig.cmake lib/pkgconfig/trun.pc; do
  [[ -e "$tmp/prefix/$f" ]] || { echo "FAIL: $f was not installed"; exit 1; }
done
[[ -x "$tmp/prefix/bin/trun" ]] || { echo "FAIL: bin/trun is not executable"; exit 1; }

# The headers are the API only, reached as <trun/...> only: no store implementation installed,
# every include of one installed header either a standard one or <trun/...>, each header
# compiling on its own from the prefix, and include/trun itself on no consumer's include path (a
# program's own "stop.h" must not find ours).
for f in tcp_store.h prefix_store.h server.h; do
  [[ ! -e "$tmp/prefix/include/trun/store/$f" ]] || { echo "FAIL: store/$f was installed"; exit 1; }
done
bad=$(grep -rnE '^\s*#\s*include' "$tmp/prefix/include/trun" |
  grep -vE '#include <(trun/[a-z_/]+\.h|[a-z_]+)>' || true)
[[ -z $bad ]] || { echo "FAIL: installed headers include other than <std> or <trun/...>:"; echo "$bad"; exit 1; }
for h in $(cd "$tmp/prefix/include" && find trun -name '*.h' | sort); do
  echo "#include <$h>" | c++ -std=c++17 -fsyntax-only -Wall -Werror -I"$tmp/prefix/include" -x c++ - ||
    { echo "FAIL: <$h> does not compile on its own from the prefix"; exit 1; }
done
if grep -rq 'include/trun' "$tmp/prefix/lib/cmake/trun" "$tmp/prefix/lib/pkgconfig/trun.pc"; then
  echo "FAIL: include/trun is on the consumers' include path:"
  grep -rn 'include/trun' "$tmp/prefix/lib/cmake/trun" "$tmp/prefix/lib/pkgconfig/trun.pc"
  exit 1
fi

# CMake package.
cmake -S "$consumer" -B "$tmp/cmake-build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  >"$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/cmake-build" >"$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
out=$(env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u LOCAL_RANK \
  -u LOCAL_WORLD_SIZE -u GROUP_RANK LD_LIBRARY_PATH="$tmp/prefix/lib" \
  "$tmp/cmake-build/consumer" 2>&1)
echo "$out"
grep -q "consumer rank 0/1 backend cpu(local) .*avg=1$" <<<"$out" || { echo "FAIL: cmake consumer"; exit 1; }

# pkg-config.
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
# shellcheck disable=SC2046
c++ -std=c++17 "$consumer/main.cpp" -o "$tmp/pc-consumer" $(pkg-config --cflags --libs trun) \
  -Wl,-rpath,"$tmp/prefix/lib"
out=$(env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u LOCAL_RANK \
  -u LOCAL_WORLD_SIZE -u GROUP_RANK "$tmp/pc-consumer" 2>&1)
echo "$out"
grep -q "consumer rank 0/1 backend cpu(local) .*avg=1$" <<<"$out" || { echo "FAIL: pkg-config consumer"; exit 1; }
echo "PASS: installed trun works through find_package(trun) and pkg-config"
