#pragma once
// Clock: where the agent reads the time and waits, so that tests can fake both (a seam, as
// LevelDB's Env). The agent, its event loop and its rendezvous session take a Clock& and never
// call std::chrono::steady_clock themselves.
//
// Time points are steady_clock's, so a fake clock's times can be handed to code that expects the
// real type (deadlines, the rendezvous options' first_round_deadline).
//
// Thread safety: steady_clock() may be used from any thread. A fake needs only to be safe for the
// agent's thread: the agent calls a clock from that thread only.

#include <chrono>

namespace trun::agent {

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Duration = std::chrono::steady_clock::duration;

  virtual ~Clock() = default;
  // Monotonic: never goes back.
  virtual TimePoint now() const = 0;
  // Blocks the calling thread for `d` (a fake advances its time instead). Never throws.
  virtual void sleep_for(Duration d) = 0;
};

// The real clock: std::chrono::steady_clock and std::this_thread::sleep_for. Lives for the whole
// program.
Clock& steady_clock();

}  // namespace trun::agent
