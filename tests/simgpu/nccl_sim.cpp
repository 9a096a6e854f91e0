// The GPU simulator's NCCL: the part of the NCCL API that libtrun_worker calls, built as a
// libnccl.so.2 over the simulated CUDA runtime (cudart_sim.cpp), for ranks that are threads of
// one process (the GPU tests run their ranks so). Loaded through LD_LIBRARY_PATH instead of the
// real library; see tests/simgpu/CMakeLists.txt.
//
// What it models, after NCCL's documented semantics:
// - ncclGetUniqueId / ncclCommInitRankConfig: ranks meet by unique id; two ranks of one clique
//   on the same device are refused ("duplicate GPU"), as real NCCL refuses them. A non-blocking
//   communicator (config.blocking = 0) answers ncclInProgress and its async state stays
//   ncclInProgress until every rank has joined, which may be never.
// - Collectives are queued on the caller's stream and run there: a rank's operation waits for the
//   same operation of every other rank, so a peer that never calls it leaves the stream stuck
//   (like a kernel spinning on the network) until the communicator is aborted. Buffers must be
//   device memory of the communicator's device, big enough for the call, and the stream must be
//   that device's; ranks whose calls disagree (count, type, op, root) get ncclInvalidUsage.
// - The first collective of a non-blocking communicator answers ncclInProgress and its async
//   state stays so for a moment (NCCL connects lazily).
// - ncclCommFinalize (in progress until queued work is done), ncclCommDestroy, ncclCommAbort
//   (queued and running operations of that rank end at once).
// - Fault injection for tests: trun_simgpu_fail_next_collective(rank, result) makes that rank's
//   next collective hang and, 100 ms later, sets its communicator's async error to `result`, as a
//   network failure under real NCCL does. Tests find it with dlsym (absent from real NCCL).

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/simgpu/sim.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[] = "trun-simgpu-nccl";

enum class Kind { kAllReduce, kBroadcast, kAllGather, kReduceScatter };

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;  // per rank: what one rank contributes or receives
  ncclDataType_t dtype;
  ncclRedOp_t op = ncclSum;
  int root = 0;

  bool same_shape(const Call& o) const {
    return kind == o.kind && count == o.count && dtype == o.dtype && op == o.op && root == o.root;
  }
};

struct CommState;

// The ranks sharing one unique id, and the exchange their collectives meet in.
struct Clique {
  int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<CommState*> members;  // by rank; null until that rank joins
  int joined = 0;
  struct Slot {
    uint64_t posted = 0;  // sequence number of the operation this rank offers
    uint64_t read = 0;    // last operation whose inputs this rank has finished reading
    Call call{};
  };
  std::vector<Slot> slots;
};

struct CommState {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int device = 0;
  bool blocking = true;
  std::atomic<bool> aborted{false};
  // Guarded by clique->mu:
  ncclResult_t async_error = ncclSuccess;
  Clock::time_point busy_until{};  // a lazy connection in progress
  bool finalizing = false;
  uint64_t issued = 0;    // collectives queued
  uint64_t finished = 0;  // collectives done (or ended by abort)
  std::string last_error;
};

}  // namespace

struct ncclComm {
  std::shared_ptr<CommState> state;
};

namespace {

std::mutex g_mu;  // the registry, injected faults and the last error without a communicator
std::map<std::string, std::weak_ptr<Clique>> g_cliques;
std::map<int, ncclResult_t> g_faults;  // rank -> async error of its next collective
std::string g_last_error;

ncclResult_t set_error(CommState* s, ncclResult_t r, const std::string& what) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_last_error = "GPU simulator: " + what;
  if (s) s->last_error = g_last_error;
  return r;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint16_t sign = (x >> 16) & 0x8000;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0);
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to more than 65504: inf
  if (abs < 0x38800000u) {                       // subnormal half (or zero)
    float v;
    std::memcpy(&v, &abs, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f));  // v / 2^-24
  }
  uint32_t rounded = abs + 0xfff + ((abs >> 13) & 1);  // round to nearest even
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // nan
  return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

template <typename T>
T combine(T a, T b, ncclRedOp_t op) {
  switch (op) {
    case ncclMin:
      return b < a ? b : a;
    case ncclMax:
      return b > a ? b : a;
    case ncclProd:
      return a * b;
    default:  // sum, avg (divided at the end)
      return a + b;
  }
}

// out[i] = reduce over ranks of inputs[r][i], in the type's own arithmetic (half types in float).
template <typename T, typename Load, typename Store>
void reduce_as(const std::vector<const void*>& in, void* out, size_t n, ncclRedOp_t op, Load load,
               Store store) {
  for (size_t i = 0; i < n; ++i) {
    auto acc = load(in[0], i);
    for (size_t r = 1; r < in.size(); ++r) acc = combine(acc, load(in[r], i), op);
    if (op == ncclAvg) acc = acc / static_cast<decltype(acc)>(in.size());
    store(out, i, acc);
  }
}

template <typename T>
void reduce_plain(const std::vector<const void*>& in, void* out, size_t n, ncclRedOp_t op) {
  reduce_as<T>(
      in, out, n, op, [](const void* p, size_t i) { return static_cast<const T*>(p)[i]; },
      [](void* p, size_t i, T v) { static_cast<T*>(p)[i] = v; });
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void reduce_16(const std::vector<const void*>& in, void* out, size_t n, ncclRedOp_t op) {
  reduce_as<float>(
      in, out, n, op,
      [](const void* p, size_t i) { return ToFloat(static_cast<const uint16_t*>(p)[i]); },
      [](void* p, size_t i, float v) { static_cast<uint16_t*>(p)[i] = FromFloat(v); });
}

void reduce(const std::vector<const void*>& in, void* out, size_t n, ncclDataType_t t,
            ncclRedOp_t op) {
  switch (t) {
    case ncclInt8:
      return reduce_plain<int8_t>(in, out, n, op);
    case ncclUint8:
      return reduce_plain<uint8_t>(in, out, n, op);
    case ncclInt32:
      return reduce_plain<int32_t>(in, out, n, op);
    case ncclUint32:
      return reduce_plain<uint32_t>(in, out, n, op);
    case ncclInt64:
      return reduce_plain<int64_t>(in, out, n, op);
    case ncclUint64:
      return reduce_plain<uint64_t>(in, out, n, op);
    case ncclFloat32:
      return reduce_plain<float>(in, out, n, op);
    case ncclFloat64:
      return reduce_plain<double>(in, out, n, op);
    case ncclFloat16:
      return reduce_16<half_to_float, float_to_half>(in, out, n, op);
    case ncclBfloat16:
      return reduce_16<bf16_to_float, float_to_bf16>(in, out, n, op);
    default:
      return;
  }
}

// This rank's result of `calls` (every rank's call of one operation), computed into `out`.
void compute(const std::vector<Call>& calls, int rank, std::vector<char>& out) {
  const Call& me = calls[rank];
  const size_t es = type_size(me.dtype), n = calls.size();
  switch (me.kind) {
    case Kind::kAllReduce: {
      std::vector<const void*> in;
      for (auto& c : calls) in.push_back(c.send);
      out.resize(me.count * es);
      reduce(in, out.data(), me.count, me.dtype, me.op);
      break;
    }
    case Kind::kBroadcast:
      out.assign(static_cast<const char*>(calls[me.root].send),
                 static_cast<const char*>(calls[me.root].send) + me.count * es);
      break;
    case Kind::kAllGather:
      out.resize(n * me.count * es);
      for (size_t r = 0; r < n; ++r)
        std::memcpy(out.data() + r * me.count * es, calls[r].send, me.count * es);
      break;
    case Kind::kReduceScatter: {
      std::vector<const void*> in;
      for (auto& c : calls) in.push_back(static_cast<const char*>(c.send) + rank * me.count * es);
      out.resize(me.count * es);
      reduce(in, out.data(), me.count, me.dtype, me.op);
      break;
    }
  }
}

// Runs operation `seq` of `s` on its stream's thread: meets the other ranks' same operation,
// reads their inputs, and writes this rank's output once everyone has read (buffers may alias).
// Ends early, writing nothing, when this rank's communicator is aborted.
void run_collective(const std::shared_ptr<CommState>& s, Call call, uint64_t seq,
                    ncclResult_t fault) {
  Clique& q = *s->clique;
  std::unique_lock<std::mutex> lock(q.mu);
  auto done = [&] {
    ++s->finished;
    q.cv.notify_all();
  };
  if (fault != ncclSuccess) {  // the network "breaks": hang, then report, until aborted
    q.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return s->aborted.load(); });
    s->async_error = fault;
    lock.unlock();
    set_error(s.get(), fault, "injected failure of rank " + std::to_string(s->rank));
    lock.lock();
    q.cv.wait(lock, [&] { return s->aborted.load(); });
    return done();
  }
  q.slots[s->rank].posted = seq;
  q.slots[s->rank].call = call;
  q.cv.notify_all();
  auto all = [&](uint64_t Clique::Slot::*field) {
    for (auto& slot : q.slots)
      if (slot.*field < seq) return false;
    return true;
  };
  q.cv.wait(lock, [&] { return s->aborted || all(&Clique::Slot::posted); });
  if (s->aborted) return done();
  std::vector<Call> calls;
  for (auto& slot : q.slots) calls.push_back(slot.call);
  for (size_t r = 0; r < calls.size(); ++r) {
    if (!calls[r].same_shape(call)) {
      s->async_error = ncclInvalidUsage;
      lock.unlock();
      set_error(s.get(), ncclInvalidUsage,
                "rank " + std::to_string(r) + "'s collective " + std::to_string(seq) +
                    " differs from rank " + std::to_string(s->rank) +
                    "'s (kind, count, type, op or root)");
      lock.lock();
      q.cv.wait(lock, [&] { return s->aborted.load(); });
      return done();
    }
  }
  lock.unlock();
  std::vector<char> out;
  compute(calls, s->rank, out);
  lock.lock();
  q.slots[s->rank].read = seq;
  q.cv.notify_all();
  q.cv.wait(lock, [&] { return s->aborted || all(&Clique::Slot::read); });
  if (!s->aborted) std::memcpy(call.recv, out.data(), out.size());
  done();
}

bool in_device(const void* p, size_t bytes, int device) {
  return bytes == 0 || trun::simgpu::device_of_range(p, bytes) == device;
}

ncclResult_t collective(const Call& call, ncclComm_t comm, cudaStream_t stream) {
  if (!comm) return set_error(nullptr, ncclInvalidArgument, "null communicator");
  auto s = comm->state;
  const size_t es = type_size(call.dtype);
  if (es == 0) return set_error(s.get(), ncclInvalidArgument, "unknown data type");
  if (call.op < ncclSum || call.op > ncclAvg)
    return set_error(s.get(), ncclInvalidArgument, "unknown reduction");
  Clique& q = *s->clique;
  const size_t n = static_cast<size_t>(q.size), bytes = call.count * es;
  size_t send_bytes = bytes, recv_bytes = bytes;
  if (call.kind == Kind::kAllGather) recv_bytes = n * bytes;
  if (call.kind == Kind::kReduceScatter) send_bytes = n * bytes;
  if (call.kind == Kind::kBroadcast) {
    if (call.root < 0 || call.root >= q.size)
      return set_error(s.get(), ncclInvalidArgument, "root out of range");
    if (call.root != s->rank) send_bytes = 0;  // only the root's send buffer is read
  }
  if (trun::simgpu::stream_device(stream) != s->device)
    return set_error(
        s.get(), ncclInvalidArgument,
        "the stream is not a stream of the communicator's device " + std::to_string(s->device));
  if (!in_device(call.send, send_bytes, s->device) || !in_device(call.recv, recv_bytes, s->device))
    return set_error(s.get(), ncclInvalidArgument,
                     "a buffer is not device memory of device " + std::to_string(s->device) +
                         " or is too small for the call");
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
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.joined < q.size || s->aborted || s->finalizing)
      return set_error(s.get(), ncclInvalidUsage, "communicator not ready (or finalizing)");
    if (s->async_error != ncclSuccess) return s->async_error;
    seq = ++s->issued;
    first = seq == 1;
    if (first && !s->blocking) s->busy_until = Clock::now() + std::chrono::milliseconds(2);
  }
  if (!trun::simgpu::enqueue(stream,
                             [s, call, seq, fault] { run_collective(s, call, seq, fault); }))
    return set_error(s.get(), ncclInvalidArgument, "invalid stream");
  return first && !s->blocking ? ncclInProgress : ncclSuccess;
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
  uint64_t parts[2] = {std::random_device{}(), ++counter};
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
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return set_error(nullptr, ncclInvalidArgument, "rank or size out of range");
  if (std::memcmp(id.internal, kMagic, sizeof kMagic) != 0)
    return set_error(nullptr, ncclInvalidArgument, "not a unique id from ncclGetUniqueId");
  if (config && config->magic != 0xcafebeef)
    return set_error(nullptr, ncclInvalidArgument, "config not set from NCCL_CONFIG_INITIALIZER");
  auto s = std::make_shared<CommState>();
  s->rank = rank;
  s->device = trun::simgpu::current_device();
  s->blocking = !config || config->blocking != 0;  // NCCL_CONFIG_UNDEF_INT means blocking
  {
    std::lock_guard<std::mutex> lock(g_mu);
    std::string key(id.internal, sizeof id.internal);
    auto q = g_cliques[key].lock();
    if (!q) {
      q = std::make_shared<Clique>();
      q->size = nranks;
      q->members.assign(nranks, nullptr);
      q->slots.resize(nranks);
      g_cliques[key] = q;
    }
    s->clique = q;
  }
  Clique& q = *s->clique;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.size != nranks || q.members[rank])
      return set_error(nullptr, ncclInvalidUsage,
                       "rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                           " joined twice, or the ranks disagree on the size");
    for (auto* m : q.members)
      if (m && m->device == s->device)
        return set_error(nullptr, ncclInvalidUsage,
                         "Duplicate GPU detected: rank " + std::to_string(rank) + " and rank " +
                             std::to_string(m->rank) + " both on device " +
                             std::to_string(s->device));
    q.members[rank] = s.get();
    ++q.joined;
    q.cv.notify_all();
  }
  *out = new ncclComm{s};
  if (!s->blocking) return ncclInProgress;
  std::unique_lock<std::mutex> lock(q.mu);
  q.cv.wait(lock, [&] { return q.joined == q.size; });
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (!comm || !state) return ncclInvalidArgument;
  CommState& s = *comm->state;
  std::lock_guard<std::mutex> lock(s.clique->mu);
  if (s.async_error != ncclSuccess)
    *state = s.async_error;
  else if (s.clique->joined < s.clique->size || Clock::now() < s.busy_until)
    *state = ncclInProgress;
  else if (s.finalizing && s.finished < s.issued)
    *state = ncclInProgress;
  else
    *state = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  CommState& s = *comm->state;
  std::unique_lock<std::mutex> lock(s.clique->mu);
  s.finalizing = true;
  if (!s.blocking) return ncclInProgress;
  s.clique->cv.wait(lock, [&] { return s.finished >= s.issued; });
  return ncclSuccess;
}

namespace {
// Leaves the clique (so that a later communicator may use this rank's device) and frees the
// handle; operations still queued hold the state.
void release(ncclComm_t comm) {
  auto s = comm->state;
  {
    std::lock_guard<std::mutex> lock(s->clique->mu);
    if (s->clique->members[s->rank] == s.get()) s->clique->members[s->rank] = nullptr;
    s->clique->cv.notify_all();
  }
  delete comm;
}
}  // namespace

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  CommState& s = *comm->state;
  {
    std::unique_lock<std::mutex> lock(s.clique->mu);
    s.clique->cv.wait(lock, [&] { return s.finished >= s.issued; });  // blocks like NCCL's
  }
  release(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(comm->state->clique->mu);
    comm->state->aborted = true;
    comm->state->clique->cv.notify_all();
  }
  release(comm);
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

}  // extern "C"
