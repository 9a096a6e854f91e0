#include "rendezvous/c10d/failover.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "rendezvous/dynamic_decisions.h"
#include "store/tcp_store.h"

namespace trun::rendezvous {
namespace {

class C10dFailover : public StoreFailover {
 public:
  C10dFailover(const RendezvousOptions& options, std::pair<std::string, uint16_t> lost_store,
               const LostStore& lost, dynamic::FailoverPlan plan)
      : keys_(options.run_id), port_(lost_store.second), lost_(lost), plan_(std::move(plan)) {
    old_store_.dialect = store::StoreDialect::kTrun;
    old_store_.token = options.store_token;
    old_store_.host = lost_store.first;
    old_store_.port = lost_store.second;
    // How long a candidate before this node may take to notice the loss and start its store: a
    // partition is noticed when keep-alives fail (each bounded by read_timeout), so two nodes
    // notice it up to a lease's ttl plus one read_timeout apart; plus slack. (A candidate that
    // is alive and noticed first answers at once: this is only spent on dead candidates.)
    window_ = dynamic::lease_ttl(options.keep_alive_interval, options.keep_alive_max_attempt) +
              options.read_timeout + std::chrono::seconds(2);
  }

  std::optional<StoreTarget> next_target() override {
    while (!healed_ && next_ < plan_.candidates.size()) {
      const int c = plan_.candidates[next_++];
      const Participant member = lost_.participants.at(c);
      StoreTarget target;
      target.endpoint = endpoint_text(member.addr, port_);
      target.host_node_id = member.node_id;
      if (c == lost_.group_rank) {
        if (old_store_answers()) {  // healed while we looked
          healed_ = true;
          break;
        }
        target.host = true;
        target.seed = dynamic::failover_seed(keys_, lost_.round, lost_.participants,
                                             target.endpoint, lost_.store_stopped);
        return target;
      }
      store::TcpStoreOptions probe = old_store_;
      probe.host = member.addr;
      probe.port = port_;
      const auto until = std::min(lost_.deadline, lost_.now() + window_);
      bool found = false;
      for (int i = 0; i < 10000 && !found; ++i) {
        found = store::probe_store_key(probe, keys_.failover(), std::chrono::milliseconds(500));
        if (found || lost_.now() >= until) break;
        // A partition that healed meanwhile: the others may be back on the old store.
        if (old_store_answers()) {
          healed_ = true;
          return std::nullopt;
        }
        lost_.pause(std::chrono::milliseconds(20));
      }
      if (found) return target;
      spdlog::info("failover: node {} (rank {}) hosts no store at {}; trying the next",
                   member.node_id, c, target.endpoint);
    }
    return std::nullopt;
  }

  bool healed() const override { return healed_; }

 private:
  bool old_store_answers() const {
    return !lost_.store_stopped &&
           store::probe_store_key(old_store_, keys_.round(), std::chrono::milliseconds(300));
  }

  const dynamic::Keys keys_;
  const uint16_t port_;  // every candidate's store listens on the lost store's port
  const LostStore lost_;
  const dynamic::FailoverPlan plan_;
  store::TcpStoreOptions old_store_;
  std::chrono::milliseconds window_{0};
  size_t next_ = 0;  // into plan_.candidates
  bool healed_ = false;
};

}  // namespace

std::unique_ptr<StoreFailover> start_c10d_failover(const RendezvousOptions& options,
                                                   const std::string& lost_endpoint,
                                                   const LostStore& lost) {
  if (!options.failover || lost.round < 0 || lost.participants.empty()) return nullptr;
  std::pair<std::string, uint16_t> lost_store;
  try {
    lost_store = parse_c10d_endpoints(lost_endpoint).front();
  } catch (const std::exception&) {
    return nullptr;
  }
  const dynamic::Keys keys(options.run_id);
  // A store that still answers (this node only lost its membership, or a blip): rejoin it.
  if (!lost.store_stopped) {
    store::TcpStoreOptions probe;
    probe.dialect = store::StoreDialect::kTrun;
    probe.token = options.store_token;
    probe.host = lost_store.first;
    probe.port = lost_store.second;
    if (store::probe_store_key(probe, keys.round(), std::chrono::seconds(1))) return nullptr;
  }
  auto plan = dynamic::plan_failover(lost.participants, lost.group_rank, lost.store_stopped);
  if (static_cast<int>(lost.participants.size()) < lost.group_world_size) {
    // A large round's nodes know only its first members (docs/rendezvous.md, "Scale"): not
    // enough to seed a store that checks the quorum.
    plan.possible = false;
    plan.why_not = "rounds of more than " + std::to_string(options.max_inline_members) +
                   " nodes do not move their store";
  }
  if (!plan.possible) {
    // The caller retries the store, or gives up at once when it stopped on purpose; its error
    // line is the one that ends the agent.
    spdlog::warn("lost the rendezvous store at {}; cannot move it: {}", lost_endpoint,
                 plan.why_not);
    return nullptr;
  }
  const std::string host_id =
      plan.lost_host_rank >= 0 ? lost.participants.at(plan.lost_host_rank).node_id : "";
  spdlog::warn(
      "lost the rendezvous store at {} ({}){}; moving it to the first reachable of {} node(s) of "
      "round {}",
      lost_endpoint, lost.why, host_id.empty() ? "" : " hosted by node " + host_id,
      plan.candidates.size(), lost.round);
  return std::make_unique<C10dFailover>(options, lost_store, lost, std::move(plan));
}

}  // namespace trun::rendezvous
