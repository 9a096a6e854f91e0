#pragma once
// Worker ranks from a completed rendezvous round, as torchelastic assigns them: global ranks are
// handed out in group-rank order (node 0's workers first), role ranks among the nodes of the same
// role. Rank terms are defined in docs/rank-terms.md.
//
// Two parts: compute_ranks() is pure; assign_ranks() first exchanges every node's (role, local
// world size) through the round's store (keys "role_info/<group rank>"), then computes. A single
// node, or a round without a store, exchanges nothing.
//
// Thread safety: no shared state; assign_ranks() blocks on the store for at most `timeout`.

#include <chrono>
#include <string>
#include <vector>

#include "rendezvous/handler.h"

namespace trun::agent {

// What one node of the round runs.
struct NodeRoleInfo {
  int group_rank = 0;
  std::string role;
  int nproc = 0;  // its local world size
};

struct Ranks {
  std::vector<int> global;  // by local rank
  std::vector<int> role;    // by local rank
  int world_size = 0;
  int role_world_size = 0;
};

// Ranks of this node (`group_rank`, running `nproc` workers of `role`) among `nodes`, which
// lists every node of the round once (this one included), in any order.
Ranks compute_ranks(const std::vector<NodeRoleInfo>& nodes, int group_rank, const std::string& role,
                    int nproc);

// The on-the-wire form of a node's entry ("<role>\n<nproc>") and its parser. parse_role_info
// throws rendezvous::RendezvousError naming the node when `value` is malformed.
std::string format_role_info(const std::string& role, int nproc);
NodeRoleInfo parse_role_info(int group_rank, const std::string& value);

// Publishes this node's entry in info.store, waits up to `timeout` for every node's, and returns
// compute_ranks() over them. Throws rendezvous::RendezvousError on a malformed entry and the
// store's errors (StoreTimeoutError when a node's entry did not arrive in time).
Ranks assign_ranks(const rendezvous::RendezvousInfo& info, const std::string& role, int nproc,
                   std::chrono::milliseconds timeout);

}  // namespace trun::agent
