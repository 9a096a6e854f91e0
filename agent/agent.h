#pragma once
// Agent: the executor behind ElasticAgent::run (agent/elastic_agent.h), one object per job on
// this node. Internal to trun_agent: not installed, included only by agent/agent*.cpp and
// agent/elastic_agent.cpp.
//
// Its phases, and the file that holds each:
//   start      agent_start.cpp      run(): signals, the event log, /metrics, then run_job(): the
//                                   first round (rendezvous join), the log directory, the
//                                   workers' base environment, and one attempt after another:
//                                   start_workers() (named steps: reset_group, make_attempt_dir,
//                                   spawn_requests, record_spawn_results).
//   supervise  agent_supervise.cpp  supervise(): the event loop until the group has stopped;
//                                   the signalfd (worker exits, signals to trun), the round-over
//                                   event, the SIGKILL deadline.
//   restart    agent_restart.cpp    after the group stopped: after_stop() / after_round_over()
//                                   (agent/decisions.h decides), resolve_root_cause() across
//                                   nodes, prepare_next_attempt() (counts the restart, forms
//                                   the next round).
//   stop       agent_stop.cpp       stopping the group (begin_stop, kill_all), finish() (the
//                                   failure summary, the exit barrier, closing the job) and
//                                   cleanup() (the destructor).
//   hang       agent_hang.cpp       hang detection (agent/hang_watch.h): the watch's start, and
//                                   on_hang(): the dumps, the failure and the stop.
//   replace    agent_replace.cpp    resilient loops (docs/launcher.md): a failed worker replaced
//                                   alone while the others keep running, the watch for the
//                                   group's re-formation, and the fallback to a whole restart.
//   publish    agent_publish.cpp    what operators see, fed from the agent's thread: the event
//                                   log, the /metrics snapshot (and its publication while a
//                                   rendezvous blocks) and the status record for `trun status`.
//
// Thread safety: everything runs on the thread that called run(), except publish_while_waiting()
// (the rendezvous session's sampler thread), which reads snap_ only under waiting_mu_.

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "agent/clock.h"
#include "agent/decisions.h"
#include "agent/event_log.h"
#include "agent/event_loop.h"
#include "agent/failure_report.h"
#include "agent/file_timer_server.h"
#include "agent/goodput.h"
#include "agent/hang_watch.h"
#include "agent/health_gate.h"
#include "agent/launch_config.h"
#include "agent/log_mux.h"
#include "agent/metrics_server.h"
#include "agent/node_status.h"
#include "agent/process_spawner.h"
#include "agent/reform_watch.h"
#include "agent/rendezvous_session.h"
#include "agent/worker_env.h"
#include "rendezvous/handler.h"

namespace trun::agent {

// The signals the agent takes through its signalfd: SIGCHLD and config.signals_to_handle.
inline sigset_t agent_signal_set(const LaunchConfig& config) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  for (int s : config.signals_to_handle) sigaddset(&set, s);
  return set;
}

// Seconds on the steady clock (any epoch): for intervals only.
inline double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

inline int64_t unix_ms() {
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
  std::string dir;  // its log directory: <base dir>/attempt_<restart count>/<local rank>
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
  // --- start (agent_start.cpp) ---
  int run_job();
  void setup_signals();
  bool make_base_dir();
  // TORCHELASTIC_ENABLE_FILE_TIMER=1: serves PyTorch's watchdog FIFO; false (after the error
  // line) when the path cannot be served.
  bool start_file_timer();
  // Whether Python workers run with faulthandler on under the watchdog (agent_start.cpp).
  bool python_fault_handler() const;
  void start_workers();
  // start_workers' steps, in order.
  void reset_group();
  std::string make_attempt_dir();
  std::vector<SpawnRequest> spawn_requests(const std::string& attempt_dir);
  // Returns false when a worker could not be started (its failure is recorded).
  bool record_spawn_results(const std::vector<SpawnResult>& results);
  // attempt_<restart count> under the base directory, made empty (an earlier run's is replaced).
  std::string fresh_attempt_dir();
  // What is the same for every worker spawned now (the current restart count and round).
  AttemptEnv attempt_env() const;
  // Worker i's ranks, directory and error file (in workers_[i]), and what to spawn for it: argv,
  // environment, CPU binding, and where its output goes (attempt_dir/<i>).
  SpawnRequest spawn_request(size_t i, const std::string& attempt_dir, const AttemptEnv& attempt);
  // Records worker i's spawn: its pid and event, or its failure to start (false).
  bool record_spawn_result(size_t i, const SpawnResult& result);
  StreamMode stream_mode(int local_rank, int stream) const;

  // --- hang (agent_hang.cpp) ---
  // Creates the progress board and the watch (--hang-detection=on); a board that cannot be made
  // leaves detection off, with a warning.
  void start_hang_watch();
  // Merges what this node's watch learned with every other node's through the job's store and
  // adopts the result (agent/hang_agree.h): after a group stopped, before the next round (so
  // that the record holds every member's once that round forms), and before a group starts.
  // Store errors are logged and leave the local values.
  void agree_hang_timeouts();
  // The watch's eventfd: a hung verdict for the running group.
  void on_hang();
  // Writes <attempt dir>/<local rank>/hang_dump.txt for each local worker; returns the culprit's
  // native stacks (empty when it is not on this node).
  std::string write_hang_dumps(const HangWatch::Finding& f, const std::vector<int>& culprits);

  // --- health (agent_health.cpp) ---
  // The health gate (agent/health_gate.h): returns once this node passes its checks; until then
  // it says why, shows as unhealthy (status, /metrics, event log) and checks again after a
  // back-off. Throws RendezvousInterrupted when a stop signal arrives meanwhile. `when`: "before
  // joining", "before the restart".
  void wait_until_healthy(const char* when);
  HealthOptions health_options() const;
  // After a failure whose root cause is this node's own worker: counts it, and when the node
  // has failed --exclude-after times within the window and the others are enough for the job
  // (--nnodes MIN), excludes it (a cooldown that doubles on each repeat). True when excluded.
  bool exclude_after_failure();
  // Excludes this node now for the next cooldown (docs/health.md): says why on stderr, in the
  // event log and the status record, and keeps it in the job's store (save_exclusion).
  // `nodes_left`: the nodes the job has without it.
  void exclude_node(const std::string& why, int nodes_left);
  // Before the first join: an exclusion of this node that the job's store still holds (the
  // agent was restarted during one) is taken up again: what is left of it is sat out, and the
  // next exclusion is as long as that agent's next would have been.
  void restore_exclusion();
  void save_exclusion(const std::string& why, double cooldown_s);
  // This node's name in exclusion records: its host name, and --local-addr when given.
  std::string node_name() const;
  // Before joining again: sits out what is left of an exclusion (a stop signal ends it).
  void sit_out_exclusion();
  // Sleeps `d` unless a stop signal is pending (then throws RendezvousInterrupted).
  void sleep_unless_stopped(std::chrono::milliseconds d);

  // --- slow ranks (agent_straggler.cpp) ---
  // A timer on the loop: every kStragglerReportInterval while a group runs, this node's ranks'
  // step times go to /metrics and its status record, and the judging node (the only one, or
  // group rank 0, which reads every node's record) scores every rank and flags the slow ones.
  void start_straggler_reports();
  void on_straggler_tick();
  // Every node's ranks, from their status records (this node's from `local`).
  std::vector<straggler::RankStats> job_rank_stats(const std::vector<straggler::RankStats>& local);
  void on_straggler_change(const straggler::Judge::Change& c,
                           const std::vector<straggler::RankStats>& scored);
  // --straggler-action=exclude, on the judging node: blames the flagged rank's node in the
  // store (trun/blame/<run id>/<node id>) when a spare waits and the job keeps MIN nodes
  // without it.
  void blame_straggler(const straggler::RankStats& r);
  // On every node, each tick with --straggler-action=exclude: when this node is blamed for the
  // current round it is excluded and leaves the round (the others re-form with the spare), unless
  // it hosts the job's store. True when it left.
  bool leave_if_blamed();

  // --- publish (agent_publish.cpp) ---
  // Records an event in --event-log (no-op without one), with the restart count.
  void event(const std::string& name, EventMetadata md);
  // --metrics-port: starts the endpoint and its heartbeat; false (after the error line) when the
  // port cannot be served.
  bool start_metrics();
  // Publishes snap_ to the endpoint (no-op without one), as alive now.
  void publish();
  void refresh_live(AgentSnapshot* s) const;
  void set_phase(const char* phase);
  // The goodput account (agent/goodput.h) follows every phase change: the running group's board
  // is sampled first, and the badput intervals it closes go to the event log
  // (trun.agent.badput). Runs also without --metrics-port.
  void account_phase(const std::string& phase);
  void sample_goodput();
  // While this thread waits in a blocking rendezvous call the loop does not run, and /metrics
  // would stand still exactly when an operator looks: the session's sampler thread publishes
  // then (publish_while_waiting), from a copy of the snapshot taken under waiting_mu_. The
  // snapshot is written only outside such a window, or after end_waiting().
  class WaitingWindow;
  void begin_waiting();
  void end_waiting();
  void publish_while_waiting();
  // Writes this node's status record for `trun status` (agent/node_status.h) in `state`.
  // Returns whether the store took it.
  bool publish_status(const char* state);
  void set_worker_state(size_t i, const char* state);

  // --- replace (agent_replace.cpp) ---
  // In on_children, when workers of the running group failed (`failed`: their indices and
  // failures): replaces them alone when decide_in_place says so (a resilient loop on this node
  // only, restarts left; see docs/launcher.md) and returns true; false leaves them to the caller,
  // which stops the group as after any failure.
  bool replace_in_place(std::vector<std::pair<size_t, WorkerFailure>>& failed);
  InPlaceFacts in_place_facts(const std::vector<std::pair<size_t, WorkerFailure>>& failed) const;
  // How long a group may take to re-form around its replacements before it is restarted whole:
  // the rendezvous' join_timeout, at least kMinReformTimeout (agent_replace.cpp).
  Clock::Duration reform_timeout() const;
  // The re-formation watch: a timer on the loop while a group re-forms.
  void arm_reform_timer(bool on);
  void on_reform_tick();
  // The group did not re-form in time: says so, then abandon_reformation().
  void reformation_timed_out();
  // The failures replaced since the re-formation began become the attempt's failures again
  // (`note` appended to each message) and the group stops, then restarts whole (counted) or
  // fails, as after any failure.
  void abandon_reformation(const std::string& note);
  // Ends the watch (the group re-formed, stops or ends).
  void end_reformation_watch();
  // The generation the workers re-form at after a replacement here: on a static rendezvous the
  // restart count after this one; on a dynamic one (every node of the round must use the same)
  // the next value of the round store's counter (agent/reform_watch.h). nullopt when the store
  // did not answer (the group then restarts whole).
  struct NextFormation {
    uint64_t generation = 0;
    int64_t naming = -1;
  };
  std::optional<NextFormation> next_formation();
  // Stores `generation` on the board with this round's Formation (the workers' places) and
  // `naming` (see base/progress_board.h).
  void publish_generation(uint64_t generation, int64_t naming);
  // A node joined or left while every local worker runs a resilient loop (dynamic rendezvous):
  // the workers keep running while the next round forms, then re-form in it (keep_workers_).
  bool can_keep_workers() const;
  // start_workers() after such a round: the running workers' new places on the board, a new
  // generation, the re-formation watch.
  void reform_kept_workers();
  // The workers kept for the next round are not going to be in it (the job ends, the round
  // cannot form, a stop signal): stops them as any group stops (`sig`), and waits.
  void stop_kept_workers(int sig);
  // Multi-node rounds of a dynamic rendezvous: the counter's reader (reform_watch_) while the
  // group runs.
  void start_reform_watch();
  // The counter went up to `generation`: another node replaced a worker in place, and this
  // node's workers re-form with it, keeping running (the board's generation moves).
  void on_remote_generation(int64_t generation);
  // Kills what is left of a dead worker's process group (its children), and keeps the group
  // tracked until it is empty (retired_groups_).
  void retire_group(WorkerProcess& w);
  // The end-of-job lines for the workers replaced in place ("" when none was).
  std::string replaced_summary() const;
  // The badput intervals the goodput account closed since, to the event log.
  void record_badput_intervals();

  // --- supervise (agent_supervise.cpp) ---
  GroupOutcome supervise();
  void on_signalfd();
  void read_signals(bool reap_children);
  void on_children();
  void on_agent_signal(int sig);
  bool on_round_over(const rendezvous::RoundEvent& e);
  // A stop signal ended a wait in the rendezvous (which this node has left): takes the signal
  // from the signalfd and returns 128+N.
  int after_interrupted_rendezvous();
  void update_groups();
  bool all_groups_gone() const;
  int running_count() const;

  // --- restart (agent_restart.cpp) ---
  // After a round ended by a worker failure (this node's, `own`, or another's) and this node's
  // workers stopped: chooses the root cause among every node's report (root_cause_), records it
  // (status, event log) and returns it.
  const RootCause& resolve_root_cause(const std::optional<rendezvous::FailureReport>& own);
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
  // Counts a failed attempt in the crash-loop guard (`root_line`: the root cause's failure line);
  // true when the guard stops the job instead of restarting it.
  // `progress`: whether the failed attempt made progress (unset: attempt_made_progress()).
  bool crash_loop_reached(const std::string& root_line,
                          std::optional<bool> progress = std::nullopt);
  // Says so on stderr and in the event log.
  void announce_crash_loop(const std::string& root_line);
  // Whether the attempt that just stopped made progress: a step on the progress board, or it ran
  // for --crash-loop-uptime before it began to stop.
  bool attempt_made_progress() const;

  // --- stop (agent_stop.cpp) ---
  void begin_stop(int sig);
  // A group stopped because it broke (a failure, a round over, a hang verdict) whose libtrun_worker
  // ranks make no progress at all after the stop signal (they wait in collectives with a peer that
  // is gone) is killed after stall_grace_ instead of --shutdown-timeout. True when it killed.
  bool kill_if_stalled();
  void kill_all();
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
  std::unique_ptr<FileTimerServer> timer_server_;  // with config_.file_timer only
  std::unique_ptr<HangWatch> hang_;                // with config_.hang_timeouts.enabled only
  std::string attempt_dir_;                        // the current attempt's log directory
  GroupPhase phase_ = GroupPhase::kRunning;
  std::optional<GroupOutcome> outcome_;
  std::optional<Clock::TimePoint> kill_at_;
  bool killed_ = false;
  Clock::TimePoint killed_at_;
  int received_signal_ = 0;
  uint64_t failure_seq_ = 0;
  std::vector<WorkerFailure> failures_;         // of the current attempt
  std::optional<RootCause> root_cause_;         // of the current attempt, across nodes, once known
  Clock::TimePoint attempt_started_{};          // when start_workers() spawned the current attempt
  std::optional<Clock::TimePoint> stop_began_;  // its first begin_stop()
  // The stall watch of a broken group's stop (kill_if_stalled): the ranks' progress events when
  // they last moved, and when.
  std::optional<uint64_t> stop_events_;
  Clock::TimePoint stop_moved_at_{};
  Clock::Duration stall_grace_{};
  CrashLoop crash_loop_;
  // The crash-loop guard was reached by a failure that would have been replaced in place: the
  // group stops, and the job ends with kExitCrashLoop instead of restarting.
  bool crash_looped_ = false;
  // The attempt's failure was already counted by the crash-loop guard: replace_in_place counted
  // it, and the group then did not re-form around the replacement (abandon_reformation).
  bool crash_loop_recorded_ = false;
  // Resilient loops (agent_replace.cpp). A group re-forming around replaced workers: the
  // generation it re-forms at, when the failure was seen, until when it may take, and where its
  // failures start in replaced_.
  // `remote`: another node replaced the worker; this node only follows (no failure of its own to
  // restart for when its workers do not re-form: that node's watch decides).
  struct Reformation {
    uint64_t generation = 0;
    Clock::TimePoint failed_at{};
    Clock::TimePoint deadline{};
    size_t first_failure = 0;
    bool remote = false;
    bool round = false;  // a new round formed around the running workers (reform_kept_workers)
  };
  std::optional<Reformation> reformation_;
  // The generation on the progress board: the workers' formations (agent/agent_replace.cpp).
  uint64_t generation_ = 0;
  // The round store's counter of replacements (agent/reform_watch.h) as this node last saw it.
  int64_t seq_seen_ = 0;
  bool keep_workers_ = false;  // see can_keep_workers
  double kept_since_ = 0;      // when the round that keeps them began (monotonic_seconds)
  std::unique_ptr<ReformWatch> reform_watch_;
  int reform_fd_ = -1;  // a timerfd, armed while reformation_ is set
  struct Replaced {
    WorkerFailure failure;
    uint64_t generation = 0;  // the replacement's
  };
  std::vector<Replaced> replaced_;      // failures replaced in place, this job
  std::vector<pid_t> retired_groups_;   // process groups of replaced workers not yet empty
  std::vector<int> goodput_slots_;      // the replacements' local ranks (goodput_progress)
  bool multi_node_note_shown_ = false;  // said once that a multi-node job restarts whole
  bool health_notes_shown_ = false;     // the health gate's skipped-check notes, once per job
  Exclusion exclusion_;
  // The last hang verdict of this group blamed a rank of this node (on_hang): the failure that
  // follows excludes the node at once (not after --exclude-after failures).
  int hang_blamed_rank_ = -1;
  // This node left the round on purpose (leave_if_blamed): the group stopped for that.
  bool stepped_out_ = false;
  bool blame_refused_ = false;   // said once per round that a blamed store host stays
  std::string outside_slot_of_;  // the node id this agent took an outside slot for
  std::optional<Clock::TimePoint> excluded_until_;  // while this node sits out
  int straggler_fd_ = -1;                           // a timerfd while the hang watch runs
  straggler::Judge straggler_judge_{config_.straggler};
  int64_t straggler_round_ = -1;  // the round the judge's state is of
  NodeStatus status_;             // the last record publish_status wrote
  goodput::Account goodput_{monotonic_seconds()};
};

// Marks a blocking rendezvous call for publish_while_waiting (see begin_waiting).
class Agent::WaitingWindow {
 public:
  explicit WaitingWindow(Agent& agent) : agent_(agent) { agent_.begin_waiting(); }
  ~WaitingWindow() { agent_.end_waiting(); }
  WaitingWindow(const WaitingWindow&) = delete;
  WaitingWindow& operator=(const WaitingWindow&) = delete;

 private:
  Agent& agent_;
};

}  // namespace trun::agent
