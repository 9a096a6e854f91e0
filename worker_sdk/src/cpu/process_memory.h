#pragma once
// Reading another process's memory (cross-memory attach, process_vm_readv): how the CPU
// backend moves data between the ranks of a node without staging it in shared memory. Needs
// the same permission as ptrace (same user and no Yama/seccomp policy against it); the caller
// falls back to another path when it is refused.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "worker_sdk/src/backend.h"

namespace trun::worker::detail {

// Copies `bytes` at address `remote` of process `pid` to dst. Returns "" or why not (errno text
// naming `who`, e.g. "local rank 1"); on failure dst may be partly written. Large reads go
// through a cache-sized bounce buffer and are written to dst with non-temporal stores
// (stream_bytes): the kernel's copy writes through the cache, reading each destination line
// first, and reading into the bounce buffer keeps that extra traffic in the cache.
std::string read_process_memory(int pid, const std::string& who, void* dst, uint64_t remote,
                                size_t bytes);

// Point-to-point messages between the ranks of one node, entirely through shared memory: no
// message over TCP, whose wake-ups cost this kind of VM milliseconds now and then (a 64 MiB
// message takes 4 ms to copy). The sender announces a message in one of its CopyChannels (size,
// address, tag, receiver) and copies it in chunks into the channel's ring of slots, which stay
// in the cache; the receiver finds the announcement and copies the chunks out into its buffer
// with non-temporal stores: two user-space copies, pipelined on two cores. When the ring stays
// empty (a sender busy elsewhere or not scheduled) and direct reads are allowed, the receiver
// claims chunks itself and reads them straight from the sender's memory (read_process_memory;
// the kernel's copy costs about three times the CPU per byte of one user-space copy here), and
// it reads small messages that way at once. A message whose data lies in the sender's shared
// buffer area (ProcessGroup::shared_buffer) is not copied by the sender at all: the receiver
// copies it straight out of the area, one copy per byte. Each side claims the next chunk from
// `next`. Owned by the sender, which resets one before announcing a message in it and reuses it
// once the receiver has marked it done.
constexpr size_t kCopyChunkBytes = 256u << 10;
constexpr int kRingSlots = 8;
constexpr size_t kSharedCopyMinBytes = 4u << 20;  // smaller messages: the receiver reads them
struct alignas(64) CopyChannel {
  // The announcement, one word so that a receiver reads it whole: state (bits 0-1: free,
  // posted by the sender, taken by the receiver, failed: the sender gave up), the receiver's
  // local rank (bits 2-11), the sender's count of announcements (bits 12-31: the order of two
  // with the same receiver and tag) and the tag (bits 32-63). bytes and addr are written
  // before the release of "posted".
  std::atomic<uint64_t> post{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> addr{0};     // of the data, in the sender's address space
  std::atomic<uint64_t> refused{0};  // 1 + the receiver's size when the sizes differ
  std::atomic<uint64_t> shared{0};   // 1 + the data's offset in the sender's shared buffer area
  alignas(64) std::atomic<uint64_t> next{0};  // next chunk to claim; >= kClosed: closed
  // 1 once the receiver has every chunk: the message is over and the channel free again.
  alignas(64) std::atomic<uint64_t> done{0};
  struct alignas(64) Slot {
    std::atomic<uint64_t> full{0};  // 0: empty; else 1 + the index of the chunk in it
  };
  Slot slots[kRingSlots];
  alignas(64) char ring[kRingSlots][kCopyChunkBytes];
};

// One message of local_p2p, with the local rank `peer`.
struct LocalTransfer {
  bool send = true;
  void* data = nullptr;
  size_t bytes = 0;
  uint32_t tag = 0;
  int peer = 0;
  // The sender's channels: ours for a send, the peer's for a receive.
  CopyChannel* channels = nullptr;
  int channel_count = 0;
  int peer_pid = 0;       // to notice a peer that died; 0: unknown (another pid namespace)
  bool may_read = false;  // a receive may read the sender's memory (process_vm_readv)
  // A send: 1 + the data's offset in this rank's shared buffer area, 0 when not there.
  uint64_t shared = 0;
  // A receive: the sender's shared buffer area as mapped here (nullptr: none).
  const char* peer_area = nullptr;
  std::string peer_name;  // e.g. "rank 3"
  std::string name;       // for errors, e.g. "send on rank 2: send to rank 3"
};

// Runs every transfer to completion, all at once (a rank's sends and receives progress
// together, so a ring or a pairwise exchange cannot wait in a cycle), bounded by `deadline`.
// `me` is this rank's local rank. Messages between two ranks with the same tag match in
// posting order; a receive whose size differs from the message fails on both sides with
// CollectiveError naming both sizes. Every few milliseconds while it waits: `check` (throws to
// stop, e.g. on abort), the deadline (CollectiveTimeoutError) and the peers' lives (a peer that
// exited: CollectiveError). A direct read that is refused (EPERM under a seccomp or ptrace
// policy) sets `direct_read_failed`, and the ring alone carries the data from then on. On
// failure the receives close their channels and the sends mark theirs failed, so that the
// peers fail at once too.
void local_p2p(std::vector<LocalTransfer>& transfers, int me, Deadline deadline,
               const std::function<void()>& check, bool& direct_read_failed);

}  // namespace trun::worker::detail
