// The only DDP file that sees the CUDA runtime (the rest of the reducer is device-agnostic).
#include <cuda_runtime.h>

#include <string>

#include "trun/ddp.h"
#include "worker_sdk/src/ddp/device_memory.h"

namespace trun::worker::detail {

namespace {
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw DdpError(std::string("DDP: ") + what + ": " + cudaGetErrorName(err) + ": " +
                   cudaGetErrorString(err));
}
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
}  // namespace

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc");
  return p;
}

void device_free(void* p) noexcept {
  if (p) cudaFree(p);
}

void device_zero(void* p, size_t bytes, void* stream) {
  check(cudaMemsetAsync(p, 0, bytes, as_stream(stream)), "cudaMemsetAsync");
}

void device_copy(void* dst, const void* src, size_t bytes, void* stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void copy_host_to_device(void* dst, const void* src, size_t bytes, void* stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(stream)),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void copy_device_to_host(void* dst, const void* src, size_t bytes, void* stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream)),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void device_sync(void* stream) {
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

}  // namespace trun::worker::detail
