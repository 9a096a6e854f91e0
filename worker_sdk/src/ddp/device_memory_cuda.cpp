// The only DDP file that sees the CUDA runtime (the rest of the reducer is device-agnostic). It
// calls the runtime through the table loaded on first use (nccl/gpu_libs.h), as the NCCL backend
// does.

#include <string>

#include "trun/ddp.h"
#include "worker_sdk/src/ddp/device_memory.h"
#include "worker_sdk/src/nccl/gpu_libs.h"

namespace trun::worker::detail {

namespace {
// The CUDA runtime, or DdpError saying why it cannot be loaded (the error of this module).
const CudaRuntimeApi& runtime() {
  std::string why;
  if (!cudart_loadable(&why)) throw DdpError("DDP: CUDA buffers: " + why);
  return cudart();
}
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw DdpError(std::string("DDP: ") + what + ": " + runtime().cudaGetErrorName(err) + ": " +
                   runtime().cudaGetErrorString(err));
}
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
}  // namespace

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  check(runtime().cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc");
  return p;
}

// `p` came from device_alloc, so the runtime is loaded and cudart() cannot throw.
void device_free(void* p) noexcept {
  if (p) cudart().cudaFree(p);
}

void device_zero(void* p, size_t bytes, void* stream) {
  check(runtime().cudaMemsetAsync(p, 0, bytes, as_stream(stream)), "cudaMemsetAsync");
}

void device_copy(void* dst, const void* src, size_t bytes, void* stream) {
  check(runtime().cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)),
        "cudaMemcpyAsync");
  check(runtime().cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void copy_host_to_device(void* dst, const void* src, size_t bytes, void* stream) {
  check(runtime().cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(stream)),
        "cudaMemcpyAsync");
  check(runtime().cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void copy_device_to_host(void* dst, const void* src, size_t bytes, void* stream) {
  check(runtime().cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream)),
        "cudaMemcpyAsync");
  check(runtime().cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void device_sync(void* stream) {
  check(runtime().cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

}  // namespace trun::worker::detail
