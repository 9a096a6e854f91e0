// SharedArea: first fit over a shared buffer area's free ranges (shm_area.h).

#include "worker_sdk/src/cpu/shm_area.h"

#include <sys/mman.h>

#include <algorithm>
#include <iterator>
#include <utility>

namespace trun::worker::detail {

SharedArea::SharedArea(std::shared_ptr<void> mapping, char* base, size_t bytes)
    : mapping_(std::move(mapping)), base_(base), total_(bytes) {
  free_.emplace(0, bytes);
}

std::shared_ptr<SharedBuffer::Block> SharedArea::allocate(size_t bytes,
                                                          const std::shared_ptr<SharedArea>& self) {
  if (bytes > total_) return nullptr;  // (and the rounding below cannot overflow)
  const size_t len = whole_pages(bytes);
  size_t off = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(free_.begin(), free_.end(),
                           [&](const auto& range) { return range.second >= len; });
    if (it == free_.end()) return nullptr;
    off = it->first;
    const size_t rest = it->second - len;
    free_.erase(it);
    if (rest) free_.emplace(off + len, rest);
  }
  auto block = std::make_shared<SharedBuffer::Block>();
  block->data = base_ + off;
  block->size = bytes;
  block->shared = true;
  block->release = [self, off, len] { self->release(off, len); };
  return block;
}

void SharedArea::release(size_t off, size_t len) {
  ::madvise(base_ + off, len, MADV_REMOVE);
  std::lock_guard<std::mutex> lock(mu_);
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {  // merge with the range after
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // and with the one before
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_.emplace(off, len);
}

}  // namespace trun::worker::detail
