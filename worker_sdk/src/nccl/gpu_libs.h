#pragma once
// The CUDA runtime and NCCL, loaded with dlopen on first use (private to libtrun_worker). The
// NCCL backend and DDP's device memory call them only through the tables below, so that
// libtrun_worker has no DT_NEEDED on libcudart or libnccl: it loads on a machine without them,
// and a program that never uses the NCCL backend or CUDA buffers never loads them (as PyTorch
// loads its CUDA libraries lazily).
//
// Search order, that of any dlopen from libtrun_worker: LD_LIBRARY_PATH, then libtrun_worker's
// RUNPATH (the CUDA library directory found at build time), then the ld.so cache.
// TRUN_CUDART_LIBRARY and TRUN_NCCL_LIBRARY name the file to load instead (a path, or another
// soname), read once, at first use.
//
// Thread safety: each library is loaded once, by the first call from any thread; the others
// wait for it. A failure is remembered, not retried: every later call reports it the same way.
// The libraries stay loaded for the life of the process.
//
// The types and constants still come from the real headers, and each pointer has the type of
// the function the headers declare, so a signature cannot drift from them.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

// Exactly the functions libtrun_worker calls: a new call needs its name here. Names pass
// through the headers' macros (under CUDA_API_PER_THREAD_DEFAULT_STREAM, cudaMemcpyAsync is
// cudaMemcpyAsync_ptsz), so the symbol looked up is the one the headers declare. OVERLOADED
// names a function the C++ headers overload, with the signature of its C function (cuda_runtime.h,
// which nccl.h includes, adds a template cudaMalloc): the cast to it compiles only if the headers
// declare that signature.
#define TRUN_CUDART_FUNCTIONS(X, OVERLOADED)              \
  X(cudaEventCreateWithFlags)                             \
  X(cudaEventDestroy)                                     \
  X(cudaEventQuery)                                       \
  X(cudaEventRecord)                                      \
  X(cudaFree)                                             \
  X(cudaGetDeviceCount)                                   \
  X(cudaGetErrorName)                                     \
  X(cudaGetErrorString)                                   \
  X(cudaGetLastError)                                     \
  OVERLOADED(cudaMalloc, cudaError_t (*)(void**, size_t)) \
  X(cudaMemcpyAsync)                                      \
  X(cudaMemsetAsync)                                      \
  X(cudaSetDevice)                                        \
  X(cudaStreamCreateWithFlags)                            \
  X(cudaStreamDestroy)                                    \
  X(cudaStreamSynchronize)                                \
  X(cudaStreamWaitEvent)

#define TRUN_NCCL_FUNCTIONS(X, OVERLOADED) \
  X(ncclAllGather)                         \
  X(ncclAllReduce)                         \
  X(ncclBroadcast)                         \
  X(ncclCommAbort)                         \
  X(ncclCommDestroy)                       \
  X(ncclCommFinalize)                      \
  X(ncclCommGetAsyncError)                 \
  X(ncclCommInitRankConfig)                \
  X(ncclGetErrorString)                    \
  X(ncclGetLastError)                      \
  X(ncclGetUniqueId)                       \
  X(ncclGetVersion)                        \
  X(ncclGroupEnd)                          \
  X(ncclGroupStart)                        \
  X(ncclRecv)                              \
  X(ncclReduce)                            \
  X(ncclReduceScatter)                     \
  X(ncclSend)

namespace trun::worker::detail {

#define TRUN_GPU_FUNCTION_POINTER(name) decltype(&::name) name = nullptr;
#define TRUN_GPU_OVERLOADED_POINTER(name, type) decltype(static_cast<type>(&::name)) name = nullptr;
struct CudaRuntimeApi {
  TRUN_CUDART_FUNCTIONS(TRUN_GPU_FUNCTION_POINTER, TRUN_GPU_OVERLOADED_POINTER)
};
struct NcclApi {
  TRUN_NCCL_FUNCTIONS(TRUN_GPU_FUNCTION_POINTER, TRUN_GPU_OVERLOADED_POINTER)
};
#undef TRUN_GPU_FUNCTION_POINTER
#undef TRUN_GPU_OVERLOADED_POINTER

// The loaded library, loading it on the first call. Throws CollectiveError when it cannot be
// loaded or lacks a function: the message names the library, gives dlerror()'s text and says
// how to fix it (install it, or set LD_LIBRARY_PATH or the override variable).
const CudaRuntimeApi& cudart();
const NcclApi& nccl();

// Whether the library can be loaded, loading it if it is not yet; otherwise false and `why` (if
// not null) gets the message cudart() or nccl() would throw. Never throws.
bool cudart_loadable(std::string* why);
bool nccl_loadable(std::string* why);

}  // namespace trun::worker::detail
