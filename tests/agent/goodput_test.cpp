// agent/goodput.h: the account's split of a node's time into productive time and badput causes,
// from a scripted sequence of phases and board samples (times in seconds).
#include <catch2/catch.hpp>

#include "agent/goodput.h"

using namespace trun::agent::goodput;

namespace {

Progress board(uint64_t steps, double first, double last, std::optional<uint64_t> resumed = {},
               double load = 0) {
  Progress p;
  p.attached = true;
  p.steps = steps;
  p.first_step = first;
  p.last_step = last;
  p.resumed_step = resumed;
  p.load_seconds = load;
  return p;
}

double sum(const Totals& t) {
  double s = t.productive;
  for (double b : t.badput) s += b;
  return s;
}

}  // namespace

TEST_CASE("goodput: one group without faults is start-up then productive", "[goodput]") {
  Account a(100);
  a.set_phase(Phase::kRunning, 101);  // rendezvous 1 s: start-up
  // First step ends at 102 (a start of 1 s), then one step every 0.1 s up to step 11 at 103.
  a.progress(board(1, 102, 102, 0), 102);
  a.progress(board(6, 102, 102.5, 0), 102.5);
  a.progress(board(11, 102, 103, 0), 103);
  const Totals t = a.totals(103);
  CHECK(t.wall == Approx(3));
  CHECK(t.of(Cause::kStartup) == Approx(2));  // 100..101 rendezvous, 101..102 the first step
  CHECK(t.step_seconds == Approx(0.1));
  CHECK(t.productive == Approx(1.0));  // 10 steps x 0.1 s
  CHECK(t.of(Cause::kSlow) == Approx(0).margin(1e-9));
  CHECK(t.ratio() == Approx(1.0 / 3));
  CHECK(sum(t) == Approx(t.wall));
}

TEST_CASE(
    "goodput: a failure splits into detection, stopping, rendezvous, restart, load and "
    "redone",
    "[goodput]") {
  Account a(0);
  a.set_phase(Phase::kRunning, 0);
  a.progress(board(1, 1, 1, 0), 1);
  a.progress(board(101, 1, 11, 0), 11);  // 100 steps of 0.1 s; reached step 101
  a.set_phase(Phase::kStopping, 11.5);   // detection 0.5 s after the last step
  a.set_phase(Phase::kRendezvous, 12);   // stopping 0.5 s
  a.set_phase(Phase::kRunning, 13);      // rendezvous 1 s
  // Resumed from step 90 (11 steps redone), the load took 0.3 s, the first step ended at 14.
  a.progress(board(0, 0, 0, 90, 0.3), 13.5);
  a.progress(board(1, 14, 14, 90, 0.3), 14);
  a.progress(board(21, 14, 16, 90, 0.3), 16);
  const Totals t = a.totals(16);
  CHECK(t.wall == Approx(16));
  CHECK(sum(t) == Approx(16));
  CHECK(t.of(Cause::kStartup) == Approx(1));
  CHECK(t.of(Cause::kDetection) == Approx(0.5));
  CHECK(t.of(Cause::kStopping) == Approx(0.5));
  CHECK(t.of(Cause::kRendezvous) == Approx(1));
  CHECK(t.of(Cause::kRestart) == Approx(0.7));
  CHECK(t.of(Cause::kCheckpointLoad) == Approx(0.3));
  CHECK(t.steps_redone == 11);
  CHECK(t.of(Cause::kRedone) == Approx(1.1));
  CHECK(t.productive == Approx((100 + 20 - 11) * 0.1));
  CHECK(t.of(Cause::kSlow) == Approx(0).margin(1e-9));
  // The intervals closed so far, for the event log.
  const auto iv = a.take_intervals();
  REQUIRE(iv.size() == 4);  // the second group's are still open
  CHECK(iv[0].cause == Cause::kStartup);
  CHECK(iv[1].cause == Cause::kDetection);
  CHECK(iv[1].begin == Approx(11));
  CHECK(iv[1].end == Approx(11.5));
  CHECK(iv[2].cause == Cause::kStopping);
  CHECK(iv[3].cause == Cause::kRendezvous);
  CHECK(a.take_intervals().empty());
}

TEST_CASE("goodput: a slow stretch is slow time, measured against the median step", "[goodput]") {
  Account a(0);
  a.set_phase(Phase::kRunning, 0);
  a.progress(board(1, 0.1, 0.1, 0), 0.1);
  double last = 0.1;
  uint64_t steps = 1;
  for (int i = 0; i < 20; ++i) {  // 20 samples of 10 steps at 0.1 s
    steps += 10;
    last += 1.0;
    a.progress(board(steps, 0.1, last, 0), last);
  }
  for (int i = 0; i < 5; ++i) {  // 5 samples of 10 steps at 0.2 s
    steps += 10;
    last += 2.0;
    a.progress(board(steps, 0.1, last, 0), last);
  }
  const Totals t = a.totals(last);
  CHECK(t.step_seconds == Approx(0.1));
  CHECK(t.of(Cause::kSlow) == Approx(5.0));
  CHECK(t.productive == Approx(25.0));
  CHECK(sum(t) == Approx(t.wall));
}

TEST_CASE("goodput: a spare's wait before it joins is outside the job, not start-up", "[goodput]") {
  Account a(0);
  a.set_phase(Phase::kRunning, 30, /*joined_late=*/true);
  a.progress(board(1, 31, 31, 40), 31);
  a.progress(board(11, 31, 32, 40), 32);
  const Totals t = a.totals(32);
  CHECK(t.outside == Approx(30));
  CHECK(t.of(Cause::kStartup) == Approx(0));
  CHECK(t.of(Cause::kRestart) == Approx(1));
  CHECK(t.wall == Approx(2));
  CHECK(t.steps_redone == 0);
}

TEST_CASE(
    "goodput: unhealthy or excluded time is outside, and a program without a board is "
    "productive while it runs",
    "[goodput]") {
  Account a(0);
  a.set_phase(Phase::kOutside, 1);  // rendezvous 1 s before: still before the first group
  a.set_phase(Phase::kRendezvous, 5);
  a.set_phase(Phase::kRunning, 6);
  a.set_phase(Phase::kStopping, 16);
  a.set_phase(Phase::kOther, 17);
  const Totals t = a.totals(18);
  CHECK(t.outside == Approx(4));
  CHECK(t.of(Cause::kStartup) == Approx(2));
  CHECK(t.productive == Approx(10));
  CHECK(t.of(Cause::kStopping) == Approx(1));
  CHECK(t.of(Cause::kOther) == Approx(1));
  CHECK(t.wall == Approx(14));
}

TEST_CASE("goodput: once a program wrote the board, a group that never does is restart time",
          "[goodput]") {
  Account a(0);
  a.set_phase(Phase::kRunning, 0);
  a.progress(board(1, 1, 1, 0), 1);
  a.progress(board(11, 1, 2, 0), 2);
  a.set_phase(Phase::kStopping, 2);
  a.set_phase(Phase::kRunning, 3);  // crashes at start: nothing on the board
  a.set_phase(Phase::kStopping, 4);
  const Totals t = a.totals(4);
  CHECK(t.of(Cause::kRestart) == Approx(1));
  CHECK(t.productive == Approx(1));
  CHECK(sum(t) == Approx(t.wall));
}

TEST_CASE(
    "goodput: a worker replaced alone costs detection and restart time, and no step is "
    "redone",
    "[goodput][resilient]") {
  Account a(0);
  a.set_phase(Phase::kRunning, 0);
  a.progress(board(1, 1, 1, 0), 1);
  a.progress(board(101, 1, 11, 0), 11);   // 100 steps of 0.1 s
  a.replaced(11.5);                       // a worker died 0.5 s after the last step
  CHECK(a.take_intervals().size() == 2);  // start-up, detection
  // From here the replacement's record: not attached yet, then attached with a "fresh start"
  // resume (it got its state from a live peer: no step is lost), then its first step at 13.
  a.progress(Progress{}, 12);
  a.progress(board(0, 0, 0, 0), 12.5);
  a.progress(board(1, 13, 13, 0), 13);
  a.progress(board(21, 13, 15, 0), 15);
  const Totals t = a.totals(15);
  CHECK(t.wall == Approx(15));
  CHECK(sum(t) == Approx(15));
  CHECK(t.of(Cause::kStartup) == Approx(1));
  CHECK(t.of(Cause::kDetection) == Approx(0.5));
  CHECK(t.of(Cause::kRestart) == Approx(1.5));  // the failure to the replacement's first step
  CHECK(t.of(Cause::kStopping) == Approx(0));
  CHECK(t.steps_redone == 0);
  CHECK(t.steps == 122);
  CHECK(t.productive == Approx(12));
  a.set_phase(Phase::kStopping, 15.5);
  const auto iv = a.take_intervals();
  REQUIRE(iv.size() == 2);
  CHECK(iv[0].cause == Cause::kRestart);
  CHECK(iv[0].begin == Approx(11.5));
  CHECK(iv[0].end == Approx(13));
  CHECK(iv[1].cause == Cause::kDetection);
}

TEST_CASE(
    "goodput: a group re-formed without a replacement here costs detection, the round and "
    "restart time, and its steps count once",
    "[goodput][resilient]") {
  Account a(0);
  a.set_phase(Phase::kRunning, 0);
  a.progress(board(1, 1, 1, 0), 1);
  a.progress(board(101, 1, 11, 0), 11);  // 100 steps of 0.1 s
  SECTION("a node left: the ranks waited from their last step, then for the round") {
    a.progress(board(101, 1, 11, 0), 12.5);
    a.reformed(12.5, 11.5);  // the round began at 11.5 and formed at 12.5
    auto iv = a.take_intervals();
    REQUIRE(iv.size() == 3);
    CHECK(iv[1].cause == Cause::kDetection);
    CHECK(iv[1].end - iv[1].begin == Approx(0.5));
    CHECK(iv[2].cause == Cause::kRendezvous);
    CHECK(iv[2].end - iv[2].begin == Approx(1));
    // The records keep their counts: no step since, then the first at 13, 20 more by 15.
    a.progress(board(101, 1, 11, 0), 12.8);
    a.progress(board(102, 1, 13, 0), 13);
    a.progress(board(122, 1, 15, 0), 15);
    const Totals t = a.totals(15);
    CHECK(t.wall == Approx(15));
    CHECK(sum(t) == Approx(15));
    CHECK(t.of(Cause::kStartup) == Approx(1));
    CHECK(t.of(Cause::kDetection) == Approx(0.5));
    CHECK(t.of(Cause::kRendezvous) == Approx(1));
    CHECK(t.of(Cause::kRestart) == Approx(0.5));
    CHECK(t.of(Cause::kSlow) == Approx(0).margin(1e-9));
    CHECK(t.steps == 122);
    CHECK(t.steps_redone == 0);
    CHECK(t.productive == Approx(12));
  }
  SECTION("a node joined: the ranks stepped on while the round formed") {
    a.progress(board(103, 1, 11.2, 0), 11.3);
    a.reformed(11.3, 10.5);  // the round began before their last steps
    // First seen 20 steps later: the first of them is put 19 reference steps before the last.
    a.progress(board(123, 1, 14, 0), 14);
    const Totals t = a.totals(14);
    CHECK(sum(t) == Approx(14));
    CHECK(t.of(Cause::kDetection) == Approx(0).margin(1e-9));
    CHECK(t.of(Cause::kRendezvous) == Approx(0.1));
    CHECK(t.of(Cause::kRestart) == Approx(0.8));
    CHECK(t.of(Cause::kSlow) == Approx(0).margin(1e-9));
    CHECK(t.steps == 123);
    CHECK(t.productive == Approx(12.1));
  }
  SECTION("a worker was replaced on another node: no round, detection to the re-formation") {
    a.progress(board(101, 1, 11, 0), 11.4);
    a.reformed(11.4);
    a.progress(board(102, 1, 11.6, 0), 11.6);
    a.reformed(11.7);  // another replacement while the first step after the last one
    a.progress(board(103, 1, 12, 0), 12);
    a.progress(board(113, 1, 13, 0), 13);
    const Totals t = a.totals(13);
    CHECK(sum(t) == Approx(13));
    CHECK(t.of(Cause::kDetection) == Approx(0.4 + 0.1));
    CHECK(t.of(Cause::kRendezvous) == Approx(0).margin(1e-9));
    CHECK(t.of(Cause::kRestart) == Approx(0.2 + 0.3));
    CHECK(t.steps == 113);
  }
}
