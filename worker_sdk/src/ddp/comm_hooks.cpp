// The built-in communication hooks (trun/ddp.h): allreduce, fp16 and bf16 compression.

#include <cstdint>
#include <cstring>
#include <map>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "trun/ddp.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker {

namespace {

class AllreduceHook : public CommHook {
 public:
  Work launch(GradBucket& b) override {
    const bool avg = b.divisor == b.group->size();
    if (!avg && b.device == Device::kCuda)
      throw DdpError("allreduce_hook: dividing a CUDA bucket by " + std::to_string(b.divisor) +
                     " ranks (join) is not supported");
    return b.group->allreduce_async(b.data, b.numel, b.dtype, avg ? ReduceOp::kAvg : ReduceOp::kSum,
                                    b.timeout);
  }
  void finish(GradBucket& b) override {
    if (b.divisor != b.group->size() && b.divisor > 0)
      detail::divide(b.data, b.numel, b.dtype, b.divisor);
  }
  std::string name() const override { return "allreduce_hook"; }
};

float load(const void* data, size_t i, DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return static_cast<const float*>(data)[i];
    case DataType::kFloat64:
      return static_cast<float>(static_cast<const double*>(data)[i]);
    case DataType::kFloat16:
      return detail::half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DataType::kBFloat16:
      return detail::bfloat16_to_float(static_cast<const uint16_t*>(data)[i]);
    default:
      return 0.0f;
  }
}

void store(void* data, size_t i, DataType dtype, float v) {
  switch (dtype) {
    case DataType::kFloat32:
      static_cast<float*>(data)[i] = v;
      return;
    case DataType::kFloat64:
      static_cast<double*>(data)[i] = v;
      return;
    case DataType::kFloat16:
      static_cast<uint16_t*>(data)[i] = detail::float_to_half(v);
      return;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(data)[i] = detail::float_to_bfloat16(v);
      return;
    default:
      return;
  }
}

// float -> 16 bits, then divided by `divisor` in the 16-bit type (computed in float and rounded
// again), exactly as PyTorch's `bucket.buffer().to(torch.float16).div_(world_size)`. The scalar
// conversions cost ~10 ns an element, which on a 10M-parameter model is more than the allreduce
// they save: use F16C where the CPU has it (every x86 CPU since 2012) and a branch-free loop the
// compiler vectorizes for bfloat16.
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void f32_to_f16_f16c(const float* src, uint16_t* dst, size_t n,
                                                         float divisor) {
  const __m256 d = _mm256_set1_ps(divisor);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound);
    const __m256 v = _mm256_div_ps(_mm256_cvtph_ps(h), d);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(v, kRound));
  }
  for (; i < n; ++i)
    dst[i] = detail::float_to_half(detail::half_to_float(detail::float_to_half(src[i])) / divisor);
}

__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const uint16_t* src, float* dst,
                                                         size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = detail::half_to_float(src[i]);
}

bool have_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}
#else
bool have_f16c() { return false; }
void f32_to_f16_f16c(const float*, uint16_t*, size_t, float) {}
void f16_to_f32_f16c(const uint16_t*, float*, size_t) {}
#endif

// Round to nearest even, NaN stays NaN (quiet).
inline uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

inline float f32_of_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Compresses to a 16-bit float type (wire = kFloat16 or kBFloat16). As PyTorch's
// fp16_compress_hook: cast, then divide (before the allreduce, so that the 16-bit sum of the
// ranks' shares does not overflow where the sum of the raw values would; a single gradient
// beyond the 16-bit range is already infinite after the cast, as in PyTorch).
class CompressHook : public CommHook {
 public:
  explicit CompressHook(DataType wire) : wire_(wire) {}

  Work launch(GradBucket& b) override {
    if (b.device != Device::kCpu)
      throw DdpError(name() + ": CUDA buckets are not supported (the compression runs on the CPU)");
    if (b.dtype != DataType::kFloat32 && b.dtype != DataType::kFloat64 &&
        b.dtype != DataType::kFloat16 && b.dtype != DataType::kBFloat16)
      throw DdpError(name() + ": bucket " + std::to_string(b.index) + " has dtype " +
                     dtype_name(b.dtype) + "; only floating-point gradients can be compressed");
    std::vector<uint16_t>& s = scratch_[b.index];
    s.resize(b.numel);
    const float d = static_cast<float>(b.divisor);
    const bool f32 = b.dtype == DataType::kFloat32;
    if (f32 && wire_ == DataType::kFloat16 && have_f16c()) {
      f32_to_f16_f16c(static_cast<const float*>(b.data), s.data(), b.numel, d);
    } else if (f32 && wire_ == DataType::kBFloat16) {
      const float* src = static_cast<const float*>(b.data);
      for (size_t i = 0; i < b.numel; ++i) s[i] = bf16_of(f32_of_bf16(bf16_of(src[i])) / d);
    } else {
      for (size_t i = 0; i < b.numel; ++i) {
        const float v = load(b.data, i, b.dtype);
        s[i] = wire_ == DataType::kFloat16
                   ? detail::float_to_half(detail::half_to_float(detail::float_to_half(v)) / d)
                   : detail::float_to_bfloat16(
                         detail::bfloat16_to_float(detail::float_to_bfloat16(v)) / d);
      }
    }
    return b.group->allreduce_async(s.data(), b.numel, wire_, ReduceOp::kSum, b.timeout);
  }

  void finish(GradBucket& b) override {
    const std::vector<uint16_t>& s = scratch_.at(b.index);
    const bool f32 = b.dtype == DataType::kFloat32;
    if (f32 && wire_ == DataType::kFloat16 && have_f16c())
      return f16_to_f32_f16c(s.data(), static_cast<float*>(b.data), b.numel);
    if (f32 && wire_ == DataType::kBFloat16) {
      float* dst = static_cast<float*>(b.data);
      for (size_t i = 0; i < b.numel; ++i) dst[i] = f32_of_bf16(s[i]);
      return;
    }
    for (size_t i = 0; i < b.numel; ++i) {
      const float v = wire_ == DataType::kFloat16 ? detail::half_to_float(s[i])
                                                  : detail::bfloat16_to_float(s[i]);
      store(b.data, i, b.dtype, v);
    }
  }

  std::string name() const override {
    return wire_ == DataType::kFloat16 ? "fp16_compress_hook" : "bf16_compress_hook";
  }

 private:
  DataType wire_;
  std::map<size_t, std::vector<uint16_t>> scratch_;  // per bucket index
};

class FunctionHook : public CommHook {
 public:
  FunctionHook(std::function<Work(GradBucket&)> launch, std::function<void(GradBucket&)> finish,
               std::string name)
      : launch_(std::move(launch)), finish_(std::move(finish)), name_(std::move(name)) {}
  Work launch(GradBucket& b) override { return launch_(b); }
  void finish(GradBucket& b) override {
    if (finish_) finish_(b);
  }
  std::string name() const override { return name_; }

 private:
  std::function<Work(GradBucket&)> launch_;
  std::function<void(GradBucket&)> finish_;
  std::string name_;
};

}  // namespace

std::shared_ptr<CommHook> allreduce_hook() { return std::make_shared<AllreduceHook>(); }
std::shared_ptr<CommHook> fp16_compress_hook() {
  return std::make_shared<CompressHook>(DataType::kFloat16);
}
std::shared_ptr<CommHook> bf16_compress_hook() {
  return std::make_shared<CompressHook>(DataType::kBFloat16);
}

std::shared_ptr<CommHook> make_comm_hook(std::function<Work(GradBucket&)> launch,
                                         std::function<void(GradBucket&)> finish,
                                         std::string name) {
  if (!launch) throw std::invalid_argument("make_comm_hook: no launch function");
  return std::make_shared<FunctionHook>(std::move(launch), std::move(finish), std::move(name));
}

}  // namespace trun::worker
