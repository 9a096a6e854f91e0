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

#include "worker_sdk/src/backend.h"

namespace trun::worker::detail {

// Copies `bytes` at address `remote` of process `pid` to dst. Returns "" or why not (errno text
// naming `who`, e.g. "local rank 1"); on failure dst may be partly written. Large reads go
// through a cache-sized bounce buffer and are written to dst with non-temporal stores
// (stream_bytes): the kernel's copy writes through the cache, reading each destination line
// first, and reading into the bounce buffer keeps that extra traffic in the cache.
std::string read_process_memory(int pid, const std::string& who, void* dst, uint64_t remote,
                                size_t bytes);

// One message copied by both processes of a point-to-point transfer on one node at once,
// pipelined: the sender, which would otherwise wait, copies chunks of its buffer into a ring
// of slots in shared memory that stay in the cache, and the receiver copies them out into its
// buffer with non-temporal stores (two user-space copies on two cores; the kernel's copy of
// process_vm_readv costs about three times the CPU per byte of one of them here). Whenever the
// ring is empty the receiver claims a chunk itself and reads it straight from the sender's
// memory (read_process_memory), so it never waits for a sender that is busy elsewhere (a ring
// exchange, say): it waits only for chunks the sender has claimed. Each side claims the next
// chunk from `next`. Lives in shared memory (ShmComm::copy_channel), owned by the sender: it
// resets one before announcing a message and reuses it once the receiver has said it is done.
// Chunk 0 is always the receiver's: its read proves that cross-memory reads work before it
// asks for help.
constexpr size_t kCopyChunkBytes = 256u << 10;
constexpr int kRingSlots = 8;
constexpr size_t kSharedCopyMinBytes = 4u << 20;  // smaller messages: the receiver alone
struct alignas(64) CopyChannel {
  std::atomic<uint64_t> next{0};  // next chunk to claim; >= kClosed: closed by the receiver
  // 1 once the receiver has every chunk (mark_done): the message is over and the channel free.
  alignas(64) std::atomic<uint64_t> done{0};
  struct alignas(64) Slot {
    std::atomic<uint64_t> full{0};  // 0: empty; else 1 + the index of the chunk in it
  };
  Slot slots[kRingSlots];
  alignas(64) char ring[kRingSlots][kCopyChunkBytes];
};
inline uint64_t copy_chunks(size_t bytes) {
  return (bytes + kCopyChunkBytes - 1) / kCopyChunkBytes;
}
void reset_channel(CopyChannel& c);

// The receiver's side, after it claimed and read chunk 0 and asked the sender for help: copies
// out what the sender puts in the ring and reads the chunks it claims itself, until every
// chunk is in dst. `check` runs every few milliseconds while it waits and throws to stop (an
// abort); a sender that died and the deadline (CollectiveTimeoutError) stop it too. Returns ""
// or why a read failed. On any failure it closes the channel (the sender stops); the sender
// never writes into dst.
std::string receive_chunks(CopyChannel& c, int pid, const std::string& who, char* dst,
                           uint64_t remote, size_t bytes, Deadline deadline,
                           const std::function<void()>& check);
// The sender's share: claims chunks and copies them into the ring until none is left or the
// receiver closed the channel. Waits for free slots, bounded by the deadline and the
// receiver's life (pid); "" or why it stopped early.
std::string push_chunks(CopyChannel& c, int pid, const std::string& who, const char* src,
                        size_t bytes, Deadline deadline);
// The end of a shared copy, through the channel instead of a message over TCP (whose wake-ups
// cost this VM a few milliseconds now and then): the receiver marks it done once every chunk
// is in its buffer, and the sender waits for that before its buffer is its caller's again.
// wait_done throws CollectiveError when the receiver closed the channel instead (it failed),
// or died, and CollectiveTimeoutError at the deadline; `check` as for receive_chunks.
void mark_done(CopyChannel& c);
void wait_done(CopyChannel& c, int pid, const std::string& who, Deadline deadline,
               const std::function<void()>& check);

}  // namespace trun::worker::detail
