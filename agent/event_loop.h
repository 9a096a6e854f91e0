#pragma once
// EventLoop: the agent's single-threaded readiness loop (epoll).
//
// The agent waits for three kinds of events only: signals (a signalfd, SIGCHLD included), worker
// output on tee pipes, and one deadline at a time (the shutdown's SIGKILL moment). epoll with a
// timeout covers all three without a helper thread, so the loop is plain Linux rather than Asio.
//
// Deadlines are read on the Clock given at construction (agent/clock.h): with a fake clock that a
// test moved past a deadline, run_once() only polls.
//
// Thread safety: none; use from one thread. Handlers run inside run_once() and may add or remove
// file descriptors (a removed fd's pending event in the same round is dropped).

#include <chrono>
#include <functional>
#include <map>
#include <optional>

#include "agent/clock.h"

namespace trun::agent {

class EventLoop {
 public:
  using Handler = std::function<void(uint32_t events)>;

  // `clock` (not owned) must outlive the loop. Throws std::system_error.
  explicit EventLoop(const Clock& clock = steady_clock());
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Watches `fd` (not owned) for `events` (EPOLLIN, ...). Throws std::system_error.
  void add(int fd, uint32_t events, Handler handler);
  void remove(int fd);
  bool empty() const { return handlers_.empty(); }

  // Waits until some fd is ready (running its handlers) or `deadline` passes; nullopt waits
  // without a deadline. Returns after one batch of events, or at the deadline.
  void run_once(std::optional<Clock::TimePoint> deadline);

 private:
  const Clock& clock_;
  int epfd_ = -1;
  std::map<int, Handler> handlers_;
};

}  // namespace trun::agent
