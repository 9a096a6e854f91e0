#pragma once
// RendezvousSession: the agent's side of the rendezvous for one job on this node.
//
// It creates the handler for the configured backend (c10d or etcd: dynamic membership; static or
// --standalone: a fixed world), forms rounds together with this node's worker ranks
// (agent/rank_assignment.h), brings the end of a round to the agent's event loop, and, after a
// dynamic backend lost its store, rejoins within one deadline (join_timeout).
//
// Round ends: the handler reports them on a thread of its own; the session hands the newest one
// to the event loop through an eventfd and calls `on_round_over` there, on the loop's thread, for
// events of the current round that concern this agent (not kShutdown, not this node's own
// failure report, at most one per round). When the callback returns true the event is the one
// that ended the attempt: round_over() returns it until the next round.
//
// Thread safety: use from the agent's thread only (the handler's thread only posts).
// Errors: start(), next_round() throw what RendezvousHandler::next_rendezvous throws, plus store
// errors from the rank exchange; rejoin() and the others report on stderr or in the log and do
// not throw. start(), next_round() and rejoin() throw RendezvousInterrupted when a stop signal
// (config.signals_to_handle) arrives while they wait for a round: a thread of their own watches
// for it (without taking it) and shuts the handler down, which ends the wait at once.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "agent/clock.h"
#include "agent/event_log.h"
#include "agent/event_loop.h"
#include "agent/launch_config.h"
#include "agent/rank_assignment.h"
#include "rendezvous/handler.h"

namespace trun::agent {

// Whether one of `signals` (the handled ones; SIGCHLD is not a stop) is pending for the process.
bool stop_signal_pending(const std::vector<int>& signals);

// One of the agent's stop signals (LaunchConfig::signals_to_handle) arrived while a round was
// being formed: the session left the rendezvous (the others see this node leave) and the handler
// is shut down. The signal itself stays pending for the agent's signalfd.
class RendezvousInterrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RendezvousSession {
 public:
  // Returns whether the agent takes the event as the end of its attempt.
  using RoundOverCallback = std::function<bool(const rendezvous::RoundEvent&)>;

  // Nothing is contacted until start(). `config`, `loop` and `clock` must outlive the session.
  RendezvousSession(const LaunchConfig& config, std::string run_id, EventLoop& loop, Clock& clock,
                    RoundOverCallback on_round_over);
  ~RendezvousSession();  // shutdown()
  RendezvousSession(const RendezvousSession&) = delete;
  RendezvousSession& operator=(const RendezvousSession&) = delete;

  // Records joins, formed rounds and the end of rounds there (not owned; null: none).
  void set_event_log(EventLog* log) { events_ = log; }
  // Called on the agent's thread after each round formed, with how long forming it took.
  void set_on_round_formed(std::function<void(std::chrono::duration<double>)> callback) {
    on_round_formed_ = std::move(callback);
  }

  // Creates the handler (connects to the store, or hosts it) without joining a round, so that a
  // node can write to the job's store (job_store) before it joins. No-op when connected.
  void connect();
  // connect(), then forms the first round (both within join_timeout).
  void start();
  // Leaves the rendezvous on purpose in the middle of a round (an excluded node): the others see
  // this node leave and re-form without it (a planned leave, not counted against their quorum).
  // Then connects again as a new node, which joins with the next next_round(). Errors of the new
  // connection are logged; next_round() retries it.
  void step_out();
  // Whether this node hosts the job's store (step_out would stop it). No I/O.
  bool hosts_store() const;
  // The job's store without a round prefix; nullptr when not connected (or static).
  std::shared_ptr<store::Store> job_store();
  // Forms the next round (after a restart or a membership change) and this node's ranks.
  void next_round();
  // After the store was lost (dynamic backends): drops the handler and joins again with a new
  // one, retrying until join_timeout from now. Every new handler gets what is left of that one
  // window for connecting and its first round, so the whole rejoin ends within it. Returns false
  // (after printing why on stderr, naming the endpoint) when the store stays unreachable or the
  // job has finished meanwhile.
  // With c10d (and --rdzv-conf failover, the default), when the store itself is gone, the
  // survivors of the last round first move it to one of them (fail_over; the handler says where)
  // and form the next round there; `store_stopped`: the store said it stops on purpose, so it is
  // not waited for (nor is it when the round ended with the store's host leaving on purpose,
  // which the handler recognises: RendezvousHandler::store_host_left).
  bool rejoin(const std::string& why, bool store_stopped = false);

  // Ends the round on every node because this node's workers failed (multi-node only), or adds
  // this report to the round's when another node ended it first. `failed_at_ms`: when the local
  // root-cause worker exited (wall clock). Logs and swallows errors: the local restart decision
  // does not depend on it.
  void report_worker_failure(const std::string& detail, int64_t failed_at_ms);
  // After this node's workers of the round stopped (every stop of a multi-node group, once per
  // round): tells the others, and returns the round's failure reports of every node, waiting up
  // to `grace` for members still stopping (0: no wait). Empty on a single node or on a store
  // error (logged).
  std::vector<rendezvous::FailureReport> round_failures(std::chrono::milliseconds grace);
  // Closes the rendezvous for every node: the job is over (multi-node only; errors are logged).
  void close_job();
  // Waits until every node's workers succeeded, up to `timeout` (multi-node only). Throws the
  // store's errors.
  void exit_barrier(std::chrono::milliseconds timeout);
  // Writes this node's status record (agent/node_status.h) to the job's store: one set, bounded
  // by the store's timeout; errors are logged at debug level (status is best effort). Before
  // the first round (after connect()) it goes through job_store(). No-op when not connected.
  // Returns whether the store took it.
  bool publish_status(const std::string& record);
  // This node's id in the rendezvous (empty before start()).
  std::string node_id() const;

  // For the metrics (--metrics-port): samples the handler's num_nodes_waiting() every `interval`
  // on a thread of its own (a few store requests each), so the agent's loop never waits on the
  // store for it. Call once, after construction. `on_sample`, when given, runs on that thread
  // after each sample (the agent publishes its metrics from there while its own thread waits in
  // a rendezvous).
  void start_sampling(std::chrono::milliseconds interval,
                      std::function<void()> on_sample = nullptr);
  // The last sample: nodes waiting for the next round; -1 before the first sample or after a
  // failed one. Any thread.
  int nodes_waiting() const { return nodes_waiting_.load(); }
  // Asks the handler now (a few store requests, on the caller's thread); -1 when it cannot.
  int nodes_waiting_now();
  // The members of a round that formed after this node's last one, without it (a few store
  // requests); 0 when none did or it cannot tell.
  int nodes_gone_on_now();
  // Nodes waiting for the next round that are not members of this node's round (spares), read
  // now (one request per waiting node, at most 64); 0 when it cannot tell (also when this round
  // lists only some of its members).
  int newcomers_waiting_now();
  // Store traffic of every handler this session has had (counters keep counting across a
  // rejoin). No I/O.
  rendezvous::RendezvousHandler::StoreStats store_stats() const;
  // Leaves the rendezvous and stops the handler. Idempotent.
  void shutdown();

  const rendezvous::RendezvousInfo& info() const { return info_; }
  const Ranks& ranks() const { return ranks_; }
  // The event that ended the current attempt (set through the callback), if any.
  const std::optional<rendezvous::RoundEvent>& round_over() const { return round_over_; }
  // c10d or etcd: membership may change between rounds, and a lost store can be rejoined.
  bool dynamic() const { return dynamic_; }
  bool multi_node() const { return dynamic_ || info_.group_world_size > 1; }
  // "standalone" for --standalone, else the handler's backend name.
  std::string backend() const;
  const std::string& store_endpoint() const { return store_endpoint_; }
  // The rendezvous' join_timeout (--rdzv-conf join_timeout, else the backend's default).
  std::chrono::milliseconds join_timeout() const { return timeout_; }

 private:
  enum class FailoverOutcome { kNotNeeded, kJoined, kFailed };
  // The store of the last round is unreachable: asks the handler where it moved
  // (RendezvousHandler::recover_lost_store; c10d: to the first reachable member of that round,
  // hosted here when none of those before this node answers) and forms the next round at each
  // target in turn until one forms. kNotNeeded: the store still answers, no failover is possible,
  // or the backend keeps no store (the caller retries the store as before).
  FailoverOutcome fail_over(const std::string& why, bool store_stopped, Clock::TimePoint deadline);
  void create_handler();
  template <typename F>
  auto create_watched(F create);
  void drop_handler();
  void form_round();
  void on_event_fd();
  // Throws RendezvousInterrupted when a stop signal is pending for the process.
  void check_stop_signal();
  // rdzv_, copied under handler_mu_: for the sampler thread and the store reads that may run
  // while another thread drops the handler.
  std::shared_ptr<rendezvous::RendezvousHandler> current_handler() const;

  const LaunchConfig& config_;
  const std::string run_id_;
  EventLoop& loop_;
  Clock& clock_;
  RoundOverCallback on_round_over_;
  EventLog* events_ = nullptr;
  std::function<void(std::chrono::duration<double>)> on_round_formed_;

  // Written on the agent's thread under handler_mu_; the sampler copies it under handler_mu_.
  std::shared_ptr<rendezvous::RendezvousHandler> rdzv_;
  mutable std::mutex handler_mu_;
  rendezvous::RendezvousHandler::StoreStats retired_stats_;  // of dropped handlers; handler_mu_
  std::atomic<int> nodes_waiting_{-1};
  bool interrupted_ = false;  // a RendezvousInterrupted was thrown: the handler is shut down
  std::thread sampler_;
  std::mutex sampler_mu_;
  std::condition_variable sampler_cv_;
  bool sampler_stop_ = false;  // under sampler_mu_
  rendezvous::RendezvousInfo info_;
  std::string member_id_;  // this node's id in info_'s round
  Ranks ranks_;
  std::optional<rendezvous::RoundEvent> round_over_;
  bool dynamic_ = false;
  std::string store_endpoint_;
  // c10d: where the store is now (the configured endpoint, until a failover moves it).
  std::string current_endpoint_;
  // Where the next create_handler() connects after a failover, and whether it hosts; unset: from
  // the configuration.
  std::optional<rendezvous::StoreTarget> target_;
  std::chrono::milliseconds timeout_{std::chrono::seconds(300)};  // join_timeout
  // While rejoin() runs: the end of its window, which bounds each new handler's first round.
  std::optional<Clock::TimePoint> rejoin_deadline_;

  // The handler's callback thread stores the newest event and signals the eventfd.
  int evfd_ = -1;
  std::mutex ev_mu_;
  std::optional<rendezvous::RoundEvent> pending_event_;
};

}  // namespace trun::agent
