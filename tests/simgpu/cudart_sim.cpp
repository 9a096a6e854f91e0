// The GPU simulator's CUDA runtime: the part of libcudart that libtrun_worker and its GPU tests
// call, built as a libcudart.so.13 with the real symbol versions, so that the unchanged test
// binaries load it through LD_LIBRARY_PATH on a machine without a GPU
// (tests/simgpu/CMakeLists.txt).
//
// What it models, after the CUDA runtime's documented semantics:
// - TRUN_SIMGPU_DEVICES devices (default 1; 0 answers cudaErrorNoDevice like a machine without
//   one); the current device is per thread. CUDA_VISIBLE_DEVICES (a list of device numbers)
//   narrows and renumbers them as it does for the real runtime, so that processes standing for
//   different nodes of one machine can hold different devices.
// - Device memory is host memory handed out by cudaMalloc and tracked, so that a copy whose
//   direction does not match its pointers, or a pointer that is not (or no longer) device memory,
//   fails with the error the real runtime gives. New allocations hold garbage, not zeros.
// - Every stream is a thread running its queue in order, each operation after a delay
//   (TRUN_SIMGPU_OP_DELAY_US, default 200): work really is asynchronous, so a missing
//   synchronization shows up as a wrong result. The legacy default stream (nullptr,
//   cudaStreamLegacy) is one per device; it and streams created without cudaStreamNonBlocking wait
//   for each other, non-blocking streams wait for nothing they are not told to (events).
// - Copies involving pageable host memory are synchronous for the host, as the real runtime's
//   are (an async copy from pageable memory first waits for its stream).
// What it leaves out: kernels, pinned memory, graphs, peer access, and every API not listed here.

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "tests/simgpu/sim.h"

namespace trun::simgpu {
namespace {

struct Stream {
  int device = 0;
  bool blocking = true;  // synchronizes with the legacy stream
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0;   // operations queued so far
  uint64_t completed = 0;  // operations finished so far (they finish in order)
  bool closing = false;

  // How many operations are queued so far: done once wait_for(tail()) returns.
  uint64_t tail() {
    std::lock_guard<std::mutex> lock(mu);
    return enqueued;
  }
  // Blocks until the first `seq` operations have finished.
  void wait_for(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return completed >= seq; });
  }
};

struct Allocation {
  size_t bytes;
  int device;
};

struct Event {
  std::shared_ptr<Stream> stream;  // where it was last recorded (null: never recorded)
  uint64_t seq = 0;                // done once that stream has completed this many operations
};

// Streams, allocations and events of the process. Never destroyed: stream threads may still run
// while static destructors do.
struct State {
  std::mutex mu;
  int devices = 0;
  std::vector<int> physical;  // the machine's device number of each visible device
  std::chrono::microseconds op_delay{200};
  std::map<uintptr_t, Allocation> allocations;  // by start address
  std::vector<std::shared_ptr<Stream>> legacy;  // per device
  std::map<Stream*, std::shared_ptr<Stream>> streams;
  std::map<Event*, std::unique_ptr<Event>> events;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

void run_stream(std::shared_ptr<Stream> s, std::chrono::microseconds delay) {
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->cv.wait(lock, [&] { return !s->queue.empty() || s->closing; });
    if (s->queue.empty()) return;  // closing and drained
    auto op = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    std::this_thread::sleep_for(delay);
    op();
    lock.lock();
    ++s->completed;
    s->cv.notify_all();
  }
}

std::shared_ptr<Stream> start_stream(State& st, int device, bool blocking) {
  auto s = std::make_shared<Stream>();
  s->device = device;
  s->blocking = blocking;
  std::thread(run_stream, s, st.op_delay).detach();
  return s;
}

State& state() {
  static State* st = [] {
    auto* s = new State;
    const int machine = env_int("TRUN_SIMGPU_DEVICES", 1);
    for (int d = 0; d < machine; ++d) s->physical.push_back(d);
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
      // Like the runtime: numbers up to the first one that is not a device of this machine.
      s->physical.clear();
      for (const char* p = visible;; p++) {
        char* end = nullptr;
        long d = std::strtol(p, &end, 10);
        if (end == p || d < 0 || d >= machine) break;
        s->physical.push_back(static_cast<int>(d));
        p = end;
        if (*p != ',') break;
      }
    }
    s->devices = static_cast<int>(s->physical.size());
    s->op_delay = std::chrono::microseconds(env_int("TRUN_SIMGPU_OP_DELAY_US", 200));
    for (int d = 0; d < s->devices; ++d) s->legacy.push_back(start_stream(*s, d, true));
    return s;
  }();
  return *st;
}

thread_local int t_device = 0;
thread_local cudaError_t t_last_error = cudaSuccess;

cudaError_t fail(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

bool is_special(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

// The stream behind a handle (caller holds state().mu); null for an unknown handle.
std::shared_ptr<Stream> resolve(State& st, cudaStream_t handle) {
  if (is_special(handle)) {
    if (st.devices == 0) return nullptr;
    return st.legacy[t_device];
  }
  auto it = st.streams.find(reinterpret_cast<Stream*>(handle));
  return it == st.streams.end() ? nullptr : it->second;
}

// Queues `op` on `s` (caller holds state().mu), after what it must wait for by the legacy
// stream's rules. Returns the operation's sequence number.
uint64_t push(State& st, const std::shared_ptr<Stream>& s, std::function<void()> op) {
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> waits;
  if (s->blocking) {
    const auto& legacy = st.legacy[s->device];
    if (s == legacy) {
      for (auto& [p, o] : st.streams)
        if (o->blocking && o->device == s->device) waits.emplace_back(o, o->tail());
    } else {
      waits.emplace_back(legacy, legacy->tail());
    }
  }
  std::lock_guard<std::mutex> lock(s->mu);
  if (waits.empty()) {
    s->queue.push_back(std::move(op));
  } else {
    s->queue.push_back([waits = std::move(waits), op = std::move(op)] {
      for (auto& [o, seq] : waits) o->wait_for(seq);
      op();
    });
  }
  s->cv.notify_all();
  return ++s->enqueued;
}

int device_of_range_locked(State& st, const void* p, size_t bytes) {
  auto a = reinterpret_cast<uintptr_t>(p);
  auto it = st.allocations.upper_bound(a);
  if (it == st.allocations.begin()) return -1;
  --it;
  if (a - it->first > it->second.bytes || bytes > it->second.bytes - (a - it->first)) return -1;
  return it->second.device;
}

// Checks a copy's pointers against its direction, as the real runtime does with unified
// addressing: cudaErrorInvalidValue when a side that must be device memory is not, or the other
// way round.
cudaError_t check_copy(State& st, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return cudaSuccess;
  if (!dst || !src) return cudaErrorInvalidValue;
  bool dst_dev = device_of_range_locked(st, dst, bytes) >= 0;
  bool src_dev = device_of_range_locked(st, src, bytes) >= 0;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return dst_dev && !src_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost:
      return src_dev && !dst_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice:
      return src_dev && dst_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyHostToHost:
      return !src_dev && !dst_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDefault:
      return cudaSuccess;
  }
  return cudaErrorInvalidMemcpyDirection;
}

// Queues `op` on a stream (a copy, a fill, a host function); with `wait_before` the host waits
// for the stream and runs `op` itself (a pageable source), with `wait_after` it waits for `op`
// (a synchronous call, a pageable destination). Leaves the last error alone: callers use fail().
cudaError_t submit(cudaStream_t handle, std::function<void()> op, bool wait_before,
                   bool wait_after) {
  State& st = state();
  std::unique_lock<std::mutex> lock(st.mu);
  std::shared_ptr<Stream> s = resolve(st, handle);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (wait_before) {
    const uint64_t before = s->tail();
    lock.unlock();
    s->wait_for(before);
    op();  // the pageable source is read now; what follows on the stream sees the copy done
    return cudaSuccess;
  }
  const uint64_t seq = push(st, s, std::move(op));
  lock.unlock();
  if (wait_after) s->wait_for(seq);
  return cudaSuccess;
}

cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s,
                 bool sync) {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (cudaError_t e = check_copy(st, dst, src, bytes, kind); e != cudaSuccess) return fail(e);
    if (bytes == 0) return cudaSuccess;
  }
  bool src_pageable = kind == cudaMemcpyHostToDevice;
  bool dst_pageable = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost;
  auto op = [dst, src, bytes] { std::memmove(dst, src, bytes); };
  return fail(submit(s, op, !sync && src_pageable, sync || dst_pageable));
}

cudaError_t fill(void* p, int value, size_t bytes, cudaStream_t s, bool sync) {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (bytes > 0 && device_of_range_locked(st, p, bytes) < 0) return fail(cudaErrorInvalidValue);
  }
  if (bytes == 0) return cudaSuccess;
  return fail(submit(
      s, [p, value, bytes] { std::memset(p, value, bytes); }, false, sync));
}

}  // namespace

int current_device() { return t_device; }

int physical_device(int device) {
  const State& st = state();
  return device >= 0 && device < st.devices ? st.physical[device] : -1;
}

int stream_device(cudaStream_t handle) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto s = resolve(st, handle);
  return s ? s->device : -1;
}

int device_of_range(const void* p, size_t bytes) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return device_of_range_locked(st, p, bytes);
}

bool enqueue(cudaStream_t handle, std::function<void()> op) {
  return submit(handle, std::move(op), false, false) == cudaSuccess;
}

}  // namespace trun::simgpu

using namespace trun::simgpu;

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return fail(cudaErrorInvalidValue);
  if (state().devices <= 0) return fail(cudaErrorNoDevice);
  *count = state().devices;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= state().devices) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected (GPU simulator with TRUN_SIMGPU_DEVICES=0)";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    default:
      return "unknown error (not modelled by the GPU simulator)";
  }
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (!p) return fail(cudaErrorInvalidValue);
  State& st = state();
  if (st.devices == 0) return fail(cudaErrorNoDevice);
  void* mem = std::malloc(bytes == 0 ? 1 : bytes);
  if (!mem) return fail(cudaErrorMemoryAllocation);
  std::memset(mem, 0xa5, bytes);  // device memory is not zeroed
  std::lock_guard<std::mutex> lock(st.mu);
  st.allocations[reinterpret_cast<uintptr_t>(mem)] = {bytes, t_device};
  *p = mem;
  return cudaSuccess;
}

// Like the real cudaFree, waits for the device's queued work first (it may still use the memory).
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  State& st = state();
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> pending;
  int device;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.allocations.find(reinterpret_cast<uintptr_t>(p));
    if (it == st.allocations.end()) return fail(cudaErrorInvalidValue);
    device = it->second.device;
    auto note = [&](const std::shared_ptr<Stream>& s) {
      if (s->device == device) pending.emplace_back(s, s->tail());
    };
    note(st.legacy[device]);
    for (auto& [k, s] : st.streams) note(s);
  }
  for (auto& [s, seq] : pending) s->wait_for(seq);
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.allocations.erase(reinterpret_cast<uintptr_t>(p)) == 0)
    return fail(cudaErrorInvalidValue);  // freed twice, concurrently
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return copy(dst, src, bytes, kind, nullptr, true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return copy(dst, src, bytes, kind, stream, false);
}

cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  return fill(p, value, bytes, nullptr, true);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  return fill(p, value, bytes, stream, false);
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  if (!fn) return fail(cudaErrorInvalidValue);
  return fail(submit(
      stream, [fn, user_data] { fn(user_data); }, false, false));
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* handle, unsigned int flags) {
  if (!handle) return fail(cudaErrorInvalidValue);
  State& st = state();
  if (st.devices == 0) return fail(cudaErrorNoDevice);
  auto s = start_stream(st, t_device, (flags & cudaStreamNonBlocking) == 0);
  std::lock_guard<std::mutex> lock(st.mu);
  st.streams[s.get()] = s;
  *handle = reinterpret_cast<cudaStream_t>(s.get());
  return cudaSuccess;
}

// Returns at once; the stream's thread finishes what was queued and then ends.
cudaError_t cudaStreamDestroy(cudaStream_t handle) {
  State& st = state();
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (is_special(handle)) return fail(cudaErrorInvalidResourceHandle);
    auto it = st.streams.find(reinterpret_cast<Stream*>(handle));
    if (it == st.streams.end()) return fail(cudaErrorInvalidResourceHandle);
    s = it->second;
    st.streams.erase(it);
  }
  std::lock_guard<std::mutex> lock(s->mu);
  s->closing = true;
  s->cv.notify_all();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t handle) {
  State& st = state();
  std::unique_lock<std::mutex> lock(st.mu);
  std::shared_ptr<Stream> s = resolve(st, handle);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  const uint64_t seq = s->tail();
  lock.unlock();
  s->wait_for(seq);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* handle, unsigned int flags) {
  if (!handle) return fail(cudaErrorInvalidValue);
  State& st = state();
  auto e = std::make_unique<Event>();
  std::lock_guard<std::mutex> lock(st.mu);
  *handle = reinterpret_cast<cudaEvent_t>(e.get());
  st.events[e.get()] = std::move(e);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t handle) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.events.erase(reinterpret_cast<Event*>(handle)) ? cudaSuccess
                                                           : fail(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventRecord(cudaEvent_t handle, cudaStream_t stream) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.events.find(reinterpret_cast<Event*>(handle));
  auto s = resolve(st, stream);
  if (it == st.events.end() || !s) return fail(cudaErrorInvalidResourceHandle);
  it->second->stream = s;
  it->second->seq = s->tail();
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t handle) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.events.find(reinterpret_cast<Event*>(handle));
  if (it == st.events.end()) return fail(cudaErrorInvalidResourceHandle);
  const Event& e = *it->second;
  if (!e.stream) return cudaSuccess;  // never recorded: nothing to wait for
  std::lock_guard<std::mutex> slock(e.stream->mu);
  return e.stream->completed >= e.seq ? cudaSuccess : cudaErrorNotReady;  // not sticky
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t handle, unsigned int flags) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.events.find(reinterpret_cast<Event*>(handle));
  auto s = resolve(st, stream);
  if (it == st.events.end() || !s) return fail(cudaErrorInvalidResourceHandle);
  auto target = it->second->stream;  // captured now: a later record does not change this wait
  uint64_t seq = it->second->seq;
  if (target && target != s) push(st, s, [target, seq] { target->wait_for(seq); });
  return cudaSuccess;
}

}  // extern "C"
