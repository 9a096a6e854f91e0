#!/usr/bin/env bash
# Installs every Debian package that trun's build, tests and benchmarks need.
# Idempotent: when everything is already installed it only runs dpkg-query (well under a second).
#   scripts/setup.sh               everything
#   scripts/setup.sh --build-only  only what building trun and libtrun_worker needs (configured
#                                  with -DTRUN_BUILD_TESTS=OFF -DTRUN_BUILD_BENCH=OFF): the
#                                  Containerfile's build stage
set -euo pipefail

# Building trun and libtrun_worker.
BUILD_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libboost-dev libboost-filesystem-dev
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev libgloo-dev libunwind-dev
)
# The tests, sanitizer builds, fuzzing and benchmarks. chromium renders `trun timeline` pages and
# prometheus (with promtool) scrapes /metrics in tests/observability; their daemons are not
# started (see the policy-rc.d guard below): the tests start their own on loopback. podman, runc
# and mmdebstrap build and run the container image (scripts/container.sh; catatonit is the
# pause process of `podman kube play`'s Pods), dpkg-dev's dpkg-shlibdeps computes the Debian
# packages' Depends (scripts/package.sh). lld links scripts/test.sh's builds (CMake TRUN_LLD).
TEST_PACKAGES=(
  clang clang-format libclang-rt-14-dev catch2 lld
  python3 python3-torch libtorch-dev python3-etcd
  etcd-server etcd-client
  iproute2 util-linux procps hyperfine
  chromium prometheus
  podman runc catatonit mmdebstrap dpkg-dev
)
# A real SLURM for tests/slurm (scripts/slurm-local.sh): installed by that script, which keeps the
# packages' postinst from starting system-wide daemons.
SLURM_PACKAGES=(slurmctld slurmd slurm-client munge)

case ${1:-} in
  "") PACKAGES=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}") ;;
  --build-only)
    PACKAGES=("${BUILD_PACKAGES[@]}")
    SLURM_PACKAGES=()
    ;;
  *)
    echo "usage: scripts/setup.sh [--build-only]" >&2
    exit 2
    ;;
esac

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${PACKAGES[@]}"; do
  installed "$p" || missing+=("$p")
done
slurm_missing=0
for p in "${SLURM_PACKAGES[@]}"; do
  installed "$p" || slurm_missing=1
done

if ((${#missing[@]} == 0 && slurm_missing == 0)); then
  echo "setup: all $((${#PACKAGES[@]} + ${#SLURM_PACKAGES[@]})) packages already installed"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  # Keep the packages' postinst (prometheus, etcd-server) from starting system-wide daemons: the
  # tests start their own, on free loopback ports. Only a guard we add is removed again.
  added_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    added_policy=1
  fi
  rc=0
  { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; } || rc=$?
  if ((added_policy)); then $SUDO rm -f /usr/sbin/policy-rc.d; fi
  if ((rc != 0)); then
    echo "setup: apt-get failed (exit $rc)" >&2
    exit "$rc"
  fi
fi
if ((slurm_missing)); then
  echo "setup: installing ${SLURM_PACKAGES[*]} (scripts/slurm-local.sh install)"
  $SUDO bash "$(dirname "$0")/slurm-local.sh" install
fi
