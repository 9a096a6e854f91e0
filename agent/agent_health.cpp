// The health gate around rendezvous joins (agent/agent.h, agent/health_gate.h, docs/health.md).
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "agent/agent.h"
#include "agent/node_status.h"
#include "base/progress_board.h"
#include "store/store.h"

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
  if (p.after <= 0) return false;
  char why[160];
  if (hang_blamed_rank_ >= 0) {
    // A hang verdict names the rank everybody waited for: one is enough.
    std::snprintf(why, sizeof why, "a hang verdict blamed its rank %d", hang_blamed_rank_);
  } else {
    if (!exclusion_.record_failure(p, monotonic_seconds())) return false;
    std::snprintf(why, sizeof why, "its workers failed %d times within %.0f s", p.after,
                  p.window_s);
  }
  // The nodes the next round can have without this one: the other members of this round and
  // the spares waiting for the next, the nodes waiting for it (spares, and members that rejoined
  // first), or the round that the others already formed without it, whichever is more. A member
  // that has died is counted until the next round shows it gone, as before exclusion existed.
  const int others = session_->info().group_world_size - 1;
  const int left = std::max({others + session_->newcomers_waiting_now(),
                             session_->nodes_waiting_now(), session_->nodes_gone_on_now()});
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
  exclude_node(why, left);
  return true;
}

void Agent::exclude_node(const std::string& why, int nodes_left) {
  const ExclusionPolicy& p = config_.exclusion;
  const double cooldown = exclusion_.next_cooldown(p);
  excluded_until_ = clock_.now() + std::chrono::duration_cast<Clock::Duration>(
                                       std::chrono::duration<double>(cooldown));
  status_.excluded = why;
  status_.excluded_until = unix_seconds() + cooldown;
  // In the store before it is said anywhere: an agent killed right after the line (the test
  // does that) must not have left its exclusion unrecorded.
  save_exclusion(why, cooldown);
  std::fprintf(stderr,
               "trun: node %s is excluded for %.0f s (exclusion %d): %s; it sits out the next "
               "rounds, then joins again if it passes its health gate\n",
               hostname_.c_str(), cooldown, exclusion_.times, why.c_str());
  std::fflush(stderr);
  event("trun.agent.excluded", {{"reason", why},
                                {"cooldown_s", cooldown},
                                {"times", int64_t{exclusion_.times}},
                                {"nodes_left", int64_t{nodes_left}}});
}

std::string Agent::node_name() const {
  return config_.rdzv.local_addr.empty() ? hostname_ : hostname_ + "@" + config_.rdzv.local_addr;
}

void Agent::save_exclusion(const std::string& why, double cooldown_s) {
  const std::shared_ptr<store::Store> store = session_ ? session_->job_store() : nullptr;
  if (!store) return;
  ExclusionRecord record;
  record.times = exclusion_.times;
  record.until = unix_seconds() + cooldown_s;
  record.reason = why;
  record.node_id = session_->node_id();
  try {
    store->set(exclusion_key(run_id_, node_name()), encode_exclusion(record));
  } catch (const std::exception& e) {
    spdlog::warn(
        "cannot keep this node's exclusion in the job's store (a restarted agent would "
        "not know of it): {}",
        e.what());
  }
}

void Agent::restore_exclusion() {
  if (config_.exclusion.after <= 0 || !session_ || !session_->dynamic()) return;
  const std::shared_ptr<store::Store> store = session_->job_store();
  if (!store) return;
  std::optional<ExclusionRecord> record;
  try {
    const std::string key = exclusion_key(run_id_, node_name());
    if (store->check({key})) record = decode_exclusion(store->get(key));
  } catch (const std::exception& e) {
    spdlog::warn("cannot read this node's exclusion record in the job's store: {}", e.what());
    return;
  }
  if (!record || record->times <= 0) return;
  if (!record->node_id.empty() && record->node_id != session_->node_id()) {
    // The agent that wrote it is gone (this one replaces it): its status record says so, and
    // `trun status` no longer lists it as outside the rounds.
    try {
      const std::string key = node_status_key(run_id_, record->node_id);
      std::optional<NodeStatus> old;
      if (store->check({key})) old = decode_node_status(store->get(key));
      if (old && old->state != "restarted") {
        old->state = "restarted";
        store->set(key, encode_node_status(*old));
      }
    } catch (const std::exception& e) {
      spdlog::debug("retiring the previous agent's status record: {}", e.what());
    }
  }
  exclusion_.times = std::max(exclusion_.times, record->times);
  const double left = record->until - unix_seconds();
  if (left <= 0) {
    spdlog::info(
        "this node was excluded {} time(s) earlier in this job (the next exclusion is "
        "longer)",
        record->times);
    return;
  }
  excluded_until_ = clock_.now() + std::chrono::duration_cast<Clock::Duration>(
                                       std::chrono::duration<double>(left));
  std::fprintf(stderr,
               "trun: node %s is still excluded for %.0f s (exclusion %d, kept in the job's "
               "store): %s; it sits out, then joins if it passes its health gate\n",
               hostname_.c_str(), left, record->times, record->reason.c_str());
  std::fflush(stderr);
  event("trun.agent.excluded", {{"reason", record->reason},
                                {"cooldown_s", left},
                                {"times", int64_t{record->times}},
                                {"restored", true}});
  status_.excluded = record->reason;
  status_.excluded_until = record->until;
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
