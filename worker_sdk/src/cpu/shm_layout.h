#pragma once
// The layout of ShmComm's shared-memory segment (private to the CPU backend): the header every
// rank maps, and the sizes of the parts after it, with their defaults and environment overrides.
//
//   header | copy channels | slots (n x slot_bytes) | all_to_all staging (n x a2a_bytes)
//          | shared buffer areas (n x buf_bytes, mapped apart)
//
// Local rank 0 writes the sizes into the header; every other rank computes them from the same
// options and environment and checks they agree (shm_comm.cpp).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "worker_sdk/src/cpu/shm_comm.h"

namespace trun::worker::detail {

constexpr uint64_t kShmMagic = 0x74727e6e73686d32ull;  // "trun shm 2"
constexpr size_t kShmPage = 4096;
constexpr size_t kShmLine = 64;
// all_to_all takes the staged rounds only when a round's sub-slot is at least this large (see
// ShmComm::all_to_all_v).
constexpr size_t kStagedMinSubBytes = 256u << 10;

struct alignas(64) ShmRankState {
  std::atomic<uint32_t> arrived{0};
  std::atomic<int32_t> pid{0};
  std::atomic<uint64_t> pid_ns{0};  // inode of /proc/self/ns/pid: pids compare only within one
  std::atomic<uint32_t> areas{0};   // 1: this rank mapped the shared buffer areas
  // The collective this rank entered last (ShmComm::publish_call), written before it arrives
  // at that collective's first barrier, after which every rank compares all ranks' (in the
  // cache line it polls `arrived` in: a few loads per collective).
  std::atomic<uint32_t> call_number{0};  // 1 for the first collective after setup
  std::atomic<uint32_t> call_shape{0};   // kind | dtype << 8 | op << 16 (0xff: not used)
  std::atomic<int32_t> call_root{-1};    // broadcast's root local rank, else -1
  std::atomic<uint64_t> call_size{0};    // elements (reductions) or bytes (the others)
};
static_assert(sizeof(ShmRankState) == 64, "a rank's state is one cache line");

struct ShmHeader {
  uint64_t magic;
  uint32_t local_size;
  uint64_t slot_bytes;
  uint64_t a2a_bytes;
  uint64_t buf_bytes;
  alignas(64) std::atomic<uint32_t> mapped;
  alignas(64) std::atomic<uint32_t> wake;
  std::atomic<uint32_t> waiters;
  alignas(64) std::atomic<int32_t> abort_owner;  // -1: not aborted; else local rank
  std::atomic<uint32_t> aborted;                 // set after abort_reason is written
  char abort_reason[512];
  ShmRankState ranks[ShmComm::kMaxLocalSize];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");

inline size_t shm_page_up(size_t bytes) { return (bytes + kShmPage - 1) / kShmPage * kShmPage; }

// The byte sizes of a segment's parts for `local_size` ranks (per rank where it says so).
struct ShmLayout {
  int local_size = 1;
  size_t header_bytes = 0;   // the ShmHeader, page-aligned
  size_t channel_bytes = 0;  // local_size * ShmComm::kCopyChannels CopyChannels, page-aligned
  size_t slot_bytes = 0;     // per rank
  size_t a2a_bytes = 0;      // per rank; 0: no staging area (the slots serve)
  size_t buf_bytes = 0;      // per rank; 0: no shared buffer areas
  size_t map_bytes = 0;      // the whole segment

  // The shared buffer areas, at the end of the segment.
  size_t areas_bytes() const { return buf_bytes * static_cast<size_t>(local_size); }
  // Where the slots start.
  size_t data_offset() const { return header_bytes + channel_bytes; }
};

// What the options and the environment ask for: read (std::invalid_argument for a malformed
// TRUN_SHM_SLOT_BYTES, TRUN_SHM_A2A_BYTES or TRUN_SHM_BUFFER_BYTES) before any segment exists.
struct ShmSizeRequest {
  size_t slot_bytes = 0;  // resolved and rounded up: at least 2 cache lines per rank, whole pages
  std::optional<size_t> a2a_bytes;
  std::optional<size_t> buf_bytes;

  static ShmSizeRequest from(size_t option_slot_bytes, int local_size);
  // The layout, once the segment's kind is known (named or not: local rank 0 decides).
  ShmLayout layout(int local_size, bool named) const;
};

}  // namespace trun::worker::detail
