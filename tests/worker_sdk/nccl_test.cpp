// The NCCL backend. Without a GPU (this machine): detection, the CPU fallback, error paths and
// what NCCL answers without a device. With GPUs (scripts/gpu-check.sh): every collective on
// device buffers, world size 1 (and 2 ranks as threads when two devices are visible).

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <trun/config.h>
#include <trun/process_group.h>

#include "tests/skip.h"

#if TRUN_HAVE_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <atomic>

#include "tests/worker_sdk/gpu_ranks.h"
#include "worker_sdk/src/nccl/nccl_info.h"
#endif

using namespace trun::worker;

#if !TRUN_HAVE_NCCL
TEST_CASE("NCCL backend is not built", "[worker_sdk][nccl]") {
  TRUN_SKIP_REPORT("libtrun_worker was configured without CUDA/NCCL", kEnvironment);
  ProcessGroupOptions o;
  o.backend = Backend::kNccl;
  CHECK_THROWS_AS(ProcessGroup(o), CollectiveError);
  CHECK_FALSE(nccl_available());
}
#else

// The library loaded at run time may be another 2.x than the headers (a GPU machine's PyTorch
// ships its own): it must be new enough for non-blocking communicators (2.14, ncclConfig_t and
// ncclCommFinalize). Where it is the library built against, the versions match.
TEST_CASE("NCCL reports its version, new enough for non-blocking communicators",
          "[worker_sdk][nccl]") {
  std::string v = detail::nccl_runtime_version();
  std::string built = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                      std::to_string(NCCL_PATCH);
  WARN("NCCL at run time " << v << ", built against " << built);
  int major = -1, minor = -1, patch = -1;
  REQUIRE(std::sscanf(v.c_str(), "%d.%d.%d", &major, &minor, &patch) == 3);
  CHECK(major == 2);
  CHECK(minor >= 14);
  CHECK(patch >= 0);
}

TEST_CASE("ncclGetUniqueId works without a device and ids differ", "[worker_sdk][nccl]") {
  std::string a = detail::nccl_new_unique_id(), b = detail::nccl_new_unique_id();
  CHECK(a.size() == NCCL_UNIQUE_ID_BYTES);
  CHECK(a != b);
}

TEST_CASE("NCCL and CUDA errors name host, rank, file:line and the error string",
          "[worker_sdk][nccl]") {
  std::string n = detail::nccl_error_for_test(ncclSystemError);
  CHECK(n.find("[host ") == 0);
  CHECK(n.find(" rank ") != std::string::npos);
  CHECK(n.find("nccl_backend.cpp:") != std::string::npos);
  CHECK(n.find("ncclTestCall() failed: ") != std::string::npos);
  CHECK(n.find(ncclGetErrorString(ncclSystemError)) != std::string::npos);
  CHECK(n.find("NCCL: ") != std::string::npos);
  std::string c = detail::cuda_error_for_test(cudaErrorInsufficientDriver);
  CHECK(c.find("cudaErrorInsufficientDriver") != std::string::npos);
  CHECK(c.find(cudaGetErrorString(cudaErrorInsufficientDriver)) != std::string::npos);
}

TEST_CASE("without a CUDA device: auto falls back to CPU, nccl fails clearly",
          "[worker_sdk][nccl]") {
  std::string why;
  if (detail::cuda_device_count(&why) > 0) {
    TRUN_SKIP("this machine has a CUDA device (covered by the GPU tests)", kEnvironment);
  }
  CHECK_FALSE(nccl_available());
  CHECK_FALSE(why.empty());
  ProcessGroupOptions o;  // world of size 1
  ProcessGroup auto_pg(o);
  CHECK(auto_pg.backend() == Backend::kCpu);
  o.backend = Backend::kNccl;
  try {
    ProcessGroup pg(o);
    FAIL("NCCL group without a device must fail");
  } catch (const CollectiveError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("no CUDA device") != std::string::npos);
    CHECK(std::string(e.what()).find("cudaGetDeviceCount") != std::string::npos);
  }
}

namespace {

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* d = nullptr;
  REQUIRE(cudaMalloc(&d, host.size() * sizeof(T) + 1) == cudaSuccess);
  REQUIRE(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> host_copy(const T* d, size_t n) {
  std::vector<T> h(n);
  REQUIRE(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

// One rank's share of the GPU checks: every op on float32 device buffers.
void gpu_rank_checks(ProcessGroup& pg) {
  const int world = pg.size(), rank = pg.rank();
  for (size_t n : {size_t{0}, size_t{1}, size_t{1000003}}) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>((rank + 1) * (i % 7));
    float* d = device_copy(x);
    pg.allreduce(d, n, DataType::kFloat32, ReduceOp::kSum);
    auto got = host_copy(d, n);
    for (size_t i = 0; i < n; ++i)
      REQUIRE(got[i] == static_cast<float>(world * (world + 1) / 2 * (i % 7)));
    // Every rank now holds the same values: each later collective must leave them in place.
    auto expect_sum = [&](const std::vector<float>& h, size_t offset) {
      for (size_t i = 0; i < n; ++i)
        REQUIRE(h[offset + i] == static_cast<float>(world * (world + 1) / 2 * (i % 7)));
    };
    pg.allreduce(d, n, DataType::kFloat32, ReduceOp::kAvg);  // the average of equal values
    expect_sum(host_copy(d, n), 0);
    pg.broadcast(d, n, DataType::kFloat32, world - 1);
    expect_sum(host_copy(d, n), 0);
    float* all = nullptr;
    REQUIRE(cudaMalloc(&all, n * world * sizeof(float) + 1) == cudaSuccess);
    pg.allgather(d, all, n, DataType::kFloat32);
    auto gathered = host_copy(all, n * world);
    for (int r = 0; r < world; ++r) expect_sum(gathered, static_cast<size_t>(r) * n);
    REQUIRE(cudaMemset(d, 0, n * sizeof(float) + 1) == cudaSuccess);
    pg.reduce_scatter(all, d, n, DataType::kFloat32, ReduceOp::kMax);
    expect_sum(host_copy(d, n), 0);
    pg.barrier();
    cudaFree(all);
    cudaFree(d);
  }
  std::vector<int64_t> v = {rank, -rank};
  int64_t* dv = device_copy(v);
  pg.allreduce(dv, 2, DataType::kInt64, ReduceOp::kMin);
  auto got = host_copy(dv, 2);
  CHECK(got[0] == 0);
  CHECK(got[1] == -(world - 1));
  cudaFree(dv);
}

}  // namespace

TEST_CASE("GPU: every collective on device buffers, world size 1", "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPU();
  ProcessGroup pg(test::nccl_rank_options(0, 1, nullptr));
  CHECK(pg.backend() == Backend::kNccl);
  gpu_rank_checks(pg);
}

// The timeout path on real hardware with one GPU: rank 0 of a world of 2 whose rank 1 never
// comes. The non-blocking ncclCommInitRankConfig stays in progress; at the group's deadline the
// communicator is aborted and the constructor raises, instead of hanging.
TEST_CASE("GPU: a peer that never joins: NCCL init times out and aborts",
          "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPU();
  auto o = test::nccl_rank_options(0, 2, std::make_shared<trun::store::InMemoryStore>());
  o.timeout = std::chrono::seconds(5);
  auto t0 = std::chrono::steady_clock::now();
  std::string what;
  bool timed_out = false;
  try {
    ProcessGroup pg(o);
    FAIL("a group whose peer never joins must not form");
  } catch (const CollectiveTimeoutError& e) {
    timed_out = true;
    what = e.what();
  } catch (const CollectiveError& e) {
    what = e.what();
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(what);
  CHECK(timed_out);
  CHECK(what.find("aborted") != std::string::npos);
  CHECK(s >= 4.5);
  CHECK(s < 60);
}

// ProcessGroupOptions::cuda_stream: the program's non-blocking stream is held for 300 ms by a
// host function and then zeroes the buffer; an out-of-place allgather issued meanwhile must
// read the zeros. Without the ordering it would copy the old ones (the legacy default stream
// does not wait for a non-blocking stream).
TEST_CASE("GPU: with cuda_stream set, a collective starts after the work queued on that stream",
          "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPU();
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  {
    auto o = test::nccl_rank_options(0, 1, nullptr);
    o.cuda_stream = s;
    ProcessGroup pg(o);
    const size_t n = 1 << 20;
    float* d = device_copy(std::vector<float>(n, 1.0f));
    float* out = device_copy(std::vector<float>(n, 2.0f));
    REQUIRE(cudaLaunchHostFunc(
                s, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); },
                nullptr) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(d, 0, n * sizeof(float), s) == cudaSuccess);
    pg.allgather(d, out, n, DataType::kFloat32);
    auto got = host_copy(out, n);
    CHECK(got[0] == 0.0f);
    CHECK(got[n - 1] == 0.0f);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    cudaFree(d);
    cudaFree(out);
  }
  cudaStreamDestroy(s);
}

TEST_CASE("GPU: two ranks on two devices", "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPUS(2);
  auto errors = test::run_nccl_ranks(2, [](ProcessGroup& pg, int) -> std::string {
    std::vector<float> x(1 << 20, 1.0f);
    float* d = nullptr;
    cudaMalloc(&d, x.size() * sizeof(float));
    cudaMemcpy(d, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice);
    pg.allreduce(d, x.size(), DataType::kFloat32);
    cudaMemcpy(x.data(), d, x.size() * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(d);
    return x[0] == 2.0f && x.back() == 2.0f ? "" : "wrong allreduce result";
  });
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}

namespace {

using Clock = std::chrono::steady_clock;

bool contains(const std::string& text, const char* part) {
  return text.find(part) != std::string::npos;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The GPU simulator's fault hook (tests/simgpu/nccl_sim.cpp); null with the real NCCL.
using FailNextCollective = int (*)(int rank, int nccl_result);
FailNextCollective simulator_fault_hook() {
  return reinterpret_cast<FailNextCollective>(
      dlsym(RTLD_DEFAULT, "trun_simgpu_fail_next_collective"));
}

// A device buffer of `n` floats, all `v`.
float* device_floats(size_t n, float v) { return device_copy(std::vector<float>(n, v)); }

}  // namespace

// Under ctest's simgpu.* entries (tests/simgpu) the GPU simulator must really be loaded: were the
// real libraries found instead, every GPU case would skip and the entry would prove nothing.
TEST_CASE("the GPU simulator is loaded when the test run expects it", "[worker_sdk][nccl]") {
  bool loaded = simulator_fault_hook() != nullptr;
  if (!std::getenv("TRUN_SIMGPU_EXPECTED")) {
    WARN((loaded ? "running on the GPU simulator" : "running on the real CUDA and NCCL"));
    return;
  }
  CHECK(loaded);
}

// The device follows the local rank when cuda_device is unset: two ranks of one node must not
// share a GPU (NCCL refuses that, "Duplicate GPU detected").
TEST_CASE("GPU: without cuda_device, ranks take the device of their local rank",
          "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPUS(2);
  auto errors = test::run_nccl_ranks(
      2,
      [](ProcessGroup& pg, int rank) -> std::string {
        float* d = device_floats(4, 1.0f);
        pg.allreduce(d, 4, DataType::kFloat32);
        auto got = host_copy(d, 4);
        cudaFree(d);
        return got[3] == 2.0f ? "" : "wrong allreduce result";
      },
      [](ProcessGroupOptions& o) {
        o.node_rank = 0;
        o.local_rank = o.rank;
        o.cuda_device = -1;
      });
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}

TEST_CASE("GPU: asynchronous collectives return work handles", "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPU();
  ProcessGroup pg(test::nccl_rank_options(0, 1, nullptr));
  const size_t n = 1 << 16;
  float* d = device_floats(n, 3.0f);
  float* all = device_floats(n, 0.0f);
  Work a = pg.allreduce_async(d, n, DataType::kFloat32, ReduceOp::kMax);
  Work b = pg.allgather_async(d, all, n, DataType::kFloat32);  // queued behind a
  b.wait();
  CHECK(a.is_completed());
  CHECK(b.is_completed());
  CHECK(a.error() == nullptr);
  CHECK(host_copy(all, n)[n - 1] == 3.0f);
  cudaFree(all);
  cudaFree(d);
}

// Rank 1 stops calling collectives (a hung or dead peer): rank 0's collective times out, its
// communicator is aborted, and a group made afresh afterwards (as after a restart) works.
TEST_CASE("GPU: a peer that stops: the collective times out and aborts, a new group works",
          "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPUS(2);
  auto second_store = std::make_shared<trun::store::InMemoryStore>();
  std::atomic<bool> rank0_failed{false};
  auto errors = test::run_nccl_ranks(2, [&](ProcessGroup& pg, int rank) -> std::string {
    float* d = device_floats(1024, 1.0f);
    pg.allreduce(d, 1024, DataType::kFloat32);
    if (rank == 0) {
      auto t0 = Clock::now();
      try {
        pg.allreduce(d, 1024, DataType::kFloat32, ReduceOp::kSum, std::chrono::seconds(3));
        return "an allreduce without its peer returned";
      } catch (const CollectiveTimeoutError& e) {
        if (!contains(e.what(), "aborted")) return std::string("no abort in: ") + e.what();
        // Each rank is a thread here: the message must name this one.
        if (!contains(e.what(), " rank 0]")) return std::string("not rank 0's: ") + e.what();
      }
      double s = seconds_since(t0);
      if (s < 2.5 || s > 60) return "timed out after " + std::to_string(s) + " s, not ~3 s";
      if (!pg.broken()) return "the group is not marked broken";
      rank0_failed = true;
    } else {
      auto t0 = Clock::now();
      while (!rank0_failed && seconds_since(t0) < 120)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ProcessGroup again(test::nccl_rank_options(rank, 2, second_store));
    float* e = device_floats(1024, 1.0f);
    again.allreduce(e, 1024, DataType::kFloat32);
    auto got = host_copy(e, 1024);
    cudaFree(e);
    cudaFree(d);
    return got[1023] == 2.0f ? "" : "the new group's allreduce is wrong";
  });
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}

TEST_CASE("GPU: abort() from another thread ends a collective waiting for its peer",
          "[worker_sdk][nccl][gpu]") {
  TRUN_SKIP_WITHOUT_GPUS(2);
  std::atomic<bool> rank0_done{false};
  auto errors = test::run_nccl_ranks(2, [&](ProcessGroup& pg, int rank) -> std::string {
    float* d = device_floats(1024, 1.0f);
    std::string result;
    if (rank == 0) {
      std::thread aborter([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        pg.abort("test abort");
      });
      auto t0 = Clock::now();
      try {
        pg.allreduce(d, 1024, DataType::kFloat32);  // the group's 120 s timeout
        result = "an allreduce without its peer returned";
      } catch (const CollectiveTimeoutError& e) {
        result = std::string("timed out instead of aborting: ") + e.what();
      } catch (const CollectiveError& e) {
        if (!contains(e.what(), "abort")) result = std::string("no abort in: ") + e.what();
      }
      aborter.join();
      if (result.empty() && seconds_since(t0) > 30) result = "abort took over 30 s";
      rank0_done = true;
    } else {
      auto t0 = Clock::now();
      while (!rank0_done && seconds_since(t0) < 120)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    cudaFree(d);
    return result;
  });
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}

// An asynchronous NCCL error (a network failure under real NCCL) on rank 1: rank 1's collective
// fails at once with NCCL's error, rank 0's times out; neither hangs. Real NCCL cannot be made to
// fail on demand, so this runs on the GPU simulator only.
TEST_CASE("GPU: an asynchronous NCCL error fails its rank's collective, the peer times out",
          "[worker_sdk][nccl][gpu]") {
  auto fail_next = simulator_fault_hook();
  if (!fail_next || !test::have_cuda_devices(2)) {
    TRUN_SKIP("needs the GPU simulator (tests/simgpu) with two devices", kEnvironment);
  }
  REQUIRE(fail_next(1, ncclRemoteError) == 0);  // rank 1's next collective
  auto errors = test::run_nccl_ranks(2, [&](ProcessGroup& pg, int rank) -> std::string {
    float* d = device_floats(1024, 1.0f);
    std::string result;
    auto t0 = Clock::now();
    try {
      pg.allreduce(d, 1024, DataType::kFloat32, ReduceOp::kSum,
                   std::chrono::seconds(rank == 0 ? 3 : 60));
      result = "the allreduce returned";
    } catch (const CollectiveTimeoutError& e) {
      if (rank == 1) result = std::string("rank 1 timed out: ") + e.what();
    } catch (const CollectiveError& e) {
      if (rank == 0) result = std::string("rank 0 did not time out: ") + e.what();
      if (rank == 1 && !(contains(e.what(), "ncclResult 6") && contains(e.what(), "injected")))
        result = std::string("rank 1's error does not carry NCCL's: ") + e.what();
    }
    if (rank == 1 && result.empty() && seconds_since(t0) > 30) result = "rank 1 took over 30 s";
    cudaFree(d);
    return result;
  });
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}

#endif
