// The sizes of ShmComm's segment: defaults, environment overrides and the resulting layout.

#include "worker_sdk/src/cpu/shm_layout.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "base/decimal.h"

namespace trun::worker::detail {

namespace {

constexpr size_t kMaxSlotBytes = 2u << 20;
constexpr size_t kSegmentDataBytes = 4u << 20;
// all_to_all's staging area (default_a2a_bytes): at most this much per rank and in all.
constexpr size_t kMaxA2aBytes = 16u << 20;
constexpr size_t kA2aSegmentBytes = 64u << 20;
// The shared buffer areas (default_buffer_bytes): at most this much per rank and in all.
constexpr size_t kMaxBufferBytes = size_t{1} << 30;
constexpr size_t kBufferSegmentBytes = size_t{8} << 30;

// Default slot: the whole segment's data about 4 MiB (2 MiB slots for 2 ranks, 1 MiB for 4),
// so that a round stays in the last-level cache while the ranks copy it in, reduce it and copy
// it out. Measured with 64 MiB allreduces on 2 cores (4 ranks): 1 MiB slots beat 2 and 4 MiB
// ones; 4 MiB slots (the earlier default) were the worst.
size_t default_slot_bytes(int local_size) {
  return std::clamp<size_t>(kSegmentDataBytes / static_cast<size_t>(local_size), 256u << 10,
                            kMaxSlotBytes);
}

// Default staging area of all_to_all per rank: clamp(64 MiB / local ranks, 0, 16 MiB), 0 (the
// slots instead) where its sub-slots would be under kStagedMinSubBytes anyway (more than 16
// local ranks) or for a segment named in /dev/shm, which is often small in a container (a page
// touched past its size is a SIGBUS). Measured with 64 MiB all_to_alls on 2 cores: 4 ranks, 1.5x
// the rounds through 1 MiB slots (fewer rounds, so fewer barriers between 2 ranks per core);
// 2 ranks, 1.1-1.2x. Its pages are touched only by all_to_alls large enough to reach them.
size_t default_a2a_bytes(int local_size, bool named) {
  const size_t per_rank =
      std::min(kA2aSegmentBytes / static_cast<size_t>(local_size), kMaxA2aBytes);
  if (named || per_rank / 2 / static_cast<size_t>(local_size) < kStagedMinSubBytes) return 0;
  return per_rank;
}

// Default shared buffer area per rank: min(1 GiB, 8 GiB / local ranks), 0 for a segment named in
// /dev/shm (often small in a container). Address space only, until buffers use it.
size_t default_buffer_bytes(int local_size, bool named) {
  if (named) return 0;
  return std::min(kBufferSegmentBytes / static_cast<size_t>(local_size), kMaxBufferBytes) /
         kShmPage * kShmPage;
}

// TRUN_SHM_SLOT_BYTES, TRUN_SHM_A2A_BYTES or TRUN_SHM_BUFFER_BYTES: bytes in
// [lowest, 2^highest_log2], else nullopt when unset.
std::optional<size_t> bytes_from_env(const char* name, size_t lowest, int highest_log2 = 30) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  // strtoull's syntax as before (leading whitespace, a '+'), but never a '-'.
  unsigned long long x = 0;
  if (base::parse_decimal(v, &x, base::DecimalSyntax{true, true}) && x >= lowest &&
      x <= (1ull << highest_log2))
    return x;
  throw std::invalid_argument(std::string(name) + ": expected bytes in [" + std::to_string(lowest) +
                              ", 2^" + std::to_string(highest_log2) + "], got '" + v + "'");
}

}  // namespace

ShmSizeRequest ShmSizeRequest::from(size_t option_slot_bytes, int local_size) {
  ShmSizeRequest r;
  r.slot_bytes =
      option_slot_bytes
          ? option_slot_bytes
          : bytes_from_env("TRUN_SHM_SLOT_BYTES", 4096).value_or(default_slot_bytes(local_size));
  // Each slot holds local_size cache-line aligned slices in each half (all_to_all_v).
  r.slot_bytes =
      shm_page_up(std::max(r.slot_bytes, 2 * static_cast<size_t>(local_size) * kShmLine));
  r.a2a_bytes = bytes_from_env("TRUN_SHM_A2A_BYTES", 0);
  r.buf_bytes = bytes_from_env("TRUN_SHM_BUFFER_BYTES", 0, 40);
  return r;
}

ShmLayout ShmSizeRequest::layout(int local_size, bool named) const {
  const size_t n = static_cast<size_t>(local_size);
  ShmLayout l;
  l.local_size = local_size;
  l.header_bytes = shm_page_up(sizeof(ShmHeader));
  l.channel_bytes = shm_page_up(sizeof(CopyChannel) * ShmComm::kCopyChannels * n);
  l.slot_bytes = slot_bytes;
  l.a2a_bytes = a2a_bytes ? *a2a_bytes : default_a2a_bytes(local_size, named);
  if (l.a2a_bytes) l.a2a_bytes = shm_page_up(std::max(l.a2a_bytes, 2 * n * kShmLine));
  l.buf_bytes = shm_page_up(buf_bytes ? *buf_bytes : default_buffer_bytes(local_size, named));
  l.map_bytes = l.header_bytes + l.channel_bytes + (l.slot_bytes + l.a2a_bytes + l.buf_bytes) * n;
  return l;
}

}  // namespace trun::worker::detail
