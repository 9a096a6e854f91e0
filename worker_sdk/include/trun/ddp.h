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
// Communication hooks (PyTorch's register_comm_hook): a CommHook replaces the allreduce of each
// bucket. launch() is called when the bucket is ready (on the thread that marked its last
// gradient) and returns the Work to wait for; finish() is called by finalize(), in bucket order,
// after that Work completed, and must leave the average in the bucket. Built-ins:
// allreduce_hook() (the default), fp16_compress_hook(), bf16_compress_hook(), powersgd_hook().
//
// Uneven inputs (PyTorch's Join context with DDP): with join_iteration() once per synchronized
// step, a rank that ran out of data keeps answering the others' collectives with zero gradients
// until every rank is out; each bucket's average divides by the number of ranks that had input
// in that step. See join_iteration().
//
// static_graph: after the first synchronized iteration, the buckets are rebuilt once in the order
// in which rank 0's gradients became ready (rank 0's order is broadcast so every rank builds the
// same buckets); grad(i) views move then. With find_unused_parameters, the parameters unused in
// that first iteration are taken as unused in every later iteration (no search per iteration).
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
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <trun/export.h>
#include <trun/process_group.h>

namespace trun::worker {

class TRUN_API DdpError : public std::runtime_error {
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
};

struct DdpOptions {
  double bucket_cap_mb = 25.0;       // MiB
  double first_bucket_cap_mb = 1.0;  // MiB
  bool find_unused_parameters = false;
  // Broadcast rank 0's parameters (and buffers) on construction.
  bool broadcast_on_construction = true;
  // On construction (world size > 1), check that every rank registered the same parameters: the
  // same count, and per parameter the same dtype, device and element count. A mismatch
  // throws std::invalid_argument on every rank, naming the first mismatching parameter and rank
  // (a collective: two allgathers of a few integers per parameter).
  bool check_parameters_across_ranks = true;
  // Deadline of each collective; 0: the group's.
  std::chrono::milliseconds timeout{0};
  // CUDA: the stream gradients are produced on (a cudaStream_t); nullptr: the legacy default.
  void* cuda_stream = nullptr;
  // Rebuild the buckets once, in gradient arrival order, after the first synchronized
  // iteration; with find_unused_parameters, reuse the first iteration's unused set. Must be the
  // same on every rank. grad(i) views obtained before the first finalize() are invalid after it.
  bool static_graph = false;
  // join_iteration(): divide by size() instead of by the number of ranks with input (PyTorch's
  // Join default, divide_by_initial_world_size=True). Must be the same on every rank.
  bool join_divide_by_initial_world_size = false;
  // join_iteration(): as soon as any rank has no input, throw DdpError on every rank (in the same
  // call) instead of shadowing (PyTorch's Join(throw_on_early_termination=True)).
  bool join_throw_on_early_termination = false;
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

// One bucket, as a communication hook sees it (PyTorch's GradBucket). `data` holds this rank's
// local gradients (sums, not averaged) when launch() is called; after finish() it must hold the
// average: the sum over ranks divided by `divisor`.
struct GradBucket {
  size_t index = 0;        // bucket index, as in buckets()
  size_t num_buckets = 0;  // index == num_buckets - 1: the last bucket of the iteration
  void* data = nullptr;    // numel elements of dtype on device
  size_t numel = 0;
  DataType dtype = DataType::kFloat32;
  Device device = Device::kCpu;
  const std::vector<size_t>* params = nullptr;  // parameter indices, in bucket order
  // Byte offset of each of those parameters' gradients inside data (same order as params).
  const std::vector<size_t>* offsets = nullptr;
  ProcessGroup* group = nullptr;
  // Ranks whose gradients are in this iteration's sum: group->size(), or fewer under join.
  int divisor = 1;
  std::chrono::milliseconds timeout{0};  // 0: the group's
  // True when this rank has no input this iteration (join): its gradients are zero.
  bool joined = false;
};

// A communication hook; see the header comment. The reducer calls launch() with its internal lock
// held (a hook must not call back into the reducer), at most once per bucket per synchronized
// iteration, and finish() once for each launch(), in bucket order, from finalize(). A hook may
// keep per-bucket state (keyed by index); bucket sizes change once under static_graph. Every rank
// must register an equivalent hook: its collectives must match across ranks. A hook may issue
// several collectives on bucket.group (in the same order on every rank) and return the last
// one's Work (collectives complete in issue order), or work synchronously and return Work() (a
// default Work counts as complete). An exception from either breaks the reducer: a
// CollectiveError from finish() comes out of finalize() as is, anything else as DdpError naming
// the hook, the bucket and the cause.
class TRUN_API CommHook {
 public:
  virtual ~CommHook() = default;
  virtual Work launch(GradBucket& bucket) = 0;
  virtual void finish(GradBucket& bucket) { (void)bucket; }
  virtual std::string name() const { return "user hook"; }
};

// The default: allreduce (kAvg, or kSum and a division when divisor != group size).
TRUN_API std::shared_ptr<CommHook> allreduce_hook();
// PyTorch's fp16_compress_hook / bf16_compress_hook: each gradient rounded to float16 (bfloat16)
// in a scratch buffer and divided by `divisor` there (rounded again), allreduced (kSum) in that
// dtype, and written back into the bucket. Halves the bytes sent. Host buckets only (the
// conversion runs on the CPU): launch() on a CUDA bucket throws. Integer buckets throw.
TRUN_API std::shared_ptr<CommHook> fp16_compress_hook();
TRUN_API std::shared_ptr<CommHook> bf16_compress_hook();
// PowerSGD (Vogels et al. 2019; PyTorch's powerSGD_hook): each parameter given a matrix shape in
// `matrix_shapes` (rows x cols = numel) is approximated by P Q^T of rank
// min(rank, rows, cols): P = M Q allreduced and orthogonalized (Gram-Schmidt), Q = M^T P
// allreduced and divided by `divisor`, M = P Q^T; with error feedback the approximation error is
// added to the next iteration's gradient; with warm start Q carries over. Parameters without a
// shape, and matrices where (rows + cols) * rank * min_compression_rate >= rows * cols, are
// allreduced uncompressed and divided. The first start_powersgd_iter iterations are plain
// allreduce. Collectives per bucket: uncompressed, P (from launch), Q (from finish, so the Q
// allreduces of the buckets run one after another). Host float32 buckets only.
struct PowerSgdOptions {
  int matrix_approximation_rank = 1;
  int start_powersgd_iter = 1000;  // PyTorch's default; >= 2 with error feedback or warm start
  int min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  float orthogonalization_epsilon = 0.0f;
  uint64_t seed = 0;  // for Q's initial values; the same on every rank
  // Parameter index -> (rows, cols); rows * cols must equal the parameter's numel.
  std::map<size_t, std::pair<size_t, size_t>> matrix_shapes;
};
// std::invalid_argument for bad options.
TRUN_API std::shared_ptr<CommHook> powersgd_hook(PowerSgdOptions options);

// A hook from functions (finish may be empty).
TRUN_API std::shared_ptr<CommHook> make_comm_hook(std::function<Work(GradBucket&)> launch,
                                                  std::function<void(GradBucket&)> finish = {},
                                                  std::string name = "user hook");

// The check of DdpOptions::check_parameters_across_ranks, for callers that build their own
// reducer or know their parameters' shapes: collective over `group`; throws
// std::invalid_argument naming the first parameter (in registration order) whose dtype, device,
// element count or shape differ from rank 0's, and the lowest rank that differs, or the first
// rank whose parameter count differs. The same message on every rank. `shapes`: empty (each
// parameter is [numel]) or one per parameter, each with product numel. (The reducer's own check
// passes none; trun::libtorch passes the tensors' shapes.)
TRUN_API void check_parameters_across_ranks(
    ProcessGroup& group, const std::vector<Parameter>& params,
    std::chrono::milliseconds timeout = std::chrono::milliseconds{0},
    const std::vector<std::vector<int64_t>>& shapes = {});

class TRUN_API DistributedDataParallel {
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

  // Replaces the allreduce of every bucket from the next synchronized iteration on. Once per
  // reducer (PyTorch's rule), outside an iteration; DdpError otherwise, std::invalid_argument
  // for a null hook. Not collective, but every rank must register an equivalent hook.
  void register_comm_hook(std::shared_ptr<CommHook> hook);

  // Uneven inputs. Call once per synchronized step, before its forward, on every rank:
  //   for (;;) {
  //     bool have = loader.next(batch);
  //     if (!ddp.join_iteration(have)) break;  // every rank is out of data
  //     forward; backward with mark_ready; finalize(); optimizer step;
  //   }
  // has_input = true: one allreduce counts the ranks that have input; returns true, and this
  // step's finalize() divides by that count. has_input = false: this rank joins: it shadows every
  // later step of the other ranks (the count, then each bucket's collective, with zero gradients
  // and the registered hook) until no rank has input, then the parameters and buffers are
  // broadcast from the rank that trained the most steps (lowest such rank), and it returns false
  // (on every rank, in the same call). A rank that joined never gets input again in this round;
  // afterwards the next join_iteration() starts a new round (e.g. the next epoch). Collective.
  // DdpError inside an iteration or a NoSync guard (gradient accumulation: call it once per
  // synchronized step, and give a rank input for all or none of the step's micro-batches).
  // CUDA parameters: std::invalid_argument (the division by the count needs a device kernel).
  // The optimizer state of a rank that joined early is not synchronized (as in PyTorch).
  // With join_throw_on_early_termination, the first call in which any rank has no input throws
  // DdpError on every rank (the reducer stays usable).
  bool join_iteration(bool has_input);
  // Synchronized steps this rank has run or shadowed in the current join round.
  int64_t join_steps() const;

  const std::vector<BucketInfo>& buckets() const;
  const IterationStats& last_iteration() const;
  // Parameters not marked in the last synchronized iteration (find_unused_parameters only).
  std::vector<size_t> unused_parameters() const;

  struct TRUN_HIDDEN Impl;  // private

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace trun::worker
