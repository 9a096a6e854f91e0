// DistributedDataParallel::Impl's steps (reducer.h): launching buckets through the hook,
// completing and ending a synchronized iteration, and the bucket memory (layout, the
// static_graph rebuild, the coalesced parameter broadcast).

#include <algorithm>
#include <cmath>
#include <cstring>

#include "worker_sdk/src/ddp/bucket_plan.h"
#include "worker_sdk/src/ddp/device_memory.h"
#include "worker_sdk/src/ddp/host_staging.h"
#include "worker_sdk/src/ddp/reducer.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker {

namespace detail {

size_t cap_bytes(double mb, const char* what) {
  constexpr size_t kMiB = size_t{1} << 20;
  if (!(mb > 0) || !std::isfinite(mb))
    throw std::invalid_argument(std::string("DDP: ") + what + " must be positive, got " +
                                std::to_string(mb));
  return std::max<size_t>(1, static_cast<size_t>(mb * static_cast<double>(kMiB)));
}

}  // namespace detail

DistributedDataParallel::Impl::~Impl() {
  for (auto& b : buckets)
    if (b.info.device == Device::kCuda) detail::device_free(b.data);
}

void DistributedDataParallel::Impl::check_usable() {
  if (broken)
    throw DdpError("DDP: the reducer is unusable after an earlier error: " + broken_cause);
}

void DistributedDataParallel::Impl::fail(const std::string& msg) {
  broken = true;
  broken_cause = msg;
  throw DdpError(msg);
}

void DistributedDataParallel::Impl::launch_ready_locked() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
    Bucket& b = buckets[next_launch];
    if (b.info.device == Device::kCuda) detail::device_sync(options.cuda_stream);
    current.bucket_launch[next_launch] = Clock::now();
    b.work = launch_hook_locked(next_launch);
    b.launched = true;
    ++next_launch;
  }
}

void DistributedDataParallel::Impl::reset_iteration_locked() {
  std::fill(marked.begin(), marked.end(), false);
  marked_count = 0;
  next_launch = 0;
  for (auto& b : buckets) {
    b.pending = b.info.params.size();
    b.launched = false;
    b.work = Work();
  }
  current = IterationStats();
  current.bucket_launch.assign(buckets.size(), Clock::time_point());
  divisor = 0;
  apply_premarks_locked();
}

// static_graph + find_unused_parameters: the first iteration's unused parameters count as
// marked from the start (their gradients are zeroed when their bucket launches).
void DistributedDataParallel::Impl::apply_premarks_locked() {
  premarked = 0;
  if (!static_unused_known) return;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!static_unused[i]) continue;
    marked[i] = true;
    ++marked_count;
    ++premarked;
    --buckets[slots[i].bucket].pending;
  }
}

void DistributedDataParallel::Impl::zero_slot(size_t i) {
  const auto& s = slots[i];
  auto& bk = buckets[s.bucket];
  const size_t bytes = params[i].numel * dtype_size(params[i].dtype);
  if (bk.info.device == Device::kCuda)
    detail::device_zero(bk.data + s.byte_offset, bytes, options.cuda_stream);
  else
    std::memset(bk.data + s.byte_offset, 0, bytes);
}

Work DistributedDataParallel::Impl::launch_hook_locked(size_t index) {
  Bucket& b = buckets[index];
  if (static_unused_known)
    for (size_t idx : b.info.params)
      if (static_unused[idx]) zero_slot(idx);
  if (!hook) hook = allreduce_hook();
  if (b.offsets.size() != b.info.params.size()) {
    b.offsets.clear();
    for (size_t idx : b.info.params) b.offsets.push_back(slots[idx].byte_offset);
  }
  GradBucket& g = b.view;
  g.index = index;
  g.num_buckets = buckets.size();
  g.data = b.data;
  g.numel = b.info.numel;
  g.dtype = b.info.dtype;
  g.device = b.info.device;
  g.params = &b.info.params;
  g.offsets = &b.offsets;
  g.group = group;
  g.divisor = divisor > 0 ? divisor : group->size();
  g.timeout = options.timeout;
  g.joined = joined_now;
  try {
    return hook->launch(g);
  } catch (const std::exception& e) {
    fail("DDP: communication hook '" + hook->name() + "' failed to launch bucket " +
         std::to_string(index) + ": " + e.what());
  }
}

void DistributedDataParallel::Impl::complete_marks_locked() {
  if (options.find_unused_parameters) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (marked[i]) continue;
      if (!used_since_sync[i]) {
        unused.push_back(i);
        zero_slot(i);
      }
      marked[i] = true;
      --buckets[slots[i].bucket].pending;
    }
    marked_count = params.size();
    launch_ready_locked();
    return;
  }
  std::string names;
  size_t listed = 0, missing = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (marked[i]) continue;
    ++missing;
    if (listed++ < 8)
      names += (names.empty() ? "" : ", ") + std::to_string(i) + " '" + params[i].name +
               "' (bucket " + std::to_string(slots[i].bucket) + ")";
  }
  if (missing > listed) names += ", ...";
  fail("DDP: finalize() with " + std::to_string(missing) +
       " gradient(s) never marked ready, so their buckets cannot be reduced: " + names +
       ". Mark every parameter's gradient each iteration, or set find_unused_parameters");
}

DistributedDataParallel::Impl::SyncOutcome DistributedDataParallel::Impl::wait_buckets(
    const std::vector<Work>& works) {
  SyncOutcome out;
  std::exception_ptr& err = out.error;
  for (auto& w : works) {
    try {
      w.wait();
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  }
  if (err) return out;
  // The hook's second half (e.g. decompression), in bucket order, on this thread.
  for (size_t b = 0; b < buckets.size() && out.hook_error.empty(); ++b) {
    try {
      hook->finish(buckets[b].view);
    } catch (const CollectiveError&) {  // a hook's own collective (e.g. PowerSGD's Q)
      err = std::current_exception();
      break;
    } catch (const std::exception& e) {
      out.hook_error = "DDP: communication hook '" + hook->name() + "' failed to finish bucket " +
                       std::to_string(b) + ": " + e.what();
    }
  }
  return out;
}

void DistributedDataParallel::Impl::end_sync_locked(const SyncOutcome& outcome) {
  current.finalized = Clock::now();
  stats = current;
  std::fill(used_since_sync.begin(), used_since_sync.end(), false);
  if (outcome.error) {
    reset_iteration_locked();
    broken = true;
    broken_cause = "a bucket's allreduce failed";
    std::rethrow_exception(outcome.error);
  }
  if (!outcome.hook_error.empty()) {
    reset_iteration_locked();
    fail(outcome.hook_error);
  }
  if (options.static_graph && !rebuilt) {
    if (options.find_unused_parameters) {
      static_unused.assign(params.size(), false);
      for (size_t i : unused) static_unused[i] = true;
    }
    std::fill(marked.begin(), marked.end(), false);  // premarks are not applied yet
    marked_count = 0;
    try {
      rebuild_buckets_locked();
    } catch (const DdpError&) {
      throw;  // fail() marked the reducer broken
    } catch (...) {
      broken = true;
      broken_cause = "rebuilding the buckets (static_graph) failed";
      throw;
    }
    static_unused_known = options.find_unused_parameters;
  }
  reset_iteration_locked();
}

// A broadcast of host data; an NCCL group needs device memory, so it is staged there.
void DistributedDataParallel::Impl::broadcast_host(void* data, size_t count, DataType dtype,
                                                   int root) {
  detail::broadcast_host(*group, data, count, dtype, root, options.timeout, options.cuda_stream);
}

// Bucket memory for `plan` and each parameter's place in it (host buckets 64-byte aligned).
void DistributedDataParallel::Impl::lay_out_buckets(std::vector<BucketInfo> plan,
                                                    std::vector<Bucket>& out,
                                                    std::vector<Slot>& out_slots) const {
  out.clear();
  out.resize(plan.size());
  out_slots.assign(params.size(), Slot{});
  for (size_t b = 0; b < plan.size(); ++b) {
    auto& bk = out[b];
    bk.info = std::move(plan[b]);
    size_t off = 0;
    for (size_t idx : bk.info.params) {
      out_slots[idx] = {b, off};
      off += params[idx].numel * dtype_size(params[idx].dtype);
    }
    if (bk.info.device == Device::kCuda) {
      bk.data = static_cast<unsigned char*>(detail::device_alloc(bk.info.bytes));
    } else {
      const size_t alloc = (std::max<size_t>(bk.info.bytes, 1) + 63) / 64 * 64;
      bk.host.reset(static_cast<unsigned char*>(std::aligned_alloc(64, alloc)));
      if (!bk.host) throw std::bad_alloc();
      bk.data = bk.host.get();
    }
  }
}

// static_graph, after the first synchronized iteration: rank 0's arrival order, broadcast, is
// the new bucket order on every rank. The averaged gradients move into the new buckets.
void DistributedDataParallel::Impl::rebuild_buckets_locked() {
  rebuilt = true;
  const size_t n = params.size();
  std::vector<size_t> order = arrival;
  for (size_t k = n; k-- > 0;)
    if (!arrived[k]) order.push_back(k);
  std::vector<int64_t> wire(order.begin(), order.end());
  broadcast_host(wire.data(), n, DataType::kInt64, 0);
  std::vector<bool> seen(n, false);
  for (size_t k = 0; k < n; ++k) {
    if (wire[k] < 0 || static_cast<size_t>(wire[k]) >= n || seen[wire[k]])
      fail("DDP: static_graph: rank 0's gradient order is not a permutation of the " +
           std::to_string(n) + " parameters (do all ranks register the same parameters?)");
    seen[wire[k]] = true;
    order[k] = static_cast<size_t>(wire[k]);
  }
  auto plan =
      detail::plan_buckets(params, order, detail::cap_bytes(options.bucket_cap_mb, "bucket_cap_mb"),
                           detail::cap_bytes(options.first_bucket_cap_mb, "first_bucket_cap_mb"));
  std::vector<Bucket> fresh;
  std::vector<Slot> fresh_slots;
  lay_out_buckets(std::move(plan), fresh, fresh_slots);
  for (size_t i = 0; i < n; ++i) {
    const size_t bytes = params[i].numel * dtype_size(params[i].dtype);
    if (bytes == 0) continue;
    unsigned char* dst = fresh[fresh_slots[i].bucket].data + fresh_slots[i].byte_offset;
    const unsigned char* src = buckets[slots[i].bucket].data + slots[i].byte_offset;
    if (params[i].device == Device::kCuda)
      detail::device_copy(dst, src, bytes, options.cuda_stream);
    else
      std::memcpy(dst, src, bytes);
  }
  for (auto& b : buckets)
    if (b.info.device == Device::kCuda) detail::device_free(b.data);
  buckets = std::move(fresh);
  slots = std::move(fresh_slots);
  infos.clear();
  for (auto& b : buckets) infos.push_back(b.info);
  arrival.clear();
  arrival.shrink_to_fit();
}

void DistributedDataParallel::Impl::broadcast_params_from(int root) {
  if (marked_count > premarked) fail("DDP: broadcast_parameters() in the middle of backward");
  // Coalesced: pack each bucket's parameters into its (free at this point) gradient buffer,
  // broadcast the bucket, unpack. One collective per bucket instead of one per parameter.
  for (auto& b : buckets) {
    if (b.info.bytes == 0) continue;
    for (size_t idx : b.info.params) {
      const auto& p = params[idx];
      const size_t bytes = p.numel * dtype_size(p.dtype);
      if (bytes == 0) continue;
      void* slot = b.data + slots[idx].byte_offset;
      if (b.info.device == Device::kCuda)
        detail::device_copy(slot, p.data, bytes, options.cuda_stream);
      else
        detail::copy_bytes(slot, p.data, bytes);
    }
    group->broadcast(b.data, b.info.numel, b.info.dtype, root, options.timeout);
    for (size_t idx : b.info.params) {
      const auto& p = params[idx];
      const size_t bytes = p.numel * dtype_size(p.dtype);
      if (bytes == 0) continue;
      const void* slot = b.data + slots[idx].byte_offset;
      if (b.info.device == Device::kCuda)
        detail::device_copy(p.data, slot, bytes, options.cuda_stream);
      else
        detail::copy_bytes(p.data, slot, bytes);
    }
    if (b.info.device == Device::kCuda)
      detail::device_zero(b.data, b.info.bytes, options.cuda_stream);
    else
      std::memset(b.data, 0, b.info.bytes);
  }
}

void DistributedDataParallel::Impl::broadcast_list(std::vector<Parameter>& list, int root) {
  for (auto& p : list) {
    if (p.numel == 0) continue;
    group->broadcast(p.data, p.numel, p.dtype, root, options.timeout);
  }
}

}  // namespace trun::worker
