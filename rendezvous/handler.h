#pragma once
// RendezvousHandler: what the agent sees of a rendezvous (torchelastic's RendezvousHandler).
//
// A rendezvous gathers the nodes of one job and gives each its group rank and the group world
// size, plus the store every agent and worker of this round shares. Backends (static today; c10d
// and etcd later) implement this interface in their own files and are created through a factory
// taking a plain options struct.
//
// Thread safety: one handler is used by one agent thread. next_rendezvous() blocks (bounded by
// the backend's timeouts) and throws RendezvousError when the round cannot complete.

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "rendezvous/store/store.h"

namespace trun::rendezvous {

class RendezvousError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RendezvousInfo {
  // The job's shared store, already namespaced for this run; null when the group is this node
  // alone and nothing needs sharing (the agent never talks to its own store then).
  std::shared_ptr<Store> store;
  int group_rank = 0;
  int group_world_size = 1;
  // Where workers reach the store that hosts their process-group bootstrap (MASTER_ADDR/PORT).
  std::string master_addr;
  uint16_t master_port = 0;
  // True when workers should use the agent's store (TORCHELASTIC_USE_AGENT_STORE=True) rather
  // than host their own TCPStore on rank 0.
  bool use_agent_store = true;
};

class RendezvousHandler {
 public:
  virtual ~RendezvousHandler() = default;

  // Name of the backend, e.g. "static".
  virtual std::string backend() const = 0;
  // The job's run id (TORCHELASTIC_RUN_ID).
  virtual std::string run_id() const = 0;
  // Joins the next round and blocks until it completes.
  virtual RendezvousInfo next_rendezvous() = 0;
  // Nodes waiting to join a new round (a static rendezvous never has any).
  virtual int num_nodes_waiting() = 0;
  // Releases what the handler holds (stops a hosted store). Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace trun::rendezvous
