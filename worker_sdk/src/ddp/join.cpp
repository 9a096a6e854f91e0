// DistributedDataParallel::join_iteration (trun/ddp.h): uneven inputs. A rank out of input
// shadows the others' synchronized steps (zero gradients, divided by the ranks still training)
// until every rank has joined; then the ranks that trained the longest broadcast the model.

#include <mutex>
#include <vector>

#include "trun/ddp.h"
#include "worker_sdk/src/ddp/reducer.h"

namespace trun::worker {

bool DistributedDataParallel::join_iteration(bool has_input) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.check_usable();
    if (m.marked_count > m.premarked)
      m.fail("DDP: join_iteration() in the middle of backward (call it before the step's forward)");
    if (m.no_sync)
      m.fail("DDP: join_iteration() inside a NoSync guard: call it once per synchronized step");
    for (const auto& b : m.buckets)
      if (b.info.device == Device::kCuda)
        throw std::invalid_argument(
            "DDP: join_iteration() with CUDA parameters is not supported (dividing by the "
            "number of ranks with input needs a device kernel)");
  }
  const int world = m.group->size();
  auto count = [&](int64_t mine) {
    int64_t v = mine;
    m.group->allreduce(&v, 1, DataType::kInt64, ReduceOp::kSum, m.options.timeout);
    return v;
  };
  auto divisor_for = [&](int64_t active) {
    return m.options.join_divide_by_initial_world_size ? world : static_cast<int>(active);
  };
  auto early = [&](int64_t active) {
    if (m.options.join_throw_on_early_termination && active < world)
      throw DdpError("DDP: join_iteration(): " + std::to_string(world - active) + " of " +
                     std::to_string(world) +
                     " ranks ran out of input (join_throw_on_early_termination)");
  };
  if (has_input) {
    const int64_t active = count(1);
    early(active);
    std::lock_guard<std::mutex> lock(m.mu);
    m.divisor = divisor_for(active);
    ++m.join_steps;
    return true;
  }
  m.joined_at = m.join_steps;
  // Shadow the others' steps. Each pass is bounded by the collectives' timeouts; the loop ends
  // when every rank has joined, or with a CollectiveError when a peer fails.
  for (;;) {
    const int64_t active = count(0);
    early(active);
    if (active == 0) break;
    zero_grad();
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.divisor = divisor_for(active);
      m.joined_now = true;
    }
    // Marked in bucket order: under static_graph this rank's "arrival order" is the current one.
    std::vector<size_t> order;
    for (const auto& b : m.buckets)
      for (size_t idx : b.info.params)
        if (!m.marked[idx]) order.push_back(idx);
    for (size_t idx : order) mark_ready(idx);
    finalize();
    std::lock_guard<std::mutex> lock(m.mu);
    m.joined_now = false;
    ++m.join_steps;
  }
  // Every rank is done: the ranks that trained the longest hold the final model.
  std::vector<int64_t> joined(static_cast<size_t>(world), 0);
  int64_t mine = m.joined_at;
  m.group->allgather(&mine, joined.data(), 1, DataType::kInt64, m.options.timeout);
  int source = 0;
  for (int r = 1; r < world; ++r)
    if (joined[r] > joined[source]) source = r;
  if (world > 1) {
    m.broadcast_params_from(source);
    m.broadcast_list(m.buffers, source);
  }
  std::lock_guard<std::mutex> lock(m.mu);
  m.join_steps = 0;
  m.joined_at = -1;
  return false;
}

}  // namespace trun::worker
