#include "store/socket_conn.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "base/write_all.h"

namespace trun::store::net {
namespace {

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > INT32_MAX ? INT32_MAX : static_cast<int>(left.count());
}

void wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = remaining_ms(deadline);
    if (ms == 0) throw IoError{true, "timed out"};
    int rc = ::poll(&p, 1, ms);
    if (rc > 0) return;
    if (rc == 0) throw IoError{true, "timed out"};
    if (errno != EINTR) throw IoError{false, std::string("poll: ") + std::strerror(errno)};
  }
}

bool permanent_gai_error(int rc) {
  switch (rc) {
    case EAI_NONAME:
    case EAI_SERVICE:
#ifdef EAI_NODATA
    case EAI_NODATA:
#endif
#ifdef EAI_ADDRFAMILY
    case EAI_ADDRFAMILY:
#endif
      return true;
    default:
      return false;
  }
}

}  // namespace

Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  constexpr std::chrono::milliseconds kMax{1'000'000'000'000};
  return Clock::now() + std::min(timeout, kMax);
}

std::string endpoint_name(const std::string& host, uint16_t port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
         std::to_string(port);
}

int open_socket(const std::string& host, uint16_t port, Clock::time_point deadline,
                OpenError* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    error->what = "cannot resolve host '" + host +
                  "': " + (rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc));
    error->permanent = permanent_gai_error(rc);
    return -1;
  }
  int fd = -1;
  bool all_unreachable = true;  // every address failed with no route to it
  for (addrinfo* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error->what = std::string("socket: ") + std::strerror(errno);
      all_unreachable = false;
      continue;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      int err = errno;
      if (err == EINPROGRESS) {
        // Never past the caller's deadline: an attempt gets what is left of it, no more.
        pollfd p{fd, POLLOUT, 0};
        int prc = ::poll(&p, 1, std::max(1, remaining_ms(deadline)));
        socklen_t len = sizeof(err);
        if (prc <= 0) {
          err = ETIMEDOUT;
        } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
          err = errno;
        }
      }
      if (err != 0 && err != EINPROGRESS) {
        error->what = std::strerror(err);
        all_unreachable = all_unreachable && (err == ENETUNREACH || err == EHOSTUNREACH);
        ::close(fd);
        fd = -1;
      }
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) {
    error->permanent = all_unreachable;
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  return fd;
}

std::string RetryResult::detail() const {
  std::string detail = std::to_string(attempts) + " attempts; last error: " + last.what;
  if (last.what == std::strerror(ECONNREFUSED)) detail += ": nothing listens there";
  return detail;
}

namespace {
std::atomic<bool> g_abandon_retries{false};
}  // namespace

void abandon_connect_retries() { g_abandon_retries = true; }

RetryResult connect_retrying(Clock::time_point deadline,
                             const std::function<int(OpenError* error)>& attempt) {
  RetryResult result;
  std::mt19937 rng(std::random_device{}());
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    if (g_abandon_retries.load() && result.attempts > 0) {
      result.last.what = "abandoned: this process is stopping";
      result.last.permanent = true;
      return result;
    }
    ++result.attempts;
    result.last.permanent = false;
    result.fd = attempt(&result.last);
    if (result.fd >= 0 || result.last.permanent) return result;
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return result;
    std::uniform_real_distribution<double> jitter(0.5, 1.5);
    // Slept in slices of at most 100 ms, so that abandon_connect_retries() takes effect soon.
    const auto pause = std::min<Clock::duration>(
        std::chrono::duration_cast<std::chrono::microseconds>(backoff * jitter(rng)), left);
    const auto wake = Clock::now() + pause;
    for (int i = 0; i < 100 && !g_abandon_retries.load() && Clock::now() < wake; ++i) {
      std::this_thread::sleep_for(
          std::min<Clock::duration>(wake - Clock::now(), std::chrono::milliseconds(100)));
    }
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
}

// base::write_all does the sending; this layer polls a full socket until the deadline (wait_fd
// throws there, so the loop ends).
void write_all(int fd, std::string_view data, Clock::time_point deadline) {
  size_t off = 0;
  while (true) {
    size_t sent = 0;
    const bool ok = base::write_all(fd, data.data() + off, data.size() - off, &sent,
                                    base::WriteCall::kSendNoSignal);
    off += sent;
    if (ok) return;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      throw IoError{false, std::string("send: ") + std::strerror(errno)};
    }
    wait_fd(fd, POLLOUT, deadline);
  }
}

void Reader::exact(void* buf, size_t len) {
  auto* p = static_cast<char*>(buf);
  size_t off = 0;
  while (off < len) {
    ssize_t n = ::recv(fd_, p + off, len - off, 0);
    if (n > 0) {
      off += static_cast<size_t>(n);
    } else if (n == 0) {
      throw IoError{false, "connection closed by the server"};
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_fd(fd_, POLLIN, deadline_);
    } else if (errno != EINTR) {
      throw IoError{false, std::string("recv: ") + std::strerror(errno)};
    }
  }
}

uint8_t Reader::u8() {
  uint8_t v;
  exact(&v, 1);
  return v;
}

uint32_t Reader::u32() {
  uint32_t v;
  exact(&v, sizeof(v));
  return v;
}

int64_t Reader::i64() {
  int64_t v;
  exact(&v, sizeof(v));
  return v;
}

std::string Reader::bytes() {
  uint64_t len;
  exact(&len, sizeof(len));
  if (len > (1ull << 40)) throw IoError{false, "implausible response length"};
  std::string s(len, '\0');
  exact(s.data(), len);
  return s;
}

}  // namespace trun::store::net
