#pragma once
// The entry point of a C++ worker in a trun (or torchrun) job.
//
//   auto worker = trun::worker::init();            // reads the environment the agent set
//   auto& pg = worker.process_group();             // the default group over all ranks
//   pg.allreduce(grads.data(), grads.size(), trun::worker::DataType::kFloat32);
//
// Environment (set by the agent, as torchrun does): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
// (the agent's store, or with TORCHELASTIC_USE_AGENT_STORE=False where rank 0 hosts the job's
// store), LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
// ROLE_NAME, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE, and
// TRUN_STORE_TOKEN when the store requires authentication. TRUN_STORE_DIALECT (auto, trun,
// torch2, torch1.13; default auto) names the store's protocol when the probe should be skipped
// (docs/worker_sdk.md); the agent does not set it. With none of RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT set, the worker is a world of size 1 (logged once on stderr). With
// some set but not all, or a malformed value, init throws EnvError naming the variable.
//
// Thread safety: a Worker (and its copies, which share its store, default group and group
// numbering) may be used from several threads at once: its accessors read state fixed by init(),
// and new_group() calls run one at a time. See ProcessGroup for the groups' rules.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "rendezvous/store/store.h"
#include "rendezvous/store/tcp_store.h"
#include "trun/process_group.h"

namespace trun::worker {

// A missing, partial or malformed environment. The message names the variable and its value.
class EnvError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What the agent told this worker. Terms as in torchrun: `rank` is global, `local_rank` within
// this node, `group_rank` is the node's index among the nodes (group_world_size of them).
struct WorkerEnv {
  bool standalone = true;  // no launcher environment: a world of size 1
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int group_rank = 0;
  int group_world_size = 1;
  int role_rank = 0;
  std::string role_name = "default";
  std::string master_addr;
  uint16_t master_port = 0;
  int restart_count = 0;
  std::string run_id = "none";
  std::string error_file;   // empty: not set
  std::string store_token;  // empty: the store does not authenticate
  // TORCHELASTIC_USE_AGENT_STORE: true (or unset) when MASTER_ADDR/PORT is the agent's store;
  // "False" (torchrun's c10d backend) means rank 0 hosts the job's store on MASTER_PORT, as
  // PyTorch's env:// initialization does, and the other ranks connect to it.
  bool use_agent_store = true;
  // TRUN_STORE_DIALECT: how to talk to MASTER_ADDR/PORT's store. kAuto probes on connect: trun's
  // agent store, PyTorch 2.x's and PyTorch 1.13's (a foreign torchrun's agent store) all work.
  // Ignored when rank 0 hosts the store itself (use_agent_store false): that store is trun's.
  rendezvous::StoreDialect store_dialect = rendezvous::StoreDialect::kAuto;

  // Reads the process environment. Throws EnvError.
  static WorkerEnv from_environment();
  // Same, reading variables through `lookup` (nullptr: unset). For tests.
  static WorkerEnv parse(const std::function<const char*(const char*)>& lookup);
};

struct InitOptions {
  Backend backend = Backend::kAuto;
  // Deadline for connecting to the store, building groups, and each collective.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Install the error-file writer (trun/error_file.h) when TORCHELASTIC_ERROR_FILE is set.
  bool install_error_handler = true;
  // Build the default process group in init() (a collective over all ranks).
  bool create_default_group = true;
  // NCCL groups built by init() and new_group(): see ProcessGroupOptions::cuda_stream.
  void* cuda_stream = nullptr;
};

class Worker {
 public:
  const WorkerEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  // The job's store (the agent's, or the one rank 0 hosts: see WorkerEnv::use_agent_store),
  // namespaced for this job's run id; nullptr when standalone.
  const std::shared_ptr<rendezvous::Store>& store() const { return store_; }
  // The default group (CollectiveError if init() was told not to create one).
  ProcessGroup& process_group();
  // A new group over all ranks, with its own keys and segments. Collective: every rank must
  // call it, in the same order relative to other new_group calls: the k-th call on one rank
  // builds a group with the k-th call on every other rank. Calls from several threads (or
  // copies) at once are safe: they run one at a time, each building its group (a collective,
  // bounded by InitOptions::timeout) before the next starts, so they cannot hold one another up
  // across ranks. Which thread's call is the k-th then depends on timing, so the threads' groups
  // pair up across ranks arbitrarily: do that only with interchangeable calls (same backend,
  // groups used alike).
  std::unique_ptr<ProcessGroup> new_group(Backend backend = Backend::kAuto);

 private:
  friend Worker init(const InitOptions& options);
  Worker() = default;
  WorkerEnv env_;
  InitOptions options_;
  std::shared_ptr<void> hosted_store_;  // rank 0's StoreServer when !env_.use_agent_store
  std::shared_ptr<rendezvous::Store> store_;
  std::shared_ptr<ProcessGroup> default_group_;
  struct Groups;  // new_group's numbering and lock, shared by copies (worker.cpp)
  std::shared_ptr<Groups> groups_;
};

// Reads the environment, connects to the agent's store (bounded by options.timeout) and builds
// the default group. Throws EnvError, rendezvous::StoreError, CollectiveError.
Worker init(const InitOptions& options = {});

}  // namespace trun::worker
