// The hang rules (agent/hang_rules.h) on fake snapshots: the timeout rule's classes, warm-up,
// learning and overrides; the wavefront verdict's culprit and its one-line summary.

#include <catch2/catch.hpp>

#include "agent/hang_rules.h"

using namespace trun::agent::hang;
using trun::base::progress::Op;

namespace {

constexpr int64_t kSec = 1000000000;
constexpr int64_t kNow = 100000 * kSec;
constexpr uint32_t kF32 = 1;  // float32 on the board
constexpr uint32_t kI64 = 6;  // int64

// A rank in the training loop, last progress `idle_s` before kNow.
RankProgress rank(int r, double idle_s, const std::string& node = "n0") {
  RankProgress p;
  p.rank = r;
  p.local_rank = r;
  p.pid = 4700 + r;
  p.node = node;
  p.attached = true;
  p.heartbeat = 100;
  p.last_progress_ns = kNow - static_cast<int64_t>(idle_s * 1e9);
  p.phase = Phase::kRunning;
  p.starting = false;
  p.process = ProcessState::kRunning;
  return p;
}

// Adds group `number` (key = number + 100) in which `r` issued up to `issued` and finished up to
// `completed`, every collective an allreduce of float32 x `count` unless `last_op` changes the
// last one.
void in_group(RankProgress& r, int number, uint64_t issued, uint64_t completed, int size,
              uint64_t count = 1024, Op last_op = Op::kAllreduce, uint32_t last_dtype = kF32,
              uint64_t last_count = 0) {
  GroupProgress g;
  g.key = static_cast<uint64_t>(number) + 100;
  g.number = number;
  g.group_rank = r.rank;
  g.group_size = size;
  g.issued = issued;
  g.completed = completed;
  for (uint64_t s = issued > 16 ? issued - 15 : 1; s <= issued; ++s) {
    CollectiveRecord c;
    c.seq = s;
    c.op = s == issued ? last_op : Op::kAllreduce;
    c.dtype = s == issued ? last_dtype : kF32;
    c.count = s == issued && last_count ? last_count : count;
    c.state = s <= completed ? State::kCompleted : State::kStarted;
    g.recent.push_back(c);
  }
  r.groups.push_back(g);
}

// A rule whose step class is past its warm-up with a 10 s timeout (floor).
TimeoutRule warm_rule(TimeoutOptions o = {}) {
  TimeoutRule rule(o);
  for (int i = 0; i < 10; ++i) rule.observe(TimeoutClass{}, 0.1);
  return rule;
}

}  // namespace

TEST_CASE("hang rules: format_ranks writes single ranks, runs and the last separator", "[hang]") {
  CHECK(format_ranks({3}) == "rank 3");
  CHECK(format_ranks({0, 1}) == "ranks 0-1");
  CHECK(format_ranks({0, 2}) == "ranks 0 and 2");
  CHECK(format_ranks({7, 0, 1, 2, 4, 5, 6}) == "ranks 0-2 and 4-7");
  CHECK(format_ranks({0, 2, 5, 6, 7}) == "ranks 0, 2 and 5-7");
  CHECK(format_ranks({1, 1, 2}) == "ranks 1-2");
}

TEST_CASE("timeout rule: the step class waits out its warm-up, then uses the floor", "[hang]") {
  TimeoutRule rule;
  const TimeoutClass step;
  CHECK(*rule.timeout_s(step) == Approx(1800));
  for (int i = 0; i < 4; ++i) rule.observe(step, 0.2);
  CHECK(*rule.timeout_s(step) == Approx(1800));
  rule.observe(step, 0.2);
  CHECK(rule.learned(step).intervals == 5);
  CHECK(*rule.timeout_s(step) == Approx(10));  // max(10, 3 x 0) after the warm-up
  rule.observe(step, 0.5);
  CHECK(*rule.timeout_s(step) == Approx(10));
}

TEST_CASE("timeout rule: factor times the longest interval when that beats the floor", "[hang]") {
  TimeoutRule rule;
  const TimeoutClass step;
  for (int i = 0; i < 5; ++i) rule.observe(step, 1);
  rule.observe(step, 4);
  rule.observe(step, 2);
  CHECK(rule.learned(step).longest_s == Approx(4));
  CHECK(*rule.timeout_s(step) == Approx(12));
}

TEST_CASE("timeout rule: a long first step in the warm-up is not learned from", "[hang]") {
  TimeoutRule rule;
  const TimeoutClass step;
  rule.observe(step, 240);  // a model load of four minutes
  for (int i = 0; i < 20; ++i) rule.observe(step, 0.5);
  CHECK(rule.learned(step).longest_s == Approx(0.5));
  CHECK(*rule.timeout_s(step) == Approx(10));
}

TEST_CASE("timeout rule: classes learn apart (sections by name, checkpoint, startup)", "[hang]") {
  TimeoutRule rule;
  TimeoutClass eval{TimeoutClass::kSection, "eval"};
  TimeoutClass data{TimeoutClass::kSection, "data"};
  TimeoutClass ckpt{TimeoutClass::kCheckpoint, ""};
  TimeoutClass startup{TimeoutClass::kStartup, ""};
  for (int i = 0; i < 3; ++i) rule.observe(eval, 1);
  for (int i = 0; i < 4; ++i) rule.observe(eval, 30);
  CHECK(*rule.timeout_s(eval) == Approx(90));
  CHECK(*rule.timeout_s(data) == Approx(1800));  // still warming up
  CHECK(*rule.timeout_s(TimeoutClass{}) == Approx(1800));
  for (int i = 0; i < 2; ++i) rule.observe(ckpt, 5);
  rule.observe(ckpt, 50);
  CHECK(*rule.timeout_s(ckpt) == Approx(150));  // max(120 floor, 3 x 50)
  rule.observe(startup, 5000);
  CHECK(*rule.timeout_s(startup) == Approx(1800));  // fixed
  CHECK(eval.name() == "section eval");
  CHECK(ckpt.name() == "checkpoint");
}

TEST_CASE("timeout rule: every default can be overridden or turned off", "[hang]") {
  TimeoutOptions o;
  o.step.floor_s = 2;
  o.step.factor = 5;
  o.step.warmup_intervals = 1;
  o.sections["eval"] = ClassPolicy{0, 0, 0, 0, 42, true};
  o.checkpoint.enabled = false;
  TimeoutRule rule(o);
  rule.observe(TimeoutClass{}, 9);  // warm-up
  rule.observe(TimeoutClass{}, 1);
  CHECK(*rule.timeout_s(TimeoutClass{}) == Approx(5));
  CHECK(*rule.timeout_s(TimeoutClass{TimeoutClass::kSection, "eval"}) == Approx(42));
  CHECK_FALSE(rule.timeout_s(TimeoutClass{TimeoutClass::kCheckpoint, ""}).has_value());
  o.enabled = false;
  TimeoutRule off(o);
  CHECK_FALSE(off.timeout_s(TimeoutClass{}).has_value());
  CHECK_FALSE(off.timeout_s(TimeoutClass{TimeoutClass::kStartup, ""}).has_value());
}

TEST_CASE("timeout rule: negative and NaN intervals are ignored", "[hang]") {
  TimeoutRule rule;
  rule.observe(TimeoutClass{}, -1);
  rule.observe(TimeoutClass{}, std::nan(""));
  CHECK(rule.learned(TimeoutClass{}).intervals == 0);
}

TEST_CASE("timeout rule: class_of reads start-up, checkpoint, section and step", "[hang]") {
  RankProgress r = rank(0, 0);
  CHECK(class_of(r).kind == TimeoutClass::kStep);
  r.phase = Phase::kStopCheck;
  CHECK(class_of(r).kind == TimeoutClass::kStep);
  r.phase = Phase::kCheckpointSave;
  CHECK(class_of(r).kind == TimeoutClass::kCheckpoint);
  r.phase = Phase::kSection;
  r.section = "eval";
  CHECK(class_of(r) == (TimeoutClass{TimeoutClass::kSection, "eval"}));
  r.starting = true;
  CHECK(class_of(r).kind == TimeoutClass::kStartup);
}

TEST_CASE("timeout rule: update() learns intervals from successive snapshots per class", "[hang]") {
  TimeoutRule rule;
  RankProgress r = rank(0, 0);
  r.last_progress_ns = 10 * kSec;
  rule.update({r});  // the first sight: nothing to learn
  CHECK(rule.learned(TimeoutClass{}).intervals == 0);
  for (int i = 1; i <= 6; ++i) {
    r.heartbeat += 3;
    r.last_progress_ns += i == 6 ? 7 * kSec : kSec / 2;
    rule.update({r});
  }
  CHECK(rule.learned(TimeoutClass{}).intervals == 6);
  CHECK(rule.learned(TimeoutClass{}).longest_s == Approx(7));
  CHECK(*rule.timeout_s(TimeoutClass{}) == Approx(21));
  // Unchanged heartbeat: no interval. A new pid (a restarted worker): starts afresh.
  rule.update({r});
  CHECK(rule.learned(TimeoutClass{}).intervals == 6);
  r.pid += 1000;
  r.heartbeat = 1;
  r.last_progress_ns += 100 * kSec;
  rule.update({r});
  CHECK(rule.learned(TimeoutClass{}).intervals == 6);
  // The interval counts in the class the rank was in when it began.
  r.phase = Phase::kSection;
  r.section = "eval";
  rule.update({r});
  r.heartbeat += 1;
  r.last_progress_ns += 4 * kSec;
  r.phase = Phase::kRunning;
  rule.update({r});
  CHECK(rule.learned(TimeoutClass{TimeoutClass::kSection, "eval"}).intervals == 1);
}

TEST_CASE("verdict: the rank that never issued the collective the others wait in", "[hang]") {
  std::vector<RankProgress> ranks;
  for (int r = 0; r < 8; ++r) {
    ranks.push_back(rank(r, r == 3 ? 12.4 : 12.0, r < 4 ? "n0" : "n1"));
    if (r == 3)
      in_group(ranks.back(), 0, 5821, 5821, 8);
    else
      in_group(ranks.back(), 0, 5822, 5821, 8);
  }
  ranks[3].node = "n1";
  ranks[3].pid = 4711;
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.kind == Verdict::kNeverIssued);
  REQUIRE(v.culprits == std::vector<int>{3});
  CHECK(v.waiting == std::vector<int>{0, 1, 2, 4, 5, 6, 7});
  CHECK(v.group == 0);
  CHECK(v.seq == 5822);
  CHECK(v.summary ==
        "rank 3 (node n1, pid 4711) made no progress for 12.4 s: it never issued allreduce #5822 "
        "of group 0, which ranks 0-2 and 4-7 wait in");
}

TEST_CASE("verdict: the waiters' own timeouts do not matter, only the culprit's", "[hang]") {
  // Rank 1 evaluates in a section (timed by its own class, still in warm-up: 30 min) while rank 0
  // waits 60 s in a barrier for it: not a hang.
  std::vector<RankProgress> ranks = {rank(0, 60), rank(1, 60)};
  in_group(ranks[0], 0, 10, 9, 2);
  in_group(ranks[1], 0, 9, 9, 2);
  ranks[1].phase = Phase::kSection;
  ranks[1].section = "eval";
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK_FALSE(v.hung);
  CHECK(v.kind == Verdict::kNeverIssued);
  CHECK(v.culprits == std::vector<int>{1});
  CHECK(v.summary.find("; it is in section \"eval\"") != std::string::npos);
  // Past its class's timeout it is.
  TimeoutOptions o;
  o.sections["eval"] = ClassPolicy{0, 0, 0, 0, 30, true};
  CHECK(judge(ranks, warm_rule(o), kNow).hung);
}

TEST_CASE("verdict: not hung while the culprit is within its timeout", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 9), rank(1, 9)};
  in_group(ranks[0], 0, 10, 9, 2);
  in_group(ranks[1], 0, 9, 9, 2);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK_FALSE(v.hung);
  CHECK(v.culprits == std::vector<int>{1});
  ranks[1].last_progress_ns = kNow - 11 * kSec;
  CHECK(judge(ranks, warm_rule(), kNow).hung);
}

TEST_CASE("verdict: a rank several collectives behind is still the culprit", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 20), rank(1, 20), rank(2, 25)};
  in_group(ranks[0], 0, 40, 39, 3);
  in_group(ranks[1], 0, 40, 39, 3);
  in_group(ranks[2], 0, 37, 37, 3);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.culprits == std::vector<int>{2});
  CHECK(v.seq == 38);
  CHECK(v.summary.find("it never issued allreduce #38 of group 0, which ranks 0-1 wait in") !=
        std::string::npos);
}

TEST_CASE("verdict: the culprit behind a chain of groups is the one waiting for nobody", "[hang]") {
  // Rank 0 waits in group 0 for rank 1; rank 1 waits in group 1 for rank 2, which never issued.
  std::vector<RankProgress> ranks = {rank(0, 30), rank(1, 30), rank(2, 30)};
  in_group(ranks[0], 0, 8, 7, 2);
  in_group(ranks[1], 0, 7, 7, 2);
  in_group(ranks[1], 1, 3, 2, 2);
  in_group(ranks[2], 1, 2, 2, 2);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.culprits == std::vector<int>{2});
  CHECK(v.group == 1);
  CHECK(v.summary ==
        "rank 2 (node n0, pid 4702) made no progress for 30.0 s: it never issued allreduce #3 of "
        "group 1, which rank 1 waits in");
}

TEST_CASE("verdict: a cycle of waits names its members", "[hang]") {
  // Rank 0 waits in group 0 for rank 1 while rank 1 waits in group 1 for rank 0: a deadlock.
  std::vector<RankProgress> ranks = {rank(0, 30), rank(1, 30)};
  in_group(ranks[0], 0, 5, 4, 2);
  in_group(ranks[0], 1, 2, 2, 2);
  in_group(ranks[1], 0, 4, 4, 2);
  in_group(ranks[1], 1, 3, 2, 2);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.kind == Verdict::kNeverIssued);
  CHECK(v.culprits == std::vector<int>{0, 1});
}

TEST_CASE("verdict: a mismatched op names both sides", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 15), rank(1, 15), rank(2, 15), rank(3, 15)};
  for (int r = 0; r < 4; ++r)
    in_group(ranks[r], 0, 17, 16, 4, 1024, r == 2 ? Op::kBroadcast : Op::kAllreduce, kF32,
             r == 2 ? 10 : 0);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.kind == Verdict::kMismatch);
  CHECK(v.culprits == std::vector<int>{2});
  CHECK(v.waiting == std::vector<int>{0, 1, 3});
  CHECK(v.summary ==
        "rank 2 (node n0, pid 4702) made no progress for 15.0 s: it issued broadcast #17 of group "
        "0 (float32 x 10) where ranks 0-1 and 3 issued allreduce #17 (float32 x 1024)");
}

TEST_CASE("verdict: a mismatched dtype or count, and a tie of two", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 15), rank(1, 15)};
  in_group(ranks[0], 0, 3, 2, 2, 8);
  in_group(ranks[1], 0, 3, 2, 2, 8, Op::kAllreduce, kI64);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.kind == Verdict::kMismatch);
  CHECK(v.culprits == std::vector<int>{1});  // the tie goes to the side of the lowest rank
  CHECK(v.summary.find("allreduce #3 of group 0 (int64 x 8) where rank 0 issued allreduce #3 "
                       "(float32 x 8)") != std::string::npos);
  ranks = {rank(0, 15), rank(1, 15), rank(2, 15)};
  in_group(ranks[0], 0, 3, 2, 3, 8, Op::kAllreduce, kF32, 16);
  in_group(ranks[1], 0, 3, 2, 3, 8);
  in_group(ranks[2], 0, 3, 2, 3, 8);
  v = judge(ranks, warm_rule(), kNow);
  CHECK(v.culprits == std::vector<int>{0});
  CHECK(v.summary.find("(float32 x 16) where ranks 1-2 issued allreduce #3 (float32 x 8)") !=
        std::string::npos);
}

TEST_CASE("verdict: all_to_all_v counts differ by design and are no mismatch", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 15), rank(1, 15)};
  in_group(ranks[0], 0, 3, 2, 2, 8, Op::kAllToAllV, kF32, 5);
  in_group(ranks[1], 0, 3, 2, 2, 8, Op::kAllToAllV, kF32, 9);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.kind == Verdict::kAllWaiting);
  CHECK(v.hung);
}

TEST_CASE("verdict: a stopped rank inside the collective is the culprit", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 12), rank(1, 12.5), rank(2, 12)};
  for (auto& r : ranks) in_group(r, 0, 9, 8, 3);
  ranks[1].process = ProcessState::kStopped;
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.kind == Verdict::kStopped);
  CHECK(v.culprits == std::vector<int>{1});
  CHECK(v.summary ==
        "rank 1 (node n0, pid 4701) made no progress for 12.5 s: it is stopped (SIGSTOP or a "
        "debugger) in allreduce #9 of group 0, which ranks 0 and 2 wait in");
}

TEST_CASE("verdict: everyone in the same collective and nobody behind", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 12), rank(1, 11)};
  for (auto& r : ranks) in_group(r, 0, 9, 8, 2);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.kind == Verdict::kAllWaiting);
  CHECK(v.culprits.empty());
  CHECK(v.summary ==
        "ranks 0-1 made no progress for 11.0 s: they wait in allreduce #9 of group 0, which every "
        "rank issued: no rank is behind");
  ranks[1].last_progress_ns = kNow - 5 * kSec;
  CHECK_FALSE(judge(ranks, warm_rule(), kNow).hung);
}

TEST_CASE("verdict: waiting for members on another node", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 12), rank(1, 12)};
  for (auto& r : ranks) in_group(r, 0, 9, 8, 4);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.kind == Verdict::kAllWaiting);
  CHECK(v.summary.find("for the group's other 2 ranks (not in these snapshots)") !=
        std::string::npos);
}

TEST_CASE("verdict: a rank spinning outside any collective with nobody waiting", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 3), rank(1, 14)};
  in_group(ranks[0], 0, 9, 9, 2);
  in_group(ranks[1], 0, 9, 9, 2);
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.kind == Verdict::kOutsideCollective);
  CHECK(v.culprits == std::vector<int>{1});
  CHECK(v.summary ==
        "rank 1 (node n0, pid 4701) made no progress for 14.0 s in the training loop, outside any "
        "collective");
}

TEST_CASE("verdict: start-up and checkpoint saves have their own generous classes", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 600)};
  ranks[0].starting = true;
  ranks[0].phase = Phase::kInit;
  CHECK_FALSE(judge(ranks, warm_rule(), kNow).hung);
  ranks[0].last_progress_ns = kNow - 1900 * kSec;
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.hung);
  CHECK(v.summary.find("while starting up") != std::string::npos);
  ranks = {rank(0, 100)};
  ranks[0].phase = Phase::kCheckpointSave;
  CHECK_FALSE(judge(ranks, warm_rule(), kNow).hung);
}

TEST_CASE("verdict: moving and unattached ranks are never culprits", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 50), rank(1, 50)};
  ranks[0].moving = true;
  ranks[1].attached = false;
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK_FALSE(v.hung);
  CHECK(v.kind == Verdict::kNone);
  CHECK(judge({}, warm_rule(), kNow).kind == Verdict::kNone);
}

TEST_CASE("verdict: a stopped culprit outside the collective says so", "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 12), rank(1, 12)};
  in_group(ranks[0], 0, 4, 3, 2);
  in_group(ranks[1], 0, 3, 3, 2);
  ranks[1].process = ProcessState::kStopped;
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.summary.find("it never issued allreduce #4 of group 0, which rank 0 waits in; it is "
                       "stopped (SIGSTOP or a debugger)") != std::string::npos);
}

TEST_CASE(
    "verdict: a group without a number is named by its key, a ring that lost the entry "
    "by its kind",
    "[hang]") {
  std::vector<RankProgress> ranks = {rank(0, 12), rank(1, 12)};
  in_group(ranks[0], 0, 4, 3, 2);
  in_group(ranks[1], 0, 3, 3, 2);
  for (auto& r : ranks) r.groups[0].number = -1;
  ranks[0].groups[0].recent.clear();
  Verdict v = judge(ranks, warm_rule(), kNow);
  CHECK(v.summary.find("it never issued collective #4 of group 0000000000000064") !=
        std::string::npos);
}

TEST_CASE("verdict: a first step that takes minutes (a model load) is no hang", "[hang]") {
  // init() returned, the first step has run for 4 minutes: the step class is still warming up.
  std::vector<RankProgress> ranks = {rank(0, 240), rank(1, 240)};
  in_group(ranks[0], 0, 1, 1, 2);
  in_group(ranks[1], 0, 1, 1, 2);
  TimeoutRule fresh;
  Verdict v = judge(ranks, fresh, kNow);
  CHECK_FALSE(v.hung);
  CHECK(v.kind == Verdict::kOutsideCollective);
  // The same idle time after the warm-up (10 s timeout) is one.
  CHECK(judge(ranks, warm_rule(), kNow).hung);
}
