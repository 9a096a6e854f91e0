// Stopping the agent's worker group and ending the job on this node (agent/agent.h): the stop
// signal and SIGKILL, the failure summary and exit barrier, and the cleanup.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "agent/agent.h"
#include "agent/job_local.h"

namespace trun::agent {

namespace fs = std::filesystem;

// The job ends on this node: the failure summary, the exit barrier, closing the rendezvous.
void Agent::finish(GroupOutcome outcome) {
  if (outcome == GroupOutcome::kFailed && !failures_.empty()) {
    const bool across = root_cause_ && session_->multi_node();
    std::string summary = format_summary(config_.entrypoint_name, failures_, hostname_,
                                         across ? &*root_cause_ : nullptr);
    if (across) summary += "trun: " + root_cause_line(*root_cause_) + "\n";
    summary += replaced_summary();
    std::fputs(summary.c_str(), stderr);
    std::fflush(stderr);
    const auto& root = failures_[root_cause_index(failures_)];
    if (const char* ef = std::getenv("TORCHELASTIC_ERROR_FILE"); ef && *ef) {
      if (!write_root_cause(ef, root)) {
        spdlog::error("cannot write the root cause to TORCHELASTIC_ERROR_FILE={}", ef);
      }
    }
  } else if (outcome == GroupOutcome::kSignaled) {
    spdlog::warn("stopped the workers after {}; exiting with {}", signal_name(received_signal_),
                 kExitSignalBase + received_signal_);
  } else if (outcome == GroupOutcome::kSucceeded) {
    if (const std::string replaced = replaced_summary(); !replaced.empty()) {
      std::fputs(replaced.c_str(), stderr);
      std::fflush(stderr);
    }
    set_phase("exit_barrier");
    try {
      session_->exit_barrier(config_.exit_barrier_timeout);
    } catch (const std::exception& e) {
      spdlog::warn("exit barrier: {}", e.what());
    }
  }
  if (outcome != GroupOutcome::kSignaled) session_->close_job();
}

void Agent::begin_stop(int sig) {
  if (!stop_began_) stop_began_ = clock_.now();
  if (hang_) hang_->end_group();  // a stopping group is not judged
  end_reformation_watch();
  phase_ = GroupPhase::kStopping;
  set_phase("stopping");
  kill_at_ = clock_.now() + config_.shutdown_timeout;
  stop_events_.reset();
  if (hang_ && outcome_ &&
      (*outcome_ == GroupOutcome::kFailed || *outcome_ == GroupOutcome::kRoundOver)) {
    stop_events_ = hang_->progress_events();
    stop_moved_at_ = clock_.now();
    // Twice the longest interval between two progress events seen in the training loop (a step
    // that computes long without a collective), at least 1 s, at most --shutdown-timeout.
    double longest = 0;
    for (const auto& [c, l] : hang_->learned()) {
      if (c.kind == hang::TimeoutClass::kStep) longest = std::max(longest, l.longest_s);
    }
    const auto grace = std::chrono::duration_cast<Clock::Duration>(
        std::chrono::duration<double>(std::max(1.0, 2 * longest)));
    stall_grace_ =
        std::min(grace, std::chrono::duration_cast<Clock::Duration>(config_.shutdown_timeout));
  }
  for (auto& w : workers_) {
    if (w.group_live) sup_.signal_group(w.pid, sig);
  }
  for (pid_t g : retired_groups_) sup_.signal_group(g, sig);
  if (config_.shutdown_timeout.count() == 0) kill_all();
}

bool Agent::kill_if_stalled() {
  if (!stop_events_ || killed_ || !hang_ || outcome_ == GroupOutcome::kSignaled) return false;
  const std::optional<uint64_t> now_events = hang_->progress_events();
  const auto now = clock_.now();
  if (now_events != stop_events_) {
    stop_events_ = now_events;
    stop_moved_at_ = now;
    return false;
  }
  if (now - stop_moved_at_ < stall_grace_) return false;
  spdlog::warn(
      "the workers made no progress in {} ms after the stop signal (they wait for a peer that is "
      "gone); sending SIGKILL",
      std::chrono::duration_cast<std::chrono::milliseconds>(now - stop_moved_at_).count());
  kill_all();
  return true;
}

void Agent::kill_all() {
  for (auto& w : workers_) {
    if (w.group_live) sup_.signal_group(w.pid, SIGKILL);
  }
  for (pid_t g : retired_groups_) sup_.signal_group(g, SIGKILL);
  killed_ = true;
  killed_at_ = clock_.now();
}

void Agent::cleanup() {
  logs_.reset();
  timer_server_.reset();  // removes its FIFO
  if (hang_) {
    loop_.remove(hang_->notify_fd());
    hang_.reset();  // unlinks the progress board
  }
  if (session_) session_->shutdown();
  remove_worker_shm_segments(run_id_);
  if (temp_base_ && !base_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(base_dir_, ec);
  }
  if (straggler_fd_ >= 0) {
    loop_.remove(straggler_fd_);
    close(straggler_fd_);
    straggler_fd_ = -1;
  }
  if (reform_fd_ >= 0) {
    loop_.remove(reform_fd_);
    close(reform_fd_);
    reform_fd_ = -1;
  }
  if (heartbeat_fd_ >= 0) {
    loop_.remove(heartbeat_fd_);
    close(heartbeat_fd_);
    heartbeat_fd_ = -1;
  }
  metrics_.reset();
  if (sigfd_ >= 0) {
    loop_.remove(sigfd_);
    close(sigfd_);
    sigfd_ = -1;
  }
}

}  // namespace trun::agent
