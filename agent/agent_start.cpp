// The agent's start (agent/agent.h): run() and run_job(), which drive the job from the first
// round to the exit code, and start_workers(), which spawns one attempt's worker group.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "agent/agent.h"
#include "agent/job_local.h"
#include "base/build_info.h"

extern char** environ;

namespace trun::agent {
namespace {

namespace fs = std::filesystem;

// --metrics-port: how often the nodes waiting for the next round are sampled (off the loop).
constexpr auto kWaitingSampleInterval = std::chrono::seconds(2);

}  // namespace

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
                               {"entrypoint", config_.entrypoint_name},
                               {"version", base::build_info().version},
                               {"commit", base::commit_text()}});
  }
  const bool served = config_.metrics_port < 0 || start_metrics();
  int code = kExitAgentError;
  try {
    if (served) code = run_job();
  } catch (const RendezvousInterrupted& e) {
    code = after_interrupted_rendezvous();
    // Workers kept running for the round that a stop signal interrupted: they stop with it.
    if (keep_workers_) stop_kept_workers(received_signal_ != 0 ? received_signal_ : SIGTERM);
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

int Agent::run_job() {
  if (config_.file_timer && !start_file_timer()) return kExitAgentError;
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
    // Connected first, so that a node kept out (unhealthy, excluded) shows in `trun status`.
    {
      WaitingWindow waiting(*this);
      session_->connect();
    }
    restore_exclusion();
    sit_out_exclusion();
    wait_until_healthy("before joining");
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
  if (config_.hang_timeouts.enabled) start_hang_watch();

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
    if (next.kind == Next::kExit) {
      stop_kept_workers(SIGTERM);
      return next.exit_code;
    }
    if (!prepare_next_attempt(next, outcome == GroupOutcome::kRoundOver)) {
      stop_kept_workers(SIGTERM);
      return kExitAgentError;
    }
  }
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

// Python workers under PyTorch's watchdog run with PYTHONFAULTHANDLER=1 unless it is set; an
// empty value keeps it off (as in Python). While it is on, an expired SIGKILL timer is preceded
// by SIGABRT, on which faulthandler dumps the worker's Python stacks.
bool Agent::python_fault_handler() const {
  if (!config_.file_timer || config_.python_interpreter.empty()) return false;
  const char* set = std::getenv("PYTHONFAULTHANDLER");
  return set == nullptr || *set != '\0';
}

// Before the rendezvous, so that a path that cannot be served fails this node alone.
bool Agent::start_file_timer() {
  try {
    FileTimerOptions options;
    options.path =
        config_.file_timer_path.empty() ? generated_timer_path() : config_.file_timer_path;
    if (python_fault_handler()) options.dump_signal = SIGABRT;
    timer_server_ = std::make_unique<FileTimerServer>(std::move(options));
  } catch (const FileTimerError& e) {
    spdlog::error("cannot serve PyTorch's watchdog timers ({}=1): {}", kEnableFileTimerVar,
                  e.what());
    return false;
  }
  spdlog::info("serving PyTorch's watchdog timers at {}={}", kTimerFileVar, timer_server_->path());
  return true;
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

void Agent::start_workers() {
  if (keep_workers_) {
    reform_kept_workers();
    return;
  }
  reset_group();
  attempt_dir_ = make_attempt_dir();
  if (hang_) {
    agree_hang_timeouts();
    hang_->begin_group();  // clears the board the new workers attach to
    // A dynamic round's generations come from its store and start again with each round (every
    // node uses the same); a static one's follow the restart count.
    generation_ = session_->dynamic() ? 0 : static_cast<uint64_t>(restart_count_);
    seq_seen_ = 0;
    publish_generation(generation_, -1);
  }
  goodput_slots_.clear();
  attempt_started_ = clock_.now();
  auto results = sup_.spawn(spawn_requests(attempt_dir_));
  logs_->close_child_ends();
  const bool spawn_failed = !record_spawn_results(results);
  if (timer_server_) {  // its requests are read from now on (reset_group paused them)
    std::vector<pid_t> pids;
    for (const auto& [pid, i] : by_pid_) pids.push_back(pid);
    timer_server_->set_workers(pids);
  }
  spdlog::info("attempt {}: started {} workers", restart_count_, by_pid_.size());
  if (metrics_) {
    snap_.worker_states.assign(workers_.size(), "running");
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (!workers_[i].running) set_worker_state(i, "failed");
    }
    snap_.phase = "";  // set_phase publishes the new states with the phase
  }
  set_phase("running");
  start_reform_watch();
  if (spawn_failed) {
    outcome_ = GroupOutcome::kFailed;
    begin_stop(SIGTERM);
  }
}

// A new attempt's state: no outcome, no failures, one slot per worker, a new LogMux.
void Agent::reset_group() {
  phase_ = GroupPhase::kRunning;
  outcome_.reset();
  kill_at_.reset();
  killed_ = false;
  failures_.clear();
  root_cause_.reset();
  crash_looped_ = false;
  crash_loop_recorded_ = false;
  end_reformation_watch();
  reform_watch_.reset();
  hang_blamed_rank_ = -1;
  stop_began_.reset();
  by_pid_.clear();
  workers_.assign(static_cast<size_t>(config_.nproc_per_node), WorkerProcess{});
  logs_.reset();
  logs_ = std::make_unique<LogMux>(loop_);
  if (timer_server_) timer_server_->clear_workers();  // the old group's timers go with it
  if (hang_) hang_->end_group();
}

std::string Agent::fresh_attempt_dir() {
  const std::string attempt_dir = base_dir_ + "/attempt_" + std::to_string(restart_count_);
  std::error_code ec;
  if (fs::exists(attempt_dir, ec)) {
    spdlog::warn("replacing the logs of an earlier run in {}", attempt_dir);
    fs::remove_all(attempt_dir, ec);
  }
  fs::create_directories(attempt_dir);
  return attempt_dir;
}

// fresh_attempt_dir(), with the filtered copies of trun's stdout and stderr there.
std::string Agent::make_attempt_dir() {
  const std::string attempt_dir = fresh_attempt_dir();
  if (!config_.duplicate_stdout_filters.empty()) {
    logs_->duplicate(STDOUT_FILENO, attempt_dir + "/filtered_stdout.log",
                     config_.duplicate_stdout_filters);
  }
  if (!config_.duplicate_stderr_filters.empty()) {
    logs_->duplicate(STDERR_FILENO, attempt_dir + "/filtered_stderr.log",
                     config_.duplicate_stderr_filters);
  }
  return attempt_dir;
}

// Every worker's spawn_request.
std::vector<SpawnRequest> Agent::spawn_requests(const std::string& attempt_dir) {
  const AttemptEnv attempt = attempt_env();
  std::vector<SpawnRequest> requests;
  for (size_t i = 0; i < workers_.size(); ++i)
    requests.push_back(spawn_request(i, attempt_dir, attempt));
  return requests;
}

AttemptEnv Agent::attempt_env() const {
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
  if (timer_server_) attempt.timer_file = timer_server_->path();
  attempt.python_fault_handler = timer_server_ && python_fault_handler();
  if (hang_) attempt.progress_shm = hang_->shm_name();
  return attempt;
}

SpawnRequest Agent::spawn_request(size_t i, const std::string& attempt_dir,
                                  const AttemptEnv& attempt) {
  WorkerProcess& w = workers_[i];
  w.local_rank = static_cast<int>(i);
  w.rank = session_->ranks().global[i];
  w.role_rank = session_->ranks().role[i];
  w.dir = attempt_dir + "/" + std::to_string(i);
  fs::create_directories(w.dir);
  w.error_file = w.dir + "/error.json";
  SpawnRequest req;
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
                                 w.dir + "/stdout.log", prefix, w.local_rank);
  req.stderr_fd = logs_->prepare(stream_mode(w.local_rank, kStdErr), STDERR_FILENO,
                                 w.dir + "/stderr.log", prefix, w.local_rank);
  return req;
}

bool Agent::record_spawn_results(const std::vector<SpawnResult>& results) {
  bool spawn_failed = false;
  for (size_t i = 0; i < workers_.size(); ++i) spawn_failed |= !record_spawn_result(i, results[i]);
  return !spawn_failed;
}

bool Agent::record_spawn_result(size_t i, const SpawnResult& result) {
  WorkerProcess& w = workers_[i];
  if (result.pid > 0) {
    w.pid = result.pid;
    w.started = clock_.now();
    w.running = true;
    w.group_live = true;
    by_pid_[w.pid] = i;
    event("trun.agent.worker_started", {{"local_rank", int64_t{w.local_rank}},
                                        {"global_rank", int64_t{w.rank}},
                                        {"role_rank", int64_t{w.role_rank}},
                                        {"worker_pid", int64_t{w.pid}}});
    return true;
  }
  w.exitcode = result.error == ENOENT ? 127 : 126;
  WorkerFailure f = read_failure(w.local_rank, w.rank, -1, w.exitcode, "", failure_seq_++);
  f.message = "cannot start worker: " + result.error_message;
  f.exited_at_ms = unix_ms();
  event("trun.agent.worker_exited", {{"local_rank", int64_t{w.local_rank}},
                                     {"global_rank", int64_t{w.rank}},
                                     {"exitcode", int64_t{w.exitcode}},
                                     {"state", std::string("FAILED")},
                                     {"raw_error", f.message}});
  failures_.push_back(std::move(f));
  return false;
}

StreamMode Agent::stream_mode(int local_rank, int stream) const {
  bool redirect = (config_.redirects.for_rank(local_rank) & stream) != 0;
  bool tee = (config_.tee.for_rank(local_rank) & stream) != 0;
  bool hidden = config_.local_ranks_filter && !config_.local_ranks_filter->count(local_rank);
  if (tee && !hidden) return StreamMode::kTee;
  if (tee || redirect) return StreamMode::kFile;
  return hidden ? StreamMode::kDiscard : StreamMode::kInherit;
}

}  // namespace trun::agent
