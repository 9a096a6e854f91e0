#pragma once
// Checks for CUDA runtime and NCCL calls (only the NCCL backend's .cpp files include this). The
// calls go through the libraries loaded at run time (gpu_libs.h): TRUN_CUDA_CHECK(cudaSetDevice,
// device_) calls cudart().cudaSetDevice(device_). A failure throws CollectiveError whose message
// names the host, the rank, file:line, the call, the error string and NCCL's last error:
//   [host gpu7 rank 3] nccl_backend.cpp:120: ncclAllReduce(...) failed: unhandled system error
//   (ncclSystemError 2); NCCL: socket connect to 10.0.0.2 failed

#include <string>

#include "worker_sdk/src/nccl/gpu_libs.h"

namespace trun::worker::detail {

// The rank named in messages from the calling thread (set by the NCCL backend; -1 until then).
void set_cuda_check_rank(int rank);
std::string cuda_check_where(const char* file, int line);

[[noreturn]] void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line);
[[noreturn]] void throw_nccl_error(const char* call, ncclResult_t res, ncclComm_t comm,
                                   const char* file, int line);
// The message throw_nccl_error would use (for tests and for errors found by polling).
std::string nccl_error_message(const char* call, ncclResult_t res, ncclComm_t comm,
                               const char* file, int line);
std::string cuda_error_message(const char* call, cudaError_t err, const char* file, int line);

}  // namespace trun::worker::detail

#define TRUN_CUDA_CHECK(fn, ...)                                                              \
  do {                                                                                        \
    cudaError_t trun_err_ = ::trun::worker::detail::cudart().fn(__VA_ARGS__);                 \
    if (trun_err_ != cudaSuccess)                                                             \
      ::trun::worker::detail::throw_cuda_error(#fn "(" #__VA_ARGS__ ")", trun_err_, __FILE__, \
                                               __LINE__);                                     \
  } while (0)

// ncclInProgress is not an error for non-blocking communicators; callers poll for it. `comm`
// (or nullptr) is the communicator whose last error the message quotes.
#define TRUN_NCCL_CHECK(comm, fn, ...)                                                      \
  do {                                                                                      \
    ncclResult_t trun_res_ = ::trun::worker::detail::nccl().fn(__VA_ARGS__);                \
    if (trun_res_ != ncclSuccess && trun_res_ != ncclInProgress)                            \
      ::trun::worker::detail::throw_nccl_error(#fn "(" #__VA_ARGS__ ")", trun_res_, (comm), \
                                               __FILE__, __LINE__);                         \
  } while (0)
