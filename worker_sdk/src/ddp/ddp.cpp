// DistributedDataParallel (trun/ddp.h): construction, the per-iteration calls (zero_grad,
// mark_ready, finalize), no_sync, broadcasts and the hook's registration. The reducer's state
// and steps are reducer.h's; join_iteration is in join.cpp.

#include "trun/ddp.h"

#include <algorithm>
#include <cstring>
#include <mutex>

#include "worker_sdk/src/ddp/bucket_plan.h"
#include "worker_sdk/src/ddp/device_memory.h"
#include "worker_sdk/src/ddp/reducer.h"
#include "worker_sdk/src/progress/progress.h"

namespace trun::worker {

using Clock = std::chrono::steady_clock;

DistributedDataParallel::DistributedDataParallel(ProcessGroup& group, std::vector<Parameter> params,
                                                 DdpOptions options, std::vector<Parameter> buffers)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.group = &group;
  m.options = options;
  if (params.empty()) throw std::invalid_argument("DDP: no parameters");
  const size_t cap = detail::cap_bytes(options.bucket_cap_mb, "bucket_cap_mb");
  const size_t first_cap = detail::cap_bytes(options.first_bucket_cap_mb, "first_bucket_cap_mb");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const std::string label = "DDP: parameter " + std::to_string(i) + " '" + p.name + "'";
    if (p.numel > 0 && !p.data) throw std::invalid_argument(label + " has no data");
    (void)dtype_size(p.dtype);
    if (p.device == Device::kCuda && group.backend() != Backend::kNccl)
      throw std::invalid_argument(label + " is on CUDA but the group's backend is " +
                                  group.backend_description() + " (CUDA needs NCCL)");
    if (p.device == Device::kCpu && group.backend() == Backend::kNccl)
      throw std::invalid_argument(label + " is in host memory but the group is NCCL");
  }
  for (const auto& b : buffers) {
    if (b.numel > 0 && !b.data)
      throw std::invalid_argument("DDP: buffer '" + b.name + "' has no data");
    (void)dtype_size(b.dtype);
  }
  if (options.check_parameters_across_ranks && group.size() > 1)
    check_parameters_across_ranks(group, params, options.timeout);
  m.params = std::move(params);
  m.buffers = std::move(buffers);

  // Buckets in reverse registration order (the order backward produces gradients).
  std::vector<size_t> order(m.params.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = order.size() - 1 - k;
  m.lay_out_buckets(detail::plan_buckets(m.params, order, cap, first_cap), m.buckets, m.slots);
  for (const auto& bk : m.buckets) m.infos.push_back(bk.info);
  m.marked.assign(m.params.size(), false);
  m.used_since_sync.assign(m.params.size(), false);
  m.arrived.assign(m.params.size(), false);
  m.reset_iteration_locked();

  if (options.broadcast_on_construction && group.size() > 1) {
    broadcast_parameters();
    if (!m.buffers.empty()) broadcast_buffers();
  }
  zero_grad();
}

DistributedDataParallel::~DistributedDataParallel() {
  // Collectives still queued read bucket memory: let them finish (each bounded by its timeout).
  for (auto& b : impl_->buckets) {
    if (!b.launched) continue;
    try {
      b.work.wait();
    } catch (...) {
    }
  }
}

size_t DistributedDataParallel::num_parameters() const { return impl_->params.size(); }

const Parameter& DistributedDataParallel::parameter(size_t i) const {
  if (i >= impl_->params.size())
    throw std::out_of_range("DDP: parameter index " + std::to_string(i) + " out of range");
  return impl_->params[i];
}

void* DistributedDataParallel::grad(size_t i) {
  if (i >= impl_->params.size())
    throw std::out_of_range("DDP: parameter index " + std::to_string(i) + " out of range");
  const auto& s = impl_->slots[i];
  return impl_->buckets[s.bucket].data + s.byte_offset;
}

void DistributedDataParallel::zero_grad() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.check_usable();
  if (m.marked_count > m.premarked)
    m.fail("DDP: zero_grad() in the middle of backward (" +
           std::to_string(m.marked_count - m.premarked) +
           " gradients marked, finalize() not called)");
  for (auto& b : m.buckets) {
    if (b.info.device == Device::kCuda)
      detail::device_zero(b.data, b.info.bytes, m.options.cuda_stream);
    else
      std::memset(b.data, 0, b.info.bytes);
  }
}

void DistributedDataParallel::mark_ready(size_t i) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.check_usable();
  if (i >= m.params.size())
    m.fail("DDP: mark_ready(" + std::to_string(i) + "): there are only " +
           std::to_string(m.params.size()) + " parameters");
  if (m.static_unused_known && m.static_unused[i])
    m.fail("DDP: static_graph: parameter " + std::to_string(i) + " '" + m.params[i].name +
           "' was unused in the first iteration but is marked ready now: the graph is not "
           "static (set static_graph = false)");
  if (m.marked[i])
    m.fail("DDP: gradient of parameter " + std::to_string(i) + " '" + m.params[i].name +
           "' marked ready twice in one iteration (is finalize() missing, or does the model use "
           "the parameter twice?)");
  const auto now = Clock::now();
  if (m.marked_count == m.premarked) m.current.first_mark = now;
  if (m.options.static_graph && !m.rebuilt && !m.arrived[i]) {
    m.arrived[i] = true;
    m.arrival.push_back(i);
  }
  m.marked[i] = true;
  m.used_since_sync[i] = true;
  ++m.marked_count;
  Impl::Bucket& b = m.buckets[m.slots[i].bucket];
  --b.pending;
  if (!m.no_sync && b.pending == 0) m.launch_ready_locked();
  if (m.marked_count == m.params.size()) {
    m.current.last_mark = Clock::now();
    size_t done = 0;
    for (auto& bk : m.buckets)
      if (bk.launched && bk.work.is_completed()) ++done;
    m.current.buckets_done_at_last_mark = done;
  }
}

void DistributedDataParallel::finalize() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  m.check_usable();
  if (m.no_sync) {  // accumulate locally; nothing to communicate
    std::fill(m.marked.begin(), m.marked.end(), false);
    m.marked_count = 0;
    for (auto& b : m.buckets) b.pending = b.info.params.size();
    m.apply_premarks_locked();
    detail::progress::step();
    return;
  }
  m.unused.clear();
  if (m.static_unused_known)
    for (size_t i = 0; i < m.params.size(); ++i)
      if (m.static_unused[i]) m.unused.push_back(i);
  if (m.marked_count < m.params.size()) m.complete_marks_locked();
  // Every bucket has launched (all gradients are marked). Wait in order.
  std::vector<Work> works;
  for (auto& b : m.buckets) works.push_back(b.work);
  lock.unlock();
  const Impl::SyncOutcome outcome = m.wait_buckets(works);
  lock.lock();
  m.end_sync_locked(outcome);
  detail::progress::step();
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel* ddp) : ddp_(ddp) {
  std::lock_guard<std::mutex> lock(ddp_->impl_->mu);
  previous_ = ddp_->impl_->no_sync;
  ddp_->impl_->no_sync = true;
}

DistributedDataParallel::NoSync::NoSync(NoSync&& other) noexcept
    : ddp_(other.ddp_), previous_(other.previous_) {
  other.ddp_ = nullptr;
}

DistributedDataParallel::NoSync::~NoSync() {
  if (!ddp_) return;
  std::lock_guard<std::mutex> lock(ddp_->impl_->mu);
  ddp_->impl_->no_sync = previous_;
}

void DistributedDataParallel::broadcast_buffers() {
  impl_->check_usable();
  impl_->broadcast_list(impl_->buffers);
}

void DistributedDataParallel::broadcast_parameters() {
  impl_->check_usable();
  impl_->broadcast_params_from(0);
}

void DistributedDataParallel::register_comm_hook(std::shared_ptr<CommHook> hook) {
  Impl& m = *impl_;
  if (!hook) throw std::invalid_argument("DDP: register_comm_hook(nullptr)");
  std::lock_guard<std::mutex> lock(m.mu);
  m.check_usable();
  if (m.hook_registered)
    throw DdpError("DDP: register_comm_hook() can be called only once (a '" + m.hook->name() +
                   "' is registered)");
  if (m.marked_count > m.premarked) m.fail("DDP: register_comm_hook() in the middle of backward");
  m.hook = std::move(hook);
  m.hook_registered = true;
}

int64_t DistributedDataParallel::join_steps() const { return impl_->join_steps; }

const std::vector<BucketInfo>& DistributedDataParallel::buckets() const { return impl_->infos; }

const IterationStats& DistributedDataParallel::last_iteration() const { return impl_->stats; }

std::vector<size_t> DistributedDataParallel::unused_parameters() const { return impl_->unused; }

}  // namespace trun::worker
