#include "agent/rendezvous_session.h"

#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <system_error>

#include "agent/node_status.h"
#include "rendezvous/static_rendezvous.h"
#include "rendezvous/store/store.h"

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
    : cfg_(config),
      run_id_(std::move(run_id)),
      loop_(loop),
      clock_(clock),
      on_round_over_(std::move(on_round_over)) {}

RendezvousSession::~RendezvousSession() { shutdown(); }

std::string RendezvousSession::backend() const {
  if (cfg_.standalone) return "standalone";
  return rdzv_ ? rdzv_->backend() : cfg_.rdzv_backend;
}

void RendezvousSession::create_handler() {
  if (cfg_.rdzv_backend != "static" && !cfg_.standalone) {  // c10d, etcd: dynamic membership
    rendezvous::RendezvousOptions o;
    o.run_id = run_id_;
    o.endpoint = cfg_.rdzv_endpoint;
    o.min_nodes = cfg_.min_nodes;
    o.max_nodes = cfg_.max_nodes;
    o.local_addr = cfg_.local_addr;
    if (const char* t = std::getenv("TRUN_STORE_TOKEN")) o.store_token = t;
    rendezvous::apply_rdzv_conf(cfg_.rdzv_conf, &o);
    o.first_round_deadline = rejoin_deadline_;
    timeout_ = o.join_timeout;
    store_endpoint_ = cfg_.rdzv_endpoint;
    dynamic_ = true;
    rdzv_ = rendezvous::create_rendezvous_handler(cfg_.rdzv_backend, o);
  } else {
    rendezvous::StaticRendezvousOptions ro;
    ro.run_id = run_id_;
    ro.host = cfg_.standalone ? "127.0.0.1" : cfg_.master_addr;
    ro.port = cfg_.standalone ? 0 : static_cast<uint16_t>(cfg_.master_port);
    ro.rank = cfg_.node_rank;
    ro.world_size = cfg_.max_nodes;
    if (cfg_.rdzv_conf.count("timeout") || cfg_.rdzv_conf.count("join_timeout")) {
      rendezvous::RendezvousOptions parsed;  // validated by the command line already
      rendezvous::apply_rdzv_conf(cfg_.rdzv_conf, &parsed);
      ro.timeout = parsed.join_timeout;
    }
    timeout_ = ro.timeout;
    store_endpoint_ = ro.host + ":" + std::to_string(ro.port);
    rdzv_ = rendezvous::create_static_rendezvous(ro);
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
  if (rdzv_) rdzv_->shutdown();
  rdzv_.reset();
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
                                       {"min_nodes", int64_t{cfg_.min_nodes}},
                                       {"max_nodes", int64_t{cfg_.max_nodes}}});
  }
  const auto began = clock_.now();
  try {
    info_ = rdzv_->next_rendezvous();
  } catch (const std::exception& e) {
    if (events_) {
      events_->record("trun.rdzv.failed", {{"rdzv_backend", backend()},
                                           {"node_id", rdzv_->node_id()},
                                           {"error_trace", std::string(e.what())}});
    }
    throw;
  }
  round_over_.reset();
  ranks_ = assign_ranks(info_, cfg_.role, cfg_.nproc_per_node, timeout_);
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

void RendezvousSession::start() {
  create_handler();
  form_round();
}

void RendezvousSession::next_round() { form_round(); }

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

bool RendezvousSession::rejoin(const std::string& why) {
  const auto deadline = clock_.now() + timeout_;
  std::string last = why;
  spdlog::warn("lost the rendezvous store at {}: {}; trying to rejoin for up to {} s",
               store_endpoint_, why, timeout_.count() / 1000.0);
  rejoin_deadline_ = deadline;
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
    } catch (const rendezvous::RendezvousClosedError& e) {
      rejoin_deadline_.reset();
      std::fprintf(stderr, "trun: error: the job '%s' has finished (rendezvous closed): %s\n",
                   run_id_.c_str(), e.what());
      return false;
    } catch (const std::exception& e) {
      last = e.what();
      spdlog::debug("rejoin attempt {}: {}", attempts, last);
    }
    const auto left = deadline - clock_.now();
    if (left <= Clock::Duration::zero()) break;
    clock_.sleep_for(std::min<Clock::Duration>(std::chrono::milliseconds(500), left));
  }
  rejoin_deadline_.reset();  // later rounds get join_timeout each
  if (rejoined) return true;
  std::fprintf(stderr,
               "trun: error: lost the rendezvous store at %s (%s) and could not rejoin within "
               "%g s (%d attempt(s)): %s\n",
               store_endpoint_.c_str(), cfg_.rdzv_backend.c_str(), timeout_.count() / 1000.0,
               attempts, last.c_str());
  std::fflush(stderr);
  return false;
}

void RendezvousSession::report_worker_failure(const std::string& detail) {
  if (!rdzv_ || !multi_node()) return;
  try {
    rdzv_->report_worker_failure(detail);
  } catch (const std::exception& e) {
    spdlog::error("cannot report the failure to the other nodes: {}", e.what());
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

void RendezvousSession::publish_status(const std::string& record) {
  if (!rdzv_ || !info_.run_store) return;
  try {
    info_.run_store->set(node_status_key(run_id_, rdzv_->node_id()), record);
  } catch (const std::exception& e) {
    spdlog::debug("cannot publish this node's status for trun status: {}", e.what());
  }
}

std::string RendezvousSession::node_id() const { return rdzv_ ? rdzv_->node_id() : ""; }

void RendezvousSession::shutdown() { drop_handler(); }

}  // namespace trun::agent
