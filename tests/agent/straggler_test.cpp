// agent/straggler.h: the Tracker's measurements from board snapshots, the scores, the judge.
#include <catch2/catch.hpp>
#include <vector>

#include "agent/straggler.h"

using namespace trun::agent;
using namespace trun::agent::straggler;

namespace {

hang::RankProgress rank_at(int rank, uint64_t steps, double collective_s) {
  hang::RankProgress p;
  p.rank = rank;
  p.local_rank = rank;
  p.pid = 1000 + rank;
  p.node = "n";
  p.attached = true;
  p.steps = steps;
  p.collective_ns = static_cast<int64_t>(collective_s * 1e9);
  return p;
}

RankStats measured(int rank, double compute_s, double step_s = 1) {
  RankStats r;
  r.rank = rank;
  r.step_s = step_s;
  r.compute_s = compute_s;
  return r;
}

}  // namespace

TEST_CASE("the tracker measures step time and time outside collectives per rank", "[straggler]") {
  Tracker t;  // 10 s measure interval, a sample per second
  // 4 ranks, 10 steps per second; ranks 0, 1 and 3 wait 40 ms per step in collectives, rank 2
  // (the slow one) 5 ms.
  for (int s = 0; s <= 12; ++s) {
    std::vector<hang::RankProgress> ranks;
    for (int r = 0; r < 4; ++r) {
      const double wait_per_step = r == 2 ? 0.005 : 0.040;
      ranks.push_back(rank_at(r, 10u * s, 10 * s * wait_per_step));
    }
    t.observe(ranks, int64_t{s} * 1000000000);
  }
  auto stats = t.stats();
  REQUIRE(stats.size() == 4);
  for (const auto& r : stats) {
    CHECK(r.step_s == Approx(0.1));
    CHECK(r.compute_s == Approx(r.rank == 2 ? 0.095 : 0.060));
    CHECK(r.self_score == Approx(1));
  }
  score(stats);
  CHECK(stats[2].slower == Approx(0.095 / 0.060 - 1));
  CHECK(stats[2].score == Approx(1 / (0.095 / 0.060)));
  CHECK(stats[0].slower == Approx(0.060 / 0.060 - 1).margin(1e-9));
  CHECK(slowest(stats, 0.2) == size_t{2});
  CHECK_FALSE(slowest(stats, 0.7));
}

TEST_CASE("the tracker needs half an interval and a step, and a new worker starts over",
          "[straggler]") {
  Tracker t;
  t.observe({rank_at(0, 0, 0)}, 0);
  t.observe({rank_at(0, 40, 0)}, 4'000'000'000);
  CHECK(t.stats()[0].step_s == 0);  // 4 s < 5 s
  t.observe({rank_at(0, 60, 0)}, 6'000'000'000);
  CHECK(t.stats()[0].step_s == Approx(0.1));
  auto restarted = rank_at(0, 0, 0);
  restarted.pid = 4242;
  t.observe({restarted}, 7'000'000'000);
  CHECK(t.stats()[0].step_s == 0);
  CHECK(t.stats()[0].steps == 0);
  // Steps that stop (a hung or stopped rank): no step in the interval, nothing measured.
  for (int s = 8; s < 20; ++s) t.observe({restarted}, int64_t{s} * 1000000000);
  CHECK(t.stats()[0].step_s == 0);
}

TEST_CASE("scores compare each rank with the median of the others", "[straggler]") {
  std::vector<RankStats> two{measured(0, 1.0), measured(1, 1.3)};
  score(two);
  CHECK(two[1].slower == Approx(0.3));  // against the other rank, not the mean of both
  CHECK(two[0].slower == Approx(1.0 / 1.3 - 1));
  CHECK(two[0].score == 1);
  std::vector<RankStats> one{measured(0, 5.0)};
  score(one);
  CHECK(one[0].slower == 0);  // nothing to compare with
  std::vector<RankStats> some{measured(0, 1.0), measured(1, 2.0), RankStats{}};
  some[2].rank = 2;  // not measured yet: neither scored nor a reference
  score(some);
  CHECK(some[1].slower == Approx(1.0));
  CHECK(some[2].slower == 0);
  // An outlier among many does not move the reference.
  std::vector<RankStats> many;
  for (int r = 0; r < 7; ++r) many.push_back(measured(r, 1.0 + 0.01 * r));
  many.push_back(measured(7, 0.2));  // a rank that computes much less (its slower is negative)
  score(many);
  CHECK(many[7].slower < 0);
  for (int r = 0; r < 7; ++r) CHECK(many[r].slower < 0.05);
}

TEST_CASE("the judge flags a rank slower for the whole window, once, and says when it recovers",
          "[straggler]") {
  Options o;
  o.threshold = 0.2;
  o.window_s = 30;
  Judge j(o);
  auto at = [&](double slower_of_1, double now) {
    std::vector<RankStats> s{measured(0, 1.0), measured(1, 1.0 + slower_of_1)};
    score(s);
    return j.update(s, now);
  };
  CHECK(at(0.3, 0).empty());
  CHECK(at(0.3, 20).empty());
  CHECK(at(0.1, 25).empty());  // dips under: the window starts again
  CHECK(at(0.3, 30).empty());
  CHECK(at(0.3, 55).empty());
  auto flagged = at(0.3, 60);
  REQUIRE(flagged.size() == 1);
  CHECK(flagged[0].kind == Judge::Change::kFlagged);
  CHECK(flagged[0].rank.rank == 1);
  CHECK(flagged[0].slow_for_s == Approx(30));
  CHECK(j.flagged() == std::vector<int>{1});
  CHECK(at(0.4, 90).empty());  // once
  auto back = at(0.05, 95);
  REQUIRE(back.size() == 1);
  CHECK(back[0].kind == Judge::Change::kRecovered);
  CHECK(j.flagged().empty());
  CHECK(describe(flagged[0].rank, 1.0).find("rank 1 (local_rank -1) on  is 30% slower") == 0);
}
