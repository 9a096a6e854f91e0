#pragma once
// What the GPU simulator's NCCL (nccl_sim.cpp) needs from its CUDA runtime (cudart_sim.cpp).
// Exported from the simulated libcudart.so.13 only; nothing outside tests/simgpu includes this.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>

namespace trun::simgpu {

// The calling thread's current device (cudaSetDevice).
int current_device();
// The machine's number for visible device `device` (CUDA_VISIBLE_DEVICES renumbers); -1 if none.
int physical_device(int device);
// The device whose stream `stream` is (nullptr and the special handles: the current device's
// legacy stream), or -1 for a handle that is not a live stream.
int stream_device(cudaStream_t stream);
// The device owning [p, p + bytes), or -1 when the range is not inside one live allocation.
int device_of_range(const void* p, size_t bytes);
// Queues `op` on `stream`, after everything queued there before; false for an unknown stream.
bool enqueue(cudaStream_t stream, std::function<void()> op);

}  // namespace trun::simgpu
