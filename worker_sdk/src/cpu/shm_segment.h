#pragma once
// Creating, opening and mapping ShmComm's shared-memory segment (private to the CPU backend).
//
// Local rank 0 creates it: an unnamed memfd, handed to its peers later (shm_handover.h), or with
// TRUN_SHM_NAMED=1 (or a kernel without memfd_create) "/<stem>-<random>" in /dev/shm. The other
// local ranks open what local rank 0 published under "shm_name" in the store: "@<address>
// <secret>" for a memfd, the name otherwise. What the segment holds is shm_layout.h's.
//
// Errors: CollectiveError (with errno text), std::invalid_argument for a malformed
// TRUN_SHM_NAMED. A failing call leaves nothing open, and nothing named in /dev/shm.

#include <memory>
#include <string>

#include "store/store.h"
#include "worker_sdk/src/backend.h"
#include "worker_sdk/src/cpu/shm_layout.h"

namespace trun::worker::detail {

struct ShmSegment {
  bool named = false;  // shared by name in /dev/shm (else an unnamed memfd)
  std::string name;    // "/<stem>-<random>", or "memfd:<stem>" for messages
  int fd = -1;         // open until the caller closes it
  ShmLayout layout;
  // After map_segment: the segment but the shared buffer areas, and those apart (nullptr when
  // the segment has none or they could not be mapped here). Each mapping goes with its last
  // holder.
  void* base = nullptr;
  std::shared_ptr<void> mapping;
  char* areas = nullptr;
  std::shared_ptr<void> areas_mapping;
};

// Local rank 0: a new segment of sizes.layout(...)'s size, zero-filled.
ShmSegment create_segment(const std::string& stem, const ShmSizeRequest& sizes, int local_size);

// Any other local rank: local rank 0's segment, once published in `store` (waits up to the
// deadline), checked to have the size this rank's options give.
ShmSegment open_segment(store::Store& store, int local_rank, const std::string& stem,
                        const ShmSizeRequest& sizes, int local_size, Deadline deadline);

// Maps `seg`. The shared buffer areas are mapped apart: they are large in address space, and a
// rank that cannot map them (RLIMIT_AS, say) still joins, without them (said on stderr). When
// the segment itself cannot be mapped, closes seg.fd (local rank 0 also unlinks a named one)
// and throws.
void map_segment(ShmSegment& seg, int local_rank);

}  // namespace trun::worker::detail
