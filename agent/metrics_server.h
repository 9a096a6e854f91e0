#pragma once
// MetricsServer: --metrics-port, an HTTP endpoint (Boost.Beast) serving the agent's state.
//
//   GET /metrics  Prometheus text format 0.0.4 (the metrics are listed in docs/observability.md)
//   GET /healthz  200 "ok: ..." while the agent's event loop is responsive and its group runs,
//                 starts, stops or re-forms; 503 with the reason otherwise (the event loop has
//                 not published for kStaleAfter, or the group failed for good)
//   anything else 404; other methods 405
//
// The agent never waits on a client: it publishes an AgentSnapshot (a copy, under a mutex held
// only for the copy) and the server answers from the latest one on its own thread. Each
// connection serves one request: its header may be at most kMaxRequestBytes, it must arrive
// within kRequestTimeout, and at most kMaxConnections are open at once (more are closed at
// accept). A request that is malformed, too large or too slow gets its connection closed;
// nothing of it reaches the agent.
//
// Thread safety: publish() from any thread; the server runs one thread of its own, started by
// start() (call it after the agent blocked its signals: the thread inherits the mask) and joined
// by the destructor.
// Errors: start() throws MetricsPortError (port in use, permission, ...) naming the port.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "agent/goodput.h"
#include "agent/straggler.h"

namespace trun::agent {

class MetricsPortError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What the endpoint reports: written by the agent's thread, read by the server from a copy.
struct AgentSnapshot {
  using TimePoint = std::chrono::steady_clock::time_point;
  // rendezvous, unhealthy, running, stopping, exit_barrier, succeeded, failed, signaled
  std::string phase = "rendezvous";
  TimePoint phase_since{};
  TimePoint heartbeat{};  // the last time the event loop (or a blocking step) published
  std::string run_id;
  std::string backend;
  int64_t round = -1;  // the current round, -1 before the first
  int group_rank = -1;
  int group_world_size = 0;
  int64_t rounds_total = 0;
  std::vector<double> round_seconds_buckets;   // upper bounds (the histogram's le)
  std::vector<uint64_t> round_seconds_counts;  // per bucket (not cumulative); last = +Inf
  double round_seconds_sum = 0;
  std::optional<TimePoint> last_round_at;
  int restarts = 0;
  int max_restarts = 0;
  // Failed workers replaced alone while the others kept running (resilient loops; each also
  // counted in `restarts`).
  uint64_t workers_replaced = 0;
  std::vector<std::string> worker_states;  // by local rank: running, succeeded, failed, stopped
  std::map<std::string, uint64_t> worker_exits;  // `exit_code="3"` or `signal="SIGKILL"` -> count
  std::string last_failure;                      // one line; empty when none
  uint64_t hangs = 0;                            // hung verdicts of this node (agent/hang_watch.h)
  bool healthy = true;                 // the last health gate check passed (agent/health_gate.h)
  uint64_t health_check_failures = 0;  // failed health gate checks so far
  // This node's ranks' step times and scores (agent/straggler.h); empty before they are measured.
  std::vector<straggler::RankStats> ranks;
  size_t slow_ranks = 0;   // ranks flagged slow now (on the judging node)
  int nodes_waiting = -1;  // sampled off the loop (RendezvousSession::nodes_waiting); -1: unknown
  uint64_t store_requests = 0;                    // the rendezvous' requests to its store (or etcd)
  uint64_t store_errors = 0;                      // of those, the failed ones
  std::optional<uint64_t> store_requests_served;  // when this node hosts the store
  // The goodput account (agent/goodput.h), copied: /metrics computes its totals at the request's
  // time (the interval under way counts up to then, also while the agent blocks in a rendezvous).
  goodput::Account goodput{0};
};

class MetricsServer {
 public:
  static constexpr size_t kMaxRequestBytes = 8192;
  static constexpr std::chrono::seconds kRequestTimeout{5};
  static constexpr int kMaxConnections = 32;
  // /healthz answers 503 when the running agent has not published for this long.
  static constexpr std::chrono::seconds kStaleAfter{10};

  // Listens on 0.0.0.0:`port` (0: a free port; see port()).
  static std::unique_ptr<MetricsServer> start(uint16_t port);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  uint16_t port() const { return port_; }
  void publish(const AgentSnapshot& snapshot);

  // The responses, for tests and the server thread: (status, content type, body).
  struct Response {
    int status = 200;
    std::string content_type;
    std::string body;
  };
  static Response metrics(const AgentSnapshot& s, AgentSnapshot::TimePoint now);
  static Response healthz(const AgentSnapshot& s, AgentSnapshot::TimePoint now);

  struct Impl;

 private:
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  std::thread thread_;
};

}  // namespace trun::agent
