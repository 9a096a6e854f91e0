#pragma once
// ReformWatch: how the nodes of a multi-node round learn that one of them replaced a failed worker
// in place (a resilient loop: agent/agent_replace.cpp, docs/launcher.md). That node takes the
// next generation from a counter in the round's store (an atomic add); every other node reads
// the counter every `interval` on a thread of its own and, when it went up, moves its own
// progress board to that generation, so that its workers leave their groups and build new ones
// at the same generation, with the replacement, without a new round and without stopping.
//
// Thread safety: construct and destroy on the agent's thread; `on_change` runs there (through an
// eventfd on the EventLoop). The reading thread only reads the store and posts.
// Blocking: the destructor joins the thread, which waits for at most one store read (bounded by
// the store's timeout; a lost connection fails at once).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "agent/event_loop.h"
#include "store/store.h"

namespace trun::agent {

// The round store's key of the counter (agent/agent_replace.cpp adds 1 to take a generation).
inline constexpr const char* kReformGenerationKey = "reform_generation";

class ReformWatch {
 public:
  // Called on the loop's thread with the counter's newest value, each time it went up.
  using Callback = std::function<void(int64_t generation)>;

  // Starts reading at once. Throws std::system_error when the eventfd cannot be made.
  ReformWatch(std::shared_ptr<store::Store> round_store, std::chrono::milliseconds interval,
              EventLoop& loop, Callback on_change);
  ~ReformWatch();
  ReformWatch(const ReformWatch&) = delete;
  ReformWatch& operator=(const ReformWatch&) = delete;

  // How often a round of `nodes` nodes reads the counter: every 100 ms, and 1 ms more per node
  // past 100, so that the store answers at most about 1000 of these reads a second.
  static std::chrono::milliseconds interval_for(int nodes);

 private:
  void run();

  std::shared_ptr<store::Store> store_;
  const std::chrono::milliseconds interval_;
  EventLoop& loop_;
  Callback on_change_;
  int evfd_ = -1;
  std::atomic<int64_t> latest_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // under mu_
  std::thread thread_;
};

}  // namespace trun::agent
