#pragma once
// Reading another process's memory (cross-memory attach, process_vm_readv): how the CPU
// backend moves data between the ranks of a node without staging it in shared memory. Needs
// the same permission as ptrace (same user and no Yama/seccomp policy against it); the caller
// falls back to another path when it is refused.

#include <cstddef>
#include <cstdint>
#include <string>

namespace trun::worker::detail {

// Copies `bytes` at address `remote` of process `pid` to dst. Returns "" or why not (errno text
// naming `who`, e.g. "local rank 1"); on failure dst may be partly written. Large reads go
// through a cache-sized bounce buffer and are written to dst with non-temporal stores
// (stream_bytes): the kernel's copy writes through the cache, reading each destination line
// first, and reading into the bounce buffer keeps that extra traffic in the cache.
std::string read_process_memory(int pid, const std::string& who, void* dst, uint64_t remote,
                                size_t bytes);

}  // namespace trun::worker::detail
