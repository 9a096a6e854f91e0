#pragma once
// The interface every collective backend implements (private to libtrun_worker). ProcessGroup
// validates arguments, queues calls and runs them one at a time on its communication thread; a
// backend only performs one collective synchronously, bounded by `deadline`.
//
// Errors: CollectiveTimeoutError when the deadline passes, CollectiveError for anything else.
// After a failure the ProcessGroup never calls the backend again except abort() and the
// destructor.

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "trun/process_group.h"

namespace trun::worker::detail {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

class BackendImpl {
 public:
  virtual ~BackendImpl() = default;
  virtual std::string description() const = 0;
  virtual void allreduce(void* data, size_t count, DataType dtype, ReduceOp op,
                         Deadline deadline) = 0;
  virtual void broadcast(void* data, size_t count, DataType dtype, int root, Deadline deadline) = 0;
  virtual void allgather(const void* send, void* recv, size_t count, DataType dtype,
                         Deadline deadline) = 0;
  virtual void reduce_scatter(const void* send, void* recv, size_t count, DataType dtype,
                              ReduceOp op, Deadline deadline) = 0;
  virtual void barrier(Deadline deadline) = 0;
  virtual void reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root,
                      Deadline deadline) = 0;
  // recv: count * size elements, only used on root.
  virtual void gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                      Deadline deadline) = 0;
  // send: count * size elements, only used on root.
  virtual void scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                       Deadline deadline) = 0;
  // Counts in elements, one per rank (size entries each); validated by ProcessGroup.
  virtual void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                            const std::vector<size_t>& recv_counts, DataType dtype,
                            Deadline deadline) = 0;
  // Posts every op, then waits for all; peers validated (not this rank, in range).
  virtual void p2p(const std::vector<P2POp>& ops, Deadline deadline) = 0;
  // std::invalid_argument when this backend cannot reduce `dtype` with `op` (beyond
  // reduce_op_check, which ProcessGroup runs first).
  virtual void check_op(ReduceOp op, DataType dtype, const char* what) const {
    (void)op, (void)dtype, (void)what;
  }
  // A block of this rank's shared buffer area (ProcessGroup::shared_buffer), or nullptr when
  // the backend has none or it is full. Any thread.
  virtual std::shared_ptr<SharedBuffer::Block> allocate_shared(size_t bytes) {
    (void)bytes;
    return nullptr;
  }
  // Called from any thread, possibly while a collective runs: make it fail soon.
  virtual void abort(const std::string& reason) = 0;
};

// What a SharedBuffer holds: `release` gives the memory back when the last copy goes.
}  // namespace trun::worker::detail

namespace trun::worker {
struct SharedBuffer::Block {
  void* data = nullptr;
  size_t size = 0;
  bool shared = false;
  std::function<void()> release;
  Block() = default;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block() {
    if (release) release();
  }
};
}  // namespace trun::worker

namespace trun::worker::detail {

// Factories, chosen by ProcessGroup through Backend. Each validates what it needs from options.
std::unique_ptr<BackendImpl> make_cpu_backend(const ProcessGroupOptions& options,
                                              Deadline deadline);
// CollectiveError when this build has no NCCL or the process has no CUDA device.
std::unique_ptr<BackendImpl> make_nccl_backend(const ProcessGroupOptions& options,
                                               Deadline deadline);

// A SharedBuffer's footprint: `bytes` rounded up to whole 4 KiB pages, at least one (bytes
// must not be near SIZE_MAX).
inline size_t whole_pages(size_t bytes) {
  constexpr size_t kPage = 4096;
  return bytes <= kPage ? kPage : (bytes + kPage - 1) / kPage * kPage;
}

// Milliseconds left until `deadline` (at least 1 so that callers passing it on never get 0).
inline std::chrono::milliseconds remaining(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() < 1 ? std::chrono::milliseconds(1) : left;
}

}  // namespace trun::worker::detail
