// Built instead of nccl_backend.cpp when CUDA or NCCL was not found at configure time.

#include "worker_sdk/src/backend.h"

namespace trun::worker {

bool nccl_available() { return false; }

namespace detail {
std::unique_ptr<BackendImpl> make_nccl_backend(const ProcessGroupOptions& options,
                                               Deadline deadline) {
  throw CollectiveError("rank " + std::to_string(options.rank) +
                        ": this libtrun_worker was built without NCCL (CUDA or NCCL not found "
                        "when it was configured)");
}
}  // namespace detail

}  // namespace trun::worker
