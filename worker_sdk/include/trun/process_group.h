#pragma once
// ProcessGroup: collectives among the ranks of a trun job (or any set of processes that share a
// Store).
//
// Backends: "nccl" (CUDA device buffers; compiled when CUDA and NCCL were found at build time, see
// trun/config.h) and "cpu" (host buffers: a shared-memory path among the ranks of one node and
// Gloo over TCP between nodes). Backend::kAuto picks NCCL when it was compiled in and the process
// sees a CUDA device, the CPU backend otherwise.
//
// Ordering: every rank must issue the same collectives in the same order with matching counts,
// dtypes, ops and roots. Collectives run one at a time, in issue order, on the group's
// communication thread; the *_async forms return at once with a Work handle, the plain forms
// wait for it.
//
// Buffers: contiguous, `count` elements of `dtype`, owned by the caller and left untouched by the
// caller until the Work completes. allreduce and broadcast work in place. allgather writes
// count * size() elements (rank r's contribution at offset r * count); reduce_scatter reads
// count * size() elements and writes the reduced block of this rank (count elements); their
// send and receive buffers must not overlap. Sizes may be 0. The rooted, all-to-all and
// point-to-point collectives document their buffers below, next to each.
//
// Reductions: kAvg divides the sum by size() (integer types: truncated toward zero). float16 and
// bfloat16 are reduced in float and rounded after each step. kProduct multiplies (integers wrap
// around on overflow). kBand, kBor, kBxor are bitwise and accept the integer types and kBool only
// (std::invalid_argument otherwise). kBool: elements are bytes, 0 is false and anything else
// true; results are 0 or 1. kSum and kMax are logical OR, kProduct and kMin logical AND (as
// PyTorch's NCCL backend maps them), kBand/kBor/kBxor are AND/OR/XOR; kAvg is refused
// (std::invalid_argument: a mean of booleans is not a boolean). NCCL has no bitwise reductions:
// an NCCL group refuses kBand/kBor/kBxor at the call with std::invalid_argument.
//
// Timeouts and failures: each collective has a deadline (the group's timeout, or the one passed to
// the call). A peer that died, stalled or aborted makes the collective fail on every other rank
// with CollectiveError (CollectiveTimeoutError when the deadline passed) instead of hanging. After
// any failure the group is broken: every later collective fails at once with the same cause; the
// worker should exit (the agent restarts it) or build a new group. abort() breaks it on purpose.
//
// Signals: a group that uses Gloo (ranks on several nodes; any CPU group once it sends or
// receives point-to-point) sets SIGPIPE to SIG_IGN if it still has its default action, so that
// a peer's closed connection is an error and not a fatal signal.
//
// Thread safety: every method may be called from any thread; calls are queued in the order they
// are made. Destroying the group waits for queued collectives (each bounded by its timeout).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <trun/export.h>
#include <trun/store/store.h>

namespace trun::worker {

enum class DataType {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt32,
  kInt64,
  kInt8,
  kUInt8,
  kBool,  // one byte per element
};
enum class ReduceOp { kSum, kAvg, kMin, kMax, kProduct, kBand, kBor, kBxor };
enum class Backend { kAuto, kCpu, kNccl };

TRUN_API size_t dtype_size(DataType dtype);
TRUN_API const char* dtype_name(DataType dtype);
TRUN_API const char* reduce_op_name(ReduceOp op);
TRUN_API const char* backend_name(Backend backend);
// Whether `op` may reduce `dtype` (see "Reductions" above); reduce_op_check throws
// std::invalid_argument naming both when not.
TRUN_API bool reduce_op_supports(ReduceOp op, DataType dtype);
TRUN_API void reduce_op_check(ReduceOp op, DataType dtype, const char* what);
// "auto", "cpu", "nccl" (case-insensitive); std::invalid_argument otherwise.
TRUN_API Backend parse_backend(const std::string& name);

// A collective failed: a peer died, closed its connection, aborted, or a transport error. The
// message names the operation, this rank and, when known, the peer.
class TRUN_API CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The collective's deadline passed (a peer stalled, or never arrived).
class TRUN_API CollectiveTimeoutError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

// Handle on one queued collective. Cheap to copy; all copies share the state.
class TRUN_API Work {
 public:
  Work() = default;
  // True once the collective finished, successfully or not. Never blocks.
  bool is_completed() const;
  // Blocks until the collective finished; rethrows its error (CollectiveError or a subclass).
  // Bounded by the collective's timeout.
  void wait() const;
  // The failure, or nullptr while pending or after success. Never blocks.
  std::exception_ptr error() const;

  struct TRUN_HIDDEN State;  // private
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// One send or receive of a batch_isend_irecv (as torch.distributed.P2POp).
struct P2POp {
  enum Kind { kSend, kRecv };
  Kind kind = kSend;
  void* data = nullptr;  // kSend: read; kRecv: written (count elements)
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  int peer = 0;  // a rank of this group other than this one
  int tag = 0;   // >= 0; a receive matches the sends from `peer` with the same tag, in order
};

// Host memory that the other ranks of this rank's node can read directly (the CPU backend's
// shared-memory segment; in the spirit of PyTorch 2.x's symmetric memory). Any collective or
// point-to-point call takes it like any other buffer. A send, all_to_all or all_to_all_v whose
// send buffer lies in one of these moves each byte with one copy instead of two: the receiving
// ranks of the node copy straight out of it. Zero-filled when allocated. Cheap to copy; the
// copies share the memory, which is freed (and its pages returned to the system) with the last
// one. It stays valid after its group is destroyed, but only its own group takes the one-copy
// path. See ProcessGroup::shared_buffer.
class TRUN_API SharedBuffer {
 public:
  SharedBuffer() = default;
  void* data() const;
  size_t size() const;  // bytes, as asked for
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }
  // False for ordinary memory (a group without a segment, or its area was full; see
  // ProcessGroup::shared_buffer): it works the same, with the usual two copies.
  bool shared() const;

  struct TRUN_HIDDEN Block;  // private
  explicit SharedBuffer(std::shared_ptr<Block> block) : block_(std::move(block)) {}

 private:
  std::shared_ptr<Block> block_;
};

struct ProcessGroupOptions {
  // Namespaced for this group and round (a re-created group needs a fresh prefix). Required when
  // world_size > 1; not owned exclusively: the group keeps a reference.
  std::shared_ptr<store::Store> store;
  int rank = 0;
  int world_size = 1;
  // Node layout: ranks that share node_rank share a machine (shared memory). -1: unknown, and
  // every rank is treated as a node of its own.
  int node_rank = -1;
  int local_rank = -1;
  Backend backend = Backend::kAuto;
  // Default deadline for each collective, and for building the group.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Part of shared-memory segment names (job id and round); any bytes, sanitized.
  std::string tag = "default";
  // NCCL: CUDA device to use; -1: local_rank modulo the number of devices.
  int cuda_device = -1;
  // NCCL: a cudaStream_t (passed as void*, so that this header needs no CUDA). Each collective
  // starts only after the work queued on it so far, e.g. the kernel that wrote the buffer.
  // nullptr: the legacy default stream, which orders it after every blocking stream; a program
  // that writes buffers on a non-blocking stream (libtorch's pool streams are such) passes that
  // stream here. The stream must outlive the group. CPU groups ignore it.
  void* cuda_stream = nullptr;
  // Gloo: local address to bind and advertise. Empty: the address this host uses to reach
  // `gloo_peer_hint` (the store's host), else 127.0.0.1.
  std::string gloo_host;
  std::string gloo_peer_hint;
};

class TRUN_API ProcessGroup {
 public:
  // Collective over every rank: blocks until all ranks constructed their group (bounded by
  // options.timeout). Throws std::invalid_argument for bad options, CollectiveError (or a
  // StoreError) when the group cannot be built, e.g. Backend::kNccl without a device.
  explicit ProcessGroup(ProcessGroupOptions options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  using Timeout = std::chrono::milliseconds;
  static constexpr Timeout kGroupTimeout{0};  // use the group's timeout

  Work allreduce_async(void* data, size_t count, DataType dtype, ReduceOp op = ReduceOp::kSum,
                       Timeout timeout = kGroupTimeout);
  Work broadcast_async(void* data, size_t count, DataType dtype, int root,
                       Timeout timeout = kGroupTimeout);
  Work allgather_async(const void* send, void* recv, size_t count, DataType dtype,
                       Timeout timeout = kGroupTimeout);
  Work reduce_scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                            ReduceOp op = ReduceOp::kSum, Timeout timeout = kGroupTimeout);
  Work barrier_async(Timeout timeout = kGroupTimeout);

  // reduce: in place, like allreduce, but only `root`'s buffer holds the result afterwards (the
  // others' buffers are left undefined: CPU backend, they hold the result too; NCCL, their input).
  Work reduce_async(void* data, size_t count, DataType dtype, ReduceOp op, int root,
                    Timeout timeout = kGroupTimeout);
  // gather: every rank sends `count` elements; root's `recv` receives count * size() elements
  // (rank r's at offset r * count). `recv` is only read on root (others may pass nullptr).
  Work gather_async(const void* send, void* recv, size_t count, DataType dtype, int root,
                    Timeout timeout = kGroupTimeout);
  // scatter: root's `send` holds count * size() elements; rank r receives block r (count
  // elements) into `recv`. `send` is only read on root (others may pass nullptr).
  Work scatter_async(const void* send, void* recv, size_t count, DataType dtype, int root,
                     Timeout timeout = kGroupTimeout);
  // all_to_all (equal splits): `send` and `recv` hold count * size() elements; block j of this
  // rank's send goes to rank j, and block i of its recv comes from rank i.
  Work all_to_all_async(const void* send, void* recv, size_t count, DataType dtype,
                        Timeout timeout = kGroupTimeout);
  // all_to_all_v (uneven splits, as all_to_all_single with split sizes): send_counts[j] elements
  // go to rank j, taken from `send` in rank order; recv_counts[i] elements come from rank i,
  // stored in `recv` in rank order. Both vectors have size() entries, and send_counts[j] on this
  // rank must equal recv_counts[this rank] on rank j: the CPU backend checks (CollectiveError on
  // every rank, naming both sizes); NCCL does not (a mismatch is undefined there, at best a
  // failure or a timeout). The vectors are copied; buffers must not overlap.
  Work all_to_all_v_async(const void* send, const std::vector<size_t>& send_counts, void* recv,
                          const std::vector<size_t>& recv_counts, DataType dtype,
                          Timeout timeout = kGroupTimeout);
  // Point-to-point. Not collective: only this rank and `peer` take part, and the other ranks'
  // queues are unaffected, but this rank's queue still runs in order (a recv queued behind a
  // collective starts after it). A send completes once its data was handed over (it may wait for
  // the matching recv); a recv completes once the data arrived. The element counts of a send and
  // its recv must match (CPU backend: CollectiveError naming both sizes; NCCL: undefined, as in
  // NCCL itself). Tags: CPU backend only (NCCL matches in issue order per peer, as PyTorch's
  // NCCL backend does). A peer that died or closed its connection fails the call with
  // CollectiveError naming the peer; one that never posts the match, with CollectiveTimeoutError
  // at the deadline (NCCL: at the deadline in both cases).
  Work send_async(const void* data, size_t count, DataType dtype, int peer, int tag = 0,
                  Timeout timeout = kGroupTimeout);
  Work recv_async(void* data, size_t count, DataType dtype, int peer, int tag = 0,
                  Timeout timeout = kGroupTimeout);
  // Every send and receive of `ops` posted at once (so that a ring exchange cannot deadlock),
  // completing together: as torch.distributed.batch_isend_irecv, but one Work for the batch.
  // An empty batch completes at once.
  Work batch_isend_irecv(const std::vector<P2POp>& ops, Timeout timeout = kGroupTimeout);

  // Blocking forms: the same as X_async(...).wait(), but run on the calling thread when no
  // other work is queued or running (saves the hand-off to the communication thread and back).
  void allreduce(void* data, size_t count, DataType dtype, ReduceOp op = ReduceOp::kSum,
                 Timeout timeout = kGroupTimeout);
  void broadcast(void* data, size_t count, DataType dtype, int root,
                 Timeout timeout = kGroupTimeout);
  void allgather(const void* send, void* recv, size_t count, DataType dtype,
                 Timeout timeout = kGroupTimeout);
  void reduce_scatter(const void* send, void* recv, size_t count, DataType dtype,
                      ReduceOp op = ReduceOp::kSum, Timeout timeout = kGroupTimeout);
  void barrier(Timeout timeout = kGroupTimeout);
  void reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root,
              Timeout timeout = kGroupTimeout);
  void gather(const void* send, void* recv, size_t count, DataType dtype, int root,
              Timeout timeout = kGroupTimeout);
  void scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
               Timeout timeout = kGroupTimeout);
  void all_to_all(const void* send, void* recv, size_t count, DataType dtype,
                  Timeout timeout = kGroupTimeout);
  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, DataType dtype,
                    Timeout timeout = kGroupTimeout);
  void send(const void* data, size_t count, DataType dtype, int peer, int tag = 0,
            Timeout timeout = kGroupTimeout);
  void recv(void* data, size_t count, DataType dtype, int peer, int tag = 0,
            Timeout timeout = kGroupTimeout);

  // A barrier that says who is missing (torch.distributed.monitored_barrier): every rank tells
  // rank 0 through the group's store that it arrived; rank 0 waits up to `timeout` (0: the
  // group's) and then releases them all, or, when some rank did not arrive, throws
  // CollectiveTimeoutError naming it ("rank 2 did not arrive at monitored_barrier within
  // 2000 ms") and the arrived ranks throw the same message. With wait_all_ranks the message
  // names every missing rank, else only the lowest. A rank that arrives late finds the verdict
  // and throws it too. Unlike the other collectives a failure does not break the group, and the
  // barrier does not use the backend (it works with NCCL; PyTorch's is Gloo-only). Every rank
  // must call it in the same order relative to its other monitored barriers; it runs after the
  // work queued before it. Non-rank-0 ranks wait for the verdict a little longer than `timeout`
  // (rank 0 may start late); if rank 0 never gives one, they throw CollectiveTimeoutError
  // naming rank 0.
  void monitored_barrier(Timeout timeout = kGroupTimeout, bool wait_all_ranks = false);

  // `bytes` of zero-filled host memory, page-aligned, in this rank's part of the node's
  // shared-memory segment (see SharedBuffer). Not collective: any rank, any time, any thread.
  // Each local rank's part holds TRUN_SHM_BUFFER_BYTES (default: 1 GiB, at most 8 GiB for the
  // node's ranks together; address space only until used). When the group has no segment (one
  // rank on this node, or a segment named in /dev/shm), this rank could not map the areas (an
  // address-space limit), or the part is full, the buffer is ordinary memory and shared() is
  // false (the last two noted once on stderr). An NCCL group throws std::invalid_argument (its
  // buffers are CUDA device memory).
  SharedBuffer shared_buffer(size_t bytes);

  // Breaks the group: the running collective fails at once (shared memory: the segment's abort
  // flag; Gloo: this process's connections are shut down; NCCL: the communicator is aborted),
  // queued and later ones fail at once, and the peers see the abort (or the closed
  // connections). Never blocks; idempotent.
  void abort(const std::string& reason = "aborted by the application");

  int rank() const;
  int size() const;
  Backend backend() const;
  // e.g. "cpu(shm)", "cpu(shm+gloo)", "cpu(gloo)", "nccl".
  std::string backend_description() const;
  // True once a collective failed or abort() was called.
  bool broken() const;

  struct TRUN_HIDDEN Impl;  // private

 private:
  std::unique_ptr<Impl> impl_;
};

// True when this build includes the NCCL backend and the process sees at least one CUDA device.
TRUN_API bool nccl_available();

}  // namespace trun::worker
