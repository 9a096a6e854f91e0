#include "agent/rendezvous_session.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <functional>
#include <system_error>
#include <thread>
#include <vector>

#include "agent/node_status.h"
#include "agent/signal_watch.h"
#include "store/store.h"

namespace trun::agent {
namespace {

// The event log's name for the end of a round.
const char* round_event_name(rendezvous::RoundEvent::Kind kind) {
  using Kind = rendezvous::RoundEvent::Kind;
  switch (kind) {
    case Kind::kWorkerFailed:
      return "worker_failed";
    case Kind::kNodeJoined:
      return "node_joined";
    case Kind::kNodeLeft:
      return "node_left";
    case Kind::kRestart:
      return "restart_requested";
    case Kind::kClosed:
      return "closed";
    case Kind::kMembershipLost:
      return "membership_lost";
    case Kind::kStoreLost:
      return "store_lost";
    case Kind::kShutdown:
      return "shutdown";
  }
  return "round_over";
}

}  // namespace

RendezvousSession::RendezvousSession(const LaunchConfig& config, std::string run_id,
                                     EventLoop& loop, Clock& clock, RoundOverCallback on_round_over)
    : config_(config),
      run_id_(std::move(run_id)),
      loop_(loop),
      clock_(clock),
      on_round_over_(std::move(on_round_over)) {}

RendezvousSession::~RendezvousSession() { shutdown(); }

std::string RendezvousSession::backend() const {
  if (config_.standalone) return "standalone";
  return rdzv_ ? rdzv_->backend() : rendezvous::backend_name(config_.rdzv.backend);
}

// Creating a handler may wait for the store to come up (a static node > 0 before node 0, a c10d
// client before the host): a stop signal meanwhile abandons the connection retries.
template <typename F>
auto RendezvousSession::create_watched(F create) {
  check_stop_signal();
  SignalWatch watch(config_.signals_to_handle,
                    [] { rendezvous::abandon_store_connection_retries(); });
  try {
    auto handler = create();
    watch.stop();
    if (!watch.fired()) return handler;
  } catch (const std::exception&) {
    watch.stop();
    if (!watch.fired()) throw;
  }
  interrupted_ = true;
  throw RendezvousInterrupted("a stop signal arrived while connecting to the store");
}

void RendezvousSession::create_handler() {
  const auto& rdzv =
      config_.standalone ? rendezvous::standalone_config(config_.rdzv) : config_.rdzv;
  rendezvous::RendezvousOptions o =
      rendezvous::handler_options(rdzv, run_id_, config_.min_nodes, config_.max_nodes);
  dynamic_ = rdzv.backend != rendezvous::BackendKind::kStatic;  // c10d, etcd
  if (dynamic_) {
    if (current_endpoint_.empty()) current_endpoint_ = o.endpoint;
    o.endpoint = current_endpoint_;
    o.first_round_deadline = rejoin_deadline_;
    if (!info_.participants.empty()) {
      // A rejoin: this node was a member of that round, under the same id (the quorum counts the
      // last round's members by id; a stale lease of the old handler can only write to rounds
      // that are over).
      o.previous_round = info_.round;
      o.previous_rank = info_.group_rank;
      o.node_id = member_id_;
    }
    if (target_) {
      o.endpoint = target_->endpoint;
      o.is_host = target_->host;
      o.store_seed = target_->seed;
      target_.reset();
    }
    store_endpoint_ = o.endpoint;
  } else {
    store_endpoint_ = o.master_addr + ":" + std::to_string(o.master_port);
  }
  timeout_ = o.join_timeout;
  auto handler =
      create_watched([&] { return rendezvous::create_rendezvous_handler(rdzv.backend, o); });
  if (!handler->store_endpoint().empty()) store_endpoint_ = handler->store_endpoint();
  {
    std::lock_guard<std::mutex> lock(handler_mu_);
    rdzv_ = std::move(handler);
  }
  evfd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (evfd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  loop_.add(evfd_, EPOLLIN, [this](uint32_t) { on_event_fd(); });
  const int fd = evfd_;
  rdzv_->set_round_over_callback([this, fd](const rendezvous::RoundEvent& e) {
    {
      std::lock_guard<std::mutex> lock(ev_mu_);
      pending_event_ = e;
    }
    uint64_t one = 1;
    ssize_t n = write(fd, &one, sizeof one);
    (void)n;
  });
}

void RendezvousSession::drop_handler() {
  if (rdzv_) {
    rdzv_->shutdown();
    const auto last = rdzv_->store_stats();
    std::lock_guard<std::mutex> lock(handler_mu_);
    retired_stats_ += last;
    rdzv_.reset();
  }
  if (evfd_ >= 0) {
    loop_.remove(evfd_);
    close(evfd_);
    evfd_ = -1;
  }
  std::lock_guard<std::mutex> lock(ev_mu_);
  pending_event_.reset();
}

void RendezvousSession::form_round() {
  if (events_) {
    events_->record("trun.rdzv.join", {{"rdzv_backend", backend()},
                                       {"node_id", rdzv_->node_id()},
                                       {"min_nodes", int64_t{config_.min_nodes}},
                                       {"max_nodes", int64_t{config_.max_nodes}}});
  }
  const auto began = clock_.now();
  check_stop_signal();
  rendezvous::RendezvousHandler* handler = rdzv_.get();
  auto record_failed = [&](const std::string& trace) {
    if (events_) {
      events_->record(
          "trun.rdzv.failed",
          {{"rdzv_backend", backend()}, {"node_id", rdzv_->node_id()}, {"error_trace", trace}});
    }
  };
  SignalWatch watch(config_.signals_to_handle, [handler] { handler->shutdown(); });
  try {
    info_ = rdzv_->next_rendezvous();
    member_id_ = rdzv_->node_id();
    watch.stop();
    // A signal right as the round formed: the handler is shut down all the same.
    if (watch.fired()) {
      interrupted_ = true;
      throw RendezvousInterrupted("a stop signal arrived as the round formed");
    }
  } catch (const RendezvousInterrupted&) {
    throw;
  } catch (const std::exception& e) {
    watch.stop();
    if (watch.fired()) {
      record_failed("stopped by a signal");
      interrupted_ = true;
      throw RendezvousInterrupted("a stop signal arrived while waiting for the round");
    }
    record_failed(e.what());
    throw;
  }
  round_over_.reset();
  ranks_ = assign_ranks(info_, config_.role, config_.nproc_per_node, timeout_);
  if (on_round_formed_) on_round_formed_(clock_.now() - began);
  if (events_) {
    events_->record(
        "trun.rdzv.round_formed",
        {{"rdzv_backend", backend()},
         {"node_id", rdzv_->node_id()},
         {"round", int64_t{info_.round}},
         {"group_rank", int64_t{info_.group_rank}},
         {"group_world_size", int64_t{info_.group_world_size}},
         {"world_size", int64_t{ranks_.world_size}},
         {"master_endpoint", info_.master_addr + ":" + std::to_string(info_.master_port)}});
  }
  spdlog::info(
      "rendezvous done: backend={} run_id={} round={} master={}:{} group_rank={} "
      "group_world_size={} world_size={}",
      backend(), run_id_, info_.round, info_.master_addr, info_.master_port, info_.group_rank,
      info_.group_world_size, ranks_.world_size);
}

std::shared_ptr<rendezvous::RendezvousHandler> RendezvousSession::current_handler() const {
  std::lock_guard<std::mutex> lock(handler_mu_);
  return rdzv_;
}

void RendezvousSession::connect() {
  if (!rdzv_) create_handler();
}

void RendezvousSession::start() {
  connect();
  form_round();
}

void RendezvousSession::next_round() {
  connect();
  form_round();
}

void RendezvousSession::step_out() {
  drop_handler();
  // A new node from here: no previous round to rejoin under the old id.
  info_ = rendezvous::RendezvousInfo{};
  ranks_ = Ranks{};
  member_id_.clear();
  round_over_.reset();
  try {
    connect();
  } catch (const RendezvousInterrupted&) {
    throw;
  } catch (const std::exception& e) {
    spdlog::warn("after leaving the round: cannot connect to the rendezvous again yet: {}",
                 e.what());
  }
}

bool RendezvousSession::hosts_store() const {
  std::lock_guard<std::mutex> lock(handler_mu_);
  return rdzv_ && rdzv_->hosts_store();
}

std::shared_ptr<store::Store> RendezvousSession::job_store() {
  if (info_.run_store) return info_.run_store;
  const std::shared_ptr<rendezvous::RendezvousHandler> handler = current_handler();
  return handler ? handler->job_store() : nullptr;
}

void RendezvousSession::on_event_fd() {
  uint64_t n;
  while (read(evfd_, &n, sizeof n) > 0) {
  }
  std::optional<rendezvous::RoundEvent> e;
  {
    std::lock_guard<std::mutex> lock(ev_mu_);
    e.swap(pending_event_);
  }
  if (!e || e->round != info_.round || round_over_) return;
  using Kind = rendezvous::RoundEvent::Kind;
  if (e->kind == Kind::kShutdown) return;
  if (events_) {
    events_->record(std::string("trun.rdzv.") + round_event_name(e->kind),
                    {{"rdzv_backend", backend()},
                     {"round", int64_t{e->round}},
                     {"node_id", e->node_id},
                     {"message", e->detail}});
  }
  // Our own report comes back as the round's end: the local failure is already being handled.
  if (e->kind == Kind::kWorkerFailed && e->node_id == rdzv_->node_id()) return;
  if (on_round_over_(*e)) round_over_ = *e;
}

RendezvousSession::FailoverOutcome RendezvousSession::fail_over(const std::string& why,
                                                                bool store_stopped,
                                                                Clock::TimePoint deadline) {
  if (!rdzv_) return FailoverOutcome::kNotNeeded;
  const std::string lost_endpoint = store_endpoint_;
  const int64_t round = info_.round;
  rendezvous::LostStore lost;
  lost.why = why;
  lost.store_stopped = store_stopped;
  lost.round = info_.round;
  lost.group_rank = info_.group_rank;
  lost.group_world_size = info_.group_world_size;
  lost.participants = info_.participants;
  lost.deadline = deadline;
  lost.now = [this] { return clock_.now(); };
  lost.pause = [this](std::chrono::milliseconds d) {
    clock_.sleep_for(d);
    check_stop_signal();
  };
  // Null: the store still answers, or cannot be moved (the caller retries it as before).
  const auto failover = rdzv_->recover_lost_store(lost);
  if (!failover) return FailoverOutcome::kNotNeeded;
  while (auto target = failover->next_target()) {
    const std::string endpoint = target->endpoint;
    const bool hosted_here = target->host;
    const std::string host_node_id = target->host_node_id;
    drop_handler();
    target_ = std::move(*target);
    try {
      create_handler();
      form_round();
    } catch (const RendezvousInterrupted&) {
      throw;
    } catch (const rendezvous::RendezvousClosedError&) {
      throw;
    } catch (const std::exception& e) {
      spdlog::warn("failover to {} failed: {}", endpoint, e.what());
      continue;
    }
    current_endpoint_ = endpoint;
    spdlog::warn("the rendezvous store moved to {} ({}; round {} formed there)", endpoint,
                 hosted_here ? "hosted here" : "hosted by node " + host_node_id, info_.round);
    if (events_) {
      events_->record("trun.rdzv.failover", {{"rdzv_backend", backend()},
                                             {"lost_endpoint", lost_endpoint},
                                             {"endpoint", endpoint},
                                             {"hosted_here", hosted_here},
                                             {"round", int64_t{info_.round}}});
    }
    return FailoverOutcome::kJoined;
  }
  // The lost store answered again while the failover looked: the others may be back on it.
  if (failover->healed()) return FailoverOutcome::kNotNeeded;
  std::fprintf(stderr,
               "trun: error: lost the rendezvous store at %s and could not move it: no node of "
               "round %lld hosts a store for this job, and hosting one here failed\n",
               lost_endpoint.c_str(), static_cast<long long>(round));
  return FailoverOutcome::kFailed;
}

bool RendezvousSession::rejoin(const std::string& why, bool store_stopped) {
  // The round ended because the store's host shut down (it said so): its store went with it.
  if (round_over_ && rdzv_) {
    store_stopped = store_stopped || rdzv_->store_host_left(*round_over_, info_.participants);
  }
  const auto deadline = clock_.now() + timeout_;
  std::string last = why;
  rejoin_deadline_ = deadline;
  // Every way out of here ends the window: later rounds get join_timeout each.
  struct EndWindow {
    std::optional<Clock::TimePoint>& window;
    ~EndWindow() { window.reset(); }
  } end_window{rejoin_deadline_};
  auto job_finished = [&](const std::exception& e) {
    std::fprintf(stderr, "trun: error: the job '%s' has finished (rendezvous closed): %s\n",
                 run_id_.c_str(), e.what());
    return false;
  };
  try {
    switch (fail_over(why, store_stopped, deadline)) {
      case FailoverOutcome::kJoined:
        return true;
      case FailoverOutcome::kFailed:
        return false;
      case FailoverOutcome::kNotNeeded:
        break;
    }
  } catch (const rendezvous::RendezvousClosedError& e) {
    return job_finished(e);
  }
  if (store_stopped) {
    // It went away on purpose: retrying that endpoint for join_timeout cannot bring it back.
    std::fprintf(stderr,
                 "trun: error: the rendezvous store at %s was stopped (its host left or the job "
                 "ended): %s\n",
                 store_endpoint_.c_str(), why.c_str());
    std::fflush(stderr);
    return false;
  }
  spdlog::warn("lost the rendezvous store at {}: {}; trying to rejoin for up to {} s",
               store_endpoint_, why, timeout_.count() / 1000.0);
  bool rejoined = false;
  int attempts = 0;
  while (attempts < 100000 && clock_.now() < deadline) {
    ++attempts;
    drop_handler();
    try {
      create_handler();
      form_round();
      rejoined = true;
      break;
    } catch (const RendezvousInterrupted&) {
      throw;
    } catch (const rendezvous::RendezvousClosedError& e) {
      return job_finished(e);
    } catch (const std::exception& e) {
      last = e.what();
      spdlog::debug("rejoin attempt {}: {}", attempts, last);
    }
    const auto left = deadline - clock_.now();
    if (left <= Clock::Duration::zero()) break;
    clock_.sleep_for(std::min<Clock::Duration>(std::chrono::milliseconds(500), left));
    try {
      check_stop_signal();
    } catch (const RendezvousInterrupted&) {
      throw;
    }
  }
  if (rejoined) return true;
  std::fprintf(stderr,
               "trun: error: lost the rendezvous store at %s (%s) and could not rejoin within "
               "%g s (%d attempt(s)): %s\n",
               store_endpoint_.c_str(), rendezvous::backend_name(config_.rdzv.backend),
               timeout_.count() / 1000.0, attempts, last.c_str());
  std::fflush(stderr);
  return false;
}

void RendezvousSession::report_worker_failure(const std::string& detail, int64_t failed_at_ms) {
  if (!rdzv_ || !multi_node()) return;
  try {
    rdzv_->report_worker_failure(detail, failed_at_ms);
  } catch (const std::exception& e) {
    spdlog::error("cannot report the failure to the other nodes: {}", e.what());
  }
}

std::vector<rendezvous::FailureReport> RendezvousSession::round_failures(
    std::chrono::milliseconds grace) {
  if (!rdzv_ || !multi_node() || interrupted_) return {};
  try {
    return rdzv_->round_failures(grace);
  } catch (const std::exception& e) {
    spdlog::warn("cannot read the other nodes' failure reports: {}", e.what());
    return {};
  }
}

void RendezvousSession::close_job() {
  if (!rdzv_ || !multi_node()) return;
  try {
    rdzv_->set_closed();
  } catch (const std::exception& e) {
    spdlog::debug("closing the rendezvous: {}", e.what());
  }
}

void RendezvousSession::exit_barrier(std::chrono::milliseconds timeout) {
  if (info_.group_world_size <= 1 || !info_.store) return;
  auto& store = *info_.store;
  int64_t arrived = store.add("exit_barrier/count", 1);
  if (arrived >= info_.group_world_size) store.set("exit_barrier/done", "1");
  store.wait({"exit_barrier/done"}, timeout);
}

bool stop_signal_pending(const std::vector<int>& signals) {
  sigset_t pending;
  if (sigpending(&pending) != 0) return false;
  for (int s : signals) {
    if (s != SIGCHLD && sigismember(&pending, s) == 1) return true;
  }
  return false;
}

void RendezvousSession::check_stop_signal() {
  if (!stop_signal_pending(config_.signals_to_handle)) return;
  interrupted_ = true;
  throw RendezvousInterrupted("a stop signal is pending");
}

bool RendezvousSession::publish_status(const std::string& record) {
  // After an interrupted rendezvous the handler is shut down (its store may be gone with it).
  if (!rdzv_ || interrupted_) return false;
  try {
    const std::shared_ptr<store::Store> store = job_store();
    if (!store) return false;
    store->set(node_status_key(run_id_, rdzv_->node_id()), record);
    return true;
  } catch (const std::exception& e) {
    spdlog::debug("cannot publish this node's status for trun status: {}", e.what());
    return false;
  }
}

std::string RendezvousSession::node_id() const { return rdzv_ ? rdzv_->node_id() : ""; }

void RendezvousSession::start_sampling(std::chrono::milliseconds interval,
                                       std::function<void()> on_sample) {
  if (sampler_.joinable()) return;
  sampler_ = std::thread([this, interval, on_sample = std::move(on_sample)] {
    std::unique_lock<std::mutex> lock(sampler_mu_);
    // Runs until shutdown() (the session's lifetime).
    while (!sampler_cv_.wait_for(lock, interval, [this] { return sampler_stop_; })) {
      lock.unlock();
      const std::shared_ptr<rendezvous::RendezvousHandler> handler = current_handler();
      int n = -1;
      if (handler) {
        try {
          n = handler->num_nodes_waiting();
        } catch (const std::exception& e) {
          spdlog::debug("sampling the nodes waiting: {}", e.what());
        }
      }
      nodes_waiting_ = n;
      if (on_sample) on_sample();
      lock.lock();
    }
  });
}

int RendezvousSession::nodes_waiting_now() {
  const std::shared_ptr<rendezvous::RendezvousHandler> handler = current_handler();
  if (!handler) return -1;
  try {
    return handler->num_nodes_waiting();
  } catch (const std::exception& e) {
    spdlog::debug("counting the nodes waiting: {}", e.what());
    return -1;
  }
}

int RendezvousSession::nodes_gone_on_now() {
  const std::shared_ptr<rendezvous::RendezvousHandler> handler = current_handler();
  if (!handler || info_.participants.empty()) return 0;
  try {
    return handler->nodes_in_round_after(info_.round);
  } catch (const std::exception& e) {
    spdlog::debug("reading the newest round: {}", e.what());
    return 0;
  }
}

int RendezvousSession::newcomers_waiting_now() {
  const std::shared_ptr<rendezvous::RendezvousHandler> handler = current_handler();
  const auto& members = info_.participants;
  if (!handler || members.empty() || static_cast<int>(members.size()) < info_.group_world_size) {
    return 0;
  }
  try {
    int n = 0;
    for (const std::string& id : handler->waiting_node_ids(64)) {
      bool member = false;
      for (size_t i = 0; i < members.size() && !member; ++i) member = members.at(i).node_id == id;
      if (!member) ++n;
    }
    return n;
  } catch (const std::exception& e) {
    spdlog::debug("reading the nodes waiting: {}", e.what());
    return 0;
  }
}

rendezvous::RendezvousHandler::StoreStats RendezvousSession::store_stats() const {
  std::lock_guard<std::mutex> lock(handler_mu_);
  auto total = retired_stats_;
  if (rdzv_) total += rdzv_->store_stats();
  return total;
}

void RendezvousSession::shutdown() {
  // The handler first, so that this node leaves the rendezvous at once; a sample in flight then
  // ends within the store's read timeout.
  drop_handler();
  if (sampler_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(sampler_mu_);
      sampler_stop_ = true;
    }
    sampler_cv_.notify_all();
    sampler_.join();
  }
}

}  // namespace trun::agent
