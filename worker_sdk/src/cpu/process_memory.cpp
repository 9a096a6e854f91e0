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

namespace {
constexpr uint64_t kClosed = uint64_t{1} << 62;
enum : uint64_t { kFree = 0, kPosted = 1, kTaken = 2, kFailed = 3 };
uint64_t state_of(uint64_t post) { return post & 3; }
uint64_t to_of(uint64_t post) { return (post >> 2) & 0x3ff; }
uint64_t order_of(uint64_t post) { return (post >> 12) & 0xfffff; }
uint64_t tag_of(uint64_t post) { return post >> 32; }
uint64_t with_state(uint64_t post, uint64_t state) { return (post & ~uint64_t{3}) | state; }
// Whether announcement order a came before b (20-bit counters: at most a few are posted at once).
bool before(uint64_t a, uint64_t b) { return ((b - a) & 0xfffff) < 0x80000 && a != b; }
// A receive whose ring stayed empty this long reads chunks itself (when it may).
constexpr auto kRingPatience = std::chrono::microseconds(200);

uint64_t copy_chunks(size_t bytes) { return (bytes + kCopyChunkBytes - 1) / kCopyChunkBytes; }

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

std::atomic<uint64_t> g_announcements{0};  // this process's, for their order

struct Progress {
  LocalTransfer* t = nullptr;
  CopyChannel* c = nullptr;  // once announced (send) or found (receive)
  uint64_t total = 0;        // chunks
  uint64_t ring = 0;         // the next ring slot, in the sender's order
  uint64_t got = 0;          // receive: chunks in the buffer
  uint64_t remote = 0;       // receive: the sender's address
  bool pushed_all = false;   // send: no chunk left to claim
  Clock::time_point last;    // receive: when the ring last had a chunk
  bool done = false;
};

// The sender: announces the message once a channel of its own is free, then fills free ring
// slots. True when anything moved.
bool step_send(Progress& p) {
  LocalTransfer& t = *p.t;
  bool moved = false;
  if (!p.c) {
    for (int k = 0; k < t.channel_count && !p.c; ++k) {
      CopyChannel& c = t.channels[k];
      // Ours: only we make it free (below) or posted.
      if (c.post.load(std::memory_order_acquire) != kFree) continue;
      for (auto& slot : c.slots) slot.full.store(0, std::memory_order_relaxed);
      c.done.store(0, std::memory_order_relaxed);
      c.next.store(0, std::memory_order_relaxed);
      c.refused.store(0, std::memory_order_relaxed);
      c.shared.store(t.shared, std::memory_order_relaxed);
      c.bytes.store(t.bytes, std::memory_order_relaxed);
      c.addr.store(reinterpret_cast<uintptr_t>(t.data), std::memory_order_relaxed);
      const uint64_t order = ++g_announcements & 0xfffff;
      c.post.store(kPosted | static_cast<uint64_t>(t.peer) << 2 | order << 12 |
                       static_cast<uint64_t>(t.tag) << 32,
                   std::memory_order_release);
      p.c = &c;
      p.total = copy_chunks(t.bytes);
      p.pushed_all = p.total == 0 || t.shared;  // shared: the receiver copies it all
      moved = true;
    }
    if (!p.c) return false;
  }
  CopyChannel& c = *p.c;
  const char* src = static_cast<const char*>(t.data);
  for (int i = 0; i < kRingSlots && !p.pushed_all; ++i) {
    CopyChannel::Slot& slot = c.slots[p.ring % kRingSlots];
    if (slot.full.load(std::memory_order_acquire)) break;  // the receiver has not emptied it
    const uint64_t k = c.next.fetch_add(1);
    if (k >= p.total) {  // every chunk is claimed, or the receiver closed the channel
      p.pushed_all = true;
      break;
    }
    // Streamed (non-temporal) into the ring for large messages: the receiver reads the chunk
    // on another core, and from memory that beats the line-by-line transfer out of this core's
    // cache here (64 MiB send/recv on 2 cores, alternating runs: 2 ranks 22-27 GB/s against 7-8
    // in 8 pairs; 4 ranks 9.4-11.4 against 4.2-10.2 in 6).
    copy_or_stream(t.bytes >= kStreamMinBytes, c.ring[p.ring % kRingSlots],
                   src + k * kCopyChunkBytes, chunk_len(k, t.bytes));
    slot.full.store(k + 1, std::memory_order_release);
    ++p.ring;
    moved = true;
  }
  if (c.done.load(std::memory_order_acquire)) {
    c.post.store(kFree, std::memory_order_release);
    p.done = true;
    return true;
  }
  if (c.next.load(std::memory_order_acquire) >= kClosed) {
    const uint64_t refused = c.refused.load(std::memory_order_acquire);
    c.post.store(kFree, std::memory_order_release);
    p.c = nullptr;
    if (refused)
      throw CollectiveError(t.name + " failed: this send has " + std::to_string(t.bytes) +
                            " bytes, the receive expects " + std::to_string(refused - 1));
    throw CollectiveError(t.name + " failed: the receiver stopped copying the message (its " +
                          "receive failed)");
  }
  return moved;
}

// The receiver: finds the announcement (the earliest of those for it with its tag), then
// empties ring slots, and reads chunks itself when it may and the ring stayed empty.
bool step_recv(Progress& p, int me, bool& direct_read_failed) {
  LocalTransfer& t = *p.t;
  bool moved = false;
  if (!p.c) {
    CopyChannel* best = nullptr;
    uint64_t best_post = 0;
    for (int k = 0; k < t.channel_count; ++k) {
      CopyChannel& c = t.channels[k];
      const uint64_t post = c.post.load(std::memory_order_acquire);
      if (state_of(post) != kPosted || to_of(post) != static_cast<uint64_t>(me) ||
          tag_of(post) != t.tag || (best && !before(order_of(post), order_of(best_post))))
        continue;
      best = &c;
      best_post = post;
    }
    if (!best) return false;
    CopyChannel& c = *best;
    // Announcements for us stay posted until we take them, unless the sender gave up.
    if (!c.post.compare_exchange_strong(best_post, with_state(best_post, kTaken),
                                        std::memory_order_acq_rel))
      return false;
    p.c = &c;
    const uint64_t bytes = c.bytes.load(std::memory_order_relaxed);
    p.remote = c.addr.load(std::memory_order_relaxed);
    if (bytes != t.bytes) {
      c.refused.store(1 + t.bytes, std::memory_order_relaxed);
      c.next.store(kClosed, std::memory_order_release);
      p.c = nullptr;
      throw CollectiveError(t.name + " failed: the sender sent " + std::to_string(bytes) +
                            " bytes, this receive expects " + std::to_string(t.bytes));
    }
    if (const uint64_t shared = c.shared.load(std::memory_order_relaxed)) {
      // In the sender's shared buffer area: ours to copy, all of it (the sender copies none).
      if (!t.peer_area) {
        c.next.store(kClosed, std::memory_order_release);
        p.c = nullptr;
        throw CollectiveError(t.name + " failed: the message is in the sender's shared buffer " +
                              "area, which this rank has not mapped");
      }
      copy_or_stream(t.bytes >= kStreamMinBytes, t.data, t.peer_area + (shared - 1), t.bytes);
      c.done.store(1, std::memory_order_release);
      p.done = true;
      return true;
    }
    p.total = copy_chunks(t.bytes);
    p.last = Clock::now();
    if (t.bytes && t.may_read && !direct_read_failed) {
      // A read that is refused must not cost a claimed chunk (the sender would never copy it):
      // try a small one first, once per message, before the sender's copy leaves none to read.
      char probe[64];
      const std::string why = read_process_memory(t.peer_pid, t.peer_name, probe, p.remote,
                                                  std::min(sizeof probe, t.bytes));
      if (!why.empty()) {
        direct_read_failed = true;
        std::fprintf(stderr,
                     "[trun.worker] %s: %s; the sender copies the data through shared memory "
                     "from now on\n",
                     t.name.c_str(), why.c_str());
      }
    }
    moved = true;
  }
  CopyChannel& c = *p.c;
  char* dst = static_cast<char*>(t.data);
  for (int i = 0; i < kRingSlots && p.got < p.total; ++i) {
    CopyChannel::Slot& slot = c.slots[p.ring % kRingSlots];
    if (const uint64_t full = slot.full.load(std::memory_order_acquire)) {
      const uint64_t k = full - 1;
      stream_bytes(dst + k * kCopyChunkBytes, c.ring[p.ring % kRingSlots], chunk_len(k, t.bytes));
      slot.full.store(0, std::memory_order_release);
      ++p.ring;
      ++p.got;
      p.last = Clock::now();
      moved = true;
      continue;
    }
    if (!t.may_read || direct_read_failed ||
        (t.bytes >= kSharedCopyMinBytes && Clock::now() - p.last < kRingPatience))
      break;
    const uint64_t k = c.next.fetch_add(1);
    if (k >= p.total) break;  // the sender claimed the rest
    const size_t off = static_cast<size_t>(k) * kCopyChunkBytes;
    if (std::string why = read_process_memory(t.peer_pid, t.peer_name, dst + off, p.remote + off,
                                              chunk_len(k, t.bytes));
        !why.empty())
      throw CollectiveError(t.name + " failed: " + why);
    ++p.got;
    moved = true;
  }
  if (p.got == p.total) {
    c.done.store(1, std::memory_order_release);  // the channel is the sender's again
    p.done = true;
    return true;
  }
  if (state_of(c.post.load(std::memory_order_acquire)) == kFailed)
    throw CollectiveError(t.name + " failed: the sender gave up on the message");
  return moved;
}
}  // namespace

void local_p2p(std::vector<LocalTransfer>& transfers, int me, Deadline deadline,
               const std::function<void()>& check, bool& direct_read_failed) {
  std::vector<Progress> progress(transfers.size());
  for (size_t i = 0; i < transfers.size(); ++i) progress[i].t = &transfers[i];
  size_t left = transfers.size();
  auto last_check = Clock::now();
  try {
    for (long idle = 0; left > 0;) {
      bool moved = false;
      for (Progress& p : progress) {
        if (p.done) continue;
        moved = (p.t->send ? step_send(p) : step_recv(p, me, direct_read_failed)) || moved;
        if (p.done) --left;
      }
      idle = moved ? 0 : idle + 1;
      if (moved) continue;
      const auto now = Clock::now();
      if (now - last_check >= std::chrono::milliseconds(5)) {
        last_check = now;
        for (Progress& p : progress) {
          if (p.done) continue;
          const char* waiting = p.t->send ? "waiting for the receiver"
                                : p.c     ? "while it copied the message"
                                          : "waiting for the message";
          if (now >= deadline)
            throw CollectiveTimeoutError(p.t->name + " timed out " + std::string(waiting));
          if (p.t->peer_pid > 0 && !alive(p.t->peer_pid))
            throw CollectiveError(p.t->name + " failed: the peer exited " + std::string(waiting));
        }
        if (check) check();
      }
      pause_for(idle);
    }
  } catch (...) {
    for (Progress& p : progress) {
      if (p.done || !p.c) continue;
      if (p.t->send)
        p.c->post.store(with_state(p.c->post.load(), kFailed), std::memory_order_release);
      else
        p.c->next.store(kClosed, std::memory_order_release);
    }
    throw;
  }
}

}  // namespace trun::worker::detail
