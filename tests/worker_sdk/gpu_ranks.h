#pragma once
// GPU test helpers shared by the NCCL and the DDP-on-CUDA tests: a process group per CUDA device,
// with its ranks as threads of the test process sharing an in-process store. Only for builds with
// NCCL (include it under #if TRUN_HAVE_NCCL).

#include <cuda_runtime.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <trun/process_group.h>

#include "store/in_memory_store.h"
#include "tests/skip.h"

namespace trun::worker::test {

// True when NCCL is usable and at least `n` CUDA devices are visible.
inline bool have_cuda_devices(int n) {
  int count = 0;
  return nccl_available() && cudaGetDeviceCount(&count) == cudaSuccess && count >= n;
}

// Why the GPU cases skip, for their skip line: on a GPU machine a CUDA error here (an old driver,
// say) must not read like "no GPU".
inline std::string no_gpu_reason() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    return std::string("no CUDA device visible: cudaGetDeviceCount: ") + cudaGetErrorName(e) +
           " (" + cudaGetErrorString(e) + ")";
  if (count == 0) return "no CUDA device visible";
  return "NCCL unavailable with " + std::to_string(count) + " CUDA device(s) visible";
}

// First statement of a "GPU:" test case: without a usable device it reports why and returns.
#define TRUN_SKIP_WITHOUT_GPU()                                              \
  do {                                                                       \
    if (!::trun::worker::nccl_available()) {                                 \
      TRUN_SKIP(::trun::worker::test::no_gpu_reason()                        \
                    << " (scripts/gpu-check.sh runs this on a GPU machine)", \
                kEnvironment);                                               \
    }                                                                        \
  } while (0)

// First statement of a case whose ranks need `n` CUDA devices (NCCL refuses two ranks on one).
#define TRUN_SKIP_WITHOUT_GPUS(n)                                                \
  do {                                                                           \
    if (!::trun::worker::test::have_cuda_devices(n)) {                           \
      TRUN_SKIP("needs " << (n) << " CUDA devices, one per rank", kEnvironment); \
    }                                                                            \
  } while (0)

// Options for rank `rank` of `world` on CUDA device `rank`, NCCL backend, a 120 s timeout.
inline ProcessGroupOptions nccl_rank_options(int rank, int world,
                                             std::shared_ptr<store::Store> store) {
  ProcessGroupOptions o;
  o.store = std::move(store);
  o.rank = rank;
  o.world_size = world;
  o.cuda_device = rank;
  o.backend = Backend::kNccl;
  o.timeout = std::chrono::seconds(120);
  return o;
}

// Runs `body` on `world` ranks, one thread and one device each (the thread's current device is
// set to its rank); `adjust`, when given, changes each rank's options first. Returns each rank's
// outcome: what `body` returned, or the exception's message; "" means success. Catch2 assertions
// are not thread-safe: `body` reports through its result.
inline std::vector<std::string> run_nccl_ranks(
    int world, const std::function<std::string(ProcessGroup&, int)>& body,
    const std::function<void(ProcessGroupOptions&)>& adjust = nullptr) {
  auto store = std::make_shared<store::InMemoryStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        auto options = nccl_rank_options(r, world, store);
        if (adjust) adjust(options);
        ProcessGroup pg(options);
        cudaSetDevice(r);
        errors[r] = body(pg, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace trun::worker::test
