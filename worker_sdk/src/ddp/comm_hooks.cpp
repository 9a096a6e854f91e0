// The built-in communication hooks (trun/ddp.h): allreduce, fp16 and bf16 compression.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

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
    s.resize(b.numel);  // allocates in the first step only
    if (b.dtype == DataType::kFloat32) {
      // float -> 16 bits, then divided in the 16-bit type (computed in float, rounded again),
      // exactly as PyTorch's `bucket.buffer().to(torch.float16).div_(world_size)`; one pass,
      // vectorised (detail::float_to_16bit: F16C/AVX2/AVX-512 where the CPU has them).
      detail::float_to_16bit(s.data(), static_cast<const float*>(b.data), b.numel, wire_,
                             b.divisor);
    } else {
      const float d = static_cast<float>(b.divisor);
      const bool f16 = wire_ == DataType::kFloat16;
      for (size_t i = 0; i < b.numel; ++i) {
        const float v = load(b.data, i, b.dtype);
        s[i] = f16 ? detail::float_to_half(detail::half_to_float(detail::float_to_half(v)) / d)
                   : detail::float_to_bfloat16(
                         detail::bfloat16_to_float(detail::float_to_bfloat16(v)) / d);
      }
    }
    return b.group->allreduce_async(s.data(), b.numel, wire_, ReduceOp::kSum, b.timeout);
  }

  void finish(GradBucket& b) override {
    const std::vector<uint16_t>& s = scratch_.at(b.index);
    if (b.dtype == DataType::kFloat32)
      return detail::float_from_16bit(static_cast<float*>(b.data), s.data(), b.numel, wire_);
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
