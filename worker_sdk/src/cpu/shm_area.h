#pragma once
// SharedArea: the allocator of one rank's shared buffer area in ShmComm's segment (private to
// the CPU backend), from which ProcessGroup::shared_buffer takes its blocks. First fit over
// the free ranges, in whole pages. A freed range's pages go back to the system (MADV_REMOVE:
// the segment is shared memory), so the next block there is zero-filled again, as a fresh one
// is. Thread safety: any thread.

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

#include "worker_sdk/src/backend.h"

namespace trun::worker::detail {

class SharedArea {
 public:
  // [base, base + bytes) of the areas `mapping` keeps mapped.
  SharedArea(std::shared_ptr<void> mapping, char* base, size_t bytes);

  // A block of `bytes` (whole pages of the area), or nullptr when no free range is large
  // enough. The block holds `self` (this area), which keeps the mapping while it lives.
  std::shared_ptr<SharedBuffer::Block> allocate(size_t bytes,
                                                const std::shared_ptr<SharedArea>& self);

 private:
  void release(size_t off, size_t len);

  std::shared_ptr<void> mapping_;  // keeps the areas mapped while blocks live
  char* base_;
  size_t total_;
  std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> length
};

}  // namespace trun::worker::detail
