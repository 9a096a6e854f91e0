#include "worker_sdk/src/ddp/host_staging.h"

#include <memory>

#include "worker_sdk/src/ddp/device_memory.h"

namespace trun::worker::detail {

namespace {

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) : p(device_alloc(bytes)) {}
  ~DeviceBuffer() { device_free(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* p;
};

}  // namespace

void broadcast_host(ProcessGroup& group, void* data, size_t count, DataType dtype, int root,
                    std::chrono::milliseconds timeout, void* stream) {
  if (group.backend() != Backend::kNccl) {
    group.broadcast(data, count, dtype, root, timeout);
    return;
  }
  const size_t bytes = count * dtype_size(dtype);
  DeviceBuffer dev(bytes);
  copy_host_to_device(dev.p, data, bytes, stream);
  group.broadcast(dev.p, count, dtype, root, timeout);
  copy_device_to_host(data, dev.p, bytes, stream);
}

void allgather_host(ProcessGroup& group, const void* send, void* recv, size_t count, DataType dtype,
                    std::chrono::milliseconds timeout, void* stream) {
  if (group.backend() != Backend::kNccl) {
    group.allgather(send, recv, count, dtype, timeout);
    return;
  }
  const size_t bytes = count * dtype_size(dtype);
  const size_t total = bytes * static_cast<size_t>(group.size());
  DeviceBuffer dev_send(bytes), dev_recv(total);
  copy_host_to_device(dev_send.p, send, bytes, stream);
  group.allgather(dev_send.p, dev_recv.p, count, dtype, timeout);
  copy_device_to_host(recv, dev_recv.p, total, stream);
}

}  // namespace trun::worker::detail
