#pragma once
// What each ProcessGroup collective runs, validated (private to libtrun_worker): a Call names
// the collective with its arguments (for errors) and binds them to the backend. Shared by the
// blocking and the asynchronous forms. Each *_call throws std::invalid_argument for a bad
// argument (null buffer, unknown dtype or op, root or peer out of range, overlapping send and
// receive buffers, counts that do not match the group) before anything is queued.

#include <functional>
#include <string>
#include <vector>

#include "trun/process_group.h"
#include "worker_sdk/src/backend.h"

namespace trun::worker::detail {

struct Call {
  std::string what;
  std::function<void(Deadline)> run;
};

Call allreduce_call(BackendImpl* b, void* data, size_t count, DataType dtype, ReduceOp op);
Call broadcast_call(BackendImpl* b, int world, void* data, size_t count, DataType dtype, int root);
Call allgather_call(BackendImpl* b, int world, const void* send, void* recv, size_t count,
                    DataType dtype);
Call reduce_scatter_call(BackendImpl* b, int world, const void* send, void* recv, size_t count,
                         DataType dtype, ReduceOp op);
Call barrier_call(BackendImpl* b);
Call reduce_call(BackendImpl* b, int world, void* data, size_t count, DataType dtype, ReduceOp op,
                 int root);
Call gather_call(BackendImpl* b, int rank, int world, const void* send, void* recv, size_t count,
                 DataType dtype, int root);
Call scatter_call(BackendImpl* b, int rank, int world, const void* send, void* recv, size_t count,
                  DataType dtype, int root);
// `name`: "all_to_all" or "all_to_all_v", for errors.
Call all_to_all_v_call(BackendImpl* b, int world, const void* send, std::vector<size_t> send_counts,
                       void* recv, std::vector<size_t> recv_counts, DataType dtype,
                       const char* name);
// `name`: "send", "recv" or "batch_isend_irecv", for errors.
Call p2p_call(BackendImpl* b, int rank, int world, std::vector<P2POp> ops, const char* name);

}  // namespace trun::worker::detail
