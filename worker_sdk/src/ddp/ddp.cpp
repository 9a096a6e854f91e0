#include "trun/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "worker_sdk/src/ddp/device_memory.h"
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
      b.work = group->allreduce_async(b.data, b.info.numel, b.info.dtype, ReduceOp::kAvg,
                                      options.timeout);
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
  }

  void broadcast_list(std::vector<Parameter>& list) {
    for (auto& p : list) {
      if (p.numel == 0) continue;
      group->broadcast(p.data, p.numel, p.dtype, 0, options.timeout);
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

  // Bucket assignment: reverse registration order, one open bucket per (dtype, device); a bucket
  // closes once it reaches its cap (the first one of each kind: first_cap).
  struct Open {
    BucketInfo info;
    bool any_closed = false;
  };
  std::map<std::pair<int, int>, Open> open;
  std::vector<BucketInfo> closed;
  for (size_t k = m.params.size(); k-- > 0;) {
    const auto& p = m.params[k];
    auto key = std::make_pair(static_cast<int>(p.dtype), static_cast<int>(p.device));
    Open& o = open[key];
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
  // Leftover open buckets, in the order of their first parameter's readiness (reverse index).
  std::vector<BucketInfo> rest;
  for (auto& [key, o] : open)
    if (!o.info.params.empty()) rest.push_back(std::move(o.info));
  std::sort(rest.begin(), rest.end(),
            [](const BucketInfo& a, const BucketInfo& b) { return a.params[0] > b.params[0]; });
  for (auto& r : rest) closed.push_back(std::move(r));

  m.slots.resize(m.params.size());
  m.buckets.resize(closed.size());
  for (size_t b = 0; b < closed.size(); ++b) {
    auto& bk = m.buckets[b];
    bk.info = std::move(closed[b]);
    size_t off = 0;
    for (size_t idx : bk.info.params) {
      m.slots[idx] = {b, off};
      off += m.params[idx].numel * dtype_size(m.params[idx].dtype);
    }
    if (bk.info.device == Device::kCuda) {
      bk.data = static_cast<unsigned char*>(detail::device_alloc(bk.info.bytes));
    } else {
      const size_t alloc = (std::max<size_t>(bk.info.bytes, 1) + 63) / 64 * 64;
      bk.host.reset(static_cast<unsigned char*>(std::aligned_alloc(64, alloc)));
      if (!bk.host) throw std::bad_alloc();
      bk.data = bk.host.get();
    }
    m.infos.push_back(bk.info);
  }
  m.marked.assign(m.params.size(), false);
  m.used_since_sync.assign(m.params.size(), false);
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
  if (m.marked_count > 0)
    m.fail("DDP: zero_grad() in the middle of backward (" + std::to_string(m.marked_count) +
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
  if (m.marked[i])
    m.fail("DDP: gradient of parameter " + std::to_string(i) + " '" + m.params[i].name +
           "' marked ready twice in one iteration (is finalize() missing, or does the model use "
           "the parameter twice?)");
  const auto now = Clock::now();
  if (m.marked_count == 0) m.current.first_mark = now;
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
    return;
  }
  m.unused.clear();
  if (m.marked_count < m.params.size()) {
    if (m.options.find_unused_parameters) {
      for (size_t i = 0; i < m.params.size(); ++i) {
        if (m.marked[i]) continue;
        if (!m.used_since_sync[i]) {
          m.unused.push_back(i);
          const auto& s = m.slots[i];
          auto& bk = m.buckets[s.bucket];
          const size_t bytes = m.params[i].numel * dtype_size(m.params[i].dtype);
          if (bk.info.device == Device::kCuda)
            detail::device_zero(bk.data + s.byte_offset, bytes, m.options.cuda_stream);
          else
            std::memset(bk.data + s.byte_offset, 0, bytes);
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
  lock.lock();
  m.current.finalized = Clock::now();
  m.stats = m.current;
  std::fill(m.used_since_sync.begin(), m.used_since_sync.end(), false);
  m.reset_iteration_locked();
  if (err) {
    m.broken = true;
    m.broken_cause = "a bucket's allreduce failed";
    std::rethrow_exception(err);
  }
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
  Impl& m = *impl_;
  m.check_usable();
  if (m.marked_count > 0) m.fail("DDP: broadcast_parameters() in the middle of backward");
  // Coalesced: pack each bucket's parameters into its (free at this point) gradient buffer,
  // broadcast the bucket, unpack. One collective per bucket instead of one per parameter.
  for (auto& b : m.buckets) {
    if (b.info.bytes == 0) continue;
    for (size_t idx : b.info.params) {
      const auto& p = m.params[idx];
      const size_t bytes = p.numel * dtype_size(p.dtype);
      if (bytes == 0) continue;
      void* slot = b.data + m.slots[idx].byte_offset;
      if (b.info.device == Device::kCuda)
        detail::device_copy(slot, p.data, bytes, m.options.cuda_stream);
      else
        detail::copy_bytes(slot, p.data, bytes);
    }
    m.group->broadcast(b.data, b.info.numel, b.info.dtype, 0, m.options.timeout);
    for (size_t idx : b.info.params) {
      const auto& p = m.params[idx];
      const size_t bytes = p.numel * dtype_size(p.dtype);
      if (bytes == 0) continue;
      const void* slot = b.data + m.slots[idx].byte_offset;
      if (b.info.device == Device::kCuda)
        detail::device_copy(p.data, slot, bytes, m.options.cuda_stream);
      else
        detail::copy_bytes(p.data, slot, bytes);
    }
    if (b.info.device == Device::kCuda)
      detail::device_zero(b.data, b.info.bytes, m.options.cuda_stream);
    else
      std::memset(b.data, 0, b.info.bytes);
  }
}

const std::vector<BucketInfo>& DistributedDataParallel::buckets() const { return impl_->infos; }

const IterationStats& DistributedDataParallel::last_iteration() const { return impl_->stats; }

std::vector<size_t> DistributedDataParallel::unused_parameters() const { return impl_->unused; }

}  // namespace trun::worker
