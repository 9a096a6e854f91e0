#include "rendezvous/round_rendezvous.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <random>
#include <set>
#include <thread>

#include "store/socket_conn.h"

namespace trun::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

bool valid_token(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
          c == ':' || c == '@' || c == '+' || c == '[' || c == ']')) {
      return false;
    }
  }
  return true;
}

// Numeric addresses `host` resolves to.
std::set<std::string> resolve_all(const std::string& host) {
  std::set<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    char buf[NI_MAXHOST];
    if (::getnameinfo(ai->ai_addr, ai->ai_addrlen, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) ==
        0) {
      out.insert(buf);
    }
  }
  ::freeaddrinfo(res);
  return out;
}

bool is_loopback(const std::string& numeric) {
  return numeric.rfind("127.", 0) == 0 || numeric == "::1";
}

bool is_numeric_ip(const std::string& host) {
  in6_addr a6;
  in_addr a4;
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

}  // namespace

Endpoint parse_endpoint(const std::string& text, uint16_t default_port, const char* what) {
  const std::string prefix = std::string(what) + "=" + text + ": ";
  auto bad = [&](const std::string& why) { return RendezvousOptionError(prefix + why); };
  Endpoint e;
  std::string port;
  bool has_port = false;
  if (text.empty()) throw RendezvousOptionError(std::string(what) + ": expected HOST[:PORT]");
  if (text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos) throw bad("unterminated [IPv6] (expected [ADDRESS]:PORT)");
    e.host = text.substr(1, close - 1);
    if (e.host.empty()) throw bad("empty host between the brackets");
    // Brackets hold an IPv6 address (a zone, "%eth0", may follow it), nothing else.
    in6_addr a6;
    std::string address = e.host.substr(0, e.host.find('%'));
    if (::inet_pton(AF_INET6, address.c_str(), &a6) != 1) {
      throw bad("'" + e.host + "' in brackets is not an IPv6 address");
    }
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') throw bad("expected [ADDRESS]:PORT after the brackets");
      port = text.substr(close + 2);
      has_port = true;
    }
  } else if (text.find(']') != std::string::npos) {
    throw bad("']' without '[' (write an IPv6 address as [ADDRESS]:PORT)");
  } else {
    size_t colon = text.rfind(':');
    if (colon != std::string::npos && text.find(':') == colon) {
      e.host = text.substr(0, colon);
      port = text.substr(colon + 1);
      has_port = true;
    } else if (colon != std::string::npos) {
      // Several colons: a bare IPv6 address (no port) or a mistake.
      in6_addr a6;
      std::string address = text.substr(0, text.find('%'));
      if (::inet_pton(AF_INET6, address.c_str(), &a6) != 1) {
        throw bad("not HOST:PORT, and not an IPv6 address (write one as [ADDRESS]:PORT)");
      }
      e.host = text;
    } else {
      e.host = text;  // no port
    }
  }
  if (e.host.empty()) throw bad("empty host (expected HOST:PORT)");
  for (char c : e.host) {
    if (std::isspace(static_cast<unsigned char>(c))) throw bad("space in host");
  }
  e.port = default_port;
  if (has_port) {
    if (port.empty()) throw bad("empty port (expected HOST:PORT)");
    bool digits = port.size() <= 5;
    for (char c : port) digits = digits && std::isdigit(static_cast<unsigned char>(c));
    long p = digits ? std::strtol(port.c_str(), nullptr, 10) : -1;
    if (p < 0 || p > 65535) throw bad("port '" + port + "' is not a number in 0..65535");
    e.port = static_cast<uint16_t>(p);
  }
  return e;
}

bool endpoint_is_local(const std::string& host, const std::string& local_addr) {
  if (host == "localhost" || (!local_addr.empty() && host == local_addr)) return true;
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) == 0 && host == name) return true;
  auto wanted = resolve_all(host);
  for (auto& a : wanted) {
    if (is_loopback(a)) return true;
  }
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (ifaddrs* i = ifs; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char buf[NI_MAXHOST];
    socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::getnameinfo(i->ifa_addr, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0) {
      continue;
    }
    std::string a = buf;
    if (auto pct = a.find('%'); pct != std::string::npos) a.resize(pct);
    found = wanted.count(a) > 0;
  }
  ::freeifaddrs(ifs);
  return found;
}

std::string default_local_addr() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == 0) return "127.0.0.1";
  return name;
}

std::string default_node_id() {
  static std::atomic<uint32_t> counter{0};
  std::random_device rd;
  char suffix[16];
  std::snprintf(suffix, sizeof(suffix), "%04x%02x", rd() & 0xffff, counter++ & 0xff);
  std::string host = default_local_addr();
  std::string id;
  for (char c : host) id += valid_token(std::string(1, c)) ? c : '_';
  return id + "-" + std::to_string(::getpid()) + "-" + suffix;
}

uint16_t pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(addr);
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

void validate_common_options(const RendezvousOptions& o, const char* backend) {
  std::string b = std::string("--rdzv-backend=") + backend + ": ";
  if (o.run_id.empty()) throw RendezvousOptionError(b + "--rdzv-id is required");
  for (char c : o.run_id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      throw RendezvousOptionError(b + "--rdzv-id=" + o.run_id +
                                  ": only letters, digits, '.', '_' and '-' are allowed");
    }
  }
  if (o.min_nodes < 1) {
    throw RendezvousOptionError(b + "--nnodes: the minimum (" + std::to_string(o.min_nodes) +
                                ") must be at least 1");
  }
  if (o.max_nodes < o.min_nodes) {
    throw RendezvousOptionError(b + "--nnodes: the maximum (" + std::to_string(o.max_nodes) +
                                ") is below the minimum (" + std::to_string(o.min_nodes) + ")");
  }
  if (!o.node_id.empty() && !valid_token(o.node_id)) {
    throw RendezvousOptionError(b + "node id '" + o.node_id +
                                "': only letters, digits and . _ - : @ + [ ] are allowed");
  }
  if (!o.local_addr.empty() && !valid_token(o.local_addr)) {
    throw RendezvousOptionError(b + "--local-addr=" + o.local_addr + ": not an address");
  }
  auto positive = [&](std::chrono::milliseconds d, const char* name) {
    if (d.count() <= 0) {
      throw RendezvousOptionError(b + "--rdzv-conf " + name + ": must be greater than 0");
    }
  };
  positive(o.join_timeout, "join_timeout");
  positive(o.close_timeout, "close_timeout");
  positive(o.keep_alive_interval, "keep_alive_interval");
  positive(o.read_timeout, "read_timeout");
  if (o.last_call_timeout.count() < 0) {
    throw RendezvousOptionError(b + "--rdzv-conf last_call_timeout: must be >= 0");
  }
  if (o.keep_alive_max_attempt < 1) {
    throw RendezvousOptionError(b + "--rdzv-conf keep_alive_max_attempt: must be at least 1");
  }
}

std::chrono::milliseconds time_left(Clock::time_point deadline, std::chrono::milliseconds cap) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::clamp(left, std::chrono::milliseconds(1), cap);
}

std::chrono::milliseconds start_first_round(RendezvousOptions* o, std::chrono::milliseconds cap) {
  if (o->first_round_deadline) return time_left(*o->first_round_deadline, cap);
  o->first_round_deadline = Clock::now() + o->join_timeout;
  return std::min(cap, o->join_timeout);
}

namespace {

// Whether something accepts TCP connections on this machine at `bind_host`:`port` (the address
// a store server was to bind; a wildcard is asked on loopback). A loopback connect answers at
// once, accepted or refused; 200 ms bounds it all the same.
bool someone_listens_here(const std::string& bind_host, uint16_t port) {
  std::string host = bind_host;
  if (host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  store::net::OpenError error;
  int fd =
      store::net::open_socket(host, port, Clock::now() + std::chrono::milliseconds(200), &error);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace

std::unique_ptr<store::StoreServer> host_store(
    const Endpoint& endpoint, const std::string& token, bool forced, const char* backend,
    const std::vector<std::pair<std::string, std::string>>& seed, std::string* not_hosted) {
  store::StoreServerOptions so;
  so.host = is_numeric_ip(endpoint.host) ? endpoint.host : "0.0.0.0";
  so.port = endpoint.port;
  so.token = token;
  so.seed = seed;
  // Two agents on one machine that both take the endpoint for theirs (both "nodes" of a test
  // cluster on one host) race for the port, and the loser becomes a client. Once under SLURM on
  // one machine neither hosted: both waited for a store that never came. The cause is not
  // confirmed (perhaps both listen() calls failing after both SO_REUSEADDR binds succeeded; 3000
  // tight tries did not reproduce that). So a failure while nothing listens on the port is tried
  // again, after a random pause so the two part ways; 8 tries, under 0.4 s in all.
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pause_ms(5, 40);
  for (int attempt = 1;; ++attempt) {
    try {
      return store::StoreServer::start(so);
    } catch (const store::StoreError& e) {
      if (attempt < 8 && !someone_listens_here(so.host, so.port)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms(rng)));
        continue;
      }
      if (forced) {
        throw RendezvousError(std::string(backend) + " rendezvous: cannot host the store on " +
                              so.host + ":" + std::to_string(endpoint.port) + ": " + e.what());
      }
      spdlog::info("{} rendezvous: not hosting the store ({}); connecting to {}:{} as a client",
                   backend, e.what(), endpoint.host, endpoint.port);
      if (not_hosted) *not_hosted = e.what();
      return nullptr;
    }
  }
}

// --- RoundRendezvous --------------------------------------------------------------------------

namespace {

// Counts the failed operations of a backend (StoreError, StoreTimeoutError) for the metrics, and
// passes everything else through.
class ErrorCountingBackend : public RendezvousBackend {
 public:
  ErrorCountingBackend(std::unique_ptr<RendezvousBackend> inner,
                       std::shared_ptr<std::atomic<uint64_t>> errors)
      : inner_(std::move(inner)), errors_(std::move(errors)) {}

  std::string name() const override { return inner_->name(); }
  void set(const std::string& key, const std::string& value) override {
    counted([&] { inner_->set(key, value); });
  }
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    return counted([&] { return inner_->compare_set(key, expected, desired); });
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return counted([&] { return inner_->add(key, delta); });
  }
  void append(const std::string& key, const std::string& value) override {
    counted([&] { inner_->append(key, value); });
  }
  std::optional<std::string> try_get(const std::string& key) override {
    return counted([&] { return inner_->try_get(key); });
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override {
    return counted([&] { return inner_->multi_get(keys, timeout); });
  }
  std::optional<std::string> wait_get(const std::string& key, Duration timeout) override {
    return counted([&] { return inner_->wait_get(key, timeout); });
  }
  void interrupt_waits() override { inner_->interrupt_waits(); }
  void arm_lease(const store::LeaseSpec& lease) override {
    counted([&] { inner_->arm_lease(lease); });
  }
  bool renew_lease() override {
    return counted([&] { return inner_->renew_lease(); });
  }
  void release_lease() override {
    counted([&] { inner_->release_lease(); });
  }
  std::shared_ptr<store::Store> agent_store() override { return inner_->agent_store(); }
  uint64_t requests_sent() const override { return inner_->requests_sent(); }

 private:
  template <typename F>
  auto counted(F f) -> decltype(f()) {
    try {
      return f();
    } catch (const store::StoreError&) {
      errors_->fetch_add(1, std::memory_order_relaxed);
      throw;
    }
  }
  std::unique_ptr<RendezvousBackend> inner_;
  std::shared_ptr<std::atomic<uint64_t>> errors_;
};

}  // namespace

RendezvousHandler::StoreStats RoundRendezvous::store_stats() const {
  StoreStats s;
  s.requests_sent = backend_->requests_sent();
  s.errors = backend_errors_->load(std::memory_order_relaxed);
  if (server_) s.requests_served = server_->num_requests();
  return s;
}

RoundRendezvous::RoundRendezvous(std::string backend_name, RendezvousOptions options,
                                 std::unique_ptr<RendezvousBackend> backend,
                                 std::unique_ptr<store::StoreServer> server)
    : options_(std::move(options)),
      backend_(std::make_unique<ErrorCountingBackend>(std::move(backend), backend_errors_)),
      server_(std::move(server)),
      backend_name_(std::move(backend_name)) {
  start_keep_alive();
}

RoundRendezvous::~RoundRendezvous() {
  // Subclasses are gone by now; shutdown() only uses this class and the backend.
  shutdown();
}

void RoundRendezvous::check_not_shut_down() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) throw RendezvousError(error_prefix() + ": the handler was shut down");
}

Clock::time_point RoundRendezvous::join_deadline() {
  auto deadline = Clock::now() + options_.join_timeout;
  if (first_join_ && options_.first_round_deadline) {
    deadline = std::min(deadline, *options_.first_round_deadline);
  }
  first_join_ = false;
  return deadline;
}

void RoundRendezvous::arm_node_lease(int64_t k, std::string node_key, std::string node_value,
                                     std::string abort_key, std::string abort_value) {
  store::LeaseSpec lease;
  lease.set_key = std::move(node_key);
  lease.set_value = std::move(node_value);
  lease.a_key = std::move(abort_key);
  lease.a_value = std::move(abort_value);
  lease.b_key = over_key(k);
  lease.b_value = dynamic::encode_over({RoundEvent::Kind::kNodeLeft, options_.node_id,
                                        "connection to the store closed or keep-alives stopped"});
  lease.ttl = dynamic::lease_ttl(options_.keep_alive_interval, options_.keep_alive_max_attempt);
  backend_->arm_lease(lease);
  std::lock_guard<std::mutex> lock(mu_);
  lease_ = true;
  lease_a_key_ = lease.a_key;
  lease_a_value_ = lease.a_value;
  lease_b_key_ = lease.b_key;
  cv_.notify_all();
}

RendezvousInfo RoundRendezvous::next_rendezvous() {
  int64_t last_round;
  int last_rank;
  bool end_round = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) throw RendezvousError(error_prefix() + ": the handler was shut down");
    // The keep-alives gave up on the store (or a wait found it gone): this handler has no lease
    // and no keep-alive thread any more, so it must not join a round even if the store answers
    // again; the caller rejoins with a new handler.
    if (local_event_ && local_event_->kind == RoundEvent::Kind::kStoreLost) {
      throw RendezvousError(error_prefix() + ": the store was lost: " + local_event_->detail);
    }
    end_round = in_round_ && !event_;
    in_round_ = false;
    // A new handler of a node that rejoins: the round it completed under the old one.
    last_round = round_ >= 0 ? round_ : options_.previous_round;
    last_rank = round_ >= 0 ? rank_ : options_.previous_rank;
  }
  try {
    if (end_round) {
      backend_->append(over_key(last_round),
                       dynamic::encode_over({RoundEvent::Kind::kRestart, options_.node_id,
                                             "the node asked for a new round"}));
    }
    RendezvousInfo info = join_round(last_round, last_rank);
    {
      std::lock_guard<std::mutex> lock(mu_);
      round_ = info.round;
      rank_ = info.group_rank;
      world_size_ = info.group_world_size;
      in_round_ = true;
      store_unreachable_ = false;
      event_.reset();
      cv_.notify_all();
    }
    joining_round_ = -1;
    return info;
  } catch (const RendezvousError&) {
    joining_round_ = -1;
    throw;
  } catch (const store::StoreError& e) {
    joining_round_ = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      store_unreachable_ = true;  // shutdown() skips its goodbyes unless a later join succeeds
    }
    check_not_shut_down();
    if (dynamic_cast<const store::StoreGoneError*>(&e)) {
      throw RendezvousStoreGoneError(error_prefix() + ": " + e.what());
    }
    throw RendezvousError(error_prefix() + ": " + e.what());
  }
}

std::optional<RoundEvent> RoundRendezvous::wait_round_over(std::chrono::milliseconds timeout) {
  int64_t k;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) {
      RoundEvent e;
      e.kind = RoundEvent::Kind::kShutdown;
      e.round = round_;
      return e;
    }
    if (round_ < 0) {
      throw RendezvousError(error_prefix() + ": wait_round_over before the first round");
    }
    if (event_) return event_;
    if (local_event_) return local_event_;
    k = round_;
  }
  std::optional<std::string> log;
  std::string error;
  bool stopped = false;
  try {
    log = backend_->wait_get(over_key(k), timeout);
  } catch (const store::StoreError& e) {
    error = e.what();
    stopped = dynamic_cast<const store::StoreGoneError*>(&e) != nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) {
    RoundEvent e;
    e.kind = RoundEvent::Kind::kShutdown;
    e.round = k;
    return e;
  }
  if (local_event_) return local_event_;
  if (!error.empty()) {
    RoundEvent e;
    e.kind = RoundEvent::Kind::kStoreLost;
    e.round = k;
    e.detail = error;
    e.store_stopped = stopped;
    local_event_ = e;
    return e;
  }
  if (!log) return std::nullopt;
  RoundEvent e = dynamic::round_event(k, *log, options_.node_id);
  if (round_ == k && !event_) event_ = e;
  return e;
}

void RoundRendezvous::set_round_over_callback(std::function<void(const RoundEvent&)> callback) {
  std::unique_lock<std::mutex> lock(mu_);
  callback_ = std::move(callback);
  if (callback_ && !callback_thread_.joinable() && !shut_down_) {
    callback_thread_ = std::thread([this] { callback_loop(); });
  }
}

void RoundRendezvous::callback_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return shut_down_ || (in_round_ && round_ > delivered_round_); });
      if (shut_down_) return;
    }
    auto event = wait_round_over(std::chrono::hours(1));
    if (!event) continue;
    std::function<void(const RoundEvent&)> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (event->kind == RoundEvent::Kind::kShutdown) return;
      delivered_round_ = event->round;
      cb = callback_;
    }
    if (cb) {
      try {
        cb(*event);
      } catch (const std::exception& e) {
        spdlog::error("{}: round-over callback threw: {}", error_prefix(), e.what());
      }
    }
    if (event->kind == RoundEvent::Kind::kStoreLost) return;
  }
}

void RoundRendezvous::report_worker_failure(const std::string& detail, int64_t failed_at_ms) {
  int64_t k;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Also when the round is already over (event_): the root cause is the earliest of all
    // reports, and this one may be it although another node reported first.
    if (shut_down_ || !in_round_) return;
    k = round_;
  }
  dynamic::OverRecord record{RoundEvent::Kind::kWorkerFailed, options_.node_id, detail};
  record.failed_at_ms = failed_at_ms;
  try {
    backend_->append(over_key(k), dynamic::encode_over(record));
  } catch (const store::StoreError& e) {
    throw RendezvousError(error_prefix() + ": cannot report the worker failure: " + e.what());
  }
}

std::vector<FailureReport> RoundRendezvous::round_failures(std::chrono::milliseconds grace) {
  int64_t k;
  size_t members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_ || !in_round_ || stopped_round_ == round_) return {};
    stopped_round_ = round_;
    k = round_;
    members = static_cast<size_t>(std::max(world_size_, 1));
  }
  const std::string over = over_key(k);
  const std::string stopped_key = dynamic::stopped_key(over);
  const auto deadline = Clock::now() + grace;
  try {
    int64_t stopped = backend_->add(stopped_key, 1);
    std::vector<dynamic::OverRecord> records;
    // Bounded by `grace`; polls 20 ms apart at first, then less often (up to 500 ms), so that a
    // large round's nodes waiting for a slow one do not flood the store. A member that left (its
    // lease lapsed, it shut down) never says it stopped, and counts as done.
    auto pause = std::chrono::milliseconds(20);
    for (;;) {
      const auto log = backend_->try_get(over);
      records = log ? dynamic::parse_over(*log) : std::vector<dynamic::OverRecord>{};
      std::set<std::string> left;
      for (const auto& r : records) {
        if (r.kind == RoundEvent::Kind::kNodeLeft) left.insert(r.node_id);
      }
      if (static_cast<size_t>(std::max<int64_t>(stopped, 0)) + left.size() >= members ||
          Clock::now() >= deadline) {
        break;
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_for(lock, pause, [&] { return shut_down_; })) break;
      }
      pause = std::min<std::chrono::milliseconds>(pause * 2, std::chrono::milliseconds(500));
      stopped = backend_->add(stopped_key, 0);
    }
    return dynamic::failure_reports(records);
  } catch (const store::StoreError& e) {
    throw RendezvousError(error_prefix() +
                          ": cannot read the round's failure reports: " + e.what());
  }
}

void RoundRendezvous::set_closed() {
  int64_t k;
  bool member;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) throw RendezvousError(error_prefix() + ": the handler was shut down");
    closed_here_ = true;
    k = round_;
    member = in_round_;
  }
  try {
    close_rendezvous(k, joining_round_.load());
    if (member) {
      backend_->append(over_key(k), dynamic::encode_over({RoundEvent::Kind::kClosed,
                                                          options_.node_id, "the job finished"}));
    }
  } catch (const store::StoreError& e) {
    throw RendezvousError(error_prefix() + ": cannot close the rendezvous: " + e.what());
  }
}

void RoundRendezvous::start_keep_alive() {
  keep_alive_thread_ = std::thread([this] { keep_alive_loop(); });
}

void RoundRendezvous::keep_alive_loop() {
  dynamic::KeepAliveState ks;
  ks.interval = options_.keep_alive_interval;
  ks.max_attempts = options_.keep_alive_max_attempt;
  ks.last_attempt = Clock::now();
  std::string last_error;
  std::unique_lock<std::mutex> lock(mu_);
  while (!shut_down_) {
    auto action = dynamic::decide_keep_alive(ks, Clock::now());
    switch (action.kind) {
      case dynamic::KeepAliveAction::Kind::kSleep:
        cv_.wait_until(lock, action.until);
        continue;
      case dynamic::KeepAliveAction::Kind::kGiveUp: {
        RoundEvent e;
        e.kind = RoundEvent::Kind::kStoreLost;
        e.round = round_;
        e.detail = "no keep-alive reached the store in " + std::to_string(ks.max_attempts) +
                   " attempts: " + last_error;
        local_event_ = e;
        lock.unlock();
        spdlog::error("{}: {}", error_prefix(), e.describe());
        backend_->interrupt_waits();
        return;
      }
      case dynamic::KeepAliveAction::Kind::kRenew:
        break;
    }
    ks.last_attempt = Clock::now();
    if (!lease_) continue;
    lock.unlock();
    bool ok = true;
    bool reached = true;
    try {
      ok = backend_->renew_lease();
    } catch (const store::StoreError& e) {
      reached = false;
      last_error = e.what();
    }
    lock.lock();
    if (!reached) {
      ++ks.consecutive_failures;
      continue;
    }
    ks.consecutive_failures = 0;
    if (!ok && lease_) {
      // The store fired our lease (we were silent too long, or our connection was replaced):
      // the others consider this node gone. The round's over key says so; a joining node re-arms.
      lease_ = false;
      spdlog::warn("{}: node {} lost its lease (declared dead by the store)", error_prefix(),
                   options_.node_id);
    }
  }
}

void RoundRendezvous::shutdown() {
  int64_t k;
  bool leave;
  bool store_lost;
  int world_size;
  bool joining;
  std::string join_abort_key, join_abort_value, join_over_key;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    k = round_;
    world_size = world_size_;
    leave = in_round_ && !event_ && !closed_here_;
    // Shut down while a next_rendezvous() on another thread joins a round (a signal to the
    // agent): this node leaves that round as its lease would report it, so a round waiting for
    // more nodes does not complete with it, and a round that just did ends for its members.
    joining = !in_round_ && lease_ && joining_round_.load() > round_ && !closed_here_;
    if (joining) {
      join_abort_key = lease_a_key_;
      join_abort_value = lease_a_value_;
      join_over_key = lease_b_key_;
    }
    // With the store gone, goodbyes would only wait for reconnects that cannot succeed.
    // (Each goodbye would spend the client's whole reconnect budget, past the caller's bound.)
    store_lost =
        (local_event_ && local_event_->kind == RoundEvent::Kind::kStoreLost) || store_unreachable_;
    cv_.notify_all();
  }
  if (keep_alive_thread_.joinable()) keep_alive_thread_.join();
  try {
    if (store_lost) throw store::StoreError("store lost");
    if (leave) {
      backend_->append(over_key(k), dynamic::encode_over({RoundEvent::Kind::kNodeLeft,
                                                          options_.node_id, "agent shut down"}));
    }
    if (joining) {
      backend_->compare_set(join_abort_key, "", join_abort_value);
      backend_->append(join_over_key,
                       dynamic::encode_over({RoundEvent::Kind::kNodeLeft, options_.node_id,
                                             "agent shut down while joining"}));
    }
    backend_->release_lease();
    // The node hosting the store stops it only after the others' last requests (above): a
    // request sent to a stopped store would retry its connection until the join timeout.
    const std::string gone = over_key(std::max<int64_t>(k, 0)) + "/shut_down";
    if (!server_) {
      backend_->add(gone, 1);
    } else if (const int others = k >= 0 ? world_size - 1 : aborted_peers_.load(); others > 0) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      while (backend_->add(gone, 0) < others && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  } catch (const store::StoreError& e) {
    spdlog::debug("{}: while shutting down: {}", error_prefix(), e.what());
  }
  backend_->interrupt_waits();
  if (callback_thread_.joinable() && callback_thread_.get_id() != std::this_thread::get_id()) {
    callback_thread_.join();
  }
  if (server_) server_->stop();
}

}  // namespace trun::rendezvous
