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

  int fd() const { return fd_; }
  Clock::time_point deadline() const { return deadline_; }
  void set_deadline(Clock::time_point deadline) { deadline_ = deadline; }

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

// Why one connection attempt failed, and whether trying again can help.
struct OpenError {
  std::string what;
  // Retrying cannot help: the name does not exist (EAI_NONAME, not the transient EAI_AGAIN), or
  // no route leads to any of its addresses (ENETUNREACH, EHOSTUNREACH). A refused port is not
  // permanent: the server may be starting.
  bool permanent = false;
};

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

// Opens a non-blocking TCP connection to one of host's addresses, within `deadline`.
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

wire::Dialect wire_dialect(StoreDialect d) {
  return d == StoreDialect::kTorch1_13 ? wire::Dialect::kV1 : wire::Dialect::kV2;
}

std::string encode(Op op, StoreDialect d) {
  std::string s;
  wire::Encoder(&s).query(op, wire_dialect(d));
  return s;
}

const char* server_name(StoreDialect d) {
  switch (d) {
    case StoreDialect::kTorch1_13:
      return "PyTorch 1.13's TCPStore server";
    case StoreDialect::kTorch2:
      return "PyTorch 2.x's TCPStore server";
    default:
      return "trun's store server";
  }
}

// The auto-detection probe (docs/tcpstore-protocol.md §12). Sent in one write:
//   VALIDATE magic | PING kProbeNonce | LEASE_RELEASE
// trun's server answers the echo and then 0 (no lease armed); PyTorch >= 2.4 answers the echo
// and closes on the unknown LEASE_RELEASE; PyTorch 2.2/2.3 close on PING. PyTorch 1.13 reads
// VALIDATE as a SET whose key length spans bytes 1-8: the nonce's third byte (0xA5) makes that
// length over 2^63, so its server fails the allocation at once and closes this connection (a
// shorter message would leave its single thread blocked reading the rest of a key). When the
// probe gets nothing back, 1.13 and 2.2/2.3 are told apart on a new connection by 1.13's
// GETNUMKEYS (0x06), which a 2.x server refuses as a first message.
constexpr uint32_t kProbeNonce = 0x54A5554E;
static_assert(((kProbeNonce >> 16) & 0xFF) >= 0x80, "the 1.13 key length must exceed 2^63");

std::string quoted(const std::string& key) { return "('" + key + "')"; }

}  // namespace

TcpStore::TcpStore(TcpStoreOptions options)
    : options_(std::move(options)),
      endpoint_((options_.host.find(':') != std::string::npos ? "[" + options_.host + "]"
                                                              : options_.host) +
                ":" + std::to_string(options_.port)) {
  timeout_ = options_.timeout;
  dialect_ = options_.dialect;
  if (!options_.token.empty() && dialect_ == StoreDialect::kAuto) dialect_ = StoreDialect::kTrun;
  if (!options_.token.empty() && dialect_ != StoreDialect::kTrun) {
    throw std::invalid_argument("store " + endpoint_ + ": a store token needs trun's server, but " +
                                "the dialect is " + to_string(dialect_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked("connect");
}

const char* to_string(StoreDialect dialect) {
  switch (dialect) {
    case StoreDialect::kAuto:
      return "auto";
    case StoreDialect::kTrun:
      return "trun";
    case StoreDialect::kTorch2:
      return "torch2";
    case StoreDialect::kTorch1_13:
      return "torch1.13";
  }
  return "?";
}

std::optional<StoreDialect> parse_store_dialect(std::string_view name) {
  for (auto d : {StoreDialect::kAuto, StoreDialect::kTrun, StoreDialect::kTorch2,
                 StoreDialect::kTorch1_13}) {
    if (name == to_string(d)) return d;
  }
  return std::nullopt;
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

int TcpStore::open_locked(const char* op, Clock::time_point deadline, std::string* error,
                          bool* permanent) {
  OpenError open_error;
  auto open = [&] {
    int fd = open_socket(options_.host, options_.port, deadline, &open_error);
    if (fd < 0) {
      *error = open_error.what;
      *permanent = open_error.permanent;
    }
    return fd;
  };
  *permanent = false;
  int fd = open();
  if (fd < 0) return -1;
  auto hs_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(30));
  try {
    if (dialect_ == StoreDialect::kAuto) {
      std::string probe;
      wire::Encoder(&probe)
          .query(Op::kValidate)
          .u32(wire::kValidationMagic)
          .query(Op::kPing)
          .u32(kProbeNonce)
          .query(Op::kLeaseRelease);
      Reader r(fd, hs_deadline);
      int answered = 0;  // bytes of the expected answer (4 echo + 1) that arrived
      bool wrong_echo = false;
      try {
        write_all(fd, probe, hs_deadline);
        if (r.u32() != kProbeNonce) {
          wrong_echo = true;
        } else {
          answered = 4;
          r.u8();
          answered = 5;
        }
      } catch (const IoError& e) {
        if (e.timed_out) throw;  // no answer at all: a failed attempt (retried)
      }
      if (wrong_echo) throw IoError{false, "unexpected answer to the probe"};
      if (answered == 5) {
        dialect_ = StoreDialect::kTrun;  // keep this connection: validated, nothing pending
        return fd;
      }
      ::close(fd);
      fd = -1;
      if (answered == 4) {
        dialect_ = StoreDialect::kTorch2;
        return open_locked(op, deadline, error, permanent);
      }
      fd = open();
      if (fd < 0) return -1;
      write_all(fd, encode(Op::kNumKeys, StoreDialect::kTorch1_13), hs_deadline);
      Reader r2(fd, hs_deadline);
      try {
        r2.i64();
        dialect_ = StoreDialect::kTorch1_13;  // keep this one too: its answer was read
        return fd;
      } catch (const IoError& e) {
        if (e.timed_out) throw;
      }
      ::close(fd);
      fd = -1;
      dialect_ = StoreDialect::kTorch2;
      return open_locked(op, deadline, error, permanent);
    }
    if (dialect_ == StoreDialect::kTorch1_13) return fd;  // 1.13 has no handshake
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
    return fd;
  } catch (const IoError& e) {
    if (fd >= 0) ::close(fd);
    if (!options_.token.empty()) {
      throw StoreError("store " + endpoint_ + ": " + op + ": authentication failed: " + e.what +
                       " (is TRUN_STORE_TOKEN the server's token?)");
    }
    *error = e.what;
    return -1;
  }
}

void TcpStore::connect_locked(const char* op, Duration cap) {
  // A reconnect (the connection was lost or dropped) gets a short budget: the server most
  // likely went away, and callers that must outlast an outage retry at their own level.
  const bool reconnect = connected_once_;
  const Duration budget =
      std::min(cap, reconnect ? std::min(options_.connect_timeout, options_.reconnect_timeout)
                              : options_.connect_timeout);
  auto deadline = Clock::now() + budget;
  std::mt19937 rng(std::random_device{}());
  auto backoff = std::chrono::milliseconds(10);
  std::string error;
  bool permanent = false;
  int attempts = 0;
  for (;;) {
    ++attempts;
    int fd = open_locked(op, deadline, &error, &permanent);
    if (fd >= 0) {
      std::lock_guard<std::mutex> fd_lock(fd_mu_);
      fd_ = fd;
      connected_once_ = true;
      answered_ = false;
      return;
    }
    if (permanent) {
      // Retrying a name that does not exist or a network with no route only hides the cause
      // behind a timeout.
      throw StoreError("store " + endpoint_ + ": " + op + ": " + error + " (not retried)");
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    // Exponential backoff with +-50% jitter, so a storm of clients does not retry in lockstep;
    // the last pause is cut short so that the final attempt comes at the deadline, not up to a
    // second before it.
    std::uniform_real_distribution<double> jitter(0.5, 1.5);
    std::this_thread::sleep_for(std::min<Clock::duration>(
        std::chrono::duration_cast<std::chrono::microseconds>(backoff * jitter(rng)), left));
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
  std::string detail = std::to_string(attempts) + " attempts; last error: " + error;
  if (error == std::strerror(ECONNREFUSED)) detail += ": nothing listens there";
  if (reconnect) {
    // Not a StoreTimeoutError: no key is late, the server is gone (callers that treat a timeout
    // as "not there yet" must not retry this forever).
    throw StoreError("store " + endpoint_ + ": " + op +
                     ": the connection was lost and reconnecting failed within " +
                     std::to_string(budget.count()) + " ms (" + detail + ")");
  }
  throw StoreTimeoutError("store " + endpoint_ + ": " + op + ": could not connect within " +
                          std::to_string(budget.count()) + " ms (" + detail + ")");
}

template <typename Reply>
auto TcpStore::call(const char* op, const std::string& request, Duration budget, Reply reply) {
  std::lock_guard<std::mutex> lock(mu_);
  {
    // An interrupt() that found no call in progress fails the next one instead.
    std::lock_guard<std::mutex> fd_lock(fd_mu_);
    if (interrupted_) {
      interrupted_ = false;
      if (fd_ >= 0) ::close(fd_);
      fd_ = -1;
      throw StoreError("store " + endpoint_ + ": " + op + ": interrupted");
    }
  }
  // The call's bound covers the reconnect too.
  const auto deadline = Clock::now() + budget;
  if (fd_ < 0) connect_locked(op, budget);
  try {
    write_all(fd_, request, deadline);
    Reader reader(fd_, deadline);
    auto result = reply(reader);
    answered_ = true;
    return result;
  } catch (const IoError& e) {
    // The stream is out of step after a failure: drop it; the next call reconnects.
    bool interrupted;
    {
      std::lock_guard<std::mutex> fd_lock(fd_mu_);
      ::close(fd_);
      fd_ = -1;
      interrupted = interrupted_;
      interrupted_ = false;
    }
    std::string msg = "store " + endpoint_ + ": " + op + ": " + e.what;
    if (interrupted) throw StoreError("store " + endpoint_ + ": " + op + ": interrupted");
    if (e.timed_out) {
      throw StoreTimeoutError(msg + " after " + std::to_string(budget.count()) + " ms");
    }
    if (e.what == "connection closed by the server" && options_.token.empty() && !answered_ &&
        server_listens()) {
      // A server that wants a token closes a new connection on its first request; one that
      // died closes every connection, and then nothing listens any more.
      msg += " (if the store requires a token, set TRUN_STORE_TOKEN)";
    }
    throw StoreError(msg);
  }
}

bool TcpStore::server_listens() const {
  OpenError ignored;
  int fd = open_socket(options_.host, options_.port, Clock::now() + std::chrono::milliseconds(200),
                       &ignored);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

void TcpStore::call_no_reply(const char* op, const std::string& request) {
  call(op, request, timeout_, [](Reader&) { return 0; });
}

void TcpStore::unsupported(const char* op) const {
  throw StoreError("store " + endpoint_ + ": " + op + ": " + server_name(dialect_) +
                   " lacks this operation (dialect " + to_string(dialect_) + ")");
}

void TcpStore::set(const std::string& key, std::string_view value) {
  std::string req;
  wire::Encoder(&req).query(Op::kSet, wire_dialect(dialect_)).bytes(key).bytes(value);
  call_no_reply("set", req);
}

// Server-side waits answer at `timeout`; the socket deadline leaves room for that answer.
static Store::Duration with_grace(Store::Duration t) { return t + std::chrono::seconds(10); }

bool TcpStore::plain_wait(const std::string& op, const std::vector<std::string>& keys,
                          Duration timeout) {
  if (timeout <= Duration(0)) return check(keys);  // a WAIT would always end by its deadline
  std::string req;
  wire::Encoder enc(&req);
  enc.query(Op::kWait, wire_dialect(dialect_)).u64(keys.size());
  for (auto& k : keys) enc.bytes(k);
  if (dialect_ == StoreDialect::kTorch1_13) {
    // 1.13 cannot cancel a WAIT: when the deadline passes, call() drops the connection (a late
    // STOP_WAITING would otherwise be read as the next reply) and the next call reconnects.
    try {
      uint8_t status = call(op.c_str(), req, timeout, [](Reader& r) { return r.u8(); });
      if (status != wire::kWaitStop) {
        throw StoreError("store " + endpoint_ + ": " + op + ": unexpected wait answer " +
                         std::to_string(status));
      }
      return true;
    } catch (const StoreTimeoutError&) {
      return false;
    }
  }
  // PyTorch 2.x: on the deadline send CANCEL_WAIT; the server answers WAIT_CANCELED, possibly
  // after a STOP_WAITING that crossed it (then the keys did appear).
  return call(op.c_str(), req, with_grace(timeout), [&](Reader& r) {
    auto outer = r.deadline();
    r.set_deadline(std::min(outer, Clock::now() + timeout));
    uint8_t status;
    try {
      status = r.u8();
    } catch (const IoError& e) {
      if (!e.timed_out) throw;
      r.set_deadline(outer);
      write_all(r.fd(), encode(Op::kCancelWait, dialect_), outer);
      status = r.u8();
      if (status == wire::kWaitCanceled) return false;
      if (r.u8() != wire::kWaitCanceled) throw IoError{false, "unexpected CANCEL_WAIT answer"};
    }
    if (status != wire::kWaitStop) throw IoError{false, "unexpected WAIT answer"};
    return true;
  });
}

std::string TcpStore::get(const std::string& key, Duration timeout) {
  std::string op = "get" + quoted(key);
  auto timed_out = [&]() {
    return StoreTimeoutError("store " + endpoint_ + ": " + op + ": key did not appear within " +
                             std::to_string(timeout.count()) + " ms");
  };
  if (dialect_ != StoreDialect::kTrun) {
    if (!plain_wait(op, {key}, timeout)) throw timed_out();
    std::string req;
    wire::Encoder(&req).query(Op::kGet, wire_dialect(dialect_)).bytes(key);
    return call(op.c_str(), req, timeout_, [](Reader& r) { return r.bytes(); });
  }
  std::string req;
  wire::Encoder(&req)
      .query(Op::kGetWait)
      .u64(1)
      .bytes(key)
      .i64(std::max<int64_t>(timeout.count(), 0));
  auto [status, value] = call(op.c_str(), req, with_grace(timeout), [](Reader& r) {
    uint8_t status = r.u8();
    return std::make_pair(status, status == wire::kWaitStop ? r.bytes() : std::string());
  });
  if (status != wire::kWaitStop) throw timed_out();
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::string req;
  wire::Encoder(&req).query(Op::kAdd, wire_dialect(dialect_)).bytes(key).i64(delta);
  return call(("add" + quoted(key)).c_str(), req, timeout_, [](Reader& r) { return r.i64(); });
}

std::string TcpStore::compare_set(const std::string& key, std::string_view expected,
                                  std::string_view desired) {
  std::string req;
  wire::Encoder(&req)
      .query(Op::kCompareSet, wire_dialect(dialect_))
      .bytes(key)
      .bytes(expected)
      .bytes(desired);
  return call(("compare_set" + quoted(key)).c_str(), req, timeout_,
              [](Reader& r) { return r.bytes(); });
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::string req;
  wire::Encoder enc(&req);
  enc.query(Op::kCheck, wire_dialect(dialect_)).u64(keys.size());
  for (auto& k : keys) enc.bytes(k);
  return call("check", req, timeout_, [](Reader& r) { return r.u8() == wire::kCheckReady; });
}

void TcpStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  std::string names;
  for (size_t i = 0; i < keys.size() && i < 4; ++i) names += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 4) names += ", ...";
  const std::string op = "wait(" + names + ")";
  bool ok;
  if (dialect_ != StoreDialect::kTrun) {
    ok = plain_wait(op, keys, timeout);
  } else {
    std::string req;
    wire::Encoder enc(&req);
    enc.query(Op::kWaitKeys).u64(keys.size());
    for (auto& k : keys) enc.bytes(k);
    enc.i64(std::max<int64_t>(timeout.count(), 0));
    ok =
        call("wait", req, with_grace(timeout), [](Reader& r) { return r.u8(); }) == wire::kWaitStop;
  }
  if (!ok) {
    throw StoreTimeoutError("store " + endpoint_ + ": " + op + ": keys did not appear within " +
                            std::to_string(timeout.count()) + " ms");
  }
}

int64_t TcpStore::num_keys() {
  return call("num_keys", encode(Op::kNumKeys, dialect_), timeout_,
              [](Reader& r) { return r.i64(); });
}

bool TcpStore::delete_key(const std::string& key) {
  std::string req;
  wire::Encoder(&req).query(Op::kDeleteKey, wire_dialect(dialect_)).bytes(key);
  return call(("delete_key" + quoted(key)).c_str(), req, timeout_,
              [](Reader& r) { return r.i64() > 0; });
}

std::vector<std::string> TcpStore::multi_get(const std::vector<std::string>& keys,
                                             Duration timeout) {
  wait(keys, timeout);
  std::string req;
  wire::Encoder enc(&req);
  if (dialect_ == StoreDialect::kTorch1_13) {
    // No MULTI_GET in 1.13: one GET per key, sent in one write.
    for (auto& k : keys) enc.query(Op::kGet, wire::Dialect::kV1).bytes(k);
  } else {
    enc.query(Op::kMultiGet).u64(keys.size());
    for (auto& k : keys) enc.bytes(k);
  }
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
  if (dialect_ == StoreDialect::kTorch1_13) {
    // No MULTI_SET in 1.13: one SET per pair, in order, in one write (not atomic).
    for (size_t i = 0; i < keys.size(); ++i) {
      enc.query(Op::kSet, wire::Dialect::kV1).bytes(keys[i]).bytes(values[i]);
    }
  } else {
    enc.query(Op::kMultiSet).u64(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) enc.bytes(keys[i]).bytes(values[i]);
  }
  call_no_reply("multi_set", req);
}

void TcpStore::append(const std::string& key, std::string_view value) {
  // 1.13 has no APPEND, and a compare_set loop cannot stand in for it: compare_set's answer is
  // the same when another client appended the same bytes first, so an append would be lost.
  if (dialect_ == StoreDialect::kTorch1_13) unsupported(("append" + quoted(key)).c_str());
  std::string req;
  wire::Encoder(&req).query(Op::kAppend).bytes(key).bytes(value);
  call_no_reply(("append" + quoted(key)).c_str(), req);
}

void TcpStore::queue_push(const std::string& key, std::string_view value) {
  const std::string op = "queue_push" + quoted(key);
  if (dialect_ == StoreDialect::kTorch1_13) unsupported(op.c_str());
  std::string req;
  wire::Encoder(&req).query(Op::kQueuePush).bytes(key).bytes(value);
  call_no_reply(op.c_str(), req);
}

std::optional<std::string> TcpStore::queue_pop(const std::string& key, bool block,
                                               Duration timeout) {
  const std::string op = "queue_pop" + quoted(key);
  if (dialect_ == StoreDialect::kTorch1_13) unsupported(op.c_str());
  std::string req;
  wire::Encoder(&req).query(Op::kQueuePop).bytes(key);
  auto pop = [&] {
    return call(op.c_str(), req, timeout_, [](Reader& r) -> std::optional<std::string> {
      if (r.i64() <= 0) return std::nullopt;  // the length before the pop, then the value
      return r.bytes();
    });
  };
  // A blocking pop waits for the queue (a WAIT counts a non-empty queue) and pops; another
  // client may pop first, so it waits again while time is left.
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (block) {
      auto left = std::chrono::duration_cast<Duration>(deadline - Clock::now());
      try {
        wait({key}, std::max(left, Duration(0)));
      } catch (const StoreTimeoutError&) {
        throw StoreTimeoutError("store " + endpoint_ + ": " + op + ": no value within " +
                                std::to_string(timeout.count()) + " ms");
      }
    }
    auto value = pop();
    if (value || !block) return value;
  }
}

int64_t TcpStore::queue_len(const std::string& key) {
  const std::string op = "queue_len" + quoted(key);
  if (dialect_ == StoreDialect::kTorch1_13) unsupported(op.c_str());
  std::string req;
  wire::Encoder(&req).query(Op::kQueueLen).bytes(key);
  return call(op.c_str(), req, timeout_, [](Reader& r) { return r.i64(); });
}

std::vector<std::string> TcpStore::list_keys() {
  if (dialect_ == StoreDialect::kTorch1_13) unsupported("list_keys");
  std::string req;
  wire::Encoder(&req).query(Op::kListKeys);
  return call("list_keys", req, timeout_, [](Reader& r) {
    std::vector<std::string> keys;
    for (int64_t i = 0, n = r.i64(); i < n; ++i) keys.push_back(r.bytes());  // n: the server's
    return keys;
  });
}

Store::Duration TcpStore::ping() {
  auto start = Clock::now();
  if (dialect_ != StoreDialect::kTrun) {
    // PyTorch 1.13 has no PING and 2.2/2.3 servers refuse it; GETNUMKEYS is a round trip too.
    num_keys();
    return std::chrono::duration_cast<Duration>(Clock::now() - start);
  }
  std::string req;
  wire::Encoder(&req).query(Op::kPing).u32(0x5452554e);
  uint32_t echo = call("ping", req, timeout_, [](Reader& r) { return r.u32(); });
  if (echo != 0x5452554e) throw StoreError("store " + endpoint_ + ": ping: wrong echo");
  return std::chrono::duration_cast<Duration>(Clock::now() - start);
}

}  // namespace trun::rendezvous

namespace trun::rendezvous {

void TcpStore::lease_arm(const LeaseSpec& lease) {
  if (dialect_ != StoreDialect::kTrun) unsupported("lease_arm");
  std::string req;
  wire::Encoder(&req)
      .query(Op::kLeaseArm)
      .bytes(lease.set_key)
      .bytes(lease.set_value)
      .bytes(lease.a_key)
      .bytes(lease.a_value)
      .bytes(lease.b_key)
      .bytes(lease.b_value)
      .i64(lease.ttl.count());
  uint8_t ok = call("lease_arm", req, timeout_, [](Reader& r) { return r.u8(); });
  if (ok != 1) throw StoreError("store " + endpoint_ + ": lease_arm: rejected by the server");
}

bool TcpStore::lease_renew(std::chrono::milliseconds ttl) {
  if (dialect_ != StoreDialect::kTrun) unsupported("lease_renew");
  std::string req;
  wire::Encoder(&req).query(Op::kLeaseRenew).i64(ttl.count());
  return call("lease_renew", req, timeout_, [](Reader& r) { return r.u8(); }) == 1;
}

bool TcpStore::lease_release() {
  if (dialect_ != StoreDialect::kTrun) unsupported("lease_release");
  return call("lease_release", encode(Op::kLeaseRelease, dialect_), timeout_,
              [](Reader& r) { return r.u8(); }) == 1;
}

void TcpStore::interrupt() {
  std::lock_guard<std::mutex> fd_lock(fd_mu_);
  interrupted_ = true;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

}  // namespace trun::rendezvous
