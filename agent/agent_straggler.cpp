// Slow ranks (agent/agent.h, agent/straggler.h, docs/health.md): this node's ranks' step times to
// /metrics and the status record, and the judging node's scores, flags and console line.
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cstdio>

#include "agent/agent.h"

namespace trun::agent {

namespace {

constexpr int kStragglerReportSeconds = 5;

double monotonic_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

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
  for (auto& r : local) r.node = hostname_;
  const auto& info = session_->info();
  if (info.round != straggler_round_) {  // a new round: new ranks, nothing judged yet
    straggler_judge_.reset();
    straggler_round_ = info.round;
  }
  // The judging node: the only one, or group rank 0 with every node's records.
  const bool judge = !session_->multi_node() || info.group_rank == 0;
  std::vector<straggler::RankStats> scored = judge ? job_rank_stats(local) : local;
  straggler::score(scored);
  std::vector<int> flagged;
  if (judge) {
    for (const auto& c : straggler_judge_.update(scored, monotonic_s())) {
      on_straggler_change(c, scored);
    }
    flagged = straggler_judge_.flagged();
  }
  status_.ranks.clear();
  for (const auto& r : local) {
    status_.ranks.push_back({r.rank, r.local_rank, r.steps, r.step_s, r.compute_s, r.self_score});
  }
  status_.slow_ranks = flagged;
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
  } else {
    spdlog::warn("rank {} on {} is no longer slower than the others ({:.0f}%)", r.rank, r.node,
                 r.slower * 100);
    event("trun.agent.straggler_recovered",
          {{"rank", int64_t{r.rank}}, {"node", r.node}, {"slower", r.slower}});
  }
}

}  // namespace trun::agent
