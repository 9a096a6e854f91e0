// The reduction kernels and the float16/bfloat16 conversions, against known bit patterns.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "worker_sdk/src/reduce.h"

using namespace trun::worker;
using namespace trun::worker::detail;

TEST_CASE("float16 conversion round-trips known values", "[worker_sdk][reduce]") {
  CHECK(float_to_half(0.0f) == 0x0000);
  CHECK(float_to_half(-0.0f) == 0x8000);
  CHECK(float_to_half(1.0f) == 0x3c00);
  CHECK(float_to_half(-2.0f) == 0xc000);
  CHECK(float_to_half(65504.0f) == 0x7bff);                          // largest finite
  CHECK(float_to_half(65520.0f) == 0x7c00);                          // rounds to inf
  CHECK(float_to_half(std::ldexp(1.0f, -24)) == 0x0001);             // smallest subnormal
  CHECK(float_to_half(std::ldexp(1.0f, -25)) == 0x0000);             // tie to even: zero
  CHECK(float_to_half(std::ldexp(3.0f, -25)) == 0x0002);             // tie to even: 2
  CHECK(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);      // tie to even (down)
  CHECK(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // tie to even (up)
  CHECK((float_to_half(std::numeric_limits<float>::quiet_NaN()) & 0x7fff) > 0x7c00);
  CHECK(half_to_float(0x3555) == Approx(0.333251953125f).epsilon(0));
  CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(half_to_float(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(std::isinf(half_to_float(0xfc00)));
  // Every half value through float and back: itself, a NaN made quiet (payload kept).
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    REQUIRE(float_to_half(half_to_float(static_cast<uint16_t>(h))) == (nan ? h | 0x200 : h));
  }
}

namespace {

float float_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

TEST_CASE("float16 conversion at the rounding edges", "[worker_sdk][reduce]") {
  // Overflow: 65520 is the midpoint between 65504 and 65536 (inf), a tie that goes to even (inf).
  CHECK(float_to_half(float_bits(0x477fefff)) == 0x7bff);  // just below 65520
  CHECK(float_to_half(65520.0f) == 0x7c00);
  CHECK(float_to_half(-65520.0f) == 0xfc00);
  CHECK(float_to_half(1e30f) == 0x7c00);
  CHECK(float_to_half(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(float_to_half(std::numeric_limits<float>::max()) == 0x7c00);
  // Subnormal results: 2^-24 is the step; below 2^-25 all is zero; 2^-14 the smallest normal.
  CHECK(float_to_half(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(float_to_half(-std::ldexp(1.0f, -25)) == 0x8000);
  CHECK(float_to_half(std::ldexp(1.0f, -26)) == 0x0000);
  CHECK(float_to_half(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(float_to_half(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(float_to_half(std::ldexp(1.0f, -14)) == 0x0400);
  CHECK(float_to_half(std::ldexp(2047.0f, -25)) == 0x0400);  // 1023.5 steps: tie, up to even
  CHECK(float_to_half(std::ldexp(2045.0f, -25)) == 0x03fe);  // 1022.5 steps: tie, down to even
  CHECK(half_to_float(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(bits(half_to_float(0x8000)) == 0x80000000u);
  // NaN: quiet, sign and the payload's top bits kept (F16C's VCVTPS2PH and VCVTPH2PS).
  CHECK(float_to_half(float_bits(0x7f802000)) == 0x7e01);
  CHECK(float_to_half(float_bits(0x7f800001)) == 0x7e00);  // signaling, payload below: quiet NaN
  CHECK(float_to_half(float_bits(0xffc00000)) == 0xfe00);
  CHECK(float_to_half(float_bits(0x7fffffff)) == 0x7fff);
  CHECK(bits(half_to_float(0x7c01)) == 0x7fc02000u);
  CHECK(bits(half_to_float(0xfe00)) == 0xffc00000u);
}

TEST_CASE("bfloat16 conversion at the rounding edges", "[worker_sdk][reduce]") {
  CHECK(float_to_bfloat16(std::numeric_limits<float>::max()) == 0x7f80);  // rounds to inf
  CHECK(float_to_bfloat16(float_bits(0x7f7f7fff)) == 0x7f7f);
  CHECK(float_to_bfloat16(float_bits(0x7f7f8000)) == 0x7f80);  // tie, to even: inf
  CHECK(float_to_bfloat16(float_bits(0x7f7e8000)) == 0x7f7e);  // tie, to even: down
  CHECK(float_to_bfloat16(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(float_to_bfloat16(-0.0f) == 0x8000);
  CHECK(float_to_bfloat16(float_bits(0x00018000)) == 0x0002);  // subnormal tie, up to even
  CHECK(float_to_bfloat16(float_bits(0x00008000)) == 0x0000);  // subnormal tie, down to even
  CHECK(float_to_bfloat16(float_bits(0x807fffff)) == 0x8080);  // subnormal rounds to -2^-126
  // NaN: quiet, sign and top payload bits kept; never rounded into inf or a sign change.
  CHECK(float_to_bfloat16(float_bits(0x7f800001)) == 0x7fc0);
  CHECK(float_to_bfloat16(float_bits(0x7fffffff)) == 0x7fff);
  CHECK(float_to_bfloat16(float_bits(0xff810000)) == 0xffc1);
}

namespace {

// The float bit patterns around every 16-bit value's rounding boundaries (for float16 steps of
// 2^13 float ulps, bfloat16 2^16; a subnormal float16 step is a multiple of that): each value
// and the pattern after it, its tie, one below and above the tie, the last
// pattern before the next value. Then `random` random patterns (a fixed seed).
std::vector<float> rounding_edges(bool bf16, size_t random) {
  const unsigned shift = bf16 ? 16 : 13;
  const uint32_t step = 1u << shift, tie = step / 2;
  std::vector<float> out;
  for (uint64_t k = 0; k <= (0xffffffffull >> shift); ++k) {
    const uint32_t base = static_cast<uint32_t>(k << shift);
    for (uint32_t d : {0u, 1u, tie - 1, tie, tie + 1, step - 1})
      out.push_back(float_bits(base + d));
  }
  uint32_t x = 0x9e3779b9u;  // xorshift32
  for (size_t i = 0; i < random; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    out.push_back(float_bits(x));
  }
  return out;
}

std::vector<Simd> vector_paths() {
  std::vector<Simd> out;
  if (best_simd() >= Simd::kAvx2) out.push_back(Simd::kAvx2);
  if (best_simd() >= Simd::kAvx512) out.push_back(Simd::kAvx512);
  if (out.empty()) WARN("this CPU has neither AVX2+F16C nor AVX-512: only the scalar path runs");
  return out;
}

const char* simd_name(Simd s) {
  return s == Simd::kAvx512 ? "avx512" : s == Simd::kAvx2 ? "avx2" : "scalar";
}

}  // namespace

TEST_CASE("the vector float16 and bfloat16 conversions give the scalar bits",
          "[worker_sdk][reduce]") {
  for (DataType wire : {DataType::kFloat16, DataType::kBFloat16}) {
    const bool bf16 = wire == DataType::kBFloat16;
    std::vector<float> in = rounding_edges(bf16, 1 << 20);
    // Odd lengths and an unaligned start: the vector loops' tails run too.
    in.push_back(0.5f);
    const size_t n = in.size() - 1;
    for (int divisor : {1, 2, 3, 7}) {
      std::vector<uint16_t> want(n);
      float_to_16bit(want.data(), in.data() + 1, n, wire, divisor, Simd::kScalar);
      if (divisor == 1)
        for (size_t i = 0; i < n; i += 97)
          REQUIRE(want[i] == (bf16 ? float_to_bfloat16(in[i + 1]) : float_to_half(in[i + 1])));
      for (Simd simd : vector_paths()) {
        INFO(dtype_name(wire) << " divisor " << divisor << " " << simd_name(simd));
        std::vector<uint16_t> got(n);
        float_to_16bit(got.data(), in.data() + 1, n, wire, divisor, simd);
        for (size_t i = 0; i < n; ++i) {
          if (got[i] == want[i]) continue;
          INFO("float bits 0x" << std::hex << bits(in[i + 1]) << ": scalar 0x" << want[i]
                               << ", vector 0x" << got[i]);
          REQUIRE(got[i] == want[i]);
        }
      }
    }
    // Every 16-bit value to float.
    std::vector<uint16_t> all(0x10001);
    for (uint32_t h = 0; h < 0x10000; ++h) all[h + 1] = static_cast<uint16_t>(h);
    std::vector<float> want(0x10000);
    float_from_16bit(want.data(), all.data() + 1, 0x10000, wire, Simd::kScalar);
    for (uint32_t h = 0; h < 0x10000; h += 7)
      REQUIRE(bits(want[h]) == bits(bf16 ? bfloat16_to_float(static_cast<uint16_t>(h))
                                         : half_to_float(static_cast<uint16_t>(h))));
    for (Simd simd : vector_paths()) {
      std::vector<float> got(0x10000);
      float_from_16bit(got.data(), all.data() + 1, 0x10000, wire, simd);
      for (uint32_t h = 0; h < 0x10000; ++h) {
        INFO(dtype_name(wire) << " " << simd_name(simd) << " 0x" << std::hex << h);
        REQUIRE(bits(got[h]) == bits(want[h]));
      }
    }
  }
}

TEST_CASE("the vector float16 and bfloat16 reductions give the scalar bits",
          "[worker_sdk][reduce]") {
  // Every 16-bit value against a scrambled order of all of them (every class meets every
  // other: NaN, inf, zeros, subnormals, overflowing sums and products), odd length.
  const size_t n = 0x10000 - 3;
  std::vector<uint16_t> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<uint16_t>(i);
    b[i] = static_cast<uint16_t>(i * 40503u + 12345u);
  }
  for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
      std::vector<uint16_t> want(n);
      reduce3_16bit(want.data(), a.data(), b.data(), n, dtype, op, Simd::kScalar);
      for (Simd simd : vector_paths()) {
        std::vector<uint16_t> got = b;  // in place, as reduce_n folds
        reduce3_16bit(got.data(), a.data(), got.data(), n, dtype, op, simd);
        for (size_t i = 0; i < n; ++i) {
          if (got[i] == want[i]) continue;
          INFO(dtype_name(dtype) << " " << reduce_op_name(op) << " " << simd_name(simd) << " 0x"
                                 << std::hex << a[i] << ", 0x" << b[i] << ": scalar 0x" << want[i]
                                 << ", vector 0x" << got[i]);
          REQUIRE(got[i] == want[i]);
        }
      }
    }
    for (int divisor : {2, 3, 8}) {
      std::vector<uint16_t> want = a;
      divide_16bit(want.data(), n, dtype, divisor, Simd::kScalar);
      for (Simd simd : vector_paths()) {
        std::vector<uint16_t> got = a;
        divide_16bit(got.data(), n, dtype, divisor, simd);
        INFO(dtype_name(dtype) << " / " << divisor << " " << simd_name(simd));
        REQUIRE(got == want);
      }
    }
  }
  // The scalar reduction itself: in float, rounded once.
  std::vector<uint16_t> x = {float_to_half(65504.0f), float_to_half(1.0f)};
  std::vector<uint16_t> y = {float_to_half(32.0f), float_to_half(std::ldexp(1.0f, -11))};
  std::vector<uint16_t> d(2);
  reduce3_16bit(d.data(), x.data(), y.data(), 2, DataType::kFloat16, ReduceOp::kSum, Simd::kScalar);
  CHECK(d[0] == 0x7c00);  // 65536 rounds to inf
  CHECK(d[1] == 0x3c00);  // 1 + 2^-11: tie, to even
}

TEST_CASE("bfloat16 conversion rounds to nearest even", "[worker_sdk][reduce]") {
  CHECK(float_to_bfloat16(1.0f) == 0x3f80);
  CHECK(bfloat16_to_float(0x3f80) == 1.0f);
  CHECK(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);      // tie: even (down)
  CHECK(float_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);  // tie: even (up)
  CHECK(float_to_bfloat16(-3.0f) == 0xc040);
  CHECK((float_to_bfloat16(std::numeric_limits<float>::quiet_NaN()) & 0x7fff) > 0x7f80);
}

TEST_CASE("reduce3 applies sum, min and max per dtype, in place", "[worker_sdk][reduce]") {
  std::vector<int64_t> a = {1, -5, 9, 4}, b = {3, 2, -9, 4};
  reduce3(a.data(), a.data(), b.data(), 4, DataType::kInt64, ReduceOp::kSum);
  CHECK(a == std::vector<int64_t>{4, -3, 0, 8});
  std::vector<float> x = {1.5f, -2.0f}, y = {0.5f, -3.0f}, out(2);
  reduce3(out.data(), x.data(), y.data(), 2, DataType::kFloat32, ReduceOp::kMin);
  CHECK(out == std::vector<float>{0.5f, -3.0f});
  reduce3(out.data(), x.data(), y.data(), 2, DataType::kFloat32, ReduceOp::kMax);
  CHECK(out == std::vector<float>{1.5f, -2.0f});
  std::vector<uint16_t> h = {float_to_half(1.5f), float_to_half(-4.0f)};
  std::vector<uint16_t> g = {float_to_half(2.25f), float_to_half(1.0f)};
  reduce3(h.data(), h.data(), g.data(), 2, DataType::kFloat16, ReduceOp::kSum);
  CHECK(half_to_float(h[0]) == 3.75f);
  CHECK(half_to_float(h[1]) == -3.0f);
  std::vector<uint16_t> p = {float_to_bfloat16(8.0f)}, q = {float_to_bfloat16(-1.0f)};
  reduce3(p.data(), p.data(), q.data(), 1, DataType::kBFloat16, ReduceOp::kMax);
  CHECK(bfloat16_to_float(p[0]) == 8.0f);
}

TEST_CASE("divide implements avg: truncation for integers", "[worker_sdk][reduce]") {
  std::vector<int32_t> i = {7, -7, 8};
  divide(i.data(), 3, DataType::kInt32, 2);
  CHECK(i == std::vector<int32_t>{3, -3, 4});
  std::vector<double> d = {1.0, 3.0};
  divide(d.data(), 2, DataType::kFloat64, 4);
  CHECK(d == std::vector<double>{0.25, 0.75});
}

TEST_CASE("reduce_n folds sources in rank order into every destination", "[worker_sdk][reduce]") {
  // Sizes around the 8 KiB block (2048 floats); a destination that is also a source.
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{2047}, size_t{2048}, size_t{5000}}) {
    for (int nsrc = 1; nsrc <= 5; ++nsrc) {
      std::vector<std::vector<int32_t>> src(nsrc, std::vector<int32_t>(n));
      for (int j = 0; j < nsrc; ++j)
        for (size_t i = 0; i < n; ++i)
          src[j][i] = static_cast<int32_t>((i * 31 + j * 7) % 101) - 50;
      std::vector<int32_t> want_sum(n), want_max(n);
      for (size_t i = 0; i < n; ++i) {
        want_sum[i] = want_max[i] = src[0][i];
        for (int j = 1; j < nsrc; ++j) {
          want_sum[i] += src[j][i];
          want_max[i] = std::max(want_max[i], src[j][i]);
        }
      }
      INFO("n=" << n << " nsrc=" << nsrc);
      std::vector<int32_t> out(n, -1);
      std::vector<const void*> srcs;
      for (auto& v : src) srcs.push_back(v.data());
      // The first destination is one of the sources (the first or the last), as in an in-place
      // allreduce; the second is separate.
      for (int alias : {0, nsrc - 1}) {
        INFO("first destination aliases source " << alias);
        std::vector<int32_t> saved = src[alias];
        std::fill(out.begin(), out.end(), -1);
        void* dsts[2] = {src[alias].data(), out.data()};
        reduce_n(dsts, 2, srcs.data(), nsrc, n, DataType::kInt32, ReduceOp::kSum);
        CHECK(out == want_sum);
        CHECK(src[alias] == want_sum);
        src[alias] = saved;
      }
      void* only = out.data();
      reduce_n(&only, 1, srcs.data(), nsrc, n, DataType::kInt32, ReduceOp::kMax);
      CHECK(out == want_max);
    }
  }
  CHECK_THROWS_AS(reduce_n(nullptr, 0, nullptr, 0, 1, DataType::kInt32, ReduceOp::kSum),
                  std::invalid_argument);
}

TEST_CASE("reduce_n is exact whatever the destination's alignment", "[worker_sdk][reduce]") {
  // Every start offset within a cache line, with the in-place destination and a separate one.
  const size_t n = 5000;
  for (size_t shift = 0; shift < 16; ++shift) {
    std::vector<int32_t> a(n + 16), b(n + 16), c(n + 16), out(n + 16, 0);
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = static_cast<int32_t>(i % 97);
      b[i] = static_cast<int32_t>(i % 89) * 3;
      c[i] = -static_cast<int32_t>(i % 83);
    }
    std::vector<int32_t> want(n);
    for (size_t i = 0; i < n; ++i) want[i] = a[shift + i] + b[shift + i] + c[shift + i];
    const void* srcs[3] = {a.data() + shift, b.data() + shift, c.data() + shift};
    void* dsts[2] = {b.data() + shift, out.data() + shift};
    reduce_n(dsts, 2, srcs, 3, n, DataType::kInt32, ReduceOp::kSum);
    INFO("shift " << shift);
    REQUIRE(std::equal(want.begin(), want.end(), b.begin() + shift));
    REQUIRE(std::equal(want.begin(), want.end(), out.begin() + shift));
    REQUIRE(out[shift + n] == 0);  // nothing written past the end
  }
}

TEST_CASE("copy_bytes copies every length and alignment exactly", "[worker_sdk][reduce]") {
  std::vector<unsigned char> src(6000), dst(6000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 13 + 5);
  for (size_t len : {size_t{0}, size_t{1}, size_t{63}, size_t{1023}, size_t{1024}, size_t{1025},
                     size_t{4096 + 77}}) {
    for (size_t so : {0, 1, 17}) {
      for (size_t d_off : {0, 3, 64}) {
        std::fill(dst.begin(), dst.end(), 0xAA);
        copy_bytes(dst.data() + d_off, src.data() + so, len);
        INFO("len=" << len << " src+" << so << " dst+" << d_off);
        REQUIRE(std::memcmp(dst.data() + d_off, src.data() + so, len) == 0);
        for (size_t i = 0; i < d_off; ++i) REQUIRE(dst[i] == 0xAA);  // nothing before
        for (size_t i = d_off + len; i < dst.size(); ++i) REQUIRE(dst[i] == 0xAA);  // or after
      }
    }
  }
}

TEST_CASE("stream_bytes copies every length and alignment exactly, below and above 4 KiB",
          "[worker_sdk][reduce]") {
  // The streamed body starts at the first 32-byte boundary of dst: every head length 0..31 and
  // every tail length past the last 128-byte step.
  std::vector<unsigned char> src((1u << 20) + 300), dst((1u << 20) + 300);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 13 + 5);
  for (size_t len : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{4096 + 127},
                     size_t{65536 + 33}, size_t{1u << 20}}) {
    for (size_t so : {0, 1, 17}) {
      for (size_t d_off : {0, 3, 31, 32, 64}) {
        std::fill(dst.begin(), dst.end(), 0xAA);
        stream_bytes(dst.data() + d_off, src.data() + so, len);
        INFO("len=" << len << " src+" << so << " dst+" << d_off);
        REQUIRE(std::memcmp(dst.data() + d_off, src.data() + so, len) == 0);
        // Nothing before or after (one assertion each: a megabyte of REQUIREs is slow).
        REQUIRE(std::count(dst.begin(), dst.begin() + d_off, 0xAA) == static_cast<long>(d_off));
        REQUIRE(std::count(dst.begin() + d_off + len, dst.end(), 0xAA) ==
                static_cast<long>(dst.size() - d_off - len));
      }
    }
  }
}

TEST_CASE("product and the bitwise ops on the integer types, with wrap-around",
          "[worker_sdk][reduce]") {
  {
    std::vector<int8_t> a = {100, -128, 3, -7}, b = {2, -1, -3, 127}, d(4);
    reduce3(d.data(), a.data(), b.data(), 4, DataType::kInt8, ReduceOp::kProduct);
    CHECK(d == std::vector<int8_t>{-56, -128, -9, -121});  // 200, 128, -889 wrap mod 256
    reduce3(d.data(), a.data(), b.data(), 4, DataType::kInt8, ReduceOp::kSum);
    CHECK(d == std::vector<int8_t>{102, 127, 0, 120});
  }
  {
    std::vector<uint8_t> a = {200, 0xf0, 7}, b = {2, 0x3c, 0xff}, d(3);
    reduce3(d.data(), a.data(), b.data(), 3, DataType::kUInt8, ReduceOp::kProduct);
    CHECK(d == std::vector<uint8_t>{144, 0x40, 0xf9});
    reduce3(d.data(), a.data(), b.data(), 3, DataType::kUInt8, ReduceOp::kBand);
    CHECK(d == std::vector<uint8_t>{0, 0x30, 7});
    reduce3(d.data(), a.data(), b.data(), 3, DataType::kUInt8, ReduceOp::kBor);
    CHECK(d == std::vector<uint8_t>{202, 0xfc, 0xff});
    reduce3(d.data(), a.data(), b.data(), 3, DataType::kUInt8, ReduceOp::kBxor);
    CHECK(d == std::vector<uint8_t>{202, 0xcc, 0xf8});
  }
  {
    // Beyond 32 bits, and a signed overflow that must wrap (not undefined behaviour).
    std::vector<int64_t> a = {0x123456789abcdef0, std::numeric_limits<int64_t>::max()};
    std::vector<int64_t> b = {0x0ff00ff00ff00ff0, 2}, d(2);
    reduce3(d.data(), a.data(), b.data(), 2, DataType::kInt64, ReduceOp::kBxor);
    CHECK(d[0] == (0x123456789abcdef0 ^ 0x0ff00ff00ff00ff0));
    reduce3(d.data(), a.data(), b.data(), 2, DataType::kInt64, ReduceOp::kProduct);
    CHECK(d[1] == -2);
    std::vector<int32_t> x = {std::numeric_limits<int32_t>::max()}, y = {1}, z(1);
    reduce3(z.data(), x.data(), y.data(), 1, DataType::kInt32, ReduceOp::kSum);
    CHECK(z[0] == std::numeric_limits<int32_t>::min());
  }
  {
    std::vector<uint16_t> a = {float_to_half(3.0f)}, b = {float_to_half(-0.5f)}, d(1);
    reduce3(d.data(), a.data(), b.data(), 1, DataType::kFloat16, ReduceOp::kProduct);
    CHECK(half_to_float(d[0]) == -1.5f);
  }
}

TEST_CASE("bool reductions read nonzero bytes as true and write 0 or 1", "[worker_sdk][reduce]") {
  std::vector<uint8_t> a = {0, 0, 2, 255}, b = {0, 7, 0, 1}, d(4);
  reduce3(d.data(), a.data(), b.data(), 4, DataType::kBool, ReduceOp::kSum);  // OR
  CHECK(d == std::vector<uint8_t>{0, 1, 1, 1});
  reduce3(d.data(), a.data(), b.data(), 4, DataType::kBool, ReduceOp::kMax);  // OR
  CHECK(d == std::vector<uint8_t>{0, 1, 1, 1});
  reduce3(d.data(), a.data(), b.data(), 4, DataType::kBool, ReduceOp::kProduct);  // AND
  CHECK(d == std::vector<uint8_t>{0, 0, 0, 1});
  reduce3(d.data(), a.data(), b.data(), 4, DataType::kBool, ReduceOp::kMin);  // AND
  CHECK(d == std::vector<uint8_t>{0, 0, 0, 1});
  reduce3(d.data(), a.data(), b.data(), 4, DataType::kBool, ReduceOp::kBxor);
  CHECK(d == std::vector<uint8_t>{0, 1, 1, 0});
}

TEST_CASE("ops a dtype does not support are refused, naming both", "[worker_sdk][reduce]") {
  float f[1] = {1};
  for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
    CHECK_FALSE(reduce_op_supports(op, DataType::kFloat32));
    CHECK_FALSE(reduce_op_supports(op, DataType::kBFloat16));
    CHECK(reduce_op_supports(op, DataType::kBool));
    CHECK(reduce_op_supports(op, DataType::kUInt8));
    CHECK_THROWS_AS(reduce3(f, f, f, 1, DataType::kFloat32, op), std::invalid_argument);
  }
  CHECK_FALSE(reduce_op_supports(ReduceOp::kAvg, DataType::kBool));
  CHECK_THROWS_WITH(reduce_op_check(ReduceOp::kBxor, DataType::kFloat64, "allreduce"),
                    Catch::Contains("bxor") && Catch::Contains("float64"));
  CHECK_THROWS_WITH(reduce_op_check(ReduceOp::kAvg, DataType::kBool, "reduce"),
                    Catch::Contains("avg") && Catch::Contains("bool"));
  uint8_t b[1] = {1};
  CHECK_THROWS_AS(divide(b, 1, DataType::kBool, 2), std::invalid_argument);
  // avg's division in int64: a divisor that does not fit the element type.
  int8_t i[2] = {-100, 127};
  divide(i, 2, DataType::kInt8, 200);
  CHECK(i[0] == 0);
  CHECK(i[1] == 0);
  int8_t j[1] = {-100};
  divide(j, 1, DataType::kInt8, 3);
  CHECK(j[0] == -33);
}
