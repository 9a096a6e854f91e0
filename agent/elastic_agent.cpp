#include "agent/elastic_agent.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "agent/decisions.h"
#include "agent/event_log.h"
#include "agent/event_loop.h"
#include "agent/failure_report.h"
#include "agent/job_local.h"
#include "agent/log_mux.h"
#include "agent/metrics_server.h"
#include "agent/node_status.h"
#include "agent/process_supervisor.h"
#include "agent/rendezvous_session.h"
#include "agent/worker_env.h"
#include "base/check.h"
#include "rendezvous/handler.h"

extern char** environ;

namespace trun::agent {
namespace {

namespace fs = std::filesystem;

// After SIGKILL, how long to wait for the kernel to let the workers go before giving up.
constexpr auto kAfterKillGrace = std::chrono::seconds(30);
// --metrics-port: how often the nodes waiting for the next round are sampled (off the loop).
constexpr auto kWaitingSampleInterval = std::chrono::seconds(2);
// After a round ended by a worker failure: how long, beyond --shutdown-timeout (what the other
// nodes may spend stopping their workers), a node waits for the others' failure reports before it
// names the root cause without them.
constexpr auto kReportGrace = std::chrono::seconds(5);

// The signals the agent takes through its signalfd: SIGCHLD and config.signals_to_handle.
sigset_t agent_signal_set(const LaunchConfig& config) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  for (int s : config.signals_to_handle) sigaddset(&set, s);
  return set;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct WorkerProcess {
  int local_rank = 0;
  int rank = 0;
  int role_rank = 0;
  pid_t pid = -1;
  bool running = false;     // started and not yet reaped
  bool group_live = false;  // its process group may still have members
  int exitcode = 0;
  std::string error_file;
  Clock::TimePoint started{};  // when it was spawned (the agent's clock)
};

class Agent {
 public:
  // `temp_dir`: the temporary log directory, already made (empty: made when needed).
  Agent(const LaunchConfig& c, Clock& clock, ProcessSpawner& spawner, std::string temp_dir = {})
      : config_(c),
        clock_(clock),
        sup_(spawner),
        loop_(clock),
        base_dir_(std::move(temp_dir)),
        temp_base_(!base_dir_.empty()) {}
  ~Agent() { cleanup(); }

  int run();

 private:
  int run_job();
  // Records an event in --event-log (no-op without one), with the restart count.
  void event(const std::string& name, EventMetadata md);
  // --metrics-port: starts the endpoint and its heartbeat; false (after the error line) when the
  // port cannot be served.
  bool start_metrics();
  // Publishes snap_ to the endpoint (no-op without one), as alive now.
  void publish();
  void refresh_live(AgentSnapshot* s) const;
  void set_phase(const char* phase);
  // While this thread waits in a blocking rendezvous call the loop does not run, and /metrics
  // would stand still exactly when an operator looks: the session's sampler thread publishes
  // then (publish_while_waiting), from a copy of the snapshot taken under waiting_mu_. The
  // snapshot is written only outside such a window, or after end_waiting().
  class WaitingWindow;
  void begin_waiting();
  void end_waiting();
  void publish_while_waiting();
  // A stop signal ended a wait in the rendezvous (which this node has left): takes the signal
  // from the signalfd and returns 128+N.
  int after_interrupted_rendezvous();
  // Writes this node's status record for `trun status` (agent/node_status.h) in `state`.
  void publish_status(const char* state);
  void set_worker_state(size_t i, const char* state);
  void setup_signals();
  bool make_base_dir();
  void start_workers();
  GroupOutcome supervise();
  void on_signalfd();
  void read_signals(bool reap_children);
  void on_children();
  void on_agent_signal(int sig);
  bool on_round_over(const rendezvous::RoundEvent& e);
  // After a round ended by a worker failure (this node's, `own`, or another's) and this node's
  // workers stopped: chooses the root cause among every node's report (root_cause_), records it
  // (status, event log) and returns it.
  const RootCause& resolve_root_cause(const std::optional<rendezvous::FailureReport>& own);
  void begin_stop(int sig);
  void kill_all();
  void update_groups();
  bool all_groups_gone() const;
  int running_count() const;
  StreamMode stream_mode(int local_rank, int stream) const;
  // What follows a stopped group: exit with exit_code, or another attempt (counted or not
  // against max_restarts; kAgainNow: the round is already formed).
  struct Next {
    enum Kind { kExit, kAgain, kAgainNow } kind = kExit;
    bool counted = false;
    int exit_code = kExitAgentError;
    explicit Next(int code) : exit_code(code) {}
    explicit Next(Kind k, bool counts = false) : kind(k), counted(counts) {}
  };
  Next after_stop(GroupOutcome outcome);
  Next after_round_over();
  bool prepare_next_attempt(const Next& next, bool after_round);
  void finish(GroupOutcome outcome);
  void cleanup();

  const LaunchConfig& config_;
  Clock& clock_;
  ProcessSpawner& sup_;
  EventLoop loop_;
  int sigfd_ = -1;
  std::unique_ptr<EventLog> events_;  // --event-log; outlives session_ (declared before it)
  std::unique_ptr<RendezvousSession> session_;
  std::unique_ptr<MetricsServer> metrics_;
  AgentSnapshot snap_;
  std::mutex waiting_mu_;
  bool waiting_ = false;   // guarded by waiting_mu_
  int heartbeat_fd_ = -1;  // a timerfd while the endpoint runs
  std::string run_id_;
  std::string base_dir_;  // DIR/<run id>, or a temporary directory
  bool temp_base_ = false;
  EnvMap base_env_;
  std::string hostname_;

  int restart_count_ = 0;  // incremented in one place: prepare_next_attempt()
  std::vector<WorkerProcess> workers_;
  std::unordered_map<pid_t, size_t> by_pid_;
  std::unique_ptr<LogMux> logs_;
  GroupPhase phase_ = GroupPhase::kRunning;
  std::optional<GroupOutcome> outcome_;
  std::optional<Clock::TimePoint> kill_at_;
  bool killed_ = false;
  Clock::TimePoint killed_at_;
  int received_signal_ = 0;
  uint64_t failure_seq_ = 0;
  std::vector<WorkerFailure> failures_;  // of the current attempt
  std::optional<RootCause> root_cause_;  // of the current attempt, across nodes, once known
  NodeStatus status_;                    // the last record publish_status wrote
};

// A round-over event of the current round, on the loop's thread: it ends the attempt unless the
// group already stops for a local reason.
bool Agent::on_round_over(const rendezvous::RoundEvent& e) {
  if (workers_.empty() || outcome_) return false;
  spdlog::warn("{}; stopping the workers", e.describe());
  outcome_ = GroupOutcome::kRoundOver;
  begin_stop(SIGTERM);
  return true;
}

// The signals are already blocked (ElasticAgent::run); the signalfd takes them from here on.
void Agent::setup_signals() {
  const sigset_t set = agent_signal_set(config_);
  sigfd_ = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sigfd_ < 0) throw std::system_error(errno, std::generic_category(), "signalfd");
  // Writes to a closed console or to the guardian must fail with EPIPE, not kill trun. Workers
  // get SIGPIPE back (process_supervisor.cpp).
  signal(SIGPIPE, SIG_IGN);
  loop_.add(sigfd_, EPOLLIN, [this](uint32_t) { on_signalfd(); });
}

// The log and error-file directory: DIR/<run id> under --log-dir, else a temporary one.
bool Agent::make_base_dir() {
  if (temp_base_) return true;  // made before the guardian was forked (ElasticAgent::run)
  try {
    base_dir_ = make_log_dir(config_.log_dir, run_id_, &temp_base_);
  } catch (const std::exception& e) {
    spdlog::error("cannot create the log directory: {}", e.what());
    return false;
  }
  return true;
}

void Agent::event(const std::string& name, EventMetadata md) {
  if (!events_) return;
  md.emplace("agent_restarts", int64_t{restart_count_});
  events_->record(name, std::move(md));
}

int Agent::run() {
  try {
    setup_signals();
  } catch (const std::exception& e) {
    spdlog::error("cannot set up process supervision: {}", e.what());
    return kExitAgentError;
  }
  hostname_ = host_name();
  run_id_ = config_.standalone ? generate_run_id() : config_.run_id;
  if (!config_.event_log.empty()) {
    try {
      events_ = EventLog::open(config_.event_log);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      std::fprintf(stderr, "trun: error: %s\n", e.what());
      return kExitAgentError;
    }
    events_->set_common("run_id", run_id_);
    events_->set_common("hostname", hostname_);
    events_->set_common("pid", int64_t{getpid()});
    events_->set_common("role", config_.role);
    event("trun.agent.start", {{"nproc_per_node", int64_t{config_.nproc_per_node}},
                               {"max_restarts", int64_t{config_.max_restarts}},
                               {"entrypoint", config_.entrypoint_name}});
  }
  const bool served = config_.metrics_port < 0 || start_metrics();
  int code = kExitAgentError;
  try {
    if (served) code = run_job();
  } catch (const RendezvousInterrupted& e) {
    code = after_interrupted_rendezvous();
  }
  const bool signaled = code >= kExitSignalBase;
  // Not after exit 3 (rendezvous or store trouble): the store may be gone, and a set would spend
  // the client's reconnect budget before trun exits.
  if (code != kExitAgentError)
    publish_status(code == 0 ? "succeeded" : signaled ? "signaled" : "failed");
  if (metrics_) set_phase(code == 0 ? "succeeded" : signaled ? "signaled" : "failed");
  // torchelastic's WorkerState words: a job stopped by a signal is STOPPED.
  event("trun.agent.stop", {{"exit_code", int64_t{code}},
                            {"state", std::string(code == 0  ? "SUCCEEDED"
                                                  : signaled ? "STOPPED"
                                                             : "FAILED")}});
  return code;
}

bool Agent::start_metrics() {
  try {
    metrics_ = MetricsServer::start(static_cast<uint16_t>(config_.metrics_port));
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "trun: error: %s (--metrics-port / TORCHELASTIC_HEALTH_CHECK_PORT; 0 picks a "
                 "free port)\n",
                 e.what());
    return false;
  }
  std::fprintf(stderr, "trun: metrics on http://0.0.0.0:%u/metrics and /healthz\n",
               static_cast<unsigned>(metrics_->port()));
  std::fflush(stderr);
  // The heartbeat: the loop republishes every second, so /healthz sees it answer.
  heartbeat_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (heartbeat_fd_ >= 0) {
    itimerspec every{{1, 0}, {1, 0}};
    timerfd_settime(heartbeat_fd_, 0, &every, nullptr);
    loop_.add(heartbeat_fd_, EPOLLIN, [this](uint32_t) {
      uint64_t ticks;
      while (read(heartbeat_fd_, &ticks, sizeof ticks) > 0) {
      }
      publish();
    });
  }
  snap_.run_id = run_id_;
  snap_.max_restarts = config_.max_restarts;
  snap_.round_seconds_buckets = {0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600};
  snap_.round_seconds_counts.assign(snap_.round_seconds_buckets.size() + 1, 0);
  snap_.phase = "rendezvous";
  snap_.phase_since = std::chrono::steady_clock::now();
  publish();
  return true;
}

void Agent::publish() {
  if (!metrics_) return;
  refresh_live(&snap_);
  metrics_->publish(snap_);
}

// What moves without the agent's loop: the heartbeat, and the session's sample and counters.
void Agent::refresh_live(AgentSnapshot* s) const {
  s->heartbeat = std::chrono::steady_clock::now();
  if (!session_) return;
  s->nodes_waiting = session_->nodes_waiting();
  const auto stats = session_->store_stats();
  s->store_requests = stats.requests_sent;
  s->store_errors = stats.errors;
  s->store_requests_served = stats.requests_served;
}

class Agent::WaitingWindow {
 public:
  explicit WaitingWindow(Agent& agent) : agent_(agent) { agent_.begin_waiting(); }
  ~WaitingWindow() { agent_.end_waiting(); }
  WaitingWindow(const WaitingWindow&) = delete;
  WaitingWindow& operator=(const WaitingWindow&) = delete;

 private:
  Agent& agent_;
};

void Agent::begin_waiting() {
  std::lock_guard<std::mutex> lock(waiting_mu_);
  waiting_ = true;
}

void Agent::end_waiting() {
  std::lock_guard<std::mutex> lock(waiting_mu_);
  waiting_ = false;
}

// The sampler thread, after each sample.
void Agent::publish_while_waiting() {
  AgentSnapshot copy;
  {
    std::lock_guard<std::mutex> lock(waiting_mu_);
    if (!waiting_ || !metrics_) return;
    copy = snap_;
  }
  refresh_live(&copy);
  metrics_->publish(copy);
}

void Agent::set_phase(const char* phase) {
  if (!metrics_ || snap_.phase == phase) return;
  snap_.phase = phase;
  snap_.phase_since = std::chrono::steady_clock::now();
  publish();
}

int Agent::after_interrupted_rendezvous() {
  read_signals(false);  // on_agent_signal records it; no workers run now
  if (received_signal_ == 0) {
    spdlog::error("the rendezvous was interrupted, but no signal could be read");
    return kExitAgentError;
  }
  spdlog::warn("{} while waiting in the rendezvous: left it; exiting with {}",
               signal_name(received_signal_), kExitSignalBase + received_signal_);
  return kExitSignalBase + received_signal_;
}

void Agent::publish_status(const char* state) {
  if (!session_) return;
  const auto& info = session_->info();
  status_.node_id = session_->node_id();
  if (status_.node_id.empty()) return;  // no round yet
  status_.hostname = hostname_;
  status_.pid = getpid();
  status_.round = info.round;
  status_.group_rank = info.group_rank;
  status_.group_world_size = info.group_world_size;
  if (static_cast<size_t>(info.group_rank) < info.participants.size()) {
    status_.addr = info.participants.at(static_cast<size_t>(info.group_rank)).addr;
  }
  status_.local_world_size = config_.nproc_per_node;
  status_.restarts = restart_count_;
  status_.max_restarts = config_.max_restarts;
  status_.state = state;
  status_.updated_at = unix_seconds();
  session_->publish_status(encode_node_status(status_));
}

void Agent::set_worker_state(size_t i, const char* state) {
  if (!metrics_) return;
  if (snap_.worker_states.size() <= i) snap_.worker_states.resize(i + 1);
  snap_.worker_states[i] = state;
}

int Agent::run_job() {
  session_ = std::make_unique<RendezvousSession>(
      config_, run_id_, loop_, clock_,
      [this](const rendezvous::RoundEvent& e) { return on_round_over(e); });
  session_->set_event_log(events_.get());
  if (metrics_)
    session_->start_sampling(kWaitingSampleInterval, [this] { publish_while_waiting(); });
  session_->set_on_round_formed([this](std::chrono::duration<double> took) {
    end_waiting();  // the snapshot is this thread's alone again
    publish_status("running");
    if (metrics_) {
      const auto& info = session_->info();
      snap_.backend = session_->backend();
      snap_.round = info.round;
      snap_.group_rank = info.group_rank;
      snap_.group_world_size = info.group_world_size;
      ++snap_.rounds_total;
      const double s = took.count();
      size_t b = 0;
      while (b < snap_.round_seconds_buckets.size() && s > snap_.round_seconds_buckets[b]) ++b;
      ++snap_.round_seconds_counts[b];
      snap_.round_seconds_sum += s;
      snap_.last_round_at = std::chrono::steady_clock::now();
      publish();
    }
  });
  try {
    WaitingWindow waiting(*this);
    session_->start();
  } catch (const RendezvousInterrupted&) {
    throw;
  } catch (const rendezvous::RendezvousClosedError& e) {
    spdlog::error("rendezvous failed: the job '{}' has finished (its rendezvous is closed): {}",
                  run_id_, e.what());
    return kExitAgentError;
  } catch (const std::exception& e) {
    spdlog::error("rendezvous failed: {}", e.what());
    return kExitAgentError;
  }
  if (!make_base_dir()) return kExitAgentError;

  bool omp_defaulted = false;
  base_env_ = base_worker_env(env_map(environ), config_.nproc_per_node, &omp_defaulted);
  if (omp_defaulted) {
    spdlog::warn(
        "setting OMP_NUM_THREADS=1 for each worker (it is unset and there are {} "
        "workers); set it yourself to tune performance",
        config_.nproc_per_node);
  }

  for (;;) {
    GroupOutcome outcome;
    try {
      start_workers();
      outcome = supervise();
      // The last chance for a signal sent with the workers' (see on_children): a stop after a
      // failure took some time, and a restart would start workers the scheduler is stopping.
      if (outcome == GroupOutcome::kFailed) {
        read_signals(false);  // the handled signals already pending; no reaping here
        if (outcome_ == GroupOutcome::kSignaled) outcome = GroupOutcome::kSignaled;
      }
    } catch (const std::exception& e) {
      spdlog::error("agent error: {}", e.what());
      if (!workers_.empty()) {
        kill_all();
        for (int i = 0; i < 100 && running_count() > 0; ++i) {
          loop_.run_once(clock_.now() + std::chrono::milliseconds(100));
        }
      }
      return kExitAgentError;
    }
    const Next next = after_stop(outcome);
    if (next.kind == Next::kExit) return next.exit_code;
    if (!prepare_next_attempt(next, outcome == GroupOutcome::kRoundOver)) return kExitAgentError;
  }
}

// The group stopped because the round ended: the next step (kAgain: after the next round).
Agent::Next Agent::after_round_over() {
  const rendezvous::RoundEvent e = *session_->round_over();
  using Kind = rendezvous::RoundEvent::Kind;
  // Set for a worker failure, the only round end decide_after_round restarts (counted) or gives
  // up on: the earliest failure across nodes, the round's first report when none could be read.
  const RootCause* root = nullptr;
  if (e.kind == Kind::kWorkerFailed) {
    root = &resolve_root_cause(std::nullopt);
  } else if (e.kind == Kind::kNodeJoined || e.kind == Kind::kNodeLeft || e.kind == Kind::kRestart) {
    // Only says that this node stopped (a failure reported in this round waits for it). Not
    // when the store may be out of reach (store lost, this node declared dead) or the job ended.
    session_->round_failures(std::chrono::milliseconds(0));
  }
  const RoundAction action =
      decide_after_round(e.kind, session_->dynamic(), restart_count_, config_.max_restarts);
  switch (action) {
    case RoundAction::kRejoin: {
      // The rejoin forms the next round itself.
      set_phase("rendezvous");
      WaitingWindow waiting(*this);
      return session_->rejoin(e.detail, e.store_stopped) ? Next{Next::kAgainNow}
                                                         : Next{kExitAgentError};
    }
    case RoundAction::kStoreLost:
      spdlog::error("lost the rendezvous store at {} ({}): {}; giving up",
                    session_->store_endpoint(), session_->backend(), e.describe());
      std::fprintf(stderr, "trun: error: lost the rendezvous store at %s: %s\n",
                   session_->store_endpoint().c_str(), e.detail.c_str());
      return Next{kExitAgentError};
    case RoundAction::kJobClosed:
      spdlog::error("the job was closed by node {}: {}", e.node_id, e.detail);
      return Next{kExitWorkersFailed};
    case RoundAction::kNoRestartsLeft:
      TRUN_CHECK(root != nullptr, "no restarts left after a " << e.describe());
      std::fprintf(stderr,
                   "trun: error: the worker group failed on node %s and no restarts are "
                   "left (%d/%d)\n%s\n",
                   root->node_id.c_str(), restart_count_, config_.max_restarts,
                   root_cause_line(*root).c_str());
      std::fflush(stderr);
      session_->close_job();
      return Next{kExitWorkersFailed};
    case RoundAction::kRestart:
      TRUN_CHECK(root != nullptr, "a counted restart after a " << e.describe());
      spdlog::warn("worker failure on node {}; {}", root->node_id, root_cause_line(*root));
      return Next{Next::kAgain, true};
    case RoundAction::kReform:
      spdlog::warn("{}: re-forming the group (restart count unchanged: {})", e.describe(),
                   restart_count_);
      return Next{Next::kAgain};
  }
  return Next{kExitAgentError};
}

// The group stopped on its own (success, failure) or after a signal: the next step.
Agent::Next Agent::after_stop(GroupOutcome outcome) {
  if (outcome == GroupOutcome::kRoundOver) return after_round_over();
  const AfterStop next =
      decide_after_stop(outcome, received_signal_, restart_count_, config_.max_restarts);
  // Ends the round on every node: they restart too, or give up with this root cause.
  if (outcome == GroupOutcome::kFailed) {
    const std::string line = failure_line(failures_, hostname_);
    const int64_t at =
        failures_.empty() ? unix_ms() : failures_[root_cause_index(failures_)].exited_at_ms;
    session_->report_worker_failure(line, at);
    snap_.last_failure = line;
    status_.last_failure = snap_.last_failure;
    status_.last_failure_at = unix_seconds();
    if (!failures_.empty()) {
      const auto& root = failures_[root_cause_index(failures_)];
      event("trun.agent.failure", {{"local_rank", int64_t{root.local_rank}},
                                   {"global_rank", int64_t{root.rank}},
                                   {"exitcode", int64_t{root.exitcode}},
                                   {"raw_error", failure_line(failures_, hostname_)},
                                   {"failed_workers", int64_t(failures_.size())},
                                   {"restart", next.restart}});
    }
    std::string id = session_->node_id();
    resolve_root_cause(rendezvous::FailureReport{id.empty() ? hostname_ : id, line, at});
  }
  if (!next.restart) {
    finish(outcome);
    return Next{next.exit_code};
  }
  for (const auto& f : failures_) {
    spdlog::warn("worker group failed (attempt {}): rank {} (local_rank {}) exited with {}",
                 restart_count_, f.rank, f.local_rank,
                 f.exitcode < 0 ? signal_name(-f.exitcode) : std::to_string(f.exitcode));
  }
  return Next{Next::kAgain, true};
}

// Before the next attempt: counts the restart and forms the next round where there are others.
// Returns false (the agent exits 3) when that round cannot be formed.
bool Agent::prepare_next_attempt(const Next& next, bool after_round) {
  if (next.counted) {
    ++restart_count_;
    spdlog::warn("restarting the worker group ({}/{} restarts)", restart_count_,
                 config_.max_restarts);
  }
  event("trun.agent.restart",
        {{"counted", next.counted},
         {"max_restarts", int64_t{config_.max_restarts}},
         {"reason", std::string(after_round ? "round over" : "worker failure")}});
  snap_.restarts = restart_count_;
  const bool same_round = next.kind == Next::kAgainNow || !session_->multi_node();
  publish_status(same_round ? "running" : "rendezvous");
  if (same_round) return true;
  set_phase("rendezvous");
  WaitingWindow waiting(*this);
  try {
    session_->next_round();
    return true;
  } catch (const RendezvousInterrupted&) {
    throw;
  } catch (const rendezvous::RendezvousClosedError& ex) {
    spdlog::error("rendezvous for the restart failed: the job has finished: {}", ex.what());
  } catch (const rendezvous::RendezvousTimeoutError& ex) {
    // join_timeout passed with the store answering: rejoining (on the store host: a new, empty
    // store) would only bypass what held the round, e.g. the lack of a majority.
    spdlog::error("rendezvous for the restart failed: {}", ex.what());
    std::fprintf(stderr, "trun: error: %s\n", ex.what());
    std::fflush(stderr);
  } catch (const std::exception& ex) {
    // The store may be gone (the round ended with it, or the failure report could not reach
    // it): a dynamic backend rejoins, moving the store if it must.
    if (session_->dynamic() &&
        session_->rejoin(
            ex.what(), dynamic_cast<const rendezvous::RendezvousStoreGoneError*>(&ex) != nullptr)) {
      return true;
    }
    spdlog::error("rendezvous for the restart failed: {}", ex.what());
  }
  return false;
}

const RootCause& Agent::resolve_root_cause(const std::optional<rendezvous::FailureReport>& own) {
  std::vector<rendezvous::FailureReport> reports =
      session_->round_failures(config_.shutdown_timeout + kReportGrace);
  if (own) {
    // A single node, or the store did not answer: this node's own report still counts.
    bool found = false;
    for (const auto& r : reports) found = found || r.node_id == own->node_id;
    if (!found) reports.push_back(*own);
  }
  const auto pick = rendezvous::root_cause(reports);
  RootCause rc;
  if (pick) {
    rc.node_id = pick->node_id;
    rc.detail = pick->detail;
    rc.failed_at_ms = pick->failed_at_ms;
    rc.local = own && pick->node_id == own->node_id;
  } else {  // nobody's report could be read: the round's first record
    const auto& e = session_->round_over();
    rc.node_id = e ? e->node_id : std::string();
    rc.detail = e ? e->detail : std::string("unknown");
  }
  root_cause_ = rc;
  status_.root_cause = rc.detail;
  status_.root_cause_node = rc.node_id;
  status_.root_cause_at = rc.failed_at_ms >= 0 ? static_cast<double>(rc.failed_at_ms) / 1000 : 0;
  status_.root_cause_round = session_->info().round;
  EventMetadata md{{"round", int64_t{session_->info().round}},
                   {"node_id", rc.node_id},
                   {"failed_at_ms", int64_t{rc.failed_at_ms}},
                   {"message", rc.detail},
                   {"local", rc.local},
                   {"reports", int64_t(reports.size())}};
  if (rc.local && !failures_.empty()) {
    const auto& f = failures_[root_cause_index(failures_)];
    md["local_rank"] = int64_t{f.local_rank};
    md["global_rank"] = int64_t{f.rank};
    md["exitcode"] = int64_t{f.exitcode};
  }
  event("trun.agent.root_cause", std::move(md));
  if (reports.size() > 1 || !rc.local) spdlog::warn("{}", root_cause_line(rc));
  return *root_cause_;
}

// The job ends on this node: the failure summary, the exit barrier, closing the rendezvous.
void Agent::finish(GroupOutcome outcome) {
  if (outcome == GroupOutcome::kFailed && !failures_.empty()) {
    const bool across = root_cause_ && session_->multi_node();
    std::string summary = format_summary(config_.entrypoint_name, failures_, hostname_,
                                         across ? &*root_cause_ : nullptr);
    if (across) summary += "trun: " + root_cause_line(*root_cause_) + "\n";
    std::fputs(summary.c_str(), stderr);
    std::fflush(stderr);
    const auto& root = failures_[root_cause_index(failures_)];
    if (const char* ef = std::getenv("TORCHELASTIC_ERROR_FILE"); ef && *ef) {
      if (!write_root_cause(ef, root)) {
        spdlog::error("cannot write the root cause to TORCHELASTIC_ERROR_FILE={}", ef);
      }
    }
  } else if (outcome == GroupOutcome::kSignaled) {
    spdlog::warn("stopped the workers after {}; exiting with {}", signal_name(received_signal_),
                 kExitSignalBase + received_signal_);
  } else if (outcome == GroupOutcome::kSucceeded) {
    set_phase("exit_barrier");
    try {
      session_->exit_barrier(config_.exit_barrier_timeout);
    } catch (const std::exception& e) {
      spdlog::warn("exit barrier: {}", e.what());
    }
  }
  if (outcome != GroupOutcome::kSignaled) session_->close_job();
}

StreamMode Agent::stream_mode(int local_rank, int stream) const {
  bool redirect = (config_.redirects.for_rank(local_rank) & stream) != 0;
  bool tee = (config_.tee.for_rank(local_rank) & stream) != 0;
  bool hidden = config_.local_ranks_filter && !config_.local_ranks_filter->count(local_rank);
  if (tee && !hidden) return StreamMode::kTee;
  if (tee || redirect) return StreamMode::kFile;
  return hidden ? StreamMode::kDiscard : StreamMode::kInherit;
}

void Agent::start_workers() {
  phase_ = GroupPhase::kRunning;
  outcome_.reset();
  kill_at_.reset();
  killed_ = false;
  failures_.clear();
  root_cause_.reset();
  by_pid_.clear();
  workers_.assign(static_cast<size_t>(config_.nproc_per_node), WorkerProcess{});
  logs_.reset();
  logs_ = std::make_unique<LogMux>(loop_);

  const std::string attempt_dir = base_dir_ + "/attempt_" + std::to_string(restart_count_);
  std::error_code ec;
  if (fs::exists(attempt_dir, ec)) {
    spdlog::warn("replacing the logs of an earlier run in {}", attempt_dir);
    fs::remove_all(attempt_dir, ec);
  }
  fs::create_directories(attempt_dir);
  if (!config_.duplicate_stdout_filters.empty()) {
    logs_->duplicate(STDOUT_FILENO, attempt_dir + "/filtered_stdout.log",
                     config_.duplicate_stdout_filters);
  }
  if (!config_.duplicate_stderr_filters.empty()) {
    logs_->duplicate(STDERR_FILENO, attempt_dir + "/filtered_stderr.log",
                     config_.duplicate_stderr_filters);
  }
  const rendezvous::RendezvousInfo& info = session_->info();
  AttemptEnv attempt;
  attempt.run_id = run_id_;
  attempt.restart_count = restart_count_;
  attempt.group_rank = info.group_rank;
  attempt.group_world_size = info.group_world_size;
  attempt.world_size = session_->ranks().world_size;
  attempt.role_world_size = session_->ranks().role_world_size;
  attempt.master_addr = info.master_addr;
  attempt.master_port = info.master_port;
  attempt.use_agent_store = info.use_agent_store;
  std::vector<SpawnRequest> requests(workers_.size());
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerProcess& w = workers_[i];
    w.local_rank = static_cast<int>(i);
    w.rank = session_->ranks().global[i];
    w.role_rank = session_->ranks().role[i];
    const std::string dir = attempt_dir + "/" + std::to_string(i);
    fs::create_directories(dir);
    w.error_file = dir + "/error.json";
    SpawnRequest& req = requests[i];
    req.argv = worker_argv(config_.entrypoint, w.local_rank);
    req.env = worker_env(base_env_, config_, attempt,
                         WorkerIdentity{w.local_rank, w.rank, w.role_rank, w.error_file});
    if (i < config_.numa_bindings.size()) {
      req.cpus = config_.numa_bindings[i].cpus;
      req.memory_node = config_.numa_bindings[i].memory_node;
    }
    const std::string prefix =
        line_prefix(config_.log_line_prefix_template, config_.role, w.rank, w.local_rank);
    req.stdout_fd = logs_->prepare(stream_mode(w.local_rank, kStdOut), STDOUT_FILENO,
                                   dir + "/stdout.log", prefix);
    req.stderr_fd = logs_->prepare(stream_mode(w.local_rank, kStdErr), STDERR_FILENO,
                                   dir + "/stderr.log", prefix);
  }
  auto results = sup_.spawn(requests);
  logs_->close_child_ends();
  bool spawn_failed = false;
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerProcess& w = workers_[i];
    if (results[i].pid > 0) {
      w.pid = results[i].pid;
      w.started = clock_.now();
      w.running = true;
      w.group_live = true;
      by_pid_[w.pid] = i;
      event("trun.agent.worker_started", {{"local_rank", int64_t{w.local_rank}},
                                          {"global_rank", int64_t{w.rank}},
                                          {"role_rank", int64_t{w.role_rank}},
                                          {"worker_pid", int64_t{w.pid}}});
    } else {
      w.exitcode = results[i].error == ENOENT ? 127 : 126;
      WorkerFailure f = read_failure(w.local_rank, w.rank, -1, w.exitcode, "", failure_seq_++);
      f.message = "cannot start worker: " + results[i].error_message;
      f.exited_at_ms = unix_ms();
      event("trun.agent.worker_exited", {{"local_rank", int64_t{w.local_rank}},
                                         {"global_rank", int64_t{w.rank}},
                                         {"exitcode", int64_t{w.exitcode}},
                                         {"state", std::string("FAILED")},
                                         {"raw_error", f.message}});
      failures_.push_back(std::move(f));
      spawn_failed = true;
    }
  }
  spdlog::info("attempt {}: started {} workers", restart_count_, by_pid_.size());
  if (metrics_) {
    snap_.worker_states.assign(workers_.size(), "running");
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (!workers_[i].running) set_worker_state(i, "failed");
    }
    snap_.phase = "";  // set_phase publishes the new states with the phase
    set_phase("running");
  }
  if (spawn_failed) {
    outcome_ = GroupOutcome::kFailed;
    begin_stop(SIGTERM);
  }
}

int Agent::running_count() const {
  int n = 0;
  for (const auto& w : workers_) n += w.running ? 1 : 0;
  return n;
}

bool Agent::all_groups_gone() const {
  for (const auto& w : workers_) {
    if (w.group_live) return false;
  }
  return true;
}

GroupOutcome Agent::supervise() {
  for (;;) {
    if (phase_ == GroupPhase::kRunning && running_count() == 0) {
      // Every worker exited 0 (a failure would have started the stop). Leftover processes in
      // their groups (background grandchildren) are stopped like workers.
      outcome_ = GroupOutcome::kSucceeded;
      if (!all_groups_gone()) begin_stop(SIGTERM);
    }
    if (outcome_ && running_count() == 0 && all_groups_gone()) break;
    std::optional<Clock::TimePoint> deadline;
    if (phase_ == GroupPhase::kStopping) {
      deadline = killed_ ? killed_at_ + kAfterKillGrace : *kill_at_;
    }
    loop_.run_once(deadline);
    // The phase may have changed inside run_once; only a deadline set before it can expire.
    if (deadline && phase_ == GroupPhase::kStopping && clock_.now() >= *deadline) {
      if (!killed_) {
        spdlog::warn("workers still running {} ms after the stop signal; sending SIGKILL",
                     config_.shutdown_timeout.count());
        kill_all();
      } else {
        throw std::runtime_error("workers did not exit " + std::to_string(kAfterKillGrace.count()) +
                                 " s after SIGKILL");
      }
    }
  }
  logs_->drain();
  logs_.reset();
  return *outcome_;
}

void Agent::on_signalfd() { read_signals(true); }

// Reads the signalfd until it is empty (bounded): each handled signal goes to on_agent_signal;
// a SIGCHLD reaps the exited children when reap_children is set (otherwise the caller reaps).
void Agent::read_signals(bool reap_children) {
  signalfd_siginfo si[16];
  for (int round = 0; round < 64; ++round) {
    ssize_t n = read(sigfd_, si, sizeof si);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    bool child = false;
    for (size_t i = 0; i < static_cast<size_t>(n) / sizeof(signalfd_siginfo); ++i) {
      int sig = static_cast<int>(si[i].ssi_signo);
      if (sig == SIGCHLD) {
        child = true;
      } else {
        on_agent_signal(sig);
      }
    }
    if (child && reap_children) on_children();
  }
}

void Agent::on_children() {
  const GroupPhase phase_before = phase_;
  auto exits = sup_.reap([this](pid_t pid) { return by_pid_.count(pid) > 0; });
  const int64_t reaped_at_ms = unix_ms();
  // A scheduler stopping the job (scancel) signals trun and its workers at the same moment: a
  // worker may exit on its own handler before trun has read its own signal. on_signalfd() reads
  // again after this, and run() once more when the group has stopped, so such an exit ends in
  // the shutdown (128+N), not a restart.
  bool failed = false;
  for (const auto& e : exits) {
    WorkerProcess& w = workers_[by_pid_.at(e.pid)];
    w.running = false;
    w.exitcode = e.exitcode();
    spdlog::debug("worker local_rank={} pid={} exited with {}", w.local_rank, w.pid, w.exitcode);
    // Exits in the same batch as the first failure are failures too: they happened before the
    // stop began.
    // A worker that fails on its own after the stop began (it wrote an error file) is a failure
    // too, so the root cause can be chosen among all of them by their timestamps.
    bool own_failure = phase_before == GroupPhase::kStopping && outcome_ == GroupOutcome::kFailed &&
                       w.exitcode != 0 && std::filesystem::exists(w.error_file);
    const bool is_failure =
        on_worker_exit(phase_before, w.exitcode, 1) == ExitAction::kStopGroupFailed || own_failure;
    EventMetadata md{{"local_rank", int64_t{w.local_rank}},
                     {"global_rank", int64_t{w.rank}},
                     {"worker_pid", int64_t{w.pid}},
                     {"exitcode", int64_t{w.exitcode}},
                     {"state", std::string(is_failure        ? "FAILED"
                                           : w.exitcode == 0 ? "SUCCEEDED"
                                                             : "STOPPED")}};
    if (w.exitcode < 0) md["signal"] = signal_name(-w.exitcode);
    event("trun.agent.worker_exited", std::move(md));
    set_worker_state(static_cast<size_t>(w.local_rank), is_failure        ? "failed"
                                                        : w.exitcode == 0 ? "succeeded"
                                                                          : "stopped");
    if (metrics_ && w.exitcode != 0) {
      // A worker that trun itself stopped (the group stopped after another's failure, a restart,
      // a signal to trun) is no failure of its own: counted under stopped_by="trun".
      ++snap_.worker_exits[(w.exitcode < 0 ? "signal=\"" + signal_name(-w.exitcode) + "\""
                                           : "exit_code=\"" + std::to_string(w.exitcode) + "\"") +
                           (is_failure ? "" : ",stopped_by=\"trun\"")];
    }
    if (is_failure) {
      WorkerFailure f =
          read_failure(w.local_rank, w.rank, w.pid, w.exitcode, w.error_file, failure_seq_++);
      f.exited_at_ms = reaped_at_ms;
      const char* path = std::getenv("PATH");
      f.hint = python_start_hint(config_.python_interpreter, path ? path : "",
                                 std::chrono::duration<double>(clock_.now() - w.started).count(),
                                 w.exitcode, f.message);
      failures_.push_back(std::move(f));
      failed = true;
    }
  }
  update_groups();
  if (failed && phase_ == GroupPhase::kRunning) {
    outcome_ = GroupOutcome::kFailed;
    begin_stop(SIGTERM);
  }
  publish();
}

void Agent::update_groups() {
  for (auto& w : workers_) {
    if (w.group_live && !w.running && !sup_.group_alive(w.pid)) {
      w.group_live = false;
      sup_.forget_group(w.pid);
    }
  }
}

void Agent::on_agent_signal(int sig) {
  if (received_signal_ == 0) {
    received_signal_ = sig;
    if (running_count() > 0 || !all_groups_gone()) {
      spdlog::warn("received {}: forwarding it to the workers and stopping them", signal_name(sig));
    } else {
      spdlog::warn("received {}: stopping", signal_name(sig));
    }
  } else if ((sig == SIGINT || sig == SIGTERM) && phase_ == GroupPhase::kStopping && !killed_) {
    // The user asked twice (a second Ctrl-C): do not make them wait for --shutdown-timeout.
    spdlog::warn("received a second signal ({}) while stopping the workers: sending SIGKILL now",
                 signal_name(sig));
    outcome_ = GroupOutcome::kSignaled;
    kill_all();
    return;
  }
  outcome_ = GroupOutcome::kSignaled;
  if (phase_ == GroupPhase::kRunning) {
    begin_stop(sig);
  } else {
    for (auto& w : workers_) {
      if (w.group_live) sup_.signal_group(w.pid, sig);
    }
  }
}

void Agent::begin_stop(int sig) {
  phase_ = GroupPhase::kStopping;
  set_phase("stopping");
  kill_at_ = clock_.now() + config_.shutdown_timeout;
  for (auto& w : workers_) {
    if (w.group_live) sup_.signal_group(w.pid, sig);
  }
  if (config_.shutdown_timeout.count() == 0) kill_all();
}

void Agent::kill_all() {
  for (auto& w : workers_) {
    if (w.group_live) sup_.signal_group(w.pid, SIGKILL);
  }
  killed_ = true;
  killed_at_ = clock_.now();
}

void Agent::cleanup() {
  logs_.reset();
  if (session_) session_->shutdown();
  remove_worker_shm_segments(run_id_);
  if (temp_base_ && !base_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(base_dir_, ec);
  }
  if (heartbeat_fd_ >= 0) {
    loop_.remove(heartbeat_fd_);
    close(heartbeat_fd_);
    heartbeat_fd_ = -1;
  }
  metrics_.reset();
  if (sigfd_ >= 0) {
    loop_.remove(sigfd_);
    close(sigfd_);
    sigfd_ = -1;
  }
}

}  // namespace

int ElasticAgent::run() {
  // Blocked first, for the whole process: the real supervisor's threads must start with the
  // agent's signals blocked (its header), and only the agent's signalfd may take them.
  const sigset_t set = agent_signal_set(config_);
  if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) {
    spdlog::error("cannot set up process supervision: pthread_sigmask: {}", std::strerror(errno));
    return kExitAgentError;
  }
  // A parent may have started trun with some of them ignored (a shell's background job ignores
  // SIGINT and SIGQUIT; some programs ignore SIGCHLD), and an ignored disposition survives exec.
  // An ignored SIGCHLD makes the kernel reap the workers itself, so their exits would never be
  // seen; ignored stop signals would be inherited by the workers, which would then ignore what
  // trun forwards. Blocked, the default action cannot run, so the defaults are safe here.
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction old {};
    if (sigismember(&set, sig) == 1 && sigaction(sig, nullptr, &old) == 0 &&
        old.sa_handler == SIG_IGN) {
      signal(sig, SIG_DFL);
    }
  }
  if (spawner_ != nullptr) {
    Agent agent(config_, *clock_, *spawner_);
    return agent.run();
  }
  // Without --log-dir the temporary directory exists before the guardian is forked, so that the
  // guardian can remove it if trun dies without doing so (SIGKILL).
  std::string temp_dir;
  if (config_.log_dir.empty()) {
    try {
      temp_dir = make_temporary_dir();
    } catch (const std::exception& e) {
      spdlog::error("cannot create the log directory: {}", e.what());
      return kExitAgentError;
    }
  }
  std::unique_ptr<ProcessSupervisor> supervisor;
  try {
    if (!ProcessSupervisor::become_subreaper()) {
      spdlog::warn("cannot become a child subreaper: {}", std::strerror(errno));
    }
    supervisor = std::make_unique<ProcessSupervisor>(temp_dir);
  } catch (const std::exception& e) {
    spdlog::error("cannot set up process supervision: {}", e.what());
    std::error_code ec;
    if (!temp_dir.empty()) fs::remove_all(temp_dir, ec);
    return kExitAgentError;
  }
  // Destroyed before the supervisor: the agent removes the directory, then the supervisor tells
  // the guardian to leave it alone.
  Agent agent(config_, steady_clock(), *supervisor, temp_dir);
  return agent.run();
}

}  // namespace trun::agent
