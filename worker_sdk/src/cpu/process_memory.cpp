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

void reset_channel(CopyChannel& c) {
  for (auto& slot : c.slots) slot.full.store(0, std::memory_order_relaxed);
  c.done.store(0, std::memory_order_relaxed);
  c.next.store(0, std::memory_order_release);
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

// Calls `ready` until it returns true, pausing between calls; every 5 ms checks the deadline
// (throws CollectiveTimeoutError with `what`), that `pid` lives (throws CollectiveError) and
// runs `check`.
template <typename Ready>
void wait_until(Ready&& ready, int pid, const std::string& what, Deadline deadline,
                const std::function<void()>& check) {
  auto last_check = Clock::now();
  for (long pass = 0; !ready(); ++pass) {
    if (pass < 200) continue;
    auto now = Clock::now();
    if (now - last_check >= std::chrono::milliseconds(5)) {
      last_check = now;
      if (now >= deadline) throw CollectiveTimeoutError("timed out " + what);
      if (!alive(pid)) throw CollectiveError("the peer exited while " + what);
      if (check) check();
    }
    pause_for(pass);
  }
}
}  // namespace

std::string receive_chunks(CopyChannel& c, int pid, const std::string& who, char* dst,
                           uint64_t remote, size_t bytes, Deadline deadline,
                           const std::function<void()>& check) {
  const uint64_t total = copy_chunks(bytes);
  uint64_t done = 1;  // chunk 0, read by the caller
  uint64_t seq = 0;   // the next ring slot to copy out, in the sender's order
  std::string why;
  try {
    while (done < total) {
      CopyChannel::Slot& slot = c.slots[seq % kRingSlots];
      if (uint64_t full = slot.full.load(std::memory_order_acquire); full) {
        const uint64_t k = full - 1;
        stream_bytes(dst + k * kCopyChunkBytes, c.ring[seq % kRingSlots], chunk_len(k, bytes));
        slot.full.store(0, std::memory_order_release);
        ++seq;
        ++done;
        continue;
      }
      if (uint64_t k = c.next.fetch_add(1); k < total) {
        const size_t off = static_cast<size_t>(k) * kCopyChunkBytes;
        why = read_process_memory(pid, who, dst + off, remote + off, chunk_len(k, bytes));
        if (!why.empty()) break;
        ++done;
        continue;
      }
      // Every chunk is claimed: wait for the sender's next one.
      wait_until([&] { return slot.full.load(std::memory_order_acquire) != 0; }, pid,
                 "waiting for " + who + " to copy its share", deadline, check);
    }
  } catch (...) {
    c.next.store(kClosed);
    throw;
  }
  if (!why.empty()) c.next.store(kClosed);
  return why;
}

std::string push_chunks(CopyChannel& c, int pid, const std::string& who, const char* src,
                        size_t bytes, Deadline deadline) {
  const uint64_t total = copy_chunks(bytes);
  uint64_t seq = 0;
  try {
    for (uint64_t k; (k = c.next.fetch_add(1)) < total; ++seq) {
      CopyChannel::Slot& slot = c.slots[seq % kRingSlots];
      bool closed = false;
      wait_until(
          [&] {
            closed = c.next.load(std::memory_order_relaxed) >= kClosed;
            return closed || slot.full.load(std::memory_order_acquire) == 0;
          },
          pid, "waiting for " + who + " to empty a slot", deadline, nullptr);
      if (closed) return "";
      copy_bytes(c.ring[seq % kRingSlots], src + k * kCopyChunkBytes, chunk_len(k, bytes));
      slot.full.store(k + 1, std::memory_order_release);
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void mark_done(CopyChannel& c) { c.done.store(1, std::memory_order_release); }

void wait_done(CopyChannel& c, int pid, const std::string& who, Deadline deadline,
               const std::function<void()>& check) {
  bool closed = false;
  wait_until(
      [&] {
        if (c.done.load(std::memory_order_acquire)) return true;
        closed = c.next.load(std::memory_order_acquire) >= kClosed;
        return closed;
      },
      pid, "waiting for " + who + " to finish copying", deadline, check);
  if (closed && !c.done.load(std::memory_order_acquire))
    throw CollectiveError(who + " stopped copying the message (its receive failed)");
}

}  // namespace trun::worker::detail
