#pragma once
// The entry point of a C++ worker in a trun (or torchrun) job.
//
//   auto worker = trun::worker::init();            // reads the environment the agent set
//   auto& pg = worker.process_group();             // the default group over all ranks
//   pg.allreduce(grads.data(), grads.size(), trun::worker::DataType::kFloat32);
//
// Where the ranks and the store come from (docs/worker_sdk.md, "Environment"), as
// torch.distributed.init_process_group does, plus `srun` and `mpirun`:
//
//   init_method (InitOptions::init_method, or TRUN_INIT_METHOD when the program leaves the default
//   "env://"): "env://" (below), "tcp://host:port" (rank 0 hosts the store there, the others
//   connect) or "file:///path" (a store in a file every rank opens: store/file_store.h,
//   PyTorch's FileStore format). Rank and world size: InitOptions::rank/world_size, else the
//   URL's query (?rank=R&world_size=N; not both), else the launcher environment below.
//
//   Launcher environments, first match wins (except that an MPI world size which differs from
//   the SLURM step's, as under mpirun inside an allocation, makes mpi win over slurm):
//   - torch (trun, torchrun, or by hand): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK,
//     LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME,
//     TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID. With env://, MASTER_ADDR:MASTER_PORT is the
//     agent's store only when TORCHELASTIC_USE_AGENT_STORE=True; otherwise (unset, False) rank 0
//     hosts the store on MASTER_PORT and the others connect, as in PyTorch.
//   - slurm (plain `srun -n N prog`, inside a step: SLURM_STEP_ID set): SLURM_PROCID,
//     SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID, SLURM_NODEID,
//     SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST (first host: rank 0, unless MASTER_ADDR),
//     SLURM_JOB_ID (the port, unless MASTER_PORT: base/slurm.h; run id "slurm-<job>.<step>").
//   - mpi (`mpirun -np N`, `mpiexec`): Open MPI's OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,
//     LOCAL_SIZE}, or MPICH/Hydra's PMI_RANK, PMI_SIZE (MPI_LOCALRANKID, MPI_LOCALNRANKS). The
//     store is at MASTER_ADDR, or 127.0.0.1 when every rank is on this node; its port MASTER_PORT
//     or one derived from the MPI job id (OMPI_MCA_ess_base_jobid, OMPI_MCA_orte_ess_jobid or
//     PMIX_NAMESPACE) in 10000-31999.
//   - standalone: none of these: a world of size 1 (logged once on stderr).
// Also TORCHELASTIC_ERROR_FILE, TRUN_STORE_TOKEN when the store requires authentication, and
// TRUN_STORE_DIALECT (auto, trun, torch2, torch1.13; default auto), the agent store's protocol
// when the probe should be skipped. A partial, contradictory or malformed environment (or
// init_method) throws EnvError naming the variables; a launcher that says N > 1 never becomes a
// world of size 1.
//
// Waiting: while init() connects to the store, and while a group waits for its peers, a line on
// stderr after 5 s (then every 30 s) says what is awaited, where, and which variables decided it;
// the timeout's error says the same.
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
#include <vector>

#include <trun/export.h>
#include <trun/process_group.h>
#include <trun/store/dialect.h>
#include <trun/store/store.h>

namespace trun::worker {

// A missing, partial or malformed environment. The message names the variable and its value.
class TRUN_API EnvError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct InitOptions;

// What the launcher (trun's agent, torchrun, srun, mpirun, or the init method) told this worker.
// Terms as in torchrun: `rank` is global, `local_rank` within this node, `group_rank` is the
// node's index among the nodes (group_world_size of them).

struct TRUN_API WorkerEnv {
  bool standalone = true;  // no launcher environment and env://: a world of size 1
  // Where rank and world size came from: "torch" (RANK, WORLD_SIZE, ...), "slurm", "mpi", "tcp" /
  // "file" (InitOptions::rank/world_size or the init method's URL query), or "standalone".
  std::string launcher = "standalone";
  // The init method in effect, without its query: "env://", "tcp://host:port", "file:///path".
  std::string init_method = "env://";
  std::string store_path;  // file://: the store's file; empty otherwise
  // Which variables (or options) decided where the store is and who hosts it, for messages, e.g.
  // "MASTER_ADDR/MASTER_PORT; rank 0 hosts it: TORCHELASTIC_USE_AGENT_STORE is not True".
  std::string store_origin;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // Both -1 under mpirun across several nodes: MPI exports no node index (Open MPI's
  // OMPI_COMM_WORLD_NODE_RANK is a rank within the node), so the process groups then treat every
  // rank as a node of its own.
  int group_rank = 0;
  int group_world_size = 1;
  int role_rank = 0;
  std::string role_name = "default";
  std::string master_addr;
  uint16_t master_port = 0;
  int restart_count = 0;
  std::string run_id = "none";  // "none": nothing gave one
  std::string error_file;       // empty: not set
  std::string store_token;      // empty: the store does not authenticate
  // TORCHELASTIC_USE_AGENT_STORE=True (env:// only): MASTER_ADDR/PORT is the agent's store.
  // Otherwise (unset or False, as PyTorch reads it; and always with tcp://) rank 0 hosts the
  // job's store on master_port and the other ranks connect to it.
  bool use_agent_store = false;
  // TRUN_STORE_DIALECT: how to talk to MASTER_ADDR/PORT's store. kAuto probes on connect: trun's
  // agent store, PyTorch 2.x's and PyTorch 1.13's (a foreign torchrun's agent store) all work.
  // Ignored when rank 0 hosts the store itself (use_agent_store false): that store is trun's.
  store::StoreDialect store_dialect = store::StoreDialect::kAuto;

  // Reads the process environment with InitOptions' init method, rank and world size (default:
  // env://, from the environment). Throws EnvError.
  static WorkerEnv from_environment();
  static WorkerEnv from_environment(const InitOptions& options);
  // Same, reading variables through `lookup` (nullptr: unset). For tests.
  static WorkerEnv parse(const std::function<const char*(const char*)>& lookup);
  static WorkerEnv parse(const std::function<const char*(const char*)>& lookup,
                         const InitOptions& options);
};

struct InitOptions {
  // As torch.distributed.init_process_group's: "env://", "tcp://host:port" or "file:///path",
  // optionally with "?rank=R&world_size=N". TRUN_INIT_METHOD replaces the default "env://" (an
  // init method the program sets itself wins).
  std::string init_method = "env://";
  // -1: from the init method's query, else from the launcher environment.
  int rank = -1;
  int world_size = -1;
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

class TRUN_API Worker {
 public:
  const WorkerEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  // The job's store (the agent's, the one rank 0 hosts: see WorkerEnv::use_agent_store, or the
  // file of file://), namespaced for this job's run id; nullptr when standalone.
  const std::shared_ptr<store::Store>& store() const { return store_; }
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
  // A group over a subset of the ranks (torch.distributed.new_group(ranks)): its rank r is the
  // r-th lowest of `ranks` (they are sorted, as PyTorch does). Every rank of the job calls it
  // with the same `ranks`, in the same order relative to other new_group calls (it takes one
  // number of the same sequence); members get the group (built as a collective among them),
  // the others nullptr at once. std::invalid_argument for an empty list, a duplicate or a rank
  // outside [0, world_size()). Node placement carries over: members that share a node use
  // shared memory.
  std::unique_ptr<ProcessGroup> new_group(const std::vector<int>& ranks,
                                          Backend backend = Backend::kAuto);
  // Equal consecutive subgroups (torch.distributed.new_subgroups(group_size)): ranks
  // [0, group_size), [group_size, 2 * group_size), ...; returns this rank's. Every rank calls
  // it; it takes world_size() / group_size numbers of the new_group sequence.
  // std::invalid_argument unless group_size >= 1 divides world_size(). (PyTorch also returns
  // the list of every subgroup; here a rank holds only its own: building a group needs its
  // members.)
  std::unique_ptr<ProcessGroup> new_subgroups(int group_size, Backend backend = Backend::kAuto);

 private:
  friend Worker init(const InitOptions& options);
  friend class ResilientLoop;
  Worker() = default;
  // The resilient loop's next formation: the same environment with `generation` as the restart
  // count, the generation in the group keys and segment names, new group numbering and a new
  // default group. A store that rank 0 hosts is connected to again (rank 0 may be the replaced
  // worker, whose successor hosts a new one).
  Worker at_generation(uint64_t generation) const;
  // What names this formation's group keys and shared-memory segments: the restart count where
  // the store outlives the group (the agent's store, a file), else the board's naming (-1: none,
  // the names torchrun's workers use).
  int naming_generation() const;
  WorkerEnv env_;
  // The agent's generation (the progress board's when there is one, else the restart count):
  // it goes up when the resilient loop re-forms the group (a replaced worker, a new round).
  uint64_t generation_ = 0;
  int64_t naming_ = -1;  // the board's Formation::naming of generation_
  InitOptions options_;
  std::shared_ptr<void> hosted_store_;  // rank 0's StoreServer when it hosts the store
  std::shared_ptr<store::Store> store_;
  std::shared_ptr<ProcessGroup> default_group_;
  struct TRUN_HIDDEN Groups;  // new_group's numbering and lock, shared by copies (worker.cpp)
  std::unique_ptr<ProcessGroup> build_group(int n, const std::vector<int>& ranks, Backend backend);
  std::shared_ptr<Groups> groups_;
};

// Reads the environment, connects to the store (bounded by options.timeout) and builds the
// default group. Throws EnvError, store::StoreError (StoreTimeoutError when the store never
// answered), CollectiveError.
TRUN_API Worker init(const InitOptions& options = {});

// What `trun --version` prints, for this build of libtrun_worker: the version (TRUN_VERSION in
// trun/config.h), the git commit it was built from and the features compiled in (NCCL, the
// libtorch adapter), several lines ending in a newline. For a bug report from a worker program.
TRUN_API std::string version();

}  // namespace trun::worker
