// Resilient loops (agent/agent.h, docs/launcher.md "Resilient loops: replacing one worker"): a
// worker of a running group that fails is replaced alone while the others keep running, when
// every local worker runs trun::worker::ResilientLoop and the other nodes of the round, if any,
// can follow (a dynamic rendezvous). The survivors see the new generation on the progress board,
// leave their process groups and build new ones with the replacement; on other nodes the
// generation comes through the round's store (agent/reform_watch.h). The agent watches the board
// until every local worker's groups run at that generation, and restarts the group whole when
// they do not in time.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <optional>
#include <string>

#include "agent/agent.h"
#include "agent/log_mux.h"

namespace trun::agent {
namespace {

// A re-formation (spawning the replacement, its init(), the new process groups, the state's
// transfer) may take the rendezvous' join_timeout, but at least 10 s and at most 45 s: the
// survivors' loop gives up after its own 60 s (ResilientOptions::reform_timeout), and trun's
// whole-group restart must come first.
constexpr auto kMinReformTimeout = std::chrono::seconds(10);
constexpr auto kMaxReformTimeout = std::chrono::seconds(45);
// How often the watch reads the board while a group re-forms.
constexpr long kReformPollNs = 50L * 1000 * 1000;

std::string exit_text(int exitcode) {
  return exitcode < 0 ? "signal " + signal_name(-exitcode)
                      : "exit code " + std::to_string(exitcode);
}

int64_t ms_between(Clock::TimePoint from, Clock::TimePoint to) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count();
}

}  // namespace

Clock::Duration Agent::reform_timeout() const {
  return std::clamp<Clock::Duration>(session_->join_timeout(), kMinReformTimeout,
                                     kMaxReformTimeout);
}

InPlaceFacts Agent::in_place_facts(
    const std::vector<std::pair<size_t, WorkerFailure>>& failed) const {
  InPlaceFacts f;
  f.board = hang_ != nullptr;
  f.stopping = received_signal_ != 0 || outcome_.has_value() || phase_ != GroupPhase::kRunning;
  f.group_world_size = session_->info().group_world_size;
  f.dynamic = session_->dynamic();
  f.restart_count = restart_count_;
  f.max_restarts = config_.max_restarts;
  f.all_present = true;
  f.all_resilient = f.board;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const WorkerProcess& w = workers_[i];
    const bool failed_now = std::any_of(failed.begin(), failed.end(),
                                        [i](const auto& entry) { return entry.first == i; });
    if (!w.running && !failed_now) {
      f.all_present = false;
      continue;
    }
    if (!hang_) continue;
    // A failed worker's record still holds what the dead process declared (untrusted data).
    const ProgressMonitor::Member m = hang_->member(static_cast<int>(i));
    if (!m.resilient || m.pid != w.pid) f.all_resilient = false;
  }
  return f;
}

bool Agent::replace_in_place(std::vector<std::pair<size_t, WorkerFailure>>& failed) {
  const Clock::TimePoint failed_at = clock_.now();
  const InPlace decision = decide_in_place(in_place_facts(failed));
  if (decision != InPlace::kReplace) {
    if (decision == InPlace::kMultiNode && !multi_node_note_shown_) {
      multi_node_note_shown_ = true;
      spdlog::info(
          "the workers run resilient loops, but the round has {} nodes of a static rendezvous, "
          "which cannot follow a replacement: the group restarts whole (a failed worker is "
          "replaced alone with --rdzv-backend=c10d or etcd, or on one node)",
          session_->info().group_world_size);
    } else if (decision != InPlace::kNoBoard) {
      spdlog::debug("worker failure not handled in place: {}", in_place_reason(decision));
    }
    return false;
  }
  arm_reform_timer(false);  // makes the watch's timer (once)
  if (reform_fd_ < 0) {
    spdlog::warn("cannot watch a re-formation (timerfd_create failed): the group restarts whole");
    return false;
  }
  std::vector<WorkerFailure> batch;
  for (const auto& [i, f] : failed) batch.push_back(f);
  const std::string line = failure_line(batch, hostname_);
  // The crash-loop guard, per replaced worker: the same failure again and again, each replacement
  // dying before it took a step or ran --crash-loop-uptime, stops the job as on the classic path
  // (whose progress test would see the survivors' steps).
  bool progress = false;
  for (const auto& [i, f] : failed) {
    progress = progress || hang_->member(static_cast<int>(i)).steps > 0 ||
               failed_at - workers_[i].started >= config_.crash_loop_uptime;
  }
  if (crash_loop_reached(line, progress)) {
    crash_looped_ = true;
    return false;
  }
  const std::optional<NextFormation> next = next_formation();
  if (!next) return false;  // next_formation said why

  // Counted as any restart; the survivors' view of it is the board's generation.
  const WorkerFailure& root = batch[root_cause_index(batch)];
  event("trun.agent.failure", {{"local_rank", int64_t{root.local_rank}},
                               {"global_rank", int64_t{root.rank}},
                               {"exitcode", int64_t{root.exitcode}},
                               {"raw_error", line},
                               {"failed_workers", int64_t(batch.size())},
                               {"restart", true},
                               {"in_place", true}});
  ++restart_count_;
  const uint64_t generation = next->generation;
  generation_ = generation;
  std::vector<int> slots;
  for (const auto& [i, f] : failed) slots.push_back(static_cast<int>(i));
  const int survivors = running_count();
  const size_t first_failure = reformation_ ? reformation_->first_failure : replaced_.size();

  // The goodput account: the group's interval ends with the failure; from here the replacements'
  // records (fresh) tell when the group steps again (the time until then is restart time).
  sample_goodput();
  goodput_.replaced(monotonic_seconds());
  record_badput_intervals();
  goodput_slots_ = slots;
  // The replacements attach to empty records; no verdict while the group re-forms. The
  // generation is stored before they are spawned: the survivors begin re-forming at once.
  hang_->begin_reformation(slots);
  publish_generation(generation, next->naming);

  std::vector<pid_t> old_pids;
  for (auto& [i, f] : failed) {
    WorkerProcess& w = workers_[i];
    spdlog::warn(
        "worker local_rank={} (rank {}) exited with {}: replacing it alone, the other {} {} "
        "running (resilient loop; restart {}/{})",
        w.local_rank, w.rank, exit_text(w.exitcode), survivors,
        survivors == 1 ? "worker keeps" : "workers keep", restart_count_, config_.max_restarts);
    EventMetadata md{{"local_rank", int64_t{w.local_rank}},
                     {"global_rank", int64_t{w.rank}},
                     {"worker_pid", int64_t{w.pid}},
                     {"exitcode", int64_t{w.exitcode}},
                     {"generation", static_cast<int64_t>(generation)}};
    if (w.exitcode < 0) md["signal"] = signal_name(-w.exitcode);
    event("trun.agent.worker_replaced", std::move(md));
    retire_group(w);
    by_pid_.erase(w.pid);
    old_pids.push_back(w.pid);
    replaced_.push_back({std::move(f), generation});
  }
  event("trun.agent.restart", {{"counted", true},
                               {"max_restarts", int64_t{config_.max_restarts}},
                               {"reason", std::string("worker replaced in place")}});
  snap_.restarts = restart_count_;
  snap_.workers_replaced += failed.size();
  snap_.last_failure = line;
  status_.last_failure = line;
  status_.last_failure_at = unix_seconds();

  // The replacements: attempt_<generation>/<local rank>, TORCHELASTIC_RESTART_COUNT=<generation>,
  // everything else as for the group.
  const std::string dir = fresh_attempt_dir();
  const AttemptEnv attempt = attempt_env();
  std::vector<SpawnRequest> requests;
  for (int slot : slots) {
    workers_[static_cast<size_t>(slot)] = WorkerProcess{};
    requests.push_back(spawn_request(static_cast<size_t>(slot), dir, attempt));
  }
  const std::vector<SpawnResult> results = sup_.spawn(requests);
  logs_->close_child_ends();
  bool spawned = true;
  for (size_t k = 0; k < slots.size(); ++k) {
    const auto i = static_cast<size_t>(slots[k]);
    const bool ok = record_spawn_result(i, results[k]);
    spawned = spawned && ok;
    set_worker_state(i, ok ? "running" : "failed");
    if (ok && timer_server_) timer_server_->replace_worker(old_pids[k], workers_[i].pid);
    if (ok) {
      spdlog::info("generation {}: started local_rank {} again (pid {})", generation, slots[k],
                   workers_[i].pid);
    }
  }
  reformation_ = Reformation{generation,
                             reformation_ ? reformation_->failed_at : failed_at,
                             clock_.now() + reform_timeout(),
                             first_failure,
                             false,
                             false};
  if (!spawned) {
    // record_spawn_result put the failure to start in failures_ (and said why).
    spdlog::warn("could not start the replacement: stopping the group and restarting it whole");
    abandon_reformation("replaced alone at generation " + std::to_string(generation) +
                        ", but the replacement could not start");
    return true;
  }
  arm_reform_timer(true);
  publish_status("running");  // the restart count, in `trun status`
  return true;
}

std::optional<Agent::NextFormation> Agent::next_formation() {
  // A static rendezvous's store outlives the group: the restart count names the groups.
  if (!session_->dynamic()) return NextFormation{static_cast<uint64_t>(restart_count_) + 1, -1};
  try {
    // Every value read before this add is below the one it returns, on every node.
    const int64_t seq = session_->info().store->add(kReformGenerationKey, 1);
    if (seq > 0) {
      seq_seen_ = std::max(seq_seen_, seq);
      return NextFormation{generation_ + 1, seq};
    }
    spdlog::warn("the round store's {} is {}: the group restarts whole", kReformGenerationKey, seq);
  } catch (const std::exception& e) {
    spdlog::warn(
        "cannot take the next generation from the round store ({}): the other nodes would not "
        "follow a replacement, so the group restarts whole",
        e.what());
  }
  return std::nullopt;
}

void Agent::publish_generation(uint64_t generation, int64_t naming) {
  const rendezvous::RendezvousInfo& info = session_->info();
  ProgressMonitor::FormationFacts f;
  f.naming = naming;
  f.world_size = session_->ranks().world_size;
  f.group_rank = info.group_rank;
  f.group_world_size = info.group_world_size;
  f.master_addr = info.master_addr;
  f.master_port = info.master_port;
  f.ranks = session_->ranks().global;
  hang_->set_generation(generation, f);
}

void Agent::start_reform_watch() {
  reform_watch_.reset();
  const rendezvous::RendezvousInfo& info = session_->info();
  if (!hang_ || !session_->dynamic() || info.group_world_size < 2 || !info.store) return;
  try {
    reform_watch_ =
        std::make_unique<ReformWatch>(info.store, ReformWatch::interval_for(info.group_world_size),
                                      loop_, [this](int64_t g) { on_remote_generation(g); });
  } catch (const std::exception& e) {
    spdlog::warn("cannot watch for workers replaced on other nodes ({}): they restart the group",
                 e.what());
  }
}

void Agent::on_remote_generation(int64_t seq) {
  if (!hang_ || seq <= seq_seen_ || phase_ != GroupPhase::kRunning || outcome_ ||
      received_signal_ != 0) {
    return;
  }
  seq_seen_ = seq;
  const uint64_t g = ++generation_;
  const InPlaceFacts f = in_place_facts({});
  if (!f.all_present || !f.all_resilient) {
    // The workers here cannot re-form: they fail on their own (their peer is gone), and this
    // node's failure ends the round for every node.
    spdlog::warn(
        "another node replaced a failed worker alone (generation {}), but {} here: this node's "
        "workers cannot re-form with it",
        g, f.all_present ? "not every worker runs a resilient loop" : "a worker has exited");
    return;
  }
  arm_reform_timer(false);  // makes the watch's timer (once)
  if (reform_fd_ < 0) return;
  spdlog::warn(
      "another node replaced a failed worker alone: the {} workers here keep running and re-form "
      "with it at generation {}",
      running_count(), g);
  event("trun.agent.reforming", {{"generation", static_cast<int64_t>(g)},
                                 {"reason", std::string("a worker was replaced on another node")}});
  const Clock::TimePoint now = clock_.now();
  // The goodput account: the ranks here pause from their last step until they step again in the
  // re-formed group (detection, then restart time), not slow time.
  sample_goodput();
  goodput_.reformed(monotonic_seconds());
  record_badput_intervals();
  hang_->begin_reformation({});
  publish_generation(g, seq);
  reformation_ = Reformation{g,
                             reformation_ ? reformation_->failed_at : now,
                             now + reform_timeout(),
                             reformation_ ? reformation_->first_failure : replaced_.size(),
                             !reformation_ || reformation_->remote,
                             false};
  arm_reform_timer(true);
}

bool Agent::can_keep_workers() const {
  if (!hang_ || !session_->dynamic() || excluded_until_ || stepped_out_) return false;
  const InPlaceFacts f = in_place_facts({});
  return !f.stopping && f.all_present && f.all_resilient && running_count() > 0;
}

void Agent::reform_kept_workers() {
  keep_workers_ = false;
  outcome_.reset();  // the round over that kept them (on_round_over); nothing else ended
  root_cause_.reset();
  const Ranks& ranks = session_->ranks();
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerProcess& w = workers_[i];
    w.rank = ranks.global[i];
    w.role_rank = ranks.role[i];
    // Before the new generation is published: the lines the worker prints at its new place
    // carry its new rank.
    if (logs_)
      logs_->set_prefix(w.local_rank, line_prefix(config_.log_line_prefix_template, config_.role,
                                                  w.rank, w.local_rank));
  }
  const rendezvous::RendezvousInfo& info = session_->info();
  const uint64_t g = ++generation_;
  seq_seen_ = 0;  // the new round's counter
  // The goodput account: the ranks' wait for the round is rendezvous time, and the time to their
  // first step in it restart time.
  sample_goodput();
  goodput_.reformed(monotonic_seconds(), kept_since_);
  record_badput_intervals();
  hang_->begin_reformation({});
  publish_generation(g, -1);  // a new store: rank 0 of this round hosts it
  spdlog::warn(
      "round {}: the {} running workers re-form in it at generation {}, as ranks {}..{} of {} "
      "(resilient loops: nothing was restarted)",
      info.round, running_count(), g, ranks.global.front(), ranks.global.back(), ranks.world_size);
  event("trun.agent.reforming", {{"generation", static_cast<int64_t>(g)},
                                 {"reason", std::string("a new round")},
                                 {"round", info.round},
                                 {"world_size", int64_t{ranks.world_size}}});
  set_phase("running");
  start_reform_watch();
  arm_reform_timer(false);  // makes the watch's timer (once)
  const Clock::TimePoint now = clock_.now();
  reformation_ = Reformation{g, now, now + reform_timeout(), replaced_.size(), false, true};
  if (reform_fd_ >= 0) arm_reform_timer(true);
  publish_status("running");
}

void Agent::stop_kept_workers(int sig) {
  keep_workers_ = false;
  if (running_count() == 0) return;
  spdlog::warn("stopping the workers that were kept running for the next round");
  if (!outcome_) outcome_ = GroupOutcome::kRoundOver;
  begin_stop(sig);
  supervise();
}

void Agent::arm_reform_timer(bool on) {
  if (reform_fd_ < 0) {
    reform_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
    if (reform_fd_ < 0) return;
    loop_.add(reform_fd_, EPOLLIN, [this](uint32_t) {
      uint64_t ticks;
      while (read(reform_fd_, &ticks, sizeof ticks) > 0) {
      }
      on_reform_tick();
    });
  }
  itimerspec spec{};
  if (on) spec = itimerspec{{0, kReformPollNs}, {0, kReformPollNs}};
  timerfd_settime(reform_fd_, 0, &spec, nullptr);
}

void Agent::end_reformation_watch() {
  reformation_.reset();
  if (reform_fd_ >= 0) arm_reform_timer(false);
}

void Agent::on_reform_tick() {
  if (!reformation_) return;
  if (!hang_ || phase_ != GroupPhase::kRunning || outcome_ || running_count() == 0) {
    end_reformation_watch();  // the group stops or ended: nothing re-forms
    return;
  }
  bool reformed = true;
  for (size_t i = 0; i < workers_.size() && reformed; ++i) {
    const WorkerProcess& w = workers_[i];
    if (!w.running) continue;
    const ProgressMonitor::Member m = hang_->member(static_cast<int>(i));
    reformed = m.pid == w.pid && m.generation == reformation_->generation;
  }
  if (reformed) {
    const int64_t ms = ms_between(reformation_->failed_at, clock_.now());
    // A round's re-formation (a node joined or left) counts from the new round's generation.
    spdlog::warn("group re-formed at generation {} in {} ms after {}", reformation_->generation, ms,
                 reformation_->round ? "the new round" : "the failure");
    event("trun.agent.reformed",
          {{"generation", static_cast<int64_t>(reformation_->generation)}, {"ms", ms}});
    hang_->end_reformation();
    end_reformation_watch();
    publish();
    return;
  }
  if (clock_.now() >= reformation_->deadline) reformation_timed_out();
}

void Agent::reformation_timed_out() {
  const Reformation r = *reformation_;
  if (r.round) {
    // The kept workers did not re-form in the new round: they stop, and the next round starts
    // fresh ones (the other nodes see this node ask for it).
    spdlog::warn(
        "the workers kept for round {} did not re-form in it within {:.0f} s: stopping them; the "
        "next round starts new ones",
        session_->info().round, std::chrono::duration<double>(clock_.now() - r.failed_at).count());
    event("trun.agent.reform_timeout",
          {{"generation", static_cast<int64_t>(r.generation)}, {"round", session_->info().round}});
    hang_->end_reformation();
    end_reformation_watch();
    outcome_ = GroupOutcome::kRoundOver;
    begin_stop(SIGTERM);
    publish();
    return;
  }
  if (r.remote) {
    // The node that replaced its worker restarts the group (its own watch) if it does not re-form;
    // the hang watch judges this node's workers again meanwhile.
    spdlog::warn(
        "the workers here did not re-form at generation {} (a replacement on another node) in "
        "time: leaving it to that node, which restarts the group whole if it does not re-form",
        r.generation);
    hang_->end_reformation();
    end_reformation_watch();
    return;
  }
  std::string behind;
  if (hang_) {
    for (size_t i = 0; i < workers_.size(); ++i) {
      const WorkerProcess& w = workers_[i];
      if (!w.running) continue;
      const ProgressMonitor::Member m = hang_->member(static_cast<int>(i));
      if (m.pid != w.pid || m.generation != r.generation)
        behind += (behind.empty() ? "" : ",") + std::to_string(i);
    }
  }
  const double waited_s = std::chrono::duration<double>(clock_.now() - r.failed_at).count();
  spdlog::warn(
      "the group did not re-form at generation {} within {:.0f} s of the failure (local ranks "
      "not there: {}): stopping it and restarting it whole",
      r.generation, waited_s, behind.empty() ? "none" : behind);
  event("trun.agent.reform_timeout", {{"generation", static_cast<int64_t>(r.generation)},
                                      {"seconds", waited_s},
                                      {"behind", behind}});
  abandon_reformation("replaced alone at generation " + std::to_string(r.generation) +
                      ", but the group did not re-form");
}

void Agent::abandon_reformation(const std::string& note) {
  const size_t first = reformation_ ? reformation_->first_failure : replaced_.size();
  end_reformation_watch();
  // The replaced failures are this attempt's again: the root cause, the summary and the restart
  // that follows see them as after any failure.
  for (size_t k = first; k < replaced_.size(); ++k) {
    WorkerFailure f = std::move(replaced_[k].failure);
    f.message += "\n(" + note + ")";
    failures_.push_back(std::move(f));
  }
  replaced_.resize(std::min(replaced_.size(), first));
  crash_loop_recorded_ = true;  // replace_in_place counted these failures
  outcome_ = GroupOutcome::kFailed;
  begin_stop(SIGTERM);
  publish();
}

void Agent::retire_group(WorkerProcess& w) {
  if (!w.group_live) return;
  // What is left of a dead worker's group (its children) is no use to the re-formed group.
  w.group_live = false;
  sup_.signal_group(w.pid, SIGKILL);
  if (sup_.group_alive(w.pid)) {
    retired_groups_.push_back(w.pid);
  } else {
    sup_.forget_group(w.pid);
  }
}

std::string Agent::replaced_summary() const {
  if (replaced_.empty()) return {};
  std::string out = "trun: " + std::to_string(replaced_.size()) +
                    (replaced_.size() == 1 ? " worker was" : " workers were") +
                    " replaced alone while the others kept running (resilient loop):\n";
  for (const auto& r : replaced_) {
    out += "trun:   generation " + std::to_string(r.generation) + ": " +
           failure_line({r.failure}, hostname_) + "\n";
  }
  return out;
}

}  // namespace trun::agent
