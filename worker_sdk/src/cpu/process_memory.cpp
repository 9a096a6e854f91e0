#include "worker_sdk/src/cpu/process_memory.h"

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "worker_sdk/src/reduce.h"

namespace trun::worker::detail {
namespace {

// One process_vm_readv/writev per pass; a short copy continues where it stopped.
std::string copy_direct(bool write, int pid, const std::string& who, char* local_addr,
                        uint64_t remote, size_t bytes) {
  size_t done = 0;
  for (int tries = 0; done < bytes && tries < 1024; ++tries) {
    iovec local{local_addr + done, bytes - done};
    iovec far{reinterpret_cast<void*>(static_cast<uintptr_t>(remote + done)), bytes - done};
    ssize_t n = write ? ::process_vm_writev(pid, &local, 1, &far, 1, 0)
                      : ::process_vm_readv(pid, &local, 1, &far, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::string(write ? "process_vm_writev to " : "process_vm_readv from ") + who +
             " (pid " + std::to_string(pid) + "): " + std::strerror(errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  if (done < bytes)
    return std::string(write ? "process_vm_writev to " : "process_vm_readv from ") + who +
           ": short copy";
  return "";
}

constexpr size_t kBounceBytes = 256u << 10;  // fits in L2 with room for the source's lines

}  // namespace

std::string read_process_memory(int pid, const std::string& who, void* dst, uint64_t remote,
                                size_t bytes) {
  char* out = static_cast<char*>(dst);
  if (bytes < kStreamMinBytes) return copy_direct(false, pid, who, out, remote, bytes);
  // One per thread: collectives run on one thread at a time, but different process groups may
  // run on different threads.
  thread_local std::vector<char> storage;
  if (storage.empty()) storage.resize(kBounceBytes + 64);
  char* bounce = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  for (size_t off = 0; off < bytes; off += kBounceBytes) {
    const size_t m = std::min(kBounceBytes, bytes - off);
    if (std::string why = copy_direct(false, pid, who, bounce, remote + off, m); !why.empty())
      return why;
    stream_bytes(out + off, bounce, m);
  }
  return "";
}

std::string write_process_memory(int pid, const std::string& who, const void* src, uint64_t remote,
                                 size_t bytes) {
  return copy_direct(true, pid, who, const_cast<char*>(static_cast<const char*>(src)), remote,
                     bytes);
}

void reset_channel(CopyChannel& c) {
  c.next.store(0, std::memory_order_relaxed);
  c.done.store(0, std::memory_order_relaxed);
  c.redo.store(-1, std::memory_order_release);
}

namespace {
constexpr uint64_t kClosed = uint64_t{1} << 62;

size_t chunk_len(uint64_t k, size_t bytes) {
  return std::min(kCopyChunkBytes, bytes - static_cast<size_t>(k) * kCopyChunkBytes);
}

// Spin, then yield the core (the process waited for may be queued on it), then sleep 50 us.
void pause_for(long pass) {
  if (pass < 200) return;
  if (pass < 2000) {
    ::sched_yield();
    return;
  }
  timespec ts{0, 50000};
  ::nanosleep(&ts, nullptr);
}

// A process that exited is dead here even before its parent reaps it (a pidfd is readable
// from its exit on; kill(pid, 0) succeeds on a zombie).
bool alive(int pid) {
#ifdef SYS_pidfd_open
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    const bool exited = ::poll(&p, 1, 0) > 0;
    ::close(fd);
    return !exited;
  }
  if (errno == ESRCH) return false;
#endif
  return ::kill(pid, 0) == 0 || errno != ESRCH;
}

// Closes the channel and waits until every chunk the sender claimed is written or handed back
// (`lost`: chunks the receiver claimed and did not copy). Bounded: 2 s, or the sender's death.
void close_and_drain(CopyChannel& c, int pid, uint64_t total, uint64_t lost) {
  const uint64_t claimed = std::min(c.next.exchange(kClosed), total);
  const auto until = Clock::now() + std::chrono::seconds(2);
  for (long pass = 0;; ++pass) {
    const uint64_t settled = c.done.load(std::memory_order_acquire) + lost +
                             (c.redo.load(std::memory_order_acquire) >= 0 ? 1 : 0);
    if (settled >= claimed) return;
    if (pass % 256 == 255 && (Clock::now() >= until || !alive(pid))) return;
    pause_for(pass);
  }
}
}  // namespace

std::string receive_chunks(CopyChannel& c, int pid, const std::string& who, char* dst,
                           uint64_t remote, size_t bytes, Deadline deadline,
                           const std::function<void()>& check) {
  const uint64_t total = copy_chunks(bytes);
  auto copy = [&](uint64_t k) {
    const size_t off = static_cast<size_t>(k) * kCopyChunkBytes;
    return read_process_memory(pid, who, dst + off, remote + off, chunk_len(k, bytes));
  };
  std::string why;
  try {
    for (uint64_t k; why.empty() && (k = c.next.fetch_add(1)) < total;) {
      why = copy(k);
      if (why.empty()) c.done.fetch_add(1, std::memory_order_release);
    }
    auto last_check = Clock::now();
    for (long pass = 0; why.empty() && c.done.load(std::memory_order_acquire) < total; ++pass) {
      if (int64_t k = c.redo.exchange(-1); k >= 0) {
        why = copy(static_cast<uint64_t>(k));
        if (why.empty()) c.done.fetch_add(1, std::memory_order_release);
        continue;
      }
      if (pass < 200) continue;
      auto now = Clock::now();
      if (now >= deadline)
        throw CollectiveTimeoutError("timed out waiting for " + who + " to write its share");
      if (now - last_check >= std::chrono::milliseconds(5)) {
        last_check = now;
        if (!alive(pid)) throw CollectiveError(who + " exited while writing its share");
        check();
      }
      pause_for(pass);
    }
  } catch (...) {
    close_and_drain(c, pid, total, 0);
    throw;
  }
  if (!why.empty()) close_and_drain(c, pid, total, 1);
  return why;
}

std::string push_chunks(CopyChannel& c, int pid, const std::string& who, const char* src,
                        uint64_t remote, size_t bytes) {
  const uint64_t total = copy_chunks(bytes);
  for (uint64_t k; (k = c.next.fetch_add(1)) < total;) {
    const size_t off = static_cast<size_t>(k) * kCopyChunkBytes;
    if (std::string why =
            write_process_memory(pid, who, src + off, remote + off, chunk_len(k, bytes));
        !why.empty()) {
      c.redo.store(static_cast<int64_t>(k), std::memory_order_release);
      return why;
    }
    c.done.fetch_add(1, std::memory_order_release);
  }
  return "";
}

}  // namespace trun::worker::detail
