#include "agent/clock.h"

#include <thread>

namespace trun::agent {
namespace {

class SteadyClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
  void sleep_for(Duration d) override { std::this_thread::sleep_for(d); }
};

}  // namespace

Clock& steady_clock() {
  static SteadyClock clock;
  return clock;
}

}  // namespace trun::agent
