#include "rendezvous/static_rendezvous.h"

#include <optional>

#include <spdlog/spdlog.h>

#include "rendezvous/c10d/backend.h"
#include "rendezvous/round_rendezvous.h"
#include "store/prefix_store.h"

namespace trun::rendezvous {
Participant parse_static_node(const std::string& value) {
  const auto space = value.find(' ');
  return {value.substr(0, space), space == std::string::npos ? "" : value.substr(space + 1)};
}

namespace {

using namespace dynamic;

// "trun pid 1234 at 10.0.0.7 (node host-1234-ab12cd)" from a node's "node_id local_addr"; the
// default node id is host-pid-suffix (default_node_id()).
std::string describe_node(const std::string& value) {
  const auto [id, addr] = parse_static_node(value);
  const auto last = id.rfind('-');
  const auto before =
      last == std::string::npos || last == 0 ? std::string::npos : id.rfind('-', last - 1);
  std::string pid;
  if (before != std::string::npos) pid = id.substr(before + 1, last - before - 1);
  const bool numeric = !pid.empty() && pid.find_first_not_of("0123456789") == std::string::npos;
  if (!numeric) return id + (addr.empty() ? "" : " (" + addr + ")");
  return "trun pid " + pid + (addr.empty() ? "" : " at " + addr) + " (node " + id + ")";
}

std::string duplicate_rank(int rank, const std::string& holder, const std::string& me) {
  return "--node-rank=" + std::to_string(rank) +
         " was given to two nodes: " + describe_node(holder) + " and " + describe_node(me) +
         " (give every node its own --node-rank)";
}

class StaticRendezvous : public RoundRendezvous {
 public:
  StaticRendezvous(RendezvousOptions options, std::unique_ptr<RendezvousBackend> backend,
                   std::unique_ptr<store::StoreServer> hosted, Endpoint master)
      : RoundRendezvous("static", std::move(options), std::move(backend), std::move(hosted)),
        keys_(options_.run_id),
        master_(std::move(master)) {}
  ~StaticRendezvous() override { shutdown(); }

  bool is_closed() override {
    check_not_shut_down();
    try {
      return backend_->try_get(keys_.closed()).has_value();
    } catch (const store::StoreError& e) {
      throw RendezvousError(error_prefix() + ": " + e.what());
    }
  }
  int num_nodes_waiting() override { return 0; }

 protected:
  std::string over_key(int64_t k) const override { return keys_.over(k); }

  void close_rendezvous(int64_t current, int64_t joining) override {
    backend_->set(keys_.closed(), "1");
    if (current >= 0) backend_->compare_set(keys_.all(current + 1), "", "closed");
    if (joining >= 0) backend_->compare_set(keys_.all(joining), "", "closed");
  }

  RendezvousInfo join_round(int64_t last_round, int /*last_rank*/) override {
    const auto deadline = join_deadline();
    const int64_t k = last_round + 1;
    const int world = options_.max_nodes;
    const int rank = options_.node_rank;
    joining_round_ = k;
    if (backend_->try_get(keys_.closed())) throw closed_error();
    backend_->add(keys_.joined(k), 1);
    // Two nodes with the same --node-rank: the later one ends the round for everyone (it could
    // never form: another rank is missing), naming both, instead of a timeout.
    const std::string me = options_.node_id + " " + options_.local_addr;
    const std::string holder = backend_->compare_set(keys_.claim(k, rank), "", me);
    // (A holder of a round that is over is a node that has gone: the old checks below apply.)
    if (holder != me && !backend_->try_get(keys_.over(k))) {
      const std::string why = duplicate_rank(rank, holder, me);
      backend_->compare_set(keys_.all(k), "", "aborted: " + why);
      throw RendezvousError(error_prefix() + ": " + why);
    }
    arm_node_lease(k, keys_.node(k, rank), options_.node_id + " " + options_.local_addr,
                   keys_.all(k),
                   "aborted node " + options_.node_id + " (rank " + std::to_string(rank) +
                       ") left during the barrier");
    int64_t arrived = backend_->add(keys_.arrived(k), 1);
    if (arrived > world) {
      throw RendezvousError(error_prefix() + ": more than " + std::to_string(world) +
                            " nodes joined round " + std::to_string(k) +
                            " (is every --node-rank unique, and --nnodes the same everywhere?)");
    }
    // Not a plain set: a duplicate rank may have aborted the round already.
    if (arrived == world) backend_->compare_set(keys_.all(k), "", "ok");
    // Every node waits for the barrier; each says at a steady pace how many have arrived.
    std::optional<std::string> v;
    for (;;) {
      const auto left = time_left(deadline, options_.join_timeout);
      const auto progress = options_.progress_interval;
      const bool slice = progress.count() > 0 && progress < left;
      v = backend_->wait_get(keys_.all(k), slice ? progress : left);
      if (v || !slice) break;
      const int joined = static_cast<int>(backend_->add(keys_.arrived(k), 0));
      spdlog::warn("{}: {}", error_prefix(),
                   waiting_line(k, joined, world, world, std::nullopt, deadline,
                                std::chrono::steady_clock::now()));
    }
    if (!v) {
      throw RendezvousTimeoutError(error_prefix() + ": only some of the " + std::to_string(world) +
                                   " nodes arrived within " +
                                   std::to_string(options_.join_timeout.count() / 1000.0) +
                                   " s (join_timeout)");
    }
    if (*v == "closed") throw closed_error();
    if (*v != "ok") {
      // The others that joined it read this value from node 0's store too: it waits for them.
      if (server_) aborted_peers_ = static_cast<int>(backend_->add(keys_.joined(k), 0)) - 1;
      throw RendezvousError(error_prefix() + ": round " + std::to_string(k) + " " + *v);
    }
    std::vector<std::string> node_keys;
    for (int r = 0; r < world; ++r) node_keys.push_back(keys_.node(k, r));
    auto values = backend_->multi_get(node_keys, options_.read_timeout);
    RendezvousInfo info;
    info.round = k;
    info.group_rank = rank;
    info.group_world_size = world;
    std::vector<Participant> participants;
    for (auto& value : values) participants.push_back(parse_static_node(value));
    info.participants = ParticipantList(participants);
    info.key_prefix = round_store_prefix(options_.run_id, k);
    info.run_store = backend_->agent_store();
    info.store = std::make_shared<store::PrefixStore>(info.key_prefix, info.run_store);
    info.master_addr = master_.host;
    info.master_port = server_ ? server_->port() : master_.port;
    info.use_agent_store = true;
    return info;
  }

 private:
  RendezvousClosedError closed_error() const {
    return RendezvousClosedError(error_prefix() + " is closed: the job has finished");
  }

  StaticKeys keys_;
  Endpoint master_;
};

}  // namespace

std::unique_ptr<RendezvousHandler> create_static_rendezvous(const RendezvousOptions& options) {
  RendezvousOptions o = options;
  validate_common_options(o, "static");
  const std::string b = "--rdzv-backend=static: ";
  if (o.min_nodes != o.max_nodes) {
    throw RendezvousOptionError(b + "--nnodes=" + std::to_string(o.min_nodes) + ":" +
                                std::to_string(o.max_nodes) +
                                ": a static rendezvous needs a fixed node count (use c10d for a "
                                "range)");
  }
  const int world = o.max_nodes;
  if (o.node_rank < 0 || o.node_rank >= world) {
    throw RendezvousOptionError(b + "--node-rank=" + std::to_string(o.node_rank) +
                                (o.node_rank < 0 ? " is required" : " is outside") + " (0.." +
                                std::to_string(world - 1) + ")");
  }
  Endpoint master;
  if (!o.master_addr.empty() || o.master_port >= 0 || o.endpoint.empty()) {
    master.host = o.master_addr.empty() ? "127.0.0.1" : o.master_addr;
    if (o.master_port > 65535) {
      throw RendezvousOptionError(b + "--master-port=" + std::to_string(o.master_port) +
                                  ": not a port");
    }
    master.port = static_cast<uint16_t>(o.master_port >= 0 ? o.master_port : 29500);
  } else {
    master = parse_endpoint(o.endpoint, 29500, "--rdzv-endpoint");
  }
  if (master.port == 0 && world > 1) {
    throw RendezvousOptionError(b + "--master-port=0 (a free port) only works on a single node");
  }
  if (o.node_id.empty()) o.node_id = default_node_id();
  if (o.local_addr.empty()) o.local_addr = default_local_addr();
  std::unique_ptr<store::StoreServer> server;
  std::optional<RendezvousError> cannot_host;
  if (o.node_rank == 0) {
    try {
      server = host_store(master, o.store_token, /*forced=*/true, "static");
    } catch (const RendezvousError& e) {
      cannot_host = e;  // perhaps another node 0 of this job holds the port: asked below
    }
  }
  StoreBackendOptions bo;
  bo.host = master.host;
  bo.port = server ? server->port() : master.port;
  bo.token = o.store_token;
  bo.read_timeout = o.read_timeout;
  // Other nodes may start long before node 0: wait for its store as long as for a round (the
  // first round's deadline covers both).
  bo.connect_timeout = start_first_round(&o, o.node_rank == 0 ? o.read_timeout : o.join_timeout);
  std::unique_ptr<RendezvousBackend> backend;
  const StaticKeys keys(o.run_id);
  const std::string me = o.node_id + " " + o.local_addr;
  if (cannot_host) {
    // A store holds the port. If it is this job's, hosted by a node 0, two nodes were given
    // --node-rank=0: say so, and end the first round for the others too (a no-op once it has
    // formed: a running job is not disturbed by a mistaken extra node).
    std::optional<std::string> holder;
    try {
      bo.connect_timeout = std::chrono::seconds(2);
      bo.read_timeout = std::chrono::seconds(5);
      backend = connect_store_backend(bo);
      // Node 0 names itself just after it starts listening: wait that long, not more.
      holder = backend->wait_get(keys.host(), std::chrono::seconds(2));
      if (holder) {
        backend->compare_set(keys.all(0), "", "aborted: " + duplicate_rank(0, *holder, me));
      }
    } catch (const store::StoreError&) {
      // Not a trun store, or not reachable: the bind error is the one to report.
    }
    if (!holder) throw *cannot_host;
    throw RendezvousError(
        "static rendezvous '" + o.run_id + "': " + duplicate_rank(0, *holder, me) +
        "; the first hosts the store at " + master.host + ":" + std::to_string(master.port));
  }
  try {
    backend = connect_store_backend(bo);
    if (server) backend->set(keys.host(), me);
  } catch (const store::StoreError& e) {
    throw RendezvousError("static rendezvous '" + o.run_id +
                          "': cannot reach node 0's store: " + e.what());
  }
  return std::make_unique<StaticRendezvous>(std::move(o), std::move(backend), std::move(server),
                                            master);
}

}  // namespace trun::rendezvous
