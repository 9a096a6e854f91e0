#pragma once
// A blocking TCP socket to 127.0.0.1 for the recorded-exchange tests: send exact bytes, read an
// exact number of bytes within a deadline, and tell "nothing more arrived" from "closed".
//
// Not thread-safe; one owner. Closes its descriptor on destruction.

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace trun::test {

// "00 ce f7 85 3c" -> the 5 bytes. Spaces are ignored; anything else than hex digits throws.
inline std::string hex(const std::string& text) {
  std::string out;
  int nibble = -1;
  for (char ch : text) {
    if (ch == ' ' || ch == '\n') continue;
    if (!std::isxdigit(static_cast<unsigned char>(ch))) throw std::invalid_argument(text);
    int v = std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0' : std::tolower(ch) - 'a' + 10;
    if (nibble < 0) {
      nibble = v;
    } else {
      out.push_back(static_cast<char>(nibble * 16 + v));
      nibble = -1;
    }
  }
  if (nibble >= 0) throw std::invalid_argument("odd number of hex digits: " + text);
  return out;
}

// The bytes as "00 ce f7": how failed comparisons print.
inline std::string to_hex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    if (!out.empty()) out.push_back(' ');
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

class RawSocket {
 public:
  explicit RawSocket(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw std::runtime_error("socket failed");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd_);
      throw std::runtime_error("connect to 127.0.0.1:" + std::to_string(port) + " failed");
    }
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;
  ~RawSocket() {
    if (fd_ >= 0) close(fd_);
  }

  void send_bytes(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw std::runtime_error("send failed");
      off += static_cast<size_t>(n);
    }
  }

  // Reads until `n` bytes arrived, the peer closed, or `timeout` passed; returns what arrived.
  std::string recv_bytes(size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::string out;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (out.size() < n) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      pollfd p{fd_, POLLIN, 0};
      int r = poll(&p, 1, static_cast<int>(left.count()));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      char buf[4096];
      ssize_t got = ::recv(fd_, buf, std::min(sizeof(buf), n - out.size()), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        closed_ = true;
        break;
      }
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }

  // True if no byte arrives (and the peer does not close) within `quiet`.
  bool silent_for(std::chrono::milliseconds quiet) {
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, static_cast<int>(quiet.count())) == 0;
  }

  // True once the server has closed the connection (EOF or reset) within `timeout`; stray bytes
  // before the close are discarded.
  bool closed_by_peer(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      recv_bytes(1 << 16, std::chrono::milliseconds(50));
      if (closed_) return true;
    }
    return false;
  }

  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  bool closed_ = false;
};

}  // namespace trun::test
