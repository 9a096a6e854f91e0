#pragma once
// RawSocket: a plain TCP connection to a store on 127.0.0.1, for tests that send exactly the
// bytes they want (garbage, half messages, floods) and read exactly what comes back. Every call
// is bounded in time; failures to connect or to send are Catch2 REQUIREs.

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace trun::testing {

class RawSocket {
 public:
  using Clock = std::chrono::steady_clock;

  explicit RawSocket(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  }
  ~RawSocket() { close(); }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }

  // Sends every byte (within 10 s; REQUIREd).
  void send(const std::string& bytes) {
    size_t off = 0;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (off < bytes.size() && Clock::now() < deadline) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n > 0) off += static_cast<size_t>(n);
      if (n < 0 && errno != EINTR && errno != EAGAIN) break;
    }
    REQUIRE(off == bytes.size());
  }
  // Sends what the socket takes now without blocking: the count, 0 when it takes nothing, -1
  // when the peer is gone.
  ssize_t send_some(std::string_view bytes) {
    ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    return n;
  }
  // Exactly `n` bytes, or fewer when the peer closed or `timeout` passed.
  std::string recv(size_t n, std::chrono::milliseconds timeout) {
    std::string out;
    recv_into(&out, n, timeout);
    return out;
  }
  // Reads exactly `n` bytes into *out within `timeout`; false if they did not all come.
  bool recv_exact(std::string* out, size_t n, std::chrono::milliseconds timeout) {
    out->clear();
    return recv_into(out, n, timeout);
  }
  // True when the peer closed the connection within `timeout` (any bytes before are dropped).
  bool closed_by_peer(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    char buf[65536];
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    }
    return false;
  }
  // Nothing arrives within `timeout` (and the connection stays open).
  bool silent_for(std::chrono::milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(timeout.count())) == 0;
  }

 private:
  bool recv_into(std::string* out, size_t n, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    char buf[65536];
    while (out->size() < n && Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      ssize_t got = ::recv(fd_, buf, std::min(sizeof(buf), n - out->size()), 0);
      if (got <= 0) break;
      out->append(buf, static_cast<size_t>(got));
    }
    return out->size() == n;
  }

  int fd_ = -1;
};

}  // namespace trun::testing
