#!/usr/bin/env bash
# Builds and runs trun's container image (the Containerfile) with podman, with no registry:
#
#   scripts/container.sh base                    make the base image (mmdebstrap) unless present
#   scripts/container.sh build [--tag T] [--from-build BUILD_DIR]
#                                                the image and the demo image (with
#                                                examples/train_mlp), from source (the
#                                                Containerfile's build stage) or from
#                                                BUILD_DIR's binaries
#   scripts/container.sh podman ARGS...          podman with this host's settings
#   scripts/container.sh clean                   remove the image and the base image
#
# The base image stands in for debian:bookworm-slim: `mmdebstrap --variant=minbase bookworm`
# from the host's configured Debian mirror (about 30 s), imported as $TRUN_BASE_IMAGE
# (localhost/trun-base:bookworm). Where a registry is reachable, TRUN_BASE_IMAGE=
# docker.io/library/debian:bookworm-slim uses the public image instead (podman pulls it).
# The image is tagged $TRUN_IMAGE (localhost/trun:<version>), or --tag; the demo image the same
# with -demo after the name (localhost/trun-demo:<version>).
#
# --from-build BUILD_DIR skips the build stage: scripts/install-runtime.sh installs BUILD_DIR's
# trun and libtrun_worker into a temporary context, and the Containerfile's `prebuilt` stage
# copies them onto the same runtime stage. The tests use it (the CI run has built trun already);
# BUILD_DIR must be a Debian 12 build, as the image's libraries are Debian 12's.
#
# Host options (docs/containers.md): scripts/containers.conf (CONTAINERS_CONF, unless set):
# podman's runc runtime with the cgroupfs manager (crun refuses hybrid cgroup hierarchies), and
# file and process limits no higher than the host's (raising RLIMIT_NOFILE is not permitted in
# some sandboxes). `scripts/container.sh podman ...` runs podman with it.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=$(bash "$REPO/scripts/version.sh")
BASE_IMAGE=${TRUN_BASE_IMAGE:-localhost/trun-base:bookworm}
IMAGE=${TRUN_IMAGE:-localhost/trun:$VERSION}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$REPO/scripts/containers.conf}

usage() {
  sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() {
  echo "container.sh: $*" >&2
  exit 1
}

need() {
  command -v "$1" >/dev/null ||
    die "$1 is not installed (scripts/setup.sh installs podman, runc and mmdebstrap)"
}

make_base() {
  need podman
  if podman image exists "$BASE_IMAGE"; then
    echo "container.sh: base image $BASE_IMAGE is present"
    return
  fi
  if [[ $BASE_IMAGE != localhost/* ]]; then
    podman pull "$BASE_IMAGE"
    return
  fi
  need mmdebstrap
  local tmp start=$SECONDS
  tmp=$(mktemp -d /tmp/trun-base-XXXXXX)
  # Not a trap: the caller's EXIT trap is its own; the directory goes on every path below.
  echo "container.sh: making $BASE_IMAGE with mmdebstrap (Debian 12 minbase)"
  # debian:bookworm-slim's dpkg filters (they stay in the image, so the runtime packages that the
  # Containerfile installs leave out their documentation and translations too): about 50 MB less.
  local slim=(
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/groff/*' --dpkgopt='path-exclude=/usr/share/lintian/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias'
  )
  # The merged-usr hook makes /bin, /lib and /sbin links into /usr itself, instead of installing
  # the usrmerge package and the Perl it needs (17 packages, about 40 MB).
  if ! mmdebstrap --quiet --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    "${slim[@]}" bookworm "$tmp/rootfs.tar" >"$tmp/log" 2>&1; then
    cat "$tmp/log" >&2
    rm -rf "$tmp"
    die "mmdebstrap failed (is a Debian mirror reachable? /etc/apt/sources.list names it)"
  fi
  if ! podman import --quiet "$tmp/rootfs.tar" "$BASE_IMAGE" >/dev/null; then
    rm -rf "$tmp"
    die "podman import failed"
  fi
  rm -rf "$tmp"
  echo "container.sh: $BASE_IMAGE made in $((SECONDS - start)) s"
}

build() {
  local from_build="" tag=$IMAGE
  while (($# > 0)); do
    case $1 in
      --from-build) from_build=${2:?--from-build needs a build directory}; shift 2 ;;
      --from-build=*) from_build=${1#*=}; shift ;;
      --tag) tag=${2:?--tag needs a name}; shift 2 ;;
      --tag=*) tag=${1#*=}; shift ;;
      *) echo "container.sh build: unknown argument $1" >&2; usage ;;
    esac
  done
  local demo_tag
  demo_tag=$(demo_name "$tag")
  make_base
  local start=$SECONDS ctx=$REPO target=runtime demo_target=demo rc=0 commit=""
  # The build stage's context has no .git: give it the checkout's commit for trun --version
  # (-modified when tracked files differ, as a build in the checkout would say).
  if git -C "$REPO" rev-parse --short=12 HEAD >/dev/null 2>&1; then
    commit=$(git -C "$REPO" rev-parse --short=12 HEAD)
    [[ -z $(git -C "$REPO" status --porcelain --untracked-files=no) ]] || commit+=-modified
  fi
  if [[ -n $from_build ]]; then
    [[ -x $from_build/launcher/trun && -x $from_build/examples/train_mlp ]] ||
      die "$from_build has no trun or train_mlp: build them first (cmake --build $from_build --target trun trun_worker train_mlp)"
    ctx=$(mktemp -d /tmp/trun-image-context-XXXXXX)
    mkdir -p "$ctx/scripts"
    cp "$REPO/scripts/runtime-packages.txt" "$ctx/scripts/"
    # The demo component: train_mlp stripped, without the build tree's RUNPATH.
    cmake --install "$from_build" --component demo --strip --prefix "$ctx/opt/demo" >/dev/null
    if ! bash "$REPO/scripts/install-runtime.sh" "$from_build" "$ctx/opt/trun" >"$ctx/install.log" 2>&1; then
      cat "$ctx/install.log" >&2
      rm -rf "$ctx"
      die "scripts/install-runtime.sh $from_build failed"
    fi
    rm -f "$ctx/install.log"
    target=prebuilt
    demo_target=prebuilt-demo
  fi
  # Two builds of one file: the second reuses every layer of the first (podman's layer cache).
  for t in "$target:$tag" "$demo_target:$demo_tag"; do
    podman build --quiet -f "$REPO/Containerfile" --target "${t%%:*}" \
      --build-arg "BUILD_BASE=$BASE_IMAGE" --build-arg "RUNTIME_BASE=$BASE_IMAGE" \
      --build-arg "TRUN_GIT_COMMIT=$commit" \
      -t "${t#*:}" "$ctx" >/dev/null || { rc=$?; break; }
  done
  [[ $ctx == "$REPO" ]] || rm -rf "$ctx"
  ((rc == 0)) || die "podman build failed (exit $rc)"
  echo "container.sh: built $tag ($(image_mb "$tag") MB) and $demo_tag ($(image_mb "$demo_tag") MB) in $((SECONDS - start)) s"
}

# The demo image's name for an image name: localhost/trun:0.1.0 -> localhost/trun-demo:0.1.0.
demo_name() {
  local name=${1%:*} tag=${1##*:}
  [[ $1 == *:* ]] || tag=latest
  echo "$name-demo:$tag"
}

image_mb() { echo $(($(podman image inspect --format '{{.Size}}' "$1") / 1000000)); }

case ${1:-} in
  base) make_base ;;
  build) shift; build "$@" ;;
  podman) shift; podman "$@" ;;
  clean)
    need podman
    for image in "$IMAGE" "$(demo_name "$IMAGE")" "$BASE_IMAGE"; do
      if podman image exists "$image"; then podman rmi "$image" >/dev/null && echo "removed $image"; fi
    done
    # The build stages that a build from source left (about 1.6 GB each, untagged; only ours).
    podman image prune -f --filter label=org.trun.stage=build >/dev/null
    ;;
  *) usage ;;
esac
