// A worker for the SDK's multi-process tests: reads the launcher environment through
// trun::worker::init() and runs one scenario, checking results against a serial reference.
//
//   pg_worker matrix [size...]   every op x dtype x size; exit 0 when all match
//   pg_worker big                every collective x dtype on 64 MiB buffers
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

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "trun/config.h"
#include "trun/error_file.h"
#include "trun/worker.h"
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
  }
}

std::vector<char> make(size_t n, DataType dt) { return std::vector<char>(n * dtype_size(dt) + 1); }

void fill(std::vector<char>& buf, size_t n, DataType dt, int rank, size_t base = 0) {
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
  }
  return 0;
}

int g_failures = 0;
bool g_cuda = false;  // PG_WORKER_CUDA=1

// A host buffer as a collective sees it: the buffer itself or, with PG_WORKER_CUDA, a device
// copy of it for as long as this object lives (copied in now, out by back()).
class OnDevice {
 public:
  OnDevice(void* host, size_t bytes) : host_(host), bytes_(bytes) {
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

  void* ptr() const { return dev_ ? dev_ : host_; }
  void back() {
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
};

// The collectives on host vectors, through OnDevice.
void allreduce(ProcessGroup& pg, std::vector<char>& buf, size_t n, DataType dt, ReduceOp op) {
  OnDevice d(buf.data(), n * dtype_size(dt));
  pg.allreduce(d.ptr(), n, dt, op);
  d.back();
}

void broadcast(ProcessGroup& pg, std::vector<char>& buf, size_t n, DataType dt, int root) {
  OnDevice d(buf.data(), n * dtype_size(dt));
  pg.broadcast(d.ptr(), n, dt, root);
  d.back();
}

void allgather(ProcessGroup& pg, std::vector<char>& send, std::vector<char>& recv, size_t n,
               DataType dt) {
  OnDevice s(send.data(), n * dtype_size(dt)), r(recv.data(), n * pg.size() * dtype_size(dt));
  pg.allgather(s.ptr(), r.ptr(), n, dt);
  r.back();
}

void reduce_scatter(ProcessGroup& pg, std::vector<char>& send, std::vector<char>& recv, size_t n,
                    DataType dt, ReduceOp op) {
  OnDevice s(send.data(), n * pg.size() * dtype_size(dt)), r(recv.data(), n * dtype_size(dt));
  pg.reduce_scatter(s.ptr(), r.ptr(), n, dt, op);
  r.back();
}

void check(const std::string& what, const std::vector<char>& got, const std::vector<char>& want,
           size_t n, DataType dt) {
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

void run_matrix(ProcessGroup& pg, const std::vector<size_t>& sizes) {
  const int world = pg.size(), rank = pg.rank();
  for (DataType dt : kDtypes) {
    for (size_t n : sizes) {
      for (ReduceOp op : kOps) {
        auto buf = make(n, dt), want = make(n, dt);
        fill(buf, n, dt, rank);
        for (size_t i = 0; i < n; ++i) store(want.data(), i, dt, reduce_ref(world, i, dt, op));
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
        auto send = make(n * world, dt), recv = make(n, dt), want = make(n, dt);
        fill(send, n * world, dt, rank);
        for (size_t i = 0; i < n; ++i)
          store(want.data(), i, dt, reduce_ref(world, rank * n + i, dt, op));
        reduce_scatter(pg, send, recv, n, dt, op);
        check(label("reduce_scatter", dt, n, reduce_op_name(op)), recv, want, n, dt);
      }
    }
  }
  pg.barrier();
  // Async: several collectives in flight, completed in order.
  const size_t n = 1001;
  std::vector<std::vector<char>> bufs;
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

// n elements of dt whose element i is f(i % 29): every value in these tests repeats every 29
// elements, so a 64 MiB buffer is 29 computed elements and doubling copies.
template <typename F>
std::vector<char> periodic(size_t n, DataType dt, F f) {
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
  try {
    InitOptions io;
    if (const char* b = std::getenv("PG_WORKER_BACKEND")) io.backend = parse_backend(b);
    if (const char* c = std::getenv("PG_WORKER_CUDA")) g_cuda = std::string(c) == "1";
    if (g_cuda && !TRUN_HAVE_NCCL) throw std::runtime_error("PG_WORKER_CUDA=1 needs CUDA");
    if (const char* t = std::getenv("PG_WORKER_TIMEOUT_MS"))
      io.timeout = std::chrono::milliseconds(std::atoi(t));
    Worker w = init(io);
    ProcessGroup& pg = w.process_group();
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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pg_worker: unexpected exception: %s\n", e.what());
    return 3;
  }
  if (g_failures) {
    std::fprintf(stderr, "pg_worker: %d mismatches\n", g_failures);
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
