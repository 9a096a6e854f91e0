#pragma once
// The static rendezvous: a fixed number of nodes with fixed ranks (torchrun's default backend),
// behind the same RendezvousHandler as the dynamic one, push notifications included.
//
// Node 0 hosts the store on master_addr:master_port (port 0 picks a free one, single node only);
// every node connects to it. Each round is a barrier of all nodes (so a restart happens on every
// node together); workers use the agent's store (use_agent_store). Node failures are reported
// through the same lease as the dynamic backend, so a dead node ends the round for the others
// (kNodeLeft) -- but the group cannot shrink: the next round waits for all nodes again.
//
// Errors: RendezvousOptionError for a missing/invalid --node-rank or a range --nnodes;
// RendezvousError when the store cannot be hosted or reached, or a node left during the barrier.

#include <chrono>
#include <memory>
#include <string>

#include "rendezvous/handler.h"

namespace trun::rendezvous {

// Registry entry "static": options.max_nodes nodes (min_nodes must equal it), options.node_rank,
// options.master_addr/master_port (falling back to options.endpoint, then 127.0.0.1:29500).
std::unique_ptr<RendezvousHandler> create_static_rendezvous(const RendezvousOptions& options);

// The narrower options the launcher's static path uses (kept for its callers).
struct StaticRendezvousOptions {
  std::string run_id = "none";
  std::string host = "127.0.0.1";  // node 0's address; node 0 binds it
  uint16_t port = 29500;           // 0: any free port (only with world_size 1)
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // joining and reaching node 0
};
std::unique_ptr<RendezvousHandler> create_static_rendezvous(const StaticRendezvousOptions& options);

}  // namespace trun::rendezvous
