#pragma once
// DistributedDataParallel::Impl, the DDP reducer's state (private to libtrun_worker): the
// parameters and their gradient buckets, one iteration's marks, the communication hook, join's
// and static_graph's bookkeeping. Its methods (reducer.cpp) are the steps the public calls
// (ddp.cpp, join.cpp) are made of.
//
// Thread safety: `mu` guards the iteration state (mark_ready may come from several threads);
// methods named *_locked expect it held. fail() marks the reducer broken and throws DdpError.

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "trun/ddp.h"

namespace trun::worker {

namespace detail {
// A byte cap from DdpOptions' MB (std::invalid_argument naming `what` unless positive).
size_t cap_bytes(double mb, const char* what);
}  // namespace detail

struct DistributedDataParallel::Impl {
  using Clock = std::chrono::steady_clock;
  struct HostFree {
    void operator()(unsigned char* p) const { std::free(p); }
  };
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
  // How a synchronized iteration's buckets ended: a collective's failure, or a hook's.
  struct SyncOutcome {
    std::exception_ptr error;
    std::string hook_error;
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

  ~Impl();

  void check_usable();
  [[noreturn]] void fail(const std::string& msg);

  // ---- one iteration
  // Launches every bucket, in order, whose gradients are all marked.
  void launch_ready_locked();
  void reset_iteration_locked();
  void apply_premarks_locked();
  Work launch_hook_locked(size_t index);
  // finalize() with gradients unmarked: with find_unused_parameters they count as unused
  // (zeroed) and their buckets launch; else fail() naming them.
  void complete_marks_locked();
  // Waits for `works` (every bucket's, in order), then runs the hook's finish() on each bucket.
  // Unlocked.
  SyncOutcome wait_buckets(const std::vector<Work>& works);
  // The end of a synchronized iteration: its stats, a failure rethrown, the static_graph
  // rebuild after the first one, and the next iteration's reset.
  void end_sync_locked(const SyncOutcome& outcome);

  // ---- buckets
  void zero_slot(size_t i);
  // A broadcast of host data; an NCCL group needs device memory, so it is staged there.
  void broadcast_host(void* data, size_t count, DataType dtype, int root);
  // Bucket memory for `plan` and each parameter's place in it (host buckets 64-byte aligned).
  void lay_out_buckets(std::vector<BucketInfo> plan, std::vector<Bucket>& out,
                       std::vector<Slot>& out_slots) const;
  void rebuild_buckets_locked();
  // Coalesced: one broadcast per bucket of the parameters it holds gradients for.
  void broadcast_params_from(int root);
  void broadcast_list(std::vector<Parameter>& list, int root = 0);
};

}  // namespace trun::worker
