// RoundRendezvous (round_rendezvous.h), what the c10d and static handlers share: the counted
// backend, joining rounds (next_rendezvous, the node's lease), the keep-alive thread, closing and
// shutdown. The round-over side (wait_round_over, the callback thread, failure reports) is in
// round_over.cpp; endpoints, options and hosting the store in round_setup.cpp.
#include "rendezvous/round_rendezvous.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

namespace trun::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

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
  } catch (const RendezvousTimeoutError&) {
    joining_round_ = -1;
    leave_joined_round();
    throw;
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

// A join that timed out leaves its round as shutdown() does for one under way: its ticket would
// otherwise stay counted, and when it was ticket 1 nobody would lead the round (the others, and
// a spare's next incarnation, waited out their own join timeouts: the goodput bench's spare,
// restarted after each timeout, wedged every re-formation this way).
void RoundRendezvous::leave_joined_round() {
  std::string abort_key, abort_value, over;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lease_ || in_round_ || closed_here_) return;
    abort_key = lease_a_key_;
    abort_value = lease_a_value_;
    over = lease_b_key_;
  }
  try {
    backend_->compare_set(abort_key, "", abort_value);
    backend_->append(over, dynamic::encode_over({RoundEvent::Kind::kNodeLeft, options_.node_id,
                                                 "its join timed out"}));
  } catch (const store::StoreError& e) {
    spdlog::debug("{}: leaving the round after the join timeout: {}", error_prefix(), e.what());
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
