// HangWatch (hang_watch.h): the poll thread beside the agent's loop.

#include "agent/hang_watch.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <set>
#include <system_error>
#include <utility>

namespace trun::agent {

HangWatch::HangWatch(std::unique_ptr<ProgressMonitor> board, HangWatchOptions options)
    : board_(std::move(board)),
      options_(std::move(options)),
      rule_(options_.timeouts),
      tracker_(options_.straggler) {
  event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  thread_ = std::thread([this] { thread_main(); });
}

HangWatch::~HangWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  ::close(event_fd_);
}

void HangWatch::begin_group() {
  std::lock_guard<std::mutex> lock(mu_);
  board_->reset();
  tracker_.reset();
  finding_.reset();
  drain_notify();
  active_ = true;
  reforming_ = false;
  cv_.notify_all();
}

void HangWatch::begin_reformation(const std::vector<int>& slots) {
  std::lock_guard<std::mutex> lock(mu_);  // a poll under way holds it
  for (int slot : slots) board_->reset_slot(slot);
  tracker_.reset();
  finding_.reset();
  drain_notify();
  reforming_ = true;
}

void HangWatch::end_reformation() {
  std::lock_guard<std::mutex> lock(mu_);
  reforming_ = false;
  rule_.forget_progress();
}

void HangWatch::drain_notify() {
  uint64_t drained;
  while (::read(event_fd_, &drained, sizeof drained) > 0) {
  }
}

void HangWatch::end_group() {
  std::lock_guard<std::mutex> lock(mu_);  // a poll under way holds it
  active_ = false;
}

std::vector<straggler::RankStats> HangWatch::straggler_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tracker_.stats();
}

std::optional<uint64_t> HangWatch::progress_events() const {
  std::optional<uint64_t> sum;
  for (int slot = 0; slot < board_->slots(); ++slot) {
    const hang::RankProgress r = board_->snapshot(slot);
    if (r.attached) sum = sum.value_or(0) + r.heartbeat;
  }
  return sum;
}

goodput::Progress HangWatch::goodput_progress(const std::vector<int>& only) const {
  goodput::Progress p;
  bool first = true;
  for (int slot = 0; slot < board_->slots(); ++slot) {
    if (!only.empty() && std::find(only.begin(), only.end(), slot) == only.end()) continue;
    const hang::RankProgress r = board_->snapshot(slot);
    if (!r.attached) continue;
    const double first_step = static_cast<double>(r.first_step_ns) / 1e9;
    const double last_step = static_cast<double>(r.last_step_ns) / 1e9;
    if (first || r.steps < p.steps) {
      p.steps = r.steps;
      p.last_step = last_step;
    }
    p.first_step = first ? first_step : std::max(p.first_step, first_step);
    if (r.resumed_step_plus1 > 0 && !p.resumed_step) p.resumed_step = r.resumed_step_plus1 - 1;
    p.load_seconds = std::max(p.load_seconds, static_cast<double>(r.checkpoint_load_ns) / 1e9);
    p.attached = true;
    first = false;
  }
  return p;
}

uint64_t HangWatch::steps_taken() const {
  uint64_t most = 0;
  for (int slot = 0; slot < board_->slots(); ++slot) {
    const hang::RankProgress r = board_->snapshot(slot);
    if (r.attached) most = std::max(most, r.steps);
  }
  return most;
}

std::map<hang::TimeoutClass, hang::TimeoutRule::Learned> HangWatch::learned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rule_.all_learned();
}

std::vector<std::string> HangWatch::adopt(
    const std::map<hang::TimeoutClass, hang::TimeoutRule::Learned>& others) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> changed;
  for (const auto& [c, l] : others) {
    const std::optional<double> before = rule_.timeout_s(c);
    rule_.adopt(c, l);
    const std::optional<double> after = rule_.timeout_s(c);
    if (before != after && after) {
      char now_s[32], was_s[32] = "none";
      std::snprintf(now_s, sizeof now_s, "%.1f s", *after);
      if (before) std::snprintf(was_s, sizeof was_s, "%.1f s", *before);
      changed.push_back(c.name() + " " + now_s + " (was " + was_s + ")");
    }
  }
  return changed;
}

std::optional<HangWatch::Finding> HangWatch::take_verdict() {
  std::lock_guard<std::mutex> lock(mu_);
  drain_notify();
  std::optional<Finding> f = std::move(finding_);
  finding_.reset();
  if (f) active_ = false;  // one verdict per group
  return f;
}

void HangWatch::thread_main() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (active_ && !reforming_ && !finding_) poll_once();
    cv_.wait_for(lock, options_.poll, [this] { return stop_; });
  }
}

bool HangWatch::waits_for_other_nodes(const hang::Verdict& v,
                                      const std::vector<hang::RankProgress>& ranks) {
  if (!v.culprits.empty()) return false;
  const std::set<int> waiting(v.waiting.begin(), v.waiting.end());
  for (const auto& r : ranks) {
    if (!r.attached || !waiting.count(r.rank)) continue;
    const hang::GroupProgress* g = r.waiting_group();
    if (!g) continue;
    int members_here = 0;
    for (const auto& o : ranks) {
      if (!o.attached) continue;
      for (const auto& og : o.groups) members_here += og.key == g->key ? 1 : 0;
    }
    if (g->group_size > members_here) return true;
  }
  return false;
}

// Under mu_.
void HangWatch::poll_once() {
  polls_.fetch_add(1, std::memory_order_relaxed);
  std::vector<hang::RankProgress> ranks = board_->snapshot_all(options_.node);
  rule_.update(ranks);
  const int64_t now = base::progress::monotonic_ns();
  tracker_.observe(ranks, now);
  hang::Verdict v = hang::judge(ranks, rule_, now);
  if (!v.hung) return;
  if (waits_for_other_nodes(v, ranks)) {
    // Give the node that can name the rank behind the time to do it (see the header).
    double timeout = 0;
    for (const auto& r : ranks) {
      if (r.attached) timeout = std::max(timeout, rule_.timeout_s(hang::class_of(r)).value_or(0));
    }
    const double grace = timeout * options_.remote_grace_factor +
                         std::chrono::duration<double>(options_.remote_grace).count();
    if (v.idle_s < timeout + grace) return;
  }
  Finding f;
  f.verdict = std::move(v);
  std::map<std::string, double> timeouts;
  for (const auto& r : ranks) {
    if (!r.attached) continue;
    const hang::TimeoutClass c = hang::class_of(r);
    if (auto t = rule_.timeout_s(c)) timeouts[c.name()] = *t;
  }
  f.timeouts.assign(timeouts.begin(), timeouts.end());
  f.ranks = std::move(ranks);
  finding_ = std::move(f);
  const uint64_t one = 1;
  if (::write(event_fd_, &one, sizeof one) < 0) {
    // EAGAIN only (the counter is full): it is readable either way.
  }
}

}  // namespace trun::agent
