#pragma once
// Device memory for the DDP reducer's CUDA buckets (private to libtrun_worker). Compiled against
// the CUDA runtime when the NCCL backend is built (device_memory_cuda.cpp), otherwise every call
// throws (device_memory_none.cpp). Errors: DdpError with the CUDA error string.

#include <cstddef>

namespace trun::worker::detail {

void* device_alloc(size_t bytes);
void device_free(void* p) noexcept;
// Ordered on `stream` (a cudaStream_t; nullptr: the legacy default stream).
void device_zero(void* p, size_t bytes, void* stream);
// Copies between device buffers on `stream` and waits for it.
void device_copy(void* dst, const void* src, size_t bytes, void* stream);
// Copies between host and device memory on `stream` and waits for it.
void copy_host_to_device(void* dst, const void* src, size_t bytes, void* stream);
void copy_device_to_host(void* dst, const void* src, size_t bytes, void* stream);
// Blocks until every operation queued on `stream` so far has finished.
void device_sync(void* stream);

}  // namespace trun::worker::detail
