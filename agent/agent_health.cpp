// The health gate around rendezvous joins (agent/agent.h, agent/health_gate.h, docs/health.md).
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "agent/agent.h"
#include "base/progress_board.h"

namespace trun::agent {

namespace fs = std::filesystem;

namespace {

// The directory itself when it exists, else its nearest existing ancestor (where it would be made).
std::string existing_dir(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  for (int i = 0; i < 256 && !p.empty(); ++i) {
    if (fs::is_directory(p, ec)) return p.string();
    if (p == p.parent_path()) break;
    p = p.parent_path();
  }
  return path;
}

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

HealthOptions Agent::health_options() const {
  HealthOptions h;
  h.command = config_.health_check;
  h.timeout = config_.health_check_timeout;
  h.builtin = config_.health_builtin;
  h.shm_bytes_needed =
      shm_bytes_for(config_.nproc_per_node) +
      static_cast<uint64_t>(config_.nproc_per_node) * sizeof(base::progress::RankRecord);
  if (!config_.log_dir.empty()) h.writable_dirs.push_back(existing_dir(config_.log_dir));
  const char* tmp = std::getenv("TMPDIR");
  h.writable_dirs.push_back(tmp && *tmp ? std::string(tmp) : std::string("/tmp"));
  h.gpus_needed = config_.health_gpus ? config_.nproc_per_node : 0;
  return h;
}

void Agent::sleep_unless_stopped(std::chrono::milliseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  for (int i = 0; i < 1000000 && std::chrono::steady_clock::now() < until; ++i) {
    if (stop_signal_pending(config_.signals_to_handle)) {
      throw RendezvousInterrupted("a stop signal is pending");
    }
    usleep(50 * 1000);
  }
}

void Agent::wait_until_healthy(const char* when) {
  const HealthOptions options = health_options();
  if (!options.builtin && options.command.empty()) return;
  for (int failures = 0; failures < 1000000;) {
    const HealthReport r = check_node_health(options);
    if (!health_notes_shown_) {
      for (const auto& note : r.notes) spdlog::info("health gate: {}", note);
      health_notes_shown_ = true;
    }
    if (!r.output.empty()) {
      spdlog::info("health check output ({} s, {}):\n{}", r.seconds,
                   r.healthy ? "passed" : "failed", r.output);
    }
    if (r.healthy) {
      if (failures > 0) {
        spdlog::warn("this node is healthy again after {} failed check(s); joining", failures);
        event("trun.agent.health", {{"healthy", true}, {"failures", int64_t{failures}}});
        status_.unhealthy.clear();
        snap_.healthy = true;
        publish();
      }
      return;
    }
    ++failures;
    const auto delay = health_retry_delay(failures);
    std::fprintf(stderr,
                 "trun: node %s is unhealthy %s: %s; it stays out of the job and checks again "
                 "in %lld s\n",
                 hostname_.c_str(), when, r.reason.c_str(),
                 static_cast<long long>(delay.count() / 1000));
    std::fflush(stderr);
    event("trun.agent.health", {{"healthy", false},
                                {"reason", r.reason},
                                {"output", r.output},
                                {"failures", int64_t{failures}},
                                {"retry_in_s", delay.count() / 1000.0}});
    status_.unhealthy = r.reason;
    publish_status("unhealthy");
    snap_.healthy = false;
    ++snap_.health_check_failures;
    snap_.phase = "";  // set_phase publishes
    set_phase("unhealthy");
    WaitingWindow waiting(*this);
    sleep_unless_stopped(delay);
  }
}

bool Agent::exclude_after_failure() {
  // Only a node that can be left out of a dynamic rendezvous, and only for its own failures.
  if (!session_ || !session_->multi_node() || !session_->dynamic()) return false;
  if (!root_cause_ || !root_cause_->local) return false;
  const ExclusionPolicy& p = config_.exclusion;
  if (!exclusion_.record_failure(p, monotonic_seconds())) return false;
  // The nodes the next round can have without this one: the other members of this round, or the
  // nodes already waiting for the next (spares, and members that rejoined first), whichever is
  // more. A lower bound (a member that has not rejoined yet and a spare are not both counted), so
  // a node is never excluded on a guess.
  const int others = session_->info().group_world_size - 1;
  const int left = std::max(others, session_->nodes_waiting_now());
  char why[160];
  std::snprintf(why, sizeof why, "its workers failed %d times within %.0f s", p.after, p.window_s);
  if (left < config_.min_nodes) {
    std::fprintf(stderr,
                 "trun: node %s %s, but the job keeps it: without it %d node(s) are left, fewer "
                 "than --nnodes MIN %d\n",
                 hostname_.c_str(), why, left, config_.min_nodes);
    std::fflush(stderr);
    event("trun.agent.exclusion_refused",
          {{"reason", std::string(why)}, {"nodes_left", int64_t{left}}});
    return false;
  }
  const double cooldown = exclusion_.next_cooldown(p);
  excluded_until_ = clock_.now() + std::chrono::duration_cast<Clock::Duration>(
                                       std::chrono::duration<double>(cooldown));
  std::fprintf(stderr,
               "trun: node %s is excluded for %.0f s (exclusion %d): %s; it sits out the next "
               "rounds, then joins again if it passes its health gate\n",
               hostname_.c_str(), cooldown, exclusion_.times, why);
  std::fflush(stderr);
  event("trun.agent.excluded", {{"reason", std::string(why)},
                                {"cooldown_s", cooldown},
                                {"times", int64_t{exclusion_.times}},
                                {"nodes_left", int64_t{left}}});
  status_.excluded = why;
  status_.excluded_until = unix_seconds() + cooldown;
  return true;
}

void Agent::sit_out_exclusion() {
  if (!excluded_until_) return;
  const auto remaining = *excluded_until_ - clock_.now();
  if (remaining > Clock::Duration::zero()) {
    publish_status("excluded");
    set_phase("excluded");
    WaitingWindow waiting(*this);
    sleep_unless_stopped(std::chrono::duration_cast<std::chrono::milliseconds>(remaining));
  }
  excluded_until_.reset();
  status_.excluded.clear();
  status_.excluded_until = 0;
  spdlog::warn("the exclusion of this node is over; joining again");
  event("trun.agent.exclusion_over", {{"times", int64_t{exclusion_.times}}});
}

}  // namespace trun::agent
