#include "worker_sdk/src/reduce.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics warn of an uninitialized variable of their own (the merge operand
// of their masked builtins, GCC bug 105593) where they are inlined; the pragma has to cover the
// header's lines.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace trun::worker::detail {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Integer sums and products wrap around (computed unsigned: signed overflow is undefined).
template <typename T>
constexpr bool kWraps = std::is_integral_v<T>&& std::is_signed_v<T>;

struct Sum {
  static constexpr ReduceOp kOp = ReduceOp::kSum;
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (kWraps<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return static_cast<T>(a + b);
    }
  }
  static bool logical(bool a, bool b) { return a || b; }
};
struct Product {
  static constexpr ReduceOp kOp = ReduceOp::kProduct;
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (kWraps<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return static_cast<T>(a * b);
    }
  }
  static bool logical(bool a, bool b) { return a && b; }
};
struct Min {
  static constexpr ReduceOp kOp = ReduceOp::kMin;
  template <typename T>
  static T apply(T a, T b) {
    return b < a ? b : a;
  }
  static bool logical(bool a, bool b) { return a && b; }
};
struct Max {
  static constexpr ReduceOp kOp = ReduceOp::kMax;
  template <typename T>
  static T apply(T a, T b) {
    return a < b ? b : a;
  }
  static bool logical(bool a, bool b) { return a || b; }
};
// Bitwise ops are only dispatched for integers (reduce3 refuses the others first); the float
// branch exists so that the templates compile for every type.
struct Band {
  static constexpr ReduceOp kOp = ReduceOp::kBand;
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(a & b);
    return a;
  }
  static bool logical(bool a, bool b) { return a && b; }
};
struct Bor {
  static constexpr ReduceOp kOp = ReduceOp::kBor;
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(a | b);
    return a;
  }
  static bool logical(bool a, bool b) { return a || b; }
};
struct Bxor {
  static constexpr ReduceOp kOp = ReduceOp::kBxor;
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(a ^ b);
    return a;
  }
  static bool logical(bool a, bool b) { return a != b; }
};
// kBool: bytes, nonzero is true; results are 0 or 1.
template <typename Op>
struct Logical {
  template <typename T>
  static T apply(T a, T b) {
    return static_cast<T>(Op::logical(a != 0, b != 0));
  }
};

// Plain loops over native types: the compiler vectorizes them (this file is built with -O3).
template <typename T, typename Op>
void native(void* dst, const void* a, const void* b, size_t n) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = Op::apply(x[i], y[i]);
}

#if defined(__x86_64__)
// The same loop compiled for AVX2 (8 floats per instruction instead of SSE2's 4), chosen at run
// time.
template <typename T, typename Op>
__attribute__((target("avx2"))) void native_avx2(void* dst, const void* a, const void* b,
                                                 size_t n) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = Op::apply(x[i], y[i]);
}

template <typename T, typename Op>
void native_best(void* dst, const void* a, const void* b, size_t n) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2)
    native_avx2<T, Op>(dst, a, b, n);
  else
    native<T, Op>(dst, a, b, n);
}
#else
template <typename T, typename Op>
void native_best(void* dst, const void* a, const void* b, size_t n) {
  native<T, Op>(dst, a, b, n);
}
#endif

template <typename Op>
void dispatch(void* dst, const void* a, const void* b, size_t n, DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return native_best<float, Op>(dst, a, b, n);
    case DataType::kFloat64:
      return native_best<double, Op>(dst, a, b, n);
    case DataType::kInt32:
      return native_best<int32_t, Op>(dst, a, b, n);
    case DataType::kInt64:
      return native_best<int64_t, Op>(dst, a, b, n);
    case DataType::kInt8:
      return native_best<int8_t, Op>(dst, a, b, n);
    case DataType::kUInt8:
      return native_best<uint8_t, Op>(dst, a, b, n);
    case DataType::kBool:
      return native_best<uint8_t, Logical<Op>>(dst, a, b, n);
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return reduce3_16bit(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                           static_cast<const uint16_t*>(b), n, dtype, Op::kOp, best_simd());
  }
  throw std::invalid_argument("unknown dtype");
}

template <typename T>
void divide_native(void* data, size_t n, int divisor) {
  T* d = static_cast<T*>(data);
  if constexpr (std::is_integral_v<T> && sizeof(T) < sizeof(int64_t)) {
    // Divide in int64: the divisor need not fit in T (int8 with 200 ranks).
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<int64_t>(d[i]) / divisor);
  } else {
    const T div = static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) d[i] = d[i] / div;
  }
}

#if defined(__x86_64__)
// 128 bytes per iteration, unaligned loads. kStream = false: unaligned plain stores (the slices
// are cache-line aligned in the shared segment, user buffers may not be). kStream = true:
// non-temporal stores, so the destination lines go to memory without being read first (a plain
// store reads each line it writes, a third memory access per byte): for large copies whose
// destination is not read again soon; d must then be 32-byte aligned.
template <bool kStream>
__attribute__((target("avx2"))) void copy_lines_avx2(char* d, const char* s, size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i v[4];
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32 * k));
    for (int k = 0; k < 4; ++k) {
      auto* to = reinterpret_cast<__m256i*>(d + i + 32 * k);
      if constexpr (kStream)
        _mm256_stream_si256(to, v[k]);
      else
        _mm256_storeu_si256(to, v[k]);
    }
  }
  if constexpr (kStream) _mm_sfence();  // the streamed lines are visible before later stores
  if (i < n) std::memcpy(d + i, s + i, n - i);
}

void copy_sse2(char* d, const char* s, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  if (i < n) std::memcpy(d + i, s + i, n - i);
}
#endif

}  // namespace

void copy_bytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n >= 1024) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2)
      copy_lines_avx2<false>(static_cast<char*>(dst), static_cast<const char*>(src), n);
    else
      copy_sse2(static_cast<char*>(dst), static_cast<const char*>(src), n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void stream_bytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && n >= 4096) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    const size_t head = (32 - reinterpret_cast<uintptr_t>(d) % 32) % 32;
    copy_bytes(d, s, head);
    copy_lines_avx2<true>(d + head, s + head, n - head);
    return;
  }
#endif
  copy_bytes(dst, src, n);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return float_of(sign);
    // Subnormal half: normalize into a float.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    return float_of(sign | ((127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13));
  }
  if (exp == 31) {
    if (mant == 0) return float_of(sign | 0x7f800000u);
    return float_of(sign | 0x7fc00000u | (mant << 13));  // NaN, made quiet as VCVTPH2PS does
  }
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t float_to_half(float f) {
  uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u)  // NaN: quiet, the payload's top 10 bits kept (as VCVTPS2PH)
    return static_cast<uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
  if (u >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65536 or inf
  if (u < 0x38800000u) {
    // Below the smallest normal half: a multiple of 2^-24, rounded in integers (an FPU add
    // would depend on the rounding mode and on DAZ). Below 2^-25 everything rounds to zero.
    const uint32_t e = u >> 23;
    if (e < 102) return static_cast<uint16_t>(sign);
    const uint32_t mant = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t r = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (r & 1u))) ++r;  // may carry into the smallest normal
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return static_cast<uint16_t>(sign | (u >> 13));  // may carry into inf: correct rounding
}

float bfloat16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_bfloat16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

namespace {

// The float16/bfloat16 kernels: reduce in float and round once per element, as the scalar
// functions do. kBf16 picks the 16-bit type. The vector loops leave their last n % 8 (or 16)
// elements to the scalar loop, which gives the same bits.
template <bool kBf16>
float wide(uint16_t h) {
  return kBf16 ? bfloat16_to_float(h) : half_to_float(h);
}
template <bool kBf16>
uint16_t narrow(float f) {
  return kBf16 ? float_to_bfloat16(f) : float_to_half(f);
}

template <bool kBf16, typename Op>
void reduce16_scalar(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n) {
  for (size_t i = 0; i < n; ++i)
    d[i] = narrow<kBf16>(Op::apply(wide<kBf16>(x[i]), wide<kBf16>(y[i])));
}
template <bool kBf16>
void to16_scalar(uint16_t* d, const float* s, size_t n, int divisor) {
  if (divisor == 1) {
    for (size_t i = 0; i < n; ++i) d[i] = narrow<kBf16>(s[i]);
    return;
  }
  const float div = static_cast<float>(divisor);
  for (size_t i = 0; i < n; ++i) d[i] = narrow<kBf16>(wide<kBf16>(narrow<kBf16>(s[i])) / div);
}
template <bool kBf16>
void from16_scalar(float* d, const uint16_t* s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = wide<kBf16>(s[i]);
}
template <bool kBf16>
void divide16_scalar(uint16_t* d, size_t n, int divisor) {
  const float div = static_cast<float>(divisor);
  for (size_t i = 0; i < n; ++i) d[i] = narrow<kBf16>(wide<kBf16>(d[i]) / div);
}

#if defined(__x86_64__)
constexpr int kNearestEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// AVX2 + F16C, 8 elements. float16: VCVTPH2PS / VCVTPS2PH. bfloat16 has no conversion
// instruction before AVX-512 BF16 (whose VCVTNEPS2BF16 flushes subnormals to zero, so it is not
// used): the top half of the float, rounded to nearest even by adding 0x7fff + the kept lsb,
// and a NaN made quiet instead (its sum could carry into the exponent or sign).
#define TRUN_AVX2 __attribute__((target("avx2,f16c")))
template <bool kBf16>
TRUN_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kBf16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else
    return _mm256_cvtph_ps(h);
}
template <bool kBf16>
TRUN_AVX2 inline void store8(uint16_t* p, __m256 v) {
  __m128i h;
  if constexpr (kBf16) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i top = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    h = _mm256_cvtps_ph(v, kNearestEven);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
// Op::apply's result for floats, NaN and signed zeros included: MINPS/MAXPS return their
// second operand unless the first compares less/greater, as `b < a ? b : a` does with (b, a).
template <typename Op>
TRUN_AVX2 inline __m256 apply8(__m256 a, __m256 b) {
  if constexpr (std::is_same_v<Op, Sum>) return _mm256_add_ps(a, b);
  if constexpr (std::is_same_v<Op, Product>) return _mm256_mul_ps(a, b);
  if constexpr (std::is_same_v<Op, Min>) return _mm256_min_ps(b, a);
  if constexpr (std::is_same_v<Op, Max>) return _mm256_max_ps(b, a);
  return a;
}

template <bool kBf16, typename Op>
TRUN_AVX2 void reduce16_avx2(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    store8<kBf16>(d + i, apply8<Op>(load8<kBf16>(x + i), load8<kBf16>(y + i)));
  reduce16_scalar<kBf16, Op>(d + i, x + i, y + i, n - i);
}
template <bool kBf16>
TRUN_AVX2 void to16_avx2(uint16_t* d, const float* s, size_t n, int divisor) {
  size_t i = 0;
  if (divisor == 1) {
    for (; i + 8 <= n; i += 8) store8<kBf16>(d + i, _mm256_loadu_ps(s + i));
  } else {
    const __m256 div = _mm256_set1_ps(static_cast<float>(divisor));
    for (; i + 8 <= n; i += 8) {
      store8<kBf16>(d + i, _mm256_loadu_ps(s + i));
      store8<kBf16>(d + i, _mm256_div_ps(load8<kBf16>(d + i), div));
    }
  }
  to16_scalar<kBf16>(d + i, s + i, n - i, divisor);
}
template <bool kBf16>
TRUN_AVX2 void from16_avx2(float* d, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, load8<kBf16>(s + i));
  from16_scalar<kBf16>(d + i, s + i, n - i);
}
template <bool kBf16>
TRUN_AVX2 void divide16_avx2(uint16_t* d, size_t n, int divisor) {
  const __m256 div = _mm256_set1_ps(static_cast<float>(divisor));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8<kBf16>(d + i, _mm256_div_ps(load8<kBf16>(d + i), div));
  divide16_scalar<kBf16>(d + i, n - i, divisor);
}
#undef TRUN_AVX2

// The same with AVX-512F, 16 elements.
#define TRUN_AVX512 __attribute__((target("avx512f,avx2,f16c")))
template <bool kBf16>
TRUN_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kBf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else
    return _mm512_cvtph_ps(h);
}
template <bool kBf16>
TRUN_AVX512 inline void store16(uint16_t* p, __m512 v) {
  __m256i h;
  if constexpr (kBf16) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i top = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
    h = _mm512_cvtepi32_epi16(r);
  } else {
    h = _mm512_cvtps_ph(v, kNearestEven);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
template <typename Op>
TRUN_AVX512 inline __m512 apply16(__m512 a, __m512 b) {
  if constexpr (std::is_same_v<Op, Sum>) return _mm512_add_ps(a, b);
  if constexpr (std::is_same_v<Op, Product>) return _mm512_mul_ps(a, b);
  if constexpr (std::is_same_v<Op, Min>) return _mm512_min_ps(b, a);
  if constexpr (std::is_same_v<Op, Max>) return _mm512_max_ps(b, a);
  return a;
}

template <bool kBf16, typename Op>
TRUN_AVX512 void reduce16_avx512(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    store16<kBf16>(d + i, apply16<Op>(load16<kBf16>(x + i), load16<kBf16>(y + i)));
  reduce16_scalar<kBf16, Op>(d + i, x + i, y + i, n - i);
}
template <bool kBf16>
TRUN_AVX512 void to16_avx512(uint16_t* d, const float* s, size_t n, int divisor) {
  size_t i = 0;
  if (divisor == 1) {
    for (; i + 16 <= n; i += 16) store16<kBf16>(d + i, _mm512_loadu_ps(s + i));
  } else {
    const __m512 div = _mm512_set1_ps(static_cast<float>(divisor));
    for (; i + 16 <= n; i += 16) {
      store16<kBf16>(d + i, _mm512_loadu_ps(s + i));
      store16<kBf16>(d + i, _mm512_div_ps(load16<kBf16>(d + i), div));
    }
  }
  to16_scalar<kBf16>(d + i, s + i, n - i, divisor);
}
template <bool kBf16>
TRUN_AVX512 void from16_avx512(float* d, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, load16<kBf16>(s + i));
  from16_scalar<kBf16>(d + i, s + i, n - i);
}
template <bool kBf16>
TRUN_AVX512 void divide16_avx512(uint16_t* d, size_t n, int divisor) {
  const __m512 div = _mm512_set1_ps(static_cast<float>(divisor));
  size_t i = 0;
  for (; i + 16 <= n; i += 16) store16<kBf16>(d + i, _mm512_div_ps(load16<kBf16>(d + i), div));
  divide16_scalar<kBf16>(d + i, n - i, divisor);
}
#undef TRUN_AVX512
#endif

Simd detect_simd() {
  Simd best = Simd::kScalar;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) best = Simd::kAvx2;
  if (best == Simd::kAvx2 && __builtin_cpu_supports("avx512f")) best = Simd::kAvx512;
#endif
  // TRUN_SIMD=scalar|avx2 caps it (benchmarks compare the paths with it).
  if (const char* cap = std::getenv("TRUN_SIMD")) {
    if (std::strcmp(cap, "scalar") == 0) best = Simd::kScalar;
    if (std::strcmp(cap, "avx2") == 0 && best == Simd::kAvx512) best = Simd::kAvx2;
  }
  return best;
}

// The path to run for a requested one: no wider than this CPU allows.
Simd usable(Simd want) {
  const Simd best = best_simd();
  return static_cast<int>(want) > static_cast<int>(best) ? best : want;
}

bool is_bf16(DataType wire, const char* what) {
  if (wire == DataType::kFloat16) return false;
  if (wire == DataType::kBFloat16) return true;
  throw std::invalid_argument(std::string(what) + ": " + dtype_name(wire) +
                              " is not a 16-bit float type");
}

template <bool kBf16, typename Op>
void reduce16(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n, Simd simd) {
#if defined(__x86_64__)
  if (simd == Simd::kAvx512) return reduce16_avx512<kBf16, Op>(d, x, y, n);
  if (simd == Simd::kAvx2) return reduce16_avx2<kBf16, Op>(d, x, y, n);
#endif
  (void)simd;
  reduce16_scalar<kBf16, Op>(d, x, y, n);
}

template <bool kBf16>
void reduce16_op(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n, ReduceOp op,
                 Simd simd) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return reduce16<kBf16, Sum>(d, x, y, n, simd);
    case ReduceOp::kProduct:
      return reduce16<kBf16, Product>(d, x, y, n, simd);
    case ReduceOp::kMin:
      return reduce16<kBf16, Min>(d, x, y, n, simd);
    case ReduceOp::kMax:
      return reduce16<kBf16, Max>(d, x, y, n, simd);
    default:
      throw std::invalid_argument(std::string("reduce op ") + reduce_op_name(op) +
                                  " does not apply to 16-bit floats");
  }
}

}  // namespace

Simd best_simd() {
  static const Simd best = detect_simd();
  return best;
}

void float_to_16bit(uint16_t* dst, const float* src, size_t n, DataType wire, int divisor,
                    Simd simd) {
  const bool bf16 = is_bf16(wire, "float_to_16bit");
  simd = usable(simd);
#if defined(__x86_64__)
  if (simd == Simd::kAvx512)
    return bf16 ? to16_avx512<true>(dst, src, n, divisor)
                : to16_avx512<false>(dst, src, n, divisor);
  if (simd == Simd::kAvx2)
    return bf16 ? to16_avx2<true>(dst, src, n, divisor) : to16_avx2<false>(dst, src, n, divisor);
#endif
  bf16 ? to16_scalar<true>(dst, src, n, divisor) : to16_scalar<false>(dst, src, n, divisor);
}

void float_from_16bit(float* dst, const uint16_t* src, size_t n, DataType wire, Simd simd) {
  const bool bf16 = is_bf16(wire, "float_from_16bit");
  simd = usable(simd);
#if defined(__x86_64__)
  if (simd == Simd::kAvx512)
    return bf16 ? from16_avx512<true>(dst, src, n) : from16_avx512<false>(dst, src, n);
  if (simd == Simd::kAvx2)
    return bf16 ? from16_avx2<true>(dst, src, n) : from16_avx2<false>(dst, src, n);
#endif
  bf16 ? from16_scalar<true>(dst, src, n) : from16_scalar<false>(dst, src, n);
}

void reduce3_16bit(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, DataType dtype,
                   ReduceOp op, Simd simd) {
  simd = usable(simd);
  if (is_bf16(dtype, "reduce3_16bit"))
    reduce16_op<true>(dst, a, b, n, op, simd);
  else
    reduce16_op<false>(dst, a, b, n, op, simd);
}

void divide_16bit(uint16_t* data, size_t n, DataType dtype, int divisor, Simd simd) {
  const bool bf16 = is_bf16(dtype, "divide_16bit");
  simd = usable(simd);
#if defined(__x86_64__)
  if (simd == Simd::kAvx512)
    return bf16 ? divide16_avx512<true>(data, n, divisor)
                : divide16_avx512<false>(data, n, divisor);
  if (simd == Simd::kAvx2)
    return bf16 ? divide16_avx2<true>(data, n, divisor) : divide16_avx2<false>(data, n, divisor);
#endif
  bf16 ? divide16_scalar<true>(data, n, divisor) : divide16_scalar<false>(data, n, divisor);
}

void reduce3(void* dst, const void* a, const void* b, size_t n, DataType dtype, ReduceOp op) {
  if (!reduce_op_supports(op == ReduceOp::kAvg ? ReduceOp::kSum : op, dtype))
    throw std::invalid_argument(std::string("reduce op ") + reduce_op_name(op) +
                                " does not apply to " + dtype_name(dtype));
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return dispatch<Sum>(dst, a, b, n, dtype);
    case ReduceOp::kMin:
      return dispatch<Min>(dst, a, b, n, dtype);
    case ReduceOp::kMax:
      return dispatch<Max>(dst, a, b, n, dtype);
    case ReduceOp::kProduct:
      return dispatch<Product>(dst, a, b, n, dtype);
    case ReduceOp::kBand:
      return dispatch<Band>(dst, a, b, n, dtype);
    case ReduceOp::kBor:
      return dispatch<Bor>(dst, a, b, n, dtype);
    case ReduceOp::kBxor:
      return dispatch<Bxor>(dst, a, b, n, dtype);
  }
  throw std::invalid_argument("unknown reduce op");
}

void reduce_n(void* const* dsts, int ndst, const void* const* srcs, int nsrc, size_t n,
              DataType dtype, ReduceOp op, bool stream_copies) {
  if (nsrc < 1) throw std::invalid_argument("reduce_n: no sources");
  const size_t es = dtype_size(dtype);
  // Per L1-sized block: fold all sources but the last into a stack buffer, then the last fold
  // writes dsts[0] directly and the other destinations copy that block (still in L1). A
  // destination aliasing a source is written only after the block's last read of it.
  constexpr size_t kBlockBytes = 8192;
  alignas(64) unsigned char acc[kBlockBytes];
  const size_t block = kBlockBytes / es;
  for (size_t i = 0; i < n; i += block) {
    const size_t m = std::min(block, n - i);
    const size_t off = i * es;
    auto src = [&](int j) { return static_cast<const unsigned char*>(srcs[j]) + off; };
    auto dst = [&](int d) { return static_cast<unsigned char*>(dsts[d]) + off; };
    if (nsrc == 1) {
      copy_bytes(dst(0), src(0), m * es);
    } else {
      const void* folded = src(0);
      if (nsrc > 2) {
        reduce3(acc, src(0), src(1), m, dtype, op);
        for (int j = 2; j < nsrc - 1; ++j) reduce3(acc, acc, src(j), m, dtype, op);
        folded = acc;
      }
      reduce3(dst(0), folded, src(nsrc > 2 ? nsrc - 1 : 1), m, dtype, op);
    }
    for (int d = 1; d < ndst; ++d) copy_or_stream(stream_copies, dst(d), dst(0), m * es);
  }
}

void divide(void* data, size_t n, DataType dtype, int divisor) {
  switch (dtype) {
    case DataType::kFloat32:
      return divide_native<float>(data, n, divisor);
    case DataType::kFloat64:
      return divide_native<double>(data, n, divisor);
    case DataType::kInt32:
      return divide_native<int32_t>(data, n, divisor);
    case DataType::kInt64:
      return divide_native<int64_t>(data, n, divisor);
    case DataType::kInt8:
      return divide_native<int8_t>(data, n, divisor);
    case DataType::kUInt8:
      return divide_native<uint8_t>(data, n, divisor);
    case DataType::kBool:
      throw std::invalid_argument("avg does not apply to bool");
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return divide_16bit(static_cast<uint16_t*>(data), n, dtype, divisor, best_simd());
  }
  throw std::invalid_argument("unknown dtype");
}

}  // namespace trun::worker::detail
