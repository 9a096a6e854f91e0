#pragma once
// EventLoop: the agent's single-threaded readiness loop (epoll).
//
// The agent waits for three kinds of events only: signals (a signalfd, SIGCHLD included), worker
// output on tee pipes, and one deadline at a time (the shutdown's SIGKILL moment). epoll with a
// timeout covers all three without a helper thread, so the loop is plain Linux rather than Asio.
//
// Thread safety: none; use from one thread. Handlers run inside run_once() and may add or remove
// file descriptors (a removed fd's pending event in the same round is dropped).

#include <chrono>
#include <functional>
#include <map>
#include <optional>

namespace trun::agent {

class EventLoop {
 public:
  using Clock = std::chrono::steady_clock;
  using Handler = std::function<void(uint32_t events)>;

  EventLoop();  // throws std::system_error
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Watches `fd` (not owned) for `events` (EPOLLIN, ...). Throws std::system_error.
  void add(int fd, uint32_t events, Handler handler);
  void remove(int fd);
  bool empty() const { return handlers_.empty(); }

  // Waits until some fd is ready (running its handlers) or `deadline` passes; nullopt waits
  // without a deadline. Returns after one batch of events, or at the deadline.
  void run_once(std::optional<Clock::time_point> deadline);

 private:
  int epfd_ = -1;
  std::map<int, Handler> handlers_;
};

}  // namespace trun::agent
