// The NCCL backend: one communicator per group, its unique id passed through the store, work on
// a dedicated non-blocking stream. The communicator is created non-blocking, so that neither
// its creation nor a collective can hang the process: the communication thread polls the
// stream's completion event and ncclCommGetAsyncError, and past the deadline (or on abort())
// aborts the communicator and raises. NCCL and the CUDA runtime are loaded on first use
// (gpu_libs.h), not with libtrun_worker.

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "worker_sdk/src/backend.h"
#include "worker_sdk/src/nccl/cuda_check.h"
#include "worker_sdk/src/nccl/nccl_info.h"

namespace trun::worker {

// The CUDA runtime first: a machine with it but no device never loads NCCL, a large library.
bool nccl_available() {
  return detail::cuda_device_count(nullptr) > 0 && detail::nccl_loadable(nullptr);
}

namespace detail {
namespace {

// The rank that messages name: per thread, since one process may hold several ranks' groups
// (one per GPU); set by the backend on the thread that calls into CUDA and NCCL.
thread_local int t_rank = -1;

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

ncclDataType_t to_nccl(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
    case DataType::kBool:
      return ncclUint8;
  }
  throw std::invalid_argument("unknown dtype");
}

// kBool travels as uint8 holding 0 or 1: OR is max and AND is min (PyTorch's NCCL backend maps
// sum and product of bool the same way). Inputs must then be 0 or 1, which PyTorch's bool
// tensors are.
ncclRedOp_t to_nccl(ReduceOp op, DataType dtype) {
  const bool boolean = dtype == DataType::kBool;
  switch (op) {
    case ReduceOp::kSum:
      return boolean ? ncclMax : ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return boolean ? ncclMin : ncclProd;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      break;
  }
  throw std::invalid_argument(std::string("the NCCL backend has no reduction ") +
                              reduce_op_name(op));
}

class NcclBackend : public BackendImpl {
 public:
  NcclBackend(const ProcessGroupOptions& o, Deadline deadline)
      : rank_(o.rank),
        size_(o.world_size),
        order_after_(o.cuda_stream ? static_cast<cudaStream_t>(o.cuda_stream) : cudaStreamLegacy) {
    try {
      init(o, deadline);
    } catch (...) {
      failed_ = true;  // a communicator half made is aborted, not finalized
      release();       // the destructor does not run for a constructor that throws
      throw;
    }
  }

  ~NcclBackend() override { release(); }

 private:
  void init(const ProcessGroupOptions& o, Deadline deadline) {
    std::string why;
    // Both libraries before the device count, so that a missing one is reported as such rather
    // than as "no CUDA device".
    if (!cudart_loadable(&why) || !nccl_loadable(&why))
      throw CollectiveError("NCCL backend on rank " + std::to_string(rank_) + ": " + why);
    int n = cuda_device_count(&why);
    if (n == 0)
      throw CollectiveError("NCCL backend on rank " + std::to_string(rank_) +
                            ": no CUDA device: " + why);
    device_ = o.cuda_device >= 0 ? o.cuda_device : std::max(o.local_rank, 0) % n;
    if (device_ >= n)
      throw std::invalid_argument("NCCL backend: cuda_device " + std::to_string(device_) +
                                  " but only " + std::to_string(n) + " devices are visible");
    set_cuda_check_rank(rank_);
    TRUN_CUDA_CHECK(cudaSetDevice, device_);
    TRUN_CUDA_CHECK(cudaStreamCreateWithFlags, &stream_, cudaStreamNonBlocking);
    TRUN_CUDA_CHECK(cudaEventCreateWithFlags, &event_, cudaEventDisableTiming);
    TRUN_CUDA_CHECK(cudaEventCreateWithFlags, &inputs_ready_, cudaEventDisableTiming);
    TRUN_CUDA_CHECK(cudaMalloc, &scratch_, sizeof(float));

    ncclUniqueId id;
    if (rank_ == 0) {
      TRUN_NCCL_CHECK(nullptr, ncclGetUniqueId, &id);
      if (size_ > 1) o.store->set("nccl/unique_id", std::string_view(id.internal, sizeof id));
    } else {
      o.store->wait({"nccl/unique_id"}, remaining(deadline));
      std::string bytes = o.store->get("nccl/unique_id");
      if (bytes.size() != sizeof id)
        throw CollectiveError("NCCL unique id from the store has " + std::to_string(bytes.size()) +
                              " bytes, expected " + std::to_string(sizeof id));
      std::memcpy(id.internal, bytes.data(), sizeof id);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    TRUN_NCCL_CHECK(comm_, ncclCommInitRankConfig, &comm_, size_, id, rank_, &config);
    wait_comm_ready("ncclCommInitRankConfig", deadline);
  }

  // Finalizes (or, after a failure, aborts) the communicator and frees the CUDA resources.
  void release() {
    if (comm_) {  // made after both libraries were loaded, like the CUDA resources below
      const NcclApi& api = nccl();
      bool clean = !failed_ && !aborted_;
      if (clean) {
        // Non-blocking finalize: give it a bounded time, abort if it does not finish.
        ncclResult_t fin = api.ncclCommFinalize(comm_);
        clean = fin == ncclSuccess || fin == ncclInProgress;
        auto limit = Clock::now() + std::chrono::seconds(10);
        ncclResult_t state = ncclInProgress;
        while (clean && Clock::now() < limit) {
          if (api.ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state != ncclInProgress)
            break;
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        clean = clean && state == ncclSuccess;
      }
      if (clean)
        api.ncclCommDestroy(comm_);
      else
        api.ncclCommAbort(comm_);
    }
    comm_ = nullptr;
    if (scratch_) cudart().cudaFree(scratch_);
    if (event_) cudart().cudaEventDestroy(event_);
    if (inputs_ready_) cudart().cudaEventDestroy(inputs_ready_);
    if (stream_) cudart().cudaStreamDestroy(stream_);
    scratch_ = nullptr;
    event_ = inputs_ready_ = nullptr;
    stream_ = nullptr;
  }

 public:
  std::string description() const override { return "nccl"; }

  void allreduce(void* data, size_t count, DataType dtype, ReduceOp op,
                 Deadline deadline) override {
    if (count == 0) return;
    run("ncclAllReduce", deadline, [&] {
      return nccl().ncclAllReduce(data, data, count, to_nccl(dtype), to_nccl(op, dtype), comm_,
                                  stream_);
    });
  }
  void broadcast(void* data, size_t count, DataType dtype, int root, Deadline deadline) override {
    if (count == 0) return;
    run("ncclBroadcast", deadline, [&] {
      return nccl().ncclBroadcast(data, data, count, to_nccl(dtype), root, comm_, stream_);
    });
  }
  void allgather(const void* send, void* recv, size_t count, DataType dtype,
                 Deadline deadline) override {
    if (count == 0) return;
    run("ncclAllGather", deadline,
        [&] { return nccl().ncclAllGather(send, recv, count, to_nccl(dtype), comm_, stream_); });
  }
  void reduce_scatter(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      Deadline deadline) override {
    if (count == 0) return;
    run("ncclReduceScatter", deadline, [&] {
      return nccl().ncclReduceScatter(send, recv, count, to_nccl(dtype), to_nccl(op, dtype), comm_,
                                      stream_);
    });
  }
  void barrier(Deadline deadline) override {
    run("barrier (ncclAllReduce)", deadline, [&] {
      return nccl().ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_);
    });
  }
  void reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root,
              Deadline deadline) override {
    if (count == 0) return;
    run("ncclReduce", deadline, [&] {
      return nccl().ncclReduce(data, data, count, to_nccl(dtype), to_nccl(op, dtype), root, comm_,
                               stream_);
    });
  }

  // gather, scatter and all_to_all: grouped ncclSend/ncclRecv (this rank's own block too: NCCL
  // copies a send to self into the matching receive).
  void gather(const void* send, void* recv, size_t count, DataType dtype, int root,
              Deadline deadline) override {
    if (count == 0) return;
    const size_t bytes = count * dtype_size(dtype);
    run("gather (ncclSend/ncclRecv)", deadline, [&] {
      return grouped([&](ncclResult_t& first) {
        keep(first, nccl().ncclSend(send, count, to_nccl(dtype), root, comm_, stream_));
        if (rank_ == root)
          for (int r = 0; r < size_; ++r)
            keep(first, nccl().ncclRecv(static_cast<char*>(recv) + r * bytes, count, to_nccl(dtype),
                                        r, comm_, stream_));
      });
    });
  }

  void scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
               Deadline deadline) override {
    if (count == 0) return;
    const size_t bytes = count * dtype_size(dtype);
    run("scatter (ncclSend/ncclRecv)", deadline, [&] {
      return grouped([&](ncclResult_t& first) {
        if (rank_ == root)
          for (int r = 0; r < size_; ++r)
            keep(first, nccl().ncclSend(static_cast<const char*>(send) + r * bytes, count,
                                        to_nccl(dtype), r, comm_, stream_));
        keep(first, nccl().ncclRecv(recv, count, to_nccl(dtype), root, comm_, stream_));
      });
    });
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, DataType dtype,
                    Deadline deadline) override {
    const size_t es = dtype_size(dtype);
    run("all_to_all (ncclSend/ncclRecv)", deadline, [&] {
      return grouped([&](ncclResult_t& first) {
        size_t so = 0, ro = 0;
        for (int r = 0; r < size_; ++r) {
          if (send_counts[r])
            keep(first, nccl().ncclSend(static_cast<const char*>(send) + so * es, send_counts[r],
                                        to_nccl(dtype), r, comm_, stream_));
          if (recv_counts[r])
            keep(first, nccl().ncclRecv(static_cast<char*>(recv) + ro * es, recv_counts[r],
                                        to_nccl(dtype), r, comm_, stream_));
          so += send_counts[r];
          ro += recv_counts[r];
        }
      });
    });
  }

  // NCCL has no tags: messages between two ranks match in issue order (as with PyTorch's NCCL
  // backend). Zero-element transfers are skipped on both sides.
  void p2p(const std::vector<P2POp>& ops, Deadline deadline) override {
    run("ncclSend/ncclRecv", deadline, [&] {
      return grouped([&](ncclResult_t& first) {
        for (const P2POp& op : ops) {
          if (op.count == 0) continue;
          keep(
              first,
              op.kind == P2POp::kSend
                  ? nccl().ncclSend(op.data, op.count, to_nccl(op.dtype), op.peer, comm_, stream_)
                  : nccl().ncclRecv(op.data, op.count, to_nccl(op.dtype), op.peer, comm_, stream_));
        }
      });
    });
  }

  void check_op(ReduceOp op, DataType dtype, const char* what) const override {
    if (op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor)
      throw std::invalid_argument(std::string(what) +
                                  ": the NCCL backend has no bitwise reduction (" +
                                  reduce_op_name(op) + " on " + dtype_name(dtype) + ")");
  }

  void abort(const std::string& reason) override { aborted_ = true; }

 private:
  static void keep(ncclResult_t& first, ncclResult_t r) {
    if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
  }

  // ncclGroupStart, the calls, ncclGroupEnd (always, once started); the first failure.
  template <typename Calls>
  static ncclResult_t grouped(Calls&& calls) {
    ncclResult_t first = nccl().ncclGroupStart();
    if (first != ncclSuccess) return first;
    calls(first);
    ncclResult_t end = nccl().ncclGroupEnd();
    return first != ncclSuccess ? first : end;
  }

  // Polls until the communicator has no operation in progress.
  void wait_comm_ready(const char* what, Deadline deadline) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      TRUN_NCCL_CHECK(comm_, ncclCommGetAsyncError, comm_, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(nccl_error_message(what, state, comm_, __FILE__, __LINE__));
      check_abort_and_deadline(what, deadline);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  void check_abort_and_deadline(const char* what, Deadline deadline) {
    if (aborted_)
      fail(cuda_check_where(__FILE__, __LINE__) + " " + what +
           ": the process group was aborted; NCCL communicator aborted");
    if (Clock::now() >= deadline) {
      failed_ = true;
      nccl().ncclCommAbort(comm_);
      comm_ = nullptr;
      throw CollectiveTimeoutError(cuda_check_where(__FILE__, __LINE__) + " " + what +
                                   " timed out; NCCL communicator aborted");
    }
  }

  [[noreturn]] void fail(const std::string& msg) {
    failed_ = true;
    if (comm_) nccl().ncclCommAbort(comm_);
    comm_ = nullptr;
    throw CollectiveError(msg);
  }

  template <typename Launch>
  void run(const char* what, Deadline deadline, Launch&& launch) {
    if (!comm_) throw CollectiveError(std::string(what) + ": NCCL communicator is gone");
    set_cuda_check_rank(rank_);  // this may be another thread than the constructor's
    TRUN_CUDA_CHECK(cudaSetDevice, device_);
    // Our stream does not synchronize with any other by itself (it is non-blocking): make it
    // wait for what the program queued on its stream (options.cuda_stream), or else on the
    // legacy default stream, which every blocking stream synchronizes with; e.g. the kernel
    // that wrote the buffer.
    TRUN_CUDA_CHECK(cudaEventRecord, inputs_ready_, order_after_);
    TRUN_CUDA_CHECK(cudaStreamWaitEvent, stream_, inputs_ready_, 0);
    ncclResult_t res = launch();
    if (res != ncclSuccess && res != ncclInProgress)
      fail(nccl_error_message(what, res, comm_, __FILE__, __LINE__));
    wait_comm_ready(what, deadline);
    TRUN_CUDA_CHECK(cudaEventRecord, event_, stream_);
    for (;;) {
      cudaError_t q = cudart().cudaEventQuery(event_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) fail(cuda_error_message(what, q, __FILE__, __LINE__));
      ncclResult_t state = ncclSuccess;
      nccl().ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress)
        fail(nccl_error_message(what, state, comm_, __FILE__, __LINE__));
      check_abort_and_deadline(what, deadline);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  int rank_;
  int size_;
  cudaStream_t order_after_;  // the program's stream that collectives wait for
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;         // recorded after the collective: completion
  cudaEvent_t inputs_ready_ = nullptr;  // recorded on the legacy stream before it
  void* scratch_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborted_{false};
  bool failed_ = false;
};

}  // namespace

void set_cuda_check_rank(int rank) { t_rank = rank; }

std::string cuda_check_where(const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  return "[host " + host_name() + " rank " + std::to_string(t_rank) + "] " +
         (base ? base + 1 : file) + ":" + std::to_string(line) + ":";
}

std::string cuda_error_message(const char* call, cudaError_t err, const char* file, int line) {
  const CudaRuntimeApi& cuda = cudart();
  return cuda_check_where(file, line) + " " + call + " failed: " + cuda.cudaGetErrorString(err) +
         " (" + cuda.cudaGetErrorName(err) + " " + std::to_string(static_cast<int>(err)) + ")";
}

std::string nccl_error_message(const char* call, ncclResult_t res, ncclComm_t comm,
                               const char* file, int line) {
  const char* last = nccl().ncclGetLastError(comm);
  return cuda_check_where(file, line) + " " + call + " failed: " + nccl().ncclGetErrorString(res) +
         " (ncclResult " + std::to_string(static_cast<int>(res)) +
         "); NCCL: " + (last && *last ? last : "(no further detail)");
}

void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line) {
  throw CollectiveError(cuda_error_message(call, err, file, line));
}

void throw_nccl_error(const char* call, ncclResult_t res, ncclComm_t comm, const char* file,
                      int line) {
  throw CollectiveError(nccl_error_message(call, res, comm, file, line));
}

int cuda_device_count(std::string* why) {
  if (!cudart_loadable(why)) return 0;
  const CudaRuntimeApi& cuda = cudart();
  int n = 0;  // without a driver the runtime returns an error and leaves `n` untouched
  cudaError_t err = cuda.cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why) *why = std::string("cudaGetDeviceCount: ") + cuda.cudaGetErrorString(err);
    cuda.cudaGetLastError();  // clear the sticky-less error so later calls do not see it
    return 0;
  }
  if (n == 0 && why) *why = "cudaGetDeviceCount returned 0 devices";
  return n;
}

std::string nccl_runtime_version() {
  int v = 0;
  TRUN_NCCL_CHECK(nullptr, ncclGetVersion, &v);
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

std::string nccl_new_unique_id() {
  ncclUniqueId id;
  TRUN_NCCL_CHECK(nullptr, ncclGetUniqueId, &id);
  return std::string(id.internal, sizeof id);
}

std::string nccl_error_for_test(int nccl_result) {
  return nccl_error_message("ncclTestCall()", static_cast<ncclResult_t>(nccl_result), nullptr,
                            __FILE__, __LINE__);
}

std::string cuda_error_for_test(int cuda_error) {
  return cuda_error_message("cudaTestCall()", static_cast<cudaError_t>(cuda_error), __FILE__,
                            __LINE__);
}

std::unique_ptr<BackendImpl> make_nccl_backend(const ProcessGroupOptions& options,
                                               Deadline deadline) {
  return std::make_unique<NcclBackend>(options, deadline);
}

}  // namespace detail
}  // namespace trun::worker
