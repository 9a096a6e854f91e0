#include "trun/worker.h"

#include <cstdio>
#include <mutex>

#include "rendezvous/shm_names.h"
#include "rendezvous/store/prefix_store.h"
#include "rendezvous/store/server.h"
#include "rendezvous/store/tcp_store.h"
#include "trun/error_file.h"

namespace trun::worker {

// new_group builds one group at a time per process: the Worker's store is one connection whose
// calls are serialized, so two groups under construction at once could each block it in a wait
// for keys that the other rank's thread, stuck behind its own wait, has not written yet.
struct Worker::Groups {
  std::mutex mu;
  int next = 0;  // under mu
};

Worker init(const InitOptions& options) {
  Worker w;
  w.env_ = WorkerEnv::from_environment();
  w.options_ = options;
  if (options.install_error_handler && !w.env_.error_file.empty())
    install_error_handler(w.env_.error_file);
  if (w.env_.standalone) {
    std::fprintf(stderr,
                 "[trun.worker] RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set: "
                 "not launched by trun, running as a world of size 1\n");
  } else {
    if (!w.env_.use_agent_store && w.env_.rank == 0) {
      // The agent's store is not for workers (torchrun's c10d backend): rank 0 hosts the job's
      // store on MASTER_PORT, on every address, as PyTorch's env:// initialization does.
      rendezvous::StoreServerOptions server_options;
      server_options.host = "0.0.0.0";
      server_options.port = w.env_.master_port;
      server_options.token = w.env_.store_token;
      std::shared_ptr<rendezvous::StoreServer> server =
          rendezvous::StoreServer::start(server_options);
      w.hosted_store_ = server;
    }
    rendezvous::TcpStoreOptions so;
    so.host = w.env_.master_addr;
    so.port = w.env_.master_port;
    so.timeout = options.timeout;
    so.connect_timeout = options.timeout;
    so.token = w.env_.store_token;
    // The store rank 0 hosts is trun's; the agent's may be trun's or a foreign torchrun's
    // (PyTorch 1.13 or 2.x), which the probe tells apart.
    so.dialect = w.env_.use_agent_store ? w.env_.store_dialect : rendezvous::StoreDialect::kTrun;
    auto base = std::make_shared<rendezvous::TcpStore>(so);
    w.store_ = std::make_shared<rendezvous::PrefixStore>("trun/worker/" + w.env_.run_id, base);
  }
  w.groups_ = std::make_shared<Worker::Groups>();
  if (options.create_default_group) w.default_group_ = w.new_group(options.backend);
  return w;
}

ProcessGroup& Worker::process_group() {
  if (!default_group_)
    throw CollectiveError("no default process group: init() ran with create_default_group=false");
  return *default_group_;
}

std::unique_ptr<ProcessGroup> Worker::new_group(Backend backend) {
  // Threads (and copies of this Worker) may call new_group at the same time: see Groups.
  std::lock_guard<std::mutex> lock(groups_->mu);
  const int n = groups_->next++;
  const std::string round =
      "restart" + std::to_string(env_.restart_count) + "/pg" + std::to_string(n);
  ProcessGroupOptions o;
  if (store_) o.store = std::make_shared<rendezvous::PrefixStore>(round, store_);
  o.rank = env_.rank;
  o.world_size = env_.world_size;
  o.node_rank = env_.group_rank;
  o.local_rank = env_.local_rank;
  o.backend = backend == Backend::kAuto ? options_.backend : backend;
  o.timeout = options_.timeout;
  // Shared-memory segment names: the agent removes leftovers by the same rule.
  o.tag = rendezvous::shm_group_tag(env_.run_id, env_.restart_count, n);
  o.gloo_peer_hint = env_.master_addr;
  o.cuda_stream = options_.cuda_stream;
  return std::make_unique<ProcessGroup>(std::move(o));
}

}  // namespace trun::worker
