// SplitMix64 (Steele, Lea and Flood 2014; the constants of Vigna's reference code): trun's one
// pseudo-random generator where the numbers must be the same everywhere. Tiny, fast and fully
// specified, unlike std::shuffle and the standard distributions, whose output differs between
// standard libraries. The sampler's permutations and PowerSGD's initial matrices come from it (and
// examples/train_mlp, which may include only <trun/...>, carries the same generator), so its
// sequence must never change.
//
// Not thread-safe (one state per user); header-only, no allocation.
#pragma once

#include <cstdint>

namespace trun::base {

// Advances `state` and returns the next value.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct SplitMix64 {
  uint64_t state;

  uint64_t next() { return splitmix64(state); }

  // Uniform in [0, bound) without modulo bias (Lemire's method with rejection). bound > 0.
  uint64_t below(uint64_t bound) {
    for (;;) {  // each turn is rejected with probability < bound / 2^64
      unsigned __int128 m = static_cast<unsigned __int128>(next()) * bound;
      uint64_t low = static_cast<uint64_t>(m);
      if (low >= bound || low >= (-bound) % bound) return static_cast<uint64_t>(m >> 64);
    }
  }
};

}  // namespace trun::base
