// The GPU simulator's NCCL: the part of the NCCL API that libtrun_worker calls, built as a
// libnccl.so.2 over the simulated CUDA runtime (cudart_sim.cpp). Loaded through LD_LIBRARY_PATH
// instead of the real library; see tests/simgpu/CMakeLists.txt. Ranks may be threads of one
// process or separate processes (a job under trun).
//
// What it models, after NCCL's documented semantics:
// - ncclGetUniqueId / ncclCommInitRankConfig: ranks meet by unique id. Each rank has a data file
//   and the clique a control file in /dev/shm; once every rank has mapped every file they are
//   unlinked, so nothing is left there however the processes end later (only a process killed
//   while its clique forms can leave its files). Two ranks on the same device are refused
//   ("duplicate GPU"), as real NCCL refuses them. A non-blocking communicator (config.blocking =
//   0) answers ncclInProgress, and its async state stays so until every rank has joined, which
//   may be never.
// - Collectives are queued on the caller's stream and run there: a rank's operation copies its
//   input to its data file and waits for the same operation of every other rank, so a peer that
//   never calls it (stopped, SIGKILLed) leaves the stream stuck, like a kernel spinning on the
//   network, until the communicator is aborted. Buffers must be device memory of the
//   communicator's device and big enough for the call, the stream must be that device's, and a
//   rank's input must fit in TRUN_SIMGPU_MAX_MIB (default 256); ranks whose calls disagree
//   (count, type, op, root) get ncclInvalidUsage.
// - The first collective of a non-blocking communicator answers ncclInProgress and its async
//   state stays so for a moment (NCCL connects lazily).
// - ncclReduce: as ncclAllReduce, but only the root's receive buffer is written.
// - ncclSend/ncclRecv, inside ncclGroupStart/ncclGroupEnd (or alone): a group's transfers on one
//   communicator run as one operation on its stream. Each ordered pair of ranks has a one-message
//   channel in the control file, the message sitting in the sender's data file (its region for
//   that peer: TRUN_SIMGPU_MAX_MIB divided by the size); the operation makes progress on any of
//   its transfers that can move (a send when the channel is empty, a receive when a message is
//   there) until all are done, and a send is done once its receiver took it (so the data file
//   is free for the next collective). A receive whose count differs from the message gets
//   ncclInvalidUsage. Sends to self are allowed, as in NCCL. A peer that never posts the match
//   leaves the stream stuck until the communicator is aborted. Collectives inside a group are
//   refused (ncclInvalidUsage): libtrun_worker never issues them so.
// - ncclCommFinalize (in progress until queued work is done), ncclCommDestroy, ncclCommAbort
//   (queued and running operations of that rank end at once).
// - Fault injection for tests: trun_simgpu_fail_next_collective(rank, result) makes that rank's
//   next collective (in this process) hang and, 100 ms later, sets its communicator's async error
//   to `result`, as a network failure under real NCCL does. Tests find it with dlsym (absent
//   from real NCCL).

#include <fcntl.h>
#include <nccl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <trun/process_group.h>

#include "tests/simgpu/sim.h"
#include "worker_sdk/src/reduce.h"

namespace {

using trun::worker::DataType;
using trun::worker::dtype_size;
using trun::worker::ReduceOp;
using Clock = std::chrono::steady_clock;
constexpr char kMagic[] = "trun-simgpu-nccl";
constexpr int kMaxRanks = 64;

enum class Kind : int32_t { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kReduce };

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;  // per rank: what one rank contributes or receives
  ncclDataType_t dtype;
  ncclRedOp_t op = ncclSum;
  int root = 0;
};

// One rank's part of a clique's control file. The call's shape is written before `posted`.
struct SlotCtl {
  std::atomic<uint32_t> joined;  // its data file exists
  std::atomic<uint32_t> mapped;  // it has mapped every peer's data file
  std::atomic<int32_t> device;
  std::atomic<uint64_t> posted;  // sequence number of the operation it offers
  std::atomic<uint64_t> read;    // last operation whose inputs it has finished reading
  int32_t kind, dtype, op, root;
  uint64_t count;
};

// The one-message channel from one rank to another (point-to-point).
struct PairCtl {
  std::atomic<uint64_t> sent;   // messages the sender has put in its data file
  std::atomic<uint64_t> taken;  // messages the receiver has copied out
  std::atomic<uint64_t> bytes;  // length of the message in flight (written before `sent`)
};

// A clique's control file (zero-filled when created): shared by its ranks' processes.
struct Ctl {
  std::atomic<uint32_t> size;  // set by the first rank to join
  std::atomic<uint32_t> mapped_count;
  SlotCtl slots[kMaxRanks];
  PairCtl pairs[kMaxRanks][kMaxRanks];  // [sender][receiver]
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "process-shared atomics");

struct CommState {
  int rank = 0;
  int size = 0;
  int device = 0;
  bool blocking = true;
  size_t max_bytes = 0;     // of each rank's data file
  std::string base;         // /dev/shm/<base>-ctl, /dev/shm/<base>-<rank>
  Ctl* ctl = nullptr;       // mapped control file
  std::vector<char*> data;  // every rank's data file, mapped (this rank's once joined)
  std::atomic<bool> aborted{false};
  std::atomic<bool> ready{false};  // every rank joined and mapped
  std::mutex mu;                   // guards what follows
  std::condition_variable cv;
  ncclResult_t async_error = ncclSuccess;
  Clock::time_point busy_until{};  // a lazy connection in progress
  bool finalizing = false;
  uint64_t issued = 0;       // operations queued (collectives and point-to-point groups)
  uint64_t finished = 0;     // operations done (or ended by abort)
  uint64_t collectives = 0;  // collectives queued: their sequence numbers
  std::string last_error;

  ~CommState() {
    for (char* d : data)
      if (d) ::munmap(d, max_bytes);
    if (ctl) ::munmap(ctl, sizeof(Ctl));
  }
  std::string path(const std::string& what) const { return "/dev/shm/" + base + "-" + what; }
  SlotCtl& slot(int r) const { return ctl->slots[r]; }
};

}  // namespace

struct ncclComm {
  std::shared_ptr<CommState> state;
};

namespace {

std::mutex g_mu;                       // injected faults and the last error without a communicator
std::map<int, ncclResult_t> g_faults;  // rank -> async error of its next collective
std::string g_last_error;

// memcpy for buffers that may be empty: a count of 0 may come with null pointers (as NCCL allows).
void copy_bytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

ncclResult_t set_error(CommState* s, ncclResult_t r, const std::string& what) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_last_error = "GPU simulator: " + what;
  if (s) s->last_error = g_last_error;
  return r;
}

// Maps `bytes` of the file at `path` (created when `create`), or returns null.
void* map_file(const std::string& path, size_t bytes, bool create) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0600);
  if (fd < 0) return nullptr;
  struct stat st {};
  bool ok = ::fstat(fd, &st) == 0 &&
            (static_cast<size_t>(st.st_size) >= bytes || ::ftruncate(fd, bytes) == 0);
  void* p = ok ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  return p == MAP_FAILED ? nullptr : p;
}

// Polls (sleeping between looks) until `done()` or this rank's communicator is aborted; false
// when aborted. A peer that never comes keeps it polling, as a kernel spinning on the network.
template <typename Done>
bool poll_until(const CommState& s, Done done) {
  while (!done()) {
    if (s.aborted) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return !s.aborted;
}

// The types and reductions modelled are those libtrun_worker's NCCL backend uses; others are
// refused (ncclInvalidArgument). The arithmetic is libtrun_worker's own reduction kernels
// (worker_sdk/src/reduce.h, as on its CPU backend): the tests check results against their own
// serial references, not against these.
std::optional<DataType> dtype_of(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
      return DataType::kFloat32;
    case ncclFloat64:
      return DataType::kFloat64;
    case ncclFloat16:
      return DataType::kFloat16;
    case ncclBfloat16:
      return DataType::kBFloat16;
    case ncclInt32:
      return DataType::kInt32;
    case ncclInt64:
      return DataType::kInt64;
    case ncclInt8:
      return DataType::kInt8;
    case ncclUint8:
      return DataType::kUInt8;
    default:
      return std::nullopt;
  }
}

std::optional<ReduceOp> op_of(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
      return ReduceOp::kSum;
    case ncclAvg:
      return ReduceOp::kAvg;
    case ncclMin:
      return ReduceOp::kMin;
    case ncclMax:
      return ReduceOp::kMax;
    case ncclProd:
      return ReduceOp::kProduct;
    default:
      return std::nullopt;
  }
}

size_t type_size(ncclDataType_t t) {
  auto d = dtype_of(t);
  return d ? dtype_size(*d) : 0;
}

// out[i] = the reduction over ranks of in[r][i]; `t` and `op` are modelled (checked on entry).
void reduce(const std::vector<const void*>& in, void* out, size_t n, ncclDataType_t t,
            ncclRedOp_t op) {
  const DataType dtype = *dtype_of(t);
  const ReduceOp rop = *op_of(op);
  void* const dst[] = {out};
  trun::worker::detail::reduce_n(dst, 1, in.data(), static_cast<int>(in.size()), n, dtype, rop);
  if (rop == ReduceOp::kAvg)
    trun::worker::detail::divide(out, n, dtype, static_cast<int>(in.size()));
}

// Bytes of `c` that its rank puts into its data file (only the root's, for a broadcast).
size_t send_bytes(const Call& c, int rank, int size) {
  const size_t bytes = c.count * type_size(c.dtype);
  switch (c.kind) {
    case Kind::kBroadcast:
      return rank == c.root ? bytes : 0;
    case Kind::kReduceScatter:
      return bytes * size;
    default:
      return bytes;
  }
}

size_t recv_bytes(const Call& c, int rank, int size) {
  const size_t bytes = c.count * type_size(c.dtype);
  if (c.kind == Kind::kReduce) return rank == c.root ? bytes : 0;
  return c.kind == Kind::kAllGather ? bytes * size : bytes;
}

// This rank's result of `me`, from every rank's data file.
void compute(const CommState& s, const Call& me, std::vector<char>& out) {
  const size_t es = type_size(me.dtype), bytes = me.count * es;
  out.resize(recv_bytes(me, s.rank, s.size));
  std::vector<const void*> in;
  switch (me.kind) {
    case Kind::kReduce:
      if (s.rank != me.root) return;
      [[fallthrough]];
    case Kind::kAllReduce:
      in.assign(s.data.begin(), s.data.end());
      return reduce(in, out.data(), me.count, me.dtype, me.op);
    case Kind::kBroadcast:
      copy_bytes(out.data(), s.data[me.root], bytes);
      return;
    case Kind::kAllGather:
      for (int r = 0; r < s.size; ++r) copy_bytes(out.data() + r * bytes, s.data[r], bytes);
      return;
    case Kind::kReduceScatter:
      for (char* d : s.data) in.push_back(d + s.rank * bytes);
      return reduce(in, out.data(), me.count, me.dtype, me.op);
  }
}

// Hangs until this rank's communicator is aborted, reporting `fault` as its async error after
// 100 ms: how a network failure looks under real NCCL.
void fail_and_hang(const std::shared_ptr<CommState>& s, ncclResult_t fault,
                   const std::string& why) {
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return s->aborted.load(); });
  s->async_error = fault;
  lock.unlock();
  set_error(s.get(), fault, why);
  lock.lock();
  s->cv.wait(lock, [&] { return s->aborted.load(); });
}

// Runs operation `seq` of `s` on its stream's thread: puts this rank's input into its data file,
// meets the other ranks' same operation, reads their inputs, and writes this rank's output once
// every rank has read (so buffers may alias). Ends early, writing nothing, when aborted.
void run_collective(const std::shared_ptr<CommState>& s, Call call, uint64_t seq,
                    ncclResult_t fault) {
  if (fault != ncclSuccess) {
    fail_and_hang(s, fault, "injected failure of rank " + std::to_string(s->rank));
  } else {
    SlotCtl& me = s->slot(s->rank);
    copy_bytes(s->data[s->rank], call.send, send_bytes(call, s->rank, s->size));
    me.kind = static_cast<int32_t>(call.kind);
    me.dtype = call.dtype;
    me.op = call.op;
    me.root = call.root;
    me.count = call.count;
    me.posted.store(seq, std::memory_order_release);
    auto all = [&](std::atomic<uint64_t> SlotCtl::*field) {
      for (int r = 0; r < s->size; ++r)
        if ((s->slot(r).*field).load(std::memory_order_acquire) < seq) return false;
      return true;
    };
    if (poll_until(*s, [&] { return all(&SlotCtl::posted); })) {
      int differs = -1;
      for (int r = 0; r < s->size && differs < 0; ++r) {
        const SlotCtl& o = s->slot(r);
        if (o.kind != me.kind || o.dtype != me.dtype || o.op != me.op || o.root != me.root ||
            o.count != me.count)
          differs = r;
      }
      if (differs >= 0) {
        fail_and_hang(s, ncclInvalidUsage,
                      "rank " + std::to_string(differs) + "'s collective " + std::to_string(seq) +
                          " differs from rank " + std::to_string(s->rank) +
                          "'s (kind, count, type, op or root)");
      } else {
        std::vector<char> out;
        compute(*s, call, out);
        me.read.store(seq, std::memory_order_release);
        if (poll_until(*s, [&] { return all(&SlotCtl::read); }))
          copy_bytes(call.recv, out.data(), out.size());
      }
    }
  }
  std::lock_guard<std::mutex> lock(s->mu);
  ++s->finished;
  s->cv.notify_all();
}

bool in_device(const void* p, size_t bytes, int device) {
  return bytes == 0 || trun::simgpu::device_of_range(p, bytes) == device;
}

// ---- point-to-point ----

struct Transfer {
  bool send = true;
  const void* sbuf = nullptr;
  void* rbuf = nullptr;
  size_t bytes = 0;
  int peer = 0;
};

struct PendingGroup {
  std::shared_ptr<CommState> s;
  cudaStream_t stream = nullptr;
  std::vector<Transfer> ops;
};

// The open ncclGroupStart/End of this thread: its depth, transfers (by communicator, in order of
// first use) and first error.
thread_local int t_group_depth = 0;
thread_local std::vector<PendingGroup> t_pending;
thread_local ncclResult_t t_group_error = ncclSuccess;

size_t region_bytes(const CommState& s) { return s.max_bytes / s.size / 64 * 64; }

// Runs one group's transfers on the stream's thread (see the top of this file).
void run_p2p(const std::shared_ptr<CommState>& s, std::vector<Transfer> ops) {
  const size_t region = region_bytes(*s);
  enum { kWaiting, kPosted, kDone };
  std::vector<int> state(ops.size(), kWaiting);
  std::vector<uint64_t> number(ops.size(), 0);  // a send's message number on its channel
  size_t done = 0;
  std::string mismatch;
  while (done < ops.size() && !s->aborted && mismatch.empty()) {
    bool moved = false;
    for (size_t i = 0; i < ops.size() && mismatch.empty(); ++i) {
      const Transfer& t = ops[i];
      if (state[i] == kDone) continue;
      if (t.send) {
        PairCtl& c = s->ctl->pairs[s->rank][t.peer];
        if (state[i] == kWaiting) {
          const uint64_t sent = c.sent.load(std::memory_order_acquire);
          if (sent != c.taken.load(std::memory_order_acquire)) continue;  // channel busy
          copy_bytes(s->data[s->rank] + t.peer * region, t.sbuf, t.bytes);
          c.bytes.store(t.bytes, std::memory_order_relaxed);
          number[i] = sent + 1;
          c.sent.store(sent + 1, std::memory_order_release);
          state[i] = kPosted;
          moved = true;
        } else if (c.taken.load(std::memory_order_acquire) >= number[i]) {
          state[i] = kDone;
          ++done;
          moved = true;
        }
      } else {
        PairCtl& c = s->ctl->pairs[t.peer][s->rank];
        const uint64_t taken = c.taken.load(std::memory_order_acquire);
        if (c.sent.load(std::memory_order_acquire) == taken) continue;  // nothing there yet
        const uint64_t bytes = c.bytes.load(std::memory_order_relaxed);
        if (bytes != t.bytes) {
          mismatch = "rank " + std::to_string(t.peer) + " sent " + std::to_string(bytes) +
                     " bytes to rank " + std::to_string(s->rank) + ", whose ncclRecv expects " +
                     std::to_string(t.bytes);
          break;
        }
        copy_bytes(t.rbuf, s->data[t.peer] + s->rank * region, bytes);
        c.taken.store(taken + 1, std::memory_order_release);
        state[i] = kDone;
        ++done;
        moved = true;
      }
    }
    if (!moved) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  if (!mismatch.empty()) fail_and_hang(s, ncclInvalidUsage, mismatch);
  std::lock_guard<std::mutex> lock(s->mu);
  ++s->finished;
  s->cv.notify_all();
}

ncclResult_t submit_p2p(PendingGroup g) {
  auto s = g.s;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->ready || s->aborted || s->finalizing)
      return set_error(s.get(), ncclInvalidUsage, "communicator not ready (or finalizing)");
    if (s->async_error != ncclSuccess) return s->async_error;
    ++s->issued;
  }
  if (!trun::simgpu::enqueue(g.stream, [s, ops = std::move(g.ops)] { run_p2p(s, ops); }))
    return set_error(s.get(), ncclInvalidArgument, "invalid stream");
  return ncclSuccess;
}

bool in_device(const void* p, size_t bytes, int device);

ncclResult_t p2p(bool send, const void* sbuf, void* rbuf, size_t count, ncclDataType_t dtype,
                 int peer, ncclComm_t comm, cudaStream_t stream) {
  auto refuse = [](CommState* s, ncclResult_t r, const std::string& why) {
    if (t_group_depth > 0 && t_group_error == ncclSuccess) t_group_error = r;
    return set_error(s, r, why);
  };
  if (!comm) return refuse(nullptr, ncclInvalidArgument, "null communicator");
  auto s = comm->state;
  if (!dtype_of(dtype)) return refuse(s.get(), ncclInvalidArgument, "data type not modelled");
  if (peer < 0 || peer >= s->size) return refuse(s.get(), ncclInvalidArgument, "peer out of range");
  const size_t bytes = count * type_size(dtype);
  if (trun::simgpu::stream_device(stream) != s->device)
    return refuse(s.get(), ncclInvalidArgument,
                  "the stream is not a stream of the communicator's device");
  if (!in_device(send ? sbuf : rbuf, bytes, s->device))
    return refuse(s.get(), ncclInvalidArgument,
                  "a buffer is not device memory of device " + std::to_string(s->device) +
                      " or is too small for the call");
  if (bytes > region_bytes(*s))
    return refuse(s.get(), ncclInvalidArgument,
                  "a message of " + std::to_string(bytes) +
                      " bytes is over the simulator's TRUN_SIMGPU_MAX_MIB / size");
  Transfer t{send, sbuf, rbuf, bytes, peer};
  if (t_group_depth == 0) return submit_p2p(PendingGroup{s, stream, {t}});
  for (PendingGroup& g : t_pending) {
    if (g.s != s) continue;
    if (g.stream != stream)
      return refuse(s.get(), ncclInvalidUsage, "one group's transfers on two streams");
    g.ops.push_back(t);
    return ncclSuccess;
  }
  t_pending.push_back(PendingGroup{s, stream, {t}});
  return ncclSuccess;
}

ncclResult_t collective(const Call& call, ncclComm_t comm, cudaStream_t stream) {
  if (!comm) return set_error(nullptr, ncclInvalidArgument, "null communicator");
  auto s = comm->state;
  if (t_group_depth > 0)
    return set_error(s.get(), ncclInvalidUsage,
                     "collectives inside ncclGroupStart/End are not modelled");
  if (!dtype_of(call.dtype))
    return set_error(s.get(), ncclInvalidArgument, "data type not modelled");
  if (!op_of(call.op)) return set_error(s.get(), ncclInvalidArgument, "reduction not modelled");
  if ((call.kind == Kind::kBroadcast || call.kind == Kind::kReduce) &&
      (call.root < 0 || call.root >= s->size))
    return set_error(s.get(), ncclInvalidArgument, "root out of range");
  const size_t in = send_bytes(call, s->rank, s->size), out = recv_bytes(call, s->rank, s->size);
  if (trun::simgpu::stream_device(stream) != s->device)
    return set_error(
        s.get(), ncclInvalidArgument,
        "the stream is not a stream of the communicator's device " + std::to_string(s->device));
  if (!in_device(call.send, in, s->device) || !in_device(call.recv, out, s->device))
    return set_error(s.get(), ncclInvalidArgument,
                     "a buffer is not device memory of device " + std::to_string(s->device) +
                         " or is too small for the call");
  if (in > s->max_bytes)
    return set_error(s.get(), ncclInvalidArgument,
                     "a rank's input of " + std::to_string(in) +
                         " bytes is over the simulator's TRUN_SIMGPU_MAX_MIB");
  ncclResult_t fault = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_faults.find(s->rank);
    if (it != g_faults.end()) {
      fault = it->second;
      g_faults.erase(it);
    }
  }
  uint64_t seq;
  bool first;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->ready || s->aborted || s->finalizing)
      return set_error(s.get(), ncclInvalidUsage, "communicator not ready (or finalizing)");
    if (s->async_error != ncclSuccess) return s->async_error;
    ++s->issued;
    seq = ++s->collectives;
    first = seq == 1;
    if (first && !s->blocking) s->busy_until = Clock::now() + std::chrono::milliseconds(2);
  }
  if (!trun::simgpu::enqueue(stream,
                             [s, call, seq, fault] { run_collective(s, call, seq, fault); }))
    return set_error(s.get(), ncclInvalidArgument, "invalid stream");
  return first && !s->blocking ? ncclInProgress : ncclSuccess;
}

// Advances a communicator's creation: once every rank has joined, maps their data files; once
// every rank has mapped them, checks the devices and removes the files from /dev/shm (the
// mappings stay), so that nothing is left there however a process ends later.
ncclResult_t progress_init(CommState& s) {
  if (s.ready) return ncclSuccess;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.async_error != ncclSuccess) return s.async_error;
  for (int r = 0; r < s.size; ++r)
    if (!s.slot(r).joined.load(std::memory_order_acquire)) return ncclInProgress;
  SlotCtl& me = s.slot(s.rank);
  if (!me.mapped.load()) {
    for (int r = 0; r < s.size; ++r) {
      if (s.data[r]) continue;
      s.data[r] = static_cast<char*>(map_file(s.path(std::to_string(r)), s.max_bytes, false));
      if (!s.data[r]) {
        s.async_error = ncclSystemError;
        return set_error(&s, ncclSystemError, "cannot map rank " + std::to_string(r) + "'s data");
      }
    }
    me.mapped.store(1);
    s.ctl->mapped_count.fetch_add(1);
  }
  if (static_cast<int>(s.ctl->mapped_count.load()) < s.size) return ncclInProgress;
  for (int r = 0; r < s.size; ++r) {
    if (r != s.rank && s.slot(r).device.load() == s.slot(s.rank).device.load()) {
      s.async_error = ncclInvalidUsage;
      return set_error(&s, ncclInvalidUsage,
                       "Duplicate GPU detected: rank " + std::to_string(s.rank) + " and rank " +
                           std::to_string(r) + " both on device " +
                           std::to_string(s.slot(r).device.load()) + " of this machine");
    }
  }
  ::unlink(s.path(std::to_string(s.rank)).c_str());
  if (s.rank == 0) ::unlink(s.path("ctl").c_str());
  s.ready = true;
  return ncclSuccess;
}

// Ends this rank's part: its operations stop (abort) or are waited for (destroy), its files go.
void release(ncclComm_t comm, bool abort) {
  auto s = comm->state;
  {
    std::unique_lock<std::mutex> lock(s->mu);
    if (abort) {
      s->aborted = true;
      s->cv.notify_all();
    } else {
      s->cv.wait(lock, [&] { return s->finished >= s->issued; });  // blocks like NCCL's
    }
  }
  if (!s->ready) {  // a clique that never formed: take our files back
    ::unlink(s->path(std::to_string(s->rank)).c_str());
    ::unlink(s->path("ctl").c_str());
  }
  delete comm;  // queued operations still hold the state
}

}  // namespace

extern "C" {

// Test hook (see the top of this file); returns 0.
int trun_simgpu_fail_next_collective(int rank, int result) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_faults[rank] = static_cast<ncclResult_t>(result);
  return 0;
}

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  static std::atomic<uint64_t> counter{0};
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, kMagic, sizeof kMagic);
  uint64_t parts[3] = {std::random_device{}(), std::random_device{}(),
                       (static_cast<uint64_t>(::getpid()) << 24) + ++counter};
  std::memcpy(id->internal + sizeof kMagic, parts, sizeof parts);
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(g_mu);
  copy = comm ? comm->state->last_error : g_last_error;
  return copy.c_str();
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (!out) return set_error(nullptr, ncclInvalidArgument, "null communicator pointer");
  if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
    return set_error(nullptr, ncclInvalidArgument, "rank or size out of range");
  if (std::memcmp(id.internal, kMagic, sizeof kMagic) != 0)
    return set_error(nullptr, ncclInvalidArgument, "not a unique id from ncclGetUniqueId");
  if (config && config->magic != 0xcafebeef)
    return set_error(nullptr, ncclInvalidArgument, "config not set from NCCL_CONFIG_INITIALIZER");
  auto s = std::make_shared<CommState>();
  s->rank = rank;
  s->size = nranks;
  s->device = trun::simgpu::current_device();
  s->blocking = !config || config->blocking != 0;  // NCCL_CONFIG_UNDEF_INT means blocking
  const char* mib = std::getenv("TRUN_SIMGPU_MAX_MIB");
  s->max_bytes = static_cast<size_t>(mib && *mib ? std::atoll(mib) : 256) << 20;
  char hex[2 * 24 + 1];
  for (int i = 0; i < 24; ++i)
    std::snprintf(hex + 2 * i, 3, "%02x",
                  static_cast<unsigned char>(id.internal[sizeof kMagic + i]));
  s->base = std::string("trun-simgpu-") + hex;
  s->data.assign(nranks, nullptr);
  s->data[rank] = static_cast<char*>(map_file(s->path(std::to_string(rank)), s->max_bytes, true));
  s->ctl = static_cast<Ctl*>(map_file(s->path("ctl"), sizeof(Ctl), true));
  if (!s->data[rank] || !s->ctl) {
    ::unlink(s->path(std::to_string(rank)).c_str());
    return set_error(nullptr, ncclSystemError, "cannot create " + s->path("*") + " files");
  }
  uint32_t expected = 0;
  SlotCtl& me = s->slot(rank);
  if ((!s->ctl->size.compare_exchange_strong(expected, nranks) &&
       expected != static_cast<uint32_t>(nranks)) ||
      me.joined.load()) {
    ::unlink(s->path(std::to_string(rank)).c_str());
    return set_error(nullptr, ncclInvalidUsage,
                     "rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                         " joined twice, or the ranks disagree on the size");
  }
  me.device.store(trun::simgpu::physical_device(s->device));  // as other processes number it
  me.joined.store(1, std::memory_order_release);
  *out = new ncclComm{s};
  if (!s->blocking) return ncclInProgress;
  ncclResult_t r;
  while ((r = progress_init(*s)) == ncclInProgress)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  return r;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (!comm || !state) return ncclInvalidArgument;
  CommState& s = *comm->state;
  *state = progress_init(s);
  if (*state != ncclSuccess) return ncclSuccess;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.async_error != ncclSuccess)
    *state = s.async_error;
  else if (Clock::now() < s.busy_until || (s.finalizing && s.finished < s.issued))
    *state = ncclInProgress;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  CommState& s = *comm->state;
  std::unique_lock<std::mutex> lock(s.mu);
  s.finalizing = true;
  if (!s.blocking) return ncclInProgress;
  s.cv.wait(lock, [&] { return s.finished >= s.issued; });
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  release(comm, false);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm) release(comm, true);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::kAllReduce, send, recv, count, dtype, op}, comm, stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::kBroadcast, send, recv, count, dtype, ncclSum, root}, comm, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::kAllGather, send, recv, count, dtype}, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::kReduceScatter, send, recv, count, dtype, op}, comm, stream);
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::kReduce, send, recv, count, dtype, op, root}, comm, stream);
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t dtype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(true, send, nullptr, count, dtype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p(false, nullptr, recv, count, dtype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0)
    return set_error(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<PendingGroup> pending = std::move(t_pending);
  t_pending.clear();
  const ncclResult_t error = t_group_error;
  t_group_error = ncclSuccess;
  if (error != ncclSuccess) return error;
  for (PendingGroup& g : pending)
    if (ncclResult_t r = submit_p2p(std::move(g)); r != ncclSuccess) return r;
  return ncclSuccess;
}

}  // extern "C"
