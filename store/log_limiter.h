#pragma once
// Private to rendezvous/: LogLimiter lets a repeated warning through at most `burst` times per
// `interval` and counts the rest, so a condition that recurs in a loop (accept failing with
// EMFILE, a flood of misbehaving clients) costs a few lines, each saying how many it stands for,
// instead of one line per iteration. A pure function of the time passed in (tests fake it).
// Not thread-safe: one per event loop or per thread.

#include <chrono>
#include <cstdint>

namespace trun::store {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LogLimiter(Clock::duration interval, int burst = 1)
      : interval_(interval), burst_(burst) {}

  // True when a line may be logged at `now`. Then *suppressed is how many lines were held back
  // since the last one let through (and that count restarts); otherwise this one is counted.
  bool allow(Clock::time_point now, uint64_t* suppressed) {
    if (!started_ || now - window_start_ >= interval_) {
      started_ = true;
      window_start_ = now;
      used_ = 0;
    }
    if (used_ >= burst_) {
      ++suppressed_;
      return false;
    }
    ++used_;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  Clock::duration interval_;
  int burst_;
  bool started_ = false;
  Clock::time_point window_start_{};
  int used_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace trun::store
