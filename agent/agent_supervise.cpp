// The agent's supervision (agent/agent.h): the event loop while a worker group runs, the
// signalfd (worker exits, signals to trun), the round-over event and the SIGKILL deadline.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "agent/agent.h"

namespace trun::agent {
namespace {

// After SIGKILL, how long to wait for the kernel to let the workers go before giving up.
constexpr auto kAfterKillGrace = std::chrono::seconds(30);
constexpr auto kStallCheck = std::chrono::milliseconds(200);

}  // namespace

int Agent::running_count() const {
  int n = 0;
  for (const auto& w : workers_) n += w.running ? 1 : 0;
  return n;
}

bool Agent::all_groups_gone() const {
  for (const auto& w : workers_) {
    if (w.group_live) return false;
  }
  return retired_groups_.empty();
}

GroupOutcome Agent::supervise() {
  for (;;) {
    if (phase_ == GroupPhase::kRunning && running_count() == 0) {
      // Every worker exited 0 (a failure would have started the stop). Leftover processes in
      // their groups (background grandchildren) are stopped like workers.
      outcome_ = GroupOutcome::kSucceeded;
      if (!all_groups_gone()) begin_stop(SIGTERM);
    }
    if (outcome_ && running_count() == 0 && all_groups_gone()) break;
    // on_round_over kept the workers for the next round: their output keeps flowing.
    if (outcome_ == GroupOutcome::kRoundOver && keep_workers_) return *outcome_;
    std::optional<Clock::TimePoint> deadline;
    std::optional<Clock::TimePoint> wake;
    if (phase_ == GroupPhase::kStopping) {
      deadline = killed_ ? killed_at_ + kAfterKillGrace : *kill_at_;
      wake = deadline;
      // The stall watch looks again every kStallCheck (kill_if_stalled).
      if (stop_events_ && !killed_) wake = std::min(*deadline, clock_.now() + kStallCheck);
    }
    loop_.run_once(wake);
    if (phase_ == GroupPhase::kStopping && kill_if_stalled()) continue;
    // The phase may have changed inside run_once; only a deadline set before it can expire.
    if (deadline && phase_ == GroupPhase::kStopping && clock_.now() >= *deadline) {
      if (!killed_) {
        spdlog::warn("workers still running {} ms after the stop signal; sending SIGKILL",
                     config_.shutdown_timeout.count());
        kill_all();
      } else {
        throw std::runtime_error("workers did not exit " + std::to_string(kAfterKillGrace.count()) +
                                 " s after SIGKILL");
      }
    }
  }
  logs_->drain();
  logs_.reset();
  return *outcome_;
}

void Agent::on_signalfd() { read_signals(true); }

// Reads the signalfd until it is empty (bounded): each handled signal goes to on_agent_signal;
// a SIGCHLD reaps the exited children when reap_children is set (otherwise the caller reaps).
void Agent::read_signals(bool reap_children) {
  signalfd_siginfo si[16];
  for (int round = 0; round < 64; ++round) {
    ssize_t n = read(sigfd_, si, sizeof si);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    bool child = false;
    for (size_t i = 0; i < static_cast<size_t>(n) / sizeof(signalfd_siginfo); ++i) {
      int sig = static_cast<int>(si[i].ssi_signo);
      if (sig == SIGCHLD) {
        child = true;
      } else {
        on_agent_signal(sig);
      }
    }
    if (child && reap_children) on_children();
  }
}

void Agent::on_children() {
  const GroupPhase phase_before = phase_;
  auto exits = sup_.reap([this](pid_t pid) { return by_pid_.count(pid) > 0; });
  const int64_t reaped_at_ms = unix_ms();
  // A scheduler stopping the job (scancel) signals trun and its workers at the same moment: a
  // worker may exit on its own handler before trun has read its own signal. on_signalfd() reads
  // again after this, and run() once more when the group has stopped, so such an exit ends in
  // the shutdown (128+N), not a restart.
  // This batch's failures, by worker index: replaced in place, or the attempt's (failures_).
  std::vector<std::pair<size_t, WorkerFailure>> failed;
  for (const auto& e : exits) {
    const size_t index = by_pid_.at(e.pid);
    WorkerProcess& w = workers_[index];
    w.running = false;
    w.exitcode = e.exitcode();
    spdlog::debug("worker local_rank={} pid={} exited with {}", w.local_rank, w.pid, w.exitcode);
    // Exits in the same batch as the first failure are failures too: they happened before the
    // stop began.
    // A worker that fails on its own after the stop began (it wrote an error file) is a failure
    // too, so the root cause can be chosen among all of them by their timestamps.
    bool own_failure = phase_before == GroupPhase::kStopping && outcome_ == GroupOutcome::kFailed &&
                       w.exitcode != 0 && std::filesystem::exists(w.error_file);
    const bool is_failure =
        on_worker_exit(phase_before, w.exitcode, 1) == ExitAction::kStopGroupFailed || own_failure;
    EventMetadata md{{"local_rank", int64_t{w.local_rank}},
                     {"global_rank", int64_t{w.rank}},
                     {"worker_pid", int64_t{w.pid}},
                     {"exitcode", int64_t{w.exitcode}},
                     {"state", std::string(is_failure        ? "FAILED"
                                           : w.exitcode == 0 ? "SUCCEEDED"
                                                             : "STOPPED")}};
    if (w.exitcode < 0) md["signal"] = signal_name(-w.exitcode);
    event("trun.agent.worker_exited", std::move(md));
    set_worker_state(static_cast<size_t>(w.local_rank), is_failure        ? "failed"
                                                        : w.exitcode == 0 ? "succeeded"
                                                                          : "stopped");
    if (metrics_ && w.exitcode != 0) {
      // A worker that trun itself stopped (the group stopped after another's failure, a restart,
      // a signal to trun) is no failure of its own: counted under stopped_by="trun".
      ++snap_.worker_exits[(w.exitcode < 0 ? "signal=\"" + signal_name(-w.exitcode) + "\""
                                           : "exit_code=\"" + std::to_string(w.exitcode) + "\"") +
                           (is_failure ? "" : ",stopped_by=\"trun\"")];
    }
    if (is_failure) {
      WorkerFailure f =
          read_failure(w.local_rank, w.rank, w.pid, w.exitcode, w.error_file, failure_seq_++);
      f.exited_at_ms = reaped_at_ms;
      const char* path = std::getenv("PATH");
      f.hint = python_start_hint(config_.python_interpreter, path ? path : "",
                                 std::chrono::duration<double>(clock_.now() - w.started).count(),
                                 w.exitcode, f.message);
      failed.emplace_back(index, std::move(f));
    }
  }
  update_groups();
  const bool running = phase_ == GroupPhase::kRunning;
  if (!failed.empty() && (!running || !replace_in_place(failed))) {
    for (auto& [index, f] : failed) failures_.push_back(std::move(f));
    if (running) {
      outcome_ = GroupOutcome::kFailed;
      begin_stop(SIGTERM);
    }
  }
  publish();
}

void Agent::update_groups() {
  for (auto& w : workers_) {
    if (w.group_live && !w.running && !sup_.group_alive(w.pid)) {
      w.group_live = false;
      sup_.forget_group(w.pid);
    }
  }
  for (size_t i = 0; i < retired_groups_.size();) {
    if (sup_.group_alive(retired_groups_[i])) {
      ++i;
      continue;
    }
    sup_.forget_group(retired_groups_[i]);
    retired_groups_.erase(retired_groups_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

void Agent::on_agent_signal(int sig) {
  if (received_signal_ == 0) {
    received_signal_ = sig;
    if (running_count() > 0 || !all_groups_gone()) {
      spdlog::warn("received {}: forwarding it to the workers and stopping them", signal_name(sig));
    } else {
      spdlog::warn("received {}: stopping", signal_name(sig));
    }
  } else if ((sig == SIGINT || sig == SIGTERM) && phase_ == GroupPhase::kStopping && !killed_) {
    // The user asked twice (a second Ctrl-C): do not make them wait for --shutdown-timeout.
    spdlog::warn("received a second signal ({}) while stopping the workers: sending SIGKILL now",
                 signal_name(sig));
    outcome_ = GroupOutcome::kSignaled;
    kill_all();
    return;
  }
  outcome_ = GroupOutcome::kSignaled;
  // This node leaves: its workers' stop agreement tells the other nodes' resilient loops to go
  // on without it (a whole job's stop reaches every node's agent, and so every rank).
  if (hang_) hang_->mark_node_leaving();
  if (phase_ == GroupPhase::kRunning) {
    begin_stop(sig);
  } else {
    for (auto& w : workers_) {
      if (w.group_live) sup_.signal_group(w.pid, sig);
    }
    for (pid_t g : retired_groups_) sup_.signal_group(g, sig);
  }
}

// A round-over event of the current round, on the loop's thread: it ends the attempt unless the
// group already stops for a local reason.
bool Agent::on_round_over(const rendezvous::RoundEvent& e) {
  if (workers_.empty() || outcome_) return false;
  using Kind = rendezvous::RoundEvent::Kind;
  if ((e.kind == Kind::kNodeJoined || e.kind == Kind::kNodeLeft) && can_keep_workers()) {
    // Resilient loops: the workers keep running (or wait for the next generation, when the
    // node that left held their peers) while the next round forms; then they re-form in it. A
    // planned leave too (that agent got SIGTERM, or its node was excluded): the leaving workers'
    // stop agreement reached these, which saved the agreed step and wait for the next
    // generation, as they were not asked to stop themselves (StopAgreement::stops_here).
    spdlog::warn("{}; the workers keep running (resilient loops) and re-form in the next round",
                 e.describe());
    keep_workers_ = true;
    kept_since_ = monotonic_seconds();
    outcome_ = GroupOutcome::kRoundOver;
    end_reformation_watch();
    hang_->begin_reformation({});
    return true;
  }
  spdlog::warn("{}; stopping the workers", e.describe());
  outcome_ = GroupOutcome::kRoundOver;
  begin_stop(SIGTERM);
  return true;
}

int Agent::after_interrupted_rendezvous() {
  read_signals(false);  // on_agent_signal records it; no workers run now
  if (received_signal_ == 0) {
    spdlog::error("the rendezvous was interrupted, but no signal could be read");
    return kExitAgentError;
  }
  spdlog::warn("{} while waiting in the rendezvous: left it; exiting with {}",
               signal_name(received_signal_), kExitSignalBase + received_signal_);
  return kExitSignalBase + received_signal_;
}

}  // namespace trun::agent
