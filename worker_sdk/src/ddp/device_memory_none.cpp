#include "worker_sdk/src/ddp/device_memory.h"

#include "trun/ddp.h"

namespace trun::worker::detail {

namespace {
[[noreturn]] void unavailable() {
  throw DdpError("DDP: CUDA parameters need a libtrun_worker built with CUDA and NCCL");
}
}  // namespace

void* device_alloc(size_t) { unavailable(); }
void device_free(void*) noexcept {}
void device_zero(void*, size_t, void*) { unavailable(); }
void device_copy(void*, const void*, size_t, void*) { unavailable(); }
void copy_host_to_device(void*, const void*, size_t, void*) { unavailable(); }
void copy_device_to_host(void*, const void*, size_t, void*) { unavailable(); }
void device_sync(void*) { unavailable(); }

}  // namespace trun::worker::detail
