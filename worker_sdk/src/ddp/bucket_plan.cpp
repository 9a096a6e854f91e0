#include "worker_sdk/src/ddp/bucket_plan.h"

#include <algorithm>
#include <map>
#include <utility>

namespace trun::worker::detail {

std::vector<BucketInfo> plan_buckets(const std::vector<Parameter>& params,
                                     const std::vector<size_t>& order, size_t cap,
                                     size_t first_cap) {
  std::vector<size_t> position(params.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  struct Open {
    BucketInfo info;
    bool any_closed = false;
  };
  std::map<std::pair<int, int>, Open> open;
  std::vector<BucketInfo> closed;
  for (size_t k : order) {
    const auto& p = params[k];
    Open& o = open[std::make_pair(static_cast<int>(p.dtype), static_cast<int>(p.device))];
    o.info.dtype = p.dtype;
    o.info.device = p.device;
    o.info.params.push_back(k);
    o.info.numel += p.numel;
    o.info.bytes += p.numel * dtype_size(p.dtype);
    if (o.info.bytes >= (o.any_closed ? cap : first_cap)) {
      closed.push_back(std::move(o.info));
      o.info = BucketInfo();
      o.any_closed = true;
    }
  }
  std::vector<BucketInfo> rest;
  for (auto& kv : open)
    if (!kv.second.info.params.empty()) rest.push_back(std::move(kv.second.info));
  std::sort(rest.begin(), rest.end(), [&](const BucketInfo& a, const BucketInfo& b) {
    return position[a.params[0]] < position[b.params[0]];
  });
  for (auto& r : rest) closed.push_back(std::move(r));
  return closed;
}

}  // namespace trun::worker::detail
