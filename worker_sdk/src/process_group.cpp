// ProcessGroup (trun/process_group.h): building the backend, the public collectives (each
// validated and bound by collective_calls.h, run in order by collective_queue.h),
// monitored_barrier over the store, and shared buffers.

#include "trun/process_group.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "store/store.h"
#include "worker_sdk/src/backend.h"
#include "worker_sdk/src/collective_calls.h"
#include "worker_sdk/src/collective_queue.h"
#include "worker_sdk/src/progress/progress.h"

namespace trun::worker {

using detail::Call;
using detail::Clock;
using detail::Deadline;

struct ProcessGroup::Impl {
  ProcessGroupOptions options;
  Backend kind = Backend::kCpu;
  std::unique_ptr<detail::BackendImpl> backend;
  std::string description;
  std::atomic<int> monitored_barriers{0};  // how many this rank started (their store keys)
  // The group's collectives on the agent's progress board; nullptr when not under trun.
  std::unique_ptr<detail::progress::GroupProgress> progress;
  // Runs the collectives on `backend`: destroyed first (ProcessGroup's destructor).
  std::unique_ptr<detail::CollectiveQueue> queue;
};

ProcessGroup::ProcessGroup(ProcessGroupOptions options) : impl_(std::make_unique<Impl>()) {
  auto& o = options;
  if (o.world_size < 1)
    throw std::invalid_argument("ProcessGroup: world_size must be >= 1, got " +
                                std::to_string(o.world_size));
  if (o.rank < 0 || o.rank >= o.world_size)
    throw std::invalid_argument("ProcessGroup: rank " + std::to_string(o.rank) +
                                " is outside [0, " + std::to_string(o.world_size) + ")");
  if (o.world_size > 1 && !o.store)
    throw std::invalid_argument("ProcessGroup: a store is required when world_size > 1");
  if (o.timeout.count() <= 0) throw std::invalid_argument("ProcessGroup: timeout must be positive");
  if ((o.node_rank < 0) != (o.local_rank < 0))
    throw std::invalid_argument(
        "ProcessGroup: node_rank and local_rank must both be set or both be -1");
  const Deadline deadline = Clock::now() + o.timeout;
  Backend kind = o.backend;
  if (kind == Backend::kAuto) kind = nccl_available() ? Backend::kNccl : Backend::kCpu;
  impl_->kind = kind;
  impl_->backend = kind == Backend::kNccl ? detail::make_nccl_backend(o, deadline)
                                          : detail::make_cpu_backend(o, deadline);
  impl_->description = impl_->backend->description();
  impl_->options = std::move(options);
  impl_->progress = detail::progress::GroupProgress::make(impl_->options.tag, impl_->options.rank,
                                                          impl_->options.world_size);
  impl_->queue =
      std::make_unique<detail::CollectiveQueue>(impl_->options.rank, impl_->options.timeout);
}

namespace {

using Op = base::progress::Op;

// `c`, reported on the progress board: issued now, started and finished around its run.
Call tracked(ProcessGroup::Impl& im, Call c, Op op, DataType dtype, size_t count) {
  detail::progress::GroupProgress* p = im.progress.get();
  if (!p) return c;
  const uint64_t seq = p->issue(op, static_cast<uint32_t>(dtype) + 1, count);
  c.run = [p, seq, run = std::move(c.run)](Deadline deadline) {
    p->start(seq);
    try {
      run(deadline);
    } catch (...) {
      p->finish(seq, false);
      throw;
    }
    p->finish(seq, true);
  };
  return c;
}

}  // namespace

ProcessGroup::~ProcessGroup() {
  // Runs what is still queued and joins the communication thread, before the backend goes.
  impl_->queue.reset();
}

Work ProcessGroup::allreduce_async(void* data, size_t count, DataType dtype, ReduceOp op,
                                   Timeout timeout) {
  Call c = tracked(*impl_, detail::allreduce_call(impl_->backend.get(), data, count, dtype, op),
                   Op::kAllreduce, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::allreduce(void* data, size_t count, DataType dtype, ReduceOp op,
                             Timeout timeout) {
  Call c = tracked(*impl_, detail::allreduce_call(impl_->backend.get(), data, count, dtype, op),
                   Op::kAllreduce, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::broadcast_async(void* data, size_t count, DataType dtype, int root,
                                   Timeout timeout) {
  Call c = tracked(*impl_,
                   detail::broadcast_call(impl_->backend.get(), size(), data, count, dtype, root),
                   Op::kBroadcast, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::broadcast(void* data, size_t count, DataType dtype, int root, Timeout timeout) {
  Call c = tracked(*impl_,
                   detail::broadcast_call(impl_->backend.get(), size(), data, count, dtype, root),
                   Op::kBroadcast, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::allgather_async(const void* send, void* recv, size_t count, DataType dtype,
                                   Timeout timeout) {
  Call c = tracked(*impl_,
                   detail::allgather_call(impl_->backend.get(), size(), send, recv, count, dtype),
                   Op::kAllgather, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::allgather(const void* send, void* recv, size_t count, DataType dtype,
                             Timeout timeout) {
  Call c = tracked(*impl_,
                   detail::allgather_call(impl_->backend.get(), size(), send, recv, count, dtype),
                   Op::kAllgather, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::reduce_scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                                        ReduceOp op, Timeout timeout) {
  Call c = tracked(
      *impl_,
      detail::reduce_scatter_call(impl_->backend.get(), size(), send, recv, count, dtype, op),
      Op::kReduceScatter, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::reduce_scatter(const void* send, void* recv, size_t count, DataType dtype,
                                  ReduceOp op, Timeout timeout) {
  Call c = tracked(
      *impl_,
      detail::reduce_scatter_call(impl_->backend.get(), size(), send, recv, count, dtype, op),
      Op::kReduceScatter, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::barrier_async(Timeout timeout) {
  Call c =
      tracked(*impl_, detail::barrier_call(impl_->backend.get()), Op::kBarrier, DataType(-1), 0);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::barrier(Timeout timeout) {
  Call c =
      tracked(*impl_, detail::barrier_call(impl_->backend.get()), Op::kBarrier, DataType(-1), 0);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::reduce_async(void* data, size_t count, DataType dtype, ReduceOp op, int root,
                                Timeout timeout) {
  Call c = tracked(*impl_,
                   detail::reduce_call(impl_->backend.get(), size(), data, count, dtype, op, root),
                   Op::kReduce, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root,
                          Timeout timeout) {
  Call c = tracked(*impl_,
                   detail::reduce_call(impl_->backend.get(), size(), data, count, dtype, op, root),
                   Op::kReduce, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::gather_async(const void* send, void* recv, size_t count, DataType dtype,
                                int root, Timeout timeout) {
  Call c = tracked(
      *impl_,
      detail::gather_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root),
      Op::kGather, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                          Timeout timeout) {
  Call c = tracked(
      *impl_,
      detail::gather_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root),
      Op::kGather, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                                 int root, Timeout timeout) {
  Call c = tracked(
      *impl_,
      detail::scatter_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root),
      Op::kScatter, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                           Timeout timeout) {
  Call c = tracked(
      *impl_,
      detail::scatter_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root),
      Op::kScatter, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::all_to_all_async(const void* send, void* recv, size_t count, DataType dtype,
                                    Timeout timeout) {
  std::vector<size_t> counts(size(), count);
  Call c = tracked(*impl_,
                   detail::all_to_all_v_call(impl_->backend.get(), size(), send, counts, recv,
                                             counts, dtype, "all_to_all"),
                   Op::kAllToAll, dtype, count);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::all_to_all(const void* send, void* recv, size_t count, DataType dtype,
                              Timeout timeout) {
  std::vector<size_t> counts(size(), count);
  Call c = tracked(*impl_,
                   detail::all_to_all_v_call(impl_->backend.get(), size(), send, counts, recv,
                                             counts, dtype, "all_to_all"),
                   Op::kAllToAll, dtype, count);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::all_to_all_v_async(const void* send, const std::vector<size_t>& send_counts,
                                      void* recv, const std::vector<size_t>& recv_counts,
                                      DataType dtype, Timeout timeout) {
  // Counts differ by rank: the board records none (the verdict compares op and dtype only).
  Call c = tracked(*impl_,
                   detail::all_to_all_v_call(impl_->backend.get(), size(), send, send_counts, recv,
                                             recv_counts, dtype, "all_to_all_v"),
                   Op::kAllToAllV, dtype, 0);
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                                void* recv, const std::vector<size_t>& recv_counts, DataType dtype,
                                Timeout timeout) {
  // Counts differ by rank: the board records none (the verdict compares op and dtype only).
  Call c = tracked(*impl_,
                   detail::all_to_all_v_call(impl_->backend.get(), size(), send, send_counts, recv,
                                             recv_counts, dtype, "all_to_all_v"),
                   Op::kAllToAllV, dtype, 0);
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::send_async(const void* data, size_t count, DataType dtype, int peer, int tag,
                              Timeout timeout) {
  return batch_isend_irecv({P2POp{P2POp::kSend, const_cast<void*>(data), count, dtype, peer, tag}},
                           timeout);
}
Work ProcessGroup::recv_async(void* data, size_t count, DataType dtype, int peer, int tag,
                              Timeout timeout) {
  return batch_isend_irecv({P2POp{P2POp::kRecv, data, count, dtype, peer, tag}}, timeout);
}
Work ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops, Timeout timeout) {
  Call c = detail::p2p_call(impl_->backend.get(), rank(), size(), ops, "batch_isend_irecv");
  detail::progress::heartbeat();  // not in the group's sequence: other ranks do not issue it
  return impl_->queue->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::send(const void* data, size_t count, DataType dtype, int peer, int tag,
                        Timeout timeout) {
  Call c = detail::p2p_call(impl_->backend.get(), rank(), size(),
                            {P2POp{P2POp::kSend, const_cast<void*>(data), count, dtype, peer, tag}},
                            "send");
  detail::progress::heartbeat();  // not in the group's sequence: other ranks do not issue it
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::recv(void* data, size_t count, DataType dtype, int peer, int tag,
                        Timeout timeout) {
  Call c = detail::p2p_call(impl_->backend.get(), rank(), size(),
                            {P2POp{P2POp::kRecv, data, count, dtype, peer, tag}}, "recv");
  detail::progress::heartbeat();  // not in the group's sequence: other ranks do not issue it
  impl_->queue->run_now(std::move(c.what), timeout, std::move(c.run));
}

void ProcessGroup::monitored_barrier(Timeout timeout, bool wait_all_ranks) {
  Impl& im = *impl_;
  if (timeout.count() <= 0) timeout = im.options.timeout;
  const int rank = im.options.rank, world = im.options.world_size;
  if (world == 1) return;
  const std::string base = "monitored_barrier/" + std::to_string(im.monitored_barriers++) + "/";
  store::Store& store = *im.options.store;
  std::exception_ptr verdict;
  // Through run_now, so that it runs after the queued work; its failure is returned, not
  // thrown, so that it does not break the group.
  auto body = [&](Deadline) {
    const std::string result_key = base + "result";
    const std::string ms = std::to_string(timeout.count()) + " ms";
    try {
      if (rank != 0) {
        store.set(base + "arrived/" + std::to_string(rank), "1");
        // Rank 0 may start up to `timeout` after us and then wait `timeout` itself.
        store.wait({result_key}, 2 * timeout + std::chrono::seconds(1));
      } else {
        std::vector<std::string> keys;
        for (int r = 1; r < world; ++r) keys.push_back(base + "arrived/" + std::to_string(r));
        std::string result = "ok";
        try {
          store.wait(keys, timeout);
        } catch (const store::StoreTimeoutError&) {
          std::vector<int> missing;
          for (int r = 1; r < world; ++r)
            if (!store.check({keys[r - 1]})) missing.push_back(r);
          if (missing.empty()) missing.push_back(-1);  // all arrived just now
          if (missing[0] >= 0) {
            if (!wait_all_ranks) missing.resize(1);
            std::string who = missing.size() == 1 ? "rank " : "ranks ";
            for (size_t i = 0; i < missing.size(); ++i)
              who += (i ? ", " : "") + std::to_string(missing[i]);
            result = who + " did not arrive at monitored_barrier within " + ms + " (rank 0 waited)";
          }
        }
        store.set(result_key, result);
      }
      std::string result = store.get(result_key, std::chrono::seconds(5));
      if (result != "ok") throw CollectiveTimeoutError(result);
    } catch (const CollectiveTimeoutError&) {
      verdict = std::current_exception();
    } catch (const store::StoreTimeoutError&) {
      verdict = std::make_exception_ptr(CollectiveTimeoutError(
          "monitored_barrier on rank " + std::to_string(rank) + ": rank 0 gave no verdict within " +
          std::to_string(2 * timeout.count() + 1000) + " ms (rank 0 did not arrive)"));
    }
  };
  Call c = tracked(im, Call{"monitored_barrier", body}, Op::kMonitoredBarrier, DataType(-1), 0);
  im.queue->run_now(std::move(c.what), timeout + std::chrono::seconds(5), std::move(c.run));
  if (verdict) std::rethrow_exception(verdict);
}

void ProcessGroup::abort(const std::string& reason) {
  impl_->queue->mark_broken("aborted: " + reason);
  impl_->backend->abort(reason);
}

int ProcessGroup::rank() const { return impl_->options.rank; }
int ProcessGroup::size() const { return impl_->options.world_size; }
void* SharedBuffer::data() const { return block_ ? block_->data : nullptr; }
size_t SharedBuffer::size() const { return block_ ? block_->size : 0; }
bool SharedBuffer::shared() const { return block_ && block_->shared; }

SharedBuffer ProcessGroup::shared_buffer(size_t bytes) {
  if (impl_->kind == Backend::kNccl)
    throw std::invalid_argument(
        "shared_buffer: an NCCL group's buffers are CUDA device memory; shared buffers are host "
        "memory for the CPU backend");
  if (bytes > static_cast<size_t>(PTRDIFF_MAX))
    throw std::invalid_argument("shared_buffer: " + std::to_string(bytes) +
                                " bytes is more than any buffer can hold");
  if (auto block = impl_->backend->allocate_shared(bytes)) return SharedBuffer(std::move(block));
  // Ordinary memory: page-aligned and zero-filled like the shared kind (fresh anonymous pages,
  // allocated as they are touched).
  const size_t rounded = detail::whole_pages(bytes);
  void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto block = std::make_shared<SharedBuffer::Block>();
  block->data = p;
  block->size = bytes;
  block->release = [p, rounded] { ::munmap(p, rounded); };
  return SharedBuffer(std::move(block));
}

Backend ProcessGroup::backend() const { return impl_->kind; }
std::string ProcessGroup::backend_description() const { return impl_->description; }
bool ProcessGroup::broken() const { return impl_->queue->broken(); }

}  // namespace trun::worker
