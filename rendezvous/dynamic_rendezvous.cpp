#include "rendezvous/dynamic_rendezvous.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "rendezvous/c10d/backend.h"
#include "rendezvous/c10d/failover.h"
#include "rendezvous/etcd/backend.h"
#include "rendezvous/round_leader.h"
#include "rendezvous/round_rendezvous.h"
#include "store/prefix_store.h"

namespace trun::rendezvous {
namespace {

using namespace dynamic;
constexpr uint16_t kDefaultPort = 29400;     // torchrun's c10d default
constexpr uint16_t kDefaultEtcdPort = 2379;  // etcd's client port

// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
std::vector<std::string> split_endpoint_list(const std::string& text) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    out.push_back(text.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

class DynamicRendezvous : public RoundRendezvous {
 public:
  DynamicRendezvous(std::string name, RendezvousOptions options,
                    std::unique_ptr<RendezvousBackend> backend,
                    std::unique_ptr<store::StoreServer> hosted)
      : RoundRendezvous(std::move(name), std::move(options), std::move(backend), std::move(hosted)),
        keys_(options_.run_id) {}

  ~DynamicRendezvous() override { shutdown(); }

  std::string store_endpoint() const override {
    return backend_->name() == "c10d" ? options_.endpoint : std::string();
  }

  // c10d only: etcd keeps its state in etcd, which no node hosts.
  std::unique_ptr<StoreFailover> recover_lost_store(const LostStore& lost) override {
    if (backend_->name() != "c10d") return nullptr;
    return start_c10d_failover(options_, store_endpoint(), lost);
  }

  bool store_host_left(const RoundEvent& event, const ParticipantList& members) const override {
    if (event.kind != RoundEvent::Kind::kNodeLeft || members.empty()) return false;
    const int host = store_host_rank(members);
    return host >= 0 && event.node_id == members.at(host).node_id &&
           planned_leave({event.kind, event.node_id, event.detail});
  }

  bool is_closed() override {
    check_not_shut_down();
    try {
      auto v = backend_->try_get(keys_.round());
      return v && parse_round_key(*v).closed;
    } catch (const store::StoreError& e) {
      throw RendezvousError(error_prefix() + ": " + e.what());
    }
  }

  std::vector<std::string> waiting_node_ids(int limit) override {
    check_not_shut_down();
    std::vector<std::string> ids;
    try {
      const auto [round, tickets] = gathering_round();
      const int64_t n = std::min<int64_t>(tickets, limit);
      for (int64_t t = 1; t <= n; ++t) {
        // A ticket whose node has not published itself yet is skipped (no wait).
        if (auto desc = backend_->try_get(keys_.node(round, t))) {
          ids.push_back(decode_node(*desc, t).id);
        }
      }
    } catch (const store::StoreError& e) {
      throw RendezvousError(error_prefix() + ": " + e.what());
    }
    return ids;
  }

  int nodes_in_round_after(int64_t round) override {
    check_not_shut_down();
    try {
      auto v = backend_->try_get(keys_.round());
      if (!v) return 0;
      const auto rk = parse_round_key(*v);
      if (rk.closed) return 0;
      // The round being gathered may have formed already; else the one before it.
      for (int64_t k = rk.round; k > round && k >= rk.round - 1; --k) {
        auto text = backend_->try_get(keys_.result(k));
        if (!text) continue;
        const RoundResult r = decode_result(*text);
        if (r.kind == RoundResult::Kind::kComplete) return r.world_size;
      }
      return 0;
    } catch (const store::StoreError& e) {
      throw RendezvousError(error_prefix() + ": " + e.what());
    }
  }

  int num_nodes_waiting() override {
    check_not_shut_down();
    try {
      return static_cast<int>(gathering_round().second);
    } catch (const store::StoreError& e) {
      throw RendezvousError(error_prefix() + ": " + e.what());
    }
  }

 protected:
  std::string over_key(int64_t k) const override { return keys_.over(k); }

  // The round nodes are joining now and its tickets so far, the nodes waiting for it: {-1, 0}
  // when there is none (closed), or it has a result (it formed, or ended before it formed: its
  // tickets wait for nothing). Throws the backend's store::StoreError.
  std::pair<int64_t, int64_t> gathering_round() {
    auto v = backend_->try_get(keys_.round());
    if (!v) return {-1, 0};
    const auto rk = parse_round_key(*v);
    if (rk.closed || backend_->try_get(keys_.result(rk.round))) return {-1, 0};
    // A counter: read with add(0) (the etcd backend keeps counters apart from values).
    return {rk.round, std::max<int64_t>(0, backend_->add(keys_.ticket(rk.round), 0))};
  }

  void close_rendezvous(int64_t current, int64_t joining) override {
    backend_->set(keys_.round(), "closed");
    RoundResult closed_result;
    closed_result.kind = RoundResult::Kind::kClosed;
    std::string closed = encode_result(closed_result);
    // Wake nodes waiting for a result: the round being gathered after ours, and our own.
    if (current >= 0) backend_->compare_set(keys_.result(current + 1), "", closed);
    if (joining >= 0) backend_->compare_set(keys_.result(joining), "", closed);
  }

  RendezvousInfo join_round(int64_t last_round, int last_rank) override {
    const auto deadline = join_deadline();
    auto rk = parse_round_key(backend_->compare_set(keys_.round(), "", "0"));
    if (rk.closed) throw closed_error();
    int64_t j = std::max(rk.round, last_round + 1);
    std::optional<RoundResult> previous;  // result of round j-1 when this node already read it
    for (;;) {
      if (Clock::now() >= deadline) throw timeout_error(j);
      // shutdown() from another thread ends the join (its abort wakes the wait below): take no
      // ticket in the next round.
      check_not_shut_down();
      joining_round_ = j;
      int64_t ticket = backend_->add(keys_.ticket(j), 1);
      NodeDesc me;
      me.id = options_.node_id;
      me.addr = options_.local_addr;
      me.store_host = server_ != nullptr;
      me.rank_hint = options_.node_rank;
      me.prev_round = last_round;
      me.prev_rank = last_rank;
      me.ticket = ticket;
      me.master_port = pick_free_port();
      arm_node_lease(j, keys_.node(j, ticket), encode_node(me), keys_.result(j),
                     abort_record("node " + me.id + " left before the round completed"));

      // A node new to a running group that has room tells its members, so they re-rendezvous.
      if (j > 0 && last_round != j - 1) {
        if (!previous) {
          if (auto v = backend_->try_get(keys_.result(j - 1))) previous = decode_result(*v);
        }
        if (previous && previous->kind == RoundResult::Kind::kComplete &&
            decide_after_result(*previous, me.id, options_.max_nodes).announce_join) {
          backend_->append(keys_.over(j - 1),
                           encode_over({RoundEvent::Kind::kNodeJoined, me.id, "waits to join"}));
        }
      }

      if (ticket == 1) leader_.lead(j, deadline);

      auto left = std::chrono::duration_cast<Duration>(deadline - Clock::now());
      auto text = backend_->wait_get(keys_.result(j), std::max(left, Duration(0)));
      if (!text) throw timeout_error(j);
      RoundResult result = decode_result(*text);
      JoinOutcome outcome = decide_after_result(result, me, options_.max_nodes);
      switch (outcome.kind) {
        case JoinOutcome::Kind::kClosed:
          throw closed_error();
        case JoinOutcome::Kind::kRanked:
          return make_info(j, outcome.rank, result);
        case JoinOutcome::Kind::kNextRound:
          break;
      }
      if (result.kind == RoundResult::Kind::kAborted) {
        spdlog::info("{}: round {} aborted ({}); joining round {}", error_prefix(), j,
                     result.reason, j + 1);
        backend_->compare_set(keys_.round(), std::to_string(j), std::to_string(j + 1));
        previous.reset();
      } else {
        previous = std::move(result);  // full: this node waits for the next round
      }
      ++j;
    }
  }

 private:
  RendezvousClosedError closed_error() const {
    return RendezvousClosedError(error_prefix() +
                                 " is closed: the job has finished (start a new job with a new "
                                 "--rdzv-id to run again)");
  }
  RendezvousTimeoutError timeout_error(int64_t round) const {
    std::string why = " with at least " + std::to_string(options_.min_nodes) + " node(s)";
    if (const QuorumCheck& held = leader_.held(); !held.ok) {
      why = ": no majority of the previous round's nodes (" + std::to_string(held.present) +
            " of " + std::to_string(held.electorate) + " here, " + std::to_string(held.needed) +
            " needed): this side of a partition, or the survivors of an unplanned loss of more "
            "than half the nodes, does not form a group (docs/rendezvous.md)";
    }
    return RendezvousTimeoutError(
        error_prefix() + ": round " + std::to_string(round) + " did not complete within " +
        std::to_string(options_.join_timeout.count() / 1000.0) + " s (join_timeout)" + why);
  }

  RendezvousInfo make_info(int64_t round, int rank, const RoundResult& result) {
    RendezvousInfo info;
    info.round = round;
    info.group_rank = rank;
    info.group_world_size = result.world_size;
    info.participants = result.members;
    info.key_prefix = round_store_prefix(options_.run_id, round);
    info.run_store = backend_->agent_store();
    info.store = std::make_shared<store::PrefixStore>(info.key_prefix, info.run_store);
    info.master_addr = std::string(result.members.field(0, 1));
    info.master_port = static_cast<uint16_t>(std::stoi(std::string(result.members.field(0, 3))));
    info.use_agent_store = false;
    return info;
  }

  Keys keys_;
  RoundLeader leader_{*backend_, keys_, options_, error_prefix()};
};

void validate_dynamic_options(const RendezvousOptions& o, const char* backend) {
  validate_common_options(o, backend);
  if (o.node_rank < -1 || o.node_rank >= o.max_nodes) {
    throw RendezvousOptionError(std::string("--rdzv-backend=") + backend +
                                ": --node-rank=" + std::to_string(o.node_rank) + " is outside 0.." +
                                std::to_string(o.max_nodes - 1) + " (the maximum node count)");
  }
}

}  // namespace

std::unique_ptr<RendezvousHandler> create_dynamic_rendezvous(
    const RendezvousOptions& options, std::unique_ptr<RendezvousBackend> backend,
    std::unique_ptr<store::StoreServer> hosted) {
  if (!backend) throw RendezvousOptionError("dynamic rendezvous: no backend given");
  RendezvousOptions o = options;
  validate_dynamic_options(o, backend->name().c_str());
  if (o.node_id.empty()) o.node_id = default_node_id();
  if (o.local_addr.empty()) o.local_addr = default_local_addr();
  std::string name = backend->name();
  return std::make_unique<DynamicRendezvous>(std::move(name), std::move(o), std::move(backend),
                                             std::move(hosted));
}

std::string endpoint_text(const std::string& host, uint16_t port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
         std::to_string(port);
}

std::vector<std::pair<std::string, uint16_t>> parse_c10d_endpoints(const std::string& text) {
  std::vector<std::pair<std::string, uint16_t>> out;
  for (const auto& entry : split_endpoint_list(text)) {
    if (entry.empty() && !text.empty()) {
      throw RendezvousOptionError("--rdzv-endpoint=" + text + ": an empty entry in the list");
    }
    Endpoint ep = parse_endpoint(entry, kDefaultPort, "--rdzv-endpoint");
    out.emplace_back(ep.host, ep.port);
  }
  return out;
}

std::unique_ptr<RendezvousHandler> create_c10d_rendezvous(const RendezvousOptions& options) {
  validate_dynamic_options(options, "c10d");
  RendezvousOptions o = options;
  const auto connect_timeout = start_first_round(&o, options.read_timeout);
  std::vector<Endpoint> endpoints;
  for (auto& [host, port] : parse_c10d_endpoints(options.endpoint))
    endpoints.push_back({host, port});
  Endpoint ep = endpoints[0];
  // An endpoint list: a store that took over from a lost one (a failover) is where the job is
  // now. One quick look at each later entry (a refused port answers at once) before hosting the
  // first entry's store or waiting for it.
  bool moved = false;
  if (endpoints.size() > 1 && options.store_seed.empty()) {
    store::TcpStoreOptions probe;
    probe.token = options.store_token;
    probe.dialect = store::StoreDialect::kTrun;
    const std::string key = Keys(options.run_id).failover();
    for (size_t i = 1; i < endpoints.size() && !moved; ++i) {
      probe.host = endpoints[i].host;
      probe.port = endpoints[i].port;
      if (probe_store_key(probe, key, std::chrono::milliseconds(500))) {
        spdlog::warn("c10d rendezvous '{}': the store moved to {}:{} (a failover); joining there",
                     options.run_id, endpoints[i].host, endpoints[i].port);
        ep = endpoints[i];
        moved = true;
      }
    }
  }
  bool host = !moved &&
              (options.is_host ? *options.is_host : endpoint_is_local(ep.host, options.local_addr));
  std::unique_ptr<store::StoreServer> server;
  std::string not_hosted;
  if (host) {
    server = host_store(ep, options.store_token, options.is_host.value_or(false), "c10d",
                        options.store_seed, &not_hosted);
  }
  StoreBackendOptions bo;
  bo.host = ep.host;
  bo.port = server ? server->port() : ep.port;
  // From here on the endpoint is the one store this handler uses.
  o.endpoint = endpoint_text(ep.host, bo.port);
  bo.token = options.store_token;
  bo.read_timeout = options.read_timeout;
  bo.connect_timeout = connect_timeout;
  std::unique_ptr<RendezvousBackend> backend;
  try {
    backend = connect_store_backend(bo);
  } catch (const store::StoreError& e) {
    // An agent that took the endpoint for its own and could not host it says why: otherwise
    // "nothing listens there" hides that this node was to be the one listening.
    std::string why;
    if (!not_hosted.empty()) {
      why = " (the endpoint is this node's, and hosting the store here failed: " + not_hosted + ")";
    }
    throw RendezvousError("c10d rendezvous '" + options.run_id +
                          "': cannot reach the store at --rdzv-endpoint=" + options.endpoint +
                          ": " + e.what() + why);
  }
  return create_dynamic_rendezvous(o, std::move(backend), std::move(server));
}

std::vector<std::pair<std::string, uint16_t>> parse_etcd_endpoints(const std::string& text) {
  std::vector<std::pair<std::string, uint16_t>> out;
  for (std::string endpoint : split_endpoint_list(text)) {
    if (endpoint.rfind("https://", 0) == 0) {
      throw RendezvousOptionError("--rdzv-endpoint=" + text +
                                  ": trun reaches etcd over plain HTTP only (no TLS); give "
                                  "HOST:PORT of plain-HTTP client URLs");
    }
    if (endpoint.rfind("http://", 0) == 0) endpoint.erase(0, 7);
    if (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
    if (endpoint.empty()) {
      throw RendezvousOptionError(
          text.empty() ? "--rdzv-backend=etcd: --rdzv-endpoint is required (HOST[:PORT] of etcd's "
                         "client URL, or several separated by commas)"
                       : "--rdzv-endpoint=" + text + ": an empty entry in the list");
    }
    Endpoint ep = parse_endpoint(endpoint, kDefaultEtcdPort, "--rdzv-endpoint");
    out.emplace_back(ep.host, ep.port);
  }
  return out;
}

std::unique_ptr<RendezvousHandler> create_etcd_rendezvous(const RendezvousOptions& options) {
  validate_dynamic_options(options, "etcd");
  RendezvousOptions o = options;
  const auto connect_timeout = start_first_round(&o, options.read_timeout);
  EtcdBackendOptions eo;
  eo.endpoints = parse_etcd_endpoints(options.endpoint);
  if (options.is_host.value_or(false)) {
    spdlog::warn("etcd rendezvous: --rdzv-conf is_host is ignored (etcd hosts the state)");
  }
  if (!options.store_token.empty()) {
    spdlog::warn(
        "etcd rendezvous: TRUN_STORE_TOKEN is not used: trun does not authenticate to "
        "etcd (keep its client URL on a trusted network)");
  }
  eo.prefix = options.etcd_prefix.empty() ? "/" : options.etcd_prefix;
  eo.run_id = options.run_id;
  eo.read_timeout = options.read_timeout;
  eo.connect_timeout = connect_timeout;
  std::unique_ptr<RendezvousBackend> backend;
  try {
    backend = connect_etcd_backend(eo);
  } catch (const store::StoreError& e) {
    throw RendezvousError("etcd rendezvous '" + options.run_id +
                          "': cannot reach etcd at --rdzv-endpoint=" + options.endpoint + ": " +
                          e.what());
  }
  return create_dynamic_rendezvous(o, std::move(backend), nullptr);
}

}  // namespace trun::rendezvous
