#pragma once
// SignalWatch: while the agent's thread blocks outside its event loop (a rendezvous round forming,
// a store connection retrying), a thread that waits (poll, not read) for one of `signals` to be
// pending and then runs `on_signal` once, e.g. to shut the rendezvous handler down. The signal
// stays pending for the agent's own signalfd. The signals must be blocked (the agent blocks its
// handled signals).
//
// Thread safety: construct, stop() and fired() from one thread; `on_signal` runs on the watch's
// own thread. Errors: when no signalfd or eventfd can be made, it logs at debug level and
// watches nothing.

#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

namespace trun::agent {

class SignalWatch {
 public:
  SignalWatch(const std::vector<int>& signals, std::function<void()> on_signal) {
    sigset_t set;
    sigemptyset(&set);
    for (int s : signals) {
      if (s != SIGCHLD) sigaddset(&set, s);
    }
    if (sigisemptyset(&set)) return;
    sig_fd_ = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (sig_fd_ < 0 || stop_fd_ < 0) {
      spdlog::debug("cannot watch for stop signals during the rendezvous: {}",
                    std::strerror(errno));
      return;
    }
    thread_ = std::thread([this, on_signal = std::move(on_signal)] {
      pollfd fds[2] = {{sig_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
      for (int i = 0; i < 1000; ++i) {  // bounded: only EINTR repeats
        const int n = poll(fds, 2, -1);
        if (n < 0 && errno == EINTR) continue;
        if (n > 0 && (fds[0].revents & POLLIN) && !(fds[1].revents & POLLIN)) {
          fired_ = true;
          on_signal();
        }
        return;
      }
    });
  }
  ~SignalWatch() { stop(); }
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;

  // Ends the watch (joins the thread). Idempotent.
  void stop() {
    if (thread_.joinable()) {
      uint64_t one = 1;
      ssize_t n = write(stop_fd_, &one, sizeof one);
      (void)n;
      thread_.join();
    }
    if (sig_fd_ >= 0) close(sig_fd_);
    if (stop_fd_ >= 0) close(stop_fd_);
    sig_fd_ = stop_fd_ = -1;
  }
  bool fired() const { return fired_; }

 private:
  int sig_fd_ = -1;
  int stop_fd_ = -1;
  std::atomic<bool> fired_{false};
  std::thread thread_;
};

}  // namespace trun::agent
