#include "worker_sdk/src/cpu/process_memory.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "worker_sdk/src/reduce.h"

namespace trun::worker::detail {
namespace {

// One process_vm_readv per pass; a short read continues where it stopped.
std::string read_direct(int pid, const std::string& who, char* dst, uint64_t remote, size_t bytes) {
  size_t done = 0;
  for (int tries = 0; done < bytes && tries < 1024; ++tries) {
    iovec local{dst + done, bytes - done};
    iovec far{reinterpret_cast<void*>(static_cast<uintptr_t>(remote + done)), bytes - done};
    ssize_t n = ::process_vm_readv(pid, &local, 1, &far, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return "process_vm_readv from " + who + " (pid " + std::to_string(pid) +
             "): " + std::strerror(errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  if (done < bytes) return "process_vm_readv from " + who + ": short read";
  return "";
}

constexpr size_t kBounceBytes = 256u << 10;  // fits in L2 with room for the source's lines

}  // namespace

std::string read_process_memory(int pid, const std::string& who, void* dst, uint64_t remote,
                                size_t bytes) {
  char* out = static_cast<char*>(dst);
  if (bytes < kStreamMinBytes) return read_direct(pid, who, out, remote, bytes);
  // One per thread: collectives run on one thread at a time, but different process groups may
  // run on different threads.
  thread_local std::vector<char> storage;
  if (storage.empty()) storage.resize(kBounceBytes + 64);
  char* bounce = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  for (size_t off = 0; off < bytes; off += kBounceBytes) {
    const size_t m = std::min(kBounceBytes, bytes - off);
    if (std::string why = read_direct(pid, who, bounce, remote + off, m); !why.empty()) return why;
    stream_bytes(out + off, bounce, m);
  }
  return "";
}

}  // namespace trun::worker::detail
