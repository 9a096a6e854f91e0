#pragma once
// Bucket assignment for the DDP reducer (private to libtrun_worker), used when static_graph
// rebuilds the buckets in gradient arrival order.

#include <cstddef>
#include <vector>

#include "trun/ddp.h"

namespace trun::worker::detail {

// Buckets for `params` taken in `order` (a permutation of their indices, the order gradients
// become ready): one open bucket per (dtype, device); a bucket closes once it reaches its cap (the
// first closed bucket of each kind: first_cap). Leftover open buckets come last, ordered by the
// position of their first parameter in `order`. With order = n-1, ..., 0 this is the
// constructor's assignment.
std::vector<BucketInfo> plan_buckets(const std::vector<Parameter>& params,
                                     const std::vector<size_t>& order, size_t cap,
                                     size_t first_cap);

}  // namespace trun::worker::detail
