// base/splitmix64.h: the sequence is fixed forever (sampler permutations, PowerSGD's initial
// matrices and the example MLP's weights come from it).
#include "base/splitmix64.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

using trun::base::splitmix64;
using trun::base::SplitMix64;

TEST_CASE("splitmix64: the reference sequence (Vigna's splitmix64.c, seed 1234567)",
          "[splitmix64]") {
  uint64_t state = 1234567;
  const std::vector<uint64_t> expected = {6457827717110365317ull, 3203168211198807973ull,
                                          9817491932198370423ull, 4593380528125082431ull,
                                          16408922859458223821ull};
  std::vector<uint64_t> got;
  for (size_t i = 0; i < expected.size(); ++i) got.push_back(splitmix64(state));
  CHECK(got == expected);
  // The struct is the same generator.
  SplitMix64 g{1234567};
  CHECK(g.next() == expected[0]);
  CHECK(g.state == 1234567 + 0x9E3779B97F4A7C15ull);
}

TEST_CASE("splitmix64: below() is uniform without modulo bias and its draws are fixed",
          "[splitmix64]") {
  SplitMix64 g{0};
  std::vector<uint64_t> first;
  for (int i = 0; i < 8; ++i) first.push_back(g.below(10));
  CHECK(first == std::vector<uint64_t>{8, 4, 0, 9, 1, 3, 1, 7});
  CHECK(g.state == 17418742259747381416ull);  // no draw was rejected
  // Every value of a small range comes up about equally often, and none outside it.
  int counts[7] = {};
  for (int i = 0; i < 70000; ++i) {
    const uint64_t v = g.below(7);
    REQUIRE(v < 7);
    ++counts[v];
  }
  for (int c : counts) CHECK((c > 9500 && c < 10500));
  CHECK(g.below(1) == 0);
  // The largest bound: a rejection region of 2^63 - 1 values, still bounded in practice.
  const uint64_t big = (uint64_t{1} << 63) + 1;
  for (int i = 0; i < 100; ++i) CHECK(g.below(big) < big);
}
