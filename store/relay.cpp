#include "store/relay.h"

#include <spdlog/spdlog.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <cstring>
#include <deque>
#include <thread>
#include <unordered_map>
#include <vector>

#include "store/acceptor.h"
#include "store/event_loop.h"
#include "store/log_limiter.h"
#include "store/relay_client.h"
#include "store/store.h"

namespace trun::store {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using relay_detail::Answer;
using relay_detail::Client;
using relay_detail::kReadChunk;
using wire::Op;

// An upstream wait is renewed at this interval while clients still wait (each client's own
// timeout is kept by the relay).
constexpr int64_t kUpstreamWaitMs = 60 * 1000;

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

class RelayImpl : public StoreRelay, private relay_detail::RelayHost {
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
    thread_ = std::thread([this] { run_event_loop(io_, "store relay"); });
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

  const StoreRelayOptions& options() const override { return options_; }
  asio::io_context& io() override { return io_; }
  std::array<char, kReadChunk>& buffer() override { return buffer_; }
  void count_request() override { num_requests_.fetch_add(1, std::memory_order_relaxed); }
  void forget(uint64_t id) override {
    if (clients_.erase(id)) num_connections_.fetch_sub(1);
  }
  void warn(const std::string& text) override {
    uint64_t held = 0;
    if (log_.allow(std::chrono::steady_clock::now(), &held)) spdlog::warn("store relay: {}", text);
  }

  // Sends `raw` (one request in the store's protocol) upstream; its answer goes to `client`.
  void pass(uint64_t client, std::string_view raw, Answer a) override {
    a.client = client;
    send_up(raw);
    answers_.push_back(a);
  }
  // Sends a request that has no answer (SET, APPEND, MULTI_SET).
  void pass_unanswered(std::string_view raw) override { send_up(raw); }

  // The client waits for `keys` (GET_WAIT when `get`): joins the wait other clients share, or
  // starts it upstream. Returns this wait's id; the client hears wait_done(id, answer).
  uint64_t wait(uint64_t client, bool get, const std::vector<std::string>& keys,
                std::string* sig_out) override {
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
  void leave_wait(const std::string& sig, uint64_t client) override {
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
  void fence(uint64_t client) override {
    std::string req;
    wire::Encoder(&req).query(Op::kPing).u32(0);
    Answer a;
    a.kind = Answer::Kind::kU32;
    a.fence = true;
    pass(client, req, a);
  }
  bool stopping() const override { return stopped_.load(); }

  // The relay's own lease upstream follows the newest round its clients arm leases for.
  void cover(const wire::Request& lease) override {
    if (lease.keys[2] == covered_) return;
    covered_ = lease.keys[2];
    pass(0, lease_request(Op::kLeaseArm, lease), {Answer::Kind::kU8});
  }
  void fire(const wire::Request& lease) override {
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

  void adopt(tcp::socket socket) {
    auto c = std::make_shared<Client>(static_cast<relay_detail::RelayHost*>(this),
                                      std::move(socket), next_client_id_++);
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

}  // namespace

std::unique_ptr<StoreRelay> StoreRelay::start(const StoreRelayOptions& options) {
  auto relay = std::make_unique<RelayImpl>(options);
  relay->listen();
  return relay;
}

}  // namespace trun::store
