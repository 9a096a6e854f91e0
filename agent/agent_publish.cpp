// What operators see of the agent (agent/agent.h), fed from the agent's thread: the event log
// (--event-log), the /metrics snapshot (--metrics-port) and the status record (`trun status`).
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cstdio>
#include <mutex>

#include "agent/agent.h"
#include "agent/node_status.h"
#include "store/store.h"

namespace trun::agent {

void Agent::event(const std::string& name, EventMetadata md) {
  if (!events_) return;
  md.emplace("agent_restarts", int64_t{restart_count_});
  events_->record(name, std::move(md));
}

bool Agent::start_metrics() {
  try {
    metrics_ = MetricsServer::start(static_cast<uint16_t>(config_.metrics_port));
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "trun: error: %s (--metrics-port / TORCHELASTIC_HEALTH_CHECK_PORT; 0 picks a "
                 "free port)\n",
                 e.what());
    return false;
  }
  // The heartbeat: the loop republishes every second, so /healthz sees it answer.
  heartbeat_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (heartbeat_fd_ >= 0) {
    itimerspec every{{1, 0}, {1, 0}};
    timerfd_settime(heartbeat_fd_, 0, &every, nullptr);
    loop_.add(heartbeat_fd_, EPOLLIN, [this](uint32_t) {
      uint64_t ticks;
      while (read(heartbeat_fd_, &ticks, sizeof ticks) > 0) {
      }
      publish();
    });
  }
  snap_.run_id = run_id_;
  snap_.max_restarts = config_.max_restarts;
  snap_.round_seconds_buckets = {0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600};
  snap_.round_seconds_counts.assign(snap_.round_seconds_buckets.size() + 1, 0);
  snap_.phase = "rendezvous";
  snap_.phase_since = std::chrono::steady_clock::now();
  publish();
  // Only now: a client that reads the port and asks at once must get this snapshot, not the
  // server's empty one (whose phase began at the clock's epoch: "rendezvous in progress for
  // 8461 s" in a fresh-clone CI run).
  std::fprintf(stderr, "trun: metrics on http://0.0.0.0:%u/metrics and /healthz\n",
               static_cast<unsigned>(metrics_->port()));
  std::fflush(stderr);
  return true;
}

void Agent::publish() {
  if (!metrics_) return;
  sample_goodput();
  snap_.goodput = goodput_;
  refresh_live(&snap_);
  metrics_->publish(snap_);
}

// What moves without the agent's loop: the heartbeat, and the session's sample and counters.
void Agent::refresh_live(AgentSnapshot* s) const {
  s->heartbeat = std::chrono::steady_clock::now();
  if (!session_) return;
  s->nodes_waiting = session_->nodes_waiting();
  const auto stats = session_->store_stats();
  s->store_requests = stats.requests_sent;
  s->store_errors = stats.errors;
  s->store_requests_served = stats.requests_served;
}

void Agent::begin_waiting() {
  std::lock_guard<std::mutex> lock(waiting_mu_);
  waiting_ = true;
}

void Agent::end_waiting() {
  std::lock_guard<std::mutex> lock(waiting_mu_);
  waiting_ = false;
}

// The sampler thread, after each sample.
void Agent::publish_while_waiting() {
  AgentSnapshot copy;
  {
    std::lock_guard<std::mutex> lock(waiting_mu_);
    if (!waiting_ || !metrics_) return;
    copy = snap_;
  }
  refresh_live(&copy);
  metrics_->publish(copy);
}

void Agent::account_phase(const std::string& phase) {
  const double now = monotonic_seconds();
  sample_goodput();
  goodput::Phase p = goodput::Phase::kOther;
  if (phase == "rendezvous")
    p = goodput::Phase::kRendezvous;
  else if (phase == "running")
    p = goodput::Phase::kRunning;
  else if (phase == "stopping")
    p = goodput::Phase::kStopping;
  else if (phase == "unhealthy" || phase == "excluded")
    p = goodput::Phase::kOutside;
  // A node whose first group is not the job's first (round 0) joined a running job.
  const bool joined_late = session_ && session_->info().round > 0;
  goodput_.set_phase(p, now, joined_late);
  record_badput_intervals();
}

void Agent::record_badput_intervals() {
  const double now = monotonic_seconds();
  const double unix_now = unix_seconds();
  for (const auto& i : goodput_.take_intervals()) {
    event("trun.agent.badput",
          {{"cause", std::string(goodput::cause_name(i.cause))},
           {"begin_ms", static_cast<int64_t>((unix_now - (now - i.begin)) * 1000)},
           {"end_ms", static_cast<int64_t>((unix_now - (now - i.end)) * 1000)},
           {"seconds", i.end - i.begin}});
  }
}

void Agent::sample_goodput() {
  // The account ignores it outside its running phase; the board keeps a stopped group's records
  // until the next group is spawned.
  if (hang_) goodput_.progress(hang_->goodput_progress(goodput_slots_), monotonic_seconds());
}

void Agent::set_phase(const char* phase) {
  account_phase(phase);
  if (!metrics_ || snap_.phase == phase) return;
  snap_.phase = phase;
  snap_.phase_since = std::chrono::steady_clock::now();
  publish();
}

bool Agent::publish_status(const char* state) {
  if (!session_) return false;
  const auto& info = session_->info();
  status_.node_id = session_->node_id();
  if (status_.node_id.empty()) return false;  // not connected
  status_.hostname = hostname_;
  status_.pid = getpid();
  const bool in_round = !info.participants.empty();
  status_.round = in_round ? info.round : -1;
  status_.group_rank = in_round ? info.group_rank : -1;
  status_.group_world_size = in_round ? info.group_world_size : 0;
  if (static_cast<size_t>(info.group_rank) < info.participants.size()) {
    status_.addr = info.participants.at(static_cast<size_t>(info.group_rank)).addr;
  }
  status_.local_world_size = config_.nproc_per_node;
  status_.restarts = restart_count_;
  status_.max_restarts = config_.max_restarts;
  status_.state = state;
  status_.updated_at = unix_seconds();
  sample_goodput();
  const goodput::Totals g = goodput_.totals(monotonic_seconds());
  status_.goodput_ratio = g.wall > 0 ? g.ratio() : -1;
  status_.goodput_wall_s = g.wall;
  status_.badput_s.clear();
  for (int c = 0; c < goodput::kCauses; ++c) {
    if (g.badput[static_cast<size_t>(c)] > 0)
      status_.badput_s[goodput::cause_name(static_cast<goodput::Cause>(c))] =
          g.badput[static_cast<size_t>(c)];
  }
  const bool took = session_->publish_status(encode_node_status(status_));
  // A node outside the rounds is in no rendezvous list: it lists itself for `trun status`.
  const std::string outside(state);
  if (took && (outside == "unhealthy" || outside == "excluded") &&
      outside_slot_of_ != status_.node_id) {
    try {
      const std::shared_ptr<store::Store> store = session_->job_store();
      const int64_t k = store->add(outside_count_key(run_id_), 1);
      store->set(outside_slot_key(run_id_, k), status_.node_id);
      outside_slot_of_ = status_.node_id;
    } catch (const std::exception& e) {
      spdlog::debug("cannot list this node for trun status: {}", e.what());
    }
  }
  return took;
}

void Agent::set_worker_state(size_t i, const char* state) {
  if (!metrics_) return;
  if (snap_.worker_states.size() <= i) snap_.worker_states.resize(i + 1);
  snap_.worker_states[i] = state;
}

}  // namespace trun::agent
