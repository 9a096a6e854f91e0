#include "worker_sdk/src/reduce.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
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
  template <typename T>
  static T apply(T a, T b) {
    return b < a ? b : a;
  }
  static bool logical(bool a, bool b) { return a && b; }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    return a < b ? b : a;
  }
  static bool logical(bool a, bool b) { return a || b; }
};
// Bitwise ops are only dispatched for integers (reduce3 refuses the others first); the float
// branch exists so that the templates compile for every type.
struct Band {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(a & b);
    return a;
  }
  static bool logical(bool a, bool b) { return a && b; }
};
struct Bor {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(a | b);
    return a;
  }
  static bool logical(bool a, bool b) { return a || b; }
};
struct Bxor {
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

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), typename Op>
void half_like(void* dst, const void* a, const void* b, size_t n) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = FromF(Op::apply(ToF(x[i]), ToF(y[i])));
}

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
      return half_like<half_to_float, float_to_half, Op>(dst, a, b, n);
    case DataType::kBFloat16:
      return half_like<bfloat16_to_float, float_to_bfloat16, Op>(dst, a, b, n);
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
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
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
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t float_to_half(float f) {
  uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x47800000u) {  // >= 65536, inf or NaN
    if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (u < 0x38800000u) {  // below the smallest normal half: let the FPU round the subnormal
    const float magic = float_of(126u << 23);  // 0.5: aligns the half subnormal step to 1 ulp
    uint32_t r = bits_of(float_of(u) + magic) - bits_of(magic);
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t odd = (u >> 13) & 1u;
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
              DataType dtype, ReduceOp op) {
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
    for (int d = 1; d < ndst; ++d) copy_bytes(dst(d), dst(0), m * es);
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
    case DataType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) d[i] = float_to_half(half_to_float(d[i]) / divisor);
      return;
    }
    case DataType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) d[i] = float_to_bfloat16(bfloat16_to_float(d[i]) / divisor);
      return;
    }
  }
  throw std::invalid_argument("unknown dtype");
}

}  // namespace trun::worker::detail
