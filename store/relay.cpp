#include "store/relay.h"

#include <spdlog/spdlog.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <deque>
#include <thread>
#include <unordered_map>
#include <vector>

#include "store/acceptor.h"
#include "store/log_limiter.h"
#include "store/store.h"

namespace trun::store {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using wire::Op;

constexpr size_t kReadChunk = 64 * 1024;
// A client with a request passed to the store (or a wait) stops being read once this much
// unprocessed input has piled up behind it.
constexpr size_t kMaxBufferedBehindRequest = 1 << 20;
// An upstream wait is renewed at this interval while clients still wait (each client's own
// timeout is kept by the relay).
constexpr int64_t kUpstreamWaitMs = 60 * 1000;

class RelayImpl;

// `op` (LEASE_ARM or LEASE_FIRE) with a client lease's notification keys, nothing to set, no ttl.
std::string lease_request(Op op, const wire::Request& lease) {
  std::string req;
  wire::Encoder(&req)
      .query(op)
      .bytes("")
      .bytes("")
      .bytes(lease.keys[1])
      .bytes(lease.values[1])
      .bytes(lease.keys[2])
      .bytes(lease.values[2])
      .i64(0);
  return req;
}

// Reads a wire value from the front of `in` at *pos; false while it is incomplete.
bool skip_bytes(std::string_view in, size_t* pos) {
  if (in.size() < *pos + 8) return false;
  uint64_t n = 0;
  std::memcpy(&n, in.data() + *pos, 8);
  if (in.size() - *pos - 8 < n) return false;
  *pos += 8 + n;
  return true;
}

// The shape of a passed-through request's answer, to cut it out of the upstream stream.
struct Answer {
  // kStatusValue: a GET_TIMEOUT's (a status, then the value when it is STOP_WAITING).
  // kU32: a PING's (the relay's fences).
  enum class Kind : uint8_t { kBytes, kI64, kU8, kU32, kList, kStatusValue } kind = Kind::kU8;
  size_t count = 0;     // kList: that many byte strings
  uint64_t client = 0;  // 0: the relay's own request (its lease): the answer is dropped
  bool fence = false;   // a PING behind the client's writes: the client's wait may go out now
};

// How many bytes at the front of `in` form the answer `a`; 0 while incomplete.
size_t answer_size(std::string_view in, const Answer& a) {
  size_t pos = 0;
  switch (a.kind) {
    case Answer::Kind::kU8:
      return in.size() >= 1 ? 1 : 0;
    case Answer::Kind::kI64:
      return in.size() >= 8 ? 8 : 0;
    case Answer::Kind::kU32:
      return in.size() >= 4 ? 4 : 0;
    case Answer::Kind::kBytes:
      return skip_bytes(in, &pos) ? pos : 0;
    case Answer::Kind::kList:  // count > 0 (an empty MULTI_GET is answered by the relay)
      for (size_t i = 0; i < a.count; ++i) {
        if (!skip_bytes(in, &pos)) return 0;
      }
      return pos;
    case Answer::Kind::kStatusValue:
      if (in.empty()) return 0;
      if (static_cast<uint8_t>(in[0]) != wire::kWaitStop) return 1;
      pos = 1;
      return skip_bytes(in, &pos) ? pos : 0;
  }
  return 0;
}

class Client : public std::enable_shared_from_this<Client> {
 public:
  Client(RelayImpl* relay, tcp::socket socket, uint64_t id);
  void start() { read(); }
  void close(const std::string& why);
  // The answer to the request being served (passed through, or a wait's). `in_order`: it came
  // over the relay's one upstream connection, behind every write the client sent before.
  void answer(std::string_view bytes, bool in_order = false);
  // The fence behind this client's writes came back: its parked wait may go upstream now.
  void fenced();
  // The shared wait `wait_id` of this client ended with `bytes` (status [+ value]).
  void wait_done(uint64_t wait_id, std::string_view bytes);
  uint64_t id() const { return id_; }
  bool closed() const { return closed_; }

 private:
  void read();
  void on_read(boost::system::error_code ec);
  void process();
  // Serves one request; false when the client now waits for an answer (or closed).
  bool execute(wire::Request& r, std::string_view raw);
  void flush();
  void arm_lease_timer();
  void fire_lease();
  void end_wait();

  RelayImpl* relay_;
  tcp::socket socket_;
  uint64_t id_;
  std::string in_, out_, writing_;
  bool reading_ = false, writing_now_ = false, closed_ = false;
  bool busy_ = false;  // a passed-through request is unanswered
  bool output_full() const;
  // The client sent writes (answered by nothing) since its last answer that came in order: a wait
  // (on another upstream connection) could overtake them, so it waits for a fence first.
  bool unfenced_writes_ = false;
  wire::Request fenced_wait_;  // the wait held back for the fence
  // Joins (or starts) the shared wait for `r`; false when the client was closed.
  bool start_wait(const wire::Request& r);
  wire::Dialect dialect_ = wire::Dialect::kUnknown;
  // A wait shared upstream (RelayImpl::waits_): its key and this client's id for it.
  std::string wait_sig_;
  uint64_t wait_id_ = 0;
  asio::steady_timer wait_timer_;
  // The client's lease, kept here: keys/values as LEASE_ARM sent them.
  bool lease_armed_ = false;
  wire::Request lease_;
  int64_t lease_ttl_ = 0;
  uint64_t lease_generation_ = 0;
  asio::steady_timer lease_timer_;
};

class RelayImpl : public StoreRelay {
 public:
  explicit RelayImpl(const StoreRelayOptions& o)
      : options_(o), acceptor_(io_, "store relay"), up_(io_) {}
  ~RelayImpl() override { stop(); }

  void listen() {
    boost::system::error_code ec;
    tcp::resolver resolver(io_);
    auto ups = resolver.resolve(options_.upstream_host, std::to_string(options_.upstream_port), ec);
    if (!ec) asio::connect(up_, ups, ec);
    if (ec) {
      throw StoreError("store relay: cannot reach the store at " + options_.upstream_host + ":" +
                       std::to_string(options_.upstream_port) + ": " + ec.message());
    }
    up_.set_option(tcp::no_delay(true), ec);
    up_.non_blocking(true, ec);
    upstream_ = up_.remote_endpoint(ec);
    std::string hello;
    wire::Encoder(&hello).query(Op::kValidate).u32(wire::kValidationMagic);
    send_up(hello);
    auto local =
        resolver.resolve(options_.host, std::to_string(options_.port), tcp::resolver::passive, ec);
    if (ec || local.empty()) {
      throw StoreError("store relay: cannot resolve '" + options_.host + "': " + ec.message());
    }
    port_ = acceptor_.listen(local.begin()->endpoint(), options_.backlog, /*dual_stack=*/false, ec);
    if (ec) {
      throw StoreError("store relay: cannot listen on " + options_.host + ":" +
                       std::to_string(options_.port) + ": " + ec.message());
    }
    acceptor_.start([this](tcp::socket socket) { adopt(std::move(socket)); });
    read_up();
    thread_ = std::thread([this] { run(); });
  }

  uint16_t port() const override { return port_; }
  size_t num_connections() const override { return num_connections_.load(); }
  uint64_t num_requests() const override { return num_requests_.load(); }
  uint64_t upstream_requests() const override { return upstream_requests_.load(); }

  void stop() override {
    if (stopped_.exchange(true)) return;
    asio::post(io_, [this] { shut_down(); });
    if (thread_.joinable()) thread_.join();
  }

  const StoreRelayOptions& options() const { return options_; }
  asio::io_context& io() { return io_; }
  std::array<char, kReadChunk>& buffer() { return buffer_; }
  void count_request() { num_requests_.fetch_add(1, std::memory_order_relaxed); }
  void forget(uint64_t id) {
    if (clients_.erase(id)) num_connections_.fetch_sub(1);
  }
  void warn(const std::string& text) {
    uint64_t held = 0;
    if (log_.allow(std::chrono::steady_clock::now(), &held)) spdlog::warn("store relay: {}", text);
  }

  // Sends `raw` (one request in the store's protocol) upstream; its answer goes to `client`.
  void pass(uint64_t client, std::string_view raw, Answer a) {
    a.client = client;
    send_up(raw);
    answers_.push_back(a);
  }
  // Sends a request that has no answer (SET, APPEND, MULTI_SET).
  void pass_unanswered(std::string_view raw) { send_up(raw); }

  // The client waits for `keys` (GET_WAIT when `get`): joins the wait other clients share, or
  // starts it upstream. Returns this wait's id; the client hears wait_done(id, answer).
  uint64_t wait(uint64_t client, bool get, const std::vector<std::string>& keys,
                std::string* sig_out) {
    std::string sig = get ? "g" : "w";
    for (auto& k : keys) {
      sig += std::to_string(k.size()) + ":" + k;
    }
    *sig_out = sig;
    const uint64_t id = next_wait_id_++;
    auto& w = waits_[sig];
    w.waiters.emplace_back(client, id);
    if (!w.conn) {
      w.get = get;
      w.keys = keys;
      w.conn = take_wait_connection();
      if (!w.conn) {
        waits_.erase(sig);
        return 0;
      }
      issue(sig);
    }
    return id;
  }
  void leave_wait(const std::string& sig, uint64_t client) {
    auto it = waits_.find(sig);
    if (it == waits_.end()) return;
    auto& list = it->second.waiters;
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].first == client) {
        list[i] = list.back();
        list.pop_back();
        break;
      }
    }
  }

  // A PING behind `client`'s writes on the upstream connection; its answer calls fenced().
  void fence(uint64_t client) {
    std::string req;
    wire::Encoder(&req).query(Op::kPing).u32(0);
    Answer a;
    a.kind = Answer::Kind::kU32;
    a.fence = true;
    pass(client, req, a);
  }
  bool stopping() const { return stopped_.load(); }

  // The relay's own lease upstream follows the newest round its clients arm leases for.
  void cover(const wire::Request& lease) {
    if (lease.keys[2] == covered_) return;
    covered_ = lease.keys[2];
    pass(0, lease_request(Op::kLeaseArm, lease), {Answer::Kind::kU8});
  }
  void fire(const wire::Request& lease) {
    pass(0, lease_request(Op::kLeaseFire, lease), {Answer::Kind::kU8});
  }

 private:
  struct WaitConn {
    explicit WaitConn(asio::io_context& io) : socket(io) {}
    tcp::socket socket;
    std::string in;
  };
  struct SharedWait {
    bool get = false;
    std::vector<std::string> keys;
    std::vector<std::pair<uint64_t, uint64_t>> waiters;  // client, wait id
    std::shared_ptr<WaitConn> conn;
  };

  void run() {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        spdlog::error("store relay: unexpected error in event loop: {}", e.what());
      }
    }
  }

  void adopt(tcp::socket socket) {
    auto c = std::make_shared<Client>(this, std::move(socket), next_client_id_++);
    clients_.emplace(c->id(), c);
    num_connections_.fetch_add(1);
    c->start();
  }

  void send_up(std::string_view raw) {
    upstream_requests_.fetch_add(1, std::memory_order_relaxed);
    up_out_.append(raw);
    flush_up();
  }
  void flush_up() {
    if (up_writing_now_ || up_out_.empty() || up_failed_) return;
    up_writing_now_ = true;
    up_writing_.swap(up_out_);
    up_out_.clear();
    asio::async_write(up_, asio::buffer(up_writing_),
                      [this](const boost::system::error_code& ec, size_t) {
                        up_writing_now_ = false;
                        up_writing_.clear();
                        if (ec) {
                          upstream_lost("write: " + ec.message());
                          return;
                        }
                        flush_up();
                      });
  }
  // Reads what `socket` has into *in (the event loop's one buffer, read when readable); false on
  // an error (logged as lost upstream).
  bool read_into(tcp::socket& socket, std::string* in, const char* what) {
    boost::system::error_code ec;
    size_t n = socket.read_some(asio::buffer(buffer_), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) return true;
    if (ec) {
      upstream_lost(std::string(what) + ": " +
                    (ec == asio::error::eof ? "the store closed the connection" : ec.message()));
      return false;
    }
    in->append(buffer_.data(), n);
    return true;
  }

  void read_up() {
    up_.async_wait(tcp::socket::wait_read, [this](const boost::system::error_code& ec) {
      if (ec) {
        upstream_lost(ec.message());
        return;
      }
      if (!read_into(up_, &up_in_, "store")) return;
      size_t used = 0;
      while (!answers_.empty()) {
        std::string_view rest(up_in_.data() + used, up_in_.size() - used);
        size_t size = answer_size(rest, answers_.front());
        if (size == 0) break;
        const uint64_t client = answers_.front().client;
        const bool fence = answers_.front().fence;
        answers_.pop_front();
        used += size;
        if (client == 0) continue;
        auto it = clients_.find(client);
        if (it == clients_.end()) continue;
        if (fence) {
          it->second->fenced();
        } else {
          it->second->answer(rest.substr(0, size), true);
        }
      }
      up_in_.erase(0, used);
      read_up();
    });
  }

  std::shared_ptr<WaitConn> take_wait_connection() {
    if (!idle_waits_.empty()) {
      auto c = idle_waits_.back();
      idle_waits_.pop_back();
      return c;
    }
    auto c = std::make_shared<WaitConn>(io_);
    boost::system::error_code ec;
    c->socket.connect(upstream_, ec);
    if (ec) {
      warn("cannot open a wait connection to the store: " + ec.message());
      return nullptr;
    }
    c->socket.set_option(tcp::no_delay(true), ec);
    std::string hello;
    wire::Encoder(&hello).query(Op::kValidate).u32(wire::kValidationMagic);
    asio::write(c->socket, asio::buffer(hello), ec);
    if (!ec) c->socket.non_blocking(true, ec);
    return ec ? nullptr : c;
  }

  // (Re)sends the shared wait `sig` upstream and reads its answer.
  void issue(const std::string& sig) {
    auto& w = waits_.at(sig);
    auto req = std::make_shared<std::string>();
    wire::Encoder enc(req.get());
    enc.query(w.get ? Op::kGetWait : Op::kWaitKeys).u64(w.keys.size());
    for (auto& k : w.keys) enc.bytes(k);
    enc.i64(kUpstreamWaitMs);
    upstream_requests_.fetch_add(1, std::memory_order_relaxed);
    auto conn = w.conn;
    asio::async_write(conn->socket, asio::buffer(*req),
                      [this, req, conn, sig](const boost::system::error_code& ec, size_t) {
                        if (ec) {
                          upstream_lost("wait: " + ec.message());
                          return;
                        }
                        read_wait(sig, conn);
                      });
  }
  void read_wait(const std::string& sig, std::shared_ptr<WaitConn> conn) {
    conn->socket.async_wait(tcp::socket::wait_read,
                            [this, sig, conn](const boost::system::error_code& ec) {
                              if (ec) {
                                upstream_lost("wait: " + ec.message());
                                return;
                              }
                              if (!read_into(conn->socket, &conn->in, "wait")) return;
                              auto it = waits_.find(sig);
                              if (it == waits_.end()) return;
                              SharedWait& w = it->second;
                              Answer shape;
                              shape.kind = w.get ? Answer::Kind::kStatusValue : Answer::Kind::kU8;
                              const size_t size = answer_size(conn->in, shape);
                              if (size == 0) {
                                read_wait(sig, conn);
                                return;
                              }
                              const std::string bytes = conn->in.substr(0, size);
                              conn->in.erase(0, size);
                              const uint8_t status = static_cast<uint8_t>(bytes[0]);
                              if (status == wire::kWaitTimedOut && !w.waiters.empty()) {
                                issue(sig);  // the clients' own timeouts are kept here
                                return;
                              }
                              auto waiters = std::move(w.waiters);
                              waits_.erase(it);
                              if (status == wire::kWaitTimedOut || status == wire::kWaitStop)
                                idle_waits_.push_back(conn);
                              for (auto& [client, id] : waiters) {
                                auto c = clients_.find(client);
                                if (c != clients_.end()) c->second->wait_done(id, bytes);
                              }
                              if (status == wire::kWaitGoingAway)
                                upstream_lost("the store is going away");
                            });
  }

  void upstream_lost(const std::string& why) {
    if (up_failed_) return;
    up_failed_ = true;
    if (!stopped_.load()) spdlog::error("store relay: lost the store: {}", why);
    shut_down();
  }
  void shut_down() {
    acceptor_.close();
    boost::system::error_code ec;
    auto clients = clients_;
    for (auto& [id, c] : clients) c->close("");
    up_.close(ec);
    for (auto& [sig, w] : waits_) {
      if (w.conn) w.conn->socket.close(ec);
    }
    for (auto& c : idle_waits_) c->socket.close(ec);
    waits_.clear();
    idle_waits_.clear();
  }

  StoreRelayOptions options_;
  asio::io_context io_{1};
  Acceptor acceptor_;
  tcp::socket up_;
  tcp::endpoint upstream_;
  std::string up_in_, up_out_, up_writing_;
  bool up_writing_now_ = false;
  bool up_failed_ = false;
  std::array<char, kReadChunk> buffer_;
  std::deque<Answer> answers_;
  std::unordered_map<uint64_t, std::shared_ptr<Client>> clients_;
  std::unordered_map<std::string, SharedWait> waits_;
  std::vector<std::shared_ptr<WaitConn>> idle_waits_;
  std::string covered_;  // the over key the relay's own lease names
  uint64_t next_client_id_ = 1;
  uint64_t next_wait_id_ = 1;
  std::atomic<size_t> num_connections_{0};
  std::atomic<uint64_t> num_requests_{0};
  std::atomic<uint64_t> upstream_requests_{0};
  LogLimiter log_{std::chrono::seconds(5), 10};
  uint16_t port_ = 0;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

Client::Client(RelayImpl* relay, tcp::socket socket, uint64_t id)
    : relay_(relay),
      socket_(std::move(socket)),
      id_(id),
      wait_timer_(relay->io()),
      lease_timer_(relay->io()) {
  boost::system::error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);
  socket_.non_blocking(true, ec);
}

bool Client::output_full() const {
  return out_.size() + writing_.size() > relay_->options().max_pending_output;
}

void Client::read() {
  if (closed_ || reading_) return;
  // Back-pressure, as the store's: a client that does not read its replies, or that pipelines
  // requests faster than they come back from the store, stops being read from.
  if (output_full()) return;
  if (in_.size() > kMaxBufferedBehindRequest && (busy_ || wait_id_ != 0)) return;
  reading_ = true;
  socket_.async_wait(
      tcp::socket::wait_read,
      [self = shared_from_this()](const boost::system::error_code& ec) { self->on_read(ec); });
}

void Client::on_read(boost::system::error_code ec) {
  reading_ = false;
  if (closed_) return;
  if (!ec) {
    auto& buffer = relay_->buffer();
    size_t n = socket_.read_some(asio::buffer(buffer), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      read();
      return;
    }
    if (!ec) in_.append(buffer.data(), n);
  }
  if (ec) {
    close(ec == asio::error::eof || ec == asio::error::connection_reset ? ""
                                                                        : "read: " + ec.message());
    return;
  }
  process();
  read();
}

void Client::process() {
  size_t offset = 0;
  while (!closed_ && !busy_) {
    std::string_view pending(in_.data() + offset, in_.size() - offset);
    if (pending.empty()) break;
    // Per request: nothing more is passed on while the client's unsent replies are over the
    // limit; the write completion goes on from here.
    if (output_full()) break;
    if (dialect_ == wire::Dialect::kUnknown) {
      dialect_ = wire::detect_dialect(pending);
      if (dialect_ == wire::Dialect::kUnknown) break;
      if (dialect_ != wire::Dialect::kV2) {
        close("PyTorch 1.13's dialect is not relayed (connect to the store itself)");
        break;
      }
    }
    wire::Request r;
    auto result = wire::decode(pending, dialect_, relay_->options().limits, &r);
    if (result.status == wire::Status::kNeedMore) break;
    if (result.status == wire::Status::kMalformed) {
      close("malformed request: " + result.error);
      break;
    }
    // Behind a wait only its cancellation is read.
    if (wait_id_ != 0 && r.op != Op::kCancelWait) break;
    offset += result.consumed;
    if (r.op != Op::kValidate) relay_->count_request();
    if (!execute(r, pending.substr(0, result.consumed))) break;
  }
  in_.erase(0, offset);
  flush();
}

bool Client::execute(wire::Request& r, std::string_view raw) {
  wire::Encoder enc(&out_);
  auto pass = [&](Answer::Kind kind, size_t count = 0) {
    busy_ = true;
    Answer a;
    a.kind = kind;
    a.count = count;
    relay_->pass(id_, raw, a);
    return false;
  };
  switch (r.op) {
    case Op::kValidate:
      if (static_cast<uint32_t>(r.number) != wire::kValidationMagic) {
        close("bad validation magic");
        return false;
      }
      return true;
    case Op::kPing:
      enc.u32(static_cast<uint32_t>(r.number));
      return true;
    case Op::kSet:
    case Op::kAppend:
    case Op::kMultiSet:
      relay_->pass_unanswered(raw);
      unfenced_writes_ = true;
      return true;
    case Op::kCompareSet:
    case Op::kGet:
      return pass(Answer::Kind::kBytes);
    case Op::kAdd:
    case Op::kDeleteKey:
    case Op::kNumKeys:
      return pass(Answer::Kind::kI64);
    case Op::kCheck:
      return pass(Answer::Kind::kU8);
    case Op::kMultiGet:
      if (r.keys.empty()) return true;  // nothing to answer
      return pass(Answer::Kind::kList, r.keys.size());
    case Op::kWait:
    case Op::kWaitKeys:
    case Op::kGetWait: {
      if (r.op == Op::kGetWait && r.keys.size() != 1) {
        close("GET_TIMEOUT with " + std::to_string(r.keys.size()) + " keys");
        return false;
      }
      if (r.op != Op::kWait && r.number == 0) {  // a look, not a wait: the store answers it
        return pass(r.op == Op::kGetWait ? Answer::Kind::kStatusValue : Answer::Kind::kU8);
      }
      if (unfenced_writes_) {
        busy_ = true;
        fenced_wait_ = r;
        relay_->fence(id_);
        return false;
      }
      if (!start_wait(r)) return false;
      return true;  // parked: process() reads only a CANCEL_WAIT behind it
    }
    case Op::kCancelWait:
      if (wait_id_ != 0) end_wait();
      enc.u8(wire::kWaitCanceled);
      return true;
    case Op::kLeaseArm:
      if (r.number < 0) {
        close("LEASE_ARM with a negative ttl");
        return false;
      }
      if (!r.keys[0].empty()) {
        std::string set;
        wire::Encoder(&set).query(Op::kSet).bytes(r.keys[0]).bytes(r.values[0]);
        relay_->pass_unanswered(set);
        unfenced_writes_ = true;
      }
      lease_ = std::move(r);
      lease_ttl_ = lease_.number;
      lease_armed_ = true;
      relay_->cover(lease_);
      arm_lease_timer();
      enc.u8(1);
      return true;
    case Op::kLeaseRenew:
      if (lease_armed_ && r.number > 0) lease_ttl_ = r.number;
      if (lease_armed_) arm_lease_timer();
      enc.u8(lease_armed_ ? 1 : 0);
      return true;
    case Op::kLeaseRelease: {
      const bool was = lease_armed_;
      lease_armed_ = false;
      ++lease_generation_;
      boost::system::error_code ec;
      lease_timer_.cancel(ec);
      enc.u8(was ? 1 : 0);
      return true;
    }
    default:
      close(std::string("a relay does not serve ") + wire::op_name(r.op) +
            " (connect to the store itself)");
      return false;
  }
}

bool Client::start_wait(const wire::Request& r) {
  wait_id_ = relay_->wait(id_, r.op == Op::kGetWait, r.keys, &wait_sig_);
  if (wait_id_ == 0) {
    close("the store does not take another wait connection");
    return false;
  }
  // A timeout over kMaxWaitTimeoutMs means none (a deadline that far out would overflow).
  if (r.op != Op::kWait && r.number > 0 && r.number <= wire::kMaxWaitTimeoutMs) {
    wait_timer_.expires_after(std::chrono::milliseconds(r.number));
    wait_timer_.async_wait(
        [self = shared_from_this(), id = wait_id_](const boost::system::error_code& ec) {
          if (ec || self->closed_ || self->wait_id_ != id) return;
          self->end_wait();
          const uint8_t timed_out = wire::kWaitTimedOut;
          self->answer(std::string_view(reinterpret_cast<const char*>(&timed_out), 1));
        });
  }
  return true;
}

void Client::fenced() {
  if (closed_) return;
  busy_ = false;
  unfenced_writes_ = false;
  if (!start_wait(fenced_wait_)) return;
  process();
  flush();
  read();
}

void Client::end_wait() {
  relay_->leave_wait(wait_sig_, id_);
  wait_id_ = 0;
  wait_sig_.clear();
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
}

void Client::answer(std::string_view bytes, bool in_order) {
  if (closed_) return;
  busy_ = false;
  if (in_order) unfenced_writes_ = false;
  out_.append(bytes);
  process();  // what queued up behind the request
  flush();
  read();
}

void Client::wait_done(uint64_t wait_id, std::string_view bytes) {
  if (closed_ || wait_id != wait_id_) return;
  wait_id_ = 0;
  wait_sig_.clear();
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
  const bool going_away = !bytes.empty() && static_cast<uint8_t>(bytes[0]) == wire::kWaitGoingAway;
  answer(bytes);
  if (going_away) close("");
}

void Client::arm_lease_timer() {
  const uint64_t generation = ++lease_generation_;
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  if (lease_ttl_ <= 0) return;  // bound to the connection only
  lease_timer_.expires_after(std::chrono::milliseconds(lease_ttl_));
  lease_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->closed_ || !self->lease_armed_ || self->lease_generation_ != generation) {
          return;
        }
        self->fire_lease();
      });
}

void Client::fire_lease() {
  if (!lease_armed_) return;
  lease_armed_ = false;
  ++lease_generation_;
  relay_->fire(lease_);
}

void Client::flush() {
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
                        self->close("write: " + ec.message());
                        return;
                      }
                      self->process();  // what back-pressure held back (flushes)
                      self->flush();
                      self->read();
                    });
}

void Client::close(const std::string& why) {
  if (closed_) return;
  closed_ = true;
  if (!why.empty())
    relay_->warn("closing the connection of client " + std::to_string(id_) + ": " + why);
  if (wait_id_ != 0) end_wait();
  // The agent is gone: the store hears it as from a closed connection. Not when the relay stops:
  // its own lease tells the store once for all of them.
  if (!relay_->stopping()) fire_lease();
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  socket_.close(ec);
  relay_->forget(id_);
}

}  // namespace

std::unique_ptr<StoreRelay> StoreRelay::start(const StoreRelayOptions& options) {
  auto relay = std::make_unique<RelayImpl>(options);
  relay->listen();
  return relay;
}

}  // namespace trun::store
