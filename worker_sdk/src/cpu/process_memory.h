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

// Copies `bytes` at src to address `remote` of process `pid` (process_vm_writev); "" or why not.
std::string write_process_memory(int pid, const std::string& who, const void* src, uint64_t remote,
                                 size_t bytes);

// One message copied by both processes of a point-to-point transfer on one node at once: the
// receiver reads chunks out of the sender's buffer (read_process_memory) while the sender,
// which would otherwise wait, writes other chunks into the receiver's buffer
// (write_process_memory); each claims the next chunk from `next`, so a side that is not
// scheduled (or busy with its other transfers) leaves its share to the other. Lives in shared
// memory (ShmComm::copy_channel), owned by the sender: it resets one before announcing a
// message and reuses it only once the receiver has said it is done. Chunk 0 is always the
// receiver's: its read proves that cross-memory reads work before it asks for help.
struct alignas(64) CopyChannel {
  std::atomic<uint64_t> next{0};  // next chunk to claim; >= kClosed: closed by the receiver
  std::atomic<uint64_t> done{0};  // chunks copied
  std::atomic<int64_t> redo{-1};  // a chunk the sender claimed but could not write, or -1
};
constexpr size_t kCopyChunkBytes = 1u << 20;
constexpr size_t kSharedCopyMinBytes = 4u << 20;  // smaller messages: the receiver alone
inline uint64_t copy_chunks(size_t bytes) {
  return (bytes + kCopyChunkBytes - 1) / kCopyChunkBytes;
}
void reset_channel(CopyChannel& c);

// The receiver's side, after it claimed and read chunk 0 and asked the sender for help: claims
// and reads chunks until none is left, then waits until the sender's are written (copying a
// chunk the sender could not write itself). `check` runs every few milliseconds while it waits
// and throws to stop (a dead sender, an abort); the deadline throws CollectiveTimeoutError.
// Returns "" or why a read failed. On any failure it first closes the channel and waits
// (briefly, bounded) until the sender's chunk in flight is written, so that nothing writes
// into dst after it returns or throws.
std::string receive_chunks(CopyChannel& c, int pid, const std::string& who, char* dst,
                           uint64_t remote, size_t bytes, Deadline deadline,
                           const std::function<void()>& check);
// The sender's share, writing into the receiver's buffer at `remote` until no chunk is left.
// A chunk it cannot write goes to `redo` (the receiver copies it) and ends its share; returns
// why, else "".
std::string push_chunks(CopyChannel& c, int pid, const std::string& who, const char* src,
                        uint64_t remote, size_t bytes);

}  // namespace trun::worker::detail
