#pragma once
// The environment a worker process starts with: torchrun's variables (RANK, LOCAL_RANK,
// WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ...) over what trun itself inherited. Rank terms are
// defined in docs/rank-terms.md.
//
// Pure functions: no I/O, no logging, no global state (the caller reads `environ`). Thread-safe.

#include <map>
#include <string>
#include <vector>

#include "agent/launch_config.h"

namespace trun::agent {

using EnvMap = std::map<std::string, std::string>;

// "KEY=VALUE" strings (a null-terminated array, as `environ`) as a map. Entries without '=' are
// skipped; for a repeated key the last one wins.
EnvMap env_map(const char* const* env);

// What every worker of this node inherits: `parent` plus torchrun's defaults, each only where
// `parent` lacks it: OMP_NUM_THREADS=1 when there is more than one worker (the caller should
// warn: `*omp_defaulted` tells whether it was set), NCCL_ASYNC_ERROR_HANDLING=1 and
// TORCH_NCCL_ASYNC_ERROR_HANDLING=1.
EnvMap base_worker_env(EnvMap parent, int nproc_per_node, bool* omp_defaulted);

// What is the same for every worker of one attempt.
struct AttemptEnv {
  std::string run_id;
  int restart_count = 0;
  int group_rank = 0;
  int group_world_size = 1;
  int world_size = 1;
  int role_world_size = 1;
  std::string master_addr;
  int master_port = 0;
  bool use_agent_store = false;
  // TORCHELASTIC_TIMER_FILE: the watchdog FIFO trun serves (agent/file_timer_server.h). Empty:
  // the variable is left as trun inherited it (set or not), as torchrun leaves it.
  std::string timer_file;
  // TRUN_PROGRESS_SHM: the node's progress board (agent/hang_watch.h). Empty: the variable is
  // removed (an inherited one belongs to an outer trun's board).
  std::string progress_shm;
  // PYTHONFAULTHANDLER=1 unless the variable is set (an empty value keeps it off, as in Python):
  // Python workers under PyTorch's watchdog, so that an expired timer dumps their Python stacks
  // (agent/file_timer_server.h, FileTimerOptions::dump_signal).
  bool python_fault_handler = false;
};

// One worker of the attempt.
struct WorkerIdentity {
  int local_rank = 0;
  int rank = 0;
  int role_rank = 0;
  std::string error_file;  // TORCHELASTIC_ERROR_FILE
};

// The complete environment of one worker, "KEY=VALUE" sorted by key: `base` (from
// base_worker_env) with the rank variables set from `config`, `attempt` and `worker`. With
// config.virtual_local_rank, LOCAL_RANK is 0, TRUN_LOCAL_RANK the real local rank and
// CUDA_VISIBLE_DEVICES names only the worker's own device; otherwise TRUN_LOCAL_RANK is removed.
// Requires worker.local_rank < config.visible_devices.size() when that list is not empty.
std::vector<std::string> worker_env(const EnvMap& base, const LaunchConfig& config,
                                    const AttemptEnv& attempt, const WorkerIdentity& worker);

// The argv of the worker with local rank `local_rank`: `entrypoint` with torchrun's macro
// substitution (torch.distributed.elastic.utils.macros, Python's Template.safe_substitute) in
// every argument after the program: `${local_rank}` and `$local_rank` become the local rank,
// `$$` becomes `$`, any other `$...` is kept as written. The program (entrypoint[0]) is kept.
std::vector<std::string> worker_argv(const std::vector<std::string>& entrypoint, int local_rank);

}  // namespace trun::agent
