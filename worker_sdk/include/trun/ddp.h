#pragma once
// DistributedDataParallel: averages gradients across the ranks of a ProcessGroup in buckets,
// overlapping communication with backward, for a model written in any framework.
//
//   std::vector<trun::worker::Parameter> params = {{"fc1.weight", w1, 100, kFloat32}, ...};
//   trun::worker::DistributedDataParallel ddp(pg, params);  // broadcasts rank 0's parameters
//   for (...) {
//     ddp.zero_grad();
//     forward(...);
//     for (size_t i = params.size(); i-- > 0;) {       // backward, last layer first
//       compute_gradient_into(ddp.grad_as<float>(i));  // accumulate (+=) into the view
//       ddp.mark_ready(i);                             // may start a bucket's allreduce
//     }
//     ddp.finalize();                                  // waits; gradients are now averaged
//     sgd_step(params, ddp);
//   }
//
// Gradients live in flat bucket buffers owned by the reducer; grad(i) is a view into one of
// them, so nothing is copied to communicate. Buckets hold parameters of one dtype and device,
// in reverse registration order (the order backward produces gradients), up to bucket_cap_mb
// each (a bucket closes once it reaches the cap, so one large parameter gets a bucket of its
// own); the first bucket is capped at first_bucket_cap_mb (1 MiB, as PyTorch's rebuilt buckets)
// so that communication starts early. When a bucket's last gradient is marked ready its
// allreduce (ReduceOp::kAvg) is queued on the group's communication thread at once, while the
// caller continues backward; buckets are always launched in bucket order, so every rank issues
// the same collectives in the same order even when gradients become ready in another order.
//
// no_sync(): while a NoSync guard lives, mark_ready() and finalize() do not communicate;
// gradients accumulate locally (gradient accumulation). The first finalize() after the guard is
// gone averages the accumulated sums.
//
// Unused parameters: by default every parameter must be marked in every synchronized iteration;
// finalize() with a parameter unmarked throws DdpError naming it. With find_unused_parameters,
// finalize() zeroes the gradient of each parameter that was not marked since the last
// synchronization, completes its bucket and launches it; unused_parameters() lists them.
//
// Devices: CPU parameters (host memory, any CPU group) and CUDA parameters (device memory on the
// caller's current device, an NCCL group; averaging happens on the device with ncclAvg). For
// CUDA, gradients are written on `cuda_stream`; before a bucket is launched the reducer waits
// for that stream on the host, since the group's NCCL stream is internal to the group.
//
// Collectives: construction (parameter and buffer broadcast), broadcast_buffers(), and each
// synchronized iteration are collective: every rank must make the same calls. Between the first
// mark_ready() and finalize() the caller must not issue other collectives on the same group.
//
// Thread safety: mark_ready() may be called from several threads (e.g. autograd workers); the
// other methods from one thread at a time. Errors: DdpError for misuse (the reducer is unusable
// afterwards: the ranks' collectives no longer match), CollectiveError from the group,
// std::invalid_argument for bad parameters or options.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "trun/process_group.h"

namespace trun::worker {

class DdpError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Device { kCpu, kCuda };

// A parameter (or buffer) the caller owns: `numel` elements of `dtype` at `data`.
struct Parameter {
  std::string name;
  void* data = nullptr;
  size_t numel = 0;
  DataType dtype = DataType::kFloat32;
  Device device = Device::kCpu;
  // Optional, for the cross-rank check and its messages; empty: [numel]. Its product must be
  // numel.
  std::vector<int64_t> shape;
};

struct DdpOptions {
  double bucket_cap_mb = 25.0;       // MiB
  double first_bucket_cap_mb = 1.0;  // MiB
  bool find_unused_parameters = false;
  // Broadcast rank 0's parameters (and buffers) on construction.
  bool broadcast_on_construction = true;
  // On construction (world size > 1), check that every rank registered the same parameters: the
  // same count, and per parameter the same dtype, device, element count and shape. A mismatch
  // throws std::invalid_argument on every rank, naming the first mismatching parameter and rank
  // (a collective: two allgathers of a few integers per parameter).
  bool check_parameters_across_ranks = true;
  // Deadline of each collective; 0: the group's.
  std::chrono::milliseconds timeout{0};
  // CUDA: the stream gradients are produced on (a cudaStream_t); nullptr: the legacy default.
  void* cuda_stream = nullptr;
};

struct BucketInfo {
  DataType dtype = DataType::kFloat32;
  Device device = Device::kCpu;
  size_t numel = 0;
  size_t bytes = 0;
  std::vector<size_t> params;  // parameter indices, in bucket order
};

// Timings of the last synchronized iteration (steady clock), for tests and benchmarks.
struct IterationStats {
  std::chrono::steady_clock::time_point first_mark, last_mark, finalized;
  std::vector<std::chrono::steady_clock::time_point> bucket_launch;  // per bucket
  // Buckets whose allreduce had completed when the last gradient was marked.
  size_t buckets_done_at_last_mark = 0;
};

// The check of DdpOptions::check_parameters_across_ranks, for callers that build their own
// reducer: collective over `group`; throws std::invalid_argument naming the first parameter (in
// registration order) whose dtype, device, element count or shape differ from rank 0's, and the
// lowest rank that differs, or the first rank whose parameter count differs. The same message
// on every rank.
void check_parameters_across_ranks(ProcessGroup& group, const std::vector<Parameter>& params,
                                   std::chrono::milliseconds timeout = std::chrono::milliseconds{
                                       0});

class DistributedDataParallel {
 public:
  // Collective when options.broadcast_on_construction. `group` is not owned and must outlive
  // the reducer. Parameters and buffers are referenced, not copied.
  DistributedDataParallel(ProcessGroup& group, std::vector<Parameter> params,
                          DdpOptions options = {}, std::vector<Parameter> buffers = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  size_t num_parameters() const;
  const Parameter& parameter(size_t i) const;
  // The gradient of parameter i: numel elements of its dtype on its device, inside a bucket.
  void* grad(size_t i);
  template <typename T>
  T* grad_as(size_t i) {
    return static_cast<T*>(grad(i));
  }
  // Sets every gradient to zero.
  void zero_grad();

  // Gradient i is complete for this iteration. DdpError when it was already marked.
  void mark_ready(size_t i);
  // Waits for every bucket and leaves the averaged gradients in place (see the header comment).
  void finalize();

  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel* ddp);
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    DistributedDataParallel* ddp_;
    bool previous_ = false;
  };
  NoSync no_sync() { return NoSync(this); }

  // Broadcasts the registered buffers from rank 0 (collective).
  void broadcast_buffers();
  // Broadcasts the parameters from rank 0 (collective); done on construction by default. The
  // gradient buckets serve as staging memory: gradients are zero afterwards.
  void broadcast_parameters();

  const std::vector<BucketInfo>& buckets() const;
  const IterationStats& last_iteration() const;
  // Parameters not marked in the last synchronized iteration (find_unused_parameters only).
  std::vector<size_t> unused_parameters() const;

  struct Impl;  // private

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace trun::worker
