// DDP on CUDA parameters with the NCCL backend. Without a GPU (this machine) only the checks that
// need none run; scripts/gpu-check.sh runs the "GPU:" cases on a GPU machine: world size 1
// on one device, and 2 ranks as threads when two devices are visible.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <trun/config.h>
#include <trun/ddp.h>

#include "tests/skip.h"

#if TRUN_HAVE_NCCL
#include <cuda_runtime.h>

#include "tests/worker_sdk/gpu_ranks.h"
#endif

using namespace trun::worker;

TEST_CASE("ddp cuda: CUDA parameters need an NCCL group", "[ddp][cuda]") {
  ProcessGroupOptions o;
  o.backend = Backend::kCpu;
  ProcessGroup pg(o);
  float dummy = 0;
  std::vector<Parameter> params = {{"w", &dummy, 1, DataType::kFloat32, Device::kCuda}};
  REQUIRE_THROWS_WITH(DistributedDataParallel(pg, params),
                      Catch::Contains("'w' is on CUDA but the group's backend is cpu"));
}

#if TRUN_HAVE_NCCL
namespace {

std::string cuda_check(cudaError_t e, const char* what) {
  return e == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(e);
}

// One rank's checks; returns "" on success, else what went wrong.
std::string rank_checks(ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  const std::vector<size_t> sizes = {1000, 300000, 17};  // 300000 floats > the 1 MiB first bucket
  std::vector<float*> dev(sizes.size(), nullptr);
  std::string err;
  for (size_t i = 0; i < sizes.size() && err.empty(); ++i) {
    err = cuda_check(cudaMalloc(&dev[i], sizes[i] * sizeof(float)), "cudaMalloc");
    std::vector<float> h(sizes[i], static_cast<float>(10 * rank + i));
    if (err.empty())
      err = cuda_check(cudaMemcpy(dev[i], h.data(), sizes[i] * 4, cudaMemcpyHostToDevice), "H2D");
  }
  if (!err.empty()) return err;
  std::vector<Parameter> params;
  for (size_t i = 0; i < sizes.size(); ++i)
    params.push_back(
        {"p" + std::to_string(i), dev[i], sizes[i], DataType::kFloat32, Device::kCuda});
  DdpOptions opt;
  opt.find_unused_parameters = true;
  {
    DistributedDataParallel ddp(pg, params, opt);
    if (ddp.buckets().size() < 2) return "expected at least 2 buckets";
    if (world == 1) ddp.broadcast_parameters();  // exercises the device staging path anyway
    for (size_t i = 0; i < sizes.size(); ++i) {  // every rank now has rank 0's values
      std::vector<float> h(sizes[i]);
      cudaMemcpy(h.data(), dev[i], sizes[i] * 4, cudaMemcpyDeviceToHost);
      if (h[0] != static_cast<float>(i) || h.back() != static_cast<float>(i))
        return "parameter " + std::to_string(i) + " not broadcast from rank 0";
    }
    for (int iter = 0; iter < 3; ++iter) {
      ddp.zero_grad();
      for (size_t i = sizes.size(); i-- > 0;) {
        if (iter == 2 && i == 1 && rank == 0) continue;  // unused on rank 0 in iteration 2
        std::vector<float> g(sizes[i], static_cast<float>(rank + 1 + i));
        err = cuda_check(
            cudaMemcpyAsync(ddp.grad(i), g.data(), sizes[i] * 4, cudaMemcpyHostToDevice, nullptr),
            "grad H2D");
        if (!err.empty()) return err;
        cudaStreamSynchronize(nullptr);  // g is pageable and goes out of scope
        ddp.mark_ready(i);
      }
      ddp.finalize();
      for (size_t i = 0; i < sizes.size(); ++i) {
        std::vector<float> h(sizes[i]);
        cudaMemcpy(h.data(), ddp.grad(i), sizes[i] * 4, cudaMemcpyDeviceToHost);
        double want = 0;
        for (int r = 0; r < world; ++r)
          want += (iter == 2 && i == 1 && r == 0) ? 0.0 : r + 1 + static_cast<double>(i);
        want /= world;
        if (std::abs(h[0] - want) > 1e-5 || std::abs(h.back() - want) > 1e-5)
          return "iteration " + std::to_string(iter) + ": grad " + std::to_string(i) + " = " +
                 std::to_string(h[0]) + ", want " + std::to_string(want);
      }
    }
  }
  for (auto* d : dev) cudaFree(d);
  return "";
}

// static_graph on device buckets: gradients marked in registration order (not the reverse the
// buckets start in), so the rebuild allocates new device buckets and moves the averages into
// them; and what CUDA buckets refuse: join_iteration() and the host-side compression hooks.
std::string static_graph_checks(ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  const std::vector<size_t> sizes = {300000, 1000, 17, 5000};
  std::vector<float*> dev(sizes.size(), nullptr);
  std::string err;
  for (size_t i = 0; i < sizes.size() && err.empty(); ++i)
    err = cuda_check(cudaMalloc(&dev[i], sizes[i] * sizeof(float)), "cudaMalloc");
  if (!err.empty()) return err;
  std::vector<Parameter> params;
  for (size_t i = 0; i < sizes.size(); ++i)
    params.push_back(
        {"s" + std::to_string(i), dev[i], sizes[i], DataType::kFloat32, Device::kCuda});
  DdpOptions opt;
  opt.static_graph = true;
  {
    DistributedDataParallel ddp(pg, params, opt);
    try {
      ddp.join_iteration(true);
      return "join_iteration() accepted CUDA parameters";
    } catch (const std::invalid_argument&) {
    }
    for (int iter = 0; iter < 2; ++iter) {
      ddp.zero_grad();
      for (size_t i = 0; i < sizes.size(); ++i) {
        std::vector<float> g(sizes[i], static_cast<float>(rank + 1 + 2 * i + iter));
        err = cuda_check(cudaMemcpy(ddp.grad(i), g.data(), sizes[i] * 4, cudaMemcpyHostToDevice),
                         "grad H2D");
        if (!err.empty()) return err;
        ddp.mark_ready(i);
      }
      ddp.finalize();
      if (iter == 0) {
        std::vector<size_t> flat;
        for (const auto& b : ddp.buckets())
          flat.insert(flat.end(), b.params.begin(), b.params.end());
        if (flat != std::vector<size_t>{0, 1, 2, 3}) return "buckets not rebuilt in arrival order";
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        std::vector<float> h(sizes[i]);
        cudaMemcpy(h.data(), ddp.grad(i), sizes[i] * 4, cudaMemcpyDeviceToHost);
        const double want = (world + 1) / 2.0 + 2.0 * i + iter;
        if (std::abs(h[0] - want) > 1e-5 || std::abs(h.back() - want) > 1e-5)
          return "static_graph iteration " + std::to_string(iter) + ": grad " + std::to_string(i) +
                 " = " + std::to_string(h[0]) + ", want " + std::to_string(want);
      }
    }
  }
  {
    DistributedDataParallel ddp(pg, params);
    ddp.register_comm_hook(fp16_compress_hook());
    ddp.zero_grad();
    try {
      for (size_t i = sizes.size(); i-- > 0;) ddp.mark_ready(i);
      ddp.finalize();
      return "fp16_compress_hook accepted a CUDA bucket";
    } catch (const DdpError& e) {
      if (!std::strstr(e.what(), "CUDA")) return std::string("unclear error: ") + e.what();
    }
  }
  for (auto* d : dev) cudaFree(d);
  return "";
}

}  // namespace

TEST_CASE("GPU: DDP on device buffers, world size 1", "[ddp][cuda][gpu]") {
  TRUN_SKIP_WITHOUT_GPU();
  ProcessGroup pg(test::nccl_rank_options(0, 1, nullptr));
  cudaSetDevice(0);
  REQUIRE(rank_checks(pg) == "");
  REQUIRE(static_graph_checks(pg) == "");
}

TEST_CASE("GPU: DDP on device buffers, two ranks on two devices", "[ddp][cuda][gpu]") {
  TRUN_SKIP_WITHOUT_GPUS(2);
  auto errors = test::run_nccl_ranks(2, [](ProcessGroup& pg, int) {
    std::string e = rank_checks(pg);
    return e.empty() ? static_graph_checks(pg) : e;
  });
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}
#else
TEST_CASE("GPU: DDP on device buffers (not built)", "[ddp][cuda][gpu]") {
  TRUN_SKIP("libtrun_worker was configured without CUDA/NCCL", kEnvironment);
}
#endif
