// agent/decisions.h: what the agent does after a worker exit, a stop, or the end of a round.
#include <catch2/catch.hpp>

#include "agent/decisions.h"

using namespace trun::agent;

TEST_CASE("a failing worker stops a running group, exits during a stop change nothing",
          "[decisions]") {
  CHECK(on_worker_exit(GroupPhase::kRunning, 1, 3) == ExitAction::kStopGroupFailed);
  CHECK(on_worker_exit(GroupPhase::kRunning, -9, 3) == ExitAction::kStopGroupFailed);
  CHECK(on_worker_exit(GroupPhase::kRunning, 0, 2) == ExitAction::kKeepRunning);
  CHECK(on_worker_exit(GroupPhase::kRunning, 0, 0) == ExitAction::kGroupSucceeded);
  CHECK(on_worker_exit(GroupPhase::kStopping, 1, 2) == ExitAction::kKeepRunning);
}

TEST_CASE("after a stop: restart while restarts remain, else the right exit code", "[decisions]") {
  CHECK(decide_after_stop(GroupOutcome::kFailed, 0, 0, 2).restart);
  CHECK(decide_after_stop(GroupOutcome::kFailed, 0, 1, 2).restart);
  auto last = decide_after_stop(GroupOutcome::kFailed, 0, 2, 2);
  CHECK_FALSE(last.restart);
  CHECK(last.exit_code == 1);
  CHECK_FALSE(decide_after_stop(GroupOutcome::kFailed, 0, 0, 0).restart);
  auto sig = decide_after_stop(GroupOutcome::kSignaled, 15, 0, 5);
  CHECK_FALSE(sig.restart);
  CHECK(sig.exit_code == 143);
  CHECK(decide_after_stop(GroupOutcome::kSucceeded, 0, 0, 5).exit_code == 0);
}

TEST_CASE("after the end of a round: rejoin, give up, restart counted or not", "[decisions]") {
  using Kind = trun::rendezvous::RoundEvent::Kind;
  CHECK(decide_after_round(Kind::kStoreLost, true, 0, 3) == RoundAction::kRejoin);
  CHECK(decide_after_round(Kind::kStoreLost, false, 0, 3) == RoundAction::kStoreLost);
  CHECK(decide_after_round(Kind::kClosed, true, 0, 3) == RoundAction::kJobClosed);
  // A failure elsewhere costs a restart like a local one.
  CHECK(decide_after_round(Kind::kWorkerFailed, true, 2, 3) == RoundAction::kRestart);
  CHECK(decide_after_round(Kind::kWorkerFailed, true, 3, 3) == RoundAction::kNoRestartsLeft);
  CHECK(decide_after_round(Kind::kWorkerFailed, true, 0, 0) == RoundAction::kNoRestartsLeft);
  // Membership changes never do, even with no restarts left.
  for (Kind k : {Kind::kNodeJoined, Kind::kNodeLeft, Kind::kRestart, Kind::kMembershipLost}) {
    CHECK(decide_after_round(k, true, 3, 3) == RoundAction::kReform);
  }
}

TEST_CASE("the crash-loop guard counts the same failure without progress, in a row",
          "[decisions][crash_loop]") {
  CHECK(failure_signature("rank 3 (local_rank 1) on node-a exited with 1: Traceback ...") ==
        "exited with 1");
  CHECK(failure_signature("rank 0 (local_rank 0) on b exited with SIGKILL") ==
        "exited with SIGKILL");
  CHECK(failure_signature("worker failure on node-a") == "worker failure on node-a");
  CrashLoop g;
  g.record_failure(false, "exited with 1");
  g.record_failure(false, "exited with 1");
  CHECK(g.streak == 2);
  CHECK_FALSE(g.reached(3));
  g.record_failure(false, "exited with 1");
  CHECK(g.reached(3));
  CHECK_FALSE(g.reached(0));  // off
  // Another failure starts a new streak; progress ends it.
  g.record_failure(false, "exited with SIGSEGV");
  CHECK(g.streak == 1);
  CHECK(g.signature == "exited with SIGSEGV");
  g.record_failure(true, "exited with SIGSEGV");
  CHECK(g.streak == 0);
  CHECK(g.signature.empty());
  g.record_failure(false, "exited with 1");
  CHECK(g.streak == 1);
}

TEST_CASE("a node is excluded after K failures in the window, for a cooldown that doubles",
          "[decisions][exclusion]") {
  ExclusionPolicy p;
  p.after = 3;
  p.window_s = 100;
  p.cooldown_s = 60;
  p.cap_s = 200;
  Exclusion e;
  CHECK_FALSE(e.record_failure(p, 0));
  CHECK_FALSE(e.record_failure(p, 50));
  CHECK_FALSE(e.record_failure(p, 120));  // the first fell out of the window
  CHECK(e.record_failure(p, 130));
  CHECK(e.next_cooldown(p) == 60);
  // Failing again at once after the cooldown: excluded again, twice as long, then capped.
  CHECK(e.record_failure(p, 200));
  CHECK(e.next_cooldown(p) == 120);
  CHECK(e.record_failure(p, 210));
  CHECK(e.next_cooldown(p) == 200);
  CHECK(e.next_cooldown(p) == 200);
  ExclusionPolicy never = p;
  never.after = 0;
  Exclusion n;
  for (int i = 0; i < 10; ++i) CHECK_FALSE(n.record_failure(never, i));
}

TEST_CASE("a failed worker is replaced in place only when every condition holds",
          "[decisions][resilient]") {
  InPlaceFacts ok;
  ok.board = true;
  ok.all_present = true;
  ok.all_resilient = true;
  ok.group_world_size = 1;
  ok.restart_count = 1;
  ok.max_restarts = 3;
  CHECK(decide_in_place(ok) == InPlace::kReplace);
  auto with = [&](auto change) {
    InPlaceFacts f = ok;
    change(f);
    return decide_in_place(f);
  };
  CHECK(with([](InPlaceFacts& f) { f.board = false; }) == InPlace::kNoBoard);
  CHECK(with([](InPlaceFacts& f) { f.stopping = true; }) == InPlace::kStopping);
  CHECK(with([](InPlaceFacts& f) { f.all_present = false; }) == InPlace::kWorkerExited);
  CHECK(with([](InPlaceFacts& f) { f.all_resilient = false; }) == InPlace::kNotResilient);
  CHECK(with([](InPlaceFacts& f) { f.group_world_size = 2; }) == InPlace::kMultiNode);
  // The other nodes of a dynamic round follow through the round's store.
  CHECK(with([](InPlaceFacts& f) {
          f.group_world_size = 2;
          f.dynamic = true;
        }) == InPlace::kReplace);
  CHECK(with([](InPlaceFacts& f) {
          f.group_world_size = 2;
          f.dynamic = true;
          f.restart_count = 3;
        }) == InPlace::kNoRestartsLeft);
  CHECK(with([](InPlaceFacts& f) { f.restart_count = 3; }) == InPlace::kNoRestartsLeft);
  CHECK(with([](InPlaceFacts& f) {
          f.max_restarts = 0;
          f.restart_count = 0;
        }) == InPlace::kNoRestartsLeft);
  // A job of several nodes whose workers run no resilient loop says nothing about nodes.
  CHECK(with([](InPlaceFacts& f) {
          f.group_world_size = 2;
          f.all_resilient = false;
        }) == InPlace::kNotResilient);
  for (InPlace d :
       {InPlace::kReplace, InPlace::kNoBoard, InPlace::kStopping, InPlace::kWorkerExited,
        InPlace::kNotResilient, InPlace::kMultiNode, InPlace::kNoRestartsLeft}) {
    CHECK(std::string(in_place_reason(d)) != "?");
  }
}
