#pragma once
// The agent's decisions as pure functions: what happens after an event, given the state.
// The executor (elastic_agent.cpp) performs them. Header-only; no side effects.

#include "rendezvous/handler.h"

namespace trun::agent {

// Exit codes of trun itself (docs/exit-codes.md).
constexpr int kExitSuccess = 0;
constexpr int kExitWorkersFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitAgentError = 3;
constexpr int kExitSignalBase = 128;

enum class GroupPhase { kRunning, kStopping };

// Why a worker group stopped.
// kRoundOver: the rendezvous round ended (a node joined or left, a worker failed on another node,
// the job was closed, the store was lost); the agent decides from the RoundEvent.
enum class GroupOutcome { kSucceeded, kFailed, kSignaled, kRoundOver };

// What the agent does when one worker exits while the group is running.
enum class ExitAction { kKeepRunning, kStopGroupFailed, kGroupSucceeded };

inline ExitAction on_worker_exit(GroupPhase phase, int exitcode, int workers_still_running) {
  if (phase != GroupPhase::kRunning) return ExitAction::kKeepRunning;  // we asked it to stop
  if (exitcode != 0) return ExitAction::kStopGroupFailed;
  return workers_still_running == 0 ? ExitAction::kGroupSucceeded : ExitAction::kKeepRunning;
}

struct AfterStop {
  bool restart = false;
  int exit_code = kExitSuccess;  // when not restarting
};

// After the whole group is gone: restart it, or finish with trun's exit code.
inline AfterStop decide_after_stop(GroupOutcome outcome, int signal, int restart_count,
                                   int max_restarts) {
  switch (outcome) {
    case GroupOutcome::kSignaled:
      return {false, kExitSignalBase + signal};
    case GroupOutcome::kSucceeded:
      return {false, kExitSuccess};
    case GroupOutcome::kFailed:
      if (restart_count < max_restarts) return {true, 0};
      return {false, kExitWorkersFailed};
    case GroupOutcome::kRoundOver:
      break;  // decided by the agent from the round event
  }
  return {false, kExitAgentError};
}

// What the agent does after the rendezvous round ended its attempt (GroupOutcome::kRoundOver),
// once its own workers are gone.
enum class RoundAction {
  kRejoin,          // the store was lost and the backend is dynamic: join again, new handler
  kStoreLost,       // the store was lost and nothing can replace it (static): exit 3
  kJobClosed,       // another node closed the job: exit 1
  kNoRestartsLeft,  // a worker failed on another node and no restarts are left: close, exit 1
  kRestart,         // a worker failed on another node: the next round, counted as a restart
  kReform,          // the membership changed: the next round, not counted
};

inline RoundAction decide_after_round(rendezvous::RoundEvent::Kind kind, bool dynamic,
                                      int restart_count, int max_restarts) {
  using Kind = rendezvous::RoundEvent::Kind;
  switch (kind) {
    case Kind::kStoreLost:
      return dynamic ? RoundAction::kRejoin : RoundAction::kStoreLost;
    case Kind::kClosed:
      return RoundAction::kJobClosed;
    case Kind::kWorkerFailed:
      return restart_count < max_restarts ? RoundAction::kRestart : RoundAction::kNoRestartsLeft;
    default:  // joined, left, restart asked, our membership lost
      return RoundAction::kReform;
  }
}

}  // namespace trun::agent
