#include "trun/worker.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>

#include "base/build_info.h"
#include "base/shm_names.h"
#include "store/file_store.h"
#include "store/prefix_store.h"
#include "store/server.h"
#include "store/tcp_store.h"
#include "trun/error_file.h"
#include "worker_sdk/src/progress/progress.h"
#include "worker_sdk/src/stop_scope.h"
#include "worker_sdk/src/waiting_store.h"

namespace trun::worker {
namespace {

std::string who(const WorkerEnv& env) {
  return "rank " + std::to_string(env.rank) + "/" + std::to_string(env.world_size);
}

// "the store at 127.0.0.1:29500 (MASTER_ADDR/MASTER_PORT; ...)", for the waiting messages.
std::string store_description(const WorkerEnv& env) {
  if (!env.store_path.empty())
    return "the store in " + env.store_path + " (" + env.store_origin + ")";
  const bool v6 = env.master_addr.find(':') != std::string::npos;
  return "the store at " + (v6 ? "[" + env.master_addr + "]" : env.master_addr) + ":" +
         std::to_string(env.master_port) + " (" + env.store_origin + ")";
}

// The job's store, before namespacing: the file of file://, else a TcpStore connected to the
// agent's store or to the one rank 0 hosts (started here, into *hosted). Connecting reports on
// stderr while it waits (detail::wait_reporting).
bool store_outlives_group(const WorkerEnv& env) {
  return env.use_agent_store || !env.store_path.empty();
}

std::shared_ptr<store::Store> open_store(const WorkerEnv& env, const InitOptions& options,
                                         std::shared_ptr<void>* hosted) {
  if (!env.store_path.empty()) {
    auto store = std::make_shared<store::FileStore>(env.store_path, env.world_size);
    store->set_timeout(options.timeout);
    return store;
  }
  if (!env.use_agent_store && env.rank == 0) {
    // Not the agent's store (torchrun's c10d backend, a hand-set env://, tcp://, srun, mpirun):
    // rank 0 hosts the job's store on the port, on every address, as PyTorch does.
    store::StoreServerOptions server_options;
    server_options.host = "0.0.0.0";
    server_options.port = env.master_port;
    server_options.token = env.store_token;
    try {
      std::shared_ptr<store::StoreServer> server = store::StoreServer::start(server_options);
      *hosted = server;
    } catch (const store::StoreError& e) {
      throw store::StoreError(who(env) + ": cannot host " + store_description(env) + ": " +
                              e.what());
    }
  }
  store::TcpStoreOptions so;
  so.host = env.master_addr;
  so.port = env.master_port;
  so.timeout = options.timeout;
  so.token = env.store_token;
  // The store rank 0 hosts is trun's; the agent's may be trun's or a foreign torchrun's
  // (PyTorch 1.13 or 2.x), which the probe tells apart.
  so.dialect = env.use_agent_store ? env.store_dialect : store::StoreDialect::kTrun;
  std::shared_ptr<store::TcpStore> store;
  detail::wait_reporting(who(env), store_description(env), options.timeout,
                         [&](std::chrono::milliseconds slice) {
                           so.connect_timeout = slice;
                           store = std::make_shared<store::TcpStore>(so);
                         });
  return store;
}

}  // namespace

// new_group builds one group at a time per process: the Worker's store is one connection whose
// calls are serialized, so two groups under construction at once could each block it in a wait
// for keys that the other rank's thread, stuck behind its own wait, has not written yet.
struct Worker::Groups {
  std::mutex mu;
  int next = 0;  // under mu
};

Worker init(const InitOptions& options) {
  // Connecting and waiting for the peers: a stop signal now ends the process (nothing to save).
  detail::DieOnStopScope die_on_stop;
  detail::progress::init_begin();  // maps the agent's progress board (TRUN_PROGRESS_SHM)
  Worker w;
  w.env_ = WorkerEnv::from_environment(options);
  w.options_ = options;
  if (options.install_error_handler && !w.env_.error_file.empty())
    install_error_handler(w.env_.error_file);
  if (w.env_.standalone) {
    std::fprintf(stderr,
                 "[trun.worker] RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set, and "
                 "there is no srun or mpirun environment: running as a world of size 1\n");
  } else {
    auto base = open_store(w.env_, options, &w.hosted_store_);
    w.store_ = std::make_shared<store::PrefixStore>("trun/worker/" + w.env_.run_id, base);
  }
  w.generation_ = static_cast<uint64_t>(w.env_.restart_count);
  if (const std::optional<uint64_t> g = detail::progress::board_generation()) {
    w.generation_ = *g;
    if (const auto f = detail::progress::board_formation(*g)) w.naming_ = f->naming;
  }
  w.groups_ = std::make_shared<Worker::Groups>();
  for (int tries = 0; options.create_default_group; ++tries) {
    try {
      w.default_group_ = w.new_group(options.backend);
      break;
    } catch (const detail::AbandonedWaitError&) {
      // A resilient loop's replacement: the agent moved to a newer generation (another failure)
      // while this process built its first groups; the others build that one's.
      const std::optional<uint64_t> g = detail::progress::board_generation();
      if (!g || *g <= w.generation_ || tries >= 100) throw;
      w.generation_ = *g;
      if (store_outlives_group(w.env_)) w.env_.restart_count = static_cast<int>(*g);
      const auto f = detail::progress::board_formation(*g);
      w.naming_ = f ? f->naming : -1;
      w.groups_ = std::make_shared<Worker::Groups>();
    }
  }
  detail::progress::init_end();
  return w;
}

Worker Worker::at_generation(uint64_t generation) const {
  detail::DieOnStopScope die_on_stop;
  // The agent may have moved on since the caller looked: the newest generation's description.
  if (const std::optional<uint64_t> g = detail::progress::board_generation(); g && *g > generation)
    generation = *g;
  Worker w;
  w.env_ = env_;
  w.env_.restart_count = static_cast<int>(generation);
  w.options_ = options_;
  w.generation_ = generation;
  w.hosted_store_ = hosted_store_;
  w.store_ = store_;
  // The agent's description of this generation: the names of its groups and, after a new round
  // formed around the running workers, this rank's new place in it.
  bool moved = false;
  if (const auto f = detail::progress::board_formation(generation)) {
    w.naming_ = f->naming;
    WorkerEnv& e = w.env_;
    moved = f->master_addr != e.master_addr || f->master_port != e.master_port;
    if (f->rank != e.rank || f->world_size != e.world_size) {
      std::fprintf(stderr, "%s: generation %llu places it as rank %d of %d\n", who(e).c_str(),
                   static_cast<unsigned long long>(generation), f->rank, f->world_size);
    }
    if (e.role_rank == e.rank) e.role_rank = f->rank;  // one role: the role rank is the rank
    e.rank = f->rank;
    e.world_size = f->world_size;
    e.group_rank = f->group_rank;
    e.group_world_size = f->group_world_size;
    e.master_addr = f->master_addr;
    e.master_port = static_cast<uint16_t>(f->master_port);
  }
  if (!store_outlives_group(w.env_) && store_) {
    // Rank 0's store. Rank 0 may have been replaced (its successor hosts a new one at the same
    // address) or, in a new round, be another process at another address: every rank connects
    // again, and a new rank 0, or rank 0 at a new address, hosts a new one.
    const bool host = w.env_.rank == 0 && (!hosted_store_ || moved);
    std::shared_ptr<void> hosted;
    if (host || !hosted_store_ || moved) {
      auto base = open_store(w.env_, options_, &hosted);
      w.store_ = std::make_shared<store::PrefixStore>("trun/worker/" + w.env_.run_id, base);
      w.hosted_store_ = host ? hosted : (w.env_.rank == 0 ? hosted_store_ : nullptr);
    }
  }
  w.groups_ = std::make_shared<Worker::Groups>();
  if (options_.create_default_group) w.default_group_ = w.new_group(options_.backend);
  return w;
}

ProcessGroup& Worker::process_group() {
  if (!default_group_)
    throw CollectiveError("no default process group: init() ran with create_default_group=false");
  return *default_group_;
}

std::unique_ptr<ProcessGroup> Worker::new_group(Backend backend) {
  std::vector<int> all(env_.world_size);
  for (int r = 0; r < env_.world_size; ++r) all[r] = r;
  // Threads (and copies of this Worker) may call new_group at the same time: see Groups.
  std::lock_guard<std::mutex> lock(groups_->mu);
  return build_group(groups_->next++, all, backend);
}

namespace {

std::vector<int> checked_members(std::vector<int> ranks, int world) {
  if (ranks.empty()) throw std::invalid_argument("new_group: the list of ranks is empty");
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= world)
      throw std::invalid_argument("new_group: rank " + std::to_string(ranks[i]) +
                                  " is outside [0, " + std::to_string(world) + ")");
    if (i && ranks[i] == ranks[i - 1])
      throw std::invalid_argument("new_group: rank " + std::to_string(ranks[i]) +
                                  " is listed twice");
  }
  return ranks;
}

}  // namespace

std::unique_ptr<ProcessGroup> Worker::new_group(const std::vector<int>& ranks, Backend backend) {
  std::vector<int> members = checked_members(ranks, env_.world_size);
  std::lock_guard<std::mutex> lock(groups_->mu);
  return build_group(groups_->next++, members, backend);
}

std::unique_ptr<ProcessGroup> Worker::new_subgroups(int group_size, Backend backend) {
  if (group_size < 1 || env_.world_size % group_size != 0)
    throw std::invalid_argument("new_subgroups: group size " + std::to_string(group_size) +
                                " does not divide the world size " +
                                std::to_string(env_.world_size));
  std::lock_guard<std::mutex> lock(groups_->mu);
  const int first = groups_->next;
  groups_->next += env_.world_size / group_size;
  const int mine = env_.rank / group_size;
  std::vector<int> members(group_size);
  for (int i = 0; i < group_size; ++i) members[i] = mine * group_size + i;
  return build_group(first + mine, members, backend);
}

// The agent's store (and a file store) outlives an attempt: the restart count keeps a re-created
// group from old keys. A store hosted by rank 0 is new with every group, and the restart count is
// not the group's but each agent's (a node that joins after the others spent restarts has 0; with
// it in the prefix the ranks would never meet), so it is left out there; within one group the
// resilient loop's generations (the same on every node: agent/agent_replace.cpp) keep the keys
// of its formations apart.
int Worker::naming_generation() const {
  if (store_outlives_group(env_)) return env_.restart_count;
  return naming_ < 0 || naming_ > INT_MAX ? -1 : static_cast<int>(naming_);
}

// Builds group number `n` over `members` (sorted, valid); nullptr when this rank is not one.
std::unique_ptr<ProcessGroup> Worker::build_group(int n, const std::vector<int>& members,
                                                  Backend backend) {
  auto me = std::find(members.begin(), members.end(), env_.rank);
  if (me == members.end()) return nullptr;
  const int naming = naming_generation();
  const std::string round = (naming < 0                   ? std::string()
                             : store_outlives_group(env_) ? "restart" + std::to_string(naming) + "/"
                                                          : "gen" + std::to_string(naming) + "/") +
                            "pg" + std::to_string(n);
  ProcessGroupOptions o;
  if (store_) {
    // Waiting for the other ranks says so on stderr (detail::WaitingStore).
    // A resilient loop's agent that moved to a newer generation meanwhile (another failure) has
    // the peers build that one's groups: waiting for this one's would last until the timeout.
    std::function<std::string()> abandon;
    if (detail::progress::board_generation()) {
      abandon = [generation = generation_]() -> std::string {
        const std::optional<uint64_t> g = detail::progress::board_generation();
        if (!g || *g <= generation) return {};
        return "the agent moved on to generation " + std::to_string(*g) + " (this group is of " +
               std::to_string(generation) + ")";
      };
    }
    o.store = std::make_shared<detail::WaitingStore>(
        std::make_shared<store::PrefixStore>(round, store_), who(env_),
        "the other ranks to build process group " + std::to_string(n), store_description(env_),
        std::move(abandon));
  }
  o.rank = static_cast<int>(me - members.begin());
  o.world_size = static_cast<int>(members.size());
  // group_rank -1 (mpirun across nodes): placement unknown, each rank a node of its own.
  o.node_rank = env_.group_rank;
  o.local_rank = env_.group_rank < 0 ? -1 : env_.local_rank;
  o.backend = backend == Backend::kAuto ? options_.backend : backend;
  o.timeout = options_.timeout;
  // Shared-memory segment names: the agent removes leftovers by the same rule.
  o.tag = base::shm_group_tag(env_.run_id, naming < 0 ? env_.restart_count : naming, n);
  o.gloo_peer_hint = env_.master_addr;
  o.cuda_stream = options_.cuda_stream;
  return std::make_unique<ProcessGroup>(std::move(o));
}

std::string version() { return base::version_text(); }

}  // namespace trun::worker
