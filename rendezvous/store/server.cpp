#include "rendezvous/store/server.h"

#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <atomic>
#include <boost/asio.hpp>
#include <charconv>
#include <deque>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "rendezvous/store/auth.h"
#include "rendezvous/store/log_limiter.h"
#include "rendezvous/store/store.h"

namespace trun::rendezvous {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using wire::Op;

constexpr size_t kReadChunk = 64 * 1024;
// While a connection is blocked in a wait it keeps reading (to see CANCEL_WAIT and disconnects),
// but stops once this much unprocessed input has piled up.
constexpr size_t kMaxBufferedWhileBlocked = 1 << 20;

class ServerImpl;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerImpl* server, tcp::socket socket, uint64_t id);
  void start();
  void close(const std::string& why);
  // Called by the server when a key this connection waits for has appeared. True when that
  // completed the wait.
  bool on_key_ready(uint64_t wait_id);

  uint64_t id() const { return id_; }
  bool closed() const { return closed_; }

 private:
  friend class ServerImpl;
  void read();
  void on_read(const boost::system::error_code& ec, size_t n);
  // Decodes and executes buffered requests until one blocks or the buffer runs dry.
  void process();
  // Executes one request. Returns false when it blocked (the connection now waits for keys).
  bool execute(wire::Request& request);
  void flush();
  void block_on(std::vector<std::string> missing, wire::Request request, int64_t timeout_ms);
  void finish_wait(uint8_t timed_out_code);
  void clear_wait();
  void arm_lease_timer();
  // Performs the armed lease's notification (the connection is gone or went silent).
  void fire_lease(const char* why);

  ServerImpl* server_;
  tcp::socket socket_;
  uint64_t id_;
  std::string peer_;
  std::array<char, kReadChunk> chunk_;
  std::string in_;
  std::string out_;
  std::string writing_;
  bool reading_ = false;
  bool writing_now_ = false;
  bool closed_ = false;
  bool processing_ = false;
  wire::Dialect dialect_ = wire::Dialect::kUnknown;
  bool authenticated_ = false;
  std::string challenge_;
  // Blocked-wait state: the request to re-run once its keys exist.
  bool blocked_ = false;
  uint64_t wait_id_ = 0;
  size_t wait_remaining_ = 0;
  std::vector<std::string> wait_keys_;
  wire::Request blocked_request_;
  asio::steady_timer wait_timer_;
  // Lease (trun extension): keys[0..2] / values[0..2] as sent by LEASE_ARM; see wire.h.
  bool lease_armed_ = false;
  wire::Request lease_;
  int64_t lease_ttl_ms_ = 0;
  uint64_t lease_generation_ = 0;
  asio::steady_timer lease_timer_;
};

class ServerImpl : public StoreServer {
 public:
  explicit ServerImpl(const StoreServerOptions& options)
      : options_(options), acceptor_(io_), signals_guard_(asio::make_work_guard(io_)) {}

  ~ServerImpl() override { stop(); }

  void listen() {
    tcp::resolver resolver(io_);
    boost::system::error_code ec;
    auto results =
        resolver.resolve(options_.host, std::to_string(options_.port), tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      throw StoreError("store server: cannot resolve bind address '" + options_.host +
                       "': " + ec.message());
    }
    tcp::endpoint endpoint = results.begin()->endpoint();
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec && endpoint.protocol() == tcp::v6()) {
      acceptor_.set_option(asio::ip::v6_only(false), ec);  // dual-stack where allowed
      ec.clear();
    }
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(options_.backlog, ec);
    if (ec) {
      throw StoreError("store server: cannot listen on " + options_.host + ":" +
                       std::to_string(options_.port) + ": " + ec.message());
    }
    port_ = acceptor_.local_endpoint().port();
    raise_fd_limit();
    accept();
    thread_ = std::thread([this] { run(); });
  }

  uint16_t port() const override { return port_; }
  std::string host() const override { return options_.host; }
  size_t num_connections() const override { return num_connections_.load(); }
  uint64_t num_requests() const override { return num_requests_.load(); }
  void count_request() { num_requests_.fetch_add(1, std::memory_order_relaxed); }
  bool stopping() const { return stopped_.load(); }

  void stop() override {
    if (stopped_.exchange(true)) return;
    asio::post(io_, [this] {
      boost::system::error_code ec;
      acceptor_.close(ec);
      auto conns = connections_;
      for (auto& [id, c] : conns) c->close("");  // quietly: stopping is not a client's fault
      signals_guard_.reset();
    });
    if (thread_.joinable()) thread_.join();
  }

  const StoreServerOptions& options() const { return options_; }

  // --- the data, touched only on the event-loop thread ---
  std::unordered_map<std::string, std::string> data_;
  // PyTorch 2.7+'s queues (queue_push/pop/len): FIFOs apart from the key-value map. A non-empty
  // queue counts as an existing key for CHECK and WAIT, as in PyTorch's libuv server.
  std::unordered_map<std::string, std::deque<std::string>> queues_;
  std::unordered_map<std::string, std::vector<std::pair<std::weak_ptr<Connection>, uint64_t>>>
      waiters_;
  uint64_t next_wait_id_ = 1;

  bool queued(const std::string& key) const {
    auto it = queues_.find(key);
    return it != queues_.end() && !it->second.empty();
  }

  // Wakes the connections waiting for `key`, in the order they came. With `first_only` (after a
  // queue push) it stops after the first whose wait is then complete: that one pops the element,
  // the rest keep waiting, ahead of any registered meanwhile (PyTorch's wakeupOneWaitingClient,
  // except that woken waiters leave the list).
  void notify(const std::string& key, bool first_only = false) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    auto list = std::move(it->second);
    waiters_.erase(it);
    for (size_t i = 0; i < list.size(); ++i) {
      auto c = list[i].first.lock();
      if (c && c->on_key_ready(list[i].second) && first_only) {
        if (i + 1 == list.size()) return;
        auto& rest = waiters_[key];
        rest.insert(rest.begin(), list.begin() + i + 1, list.end());
        return;
      }
    }
  }

  void remove_waiter(const std::string& key, const Connection* conn) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    auto& list = it->second;
    list.erase(std::remove_if(list.begin(), list.end(),
                              [conn](const auto& w) {
                                auto c = w.first.lock();
                                return !c || c.get() == conn;
                              }),
               list.end());
    if (list.empty()) waiters_.erase(it);
  }

  void forget(uint64_t id) {
    if (connections_.erase(id)) num_connections_.fetch_sub(1);
  }

  asio::io_context& io() { return io_; }

  // A warning about one client (rejected, cut off). At most 10 per 5 s reach the log: a flood
  // of misbehaving clients must not flood it; the next line says how many were left out.
  void warn_client(const std::string& text) {
    uint64_t held = 0;
    if (!client_log_.allow(std::chrono::steady_clock::now(), &held)) return;
    if (held == 0) {
      spdlog::warn("store server: {}", text);
    } else {
      spdlog::warn("store server: {} ({} similar line(s) left out before this one)", text, held);
    }
  }

 private:
  void run() {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        // A handler must never throw; if one does, log it and keep serving the others.
        spdlog::error("store server: unexpected error in event loop: {}", e.what());
      }
    }
  }

  void accept() {
    acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
      if (ec) {
        // EMFILE and friends: nothing can be accepted until a descriptor frees up, and the
        // listening socket stays readable meanwhile. Back off (10 ms, doubling up to 1 s) rather
        // than spin, and log one line per 5 s that says how many failures it stands for.
        ++accept_failures_;
        uint64_t held = 0;
        if (accept_log_.allow(std::chrono::steady_clock::now(), &held)) {
          spdlog::warn(
              "store server: accept failed: {} ({} in a row{}); retrying in {} ms, existing "
              "connections are still served",
              ec.message(), accept_failures_,
              held ? ", " + std::to_string(held) + " not logged" : std::string(),
              accept_backoff_.count());
        }
        auto timer = std::make_shared<asio::steady_timer>(io_, accept_backoff_);
        accept_backoff_ = std::min(accept_backoff_ * 2, kMaxAcceptBackoff);
        timer->async_wait([this, timer](const boost::system::error_code&) { accept(); });
        return;
      }
      if (accept_failures_ > 0) {
        spdlog::warn("store server: accepting connections again after {} failed accept(s)",
                     accept_failures_);
        accept_failures_ = 0;
        accept_backoff_ = kMinAcceptBackoff;
      }
      auto conn = std::make_shared<Connection>(this, std::move(socket), next_conn_id_++);
      connections_.emplace(conn->id(), conn);
      num_connections_.fetch_add(1);
      conn->start();
      accept();
    });
  }

  static void raise_fd_limit() {
    rlimit rl{};
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      setrlimit(RLIMIT_NOFILE, &rl);
    }
  }

  StoreServerOptions options_;
  asio::io_context io_{1};
  tcp::acceptor acceptor_;
  asio::executor_work_guard<asio::io_context::executor_type> signals_guard_;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> connections_;
  std::atomic<size_t> num_connections_{0};
  std::atomic<uint64_t> num_requests_{0};
  uint64_t next_conn_id_ = 1;
  static constexpr std::chrono::milliseconds kMinAcceptBackoff{10};
  static constexpr std::chrono::milliseconds kMaxAcceptBackoff{1000};
  std::chrono::milliseconds accept_backoff_ = kMinAcceptBackoff;  // event-loop thread only
  uint64_t accept_failures_ = 0;                                  // in a row
  LogLimiter accept_log_{std::chrono::seconds(5)};
  LogLimiter client_log_{std::chrono::seconds(5), 10};
  uint16_t port_ = 0;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

Connection::Connection(ServerImpl* server, tcp::socket socket, uint64_t id)
    : server_(server),
      socket_(std::move(socket)),
      id_(id),
      wait_timer_(server->io()),
      lease_timer_(server->io()) {
  boost::system::error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);
  socket_.set_option(asio::socket_base::keep_alive(true), ec);
  auto ep = socket_.remote_endpoint(ec);
  peer_ =
      ec ? std::string("unknown peer") : ep.address().to_string() + ":" + std::to_string(ep.port());
  authenticated_ = server_->options().token.empty();
}

void Connection::start() { read(); }

void Connection::read() {
  if (closed_ || reading_) return;
  // Back-pressure: stop reading from a client that does not read its responses, or that piles up
  // requests behind a blocked wait.
  if (out_.size() + writing_.size() > server_->options().max_pending_output) return;
  if (blocked_ && in_.size() > kMaxBufferedWhileBlocked) return;
  reading_ = true;
  socket_.async_read_some(asio::buffer(chunk_),
                          [self = shared_from_this()](const boost::system::error_code& ec,
                                                      size_t n) { self->on_read(ec, n); });
}

void Connection::on_read(const boost::system::error_code& ec, size_t n) {
  reading_ = false;
  if (closed_) return;
  if (ec) {
    if (ec == asio::error::eof || ec == asio::error::connection_reset) {
      close("");
    } else {
      close("read failed: " + ec.message());
    }
    return;
  }
  in_.append(chunk_.data(), n);
  process();
  read();
}

void Connection::process() {
  if (processing_) return;  // re-entered from finish_wait inside execute
  processing_ = true;
  size_t offset = 0;
  while (!closed_) {
    std::string_view pending(in_.data() + offset, in_.size() - offset);
    if (pending.empty()) break;
    if (dialect_ == wire::Dialect::kUnknown) {
      dialect_ = wire::detect_dialect(pending);
      if (dialect_ == wire::Dialect::kUnknown) break;
    }
    wire::Request request;
    auto result = wire::decode(pending, dialect_, server_->options().limits, &request);
    if (result.status == wire::Status::kNeedMore) break;
    if (result.status == wire::Status::kMalformed) {
      close("malformed request: " + result.error);
      break;
    }
    // A blocked request holds back the ones behind it until it is answered or cancelled, except
    // a 1.13 WAIT: the 1.13 client gives up on a wait silently (a socket timeout, no CANCEL_WAIT)
    // and goes on using the connection, and PyTorch's 1.13 server keeps serving it, sending the
    // STOP_WAITING whenever the keys appear. Do the same.
    bool background_wait = dialect_ == wire::Dialect::kV1 && blocked_request_.op == Op::kWait;
    if (blocked_ && request.op != Op::kCancelWait && !background_wait) break;
    offset += result.consumed;
    // Counted once here: a blocked request runs execute() again when its keys arrive.
    if (request.op != Op::kValidate && request.op != Op::kAuthHello &&
        request.op != Op::kAuthProof) {
      server_->count_request();
    }
    if (!execute(request)) break;
  }
  in_.erase(0, offset);
  processing_ = false;
  flush();
}

bool Connection::execute(wire::Request& r) {
  auto& data = server_->data_;
  wire::Encoder enc(&out_);

  if (!authenticated_ && r.op != Op::kValidate && r.op != Op::kAuthHello &&
      r.op != Op::kAuthProof) {
    server_->warn_client("rejected " + peer_ + ": " + op_name(r.op) +
                         " before authenticating (a token is required)");
    close("");
    return false;
  }

  switch (r.op) {
    case Op::kValidate:
      if (static_cast<uint32_t>(r.number) != wire::kValidationMagic) {
        close("bad validation magic");
        return false;
      }
      return true;
    case Op::kAuthHello:
      challenge_ = auth::make_challenge();
      enc.bytes(challenge_);
      return true;
    case Op::kAuthProof: {
      bool ok = !challenge_.empty() &&
                auth::constant_time_equal(r.values[0],
                                          auth::hmac_sha256(server_->options().token, challenge_));
      challenge_.clear();
      if (!ok) {
        server_->warn_client("rejected " + peer_ + ": wrong token");
        enc.u8(0);
        flush();
        close("");
        return false;
      }
      authenticated_ = true;
      enc.u8(1);
      return true;
    }
    case Op::kSet:
      data[r.keys[0]] = std::move(r.values[0]);
      server_->notify(r.keys[0]);
      return true;
    case Op::kAppend: {
      auto& v = data[r.keys[0]];
      if (v.size() + r.values[0].size() > server_->options().limits.max_value_bytes) {
        close("append would grow '" + r.keys[0] + "' past the value size limit");
        return false;
      }
      v.append(r.values[0]);
      server_->notify(r.keys[0]);
      return true;
    }
    case Op::kMultiSet:
      for (size_t i = 0; i < r.keys.size(); ++i) {
        data[r.keys[i]] = std::move(r.values[i]);
        server_->notify(r.keys[i]);
      }
      return true;
    case Op::kCompareSet: {
      auto it = data.find(r.keys[0]);
      const std::string& expected = r.values[0];
      std::string& desired = r.values[1];
      if (it == data.end()) {
        if (expected.empty()) {
          data[r.keys[0]] = desired;
          enc.bytes(desired);
          server_->notify(r.keys[0]);
        } else {
          enc.bytes(expected);
        }
      } else if (it->second == expected) {
        it->second = desired;
        enc.bytes(desired);
        server_->notify(r.keys[0]);
      } else {
        enc.bytes(it->second);
      }
      return true;
    }
    case Op::kAdd:
    case Op::kBarrier: {
      // BARRIER counts arrivals in the key's decimal value, as ADD does; the arrival that
      // reaches the world size (r.number) releases everyone waiting on the key.
      const std::string& key = r.keys[0];
      auto it = data.find(key);
      int64_t value = 0;
      if (it != data.end()) {
        const std::string& s = it->second;
        auto [p, err] = std::from_chars(s.data(), s.data() + s.size(), value);
        if (err != std::errc() || p != s.data() + s.size()) {
          close(std::string(op_name(r.op)) + " on key '" + key + "' whose value is not an integer");
          return false;
        }
      }
      const int64_t delta = r.op == Op::kAdd ? r.number : 1;
      value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(delta));
      data[key] = std::to_string(value);
      if (r.op == Op::kAdd) {
        enc.i64(value);
        server_->notify(key);
        return true;
      }
      if (value >= r.number) {
        server_->notify(key);
        enc.u8(wire::kWaitStop);
        return true;
      }
      // Wait for the next change of the key: then a WAIT on it answers STOP_WAITING. A timed-out
      // client sends CANCEL_WAIT, as after a WAIT.
      wire::Request wait;
      wait.op = Op::kWait;
      wait.keys = {key};
      block_on({key}, std::move(wait), -1);
      return false;
    }
    case Op::kListKeys:
      enc.i64(static_cast<int64_t>(data.size()));
      for (const auto& kv : data) enc.bytes(kv.first);
      return true;
    case Op::kCheck: {
      bool all = true;
      for (auto& k : r.keys) all = all && (data.count(k) || server_->queued(k));
      enc.u8(all ? wire::kCheckReady : wire::kCheckNotReady);
      return true;
    }
    case Op::kNumKeys:
      enc.i64(static_cast<int64_t>(data.size()));
      return true;
    case Op::kDeleteKey:
      enc.i64(static_cast<int64_t>(data.erase(r.keys[0])));
      return true;
    case Op::kPing:
      enc.u32(static_cast<uint32_t>(r.number));
      return true;
    case Op::kLeaseArm: {
      if (r.number < 0) {
        close("LEASE_ARM with a negative ttl");
        return false;
      }
      if (!r.keys[0].empty()) {
        data[r.keys[0]] = r.values[0];
        server_->notify(r.keys[0]);
      }
      lease_ = std::move(r);
      lease_ttl_ms_ = lease_.number;
      lease_armed_ = true;
      arm_lease_timer();
      enc.u8(1);
      return true;
    }
    case Op::kLeaseRenew:
      if (r.number < 0) {
        close("LEASE_RENEW with a negative ttl");
        return false;
      }
      if (lease_armed_) {
        if (r.number > 0) lease_ttl_ms_ = r.number;
        arm_lease_timer();
      }
      enc.u8(lease_armed_ ? 1 : 0);
      return true;
    case Op::kLeaseRelease: {
      bool was = lease_armed_;
      lease_armed_ = false;
      ++lease_generation_;
      boost::system::error_code ec;
      lease_timer_.cancel(ec);
      enc.u8(was ? 1 : 0);
      return true;
    }
    case Op::kCancelWait:
      if (blocked_) clear_wait();
      enc.u8(wire::kWaitCanceled);
      return true;
    case Op::kWatchKey:
      // 1.13's callback socket; PyTorch itself never uses watches in its launcher. Confirmed with
      // KEY_CALLBACK_REGISTERED (the 1.13 C++ client's watchKey() blocks until it arrives) and
      // never notified.
      spdlog::debug("store server: {} asked to watch '{}' (unsupported, never notified)", peer_,
                    r.keys[0]);
      enc.u8(3);  // WatchResponseType::KEY_CALLBACK_REGISTERED
      return true;
    case Op::kQueuePush: {
      auto& q = server_->queues_[r.keys[0]];
      q.push_back(std::move(r.values[0]));
      server_->notify(r.keys[0], /*first_only=*/true);
      return true;
    }
    case Op::kQueuePop: {
      // The length before the pop, then the front element when there is one.
      auto it = server_->queues_.find(r.keys[0]);
      size_t n = it == server_->queues_.end() ? 0 : it->second.size();
      enc.i64(static_cast<int64_t>(n));
      if (n > 0) {
        enc.bytes(it->second.front());
        it->second.pop_front();
        if (it->second.empty()) server_->queues_.erase(it);
      }
      return true;
    }
    case Op::kQueueLen: {
      auto it = server_->queues_.find(r.keys[0]);
      enc.i64(static_cast<int64_t>(it == server_->queues_.end() ? 0 : it->second.size()));
      return true;
    }
    case Op::kWait:
    case Op::kWaitKeys:
    case Op::kGet:
    case Op::kGetWait:
    case Op::kMultiGet: {
      std::vector<std::string> missing;
      std::unordered_set<std::string_view> seen;
      // A WAIT is also satisfied by a non-empty queue (queue_pop(block=True) is WAIT + QUEUE_POP).
      const bool queues_count = r.op == Op::kWait || r.op == Op::kWaitKeys;
      for (auto& k : r.keys) {
        bool present = data.count(k) || (queues_count && server_->queued(k));
        if (!present && seen.insert(k).second) missing.push_back(k);
      }
      if (!missing.empty()) {
        int64_t timeout_ms = (r.op == Op::kWaitKeys || r.op == Op::kGetWait) ? r.number : -1;
        if (timeout_ms == 0) {
          enc.u8(wire::kWaitTimedOut);
          return true;
        }
        block_on(std::move(missing), std::move(r), timeout_ms);
        return false;
      }
      switch (r.op) {
        case Op::kWait:
        case Op::kWaitKeys:
          enc.u8(wire::kWaitStop);
          break;
        case Op::kGetWait:
          enc.u8(wire::kWaitStop);
          enc.bytes(data[r.keys[0]]);
          break;
        case Op::kGet:
          enc.bytes(data[r.keys[0]]);
          break;
        default:  // kMultiGet
          for (auto& k : r.keys) enc.bytes(data[k]);
      }
      return true;
    }
  }
  return true;
}

void Connection::block_on(std::vector<std::string> missing, wire::Request request,
                          int64_t timeout_ms) {
  if (blocked_) clear_wait();  // a new wait replaces a pending 1.13 one (see process())
  blocked_ = true;
  wait_id_ = server_->next_wait_id_++;
  wait_remaining_ = missing.size();
  wait_keys_ = std::move(missing);
  blocked_request_ = std::move(request);
  for (auto& k : wait_keys_) server_->waiters_[k].emplace_back(weak_from_this(), wait_id_);
  if (timeout_ms > 0) {
    wait_timer_.expires_after(std::chrono::milliseconds(timeout_ms));
    wait_timer_.async_wait(
        [self = shared_from_this(), id = wait_id_](const boost::system::error_code& ec) {
          if (ec || self->closed_ || !self->blocked_ || self->wait_id_ != id) return;
          self->finish_wait(wire::kWaitTimedOut);
        });
  }
}

bool Connection::on_key_ready(uint64_t wait_id) {
  if (closed_ || !blocked_ || wait_id != wait_id_) return false;
  if (--wait_remaining_ > 0) return false;
  finish_wait(0);
  return true;
}

void Connection::finish_wait(uint8_t timed_out_code) {
  wire::Request request = std::move(blocked_request_);
  clear_wait();
  if (timed_out_code) {
    wire::Encoder(&out_).u8(timed_out_code);
  } else {
    // Every key exists now (or one was deleted again, in which case this blocks anew).
    execute(request);
  }
  process();  // serve what queued up behind the wait
  read();
}

void Connection::clear_wait() {
  for (auto& k : wait_keys_) server_->remove_waiter(k, this);
  wait_keys_.clear();
  blocked_ = false;
  wait_remaining_ = 0;
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
}

void Connection::arm_lease_timer() {
  uint64_t generation = ++lease_generation_;
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  if (lease_ttl_ms_ <= 0) return;  // bound to the connection only
  lease_timer_.expires_after(std::chrono::milliseconds(lease_ttl_ms_));
  lease_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->closed_ || !self->lease_armed_ || self->lease_generation_ != generation) {
          return;
        }
        self->fire_lease("no keep-alive");
      });
}

void Connection::fire_lease(const char* why) {
  if (!lease_armed_) return;
  lease_armed_ = false;
  ++lease_generation_;
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  auto& data = server_->data_;
  const std::string& a_key = lease_.keys[1];
  const std::string& b_key = lease_.keys[2];
  spdlog::info("store server: lease of {} lost ({}{}): notifying '{}'", peer_, why,
               lease_ttl_ms_ > 0 && std::string_view(why) == "no keep-alive"
                   ? " for " + std::to_string(lease_ttl_ms_) + " ms"
                   : std::string(),
               !a_key.empty() && !data.count(a_key) ? a_key : b_key);
  if (!a_key.empty() && !data.count(a_key)) {
    data[a_key] = lease_.values[1];
    server_->notify(a_key);
  } else if (!b_key.empty()) {
    auto& v = data[b_key];
    if (v.size() + lease_.values[2].size() <= server_->options().limits.max_value_bytes) {
      v.append(lease_.values[2]);
    }
    server_->notify(b_key);
  }
}

void Connection::flush() {
  if (closed_ || writing_now_ || out_.empty()) return;
  writing_now_ = true;
  writing_.swap(out_);
  out_.clear();
  asio::async_write(socket_, asio::buffer(writing_),
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      self->writing_now_ = false;
                      self->writing_.clear();
                      if (self->closed_) return;
                      if (ec) {
                        self->close("write failed: " + ec.message());
                        return;
                      }
                      self->flush();
                      self->read();  // may have paused for back-pressure
                    });
}

void Connection::close(const std::string& why) {
  if (closed_) return;
  closed_ = true;
  if (!why.empty()) server_->warn_client("closing connection from " + peer_ + ": " + why);
  if (blocked_) clear_wait();
  // A lease fires when its connection goes away, unless the whole server is stopping.
  if (lease_armed_ && !server_->stopping()) fire_lease("connection closed");
  lease_armed_ = false;
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  server_->forget(id_);
}

}  // namespace

std::unique_ptr<StoreServer> StoreServer::start(const StoreServerOptions& options) {
  auto server = std::make_unique<ServerImpl>(options);
  server->listen();
  return server;
}

}  // namespace trun::rendezvous
