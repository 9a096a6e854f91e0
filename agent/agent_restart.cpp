// After a worker group stopped (agent/agent.h): what follows (agent/decisions.h decides), the
// root cause across nodes, and the next attempt's restart count and round.
#include <spdlog/spdlog.h>

#include <cstdio>

#include "agent/agent.h"
#include "base/check.h"

namespace trun::agent {
namespace {

// After a round ended by a worker failure: how long, beyond --shutdown-timeout (what the other
// nodes may spend stopping their workers), a node waits for the others' failure reports before it
// names the root cause without them.
constexpr auto kReportGrace = std::chrono::seconds(5);

}  // namespace

// The group stopped because the round ended: the next step (kAgain: after the next round).
Agent::Next Agent::after_round_over() {
  const rendezvous::RoundEvent e = *session_->round_over();
  using Kind = rendezvous::RoundEvent::Kind;
  // Set for a worker failure, the only round end decide_after_round restarts (counted) or gives
  // up on: the earliest failure across nodes, the round's first report when none could be read.
  const RootCause* root = nullptr;
  if (e.kind == Kind::kWorkerFailed) {
    root = &resolve_root_cause(std::nullopt);
  } else if (e.kind == Kind::kNodeJoined || e.kind == Kind::kNodeLeft || e.kind == Kind::kRestart) {
    // Only says that this node stopped (a failure reported in this round waits for it). Not
    // when the store may be out of reach (store lost, this node declared dead) or the job ended.
    session_->round_failures(std::chrono::milliseconds(0));
  }
  const RoundAction action =
      decide_after_round(e.kind, session_->dynamic(), restart_count_, config_.max_restarts);
  if (keep_workers_ && action != RoundAction::kReform) stop_kept_workers(SIGTERM);
  switch (action) {
    case RoundAction::kRejoin: {
      // The rejoin forms the next round itself.
      set_phase("rendezvous");
      WaitingWindow waiting(*this);
      return session_->rejoin(e.detail, e.store_stopped) ? Next{Next::kAgainNow}
                                                         : Next{kExitAgentError};
    }
    case RoundAction::kStoreLost:
      spdlog::error("lost the rendezvous store at {} ({}): {}; giving up",
                    session_->store_endpoint(), session_->backend(), e.describe());
      std::fprintf(stderr, "trun: error: lost the rendezvous store at %s: %s\n",
                   session_->store_endpoint().c_str(), e.detail.c_str());
      return Next{kExitAgentError};
    case RoundAction::kJobClosed:
      spdlog::error("the job was closed by node {}: {}", e.node_id, e.detail);
      return Next{kExitWorkersFailed};
    case RoundAction::kNoRestartsLeft:
      TRUN_CHECK(root != nullptr, "no restarts left after a " << e.describe());
      std::fprintf(stderr,
                   "trun: error: the worker group failed on node %s and no restarts are "
                   "left (%d/%d)\n%s\n",
                   root->node_id.c_str(), restart_count_, config_.max_restarts,
                   root_cause_line(*root).c_str());
      std::fflush(stderr);
      session_->close_job();
      return Next{kExitWorkersFailed};
    case RoundAction::kRestart:
      TRUN_CHECK(root != nullptr, "a counted restart after a " << e.describe());
      spdlog::warn("worker failure on node {}; {}", root->node_id, root_cause_line(*root));
      if (crash_loop_reached(root->detail)) {
        announce_crash_loop(root->detail);
        session_->close_job();
        return Next{kExitCrashLoop};
      }
      return Next{Next::kAgain, true};
    case RoundAction::kReform:
      crash_loop_ = CrashLoop{};  // an attempt that ended without failing breaks a streak
      spdlog::warn("{}: re-forming the group (restart count unchanged: {})", e.describe(),
                   restart_count_);
      return Next{Next::kAgain};
  }
  return Next{kExitAgentError};
}

// The group stopped on its own (success, failure) or after a signal: the next step.
Agent::Next Agent::after_stop(GroupOutcome outcome) {
  if (stepped_out_) {
    // This node left the round (excluded): it sits out, then joins as a new node.
    stepped_out_ = false;
    if (outcome == GroupOutcome::kRoundOver) return Next{Next::kAgain};
  }
  if (outcome == GroupOutcome::kRoundOver) return after_round_over();
  const AfterStop next =
      decide_after_stop(outcome, received_signal_, restart_count_, config_.max_restarts);
  // Ends the round on every node: they restart too, or give up with this root cause.
  if (outcome == GroupOutcome::kFailed) {
    const std::string line = failure_line(failures_, hostname_);
    const int64_t at =
        failures_.empty() ? unix_ms() : failures_[root_cause_index(failures_)].exited_at_ms;
    session_->report_worker_failure(line, at);
    snap_.last_failure = line;
    status_.last_failure = snap_.last_failure;
    status_.last_failure_at = unix_seconds();
    if (!failures_.empty()) {
      const auto& root = failures_[root_cause_index(failures_)];
      event("trun.agent.failure", {{"local_rank", int64_t{root.local_rank}},
                                   {"global_rank", int64_t{root.rank}},
                                   {"exitcode", int64_t{root.exitcode}},
                                   {"raw_error", failure_line(failures_, hostname_)},
                                   {"failed_workers", int64_t(failures_.size())},
                                   {"restart", next.restart}});
    }
    std::string id = session_->node_id();
    resolve_root_cause(rendezvous::FailureReport{id.empty() ? hostname_ : id, line, at});
  }
  if (!next.restart) {
    finish(outcome);
    return Next{next.exit_code};
  }
  if (outcome == GroupOutcome::kFailed && exclude_after_failure()) {
    // This node's own failures sit it out; its program is not in a crash loop for that.
    crash_loop_ = CrashLoop{};
    return Next{Next::kAgain, true};
  }
  // crash_looped_: the guard was reached by a failure that would have been replaced in place
  // (replace_in_place counted it, with that worker's own progress).
  if (const std::string& root_line = root_cause_ ? root_cause_->detail : snap_.last_failure;
      outcome == GroupOutcome::kFailed &&
      (crash_looped_ || (!crash_loop_recorded_ && crash_loop_reached(root_line)))) {
    finish(outcome);  // the failure summary, and the job closed on every node
    announce_crash_loop(root_line);
    return Next{kExitCrashLoop};
  }
  for (const auto& f : failures_) {
    spdlog::warn("worker group failed (attempt {}): rank {} (local_rank {}) exited with {}",
                 restart_count_, f.rank, f.local_rank,
                 f.exitcode < 0 ? signal_name(-f.exitcode) : std::to_string(f.exitcode));
  }
  return Next{Next::kAgain, true};
}

// Before the next attempt: counts the restart and forms the next round where there are others.
// Returns false (the agent exits 3) when that round cannot be formed.
bool Agent::prepare_next_attempt(const Next& next, bool after_round) {
  if (next.counted) {
    ++restart_count_;
    spdlog::warn("restarting the worker group ({}/{} restarts)", restart_count_,
                 config_.max_restarts);
  }
  event("trun.agent.restart",
        {{"counted", next.counted},
         {"max_restarts", int64_t{config_.max_restarts}},
         {"reason", std::string(after_round ? "round over" : "worker failure")}});
  snap_.restarts = restart_count_;
  const bool same_round = next.kind == Next::kAgainNow || !session_->multi_node();
  // What this group taught the hang watch goes to the store before this node joins the next
  // round, so that every node, reading it when that round has formed (start_workers), sees every
  // member's. Only when the store has just answered: one that is gone or cut off would hold the
  // restart for its timeout once more.
  if (publish_status(same_round ? "running" : "rendezvous")) agree_hang_timeouts();
  if (next.kind != Next::kAgainNow && !keep_workers_) {
    sit_out_exclusion();
    wait_until_healthy(next.counted ? "after the failure" : "before rejoining");
  }
  if (same_round) return true;
  // Workers kept for the next round keep the node in its running phase; the goodput account
  // splits their pause when they re-form (reform_kept_workers).
  if (!keep_workers_) set_phase("rendezvous");
  WaitingWindow waiting(*this);
  try {
    session_->next_round();
    return true;
  } catch (const RendezvousInterrupted&) {
    throw;
  } catch (const rendezvous::RendezvousClosedError& ex) {
    spdlog::error("rendezvous for the restart failed: the job has finished: {}", ex.what());
  } catch (const rendezvous::RendezvousTimeoutError& ex) {
    // join_timeout passed with the store answering: rejoining (on the store host: a new, empty
    // store) would only bypass what held the round, e.g. the lack of a majority.
    spdlog::error("rendezvous for the restart failed: {}", ex.what());
    std::fprintf(stderr, "trun: error: %s\n", ex.what());
    std::fflush(stderr);
  } catch (const std::exception& ex) {
    // The store may be gone (the round ended with it, or the failure report could not reach
    // it): a dynamic backend rejoins, moving the store if it must.
    if (session_->dynamic() &&
        session_->rejoin(
            ex.what(), dynamic_cast<const rendezvous::RendezvousStoreGoneError*>(&ex) != nullptr)) {
      return true;
    }
    spdlog::error("rendezvous for the restart failed: {}", ex.what());
  }
  return false;
}

bool Agent::attempt_made_progress() const {
  if (hang_ && hang_->steps_taken() > 0) return true;
  const Clock::TimePoint end = stop_began_.value_or(clock_.now());
  return end - attempt_started_ >= config_.crash_loop_uptime;
}

bool Agent::crash_loop_reached(const std::string& root_line, std::optional<bool> made_progress) {
  const bool progress = made_progress ? *made_progress : attempt_made_progress();
  crash_loop_.record_failure(progress, failure_signature(root_line));
  if (crash_loop_.reached(config_.crash_loop_limit)) return true;
  if (!progress && crash_loop_.streak > 1 && config_.crash_loop_limit > 0) {
    spdlog::warn(
        "the same failure {} times in a row, no progress ({}); the crash-loop guard "
        "stops the job at {}",
        crash_loop_.streak, crash_loop_.signature, config_.crash_loop_limit);
  }
  return false;
}

void Agent::announce_crash_loop(const std::string& root_line) {
  const std::string& signature = crash_loop_.signature;
  const long uptime_s = static_cast<long>(
      std::chrono::duration_cast<std::chrono::seconds>(config_.crash_loop_uptime).count());
  std::fprintf(stderr,
               "trun: error: the same failure %d times in a row, no progress: %s (no worker "
               "completed a step, and no attempt ran %ld s); stopping with exit code %d "
               "instead of restarting (%d of %d restarts used; --crash-loop-limit=0 turns "
               "this off)\ntrun: the last failure: %s\n",
               crash_loop_.streak, signature.c_str(), uptime_s, kExitCrashLoop, restart_count_,
               config_.max_restarts, root_line.c_str());
  std::fflush(stderr);
  event("trun.agent.crash_loop", {{"streak", int64_t{crash_loop_.streak}},
                                  {"limit", int64_t{config_.crash_loop_limit}},
                                  {"failure", signature},
                                  {"last_failure", root_line}});
}

const RootCause& Agent::resolve_root_cause(const std::optional<rendezvous::FailureReport>& own) {
  std::vector<rendezvous::FailureReport> reports =
      session_->round_failures(config_.shutdown_timeout + kReportGrace);
  if (own) {
    // A single node, or the store did not answer: this node's own report still counts.
    bool found = false;
    for (const auto& r : reports) found = found || r.node_id == own->node_id;
    if (!found) reports.push_back(*own);
  }
  const auto pick = rendezvous::root_cause(reports);
  RootCause rc;
  if (pick) {
    rc.node_id = pick->node_id;
    rc.detail = pick->detail;
    rc.failed_at_ms = pick->failed_at_ms;
    rc.local = own && pick->node_id == own->node_id;
  } else {  // nobody's report could be read: the round's first record
    const auto& e = session_->round_over();
    rc.node_id = e ? e->node_id : std::string();
    rc.detail = e ? e->detail : std::string("unknown");
  }
  root_cause_ = rc;
  status_.root_cause = rc.detail;
  status_.root_cause_node = rc.node_id;
  status_.root_cause_at = rc.failed_at_ms >= 0 ? static_cast<double>(rc.failed_at_ms) / 1000 : 0;
  status_.root_cause_round = session_->info().round;
  EventMetadata md{{"round", int64_t{session_->info().round}},
                   {"node_id", rc.node_id},
                   {"failed_at_ms", int64_t{rc.failed_at_ms}},
                   {"message", rc.detail},
                   {"local", rc.local},
                   {"reports", int64_t(reports.size())}};
  if (rc.local && !failures_.empty()) {
    const auto& f = failures_[root_cause_index(failures_)];
    md["local_rank"] = int64_t{f.local_rank};
    md["global_rank"] = int64_t{f.rank};
    md["exitcode"] = int64_t{f.exitcode};
  }
  event("trun.agent.root_cause", std::move(md));
  if (reports.size() > 1 || !rc.local) spdlog::warn("{}", root_cause_line(rc));
  return *root_cause_;
}

}  // namespace trun::agent
