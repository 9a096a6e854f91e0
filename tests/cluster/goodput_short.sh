#!/usr/bin/env bash
# cluster.goodput_short: the CI form of scripts/bench.sh goodput (issue 39). trun only, 60 s on
# three network-namespace nodes of 2 ranks and a spare, 3 faults (a worker killed, an agent
# killed with the spare taking over, a partition healed); then the accounting must add up
# (productive + badput = wall within 1 %, "other" small), every fault must have badput, the final
# checkpoint must load and every sample be trained once per epoch over the committed steps, and
# the agents' live goodput metrics must agree with the offline accounting (15 %; absent metrics
# are a note unless GOODPUT_REQUIRE_LIVE=1). About 80 s.
# Usage: tests/cluster/goodput_short.sh BUILD_DIR
# Skips (exit 77, tests/skip.sh) without root or `ip netns`; the bench script cleans up its
# namespaces, processes and files itself (scripts/bench_goodput.sh's header).
set -euo pipefail
BIN=${1:?usage: goodput_short.sh BUILD_DIR}
SKIP_TEST_NAME="cluster.goodput_short (goodput_short.sh)"
# shellcheck source=tests/skip.sh
source "$(dirname "$0")/../skip.sh"
[[ $(id -u) == 0 ]] || skip setup "needs root to create network namespaces"
for tool in ip tc unshare curl; do
  command -v "$tool" >/dev/null || skip setup "needs $tool"
done
ip netns list >/dev/null 2>&1 || skip setup "ip netns does not work here"
for f in launcher/trun examples/train_mlp; do
  [[ -x $BIN/$f ]] || { echo "FAIL: $BIN/$f is not built"; exit 1; }
done
start=$SECONDS
GOODPUT_SKIP_CODE=77 bash "$(dirname "$0")/../../scripts/bench_goodput.sh" --short "$BIN"
echo "cluster.goodput_short: PASS in $((SECONDS - start)) s"
