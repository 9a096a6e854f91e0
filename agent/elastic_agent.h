#pragma once
// ElasticAgent: runs one job on this node from rendezvous to the end.
//
//   rendezvous -> start the worker group -> supervise -> on a failure: stop the group and
//   restart it (up to max_restarts) or fail; on success: exit barrier and done; on a signal:
//   forward it, stop the group, exit 128+signal. A second SIGINT or SIGTERM during that stop
//   sends SIGKILL to the worker groups at once instead of waiting for the shutdown timeout.
//
// Everything happens on the calling thread in one event loop (agent/event_loop.h): worker exits
// arrive as SIGCHLD through a signalfd, never by polling. The agent is a child subreaper and
// reaps orphaned grandchildren, so it is correct as PID 1 in a container.
//
// Call run() from the main thread before starting any other thread: it blocks the signals it
// handles (for the whole process) so that only its signalfd sees them.
// Output: the failure summary goes to stderr; trun's own log lines go through spdlog. Neither
// blocks on a console that does not read (agent/console.h, set up by main).

//
// Seams (STYLE 8): the agent reads the time from a Clock (agent/clock.h) and starts, signals and
// reaps workers only through a ProcessSpawner (agent/process_spawner.h). The one-argument
// constructor uses the real ones (steady_clock(), ProcessSupervisor); tests hand in fakes.
//
// Its parts: the rendezvous and worker ranks (agent/rendezvous_session.h, rank_assignment.h),
// the worker environment (agent/worker_env.h), every decision (agent/decisions.h), worker output
// (agent/log_mux.h) and failure reports (agent/failure_report.h); what operators see of it: the
// event log (agent/event_log.h, --event-log) and the metrics endpoint (agent/metrics_server.h,
// --metrics-port), which the agent feeds from its own thread without waiting on either.

#include "agent/clock.h"
#include "agent/launch_config.h"
#include "agent/process_spawner.h"

namespace trun::agent {

class ElasticAgent {
 public:
  explicit ElasticAgent(const LaunchConfig& config) : config_(config) {}
  // With a fake clock and spawner (not owned; they must outlive run()). The rendezvous, the event
  // loop, the signalfd and the log files stay real.
  ElasticAgent(const LaunchConfig& config, Clock& clock, ProcessSpawner& spawner)
      : config_(config), clock_(&clock), spawner_(&spawner) {}
  // Runs the job; returns trun's exit code (agent/decisions.h, docs/exit-codes.md).
  int run();

 private:
  const LaunchConfig& config_;
  Clock* clock_ = nullptr;
  ProcessSpawner* spawner_ = nullptr;
};

}  // namespace trun::agent
