#include "store/tcp_store.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "store/auth.h"
#include "store/dialect_ops.h"
#include "store/dialect_probe.h"
#include "store/socket_conn.h"
#include "store/wire.h"

namespace trun::store {
namespace {

using Clock = std::chrono::steady_clock;
using dialect::StoreOp;
using dialect::Support;
using dialect::Way;
using net::IoError;
using net::Reader;
using net::write_all;
using wire::Op;

std::string encode(Op op, StoreDialect d) {
  std::string s;
  wire::Encoder(&s).query(op, dialect::numbering(d));
  return s;
}

// How the store's dialect carries `op`; a StoreError naming `what` and the server when it lacks
// it. Every operation asks once.
const Way& require(const TcpStore& store, StoreOp op, const std::string& what) {
  const Way& way = dialect::way(op, store.dialect());
  if (way.support == Support::kUnsupported) {
    throw StoreError("store " + store.endpoint() + ": " + what + ": " +
                     dialect::server_name(store.dialect()) + " lacks this operation (dialect " +
                     to_string(store.dialect()) + ")");
  }
  return way;
}

// Starts a request for `op` (after require()): the table's query, in the dialect's numbering.
wire::Encoder begin_request(std::string* req, const TcpStore& store, StoreOp op,
                            const std::string& what) {
  wire::Encoder enc(req);
  enc.query(require(store, op, what).query, dialect::numbering(store.dialect()));
  return enc;
}

std::string quoted(const std::string& key) { return "('" + key + "')"; }

// Server-side waits answer at `timeout`; the socket deadline leaves room for that answer.
Store::Duration with_grace(Store::Duration t) {
  constexpr Store::Duration kGrace = std::chrono::seconds(10);
  return t > Store::Duration::max() - kGrace ? Store::Duration::max() : t + kGrace;
}

// What a trun wait's reply reader throws when the server answers kWaitGoingAway (call() turns it
// into StoreGoneError and remembers it).
IoError going_away() {
  return IoError{false, "the store is stopping on purpose (its host left or the job ended)", true};
}

}  // namespace

bool probe_store_key(TcpStoreOptions options, const std::string& key,
                     std::chrono::milliseconds timeout) {
  net::OpenError error;
  int fd = net::open_socket(options.host, options.port, net::deadline_after(timeout), &error);
  if (fd < 0) return false;  // nothing listens (or it is unreachable): no retries
  ::close(fd);
  options.connect_timeout = timeout;
  options.reconnect_timeout = timeout;
  options.timeout = timeout;
  try {
    TcpStore store(options);
    return store.check({key});
  } catch (const std::exception&) {
    return false;
  }
}

TcpStore::TcpStore(TcpStoreOptions options)
    : options_(std::move(options)), endpoint_(net::endpoint_name(options_.host, options_.port)) {
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

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

int TcpStore::open_locked(const char* op, Clock::time_point deadline, std::string* error,
                          bool* permanent) {
  net::OpenError open_error;
  auto open = [&] {
    int fd = net::open_socket(options_.host, options_.port, deadline, &open_error);
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
      ProbeResult probe = probe_dialect(std::exchange(fd, -1), hs_deadline, open);
      if (probe.dialect == StoreDialect::kAuto) return -1;  // reopening failed: *error says why
      dialect_ = probe.dialect;
      if (probe.fd >= 0) return probe.fd;
      return open_locked(op, deadline, error, permanent);  // kTorch2: a connection with VALIDATE
    }
    if (!dialect::validates(dialect_)) return fd;  // 1.13 has no handshake
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
  auto deadline = net::deadline_after(budget);
  net::RetryResult result = net::connect_retrying(deadline, [&](net::OpenError* error) {
    return open_locked(op, deadline, &error->what, &error->permanent);
  });
  if (result.fd >= 0) {
    std::lock_guard<std::mutex> fd_lock(fd_mu_);
    fd_ = result.fd;
    connected_once_ = true;
    answered_ = false;
    return;
  }
  if (result.last.permanent) {
    // Retrying a name that does not exist or a network with no route only hides the cause
    // behind a timeout.
    throw StoreError("store " + endpoint_ + ": " + op + ": " + result.last.what + " (not retried)");
  }
  const std::string detail = result.detail();
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
  if (gone_) {
    throw StoreGoneError("store " + endpoint_ + ": " + op +
                         ": the store was stopped on purpose (its host left or the job ended); "
                         "not retried");
  }
  // The call's bound covers the reconnect too.
  const auto deadline = net::deadline_after(budget);
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
    if (e.gone) {
      gone_ = true;
      throw StoreGoneError(msg + " (not retried)");
    }
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
  net::OpenError ignored;
  int fd = net::open_socket(options_.host, options_.port,
                            Clock::now() + std::chrono::milliseconds(200), &ignored);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

void TcpStore::call_no_reply(const char* op, const std::string& request) {
  call(op, request, timeout_, [](Reader&) { return 0; });
}

void TcpStore::set(const std::string& key, std::string_view value) {
  std::string req;
  begin_request(&req, *this, StoreOp::kSet, "set").bytes(key).bytes(value);
  call_no_reply("set", req);
}

bool TcpStore::plain_wait(const std::string& op, const std::vector<std::string>& keys,
                          Duration timeout, bool cancel_wait) {
  if (timeout <= Duration(0)) return check(keys);  // a WAIT would always end by its deadline
  std::string req;
  wire::Encoder enc(&req);
  enc.query(Op::kWait, dialect::numbering(dialect_)).u64(keys.size());
  for (auto& k : keys) enc.bytes(k);
  if (!cancel_wait) {
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
    r.set_deadline(std::min(outer, net::deadline_after(timeout)));
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
  const Way& way = require(*this, StoreOp::kGet, op);
  if (way.support == Support::kEmulated) {
    if (!plain_wait(op, {key}, timeout, way.cancel_wait)) throw timed_out();
    std::string req;
    wire::Encoder(&req).query(Op::kGet, dialect::numbering(dialect_)).bytes(key);
    return call(op.c_str(), req, timeout_, [](Reader& r) { return r.bytes(); });
  }
  std::string req;
  wire::Encoder(&req).query(way.query).u64(1).bytes(key).i64(std::max<int64_t>(timeout.count(), 0));
  auto [status, value] = call(op.c_str(), req, with_grace(timeout), [](Reader& r) {
    uint8_t status = r.u8();
    if (status == wire::kWaitGoingAway) throw going_away();
    return std::make_pair(status, status == wire::kWaitStop ? r.bytes() : std::string());
  });
  if (status != wire::kWaitStop) throw timed_out();
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  const std::string op = "add" + quoted(key);
  std::string req;
  begin_request(&req, *this, StoreOp::kAdd, op).bytes(key).i64(delta);
  return call(op.c_str(), req, timeout_, [](Reader& r) { return r.i64(); });
}

std::string TcpStore::compare_set(const std::string& key, std::string_view expected,
                                  std::string_view desired) {
  const std::string op = "compare_set" + quoted(key);
  std::string req;
  begin_request(&req, *this, StoreOp::kCompareSet, op).bytes(key).bytes(expected).bytes(desired);
  return call(op.c_str(), req, timeout_, [](Reader& r) { return r.bytes(); });
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::string req;
  wire::Encoder enc = begin_request(&req, *this, StoreOp::kCheck, "check");
  enc.u64(keys.size());
  for (auto& k : keys) enc.bytes(k);
  return call("check", req, timeout_, [](Reader& r) { return r.u8() == wire::kCheckReady; });
}

void TcpStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  std::string names;
  for (size_t i = 0; i < keys.size() && i < 4; ++i) names += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 4) names += ", ...";
  const std::string op = "wait(" + names + ")";
  const Way& way = require(*this, StoreOp::kWait, op);
  bool ok;
  if (way.support == Support::kEmulated) {
    ok = plain_wait(op, keys, timeout, way.cancel_wait);
  } else {
    std::string req;
    wire::Encoder enc(&req);
    enc.query(way.query).u64(keys.size());
    for (auto& k : keys) enc.bytes(k);
    enc.i64(std::max<int64_t>(timeout.count(), 0));
    ok = call("wait", req, with_grace(timeout), [](Reader& r) {
           uint8_t status = r.u8();
           if (status == wire::kWaitGoingAway) throw going_away();
           return status;
         }) == wire::kWaitStop;
  }
  if (!ok) {
    throw StoreTimeoutError("store " + endpoint_ + ": " + op + ": keys did not appear within " +
                            std::to_string(timeout.count()) + " ms");
  }
}

int64_t TcpStore::num_keys() {
  std::string req;
  begin_request(&req, *this, StoreOp::kNumKeys, "num_keys");
  return call("num_keys", req, timeout_, [](Reader& r) { return r.i64(); });
}

bool TcpStore::delete_key(const std::string& key) {
  const std::string op = "delete_key" + quoted(key);
  std::string req;
  begin_request(&req, *this, StoreOp::kDeleteKey, op).bytes(key);
  return call(op.c_str(), req, timeout_, [](Reader& r) { return r.i64() > 0; });
}

std::vector<std::string> TcpStore::multi_get(const std::vector<std::string>& keys,
                                             Duration timeout) {
  wait(keys, timeout);
  const Way& way = require(*this, StoreOp::kMultiGet, "multi_get");
  const wire::Dialect numbering = dialect::numbering(dialect_);
  std::string req;
  wire::Encoder enc(&req);
  if (way.support == Support::kEmulated) {
    for (auto& k : keys) enc.query(way.query, numbering).bytes(k);  // GETs, in one write
  } else {
    enc.query(way.query, numbering).u64(keys.size());
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
  const Way& way = require(*this, StoreOp::kMultiSet, "multi_set");
  const wire::Dialect numbering = dialect::numbering(dialect_);
  std::string req;
  wire::Encoder enc(&req);
  if (way.support == Support::kEmulated) {
    // SETs, in order, in one write (not atomic).
    for (size_t i = 0; i < keys.size(); ++i) {
      enc.query(way.query, numbering).bytes(keys[i]).bytes(values[i]);
    }
  } else {
    enc.query(way.query, numbering).u64(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) enc.bytes(keys[i]).bytes(values[i]);
  }
  call_no_reply("multi_set", req);
}

void TcpStore::append(const std::string& key, std::string_view value) {
  const std::string op = "append" + quoted(key);
  std::string req;
  begin_request(&req, *this, StoreOp::kAppend, op).bytes(key).bytes(value);
  call_no_reply(op.c_str(), req);
}

void TcpStore::queue_push(const std::string& key, std::string_view value) {
  const std::string op = "queue_push" + quoted(key);
  std::string req;
  begin_request(&req, *this, StoreOp::kQueuePush, op).bytes(key).bytes(value);
  call_no_reply(op.c_str(), req);
}

std::optional<std::string> TcpStore::queue_pop(const std::string& key, bool block,
                                               Duration timeout) {
  const std::string op = "queue_pop" + quoted(key);
  std::string req;
  begin_request(&req, *this, StoreOp::kQueuePop, op).bytes(key);
  auto pop = [&] {
    return call(op.c_str(), req, timeout_, [](Reader& r) -> std::optional<std::string> {
      if (r.i64() <= 0) return std::nullopt;  // the length before the pop, then the value
      return r.bytes();
    });
  };
  // A blocking pop waits for the queue (a WAIT counts a non-empty queue) and pops; another
  // client may pop first, so it waits again while time is left.
  const auto deadline = net::deadline_after(timeout);
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
  std::string req;
  begin_request(&req, *this, StoreOp::kQueueLen, op).bytes(key);
  return call(op.c_str(), req, timeout_, [](Reader& r) { return r.i64(); });
}

std::vector<std::string> TcpStore::list_keys() {
  std::string req;
  begin_request(&req, *this, StoreOp::kListKeys, "list_keys");
  return call("list_keys", req, timeout_, [](Reader& r) {
    std::vector<std::string> keys;
    for (int64_t i = 0, n = r.i64(); i < n; ++i) keys.push_back(r.bytes());  // n: the server's
    return keys;
  });
}

Store::Duration TcpStore::ping() {
  auto start = Clock::now();
  const Way& way = require(*this, StoreOp::kPing, "ping");
  if (way.support == Support::kEmulated) {
    num_keys();  // a GETNUMKEYS round trip
    return std::chrono::duration_cast<Duration>(Clock::now() - start);
  }
  std::string req;
  wire::Encoder(&req).query(way.query).u32(0x5452554e);
  uint32_t echo = call("ping", req, timeout_, [](Reader& r) { return r.u32(); });
  if (echo != 0x5452554e) throw StoreError("store " + endpoint_ + ": ping: wrong echo");
  return std::chrono::duration_cast<Duration>(Clock::now() - start);
}

void TcpStore::lease_arm(const LeaseSpec& lease) {
  std::string req;
  begin_request(&req, *this, StoreOp::kLeaseArm, "lease_arm")
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
  std::string req;
  begin_request(&req, *this, StoreOp::kLeaseRenew, "lease_renew").i64(ttl.count());
  return call("lease_renew", req, timeout_, [](Reader& r) { return r.u8(); }) == 1;
}

bool TcpStore::lease_release() {
  std::string req;
  begin_request(&req, *this, StoreOp::kLeaseRelease, "lease_release");
  return call("lease_release", req, timeout_, [](Reader& r) { return r.u8(); }) == 1;
}

void TcpStore::interrupt() {
  std::lock_guard<std::mutex> fd_lock(fd_mu_);
  interrupted_ = true;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

}  // namespace trun::store
