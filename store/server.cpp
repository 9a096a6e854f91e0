#include "store/server.h"

#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <atomic>
#include <boost/asio.hpp>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/acceptor.h"
#include "store/auth.h"
#include "store/event_loop.h"
#include "store/kv_state.h"
#include "store/lease.h"
#include "store/log_limiter.h"
#include "store/request_loop.h"
#include "store/store.h"

namespace trun::store {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using wire::Op;

constexpr size_t kServerReadChunk =
    64 * 1024;  // one read; the buffer is the server's, not per connection
// While a connection is blocked in a wait it keeps reading (to see CANCEL_WAIT and disconnects),
// but stops once this much unprocessed input has piled up.
constexpr size_t kMaxBufferedWhileBlocked = 1 << 20;

class ServerImpl;

class Connection : public std::enable_shared_from_this<Connection>, private RequestLoop::Host {
 public:
  Connection(ServerImpl* server, tcp::socket socket, uint64_t id);
  void start();
  void close(const std::string& why);
  // The server stops on purpose: a client parked in one of trun's waits (WAIT_KEYS, GET_WAIT)
  // hears kWaitGoingAway before the connection closes, so it need not retry this endpoint.
  void going_away();
  // Called by the server when every key this connection's parked request waits for exists.
  void on_keys_ready();

  uint64_t id() const { return id_; }
  bool closed() const { return closed_; }

 private:
  friend class ServerImpl;
  void read();
  void on_read(boost::system::error_code ec);
  // Executes buffered requests (RequestLoop) until one blocks, the input runs dry or the unsent
  // output is over the limit, then starts writing what they answered.
  void process();
  // RequestLoop::Host.
  size_t in_flight() const override { return unsent_; }
  void parked(const KvState::Outcome& outcome) override;
  void wait_cancelled() override;
  bool lease(wire::Request& r, std::string* out, std::string* why) override;
  void counted() override;
  // Acts on what the key-value state made of a resumed request.
  void follow(const KvState::Outcome& outcome);
  bool blocked() const;
  void flush();
  void clear_wait();
  void arm_lease_timer();
  // Token mode: closes the connection unless it authenticates within options.auth_timeout.
  void arm_auth_timer();
  // Performs the armed lease's notification (the connection is gone or went silent).
  void fire_lease(const char* why);

  ServerImpl* server_;
  tcp::socket socket_;
  uint64_t id_;
  std::string peer_;
  RequestLoop loop_;  // the input buffer, the replies not yet written (out()), authentication
  // Replies leave in chunks, one per process() turn: queued_ waits for the write in progress
  // (writing_) to finish. Chunks, not one growing string: appending a 1 MiB reply to a 63 MiB
  // buffer would copy all of it again on the event loop every time the buffer doubles.
  std::vector<std::string> writing_;
  std::vector<std::string> queued_;
  size_t unsent_ = 0;  // bytes in writing_ and queued_
  bool reading_ = false;
  bool writing_now_ = false;
  bool closed_ = false;
  bool processing_ = false;
  bool resume_posted_ = false;  // process() yielded and posted its next turn
  // A parked request (kv_.parked(id_)) times out on this timer, when it has a deadline.
  asio::steady_timer wait_timer_;
  Lease lease_;
  asio::steady_timer lease_timer_;
  asio::steady_timer auth_timer_;  // armed until the client authenticates (token mode)
  bool auth_pending_ = false;
};

class ServerImpl : public StoreServer {
 public:
  explicit ServerImpl(const StoreServerOptions& options)
      : options_(options),
        kv_(options.limits, [this](KvState::Waiter id) { wake(id); }),
        acceptor_(io_, "store server"),
        signals_guard_(asio::make_work_guard(io_)) {}

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
    port_ =
        acceptor_.listen(results.begin()->endpoint(), options_.backlog, /*dual_stack=*/true, ec);
    if (ec) {
      throw StoreError("store server: cannot listen on " + options_.host + ":" +
                       std::to_string(options_.port) + ": " + ec.message());
    }
    for (auto& [key, value] : options_.seed) kv_.set(key, value);  // before the loop runs
    raise_fd_limit();
    acceptor_.start([this](tcp::socket socket) { adopt(std::move(socket)); });
    thread_ = std::thread([this] { run_event_loop(io_, "store server"); });
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
      acceptor_.close();
      auto conns = connections_;
      for (auto& [id, c] : conns) c->going_away();  // quietly: stopping is not a client's fault
      signals_guard_.reset();
    });
    if (thread_.joinable()) thread_.join();
  }

  const StoreServerOptions& options() const { return options_; }

  // The keys, queues and parked waits, touched only on the event-loop thread.
  KvState& kv() { return kv_; }

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

  RequestLoopOptions loop_options() const {
    RequestLoopOptions o;
    o.limits = options_.limits;
    o.token = options_.token;
    o.max_pending_output = options_.max_pending_output;
    return o;
  }

  // Where every connection reads into (one read at a time: the event loop is one thread). A
  // connection keeps only what it has not processed yet, so an idle one costs no buffer.
  std::array<char, kServerReadChunk>& read_buffer() { return read_buffer_; }

 private:
  // Resumes a connection whose parked request's keys all exist (called from inside kv_).
  void wake(KvState::Waiter id) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    auto conn = it->second;  // it may close, and leave connections_, while resuming
    conn->on_keys_ready();
  }

  void adopt(tcp::socket socket) {
    auto conn = std::make_shared<Connection>(this, std::move(socket), next_conn_id_++);
    connections_.emplace(conn->id(), conn);
    num_connections_.fetch_add(1);
    conn->start();
  }

  static void raise_fd_limit() {
    rlimit rl{};
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      setrlimit(RLIMIT_NOFILE, &rl);
    }
  }

  StoreServerOptions options_;
  KvState kv_;
  asio::io_context io_{1};
  Acceptor acceptor_;
  asio::executor_work_guard<asio::io_context::executor_type> signals_guard_;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> connections_;
  std::atomic<size_t> num_connections_{0};
  std::atomic<uint64_t> num_requests_{0};
  uint64_t next_conn_id_ = 1;
  LogLimiter client_log_{std::chrono::seconds(5), 10};
  std::array<char, kServerReadChunk> read_buffer_;
  uint16_t port_ = 0;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

Connection::Connection(ServerImpl* server, tcp::socket socket, uint64_t id)
    : server_(server),
      socket_(std::move(socket)),
      id_(id),
      loop_(server->loop_options(), &server->kv(), id),
      wait_timer_(server->io()),
      lease_timer_(server->io()),
      auth_timer_(server->io()) {
  boost::system::error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);
  socket_.set_option(asio::socket_base::keep_alive(true), ec);
  socket_.non_blocking(true, ec);  // reads are attempted when the socket is readable
  auto ep = socket_.remote_endpoint(ec);
  peer_ =
      ec ? std::string("unknown peer") : ep.address().to_string() + ":" + std::to_string(ep.port());
}

void Connection::start() {
  arm_auth_timer();
  read();
}

void Connection::arm_auth_timer() {
  const auto timeout = server_->options().auth_timeout;
  if (loop_.authenticated() || timeout.count() <= 0) return;
  auth_pending_ = true;
  auth_timer_.expires_after(timeout);
  auth_timer_.async_wait([self = shared_from_this(), timeout](const boost::system::error_code& ec) {
    if (ec || self->closed_ || self->loop_.authenticated()) return;
    self->server_->warn_client("rejected " + self->peer_ + ": not authenticated within " +
                               std::to_string(timeout.count()) + " ms");
    self->close("");
  });
}

void Connection::read() {
  if (closed_ || reading_) return;
  // Back-pressure: stop reading from a client that does not read its responses, or that piles up
  // requests behind a blocked wait.
  if (loop_.output_full(*this)) return;
  if (resume_posted_) return;  // the posted turn reads when it is done
  if (loop_.buffered_input() > kMaxBufferedWhileBlocked && blocked()) return;
  reading_ = true;
  socket_.async_wait(
      tcp::socket::wait_read,
      [self = shared_from_this()](const boost::system::error_code& ec) { self->on_read(ec); });
}

void Connection::on_read(boost::system::error_code ec) {
  reading_ = false;
  if (closed_) return;
  size_t n = 0;
  if (!ec) {
    auto& buffer = server_->read_buffer();
    n = socket_.read_some(asio::buffer(buffer), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      read();  // a spurious wake-up
      return;
    }
    if (!ec) loop_.append(buffer.data(), n);
  }
  if (ec) {
    if (ec == asio::error::eof || ec == asio::error::connection_reset) {
      close("");
    } else {
      close("read failed: " + ec.message());
    }
    return;
  }
  process();
  read();
}

void Connection::process() {
  if (processing_ || closed_) return;  // re-entered from on_keys_ready inside the loop
  processing_ = true;
  RequestLoop::Stop stop = loop_.process(*this);
  processing_ = false;
  if (auth_pending_ && loop_.authenticated()) {
    auth_pending_ = false;
    boost::system::error_code ec;
    auth_timer_.cancel(ec);
  }
  if (stop == RequestLoop::Stop::kClose && !closed_) {
    flush();  // e.g. the 0 byte that answers a wrong token
    if (loop_.rejected()) {
      server_->warn_client("rejected " + peer_ + ": " + loop_.why());
      close("");
    } else {
      close(loop_.why());
    }
    return;
  }
  flush();
  if (stop == RequestLoop::Stop::kYield && !resume_posted_) {
    // Let the event loop serve the other connections before this one's next turn.
    resume_posted_ = true;
    asio::post(server_->io(), [self = shared_from_this()] {
      self->resume_posted_ = false;
      if (self->closed_) return;
      self->process();
      self->read();
    });
  }
}

void Connection::parked(const KvState::Outcome& outcome) {
  // A new wait replaces a pending 1.13 one (see RequestLoop::process), and its timer.
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
  if (outcome.timeout_ms <= 0) return;
  wait_timer_.expires_after(std::chrono::milliseconds(outcome.timeout_ms));
  wait_timer_.async_wait(
      [self = shared_from_this(), id = outcome.wait_id](const boost::system::error_code& ec) {
        if (ec || self->closed_) return;
        if (!self->server_->kv().time_out(self->id_, id, &self->loop_.out())) return;  // stale
        self->process();  // serve what queued up behind the wait (as far as the output allows)
        self->read();
      });
}

void Connection::counted() { server_->count_request(); }

void Connection::wait_cancelled() {
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
}

bool Connection::lease(wire::Request& r, std::string* out, std::string* why) {
  wire::Encoder enc(out);
  switch (r.op) {
    case Op::kLeaseArm:
      if (r.number < 0) {
        *why = "LEASE_ARM with a negative ttl";
        return false;
      }
      lease_.arm(std::move(r), server_->kv());
      arm_lease_timer();
      enc.u8(1);
      return true;
    case Op::kLeaseFire: {
      Lease once;
      once.arm(std::move(r), server_->kv());
      once.fire(server_->kv());
      enc.u8(1);
      return true;
    }
    case Op::kLeaseRenew:
      if (r.number < 0) {
        *why = "LEASE_RENEW with a negative ttl";
        return false;
      }
      if (lease_.renew(r.number)) arm_lease_timer();
      enc.u8(lease_.armed() ? 1 : 0);
      return true;
    case Op::kLeaseRelease: {
      bool was = lease_.release();
      boost::system::error_code ec;
      lease_timer_.cancel(ec);
      enc.u8(was ? 1 : 0);
      return true;
    }
    default:
      *why = std::string("not a lease request: ") + wire::op_name(r.op);
      return false;
  }
}

void Connection::follow(const KvState::Outcome& outcome) {
  switch (outcome.kind) {
    case KvState::Outcome::Kind::kReply:
      return;
    case KvState::Outcome::Kind::kClose:
      close(outcome.why);
      return;
    case KvState::Outcome::Kind::kPark:
      parked(outcome);
      return;
  }
}

bool Connection::blocked() const { return server_->kv().parked(id_) != nullptr; }

void Connection::on_keys_ready() {
  if (closed_) return;
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
  // Every key exists now (or one was deleted again, in which case this blocks anew).
  follow(server_->kv().resume(id_, &loop_.out()));
  process();  // serve what queued up behind the wait (as far as the output allows)
  read();
}

void Connection::clear_wait() {
  server_->kv().cancel(id_);
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
}

void Connection::arm_lease_timer() {
  uint64_t generation = lease_.restart();
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  if (lease_.ttl_ms() <= 0) return;  // bound to the connection only
  lease_timer_.expires_after(std::chrono::milliseconds(lease_.ttl_ms()));
  lease_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->closed_ || !self->lease_.current(generation)) return;
        self->fire_lease("no keep-alive");
      });
}

void Connection::fire_lease(const char* why) {
  if (!lease_.armed()) return;
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  auto& kv = server_->kv();
  spdlog::info("store server: lease of {} lost ({}{}): notifying '{}'", peer_, why,
               lease_.ttl_ms() > 0 && std::string_view(why) == "no keep-alive"
                   ? " for " + std::to_string(lease_.ttl_ms()) + " ms"
                   : std::string(),
               lease_.target(kv));
  lease_.fire(kv);
}

void Connection::flush() {
  if (closed_) return;
  std::string& out = loop_.out();
  if (!out.empty()) {
    unsent_ += out.size();
    queued_.push_back(std::exchange(out, std::string()));
  }
  if (writing_now_ || queued_.empty()) return;
  writing_now_ = true;
  writing_.swap(queued_);
  std::vector<asio::const_buffer> buffers;
  buffers.reserve(writing_.size());
  for (const auto& chunk : writing_) buffers.push_back(asio::buffer(chunk));
  asio::async_write(socket_, buffers,
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      self->writing_now_ = false;
                      for (const auto& chunk : self->writing_) self->unsent_ -= chunk.size();
                      self->writing_.clear();
                      if (self->closed_) return;
                      if (ec) {
                        self->close("write failed: " + ec.message());
                        return;
                      }
                      // The output drained: run the requests that back-pressure held back (they
                      // may be all the client sent, so reading alone would stall), then write
                      // their replies and read again.
                      self->process();
                      self->flush();
                      self->read();
                    });
}

void Connection::going_away() {
  if (closed_) return;
  const wire::Request* parked = server_->kv().parked(id_);
  // Only when nothing else is on its way to the client: the byte must be the answer to the wait.
  if (parked && (parked->op == Op::kWaitKeys || parked->op == Op::kGetWait) && !writing_now_ &&
      loop_.out().empty() && queued_.empty()) {
    clear_wait();
    const uint8_t bye = wire::kWaitGoingAway;
    boost::system::error_code ec;
    asio::write(socket_, asio::buffer(&bye, 1), ec);  // one byte into an idle socket
  }
  close("");
}

void Connection::close(const std::string& why) {
  if (closed_) return;
  closed_ = true;
  if (!why.empty()) server_->warn_client("closing connection from " + peer_ + ": " + why);
  if (blocked()) clear_wait();
  // A lease fires when its connection goes away, unless the whole server is stopping.
  if (!server_->stopping()) fire_lease("connection closed");
  lease_.release();
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  auth_timer_.cancel(ec);
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

}  // namespace trun::store
