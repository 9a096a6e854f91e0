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
#include <cstdint>
#include <memory>
#include <string>

#include "rendezvous/handler.h"

namespace trun::rendezvous {

// The static protocol's keys (read by `trun status` too). Every key of one run lives under
// "trun/static/<run_id>/"; round k's under "trun/static/<run_id>/<k>/".
struct StaticKeys {
  std::string base;
  explicit StaticKeys(const std::string& run_id) : base("trun/static/" + run_id) {}
  std::string closed() const { return base + "/closed"; }
  // Node 0's "node_id local_addr", set once it hosts the store: a second node 0 names it.
  std::string host() const { return base + "/host"; }
  // Who holds a rank in round k ("node_id local_addr"): taken once, so a duplicate is seen.
  std::string claim(int64_t k, int rank) const { return r(k) + "/claim/" + std::to_string(rank); }
  std::string r(int64_t k) const { return base + "/" + std::to_string(k); }
  std::string arrived(int64_t k) const { return r(k) + "/arrived"; }
  // Every node that starts joining round k, duplicates included (arrived counts only claims).
  std::string joined(int64_t k) const { return r(k) + "/joined"; }
  std::string all(int64_t k) const { return r(k) + "/all"; }
  std::string node(int64_t k, int rank) const { return r(k) + "/node/" + std::to_string(rank); }
  std::string over(int64_t k) const { return r(k) + "/over"; }
};

// A static node's "node_id local_addr" value (claims, node keys, host) read back; addr is empty
// when the value has none.
Participant parse_static_node(const std::string& value);

// Registry entry "static": options.max_nodes nodes (min_nodes must equal it), options.node_rank,
// options.master_addr/master_port (falling back to options.endpoint, then 127.0.0.1:29500).
std::unique_ptr<RendezvousHandler> create_static_rendezvous(const RendezvousOptions& options);

}  // namespace trun::rendezvous
