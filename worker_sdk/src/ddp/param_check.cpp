// The cross-rank parameter check (trun/ddp.h, check_parameters_across_ranks): every rank
// publishes a fixed-size record per parameter through allgather, and every rank then reaches the
// same verdict from the same data, so all of them throw the same message (none waits for a
// collective the others skipped).

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "trun/ddp.h"
#include "worker_sdk/src/ddp/host_staging.h"

namespace trun::worker {

namespace {

// dtype, device, numel, ndim, dims[0..kDims), hash of all dims.
constexpr size_t kDims = 7;
constexpr size_t kRecord = 4 + kDims + 1;

void encode(const Parameter& p, const std::vector<int64_t>& shape, int64_t* r) {
  r[0] = static_cast<int64_t>(p.dtype);
  r[1] = static_cast<int64_t>(p.device);
  r[2] = static_cast<int64_t>(p.numel);
  r[3] = static_cast<int64_t>(shape.size());
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the dims
  for (size_t d = 0; d < shape.size(); ++d) {
    if (d < kDims) r[4 + d] = shape[d];
    h = (h ^ static_cast<uint64_t>(shape[d])) * 1099511628211ull;
  }
  for (size_t d = shape.size(); d < kDims; ++d) r[4 + d] = 0;
  r[4 + kDims] = static_cast<int64_t>(h);
}

std::string describe(const int64_t* r) {
  std::ostringstream os;
  os << "shape [";
  for (int64_t d = 0; d < r[3]; ++d) {
    if (d) os << ", ";
    if (static_cast<size_t>(d) == kDims) {
      os << "...";
      break;
    }
    os << r[4 + d];
  }
  const int64_t dt = r[0];
  os << "] (" << r[2] << " elements) "
     << (dt >= 0 && dt <= static_cast<int64_t>(DataType::kInt64)
             ? dtype_name(static_cast<DataType>(dt))
             : "?")
     << " on " << (r[1] == static_cast<int64_t>(Device::kCuda) ? "cuda" : "cpu");
  return os.str();
}

bool product_matches(const int64_t* r) {
  // Only checkable in full when every dim is in the record.
  if (r[3] > static_cast<int64_t>(kDims)) return true;
  int64_t n = 1;
  for (int64_t d = 0; d < r[3]; ++d) n *= r[4 + d];
  return n == r[2];
}

}  // namespace

void check_parameters_across_ranks(ProcessGroup& group, const std::vector<Parameter>& params,
                                   std::chrono::milliseconds timeout,
                                   const std::vector<std::vector<int64_t>>& shapes) {
  if (!shapes.empty() && shapes.size() != params.size())
    throw std::invalid_argument(
        "DDP: check_parameters_across_ranks: " + std::to_string(shapes.size()) + " shapes for " +
        std::to_string(params.size()) + " parameters");
  const int world = group.size();
  const int64_t count = static_cast<int64_t>(params.size());
  std::vector<int64_t> counts(static_cast<size_t>(world));
  detail::allgather_host(group, &count, counts.data(), 1, DataType::kInt64, timeout, nullptr);
  for (int r = 1; r < world; ++r)
    if (counts[static_cast<size_t>(r)] != counts[0])
      throw std::invalid_argument("DDP: the ranks registered different parameters: rank 0 has " +
                                  std::to_string(counts[0]) + " parameters, rank " +
                                  std::to_string(r) + " has " +
                                  std::to_string(counts[static_cast<size_t>(r)]));
  if (count == 0) return;
  const size_t per_rank = params.size() * kRecord;
  std::vector<int64_t> mine(per_rank), all(per_rank * static_cast<size_t>(world));
  for (size_t i = 0; i < params.size(); ++i)
    encode(params[i],
           shapes.empty() ? std::vector<int64_t>{static_cast<int64_t>(params[i].numel)} : shapes[i],
           &mine[i * kRecord]);
  detail::allgather_host(group, mine.data(), all.data(), per_rank, DataType::kInt64, timeout,
                         nullptr);
  auto rec = [&](int r, size_t i) { return &all[static_cast<size_t>(r) * per_rank + i * kRecord]; };
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string label = "DDP: parameter " + std::to_string(i) + " '" + params[i].name + "'";
    for (int r = 0; r < world; ++r)
      if (!product_matches(rec(r, i)))
        throw std::invalid_argument(label + " on rank " + std::to_string(r) + ": its " +
                                    describe(rec(r, i)) + " do not match its element count");
    for (int r = 1; r < world; ++r) {
      bool same = true;
      for (size_t k = 0; k < kRecord; ++k) same = same && rec(r, i)[k] == rec(0, i)[k];
      if (same) continue;
      throw std::invalid_argument(label + " differs across ranks: rank 0 has " +
                                  describe(rec(0, i)) + ", rank " + std::to_string(r) + " has " +
                                  describe(rec(r, i)) + " (every rank must build the same model)");
    }
  }
}

}  // namespace trun::worker
