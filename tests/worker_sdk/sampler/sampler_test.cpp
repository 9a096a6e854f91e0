#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <set>

#include <trun/sampler.h>

using namespace trun::worker;

namespace {

// Runs `steps` steps (or to the end of the epoch when steps < 0) of every rank of a world,
// appending what each sample was seen, and returns the sampler state afterwards.
SamplerState run_world(uint64_t n, int world, size_t batch, SamplerOptions o,
                       const SamplerState* from, int steps, std::map<uint64_t, int>& seen) {
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back(n, r, world, o);
    if (from) ranks.back().load_state(*from);
  }
  for (int s = 0; steps < 0 || s < steps; ++s) {
    if (ranks[0].epoch_done()) break;
    size_t count = 0;
    for (int r = 0; r < world; ++r) {
      auto b = ranks[r].next_batch(batch);
      if (r == 0) count = b.size();
      REQUIRE(b.size() == count);  // every rank takes as many samples
      for (auto i : b) ++seen[i];
    }
    for (int r = 1; r < world; ++r) REQUIRE(ranks[r].offset() == ranks[0].offset());
  }
  return ranks[0].state();
}

}  // namespace

TEST_CASE("sampler: one epoch over every rank covers the dataset exactly once", "[sampler]") {
  for (int world : {1, 2, 3, 4, 7}) {
    std::map<uint64_t, int> seen;
    SamplerOptions o;
    o.tail = TailPolicy::kDrop;
    run_world(84, world, 5, o, nullptr, -1, seen);  // 84 = lcm(1..4, 7) / 1: no tail
    REQUIRE(seen.size() == 84);
    for (auto& [i, c] : seen) REQUIRE(c == 1);
  }
}

TEST_CASE("sampler: resume after a resize sees every sample of the epoch exactly once",
          "[sampler]") {
  // Save at world size 4 after a few steps, resume at 2 and at 3 (and 1, 5).
  const uint64_t n = 1000;
  for (TailPolicy tail : {TailPolicy::kPad, TailPolicy::kDrop}) {
    for (int resume_world : {1, 2, 3, 5}) {
      SamplerOptions o;
      o.seed = 42;
      o.tail = tail;
      std::map<uint64_t, int> seen;
      std::vector<DistributedSampler> four;
      SamplerState saved = run_world(n, 4, 7, o, nullptr, 9, seen);
      REQUIRE(saved.offset == 9u * 7 * 4);
      run_world(n, resume_world, 6, o, &saved, -1, seen);
      // Tail of what remained after the save: 1000 - 252 = 748 positions among resume_world.
      const uint64_t rest = n - saved.offset;
      const uint64_t extra = (resume_world - rest % resume_world) % resume_world;
      if (tail == TailPolicy::kDrop) {
        INFO("drop, resume at " << resume_world);
        size_t total = 0;
        for (auto& [i, c] : seen) {
          REQUIRE(c == 1);
          total += c;
        }
        REQUIRE(total == n - rest % resume_world);  // fewer than resume_world skipped
      } else {
        INFO("pad, resume at " << resume_world);
        REQUIRE(seen.size() == n);  // nothing skipped
        size_t twice = 0;
        for (auto& [i, c] : seen) {
          REQUIRE(c <= 2);
          twice += c == 2;
        }
        REQUIRE(twice == extra);  // only the padding repeats
      }
    }
  }
}

TEST_CASE("sampler: the order depends on seed and epoch, not on the world size", "[sampler]") {
  SamplerOptions o;
  o.seed = 9;
  DistributedSampler a(500, 0, 1, o), b(500, 1, 3, o);
  for (uint64_t pos = 0; pos < 500; ++pos) REQUIRE(a.index_at(pos) == b.index_at(pos));
  std::vector<uint64_t> e0, e1;
  for (uint64_t pos = 0; pos < 500; ++pos) e0.push_back(a.index_at(pos));
  a.set_epoch(1);
  for (uint64_t pos = 0; pos < 500; ++pos) e1.push_back(a.index_at(pos));
  REQUIRE(e0 != e1);
  auto s0 = e0;
  std::sort(s0.begin(), s0.end());
  for (uint64_t i = 0; i < 500; ++i) REQUIRE(s0[i] == i);  // a permutation
  SamplerOptions o2 = o;
  o2.seed = 10;
  DistributedSampler c(500, 0, 1, o2);
  std::vector<uint64_t> f0;
  for (uint64_t pos = 0; pos < 500; ++pos) f0.push_back(c.index_at(pos));
  REQUIRE(f0 != e0);
  SamplerOptions plain;
  plain.shuffle = false;
  DistributedSampler d(10, 1, 3, plain);
  REQUIRE(d.remaining_indices() == std::vector<uint64_t>{1, 4, 7, 0});  // padded with 0
}

TEST_CASE("sampler: pad gives every rank the same count, drop leaves the tail out", "[sampler]") {
  SamplerOptions pad, drop;
  pad.shuffle = drop.shuffle = false;
  drop.tail = TailPolicy::kDrop;
  for (int r = 0; r < 4; ++r) {
    REQUIRE(DistributedSampler(10, r, 4, pad).remaining_indices().size() == 3);
    REQUIRE(DistributedSampler(10, r, 4, drop).remaining_indices().size() == 2);
  }
  DistributedSampler s(10, 0, 4, pad);
  REQUIRE(s.next_batch(2).size() == 2);
  REQUIRE(s.next_batch(2).size() == 1);  // the short last batch
  REQUIRE(s.epoch_done());
  REQUIRE(s.next_batch(2).empty());
}

TEST_CASE("sampler: state round-trips through JSON and bad input is rejected", "[sampler]") {
  SamplerOptions o;
  o.seed = 5;
  o.tail = TailPolicy::kDrop;
  DistributedSampler s(100, 0, 2, o);
  s.set_epoch(3);
  s.next_batch(4);
  const SamplerState st = s.state();
  const SamplerState back = sampler_state_from_json(sampler_state_to_json(st));
  REQUIRE(back.epoch == 3);
  REQUIRE(back.offset == 8);
  REQUIRE(back.tail == TailPolicy::kDrop);
  DistributedSampler t(100, 1, 3, o);
  t.load_state(back);
  REQUIRE(t.offset() == 8);
  REQUIRE(t.epoch() == 3);

  REQUIRE_THROWS_WITH(DistributedSampler(0, 0, 1), Catch::Contains("dataset_size"));
  REQUIRE_THROWS_WITH(DistributedSampler(10, 2, 2), Catch::Contains("rank 2"));
  SamplerState other = st;
  other.dataset_size = 99;
  REQUIRE_THROWS_WITH(t.load_state(other), Catch::Contains("dataset_size"));
  other = st;
  other.seed = 6;
  REQUIRE_THROWS_WITH(t.load_state(other), Catch::Contains("seed"));
  REQUIRE_THROWS_WITH(sampler_state_from_json("{\"epoch\": -1}"), Catch::Contains("epoch"));
  REQUIRE_THROWS_WITH(sampler_state_from_json("nope"), Catch::Contains("not JSON"));
  REQUIRE_THROWS_WITH(
      sampler_state_from_json("{\"epoch\":0,\"offset\":0,\"dataset_size\":1,\"seed\":0,\"shuffle\":"
                              "true,\"tail\":\"wrap\"}"),
      Catch::Contains("tail"));
}
