// A worker for the SDK's multi-process tests: reads the launcher environment through
// trun::worker::init() and runs one scenario, checking results against a serial reference.
//
//   pg_worker matrix [size...]   every op x dtype x size; exit 0 when all match
//   pg_worker big                every collective x dtype on 64 MiB buffers
//   pg_worker coll [size...]     reduce, gather, scatter, all_to_all (equal and uneven), send/recv
//                                and batch_isend_irecv, and allreduce with the ops and dtypes that
//                                came with them, x every dtype and op each accepts; exit 0 when
//                                all match. PG_WORKER_SKIP_BITWISE=1: no kBand/kBor/kBxor (NCCL)
//   pg_worker groups             new_group(ranks) over the odd ranks and new_subgroups(2): members
//                                get groups of the right rank and size whose allreduce covers
//                                exactly them, others nullptr; bad rank lists are refused
//   pg_worker mbarrier <late> <all> [never]
//                                a monitored_barrier every rank passes, then one that the ranks
//                                in the comma-separated <late> list reach 2.5 s late (rank 0
//                                waits 1.5 s; <all>: wait_all_ranks 0/1), or with "never" do not
//                                call at all (they exit 0): every rank that calls it must throw
//                                CollectiveTimeoutError; prints "VERDICT <message>", exit 17
//   pg_worker dump <dir>         the collectives tests/worker_sdk/torch_collectives.py runs under
//                                PyTorch gloo, on the same inputs, each result written to
//                                <dir>/<rank>/<name>.bin for collectives_torch_test.cpp
//   pg_worker p2p_dead <when>    rank 1 dies (SIGKILL) "before" it ever connects to rank 0 or
//                                "after" one exchange; rank 0's recv from it must fail naming
//                                rank 1: exit 15 (CollectiveError), 16 (timeout), 4 otherwise
//   pg_worker a2a_dead <MiB>     every rank runs all_to_all of <MiB> per rank in a loop; rank 1
//                                dies (SIGKILL, from a thread) 300 ms into it, mid-exchange: the
//                                others must fail naming it: exit 15 (CollectiveError naming local
//                                rank 1 or rank 1), 16 (timeout), 4 otherwise (or no failure in
//                                2000 calls)
//   pg_worker p2p_big <MiB> [<rank> <call>]
//                                a 4000-byte message 0 -> 1, then messages of <MiB> MiB plus
//                                12 KiB between ranks of a node, three times each: send/recv
//                                0 -> 1 and 1 -> 0, a ring of batch_isend_irecv, two sends to
//                                rank 1 in one batch (tags 1 and 2, received in the other
//                                order); exit 0 when all match. With
//                                <rank> and <call> (process_vm_readv or process_vm_writev): that
//                                rank first makes the call fail with EPERM (seccomp), as a
//                                container's policy would (exit 18 when it cannot)
//   pg_worker p2p_mismatch <n>   rank 0 sends 1000 int32 to rank 1, which posts a receive of <n>
//                                (not 1000): both must fail at once naming both sizes in bytes
//                                (exit 15), and a later send must fail at once, the group
//                                broken (exit 4 otherwise, 16 on a timeout)
//   pg_worker shared_buf         ProcessGroup::shared_buffer: zero-filled, shared() on a node of
//                                several ranks; a freed block's pages come back zeroed; a buffer
//                                outlives its (sub)group; all_to_all and send/recv with a
//                                buffer of a destroyed subgroup still match; exit 0 when all hold
//   PG_WORKER_SHARED=all|odd     (any scenario that goes through OnDevice, e.g. coll) buffers
//                                are copied into ProcessGroup::shared_buffer blocks, on every
//                                rank or on the odd ranks only; prints "SHARED <k> of <m>"
//                                (blocks in the segment) at the end
//   PG_WORKER_LIMIT_AS_RANK=<r>  rank <r> limits its address space (RLIMIT_AS) to what it uses
//                                plus 1 GiB before init, too little for the shared buffer areas
//   pg_worker p2p_mixed_fail <dir>
//                                4 ranks on 2 nodes of 2: rank 0 posts one batch of a receive of
//                                999 int32 from rank 2 (which sends 1000) and a send to rank 1,
//                                on its node; the TCP part fails before the local one starts, and
//                                rank 1 must fail at once naming rank 0's failure (not at its
//                                deadline): ranks 0-2 exit 15, 16 on a timeout, 4 otherwise.
//                                Rank 0 lives on until rank 1 has failed (<dir>/rank1_failed, at
//                                most 30 s), so that rank 1 cannot learn of it by rank 0's exit
//   pg_worker p2p_big_dead <rank>
//                                ranks 0 and 1 exchange 16 MiB messages in turns in a loop; <rank>
//                                dies (SIGKILL, from a thread) 300 ms into it: the other must fail
//                                naming it: exit 15 (CollectiveError), 16 (timeout), 4 otherwise
//   pg_worker stall <victim> <timeout_ms>
//                                the victim never joins; the others must time out (exit 10)
//   pg_worker loop               allreduce until failure, printing READY after the first;
//                                exit 11 on CollectiveError
//   pg_worker abort              rank 0 aborts while the others wait; others exit 12
//   pg_worker abort_inflight <first_absent>
//                                ranks >= first_absent never join; the others allreduce and a
//                                second thread of rank 0 aborts it: exit 13 when it failed
//                                naming the abort, 4 on a timeout
//   pg_worker abort_midstream    every rank runs 16 MiB allreduces (READY after the first);
//                                rank 0 aborts when it receives SIGUSR1 (the test first stops a
//                                peer with SIGSTOP, most likely in the middle of a message): exit
//                                14 when the allreduce failed naming the abort, 4 on a timeout
//   pg_worker kill_once          first attempt (TORCHELASTIC_RESTART_COUNT=0): loop, with rank 1
//                                SIGKILLing itself after 3 allreduces; later attempts: matrix
//                                on sizes 0, 1, 1000
//   pg_worker shrink             in a world of more than one: loop; alone: matrix on sizes 0, 1,
//                                1000 (an elastic job that loses its other nodes)
//   pg_worker throw | segv       die by an uncaught exception / SIGSEGV (error-file tests)
//
// Every scenario first prints "env launcher=... init=... rank=... world=... local_rank=...
// local_world=... group_rank=... group_world=... run_id=..." (WorkerEnv, for the launcher tests).
// PG_WORKER_BACKEND=cpu|nccl|auto picks the backend; PG_WORKER_CUDA=1 (builds with NCCL) runs
// matrix, stall and loop on device buffers: each collective gets device copies of its buffers.
//
// Exit codes: 0 pass, 1 mismatch, 2 usage, 3 unexpected exception.

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <trun/config.h>
#include <trun/error_file.h>
#include <trun/worker.h>

#include "worker_sdk/src/reduce.h"

#if TRUN_HAVE_NCCL
#include <cuda_runtime.h>
#endif

using namespace trun::worker;
using Clock = std::chrono::steady_clock;

namespace {

constexpr DataType kDtypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                                DataType::kBFloat16, DataType::kInt32,   DataType::kInt64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax};

// Small integers: exact in every dtype, and sums of up to 8 ranks stay exact in bfloat16.
int64_t value(int rank, size_t i) {
  return static_cast<int64_t>((static_cast<uint64_t>(rank) * 7 + i * 13) % 29) - 14;
}

// Stores `v` (exact, or the quotient of an average) as dtype at index i.
void store(void* buf, size_t i, DataType dt, double v) {
  switch (dt) {
    case DataType::kFloat32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case DataType::kFloat64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DataType::kFloat16:
      static_cast<uint16_t*>(buf)[i] = detail::float_to_half(static_cast<float>(v));
      break;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(buf)[i] = detail::float_to_bfloat16(static_cast<float>(v));
      break;
    case DataType::kInt32:
      static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v);
      break;
    case DataType::kInt64:
      static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v);
      break;
    case DataType::kInt8:  // wraps, as the library's integer arithmetic does
      static_cast<int8_t*>(buf)[i] = static_cast<int8_t>(static_cast<int64_t>(v));
      break;
    case DataType::kUInt8:
      static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(static_cast<int64_t>(v));
      break;
    case DataType::kBool:
      static_cast<uint8_t*>(buf)[i] = v != 0 ? 1 : 0;
      break;
  }
}

// The scenarios' buffers come from a pool that keeps freed blocks for reuse, by size. A fresh
// block of more than about 128 KiB is a new mapping under every allocator here (glibc's past its
// mmap threshold, ASan's and TSan's always), page-faulted in anew: that was most of the time of
// the reference scenarios (the 64 MiB case: 103 s of 125, plain build; the matrix under ASan).
class BlockPool {
 public:
  static BlockPool& get() {
    static BlockPool* pool = new BlockPool;  // never destroyed: buffers outlive main's locals
    return *pool;
  }
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        kept_ -= bytes;
        return p;
      }
    }
    if (void* p = std::malloc(bytes ? bytes : 1)) return p;
    throw std::bad_alloc();
  }
  void give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (kept_ + bytes <= kKeepBytes) {
        free_.emplace(bytes, p);
        kept_ += bytes;
        return;
      }
    }
    std::free(p);
  }

 private:
  static constexpr size_t kKeepBytes = size_t{512} << 20;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  size_t kept_ = 0;
};

template <typename T>
struct Pooled {
  using value_type = T;
  Pooled() = default;
  template <typename U>
  Pooled(const Pooled<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(BlockPool::get().take(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { BlockPool::get().give(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const Pooled<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const Pooled<U>&) const {
    return false;
  }
};
using Bytes = std::vector<char, Pooled<char>>;

Bytes make(size_t n, DataType dt) { return Bytes(n * dtype_size(dt) + 1); }

void fill(Bytes& buf, size_t n, DataType dt, int rank, size_t base = 0) {
  for (size_t i = 0; i < n; ++i)
    store(buf.data(), i, dt, static_cast<double>(value(rank, base + i)));
}

// Expected reduction of element `i` over all ranks, as the library defines it.
double reduce_ref(int world, size_t i, DataType dt, ReduceOp op) {
  int64_t s = 0, mn = INT64_MAX, mx = INT64_MIN;
  for (int r = 0; r < world; ++r) {
    int64_t v = value(r, i);
    s += v;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  switch (op) {
    case ReduceOp::kSum:
      return static_cast<double>(s);
    case ReduceOp::kMin:
      return static_cast<double>(mn);
    case ReduceOp::kMax:
      return static_cast<double>(mx);
    case ReduceOp::kAvg:
      if (dt == DataType::kInt32 || dt == DataType::kInt64) return static_cast<double>(s / world);
      if (dt == DataType::kFloat64) return static_cast<double>(s) / world;
      return static_cast<double>(static_cast<float>(s) / static_cast<float>(world));
    default:  // the other ops: coll_ref
      break;
  }
  return 0;
}

int g_failures = 0;
bool g_cuda = false;                  // PG_WORKER_CUDA=1
ProcessGroup* g_shared_pg = nullptr;  // PG_WORKER_SHARED: buffers from its shared_buffer
int g_shared_blocks = 0, g_shared_in_segment = 0;

// A host buffer as a collective sees it: the buffer itself or, with PG_WORKER_CUDA, a device
// copy of it for as long as this object lives (copied in now, out by back()).
class OnDevice {
 public:
  OnDevice(void* host, size_t bytes) : host_(host), bytes_(bytes) {
    if (g_shared_pg) {
      shared_ = g_shared_pg->shared_buffer(bytes);
      ++g_shared_blocks;
      g_shared_in_segment += shared_.shared() ? 1 : 0;
      if (bytes) std::memcpy(shared_.data(), host, bytes);
      return;
    }
#if TRUN_HAVE_NCCL
    if (!g_cuda) return;
    must(cudaMalloc(&dev_, bytes + 1), "cudaMalloc");
    must(cudaMemcpy(dev_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the device");
#endif
  }
  ~OnDevice() {
#if TRUN_HAVE_NCCL
    if (dev_) cudaFree(dev_);
#endif
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

  void* ptr() const { return shared_.data() ? shared_.data() : dev_ ? dev_ : host_; }
  void back() {
    if (shared_.data() && bytes_) std::memcpy(host_, shared_.data(), bytes_);
#if TRUN_HAVE_NCCL
    if (dev_) must(cudaMemcpy(host_, dev_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy back");
#endif
  }

 private:
#if TRUN_HAVE_NCCL
  static void must(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
      throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
#endif
  void* host_;
  size_t bytes_;
  void* dev_ = nullptr;
  SharedBuffer shared_;
};

// The collectives on host vectors, through OnDevice.
void allreduce(ProcessGroup& pg, Bytes& buf, size_t n, DataType dt, ReduceOp op) {
  OnDevice d(buf.data(), n * dtype_size(dt));
  pg.allreduce(d.ptr(), n, dt, op);
  d.back();
}

void broadcast(ProcessGroup& pg, Bytes& buf, size_t n, DataType dt, int root) {
  OnDevice d(buf.data(), n * dtype_size(dt));
  pg.broadcast(d.ptr(), n, dt, root);
  d.back();
}

void allgather(ProcessGroup& pg, Bytes& send, Bytes& recv, size_t n, DataType dt) {
  OnDevice s(send.data(), n * dtype_size(dt)), r(recv.data(), n * pg.size() * dtype_size(dt));
  pg.allgather(s.ptr(), r.ptr(), n, dt);
  r.back();
}

void reduce_scatter(ProcessGroup& pg, Bytes& send, Bytes& recv, size_t n, DataType dt,
                    ReduceOp op) {
  OnDevice s(send.data(), n * pg.size() * dtype_size(dt)), r(recv.data(), n * dtype_size(dt));
  pg.reduce_scatter(s.ptr(), r.ptr(), n, dt, op);
  r.back();
}

void check(const std::string& what, const Bytes& got, const Bytes& want, size_t n, DataType dt) {
  size_t es = dtype_size(dt);
  if (std::memcmp(got.data(), want.data(), n * es) == 0) return;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(got.data() + i * es, want.data() + i * es, es) != 0) {
      std::fprintf(stderr, "MISMATCH %s at element %zu of %zu\n", what.c_str(), i, n);
      break;
    }
  }
  ++g_failures;
}

std::string label(const char* op, DataType dt, size_t n, const char* extra = "") {
  return std::string(op) + "(" + dtype_name(dt) + ", n=" + std::to_string(n) + extra + ")";
}

// n elements of dt whose element i is f(i % 29): every value in these tests repeats every 29
// elements, so a 64 MiB buffer is 29 computed elements and doubling copies.
template <typename F>
Bytes periodic(size_t n, DataType dt, F f) {
  const size_t es = dtype_size(dt);
  auto buf = make(n, dt);
  const size_t period = std::min<size_t>(29, n);
  for (size_t i = 0; i < period; ++i) store(buf.data(), i, dt, f(i));
  for (size_t done = period; done < n;) {
    const size_t c = std::min(done, n - done);
    std::memcpy(buf.data() + done * es, buf.data(), c * es);
    done += c;
  }
  return buf;
}

void run_matrix(ProcessGroup& pg, const std::vector<size_t>& sizes) {
  const int world = pg.size(), rank = pg.rank();
  for (DataType dt : kDtypes) {
    for (size_t n : sizes) {
      for (ReduceOp op : kOps) {
        auto buf = make(n, dt);
        fill(buf, n, dt, rank);
        auto want = periodic(n, dt, [&](size_t i) { return reduce_ref(world, i, dt, op); });
        allreduce(pg, buf, n, dt, op);
        check(label("allreduce", dt, n, reduce_op_name(op)), buf, want, n, dt);
      }
      {
        int root = static_cast<int>(n % world);
        auto buf = make(n, dt), want = make(n, dt);
        fill(buf, n, dt, rank);
        fill(want, n, dt, root);
        broadcast(pg, buf, n, dt, root);
        check(label("broadcast", dt, n), buf, want, n, dt);
      }
      {
        auto send = make(n, dt), recv = make(n * world, dt), want = make(n * world, dt);
        fill(send, n, dt, rank);
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < n; ++i)
            store(want.data(), r * n + i, dt, static_cast<double>(value(r, i)));
        allgather(pg, send, recv, n, dt);
        check(label("allgather", dt, n), recv, want, n * world, dt);
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        auto send = make(n * world, dt), recv = make(n, dt);
        fill(send, n * world, dt, rank);
        auto want =
            periodic(n, dt, [&](size_t i) { return reduce_ref(world, rank * n + i, dt, op); });
        reduce_scatter(pg, send, recv, n, dt, op);
        check(label("reduce_scatter", dt, n, reduce_op_name(op)), recv, want, n, dt);
      }
    }
  }
  pg.barrier();
  // Async: several collectives in flight, completed in order.
  const size_t n = 1001;
  std::vector<Bytes> bufs;
  std::vector<std::unique_ptr<OnDevice>> staged;
  std::vector<Work> works;
  for (int k = 0; k < 4; ++k) {
    bufs.push_back(make(n, DataType::kFloat32));
    fill(bufs.back(), n, DataType::kFloat32, rank);
  }
  for (auto& b : bufs) {
    staged.push_back(std::make_unique<OnDevice>(b.data(), n * 4));
    works.push_back(pg.allreduce_async(staged.back()->ptr(), n, DataType::kFloat32));
  }
  works.push_back(pg.barrier_async());
  // A blocking call while async work is queued: it must run after that work, in the same order
  // on every rank (a different order would pair different buffers across ranks).
  auto blocking = make(n, DataType::kFloat32);
  fill(blocking, n, DataType::kFloat32, rank);
  allreduce(pg, blocking, n, DataType::kFloat32, ReduceOp::kSum);
  for (auto& w : works) {
    if (!w.is_completed()) {
      std::fprintf(stderr, "MISMATCH a blocking call returned before earlier async work\n");
      ++g_failures;
    }
    w.wait();
  }
  for (auto& d : staged) d->back();
  auto want = make(n, DataType::kFloat32);
  for (size_t i = 0; i < n; ++i)
    store(want.data(), i, DataType::kFloat32,
          reduce_ref(world, i, DataType::kFloat32, ReduceOp::kSum));
  for (size_t k = 0; k < works.size(); ++k) {
    if (!works[k].is_completed() || works[k].error()) {
      std::fprintf(stderr, "MISMATCH async work %zu not completed cleanly\n", k);
      ++g_failures;
    }
    if (k < bufs.size()) check("allreduce_async", bufs[k], want, n, DataType::kFloat32);
  }
  check("allreduce after async work", blocking, want, n, DataType::kFloat32);
}

// Every operation x dtype on 64 MiB buffers (n = 64 MiB / element size), against the reference.
void run_big(ProcessGroup& pg) {
  const int world = pg.size(), rank = pg.rank();
  for (DataType dt : kDtypes) {
    const size_t n = (64u << 20) / dtype_size(dt);
    auto mine = [&](size_t base) {
      return [&, base](size_t i) { return static_cast<double>(value(rank, base + i)); };
    };
    for (ReduceOp op : kOps) {
      auto buf = periodic(n, dt, mine(0));
      auto want = periodic(n, dt, [&](size_t i) { return reduce_ref(world, i, dt, op); });
      pg.allreduce(buf.data(), n, dt, op);
      check(label("allreduce", dt, n, reduce_op_name(op)), buf, want, n, dt);
    }
    {
      const int root = world - 1;
      auto buf = periodic(n, dt, mine(0));
      auto want = periodic(n, dt, [&](size_t i) { return static_cast<double>(value(root, i)); });
      pg.broadcast(buf.data(), n, dt, root);
      check(label("broadcast", dt, n), buf, want, n, dt);
    }
    const size_t per = n / world;  // 64 MiB in (all ranks together), 64 MiB out
    {
      auto send = periodic(per, dt, mine(0));
      auto recv = make(per * world, dt), want = make(per * world, dt);
      for (int r = 0; r < world; ++r) {
        auto block = periodic(per, dt, [&](size_t i) { return static_cast<double>(value(r, i)); });
        std::memcpy(want.data() + r * per * dtype_size(dt), block.data(), per * dtype_size(dt));
      }
      pg.allgather(send.data(), recv.data(), per, dt);
      check(label("allgather", dt, per), recv, want, per * world, dt);
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      auto send = make(per * world, dt);
      for (int d = 0; d < world; ++d) {
        auto block = periodic(per, dt, mine(d * per));
        std::memcpy(send.data() + d * per * dtype_size(dt), block.data(), per * dtype_size(dt));
      }
      auto want =
          periodic(per, dt, [&](size_t i) { return reduce_ref(world, rank * per + i, dt, op); });
      auto recv = make(per, dt);
      pg.reduce_scatter(send.data(), recv.data(), per, dt, op);
      check(label("reduce_scatter", dt, per, reduce_op_name(op)), recv, want, per, dt);
    }
  }
}

// ---- p2p_big: large point-to-point messages, which the two ranks of a node copy together ----

// Makes every later `call` (process_vm_readv or process_vm_writev) of this process fail with
// EPERM. Returns false for an unknown name or when the filter cannot be installed.
bool deny_syscall(const std::string& call) {
  long nr = call == "process_vm_readv"    ? SYS_process_vm_readv
            : call == "process_vm_writev" ? SYS_process_vm_writev
                                          : -1;
  if (nr < 0) return false;
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) == 0;
}

int32_t big_value(int rank, int tag, size_t i) {
  return static_cast<int32_t>(static_cast<uint32_t>(rank * 1000003 + tag * 7919) + i * 2654435761u);
}

void fill_big(std::vector<int32_t>& v, int rank, int tag) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = big_value(rank, tag, i);
}

void check_big(const char* what, const std::vector<int32_t>& got, int rank, int tag) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != big_value(rank, tag, i)) {
      std::fprintf(stderr, "MISMATCH %s: element %zu of %zu is %d, expected %d\n", what, i,
                   got.size(), got[i], big_value(rank, tag, i));
      ++g_failures;
      return;
    }
  }
}

void run_p2p_big(ProcessGroup& pg, size_t mib) {
  const int rank = pg.rank(), world = pg.size();
  const size_t n = ((mib << 20) + (12 << 10)) / 4;  // a short last chunk
  std::vector<int32_t> a(n), b(n);
  // A small message first: its receiver reads it straight from the sender's memory (or tries).
  std::vector<int32_t> small(1000);
  if (rank == 0) {
    fill_big(small, rank, 99);
    pg.send(small.data(), small.size(), DataType::kInt32, 1, 99);
  } else if (rank == 1) {
    pg.recv(small.data(), small.size(), DataType::kInt32, 0, 99);
    check_big("small send/recv", small, 0, 99);
  }
  for (int round = 0; round < 3; ++round) {
    if (rank < 2 && world >= 2) {
      for (int from = 0; from < 2; ++from) {
        if (rank == from) {
          fill_big(a, rank, round);
          pg.send(a.data(), n, DataType::kInt32, 1 - rank, round);
        } else {
          std::fill(b.begin(), b.end(), 0);
          pg.recv(b.data(), n, DataType::kInt32, from, round);
          check_big("send/recv", b, from, round);
        }
      }
    }
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    fill_big(a, rank, 10 + round);
    std::fill(b.begin(), b.end(), 0);
    pg.batch_isend_irecv({P2POp{P2POp::kSend, a.data(), n, DataType::kInt32, next, 3},
                          P2POp{P2POp::kRecv, b.data(), n, DataType::kInt32, prev, 3}})
        .wait();
    check_big("batch_isend_irecv ring", b, prev, 10 + round);
    if (rank == 0) {
      fill_big(a, rank, 1);
      fill_big(b, rank, 2);
      pg.batch_isend_irecv({P2POp{P2POp::kSend, a.data(), n, DataType::kInt32, 1, 1},
                            P2POp{P2POp::kSend, b.data(), n, DataType::kInt32, 1, 2}})
          .wait();
    } else if (rank == 1) {
      std::fill(a.begin(), a.end(), 0);
      std::fill(b.begin(), b.end(), 0);
      pg.batch_isend_irecv({P2POp{P2POp::kRecv, b.data(), n, DataType::kInt32, 0, 2},
                            P2POp{P2POp::kRecv, a.data(), n, DataType::kInt32, 0, 1}})
          .wait();
      check_big("two sends in one batch, tag 1", a, 0, 1);
      check_big("two sends in one batch, tag 2", b, 0, 2);
    }
    pg.barrier();
  }
}

// ---- coll: the rooted, all-to-all and point-to-point collectives, and the new ops/dtypes ----

constexpr DataType kAllDtypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                                   DataType::kBFloat16, DataType::kInt32,   DataType::kInt64,
                                   DataType::kInt8,     DataType::kUInt8,   DataType::kBool};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg,     ReduceOp::kMin,
                                ReduceOp::kMax, ReduceOp::kProduct, ReduceOp::kBand,
                                ReduceOp::kBor, ReduceOp::kBxor};

bool g_skip_bitwise = false;  // PG_WORKER_SKIP_BITWISE=1

bool is_bitwise(ReduceOp op) {
  return op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
}

// Element i of `rank`'s input for `op` on dt: exact in every dtype, and such that the serial
// reference below is exact (products are of 1, -1, 2, -2: at most 2^8 with 8 ranks).
int64_t input(DataType dt, ReduceOp op, int rank, size_t i) {
  if (dt == DataType::kBool) return (static_cast<size_t>(rank) + i) % 5 != 0 ? 1 : 0;
  if (is_bitwise(op)) {
    uint64_t h =
        (static_cast<uint64_t>(rank) + 1) * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull;
    return static_cast<int64_t>((h >> 17) & 0x7fffffffull);  // exact in a double
  }
  if (op == ReduceOp::kProduct) {
    static const int64_t p[] = {1, -1, 2, 1, -2, 1, 1};
    int64_t v = p[(static_cast<size_t>(rank) * 3 + i) % 7];
    return dt == DataType::kUInt8 ? (v < 0 ? -v : v) : v;
  }
  int64_t v = value(rank, i);
  return dt == DataType::kUInt8 ? v + 14 : v;
}

// The library's result for element i, computed serially (stored through store(), which wraps
// integers to the dtype as the library's integer arithmetic does).
double coll_ref(int world, size_t i, DataType dt, ReduceOp op) {
  const bool boolean = dt == DataType::kBool;
  int64_t acc = input(dt, op, 0, i);
  for (int r = 1; r < world; ++r) {
    const int64_t v = input(dt, op, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc = boolean ? (acc || v) : acc + v;
        break;
      case ReduceOp::kProduct:
        acc = boolean ? (acc && v) : acc * v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
      case ReduceOp::kBand:
        acc &= v;
        break;
      case ReduceOp::kBor:
        acc |= v;
        break;
      case ReduceOp::kBxor:
        acc = boolean ? (acc != v) : (acc ^ v);
        break;
    }
  }
  if (op != ReduceOp::kAvg) return static_cast<double>(acc);
  switch (dt) {
    case DataType::kFloat64:
      return static_cast<double>(acc) / world;
    case DataType::kFloat32:
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return static_cast<double>(static_cast<float>(acc) / static_cast<float>(world));
    default:
      return static_cast<double>(acc / world);
  }
}

Bytes inputs(size_t n, DataType dt, ReduceOp op, int rank, size_t base = 0) {
  auto buf = make(n, dt);
  for (size_t i = 0; i < n; ++i)
    store(buf.data(), i, dt, static_cast<double>(input(dt, op, rank, base + i)));
  return buf;
}

// Elements from-src-to-dst in the uneven all_to_all: 0 .. 2n, some 0.
size_t split(size_t n, int src, int dst) { return (n + 3 * src + 5 * dst) % (2 * n + 1); }

void run_coll(ProcessGroup& pg, const std::vector<size_t>& sizes) {
  const int world = pg.size(), rank = pg.rank();
  const ReduceOp plain = ReduceOp::kSum;  // the values of the data-movement collectives
  int step = 0;
  for (DataType dt : kAllDtypes) {
    const size_t es = dtype_size(dt);
    for (size_t n : sizes) {
      ++step;
      for (ReduceOp op : kAllOps) {
        if (!reduce_op_supports(op, dt) || (g_skip_bitwise && is_bitwise(op))) continue;
        auto want = make(n, dt);
        for (size_t i = 0; i < n; ++i) store(want.data(), i, dt, coll_ref(world, i, dt, op));
        {
          auto buf = inputs(n, dt, op, rank);
          allreduce(pg, buf, n, dt, op);
          check(label("allreduce", dt, n, reduce_op_name(op)), buf, want, n, dt);
        }
        {
          const int root = (step + static_cast<int>(op)) % world;
          auto buf = inputs(n, dt, op, rank);
          OnDevice d(buf.data(), n * es);
          pg.reduce(d.ptr(), n, dt, op, root);
          d.back();
          if (rank == root) check(label("reduce", dt, n, reduce_op_name(op)), buf, want, n, dt);
        }
      }
      const int root = step % world;
      {  // gather
        auto send = inputs(n, dt, plain, rank), recv = make(n * world, dt);
        auto want = make(n * world, dt);
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < n; ++i)
            store(want.data(), r * n + i, dt, static_cast<double>(input(dt, plain, r, i)));
        OnDevice s(send.data(), n * es), r(recv.data(), n * world * es);
        pg.gather(s.ptr(), rank == root ? r.ptr() : nullptr, n, dt, root);
        r.back();
        if (rank == root) check(label("gather", dt, n), recv, want, n * world, dt);
      }
      {  // scatter: block r of root's buffer is input(root, r*n + i)
        auto send = inputs(n * world, dt, plain, root), recv = make(n, dt);
        auto want = inputs(n, dt, plain, root, rank * n);
        OnDevice s(send.data(), n * world * es), r(recv.data(), n * es);
        pg.scatter(rank == root ? s.ptr() : nullptr, r.ptr(), n, dt, root);
        r.back();
        check(label("scatter", dt, n), recv, want, n, dt);
      }
      {  // all_to_all: block d of rank s is input(s, d*n + i)
        auto send = inputs(n * world, dt, plain, rank), recv = make(n * world, dt);
        auto want = make(n * world, dt);
        for (int src = 0; src < world; ++src)
          for (size_t i = 0; i < n; ++i)
            store(want.data(), src * n + i, dt,
                  static_cast<double>(input(dt, plain, src, rank * n + i)));
        OnDevice s(send.data(), n * world * es), r(recv.data(), n * world * es);
        pg.all_to_all(s.ptr(), r.ptr(), n, dt);
        r.back();
        check(label("all_to_all", dt, n), recv, want, n * world, dt);
      }
      {  // all_to_all_v: split(n, s, d) elements s -> d, input(s, 1000 * d + i)
        std::vector<size_t> sc(world), rc(world);
        size_t st = 0, rt = 0;
        for (int j = 0; j < world; ++j) {
          sc[j] = split(n, rank, j);
          rc[j] = split(n, j, rank);
          st += sc[j];
          rt += rc[j];
        }
        auto send = make(st, dt), recv = make(rt, dt), want = make(rt, dt);
        for (int j = 0, so = 0, ro = 0; j < world; ++j) {
          for (size_t i = 0; i < sc[j]; ++i)
            store(send.data(), so + i, dt,
                  static_cast<double>(input(dt, plain, rank, 1000 * j + i)));
          for (size_t i = 0; i < rc[j]; ++i)
            store(want.data(), ro + i, dt,
                  static_cast<double>(input(dt, plain, j, 1000 * rank + i)));
          so += static_cast<int>(sc[j]);
          ro += static_cast<int>(rc[j]);
        }
        OnDevice s(send.data(), st * es), r(recv.data(), rt * es);
        pg.all_to_all_v(s.ptr(), sc, r.ptr(), rc, dt);
        r.back();
        check(label("all_to_all_v", dt, n), recv, want, rt, dt);
      }
      if (world > 1) {  // a ring through batch_isend_irecv: send to next, receive from previous
        const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
        auto send = inputs(n, dt, plain, rank), recv = make(n, dt);
        auto want = inputs(n, dt, plain, prev);
        OnDevice s(send.data(), n * es), r(recv.data(), n * es);
        pg.batch_isend_irecv({P2POp{P2POp::kSend, s.ptr(), n, dt, next, 1},
                              P2POp{P2POp::kRecv, r.ptr(), n, dt, prev, 1}})
            .wait();
        r.back();
        check(label("batch_isend_irecv ring", dt, n), recv, want, n, dt);
      }
      if (world > 1) {  // blocking send/recv between pairs (0,1), (2,3), ...; the odd one out idles
        const int peer = rank ^ 1;
        if (peer < world) {
          auto send = inputs(n, dt, plain, rank + 100), recv = make(n, dt);
          auto want = inputs(n, dt, plain, peer + 100);
          OnDevice s(send.data(), n * es), r(recv.data(), n * es);
          if (rank % 2 == 0) {
            pg.send(s.ptr(), n, dt, peer, 7);
            pg.recv(r.ptr(), n, dt, peer, 7);
          } else {
            pg.recv(r.ptr(), n, dt, peer, 7);
            pg.send(s.ptr(), n, dt, peer, 7);
          }
          r.back();
          check(label("send/recv", dt, n), recv, want, n, dt);
        }
      }
    }
  }
  if (world > 1 && !g_cuda) {
    // Tags: two messages to rank 1, received in the other order by tag.
    const size_t n = 33;
    if (rank == 0) {
      auto a = inputs(n, DataType::kInt32, plain, 50),
           b = inputs(2 * n, DataType::kInt32, plain, 51);
      pg.batch_isend_irecv({P2POp{P2POp::kSend, a.data(), n, DataType::kInt32, 1, 5},
                            P2POp{P2POp::kSend, b.data(), 2 * n, DataType::kInt32, 1, 3}})
          .wait();
    } else if (rank == 1) {
      auto a = make(n, DataType::kInt32), b = make(2 * n, DataType::kInt32);
      pg.batch_isend_irecv({P2POp{P2POp::kRecv, b.data(), 2 * n, DataType::kInt32, 0, 3},
                            P2POp{P2POp::kRecv, a.data(), n, DataType::kInt32, 0, 5}})
          .wait();
      check("recv by tag 5", a, inputs(n, DataType::kInt32, plain, 50), n, DataType::kInt32);
      check("recv by tag 3", b, inputs(2 * n, DataType::kInt32, plain, 51), 2 * n,
            DataType::kInt32);
    }
  }
  // Async forms, queued together, completing in order.
  {
    const size_t n = 1001;
    auto red = inputs(n, DataType::kInt64, ReduceOp::kProduct, rank);
    auto a2a_send = inputs(n * world, DataType::kFloat32, plain, rank),
         a2a_recv = make(n * world, DataType::kFloat32);
    OnDevice dr(red.data(), n * 8), ds(a2a_send.data(), n * world * 4),
        dv(a2a_recv.data(), n * world * 4);
    std::vector<Work> works;
    works.push_back(pg.reduce_async(dr.ptr(), n, DataType::kInt64, ReduceOp::kProduct, 0));
    works.push_back(pg.all_to_all_async(ds.ptr(), dv.ptr(), n, DataType::kFloat32));
    works.push_back(pg.barrier_async());
    for (auto& w : works) w.wait();
    dr.back();
    dv.back();
    auto want = make(n, DataType::kInt64);
    for (size_t i = 0; i < n; ++i)
      store(want.data(), i, DataType::kInt64,
            coll_ref(world, i, DataType::kInt64, ReduceOp::kProduct));
    if (rank == 0) check("reduce_async", red, want, n, DataType::kInt64);
    auto want2 = make(n * world, DataType::kFloat32);
    for (int src = 0; src < world; ++src)
      for (size_t i = 0; i < n; ++i)
        store(want2.data(), src * n + i, DataType::kFloat32,
              static_cast<double>(input(DataType::kFloat32, plain, src, rank * n + i)));
    check("all_to_all_async", a2a_recv, want2, n * world, DataType::kFloat32);
  }
  // Bad arguments are refused at the call, on every rank alike.
  int refused = 0;
  float f = 0;
  auto refuses = [&](auto&& call) {
    try {
      call();
    } catch (const std::invalid_argument&) {
      ++refused;
    }
  };
  refuses([&] { pg.allreduce(&f, 1, DataType::kFloat32, ReduceOp::kBxor); });
  bool b = true;
  refuses([&] { pg.allreduce(&b, 1, DataType::kBool, ReduceOp::kAvg); });
  refuses([&] { pg.reduce(&f, 1, DataType::kFloat32, ReduceOp::kSum, world); });
  refuses([&] { pg.send(&f, 1, DataType::kFloat32, rank); });
  refuses([&] { pg.recv(&f, 1, DataType::kFloat32, world); });
  refuses([&] { pg.send(&f, 1, DataType::kFloat32, (rank + 1) % std::max(world, 2), -1); });
  refuses([&] {
    pg.all_to_all_v(&f, std::vector<size_t>(world + 1, 0), &f, std::vector<size_t>(world, 0),
                    DataType::kFloat32);
  });
  int expected = 7;
  if (g_skip_bitwise && pg.backend() == Backend::kNccl) {  // NCCL has no bitwise reductions
    int32_t i = 0;
    OnDevice d(&i, sizeof i);
    refuses([&] { pg.allreduce(d.ptr(), 1, DataType::kInt32, ReduceOp::kBand); });
    ++expected;
  }
  if (refused != expected) {
    std::fprintf(stderr, "MISMATCH %d of %d bad calls refused\n", refused, expected);
    ++g_failures;
  }
  pg.barrier();
}

// ---- dump: the same computations as tests/worker_sdk/torch_collectives.py ----

constexpr size_t kDumpN = 37;

int64_t dump_input(const std::string& kind, DataType dt, int rank, size_t i) {
  if (kind == "bits")
    return static_cast<int64_t>(
        (static_cast<uint64_t>(rank) * 2654435761ull + i * 40503ull + 12345ull) % 2147483647ull);
  if (kind == "product") {
    static const int64_t p[] = {1, -1, 2, 1, -2, 1, 1};
    int64_t v = p[(static_cast<size_t>(rank) * 3 + i) % 7];
    return dt == DataType::kUInt8 && v < 0 ? -v : v;
  }
  int64_t v = static_cast<int64_t>((static_cast<size_t>(rank) * 31 + i * 17) % 23) - 11;
  return dt == DataType::kUInt8 ? v + 11 : v;
}

Bytes dump_tensor(const std::string& kind, DataType dt, int rank, size_t n, size_t base = 0) {
  auto buf = make(n, dt);
  for (size_t i = 0; i < n; ++i)
    store(buf.data(), i, dt, static_cast<double>(dump_input(kind, dt, rank, base + i)));
  return buf;
}

void save(const std::string& dir, int rank, const std::string& name, const Bytes& buf, size_t n,
          DataType dt) {
  const std::string path = dir + "/" + std::to_string(rank) + "/" + name + ".bin";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fwrite(buf.data(), 1, n * dtype_size(dt), f);
  std::fclose(f);
}

void run_dump(ProcessGroup& pg, const std::string& dir) {
  const int world = pg.size(), rank = pg.rank();
  const size_t n = kDumpN;
  ::mkdir((dir + "/" + std::to_string(rank)).c_str(), 0755);
  const ReduceOp ops[] = {ReduceOp::kSum,  ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                          ReduceOp::kBand, ReduceOp::kBor,     ReduceOp::kBxor};
  for (DataType dt : {DataType::kInt32, DataType::kInt64, DataType::kInt8, DataType::kUInt8,
                      DataType::kFloat32}) {
    const std::string d = dtype_name(dt);
    for (ReduceOp op : ops) {
      if (!reduce_op_supports(op, dt)) continue;
      const std::string kind = is_bitwise(op)             ? "bits"
                               : op == ReduceOp::kProduct ? "product"
                                                          : "plain";
      const std::string o = reduce_op_name(op);
      auto t = dump_tensor(kind, dt, rank, n);
      pg.allreduce(t.data(), n, dt, op);
      save(dir, rank, "allreduce_" + o + "_" + d, t, n, dt);
      t = dump_tensor(kind, dt, rank, n);
      pg.reduce(t.data(), n, dt, op, 1);
      if (rank == 1) save(dir, rank, "reduce_" + o + "_" + d, t, n, dt);
    }
    {
      auto t = dump_tensor("plain", dt, rank, n), all = make(n * world, dt);
      pg.gather(t.data(), all.data(), n, dt, 2);
      if (rank == 2) save(dir, rank, "gather_" + d, all, n * world, dt);
    }
    {
      auto send = dump_tensor("plain", dt, 0, n * world), recv = make(n, dt);
      pg.scatter(send.data(), recv.data(), n, dt, 0);
      save(dir, rank, "scatter_" + d, recv, n, dt);
    }
    {
      auto split = [&](int s, int t) { return (n + 3 * s + 5 * t) % (2 * n + 1); };
      std::vector<size_t> sc(world), rc(world);
      Bytes send;
      size_t rt = 0;
      for (int j = 0; j < world; ++j) {
        sc[j] = split(rank, j);
        rc[j] = split(j, rank);
        rt += rc[j];
        auto block = dump_tensor("plain", dt, rank, sc[j], 1000 * j);
        send.insert(send.end(), block.begin(), block.begin() + sc[j] * dtype_size(dt));
      }
      send.push_back(0);
      auto recv = make(rt, dt);
      pg.all_to_all_v(send.data(), sc, recv.data(), rc, dt);
      save(dir, rank, "all_to_all_v_" + d, recv, rt, dt);
    }
    {
      const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
      auto send = dump_tensor("plain", dt, rank + 100, n), recv = make(n, dt);
      pg.batch_isend_irecv({P2POp{P2POp::kSend, send.data(), n, dt, next, 0},
                            P2POp{P2POp::kRecv, recv.data(), n, dt, prev, 0}})
          .wait();
      save(dir, rank, "sendrecv_" + d, recv, n, dt);
    }
  }
  pg.barrier();
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Streams 16 MiB allreduces until one fails, printing READY after the first and "FAILED after
// <s> s in iteration <i>: <error>" for the failure, which it returns (nullptr: none came in
// 100000 iterations). With `kill_at` >= 0 the process SIGKILLs itself before that iteration.
std::exception_ptr stream_allreduces(ProcessGroup& pg, int kill_at = -1) {
  std::vector<float> buf(4 << 20, 1.0f);
  OnDevice d(buf.data(), buf.size() * sizeof(float));
  for (int it = 0; it < 100000; ++it) {
    if (it == kill_at) {
      std::printf("KILLING MYSELF\n");
      std::raise(SIGKILL);
    }
    auto t0 = Clock::now();
    try {
      pg.allreduce(d.ptr(), buf.size(), DataType::kFloat32, ReduceOp::kAvg);
      if (it == 0) std::printf("READY\n");
    } catch (const CollectiveError& e) {
      std::printf("FAILED after %.3f s in iteration %d: %s\n", seconds_since(t0), it, e.what());
      return std::current_exception();
    }
  }
  return nullptr;
}

// RLIMIT_AS = this process's current size (VmSize) + `headroom`.
void limit_address_space(size_t headroom) {
  size_t vm_kib = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "VmSize: %zu kB", &vm_kib) == 1) break;
    std::fclose(f);
  }
  rlimit lim{};
  lim.rlim_cur = lim.rlim_max = (vm_kib << 10) + headroom;
  if (vm_kib == 0 || ::setrlimit(RLIMIT_AS, &lim) != 0) {
    std::fprintf(stderr, "pg_worker: cannot limit the address space\n");
    std::exit(2);
  }
}

void expect(bool ok, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "MISMATCH %s\n", what.c_str());
  ++g_failures;
}

bool all_zero(const SharedBuffer& b) {
  const char* p = b.as<char>();
  return std::all_of(p, p + b.size(), [](char c) { return c == 0; });
}

// ProcessGroup::shared_buffer's contract (see the usage above).
void run_shared_buf(Worker& w, ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  // A segment named in /dev/shm has no shared buffer areas.
  const char* named = std::getenv("TRUN_SHM_NAMED");
  const bool several = w.env().local_world_size > 1 && !(named && std::string(named) == "1");
  constexpr size_t kBytes = (3u << 20) + 100;  // not a whole number of pages
  SharedBuffer a = pg.shared_buffer(kBytes);
  expect(a.size() == kBytes, "size");
  expect(reinterpret_cast<uintptr_t>(a.data()) % 4096 == 0, "page-aligned");
  expect(a.shared() == several, "shared() on a node of " + std::to_string(several ? 2 : 1) +
                                    "+ ranks: " + std::to_string(a.shared()));
  expect(all_zero(a), "a new buffer is zero-filled");
  std::memset(a.data(), 0x5a, kBytes);
  void* where = a.data();
  SharedBuffer copy = a;  // copies share the memory
  expect(copy.data() == where, "a copy shares the memory");
  a = SharedBuffer();
  expect(copy.as<unsigned char>()[kBytes - 1] == 0x5a, "the memory lives while a copy does");
  copy = SharedBuffer();
  SharedBuffer again = pg.shared_buffer(kBytes);
  if (several) expect(again.data() == where, "a freed range is reused first");
  expect(all_zero(again), "a reused range is zero-filled again");
  try {
    pg.shared_buffer(SIZE_MAX);
    expect(false, "shared_buffer(SIZE_MAX) did not throw");
  } catch (const std::invalid_argument& e) {
    expect(std::strstr(e.what(), "more than any buffer can hold") != nullptr, e.what());
  }
  // More than a rank's area (at most 1 GiB by default): ordinary memory, untouched until used.
  SharedBuffer huge = pg.shared_buffer(size_t{2} << 30);
  expect(!huge.shared() && huge.size() == size_t{2} << 30, "a buffer larger than the area");
  expect(huge.as<char>()[(size_t{2} << 30) - 1] == 0, "a large ordinary buffer is zero-filled");
  huge = SharedBuffer();
  SharedBuffer empty = pg.shared_buffer(0);
  expect(empty.size() == 0 && empty.data() != nullptr, "a 0-byte buffer");

  // A buffer of a subgroup of everyone, used after the subgroup is gone: still valid memory,
  // and as an ordinary buffer of the world group, the results still match.
  std::vector<int> everyone(world);
  for (int r = 0; r < world; ++r) everyone[r] = r;
  SharedBuffer orphan;
  {
    auto sub = w.new_group(everyone);
    orphan = sub->shared_buffer(world * 1000 * sizeof(int32_t));
    expect(orphan.shared() == several, "a subgroup's buffer is shared too");
  }
  auto* send = orphan.as<int32_t>();
  for (int d = 0; d < world; ++d)
    for (int i = 0; i < 1000; ++i) send[d * 1000 + i] = rank * 100000 + d * 1000 + i;
  std::vector<int32_t> recv(world * 1000, -1);
  pg.all_to_all(send, recv.data(), 1000, DataType::kInt32);
  for (int s = 0; s < world; ++s)
    for (int i = 0; i < 1000; ++i)
      if (recv[s * 1000 + i] != s * 100000 + rank * 1000 + i) {
        expect(false,
               "all_to_all from a destroyed subgroup's buffer, from rank " + std::to_string(s));
        break;
      }
  // And through the world group's own buffers: the one-copy path.
  SharedBuffer mine = pg.shared_buffer(world * 1000 * sizeof(int32_t));
  std::memcpy(mine.data(), send, mine.size());
  std::fill(recv.begin(), recv.end(), -1);
  pg.all_to_all(mine.data(), recv.data(), 1000, DataType::kInt32);
  for (int s = 0; s < world; ++s)
    if (recv[s * 1000 + 999] != s * 100000 + rank * 1000 + 999)
      expect(false, "all_to_all from a shared buffer, from rank " + std::to_string(s));
  if (world >= 2 && rank < 2) {  // send/recv both ways, one shared buffer each
    if (rank == 0) pg.send(mine.data(), 1000, DataType::kInt32, 1, 7);
    if (rank == 1) {
      std::fill(recv.begin(), recv.end(), -1);
      pg.recv(recv.data(), 1000, DataType::kInt32, 0, 7);
      expect(recv[999] == 999, "send/recv from a shared buffer");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: pg_worker matrix|big|stall|loop|kill_once|shrink|abort|abort_inflight|"
                 "abort_midstream|throw|segv ...\n");
    return 2;
  }
  std::string scenario = argv[1];
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (scenario == "throw") {
    install_error_handler();
    throw std::runtime_error("model diverged at step 42");
  }
  if (scenario == "segv") {
    install_error_handler();
    std::raise(SIGSEGV);
    return 3;
  }
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  // Blocked before init() starts any thread, so that only sigwait() below ever takes it.
  if (scenario == "abort_midstream") pthread_sigmask(SIG_BLOCK, &usr1, nullptr);
  if (const char* r = std::getenv("PG_WORKER_LIMIT_AS_RANK");
      r && std::getenv("RANK") && std::string(r) == std::getenv("RANK"))
    limit_address_space(size_t{1} << 30);
  try {
    InitOptions io;
    if (const char* b = std::getenv("PG_WORKER_BACKEND")) io.backend = parse_backend(b);
    if (const char* c = std::getenv("PG_WORKER_CUDA")) g_cuda = std::string(c) == "1";
    if (g_cuda && !TRUN_HAVE_NCCL) throw std::runtime_error("PG_WORKER_CUDA=1 needs CUDA");
    if (const char* t = std::getenv("PG_WORKER_TIMEOUT_MS"))
      io.timeout = std::chrono::milliseconds(std::atoi(t));
    Worker w = init(io);
    ProcessGroup& pg = w.process_group();
    if (const char* m = std::getenv("PG_WORKER_SHARED")) {
      const std::string mode = m;
      if (mode != "all" && mode != "odd") throw std::runtime_error("PG_WORKER_SHARED: all or odd");
      if (mode == "all" || pg.rank() % 2 == 1) g_shared_pg = &pg;
    }
#if TRUN_HAVE_NCCL
    int devices = 0;  // as a training program would: this rank's GPU for its own buffers
    if (g_cuda && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0)
      cudaSetDevice(std::max(w.env().local_rank, 0) % devices);
#endif
    std::printf("rank %d/%d backend %s\n", pg.rank(), pg.size(), pg.backend_description().c_str());
    const WorkerEnv& env = w.env();
    std::printf("rank %d store %s\n", pg.rank(),
                !env.store_path.empty() ? "file"
                : env.use_agent_store   ? "agent"
                                        : "hosted by rank 0");
    std::printf(
        "env launcher=%s init=%s rank=%d world=%d local_rank=%d local_world=%d "
        "group_rank=%d group_world=%d run_id=%s\n",
        env.launcher.c_str(), env.init_method.c_str(), env.rank, env.world_size, env.local_rank,
        env.local_world_size, env.group_rank, env.group_world_size, env.run_id.c_str());
    if (scenario == "matrix") {
      std::vector<size_t> sizes;
      for (int i = 2; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
      if (sizes.empty()) sizes = {0, 1, 7, 1000, 300001};
      run_matrix(pg, sizes);
    } else if (scenario == "big") {
      run_big(pg);
    } else if (scenario == "coll") {
      std::vector<size_t> sizes;
      for (int i = 2; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
      if (sizes.empty()) sizes = {0, 1, 7, 1001, 65537};
      if (const char* sb = std::getenv("PG_WORKER_SKIP_BITWISE")) g_skip_bitwise = *sb == '1';
      run_coll(pg, sizes);
    } else if (scenario == "groups") {
      const int world = pg.size(), rank = pg.rank();
      std::vector<int> odd;
      for (int r = world - 1; r >= 0; --r)
        if (r % 2) odd.push_back(r);  // unsorted on purpose
      auto sub = w.new_group(odd);
      if ((rank % 2 == 1) != static_cast<bool>(sub)) {
        std::fprintf(stderr, "MISMATCH membership of rank %d in the odd group\n", rank);
        ++g_failures;
      }
      auto sum_of = [&](ProcessGroup& g, const std::vector<int>& members) {
        int64_t v = rank + 1, want = 0;
        for (int m : members) want += m + 1;
        g.allreduce(&v, 1, DataType::kInt64);
        if (v != want) {
          std::fprintf(stderr, "MISMATCH subgroup allreduce %" PRId64 " != %" PRId64 "\n", v, want);
          ++g_failures;
        }
      };
      if (sub) {
        if (sub->rank() != rank / 2 || sub->size() != world / 2) {
          std::fprintf(stderr, "MISMATCH odd group rank %d size %d\n", sub->rank(), sub->size());
          ++g_failures;
        }
        sum_of(*sub, odd);
      }
      if (world % 2 == 0) {
        auto pair = w.new_subgroups(2);
        if (!pair || pair->size() != 2 || pair->rank() != rank % 2) {
          std::fprintf(stderr, "MISMATCH new_subgroups(2) on rank %d\n", rank);
          ++g_failures;
        } else {
          sum_of(*pair, {rank - rank % 2, rank - rank % 2 + 1});
        }
      }
      int refused = 0;
      for (std::vector<int> bad : {std::vector<int>{}, {0, 0}, {world}, {-1}}) {
        try {
          w.new_group(bad);
        } catch (const std::invalid_argument&) {
          ++refused;
        }
      }
      try {
        w.new_subgroups(world + 1);
      } catch (const std::invalid_argument&) {
        ++refused;
      }
      if (refused != 5) {
        std::fprintf(stderr, "MISMATCH %d of 5 bad groups refused\n", refused);
        ++g_failures;
      }
      std::vector<int> all;
      for (int r = 0; r < world; ++r) all.push_back(r);
      sum_of(pg, all);  // the default group is unaffected
    } else if (scenario == "mbarrier") {
      std::vector<int> late;
      if (argc > 2)
        for (char* t = std::strtok(argv[2], ","); t; t = std::strtok(nullptr, ","))
          late.push_back(std::atoi(t));
      const bool all = argc > 3 && std::atoi(argv[3]) == 1;
      const bool never = argc > 4 && std::string(argv[4]) == "never";
      pg.monitored_barrier(std::chrono::milliseconds(5000), all);
      std::printf("PASSED the first\n");
      if (std::find(late.begin(), late.end(), pg.rank()) != late.end()) {
        if (never) {
          std::printf("NEVER ARRIVING\n");
          return 0;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      }
      try {
        pg.monitored_barrier(std::chrono::milliseconds(1500), all);
      } catch (const CollectiveTimeoutError& e) {
        std::printf("VERDICT %s\n", e.what());
        // Not broken: the group still works (unless a rank left for good).
        if (!never) pg.barrier();
        return 17;
      }
      return 4;
    } else if (scenario == "dump") {
      if (argc < 3) return 2;
      run_dump(pg, argv[2]);
    } else if (scenario == "p2p_dead") {
      const bool after = argc > 2 && std::string(argv[2]) == "after";
      std::vector<float> buf(1 << 16, 1.0f);
      if (pg.size() < 2) return 2;
      // Every rank has finished building the group (a Gloo rank's constructor may return while
      // its peers still connect to it), so rank 1's death hits the point-to-point part only.
      pg.barrier();
      if (after) {  // one exchange first: the pair is connected when rank 1 dies
        if (pg.rank() == 0) pg.send(buf.data(), buf.size(), DataType::kFloat32, 1);
        if (pg.rank() == 1) pg.recv(buf.data(), buf.size(), DataType::kFloat32, 0);
      }
      if (pg.rank() == 1) {
        std::printf("DYING\n");
        std::raise(SIGKILL);
      }
      if (pg.rank() != 0) return 0;
      auto t0 = Clock::now();
      try {
        pg.recv(buf.data(), buf.size(), DataType::kFloat32, 1);
      } catch (const CollectiveTimeoutError& e) {
        std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
        return std::strstr(e.what(), "rank 1") ? 16 : 4;
      } catch (const CollectiveError& e) {
        std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
        return std::strstr(e.what(), "rank 1") ? 15 : 4;
      }
      return 4;
    } else if (scenario == "p2p_big") {
      if (argc > 4 && std::atoi(argv[3]) == pg.rank() && !deny_syscall(argv[4])) {
        std::printf("NO SECCOMP: cannot refuse %s (%s)\n", argv[4], std::strerror(errno));
        return 18;
      }
      if (pg.size() < 2) return 2;
      run_p2p_big(pg, argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 8);
      std::printf("P2P_BIG done, %d mismatches\n", g_failures);
    } else if (scenario == "shared_buf") {
      run_shared_buf(w, pg);
    } else if (scenario == "p2p_mixed_fail") {
      if (pg.size() != 4 || argc < 3) return 2;
      const std::string flag = std::string(argv[2]) + "/rank1_failed";
      pg.barrier();
      if (pg.rank() == 3) return 0;
      // A training program lives on after a failed step (a checkpoint, a log line): so does rank 0.
      auto linger = [&] {
        if (pg.rank() == 1) {
          std::fclose(std::fopen(flag.c_str(), "w"));
          return;
        }
        for (int i = 0; pg.rank() == 0 && i < 300 && ::access(flag.c_str(), F_OK) != 0; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
      };
      std::vector<int32_t> big(1000, 7), small(10, 1);
      auto t0 = Clock::now();
      try {
        if (pg.rank() == 0)
          pg.batch_isend_irecv({P2POp{P2POp::kRecv, big.data(), 999, DataType::kInt32, 2, 5},
                                P2POp{P2POp::kSend, small.data(), 10, DataType::kInt32, 1, 5}})
              .wait();
        else if (pg.rank() == 1)
          pg.recv(small.data(), 10, DataType::kInt32, 0, 5);
        else
          pg.send(big.data(), 1000, DataType::kInt32, 0, 5);
        std::printf("NO FAILURE\n");
        return 4;
      } catch (const CollectiveTimeoutError& e) {
        std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
        linger();
        return 16;
      } catch (const CollectiveError& e) {
        const double took = seconds_since(t0);
        std::printf("FAILED after %.3f s: %s\n", took, e.what());
        linger();
        // Rank 2 learns only that rank 0 refused; ranks 0 and 1 name both sizes.
        if (pg.rank() != 2 &&
            (!std::strstr(e.what(), "4000 bytes") || !std::strstr(e.what(), "expects 3996")))
          return 4;
        return took < 20 ? 15 : 4;
      }
    } else if (scenario == "p2p_mismatch") {
      const size_t expect = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 999;
      if (pg.size() < 2 || expect == 1000) return 2;
      pg.barrier();
      if (pg.rank() > 1) return 0;
      const size_t count = pg.rank() == 0 ? 1000 : expect;
      std::vector<int32_t> buf(count, 7);
      OnDevice sent(buf.data(), count * 4);  // PG_WORKER_SHARED: the sender's is shared
      const std::string other = std::to_string(expect * 4);
      auto t0 = Clock::now();
      try {
        if (pg.rank() == 0)
          pg.send(sent.ptr(), count, DataType::kInt32, 1, 5);
        else
          pg.recv(buf.data(), count, DataType::kInt32, 0, 5);
        std::printf("NO FAILURE\n");
        return 4;
      } catch (const CollectiveTimeoutError& e) {
        std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
        return 16;
      } catch (const CollectiveError& e) {
        std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
        if (!std::strstr(e.what(), "4000 bytes") ||
            !std::strstr(e.what(), ("expects " + other).c_str()))
          return 4;
      }
      t0 = Clock::now();
      try {
        pg.send(buf.data(), 1, DataType::kInt32, 1 - pg.rank(), 6);
        return 4;
      } catch (const CollectiveError& e) {
        std::printf("LATER after %.3f s: %s\n", seconds_since(t0), e.what());
        return seconds_since(t0) < 5 ? 15 : 4;
      }
    } else if (scenario == "p2p_big_dead") {
      const int victim = argc > 2 ? std::atoi(argv[2]) : 1;
      if (pg.size() < 2 || victim < 0 || victim > 1) return 2;
      std::vector<float> buf((16u << 20) / 4, 1.0f);
      pg.barrier();
      if (pg.rank() > 1) return 0;
      if (pg.rank() == victim) {
        std::thread([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          std::printf("DYING\n");
          std::fflush(stdout);
          std::raise(SIGKILL);
        }).detach();
      }
      const int peer = 1 - pg.rank();
      auto t0 = Clock::now();
      try {
        for (int i = 0; i < 20000; ++i) {
          if (i % 2 == pg.rank())
            pg.send(buf.data(), buf.size(), DataType::kFloat32, peer);
          else
            pg.recv(buf.data(), buf.size(), DataType::kFloat32, peer);
        }
      } catch (const CollectiveTimeoutError& e) {
        std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
        return 16;
      } catch (const CollectiveError& e) {
        std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
        return std::strstr(e.what(), ("rank " + std::to_string(peer)).c_str()) ? 15 : 4;
      }
      return 4;
    } else if (scenario == "a2a_dead") {
      const size_t mib = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 8;
      const size_t block = (mib << 20) / 4 / pg.size();
      std::vector<float> send(block * pg.size(), 1.0f), recv(block * pg.size(), 0.0f);
      if (pg.size() < 2) return 2;
      pg.barrier();
      if (pg.rank() == 1) {
        std::thread([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          std::printf("DYING\n");
          std::fflush(stdout);
          std::raise(SIGKILL);
        }).detach();
      }
      auto t0 = Clock::now();
      try {
        for (int i = 0; i < 2000; ++i)
          pg.all_to_all(send.data(), recv.data(), block, DataType::kFloat32);
      } catch (const CollectiveTimeoutError& e) {
        std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
        return 16;
      } catch (const CollectiveError& e) {
        std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
        return std::strstr(e.what(), "rank 1") ? 15 : 4;
      }
      return 4;
    } else if (scenario == "stall") {
      int victim = argc > 2 ? std::atoi(argv[2]) : pg.size() - 1;
      int timeout_ms = argc > 3 ? std::atoi(argv[3]) : 1500;
      pg.barrier();
      if (pg.rank() == victim) {
        std::printf("STALLING\n");
        std::this_thread::sleep_for(std::chrono::seconds(120));
        return 0;
      }
      std::vector<float> buf(1 << 16, 1.0f);
      OnDevice d(buf.data(), buf.size() * sizeof(float));
      auto t0 = Clock::now();
      try {
        pg.allreduce(d.ptr(), buf.size(), DataType::kFloat32, ReduceOp::kSum,
                     std::chrono::milliseconds(timeout_ms));
      } catch (const CollectiveTimeoutError& e) {
        std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
        // A broken group refuses further work at once.
        try {
          pg.barrier();
        } catch (const CollectiveError& e2) {
          std::printf("BROKEN: %s\n", e2.what());
          return 10;
        }
        return 4;
      } catch (const CollectiveError& e) {
        // A peer that timed out first aborts the node's segment: also a correct outcome.
        std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
        return 10;
      }
      return 5;
    } else if (scenario == "loop") {
      return stream_allreduces(pg) ? 11 : 6;
    } else if (scenario == "shrink") {
      if (pg.size() > 1) return stream_allreduces(pg) ? 11 : 6;
      run_matrix(pg, {0, 1, 1000});
    } else if (scenario == "kill_once") {
      if (w.env().restart_count == 0)
        return stream_allreduces(pg, pg.rank() == 1 ? 3 : -1) ? 11 : 6;
      run_matrix(pg, {0, 1, 1000});
    } else if (scenario == "abort") {
      pg.barrier();
      if (pg.rank() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        pg.abort("test abort");
        try {
          pg.barrier();
        } catch (const CollectiveError& e) {
          std::printf("ROOT BROKEN: %s\n", e.what());
          return 12;
        }
        return 7;
      }
      std::vector<float> buf(1024, 1.0f);
      auto t0 = Clock::now();
      try {
        pg.allreduce(buf.data(), buf.size(), DataType::kFloat32);
      } catch (const CollectiveError& e) {
        std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
        return 12;
      }
      return 8;
    } else if (scenario == "abort_inflight") {
      const int first_absent = argc > 2 ? std::atoi(argv[2]) : pg.size() - 1;
      pg.barrier();
      if (pg.rank() >= first_absent) {
        std::printf("STALLING\n");
        std::this_thread::sleep_for(std::chrono::seconds(120));
        return 0;
      }
      std::thread aborter;
      if (pg.rank() == 0)
        aborter = std::thread([&pg] {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          pg.abort("abort in flight");
        });
      std::vector<float> buf(1 << 16, 1.0f);
      auto t0 = Clock::now();
      int code = 9;
      try {
        pg.allreduce(buf.data(), buf.size(), DataType::kFloat32);
      } catch (const CollectiveTimeoutError& e) {
        std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
        code = 4;
      } catch (const CollectiveError& e) {
        std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
        code = std::strstr(e.what(), "abort in flight") ? 13 : 9;
      }
      if (aborter.joinable()) aborter.join();
      return code;
    } else if (scenario == "abort_midstream") {
      std::thread aborter;
      if (pg.rank() == 0)
        aborter = std::thread([&pg, usr1] {
          int sig = 0;
          sigwait(&usr1, &sig);
          std::printf("ABORTING\n");
          pg.abort("abort midstream");
        });
      int code = 6;
      if (std::exception_ptr failure = stream_allreduces(pg)) {
        try {
          std::rethrow_exception(failure);
        } catch (const CollectiveTimeoutError&) {
          code = 4;
        } catch (const CollectiveError& e) {
          code = std::strstr(e.what(), "abort midstream") ? 14 : 11;
        }
      }
      if (aborter.joinable()) {
        if (code != 14) pthread_kill(aborter.native_handle(), SIGUSR1);  // let it finish
        aborter.join();
      }
      return code;
    } else {
      std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
      return 2;
    }
  } catch (const CollectiveError& e) {  // by name, for the cases that expect this type
    std::fprintf(stderr, "pg_worker: unexpected exception: CollectiveError: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pg_worker: unexpected exception: %s\n", e.what());
    return 3;
  }
  if (g_shared_pg) std::printf("SHARED %d of %d\n", g_shared_in_segment, g_shared_blocks);
  if (g_failures) {
    std::fprintf(stderr, "pg_worker: %d mismatches\n", g_failures);
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
