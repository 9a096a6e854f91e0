#include "worker_sdk/src/waiting_store.h"

#include <algorithm>
#include <cstdio>

namespace trun::worker::detail {
namespace {

using Clock = std::chrono::steady_clock;

long long whole_seconds(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::seconds>(d + std::chrono::milliseconds(500))
      .count();
}

}  // namespace

void wait_reporting(const std::string& who, const std::string& what,
                    std::chrono::milliseconds timeout,
                    const std::function<void(std::chrono::milliseconds)>& attempt,
                    const std::function<std::string()>& abandon) {
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  auto next_report = start + kFirstWaitReport;
  const long long up_to = whole_seconds(timeout);
  for (;;) {
    const auto now = Clock::now();
    auto until = std::min(deadline, next_report);
    if (abandon) {
      if (const std::string why = abandon(); !why.empty())
        throw AbandonedWaitError(who + ": stopped waiting for " + what + ": " + why);
      until = std::min(until, now + kAbandonCheck);
    }
    const auto slice = std::max(std::chrono::milliseconds(1),
                                std::chrono::ceil<std::chrono::milliseconds>(until - now));
    try {
      attempt(slice);
      return;
    } catch (const store::StoreTimeoutError& e) {
      const auto after = Clock::now();
      if (after >= deadline)
        throw store::StoreTimeoutError(who + ": gave up after " +
                                       std::to_string(whole_seconds(after - start)) +
                                       " s waiting for " + what + ": " + e.what());
      if (after >= next_report) {
        std::fprintf(stderr,
                     "[trun.worker] %s: waiting %lld s so far for %s; waiting up to %lld s\n",
                     who.c_str(), whole_seconds(after - start), what.c_str(), up_to);
        std::fflush(stderr);
        while (next_report <= after) next_report += kWaitReportEvery;
      }
    }
  }
}

WaitingStore::WaitingStore(std::shared_ptr<store::Store> base, std::string who, std::string purpose,
                           std::string where, std::function<std::string()> abandon)
    : base_(std::move(base)),
      who_(std::move(who)),
      purpose_(std::move(purpose)),
      where_(std::move(where)),
      abandon_(std::move(abandon)) {
  set_timeout(base_->timeout());
}

std::string WaitingStore::what(const std::vector<std::string>& keys) const {
  std::string names;
  const size_t shown = std::min<size_t>(keys.size(), 3);
  for (size_t i = 0; i < shown; ++i) names += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > shown) names += ", ... (" + std::to_string(keys.size()) + " keys)";
  return purpose_ + " (key" + (keys.size() == 1 ? " " : "s ") + names + ") in " + where_;
}

std::string WaitingStore::get(const std::string& key, Duration timeout) {
  std::string out;
  wait_reporting(
      who_, what({key}), timeout, [&](Duration slice) { out = base_->get(key, slice); }, abandon_);
  return out;
}

void WaitingStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  wait_reporting(
      who_, what(keys), timeout, [&](Duration slice) { base_->wait(keys, slice); }, abandon_);
}

std::vector<std::string> WaitingStore::multi_get(const std::vector<std::string>& keys,
                                                 Duration timeout) {
  std::vector<std::string> out;
  wait_reporting(
      who_, what(keys), timeout, [&](Duration slice) { out = base_->multi_get(keys, slice); },
      abandon_);
  return out;
}

}  // namespace trun::worker::detail
