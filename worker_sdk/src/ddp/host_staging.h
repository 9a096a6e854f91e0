#pragma once
// Collectives on small host buffers for the DDP reducer's own bookkeeping (private to
// libtrun_worker): an NCCL group takes device buffers only, so on NCCL these stage the data
// through device copies (on `stream`, a cudaStream_t; nullptr: the legacy default stream); on any
// other group they run on the host buffers directly. Errors: the group's, and DdpError from the
// device copies.

#include <chrono>
#include <cstddef>

#include "trun/process_group.h"

namespace trun::worker::detail {

void broadcast_host(ProcessGroup& group, void* data, size_t count, DataType dtype, int root,
                    std::chrono::milliseconds timeout, void* stream);
// recv: count * group.size() elements.
void allgather_host(ProcessGroup& group, const void* send, void* recv, size_t count, DataType dtype,
                    std::chrono::milliseconds timeout, void* stream);

}  // namespace trun::worker::detail
