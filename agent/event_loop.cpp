#include "agent/event_loop.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace trun::agent {

EventLoop::EventLoop(const Clock& clock) : clock_(clock) {
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
}

EventLoop::~EventLoop() {
  if (epfd_ >= 0) close(epfd_);
}

void EventLoop::add(int fd, uint32_t events, Handler handler) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    throw std::system_error(errno, std::generic_category(), "epoll_ctl(ADD)");
  }
  handlers_[fd] = std::move(handler);
}

void EventLoop::remove(int fd) {
  if (handlers_.erase(fd) > 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
}

void EventLoop::run_once(std::optional<Clock::TimePoint> deadline) {
  int timeout_ms = -1;
  if (deadline) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - clock_.now()).count();
    timeout_ms = left < 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
  }
  epoll_event events[32];
  int n = epoll_wait(epfd_, events, 32, timeout_ms);
  if (n < 0) {
    if (errno == EINTR) return;
    throw std::system_error(errno, std::generic_category(), "epoll_wait");
  }
  for (int i = 0; i < n; ++i) {
    auto it = handlers_.find(events[i].data.fd);
    if (it == handlers_.end()) continue;  // removed by an earlier handler in this batch
    Handler h = it->second;               // a copy: the handler may remove itself
    h(events[i].events);
  }
}

}  // namespace trun::agent
