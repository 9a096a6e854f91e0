// Slow ranks (agent/agent.h, agent/straggler.h, docs/health.md): this node's ranks' step times to
// /metrics and the status record, and the judging node's scores, flags and console line.
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "agent/agent.h"
#include "agent/node_status.h"
#include "store/store.h"

namespace trun::agent {

namespace {

constexpr int kStragglerReportSeconds = 5;

}  // namespace

void Agent::start_straggler_reports() {
  straggler_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (straggler_fd_ < 0) {
    spdlog::warn("straggler scores are off: timerfd_create failed");
    return;
  }
  itimerspec every{{kStragglerReportSeconds, 0}, {kStragglerReportSeconds, 0}};
  timerfd_settime(straggler_fd_, 0, &every, nullptr);
  loop_.add(straggler_fd_, EPOLLIN, [this](uint32_t) {
    uint64_t ticks;
    while (read(straggler_fd_, &ticks, sizeof ticks) > 0) {
    }
    on_straggler_tick();
  });
}

void Agent::on_straggler_tick() {
  if (!hang_ || !session_ || phase_ != GroupPhase::kRunning || workers_.empty()) return;
  std::vector<straggler::RankStats> local = hang_->straggler_stats();
  if (local.empty()) return;  // not a libtrun_worker program, or not attached yet
  for (auto& r : local) {
    r.node = hostname_;
    r.node_id = session_->node_id();
  }
  const auto& info = session_->info();
  if (info.round != straggler_round_) {  // a new round: new ranks, nothing judged yet
    straggler_judge_.reset();
    straggler_round_ = info.round;
    blame_refused_ = false;
  }
  // The judging node: the only one, or group rank 0 with every node's records.
  const bool judge = !session_->multi_node() || info.group_rank == 0;
  std::vector<straggler::RankStats> scored = judge ? job_rank_stats(local) : local;
  straggler::score(scored);
  std::vector<int> flagged;
  if (judge) {
    for (const auto& c : straggler_judge_.update(scored, monotonic_seconds())) {
      on_straggler_change(c, scored);
    }
    flagged = straggler_judge_.flagged();
  }
  status_.ranks.clear();
  for (const auto& r : local) {
    status_.ranks.push_back({r.rank, r.local_rank, r.steps, r.step_s, r.compute_s, r.self_score});
  }
  status_.slow_ranks = flagged;
  if (config_.straggler.exclude && leave_if_blamed()) return;
  publish_status("running");
  if (metrics_) {
    snap_.ranks.clear();
    for (const auto& r : scored) {
      if (r.node == hostname_) snap_.ranks.push_back(r);
    }
    snap_.slow_ranks = flagged.size();
    publish();
  }
}

std::vector<straggler::RankStats> Agent::job_rank_stats(
    const std::vector<straggler::RankStats>& local) {
  std::vector<straggler::RankStats> all = local;
  if (!session_->multi_node()) return all;
  const auto& info = session_->info();
  const std::shared_ptr<store::Store> store = info.run_store;
  if (!store) return all;
  const std::string self = session_->node_id();
  // Every member's record: one get each, every few seconds, on this node only.
  for (size_t i = 0; i < info.participants.size(); ++i) {
    const std::string id = info.participants.at(i).node_id;
    if (id == self) continue;
    try {
      const std::string key = node_status_key(run_id_, id);
      if (!store->check({key})) continue;
      const auto rec = decode_node_status(store->get(key));
      if (!rec || rec->round != info.round || rec->state != "running") continue;
      for (const auto& r : rec->ranks) {
        straggler::RankStats s;
        s.rank = r.rank;
        s.local_rank = r.local_rank;
        s.node = rec->hostname;
        s.node_id = id;
        s.steps = r.steps;
        s.step_s = r.step_s;
        s.compute_s = r.compute_s;
        s.self_score = r.self_score;
        all.push_back(std::move(s));
      }
    } catch (const std::exception& e) {
      spdlog::debug("straggler scores: cannot read node {}'s record: {}", id, e.what());
    }
  }
  return all;
}

void Agent::on_straggler_change(const straggler::Judge::Change& c,
                                const std::vector<straggler::RankStats>& scored) {
  const auto& r = c.rank;
  double reference = 0;
  if (r.slower > -1) reference = r.compute_s / (1 + r.slower);
  if (c.kind == straggler::Judge::Change::kFlagged) {
    const std::string line = straggler::describe(r, reference);
    std::fprintf(stderr, "trun: slow rank: %s, for %.0f s (threshold %.0f%%, window %.0f s)\n",
                 line.c_str(), c.slow_for_s, config_.straggler.threshold * 100,
                 config_.straggler.window_s);
    std::fflush(stderr);
    event("trun.agent.straggler", {{"rank", int64_t{r.rank}},
                                   {"local_rank", int64_t{r.local_rank}},
                                   {"node", r.node},
                                   {"slower", r.slower},
                                   {"step_s", r.step_s},
                                   {"compute_s", r.compute_s},
                                   {"reference_compute_s", reference},
                                   {"slow_for_s", c.slow_for_s},
                                   {"ranks_scored", int64_t(scored.size())},
                                   {"summary", line}});
    if (config_.straggler.exclude) blame_straggler(r);
  } else {
    spdlog::warn("rank {} on {} is no longer slower than the others ({:.0f}%)", r.rank, r.node,
                 r.slower * 100);
    event("trun.agent.straggler_recovered",
          {{"rank", int64_t{r.rank}}, {"node", r.node}, {"slower", r.slower}});
  }
}

void Agent::blame_straggler(const straggler::RankStats& r) {
  const auto& info = session_->info();
  auto keep = [&](const std::string& why) {
    std::fprintf(stderr, "trun: slow rank %d on %s is not excluded: %s\n", r.rank, r.node.c_str(),
                 why.c_str());
    std::fflush(stderr);
    event("trun.agent.exclusion_refused",
          {{"reason", "slow rank " + std::to_string(r.rank) + ": " + why}, {"node", r.node}});
  };
  if (!session_->dynamic() || !session_->multi_node() || r.node_id.empty()) {
    return keep("a job of one node, or a static rendezvous, has no node to leave out");
  }
  const int spares = session_->nodes_waiting_now();
  if (spares <= 0) return keep("no spare node waits to take its place");
  const int left = info.group_world_size - 1 + spares;
  if (left < config_.min_nodes) {
    return keep("without it " + std::to_string(left) +
                " node(s) are left, fewer than --nnodes MIN " + std::to_string(config_.min_nodes));
  }
  nlohmann::json j;
  j["round"] = info.round;
  j["rank"] = r.rank;
  char why[200];
  std::snprintf(why, sizeof why, "its rank %d was %.0f%% slower than the others for %.0f s", r.rank,
                r.slower * 100, config_.straggler.window_s);
  j["reason"] = why;
  try {
    session_->job_store()->set(blame_key(run_id_, r.node_id), j.dump());
    spdlog::warn("blamed node {} ({}) for slow rank {}: it leaves the round for a spare", r.node,
                 r.node_id, r.rank);
  } catch (const std::exception& e) {
    spdlog::warn("cannot blame node {} for slow rank {}: {}", r.node, r.rank, e.what());
  }
}

bool Agent::leave_if_blamed() {
  if (!session_->dynamic() || !session_->multi_node()) return false;
  const std::shared_ptr<store::Store> store = session_->job_store();
  if (!store) return false;
  nlohmann::json j;
  try {
    const std::string key = blame_key(run_id_, session_->node_id());
    if (!store->check({key})) return false;
    j = nlohmann::json::parse(store->get(key), nullptr, /*allow_exceptions=*/false);
  } catch (const std::exception& e) {
    spdlog::debug("reading this node's blame: {}", e.what());
    return false;
  }
  if (!j.is_object() || j.value("round", int64_t{-1}) != session_->info().round) return false;
  const std::string why = j.value("reason", std::string("a straggler verdict blamed it"));
  if (session_->hosts_store()) {
    if (!blame_refused_) {
      std::fprintf(stderr,
                   "trun: node %s is blamed (%s) but stays: it hosts the job's store, which "
                   "would stop with it\n",
                   hostname_.c_str(), why.c_str());
      std::fflush(stderr);
      event("trun.agent.exclusion_refused", {{"reason", why + "; it hosts the job's store"}});
      blame_refused_ = true;
    }
    return false;
  }
  exclude_node(why, session_->info().group_world_size - 1);
  // Out of the round first: the others stop their workers for a planned leave (not counted),
  // not for the failures that this node's stopping workers would cause in their collectives.
  session_->step_out();
  stepped_out_ = true;
  outcome_ = GroupOutcome::kRoundOver;
  if (hang_) hang_->mark_node_leaving();  // the others' resilient loops go on without this node
  begin_stop(SIGTERM);
  publish();
  return true;
}

}  // namespace trun::agent
