#include "trun/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "worker_sdk/src/ddp/bucket_plan.h"
#include "worker_sdk/src/ddp/device_memory.h"
#include "worker_sdk/src/ddp/host_staging.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker {

using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kMiB = size_t{1} << 20;

size_t cap_bytes(double mb, const char* what) {
  if (!(mb > 0) || !std::isfinite(mb))
    throw std::invalid_argument(std::string("DDP: ") + what + " must be positive, got " +
                                std::to_string(mb));
  return std::max<size_t>(1, static_cast<size_t>(mb * static_cast<double>(kMiB)));
}

struct HostFree {
  void operator()(unsigned char* p) const { std::free(p); }
};

}  // namespace

struct DistributedDataParallel::Impl {
  struct Bucket {
    BucketInfo info;
    unsigned char* data = nullptr;  // host or device
    std::unique_ptr<unsigned char, HostFree> host;
    size_t pending = 0;  // gradients not yet marked this iteration
    bool launched = false;
    Work work;
    std::vector<size_t> offsets;  // byte offset of each parameter's gradient (hooks)
    GradBucket view;              // what the hook sees; valid from launch to finish
  };
  struct Slot {
    size_t bucket = 0;
    size_t byte_offset = 0;
  };

  ProcessGroup* group = nullptr;
  std::vector<Parameter> params;
  std::vector<Parameter> buffers;
  DdpOptions options;
  std::vector<Bucket> buckets;
  std::vector<BucketInfo> infos;
  std::vector<Slot> slots;

  std::mutex mu;  // guards the iteration state below (mark_ready may come from several threads)
  std::vector<bool> marked;           // this iteration
  std::vector<bool> used_since_sync;  // across no_sync iterations
  size_t marked_count = 0;
  size_t next_launch = 0;
  bool no_sync = false;
  bool broken = false;
  std::string broken_cause;
  IterationStats stats, current;
  std::vector<size_t> unused;

  // Communication hook (allreduce_hook() unless one was registered).
  std::shared_ptr<CommHook> hook;
  bool hook_registered = false;
  // Join: this iteration's divisor (0: the group size), and whether this rank is shadowing.
  int divisor = 0;
  bool joined_now = false;
  int64_t join_steps = 0;
  int64_t joined_at = -1;
  // static_graph: gradient arrival order until the rebuild; then the first iteration's unused
  // parameters, marked in advance each iteration (`premarked` of them).
  std::vector<size_t> arrival;
  std::vector<bool> arrived;
  bool rebuilt = false;
  std::vector<bool> static_unused;
  bool static_unused_known = false;
  size_t premarked = 0;

  ~Impl() {
    for (auto& b : buckets)
      if (b.info.device == Device::kCuda) detail::device_free(b.data);
  }

  void check_usable() {
    if (broken)
      throw DdpError("DDP: the reducer is unusable after an earlier error: " + broken_cause);
  }

  [[noreturn]] void fail(const std::string& msg) {
    broken = true;
    broken_cause = msg;
    throw DdpError(msg);
  }

  void launch_ready_locked() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      Bucket& b = buckets[next_launch];
      if (b.info.device == Device::kCuda) detail::device_sync(options.cuda_stream);
      current.bucket_launch[next_launch] = Clock::now();
      b.work = launch_hook_locked(next_launch);
      b.launched = true;
      ++next_launch;
    }
  }

  void reset_iteration_locked() {
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
  void apply_premarks_locked() {
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

  void zero_slot(size_t i) {
    const auto& s = slots[i];
    auto& bk = buckets[s.bucket];
    const size_t bytes = params[i].numel * dtype_size(params[i].dtype);
    if (bk.info.device == Device::kCuda)
      detail::device_zero(bk.data + s.byte_offset, bytes, options.cuda_stream);
    else
      std::memset(bk.data + s.byte_offset, 0, bytes);
  }

  Work launch_hook_locked(size_t index) {
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

  // A broadcast of host data; an NCCL group needs device memory, so it is staged there.
  void broadcast_host(void* data, size_t count, DataType dtype, int root) {
    detail::broadcast_host(*group, data, count, dtype, root, options.timeout, options.cuda_stream);
  }

  // Bucket memory for `plan` and each parameter's place in it (host buckets 64-byte aligned).
  void lay_out_buckets(std::vector<BucketInfo> plan, std::vector<Bucket>& out,
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
  void rebuild_buckets_locked() {
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
        detail::plan_buckets(params, order, cap_bytes(options.bucket_cap_mb, "bucket_cap_mb"),
                             cap_bytes(options.first_bucket_cap_mb, "first_bucket_cap_mb"));
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

  void broadcast_params_from(int root) {
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

  void broadcast_list(std::vector<Parameter>& list, int root = 0) {
    for (auto& p : list) {
      if (p.numel == 0) continue;
      group->broadcast(p.data, p.numel, p.dtype, root, options.timeout);
    }
  }
};

DistributedDataParallel::DistributedDataParallel(ProcessGroup& group, std::vector<Parameter> params,
                                                 DdpOptions options, std::vector<Parameter> buffers)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.group = &group;
  m.options = options;
  if (params.empty()) throw std::invalid_argument("DDP: no parameters");
  const size_t cap = cap_bytes(options.bucket_cap_mb, "bucket_cap_mb");
  const size_t first_cap = cap_bytes(options.first_bucket_cap_mb, "first_bucket_cap_mb");
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
    return;
  }
  m.unused.clear();
  if (m.static_unused_known)
    for (size_t i = 0; i < m.params.size(); ++i)
      if (m.static_unused[i]) m.unused.push_back(i);
  if (m.marked_count < m.params.size()) {
    if (m.options.find_unused_parameters) {
      for (size_t i = 0; i < m.params.size(); ++i) {
        if (m.marked[i]) continue;
        if (!m.used_since_sync[i]) {
          m.unused.push_back(i);
          m.zero_slot(i);
        }
        m.marked[i] = true;
        --m.buckets[m.slots[i].bucket].pending;
      }
      m.marked_count = m.params.size();
      m.launch_ready_locked();
    } else {
      std::string names;
      size_t listed = 0, missing = 0;
      for (size_t i = 0; i < m.params.size(); ++i) {
        if (m.marked[i]) continue;
        ++missing;
        if (listed++ < 8)
          names += (names.empty() ? "" : ", ") + std::to_string(i) + " '" + m.params[i].name +
                   "' (bucket " + std::to_string(m.slots[i].bucket) + ")";
      }
      if (missing > listed) names += ", ...";
      m.fail("DDP: finalize() with " + std::to_string(missing) +
             " gradient(s) never marked ready, so their buckets cannot be reduced: " + names +
             ". Mark every parameter's gradient each iteration, or set find_unused_parameters");
    }
  }
  // Every bucket has launched (all gradients are marked). Wait in order.
  std::vector<Work> works;
  for (auto& b : m.buckets) works.push_back(b.work);
  lock.unlock();
  std::exception_ptr err;
  for (auto& w : works) {
    try {
      w.wait();
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  }
  std::string hook_error;
  if (!err) {
    // The hook's second half (e.g. decompression), in bucket order, on this thread.
    for (size_t b = 0; b < m.buckets.size() && hook_error.empty(); ++b) {
      try {
        m.hook->finish(m.buckets[b].view);
      } catch (const CollectiveError&) {  // a hook's own collective (e.g. PowerSGD's Q)
        err = std::current_exception();
        break;
      } catch (const std::exception& e) {
        hook_error = "DDP: communication hook '" + m.hook->name() + "' failed to finish bucket " +
                     std::to_string(b) + ": " + e.what();
      }
    }
  }
  lock.lock();
  m.current.finalized = Clock::now();
  m.stats = m.current;
  std::fill(m.used_since_sync.begin(), m.used_since_sync.end(), false);
  if (err) {
    m.reset_iteration_locked();
    m.broken = true;
    m.broken_cause = "a bucket's allreduce failed";
    std::rethrow_exception(err);
  }
  if (!hook_error.empty()) {
    m.reset_iteration_locked();
    m.fail(hook_error);
  }
  if (m.options.static_graph && !m.rebuilt) {
    if (m.options.find_unused_parameters) {
      m.static_unused.assign(m.params.size(), false);
      for (size_t i : m.unused) m.static_unused[i] = true;
    }
    std::fill(m.marked.begin(), m.marked.end(), false);  // premarks are not applied yet
    m.marked_count = 0;
    try {
      m.rebuild_buckets_locked();
    } catch (const DdpError&) {
      throw;  // fail() marked the reducer broken
    } catch (...) {
      m.broken = true;
      m.broken_cause = "rebuilding the buckets (static_graph) failed";
      throw;
    }
    m.static_unused_known = m.options.find_unused_parameters;
  }
  m.reset_iteration_locked();
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

int64_t DistributedDataParallel::join_steps() const { return impl_->join_steps; }

const std::vector<BucketInfo>& DistributedDataParallel::buckets() const { return impl_->infos; }

const IterationStats& DistributedDataParallel::last_iteration() const { return impl_->stats; }

std::vector<size_t> DistributedDataParallel::unused_parameters() const { return impl_->unused; }

}  // namespace trun::worker
