#include "rendezvous/store/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "rendezvous/store/auth.h"
#include "rendezvous/store/wire.h"

namespace trun::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;
using wire::Op;

// Transport failure inside one call; translated to StoreError at the API boundary.
struct IoError {
  bool timed_out;
  std::string what;
};

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

void write_all(int fd, std::string_view data, Clock::time_point deadline) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_fd(fd, POLLOUT, deadline);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      throw IoError{false, std::string("send: ") + std::strerror(errno)};
    }
  }
}

class Reader {
 public:
  Reader(int fd, Clock::time_point deadline) : fd_(fd), deadline_(deadline) {}

  void exact(void* buf, size_t len) {
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
  uint8_t u8() {
    uint8_t v;
    exact(&v, 1);
    return v;
  }
  uint32_t u32() {
    uint32_t v;
    exact(&v, sizeof(v));
    return v;
  }
  int64_t i64() {
    int64_t v;
    exact(&v, sizeof(v));
    return v;
  }
  std::string bytes() {
    uint64_t len;
    exact(&len, sizeof(len));
    if (len > (1ull << 40)) throw IoError{false, "implausible response length"};
    std::string s(len, '\0');
    exact(s.data(), len);
    return s;
  }

 private:
  int fd_;
  Clock::time_point deadline_;
};

// Opens a non-blocking TCP connection to one of host's addresses, within `deadline`.
int open_socket(const std::string& host, uint16_t port, Clock::time_point deadline,
                std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    *error = std::string("cannot resolve host: ") + ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      *error = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      int err = errno;
      if (err == EINPROGRESS) {
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
        *error = std::strerror(err);
        ::close(fd);
        fd = -1;
      }
    }
  }
  ::freeaddrinfo(res);
  if (fd >= 0) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  }
  return fd;
}

std::string encode(Op op) {
  std::string s;
  wire::Encoder(&s).query(op);
  return s;
}

std::string quoted(const std::string& key) { return "('" + key + "')"; }

}  // namespace

TcpStore::TcpStore(TcpStoreOptions options)
    : options_(std::move(options)),
      endpoint_((options_.host.find(':') != std::string::npos ? "[" + options_.host + "]"
                                                              : options_.host) +
                ":" + std::to_string(options_.port)) {
  timeout_ = options_.timeout;
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked("connect");
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpStore::connect_locked(const char* op) {
  auto deadline = Clock::now() + options_.connect_timeout;
  std::mt19937 rng(std::random_device{}());
  auto backoff = std::chrono::milliseconds(10);
  std::string error;
  int attempts = 0;
  for (;;) {
    ++attempts;
    int fd = open_socket(options_.host, options_.port, deadline, &error);
    if (fd >= 0) {
      try {
        auto hs_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(30));
        std::string hello;
        wire::Encoder(&hello).query(Op::kValidate).u32(wire::kValidationMagic);
        if (!options_.token.empty()) wire::Encoder(&hello).query(Op::kAuthHello);
        write_all(fd, hello, hs_deadline);
        if (!options_.token.empty()) {
          Reader r(fd, hs_deadline);
          std::string challenge = r.bytes();
          std::string proof;
          wire::Encoder(&proof)
              .query(Op::kAuthProof)
              .bytes(auth::hmac_sha256(options_.token, challenge));
          write_all(fd, proof, hs_deadline);
          if (r.u8() != 1) throw IoError{false, "wrong token"};
        }
        fd_ = fd;
        return;
      } catch (const IoError& e) {
        ::close(fd);
        if (!options_.token.empty()) {
          throw StoreError("store " + endpoint_ + ": " + op + ": authentication failed: " + e.what +
                           " (is TRUN_STORE_TOKEN the server's token?)");
        }
        error = e.what;
      }
    }
    if (Clock::now() + backoff >= deadline) break;
    // Exponential backoff with +-50% jitter, so a storm of clients does not retry in lockstep.
    std::uniform_real_distribution<double> jitter(0.5, 1.5);
    std::this_thread::sleep_for(
        std::chrono::duration_cast<std::chrono::microseconds>(backoff * jitter(rng)));
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
  throw StoreTimeoutError("store " + endpoint_ + ": " + op + ": could not connect within " +
                          std::to_string(options_.connect_timeout.count()) + " ms (" +
                          std::to_string(attempts) + " attempts; last error: " + error + ")");
}

template <typename Reply>
auto TcpStore::call(const char* op, const std::string& request, Duration budget, Reply reply) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) connect_locked(op);
  auto deadline = Clock::now() + budget;
  try {
    write_all(fd_, request, deadline);
    Reader reader(fd_, deadline);
    return reply(reader);
  } catch (const IoError& e) {
    // The stream is out of step after a failure: drop it; the next call reconnects.
    ::close(fd_);
    fd_ = -1;
    std::string msg = "store " + endpoint_ + ": " + op + ": " + e.what;
    if (e.timed_out) {
      throw StoreTimeoutError(msg + " after " + std::to_string(budget.count()) + " ms");
    }
    if (e.what == "connection closed by the server" && options_.token.empty()) {
      msg += " (if the store requires a token, set TRUN_STORE_TOKEN)";
    }
    throw StoreError(msg);
  }
}

void TcpStore::call_no_reply(const char* op, const std::string& request) {
  call(op, request, timeout_, [](Reader&) { return 0; });
}

void TcpStore::set(const std::string& key, std::string_view value) {
  std::string req;
  wire::Encoder(&req).query(Op::kSet).bytes(key).bytes(value);
  call_no_reply("set", req);
}

// Server-side waits answer at `timeout`; the socket deadline leaves room for that answer.
static Store::Duration with_grace(Store::Duration t) { return t + std::chrono::seconds(10); }

std::string TcpStore::get(const std::string& key, Duration timeout) {
  std::string req;
  wire::Encoder(&req)
      .query(Op::kGetWait)
      .u64(1)
      .bytes(key)
      .i64(std::max<int64_t>(timeout.count(), 0));
  std::string op = "get" + quoted(key);
  auto [status, value] = call(op.c_str(), req, with_grace(timeout), [](Reader& r) {
    uint8_t status = r.u8();
    return std::make_pair(status, status == wire::kWaitStop ? r.bytes() : std::string());
  });
  if (status != wire::kWaitStop) {
    throw StoreTimeoutError("store " + endpoint_ + ": " + op + ": key did not appear within " +
                            std::to_string(timeout.count()) + " ms");
  }
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::string req;
  wire::Encoder(&req).query(Op::kAdd).bytes(key).i64(delta);
  return call(("add" + quoted(key)).c_str(), req, timeout_, [](Reader& r) { return r.i64(); });
}

std::string TcpStore::compare_set(const std::string& key, std::string_view expected,
                                  std::string_view desired) {
  std::string req;
  wire::Encoder(&req).query(Op::kCompareSet).bytes(key).bytes(expected).bytes(desired);
  return call(("compare_set" + quoted(key)).c_str(), req, timeout_,
              [](Reader& r) { return r.bytes(); });
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::string req;
  wire::Encoder enc(&req);
  enc.query(Op::kCheck).u64(keys.size());
  for (auto& k : keys) enc.bytes(k);
  return call("check", req, timeout_, [](Reader& r) { return r.u8() == wire::kCheckReady; });
}

void TcpStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  std::string req;
  wire::Encoder enc(&req);
  enc.query(Op::kWaitKeys).u64(keys.size());
  for (auto& k : keys) enc.bytes(k);
  enc.i64(std::max<int64_t>(timeout.count(), 0));
  uint8_t status = call("wait", req, with_grace(timeout), [](Reader& r) { return r.u8(); });
  if (status != wire::kWaitStop) {
    std::string names;
    for (size_t i = 0; i < keys.size() && i < 4; ++i) names += (i ? ", '" : "'") + keys[i] + "'";
    if (keys.size() > 4) names += ", ...";
    throw StoreTimeoutError("store " + endpoint_ + ": wait(" + names +
                            "): keys did not appear within " + std::to_string(timeout.count()) +
                            " ms");
  }
}

int64_t TcpStore::num_keys() {
  return call("num_keys", encode(Op::kNumKeys), timeout_, [](Reader& r) { return r.i64(); });
}

bool TcpStore::delete_key(const std::string& key) {
  std::string req;
  wire::Encoder(&req).query(Op::kDeleteKey).bytes(key);
  return call(("delete_key" + quoted(key)).c_str(), req, timeout_,
              [](Reader& r) { return r.i64() > 0; });
}

std::vector<std::string> TcpStore::multi_get(const std::vector<std::string>& keys,
                                             Duration timeout) {
  wait(keys, timeout);
  std::string req;
  wire::Encoder enc(&req);
  enc.query(Op::kMultiGet).u64(keys.size());
  for (auto& k : keys) enc.bytes(k);
  return call("multi_get", req, timeout_, [n = keys.size()](Reader& r) {
    std::vector<std::string> values;
    values.reserve(n);
    for (size_t i = 0; i < n; ++i) values.push_back(r.bytes());
    return values;
  });
}

void TcpStore::multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    throw std::invalid_argument("multi_set: " + std::to_string(keys.size()) + " keys but " +
                                std::to_string(values.size()) + " values");
  }
  std::string req;
  wire::Encoder enc(&req);
  enc.query(Op::kMultiSet).u64(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) enc.bytes(keys[i]).bytes(values[i]);
  call_no_reply("multi_set", req);
}

void TcpStore::append(const std::string& key, std::string_view value) {
  std::string req;
  wire::Encoder(&req).query(Op::kAppend).bytes(key).bytes(value);
  call_no_reply(("append" + quoted(key)).c_str(), req);
}

Store::Duration TcpStore::ping() {
  std::string req;
  wire::Encoder(&req).query(Op::kPing).u32(0x5452554e);
  auto start = Clock::now();
  uint32_t echo = call("ping", req, timeout_, [](Reader& r) { return r.u32(); });
  if (echo != 0x5452554e) throw StoreError("store " + endpoint_ + ": ping: wrong echo");
  return std::chrono::duration_cast<Duration>(Clock::now() - start);
}

}  // namespace trun::rendezvous
