#pragma once
// The static rendezvous: a fixed number of nodes with fixed ranks (torchrun's default backend).
//
// Node 0 hosts a StoreServer on host:port (port 0 picks a free one, single node only); every
// node's rank and the world size are given up front, so a round completes at once. With more than
// one node, each agent connects to node 0's store as a client. --standalone is this backend on
// 127.0.0.1 with a free port and a generated run id.
//
// Errors: RendezvousError when the store cannot be hosted (port taken) or reached.

#include <chrono>
#include <memory>
#include <string>

#include "rendezvous/handler.h"

namespace trun::rendezvous {

struct StaticRendezvousOptions {
  std::string run_id = "none";
  std::string host = "127.0.0.1";  // node 0's address; node 0 binds it
  uint16_t port = 29500;           // 0: any free port (only with world_size 1)
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // reaching node 0's store
};

std::unique_ptr<RendezvousHandler> create_static_rendezvous(const StaticRendezvousOptions& options);

}  // namespace trun::rendezvous
