#include "worker_sdk/src/cpu/shm_comm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>
#include <thread>

#include "worker_sdk/src/reduce.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TRUN_CPU_RELAX() _mm_pause()
#else
#define TRUN_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace trun::worker::detail {

namespace {
constexpr uint64_t kMagic = 0x74727e6e73686d31ull;  // "trun shm 1"
constexpr size_t kPage = 4096;
constexpr size_t kDefaultSlotBytes = 4u << 20;
constexpr size_t kMaxSegmentData = 32u << 20;
constexpr size_t kLine = 64;
}  // namespace

struct alignas(64) ShmRankState {
  std::atomic<uint32_t> arrived{0};
  std::atomic<int32_t> pid{0};
  std::atomic<uint64_t> pid_ns{0};  // inode of /proc/self/ns/pid: pids compare only within one
};

struct ShmHeader {
  uint64_t magic;
  uint32_t local_size;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> mapped;
  alignas(64) std::atomic<uint32_t> wake;
  std::atomic<uint32_t> waiters;
  alignas(64) std::atomic<int32_t> abort_owner;  // -1: not aborted; else local rank
  std::atomic<uint32_t> aborted;                 // set after abort_reason is written
  char abort_reason[512];
  ShmRankState ranks[ShmComm::kMaxLocalSize];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");

namespace {

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    out.push_back(ok ? c : '_');
    if (out.size() >= 120) break;
  }
  return out;
}

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

int pidfd_open(int pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

// Default slot: 4 MiB (fewer rounds, so fewer barriers: each costs futex sleeps and wake-ups on
// a busy machine; measured best of 1/4/8 MiB for 2 and 4 ranks), at most 32 MiB per segment.
size_t default_slot_bytes(int local_size) {
  return std::clamp<size_t>(kMaxSegmentData / static_cast<size_t>(local_size), 256u << 10,
                            kDefaultSlotBytes);
}

uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

size_t slot_bytes_from_env(size_t requested, int local_size) {
  if (requested) return requested;
  if (const char* v = std::getenv("TRUN_SHM_SLOT_BYTES")) {
    char* end = nullptr;
    unsigned long long x = std::strtoull(v, &end, 10);
    if (end && *end == '\0' && x >= 4096 && x <= (1ull << 30)) return x;
    throw std::invalid_argument(
        std::string("TRUN_SHM_SLOT_BYTES: expected bytes in [4096, 2^30], got '") + v + "'");
  }
  return default_slot_bytes(local_size);
}

}  // namespace

ShmComm::ShmComm(const ShmOptions& o, Deadline deadline) : me_(o.local_rank), n_(o.local_size) {
  if (n_ < 1 || n_ > kMaxLocalSize || me_ < 0 || me_ >= n_)
    throw std::invalid_argument("ShmComm: local rank " + std::to_string(me_) + " of " +
                                std::to_string(n_) + " out of range");
  slot_bytes_ = slot_bytes_from_env(o.slot_bytes, n_);
  // Each slot holds n_ cache-line aligned slices.
  slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(n_) * kLine);
  slot_bytes_ = (slot_bytes_ + kPage - 1) / kPage * kPage;
  const size_t header_bytes = (sizeof(ShmHeader) + kPage - 1) / kPage * kPage;
  map_bytes_ = header_bytes + slot_bytes_ * static_cast<size_t>(n_);

  int fd = -1;
  if (me_ == 0) {
    std::random_device rd;
    char nonce[17];
    std::snprintf(nonce, sizeof nonce, "%08x%08x", rd(), rd());
    name_ = "/trun-" + sanitize(o.tag) + "-" + nonce;
    fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw CollectiveError(errno_text(("shm_open(" + name_ + ")").c_str()));
    if (::ftruncate(fd, static_cast<off_t>(map_bytes_)) != 0) {
      std::string err = errno_text("ftruncate");
      ::close(fd);
      ::shm_unlink(name_.c_str());
      throw CollectiveError("shared memory segment " + name_ + ": " + err);
    }
  } else {
    std::string key = "shm_name";
    o.store->wait({key}, remaining(deadline));
    name_ = o.store->get(key);
    fd = ::shm_open(name_.c_str(), O_RDWR, 0600);
    if (fd < 0)
      throw CollectiveError(
          errno_text(("local rank " + std::to_string(me_) + ": shm_open(" + name_ + ")").c_str()));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != map_bytes_) {
      ::close(fd);
      throw CollectiveError("shared memory segment " + name_ + " has size " +
                            std::to_string(st.st_size) + ", expected " +
                            std::to_string(map_bytes_) + " (mismatched slot size?)");
    }
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_errno = errno;
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    if (me_ == 0) ::shm_unlink(name_.c_str());
    errno = map_errno;
    throw CollectiveError(errno_text(("mmap(" + name_ + ")").c_str()));
  }
  hdr_ = static_cast<ShmHeader*>(map_);
  data_ = static_cast<char*>(map_) + header_bytes;

  if (me_ == 0) {
    // ftruncate zero-filled the segment; placement-new the atomics for form's sake.
    new (hdr_) ShmHeader();
    hdr_->local_size = static_cast<uint32_t>(n_);
    hdr_->slot_bytes = slot_bytes_;
    hdr_->abort_owner.store(-1);
    hdr_->magic = kMagic;
    std::atomic_thread_fence(std::memory_order_release);
    try {
      o.store->set("shm_name", name_);
    } catch (...) {
      ::shm_unlink(name_.c_str());
      ::munmap(map_, map_bytes_);
      map_ = nullptr;
      throw;
    }
  } else {
    std::atomic_thread_fence(std::memory_order_acquire);
    if (hdr_->magic != kMagic || hdr_->local_size != static_cast<uint32_t>(n_) ||
        hdr_->slot_bytes != slot_bytes_) {
      ::munmap(map_, map_bytes_);
      map_ = nullptr;
      throw CollectiveError("shared memory segment " + name_ +
                            " does not match this group (local size or slot size differ)");
    }
  }
  hdr_->ranks[me_].pid.store(static_cast<int32_t>(::getpid()));
  hdr_->ranks[me_].pid_ns.store(pid_namespace());
  // The last rank to map the segment removes its name: from here on nothing in /dev/shm
  // refers to it, and the memory goes away with the last process, however it exits.
  if (hdr_->mapped.fetch_add(1) + 1 == static_cast<uint32_t>(n_)) ::shm_unlink(name_.c_str());

  unsigned cpus = std::thread::hardware_concurrency();
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  // Spin only briefly before sleeping on the futex: on a busy or oversubscribed machine a
  // spinning rank steals the core its peer needs.
  spin_limit_ = (cpus >= static_cast<unsigned>(n_)) ? 1000 : 64;
  if (const char* v = std::getenv("TRUN_SHM_SPIN")) spin_limit_ = std::atoi(v);  // tuning

  // Everyone mapped (and wrote its pid): wait with the usual barrier machinery.
  try {
    arrive_and_wait(deadline, "shared memory setup");
  } catch (...) {
    ::shm_unlink(name_.c_str());  // in case a peer never mapped it
    throw;
  }
  pidfds_.assign(n_, -1);
  pids_.assign(n_, 0);
  const uint64_t my_ns = pid_namespace();
  for (int r = 0; r < n_; ++r) {
    pids_[r] = hdr_->ranks[r].pid.load();
    // A peer in another pid namespace (containers sharing /dev/shm) has a pid that means
    // nothing here: watch only the deadline and the abort flag for it.
    if (r == me_ || my_ns == 0 || hdr_->ranks[r].pid_ns.load() != my_ns) {
      if (r != me_) pids_[r] = 0;
      continue;
    }
    pidfds_[r] = pidfd_open(pids_[r]);
  }
}

ShmComm::~ShmComm() {
  for (int fd : pidfds_)
    if (fd >= 0) ::close(fd);
  if (map_) ::munmap(map_, map_bytes_);
}

void ShmComm::set_abort(const std::string& reason) {
  int32_t expected = -1;
  if (hdr_->abort_owner.compare_exchange_strong(expected, me_)) {
    std::snprintf(hdr_->abort_reason, sizeof hdr_->abort_reason, "%s", reason.c_str());
    hdr_->aborted.store(1, std::memory_order_release);
  }
  hdr_->wake.fetch_add(1);
  futex(&hdr_->wake, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmComm::abort(const std::string& reason) {
  if (hdr_) set_abort("local rank " + std::to_string(me_) + " aborted: " + reason);
}

void ShmComm::fail_aborted(const char* what) {
  throw CollectiveError(std::string(what) + " failed on local rank " + std::to_string(me_) +
                        " (shared memory " + name_ + "): " + hdr_->abort_reason);
}

void ShmComm::check_peers_alive(const char* what) {
  for (int r = 0; r < n_; ++r) {
    if (r == me_) continue;
    bool dead = false;
    if (pidfds_.empty()) break;  // still in setup
    if (pidfds_[r] >= 0) {
      pollfd p{pidfds_[r], POLLIN, 0};
      dead = ::poll(&p, 1, 0) > 0;
    } else if (pids_[r] > 0) {
      dead = ::kill(pids_[r], 0) != 0 && errno == ESRCH;
    }
    if (dead) {
      std::string reason = "local rank " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) +
                           ") exited during " + what;
      set_abort(reason);
      fail_aborted(what);
    }
  }
}

void ShmComm::wait_for_all(uint32_t target, Deadline deadline, const char* what) {
  int spins = 0;
  int next = 0;  // first rank not yet known to have arrived
  auto last_check = Clock::now();
  for (;;) {
    while (next < n_ &&
           static_cast<int32_t>(hdr_->ranks[next].arrived.load(std::memory_order_acquire) -
                                target) >= 0)
      ++next;
    if (next == n_) return;
    if (hdr_->aborted.load(std::memory_order_acquire)) fail_aborted(what);
    if (spins < spin_limit_) {
      ++spins;
      TRUN_CPU_RELAX();
      continue;
    }
    auto now = Clock::now();
    if (now >= deadline) {
      std::string reason = "local rank " + std::to_string(me_) + " timed out in " + what +
                           " waiting for local rank " + std::to_string(next) +
                           (pids_.empty() ? "" : " (pid " + std::to_string(pids_[next]) + ")");
      set_abort(reason);
      throw CollectiveTimeoutError(std::string(what) + " timed out on local rank " +
                                   std::to_string(me_) + ": " + reason);
    }
    if (now - last_check >= std::chrono::milliseconds(20)) {
      last_check = now;
      check_peers_alive(what);
    }
    hdr_->waiters.fetch_add(1);
    uint32_t w = hdr_->wake.load();
    bool ready = static_cast<int32_t>(hdr_->ranks[next].arrived.load() - target) >= 0 ||
                 hdr_->aborted.load();
    if (!ready) {
      auto left = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(20));
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      futex(&hdr_->wake, FUTEX_WAIT, w, &ts);
    }
    hdr_->waiters.fetch_sub(1);
  }
}

void ShmComm::arrive_and_wait(Deadline deadline, const char* what) {
  ++seq_;
  hdr_->ranks[me_].arrived.store(seq_);  // seq_cst: ordered before the waiters load below
  if (hdr_->waiters.load() > 0) {
    hdr_->wake.fetch_add(1);
    futex(&hdr_->wake, FUTEX_WAKE, INT_MAX, nullptr);
  }
  wait_for_all(seq_, deadline, what);
}

void ShmComm::barrier(Deadline deadline) { arrive_and_wait(deadline, "barrier"); }

void ShmComm::allreduce(void* data, size_t count, DataType dtype, ReduceOp op, Deadline deadline) {
  if (n_ == 1 || count == 0) return;
  const size_t es = dtype_size(dtype);
  char* buf = static_cast<char*>(data);
  // Slices are whole cache lines so that two ranks never write the same line.
  const size_t line_elems = std::max<size_t>(1, kLine / es);
  const size_t slice_cap = (slot_bytes_ / n_) / kLine * kLine / es;
  const size_t round_cap = slice_cap * n_;
  // Slice j of every slot sits at a fixed offset: a short last round must not move a slice
  // onto bytes a peer may still be copying out of the previous round.
  const size_t slice_bytes = slice_cap * es;
  for (size_t off = 0; off < count; off += round_cap) {
    const size_t m = std::min(round_cap, count - off);
    size_t per = (m + n_ - 1) / n_;
    per = std::min(slice_cap, (per + line_elems - 1) / line_elems * line_elems);
    auto slice_len = [&](int j) -> size_t {
      size_t b = static_cast<size_t>(j) * per;
      return b >= m ? 0 : std::min(per, m - b);
    };
    char* mine = slot(me_);
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      std::memcpy(mine + j * slice_bytes, buf + (off + j * per) * es, slice_len(j) * es);
    }
    arrive_and_wait(deadline, "allreduce");
    const size_t len = slice_len(me_);
    if (len) {
      char* dst = buf + (off + me_ * per) * es;
      for (int j = 0; j < n_; ++j) {
        if (j == me_) continue;
        reduce3(dst, dst, slot(j) + me_ * slice_bytes, len, dtype, op);
      }
      std::memcpy(mine + me_ * slice_bytes, dst, len * es);
    }
    arrive_and_wait(deadline, "allreduce");
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      std::memcpy(buf + (off + j * per) * es, slot(j) + j * slice_bytes, slice_len(j) * es);
    }
  }
  // Nobody may reuse the slots until every rank copied its results out.
  arrive_and_wait(deadline, "allreduce");
}

void ShmComm::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  if (n_ == 1 || bytes == 0) return;
  char* buf = static_cast<char*>(data);
  const size_t cap = slot_bytes_ * n_;
  for (size_t off = 0; off < bytes; off += cap) {
    const size_t m = std::min(cap, bytes - off);
    if (me_ == root) std::memcpy(data_, buf + off, m);
    arrive_and_wait(deadline, "broadcast");
    if (me_ != root) std::memcpy(buf + off, data_, m);
    arrive_and_wait(deadline, "broadcast");
  }
}

void ShmComm::allgather(const void* send, void* recv, size_t bytes, Deadline deadline) {
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (n_ == 1 || bytes == 0) {
    if (bytes) std::memcpy(out, in, bytes);
    return;
  }
  for (size_t off = 0; off < bytes; off += slot_bytes_) {
    const size_t m = std::min(slot_bytes_, bytes - off);
    std::memcpy(slot(me_), in + off, m);
    arrive_and_wait(deadline, "allgather");
    for (int j = 0; j < n_; ++j) std::memcpy(out + j * bytes + off, slot(j), m);
    arrive_and_wait(deadline, "allgather");
  }
}

void ShmComm::reduce_scatter(const void* send, void* recv, size_t count, DataType dtype,
                             ReduceOp op, Deadline deadline) {
  const size_t es = dtype_size(dtype);
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (count == 0) return;
  if (n_ == 1) {
    std::memcpy(out, in, count * es);
    return;
  }
  const size_t sub_bytes = (slot_bytes_ / n_) / kLine * kLine;
  const size_t sub = sub_bytes / es;
  for (size_t off = 0; off < count; off += sub) {
    const size_t m = std::min(sub, count - off);
    for (int d = 0; d < n_; ++d) {
      if (d == me_) continue;
      std::memcpy(slot(me_) + d * sub_bytes, in + (d * count + off) * es, m * es);
    }
    arrive_and_wait(deadline, "reduce_scatter");
    const char* own = in + (me_ * count + off) * es;
    char* dst = out + off * es;
    bool first = true;
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      reduce3(dst, first ? own : dst, slot(j) + me_ * sub_bytes, m, dtype, op);
      first = false;
    }
    arrive_and_wait(deadline, "reduce_scatter");
  }
}

}  // namespace trun::worker::detail
