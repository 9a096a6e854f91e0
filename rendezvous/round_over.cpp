// The round-over side of RoundRendezvous (round_rendezvous.h): waiting for the round's "over" key
// (wait_round_over), the callback thread that pushes it, and the failure reports every node of
// the round appends and reads back (report_worker_failure, round_failures).
#include "rendezvous/round_rendezvous.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>
#include <thread>

namespace trun::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

std::optional<RoundEvent> RoundRendezvous::wait_round_over(std::chrono::milliseconds timeout) {
  int64_t k;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) {
      RoundEvent e;
      e.kind = RoundEvent::Kind::kShutdown;
      e.round = round_;
      return e;
    }
    if (round_ < 0) {
      throw RendezvousError(error_prefix() + ": wait_round_over before the first round");
    }
    if (event_) return event_;
    if (local_event_) return local_event_;
    k = round_;
  }
  std::optional<std::string> log;
  std::string error;
  bool stopped = false;
  try {
    log = backend_->wait_get(over_key(k), timeout);
  } catch (const store::StoreError& e) {
    error = e.what();
    stopped = dynamic_cast<const store::StoreGoneError*>(&e) != nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) {
    RoundEvent e;
    e.kind = RoundEvent::Kind::kShutdown;
    e.round = k;
    return e;
  }
  if (local_event_) return local_event_;
  if (!error.empty()) {
    RoundEvent e;
    e.kind = RoundEvent::Kind::kStoreLost;
    e.round = k;
    e.detail = error;
    e.store_stopped = stopped;
    local_event_ = e;
    return e;
  }
  if (!log) return std::nullopt;
  RoundEvent e = dynamic::round_event(k, *log, options_.node_id);
  if (round_ == k && !event_) event_ = e;
  return e;
}

void RoundRendezvous::set_round_over_callback(std::function<void(const RoundEvent&)> callback) {
  std::unique_lock<std::mutex> lock(mu_);
  callback_ = std::move(callback);
  if (callback_ && !callback_thread_.joinable() && !shut_down_) {
    callback_thread_ = std::thread([this] { callback_loop(); });
  }
}

void RoundRendezvous::callback_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return shut_down_ || (in_round_ && round_ > delivered_round_); });
      if (shut_down_) return;
    }
    auto event = wait_round_over(std::chrono::hours(1));
    if (!event) continue;
    std::function<void(const RoundEvent&)> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (event->kind == RoundEvent::Kind::kShutdown) return;
      delivered_round_ = event->round;
      cb = callback_;
    }
    if (cb) {
      try {
        cb(*event);
      } catch (const std::exception& e) {
        spdlog::error("{}: round-over callback threw: {}", error_prefix(), e.what());
      }
    }
    if (event->kind == RoundEvent::Kind::kStoreLost) return;
  }
}

void RoundRendezvous::report_worker_failure(const std::string& detail, int64_t failed_at_ms) {
  int64_t k;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Also when the round is already over (event_): the root cause is the earliest of all
    // reports, and this one may be it although another node reported first.
    if (shut_down_ || !in_round_) return;
    k = round_;
  }
  dynamic::OverRecord record{RoundEvent::Kind::kWorkerFailed, options_.node_id, detail};
  record.failed_at_ms = failed_at_ms;
  try {
    backend_->append(over_key(k), dynamic::encode_over(record));
  } catch (const store::StoreError& e) {
    throw RendezvousError(error_prefix() + ": cannot report the worker failure: " + e.what());
  }
}

std::vector<FailureReport> RoundRendezvous::round_failures(std::chrono::milliseconds grace) {
  int64_t k;
  size_t members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_ || !in_round_ || stopped_round_ == round_) return {};
    stopped_round_ = round_;
    k = round_;
    members = static_cast<size_t>(std::max(world_size_, 1));
  }
  const std::string over = over_key(k);
  const std::string stopped_key = dynamic::stopped_key(over);
  const auto deadline = Clock::now() + grace;
  try {
    int64_t stopped = backend_->add(stopped_key, 1);
    std::vector<dynamic::OverRecord> records;
    // Bounded by `grace`; polls 20 ms apart at first, then less often (up to 500 ms), so that a
    // large round's nodes waiting for a slow one do not flood the store. A member that left (its
    // lease lapsed, it shut down) never says it stopped, and counts as done.
    auto pause = std::chrono::milliseconds(20);
    for (;;) {
      const auto log = backend_->try_get(over);
      records = log ? dynamic::parse_over(*log) : std::vector<dynamic::OverRecord>{};
      std::set<std::string> left;
      for (const auto& r : records) {
        if (r.kind == RoundEvent::Kind::kNodeLeft) left.insert(r.node_id);
      }
      if (static_cast<size_t>(std::max<int64_t>(stopped, 0)) + left.size() >= members ||
          Clock::now() >= deadline) {
        break;
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_for(lock, pause, [&] { return shut_down_; })) break;
      }
      pause = std::min<std::chrono::milliseconds>(pause * 2, std::chrono::milliseconds(500));
      stopped = backend_->add(stopped_key, 0);
    }
    return dynamic::failure_reports(records);
  } catch (const store::StoreError& e) {
    throw RendezvousError(error_prefix() +
                          ": cannot read the round's failure reports: " + e.what());
  }
}

}  // namespace trun::rendezvous
