// PowerSGD gradient compression as a DDP communication hook (trun/ddp.h powersgd_hook), following
// the algorithm of PyTorch's powerSGD_hook: per bucket, error feedback over the whole bucket,
// uncompressed tensors allreduced together, P = M Q allreduced and orthogonalized, Q = M^T P
// allreduced and divided, M = P Q^T. Matrices are row-major float32 inside the bucket.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/splitmix64.h"
#include "trun/ddp.h"

namespace trun::worker {

namespace {

using base::splitmix64;

// Standard normal values (Box-Muller), the same for the same seed on every platform.
void fill_normal(float* out, size_t n, uint64_t seed) {
  uint64_t s = seed;
  for (size_t i = 0; i < n; i += 2) {
    const double u1 = (static_cast<double>(splitmix64(s) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(splitmix64(s) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(r * std::cos(2.0 * M_PI * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(r * std::sin(2.0 * M_PI * u2));
  }
}

// Gram-Schmidt on the columns of a rows x r row-major matrix, in place (PyTorch's
// _orthogonalize_gram_schmidt; a zero column stays zero instead of becoming NaN).
void orthogonalize(float* m, size_t rows, size_t r, float epsilon) {
  for (size_t i = 0; i < r; ++i) {
    double norm = 0;
    for (size_t k = 0; k < rows; ++k) norm += double(m[k * r + i]) * m[k * r + i];
    norm = std::sqrt(norm);
    const double div = epsilon == 0.0f ? norm : norm + epsilon;
    for (size_t k = 0; k < rows; ++k)
      m[k * r + i] = div > 0 ? static_cast<float>(m[k * r + i] / div) : 0.0f;
    for (size_t j = i + 1; j < r; ++j) {
      double dot = 0;
      for (size_t k = 0; k < rows; ++k) dot += double(m[k * r + i]) * m[k * r + j];
      for (size_t k = 0; k < rows; ++k) m[k * r + j] -= static_cast<float>(dot * m[k * r + i]);
    }
  }
}

// out (n x r, row-major) = A x, with A (n x m) read as a[i * row_stride + j * col_stride]: a
// row-major rows x cols matrix itself (cols, 1) or its transpose (1, cols); x is m x r.
// Accumulates in double.
void multiply(const float* a, size_t n, size_t m, size_t row_stride, size_t col_stride,
              const float* x, size_t r, float* out) {
  for (size_t i = 0; i < n; ++i)
    for (size_t k = 0; k < r; ++k) {
      double acc = 0;
      for (size_t j = 0; j < m; ++j)
        acc += double(a[i * row_stride + j * col_stride]) * x[j * r + k];
      out[i * r + k] = static_cast<float>(acc);
    }
}

class PowerSgdHook : public CommHook {
 public:
  explicit PowerSgdHook(PowerSgdOptions o) : o_(std::move(o)) {
    if (o_.matrix_approximation_rank < 1)
      throw std::invalid_argument("powersgd_hook: matrix_approximation_rank must be >= 1, got " +
                                  std::to_string(o_.matrix_approximation_rank));
    if (o_.start_powersgd_iter < 0 || o_.min_compression_rate < 0)
      throw std::invalid_argument(
          "powersgd_hook: start_powersgd_iter and min_compression_rate must be >= 0");
    // As PyTorch: per-bucket state must not be built in the first iteration (static_graph
    // rebuilds the buckets after it).
    if ((o_.use_error_feedback || o_.warm_start) && o_.start_powersgd_iter < 2)
      throw std::invalid_argument(
          "powersgd_hook: start_powersgd_iter must be >= 2 with use_error_feedback or warm_start "
          "(got " +
          std::to_string(o_.start_powersgd_iter) + ")");
    for (const auto& [idx, shape] : o_.matrix_shapes)
      if (shape.first == 0 || shape.second == 0)
        throw std::invalid_argument("powersgd_hook: parameter " + std::to_string(idx) +
                                    " has an empty matrix shape");
  }

  std::string name() const override { return "powersgd_hook"; }

  Work launch(GradBucket& b) override {
    if (b.device != Device::kCpu || b.dtype != DataType::kFloat32)
      throw DdpError("powersgd_hook: only host float32 buckets are supported (bucket " +
                     std::to_string(b.index) + " is " + dtype_name(b.dtype) + " on " +
                     (b.device == Device::kCpu ? "the CPU" : "CUDA") + ")");
    State& st = state_[b.index];
    const bool last = b.index + 1 == b.num_buckets;
    st.vanilla = iter_ < o_.start_powersgd_iter;
    if (last) ++iter_;
    float* data = static_cast<float*>(b.data);
    if (st.vanilla) {
      const bool avg = b.divisor == b.group->size();
      return b.group->allreduce_async(data, b.numel, b.dtype, avg ? ReduceOp::kAvg : ReduceOp::kSum,
                                      b.timeout);
    }
    layout(b, st);  // (resets st when the bucket changed)
    st.vanilla = false;
    if (o_.use_error_feedback) {
      if (st.error.size() != b.numel) st.error.assign(b.numel, 0.0f);
      for (size_t i = 0; i < b.numel; ++i) data[i] += st.error[i];
      st.input.assign(data, data + b.numel);
    }
    st.flat.clear();
    for (const auto& [off, n] : st.plain) st.flat.insert(st.flat.end(), data + off, data + off + n);
    const bool randomize = !o_.warm_start || !st.q_ready;
    if (randomize) {
      uint64_t seed = o_.seed ^ (0x5851f42d4c957f2dull * (b.index + 1)) ^ (randomizations_++ << 32);
      fill_normal(st.q.data(), st.q.size(), splitmix64(seed));
      st.q_ready = true;
    }
    for (const auto& m : st.mats) {
      float* q = st.q.data() + m.q_off;
      orthogonalize(q, m.cols, m.rank, o_.orthogonalization_epsilon);
      // P = M Q: (rows x cols) (cols x r).
      multiply(data + m.offset, m.rows, m.cols, m.cols, 1, q, m.rank, st.p.data() + m.p_off);
    }
    (void)b.group->allreduce_async(st.flat.data(), st.flat.size(), DataType::kFloat32,
                                   ReduceOp::kSum, b.timeout);
    return b.group->allreduce_async(st.p.data(), st.p.size(), DataType::kFloat32, ReduceOp::kSum,
                                    b.timeout);
  }

  void finish(GradBucket& b) override {
    State& st = state_.at(b.index);
    float* data = static_cast<float*>(b.data);
    const float d = static_cast<float>(b.divisor);
    if (st.vanilla) {
      if (b.divisor != b.group->size())
        for (size_t i = 0; i < b.numel; ++i) data[i] /= d;
      return;
    }
    size_t at = 0;
    for (const auto& [off, n] : st.plain)
      for (size_t i = 0; i < n; ++i) data[off + i] = st.flat[at++] / d;
    for (const auto& m : st.mats) {
      float* p = st.p.data() + m.p_off;
      orthogonalize(p, m.rows, m.rank, o_.orthogonalization_epsilon);
      // Q = M^T P: (cols x rows) (rows x r).
      multiply(data + m.offset, m.cols, m.rows, 1, m.cols, p, m.rank, st.q.data() + m.q_off);
    }
    b.group->allreduce(st.q.data(), st.q.size(), DataType::kFloat32, ReduceOp::kSum, b.timeout);
    for (float& v : st.q) v /= d;
    for (const auto& m : st.mats) {
      const float* p = st.p.data() + m.p_off;
      const float* q = st.q.data() + m.q_off;
      float* mat = data + m.offset;
      for (size_t i = 0; i < m.rows; ++i)
        for (size_t j = 0; j < m.cols; ++j) {
          double acc = 0;
          for (size_t k = 0; k < m.rank; ++k) acc += double(p[i * m.rank + k]) * q[j * m.rank + k];
          mat[i * m.cols + j] = static_cast<float>(acc);
        }
    }
    if (o_.use_error_feedback)
      for (size_t i = 0; i < b.numel; ++i) st.error[i] = st.input[i] - data[i];
  }

 private:
  struct Matrix {
    size_t offset, rows, cols, rank, p_off, q_off;  // offsets in elements
  };
  struct State {
    bool vanilla = true;
    size_t layout_numel = SIZE_MAX;
    std::vector<size_t> layout_params;
    std::vector<Matrix> mats;
    std::vector<std::pair<size_t, size_t>> plain;  // (offset, numel) in elements
    std::vector<float> error, input, flat, p, q;
    bool q_ready = false;
  };

  void layout(const GradBucket& b, State& st) {
    if (st.layout_numel == b.numel && st.layout_params == *b.params) return;
    st = State();  // the bucket changed (static_graph rebuilt it): start afresh
    st.layout_numel = b.numel;
    st.layout_params = *b.params;
    size_t p_size = 0, q_size = 0;
    for (size_t j = 0; j < b.params->size(); ++j) {
      const size_t idx = (*b.params)[j];
      const size_t off = (*b.offsets)[j] / sizeof(float);
      const size_t end = j + 1 < b.params->size() ? (*b.offsets)[j + 1] / sizeof(float) : b.numel;
      const size_t n = end - off;
      auto it = o_.matrix_shapes.find(idx);
      if (it != o_.matrix_shapes.end()) {
        const auto [rows, cols] = it->second;
        if (rows * cols != n)
          throw DdpError("powersgd_hook: parameter " + std::to_string(idx) + " has " +
                         std::to_string(n) + " elements but its matrix shape is " +
                         std::to_string(rows) + " x " + std::to_string(cols));
        const size_t r = std::min<size_t>({rows, cols, size_t(o_.matrix_approximation_rank)});
        if ((rows + cols) * r * static_cast<size_t>(o_.min_compression_rate) < rows * cols) {
          st.mats.push_back({off, rows, cols, r, p_size, q_size});
          p_size += rows * r;
          q_size += cols * r;
          continue;
        }
      }
      st.plain.emplace_back(off, n);
    }
    st.p.assign(p_size, 0.0f);
    st.q.assign(q_size, 0.0f);
  }

  PowerSgdOptions o_;
  std::map<size_t, State> state_;
  int64_t iter_ = 0;
  uint64_t randomizations_ = 0;
};

}  // namespace

std::shared_ptr<CommHook> powersgd_hook(PowerSgdOptions options) {
  return std::make_shared<PowerSgdHook>(std::move(options));
}

}  // namespace trun::worker
