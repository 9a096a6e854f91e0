#pragma once
// What the NCCL backend can tell without a GPU (for tests and diagnostics). Private.

#include <string>

namespace trun::worker::detail {

// Number of CUDA devices; 0 with `why` set when none is usable (no driver, no device).
int cuda_device_count(std::string* why);
// "2.28.9"-style version of the NCCL library loaded at run time; throws CollectiveError.
std::string nccl_runtime_version();
// A fresh ncclUniqueId as raw bytes (NCCL_UNIQUE_ID_BYTES); throws CollectiveError.
std::string nccl_new_unique_id();
// Formats an NCCL error the way the backend reports it (tests check the format).
std::string nccl_error_for_test(int nccl_result);
std::string cuda_error_for_test(int cuda_error);

}  // namespace trun::worker::detail
