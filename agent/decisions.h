#pragma once
// The agent's decisions as pure functions: what happens after an event, given the state.
// The executor (elastic_agent.cpp) performs them. Header-only; no side effects.

#include <string>
#include <vector>

#include "rendezvous/handler.h"

namespace trun::agent {

// Exit codes of trun itself (docs/exit-codes.md).
constexpr int kExitSuccess = 0;
constexpr int kExitWorkersFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitAgentError = 3;
// The same failure --crash-loop-limit attempts in a row without progress (CrashLoop).
constexpr int kExitCrashLoop = 4;
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

// Whether the failed workers of a running group are replaced alone, in place, while the others
// keep running (a resilient loop: docs/launcher.md, "Resilient loops: replacing one worker"), or
// the group stops as after any failure. The facts are the agent's, read when the failure is seen.
struct InPlaceFacts {
  bool board = false;     // the progress board exists (hang detection on, not Python)
  bool stopping = false;  // a signal to trun, or a stop of the group, came first
  // Every local worker still runs or is one of the failed ones (none exited 0 before).
  bool all_present = false;
  // Every local worker's record, the failed ones' included (what the dead process declared),
  // says it runs a resilient loop, with the pid trun spawned for that local rank.
  bool all_resilient = false;
  int group_world_size = 1;  // nodes in the round
  // A dynamic rendezvous (c10d, etcd): the other nodes of the round follow a replacement through
  // the round's store (agent/reform_watch.h). A static one's nodes cannot.
  bool dynamic = false;
  int restart_count = 0;
  int max_restarts = 0;
};

enum class InPlace {
  kReplace,         // replace the failed workers alone, counted as a restart
  kNoBoard,         // no progress board: nothing says the workers run resilient loops
  kStopping,        // the group stops anyway
  kWorkerExited,    // a worker already exited: the group cannot re-form whole
  kNotResilient,    // some local worker runs no resilient loop (or not as the pid trun spawned)
  kMultiNode,       // the round has other nodes of a static rendezvous: they cannot follow
  kNoRestartsLeft,  // --max-restarts is used up: the job fails as after any failure
};

inline InPlace decide_in_place(const InPlaceFacts& f) {
  if (!f.board) return InPlace::kNoBoard;
  if (f.stopping) return InPlace::kStopping;
  if (!f.all_present) return InPlace::kWorkerExited;
  if (!f.all_resilient) return InPlace::kNotResilient;
  if (f.group_world_size != 1 && !f.dynamic) return InPlace::kMultiNode;
  if (f.restart_count >= f.max_restarts) return InPlace::kNoRestartsLeft;
  return InPlace::kReplace;
}

// Why a failure is not handled in place, in a few words (kReplace: "replaced in place").
inline const char* in_place_reason(InPlace d) {
  switch (d) {
    case InPlace::kReplace:
      return "replaced in place";
    case InPlace::kNoBoard:
      return "no progress board";
    case InPlace::kStopping:
      return "the group is stopping";
    case InPlace::kWorkerExited:
      return "a worker of the group has exited";
    case InPlace::kNotResilient:
      return "not every local worker runs a resilient loop";
    case InPlace::kMultiNode:
      return "the job spans several nodes of a static rendezvous";
    case InPlace::kNoRestartsLeft:
      return "no restarts are left";
  }
  return "?";
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

// The crash-loop guard (docs/health.md): failed attempts in a row that made no progress and
// failed the same way. `signature` names the failure (failure_signature: "exit code 1",
// "SIGSEGV"); an attempt that made progress, or failed another way, starts the count again.
struct CrashLoop {
  int streak = 0;
  std::string signature;  // of the streak's failures

  void record_failure(bool progress, const std::string& failure) {
    if (progress) {
      streak = 0;
      signature.clear();
    } else if (streak > 0 && failure == signature) {
      ++streak;
    } else {
      streak = 1;
      signature = failure;
    }
  }
  // Whether the guard stops the job instead of the restart that would follow (limit 0: never).
  bool reached(int limit) const { return limit > 0 && streak >= limit; }
};

// Node exclusion (docs/health.md): a node whose own workers failed `after` times within `window_s`
// sits out the next rounds for a cooldown that doubles on each exclusion, up to `cap_s`.
struct ExclusionPolicy {
  int after = 3;  // 0: never exclude
  double window_s = 600;
  double cooldown_s = 60;
  double cap_s = 3600;
};

struct Exclusion {
  std::vector<double> failures;  // when this node's workers failed (any monotonic seconds)
  int times = 0;                 // exclusions so far

  // Records a failure at `now_s`; true when the node should sit out now. The failures stay
  // counted (within the window), so a node that fails again right after it rejoins is excluded
  // again at once, for twice as long.
  bool record_failure(const ExclusionPolicy& p, double now_s) {
    if (p.after <= 0) return false;
    failures.push_back(now_s);
    size_t keep = 0;
    for (double t : failures) {
      if (now_s - t <= p.window_s) failures[keep++] = t;
    }
    failures.resize(keep);
    return static_cast<int>(failures.size()) >= p.after;
  }
  // The cooldown of the next exclusion (call once per exclusion: it counts it).
  double next_cooldown(const ExclusionPolicy& p) {
    double c = p.cooldown_s;
    for (int i = 0; i < times && c < p.cap_s; ++i) c *= 2;
    ++times;
    return c < p.cap_s ? c : p.cap_s;
  }
};

// What a failure line (failure_line: "rank R (local_rank L) on HOST exited with CODE: message")
// says about how the worker ended: "exited with CODE"; the whole line when it says nothing of it.
// Rank, host, pid and message are left out, so that the same crash on another rank or node, or
// with another pid in its message, is the same failure.
inline std::string failure_signature(const std::string& line) {
  const std::string mark = "exited with ";
  const size_t at = line.find(mark);
  if (at == std::string::npos) return line;
  size_t end = line.find_first_of(": ", at + mark.size());
  if (end == std::string::npos) end = line.size();
  return line.substr(at, end - at);
}

}  // namespace trun::agent
