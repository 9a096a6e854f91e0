// ReformWatch (agent/reform_watch.h).
#include "agent/reform_watch.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <system_error>

namespace trun::agent {

std::chrono::milliseconds ReformWatch::interval_for(int nodes) {
  return std::chrono::milliseconds(std::max(100, nodes));
}

ReformWatch::ReformWatch(std::shared_ptr<store::Store> round_store,
                         std::chrono::milliseconds interval, EventLoop& loop, Callback on_change)
    : store_(std::move(round_store)),
      interval_(interval),
      loop_(loop),
      on_change_(std::move(on_change)) {
  evfd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (evfd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  loop_.add(evfd_, EPOLLIN, [this](uint32_t) {
    uint64_t n;
    while (read(evfd_, &n, sizeof n) > 0) {
    }
    on_change_(latest_.load());
  });
  thread_ = std::thread([this] { run(); });
}

ReformWatch::~ReformWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  loop_.remove(evfd_);
  close(evfd_);
}

void ReformWatch::run() {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, interval_, [this] { return stop_; })) return;
    }
    int64_t value = 0;
    try {
      value = store_->add(kReformGenerationKey, 0);
    } catch (const std::exception&) {
      continue;  // a lost store ends the round: the agent hears that from the rendezvous
    }
    if (value <= seen) continue;
    seen = value;
    latest_.store(value);
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(evfd_, &one, sizeof one);
  }
}

}  // namespace trun::agent
