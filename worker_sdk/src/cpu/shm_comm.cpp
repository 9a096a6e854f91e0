#include "worker_sdk/src/cpu/shm_comm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "base/check.h"
#include "base/shm_names.h"
#include "store/auth.h"
#include "worker_sdk/src/cpu/process_memory.h"
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
constexpr size_t kMaxSlotBytes = 2u << 20;
constexpr size_t kSegmentDataBytes = 4u << 20;
constexpr size_t kLine = 64;
constexpr size_t kStagedMinSubBytes = 256u << 10;  // see all_to_all_v
// all_to_all's staging area (default_a2a_bytes): at most this much per rank and in all.
constexpr size_t kMaxA2aBytes = 16u << 20;
constexpr size_t kA2aSegmentBytes = 64u << 20;
// The shared buffer areas (default_buffer_bytes): at most this much per rank and in all.
constexpr size_t kMaxBufferBytes = size_t{1} << 30;
constexpr size_t kBufferSegmentBytes = size_t{8} << 30;
}  // namespace

struct alignas(64) ShmRankState {
  std::atomic<uint32_t> arrived{0};
  std::atomic<int32_t> pid{0};
  std::atomic<uint64_t> pid_ns{0};  // inode of /proc/self/ns/pid: pids compare only within one
  std::atomic<uint32_t> areas{0};   // 1: this rank mapped the shared buffer areas
};

struct ShmHeader {
  uint64_t magic;
  uint32_t local_size;
  uint64_t slot_bytes;
  uint64_t a2a_bytes;
  uint64_t buf_bytes;
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

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

std::string random_hex(int bytes) {
  std::random_device rd;
  std::string out;
  char b[3];
  for (int i = 0; i < bytes; ++i) {
    std::snprintf(b, sizeof b, "%02x", static_cast<unsigned>(rd() & 0xff));
    out += b;
  }
  return out;
}

// TRUN_SHM_NAMED=1: share segments by name in /dev/shm (as before memfds) instead of passing a
// memfd over an abstract Unix socket; needed only when the ranks of a node share /dev/shm but
// not a network namespace.
bool want_named_segment() {
  const char* v = std::getenv("TRUN_SHM_NAMED");
  if (!v || !*v || std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  throw std::invalid_argument(std::string("TRUN_SHM_NAMED: expected 0 or 1, got '") + v + "'");
}

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof a.sun_path - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] == 0: abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

void set_socket_timeout(int fd, Deadline deadline, std::chrono::milliseconds cap) {
  auto left = std::min<Clock::duration>(remaining(deadline), cap);
  auto us =
      std::max<int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(left).count(), 1000);
  timeval tv{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

constexpr size_t kSecretHex = 32;

// A one-byte message with room for one descriptor (SCM_RIGHTS). Not copyable: msg points into it.
struct FdMessage {
  explicit FdMessage(char b) : byte(b) {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
  char byte;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
};

// Local rank 0's side of the hand-over: a listening abstract socket; each peer connects, shows
// the secret it read from the store and gets the memfd. Peers must run as the same user (as a
// 0600 segment in /dev/shm would require). The socket goes away with the object or the process.
class FdServer {
 public:
  explicit FdServer(int backlog) : secret_(random_hex(kSecretHex / 2)) {
    address_ = "trun-shm-" + std::to_string(::getpid()) + "-" + random_hex(8);
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw CollectiveError(errno_text("shared memory hand-over: socket"));
    socklen_t len = 0;
    sockaddr_un a = abstract_address(address_, &len);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd_, backlog) != 0) {
      std::string err = errno_text(("shared memory hand-over: bind/listen @" + address_).c_str());
      ::close(fd_);
      throw CollectiveError(err);
    }
  }
  ~FdServer() { ::close(fd_); }
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

  const std::string& address() const { return address_; }
  const std::string& secret() const { return secret_; }

  // Hands `segment_fd` to `peers` connections that show the secret, or throws at the deadline.
  void serve(int segment_fd, int peers, Deadline deadline) {
    int served = 0;
    // Bounded by the deadline: each pass waits at most a second or serves one connection.
    while (served < peers) {
      if (Clock::now() >= deadline)
        throw CollectiveTimeoutError(
            "shared memory setup timed out on local rank 0: " + std::to_string(served) + " of " +
            std::to_string(peers) +
            " local ranks fetched the segment (a local rank exited early?)");
      pollfd p{fd_, POLLIN, 0};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(remaining(deadline));
      if (::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 1, 1000))) <= 0)
        continue;
      int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      if (hand_over(c, segment_fd, deadline)) ++served;
      ::close(c);
    }
  }

 private:
  bool hand_over(int c, int segment_fd, Deadline deadline) {
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::geteuid())
      return false;
    set_socket_timeout(c, deadline, std::chrono::seconds(5));
    char got[kSecretHex];
    if (::recv(c, got, sizeof got, MSG_WAITALL) != static_cast<ssize_t>(sizeof got) ||
        !store::auth::constant_time_equal(std::string_view(got, sizeof got), secret_))
      return false;
    FdMessage m('F');
    cmsghdr* cm = CMSG_FIRSTHDR(&m.msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &segment_fd, sizeof(int));
    return ::sendmsg(c, &m.msg, MSG_NOSIGNAL) == 1;
  }

  int fd_ = -1;
  std::string address_;
  std::string secret_;
};

// A peer's side: `published` is "<abstract address> <secret>" from the store.
int fetch_segment_fd(const std::string& published, int local_rank, Deadline deadline) {
  const std::string who = "local rank " + std::to_string(local_rank) + ": shared memory hand-over";
  size_t space = published.find(' ');
  if (space == std::string::npos || published.size() - space - 1 != kSecretHex)
    throw CollectiveError(who + ": malformed store entry 'shm_name'");
  const std::string address = published.substr(0, space);
  const std::string secret = published.substr(space + 1);
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) throw CollectiveError(errno_text((who + ": socket").c_str()));
  set_socket_timeout(s, deadline, std::chrono::hours(1));
  socklen_t len = 0;
  sockaddr_un a = abstract_address(address, &len);
  auto fail = [&](const std::string& what) {
    std::string err = errno_text((who + ": " + what).c_str());
    ::close(s);
    throw CollectiveError(err);
  };
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0)
    fail("connect to local rank 0 at @" + address +
         " (the ranks of a node must share a network namespace for this; TRUN_SHM_NAMED=1 "
         "shares the segment through /dev/shm instead)");
  if (::send(s, secret.data(), secret.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(secret.size()))
    fail("send");
  FdMessage m(0);
  ssize_t got = ::recvmsg(s, &m.msg, MSG_CMSG_CLOEXEC);
  cmsghdr* cm = got == 1 ? CMSG_FIRSTHDR(&m.msg) : nullptr;
  if (!cm || cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) {
    if (got >= 0) errno = EPROTO;
    fail("receive the segment from local rank 0");
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(cm), sizeof fd);
  ::close(s);
  return fd;
}

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

// Default slot: the whole segment's data about 4 MiB (2 MiB slots for 2 ranks, 1 MiB for 4),
// so that a round stays in the last-level cache while the ranks copy it in, reduce it and copy
// it out. Measured with 64 MiB allreduces on 2 cores (4 ranks): 1 MiB slots beat 2 and 4 MiB
// ones; 4 MiB slots (the earlier default) were the worst.
size_t default_slot_bytes(int local_size) {
  return std::clamp<size_t>(kSegmentDataBytes / static_cast<size_t>(local_size), 256u << 10,
                            kMaxSlotBytes);
}

uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Default staging area of all_to_all per rank: clamp(64 MiB / local ranks, 0, 16 MiB), 0 (the
// slots instead) where its sub-slots would be under kStagedMinSubBytes anyway (more than 16
// local ranks) or for a segment named in /dev/shm, which is often small in a container (a page
// touched past its size is a SIGBUS). Measured with 64 MiB all_to_alls on 2 cores: 4 ranks, 1.5x
// the rounds through 1 MiB slots (fewer rounds, so fewer barriers between 2 ranks per core);
// 2 ranks, 1.1-1.2x. Its pages are touched only by all_to_alls large enough to reach them.
size_t default_a2a_bytes(int local_size, bool named) {
  const size_t per_rank =
      std::min(kA2aSegmentBytes / static_cast<size_t>(local_size), kMaxA2aBytes);
  if (named || per_rank / 2 / static_cast<size_t>(local_size) < kStagedMinSubBytes) return 0;
  return per_rank;
}

// Default shared buffer area per rank: min(1 GiB, 8 GiB / local ranks), 0 for a segment named in
// /dev/shm (often small in a container). Address space only, until buffers use it.
size_t default_buffer_bytes(int local_size, bool named) {
  if (named) return 0;
  return std::min(kBufferSegmentBytes / static_cast<size_t>(local_size), kMaxBufferBytes) / kPage *
         kPage;
}

// TRUN_SHM_SLOT_BYTES, TRUN_SHM_A2A_BYTES or TRUN_SHM_BUFFER_BYTES: bytes in
// [lowest, 2^highest_log2], else nullopt when unset.
std::optional<size_t> bytes_from_env(const char* name, size_t lowest, int highest_log2 = 30) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v, &end, 10);
  if (*v && *v != '-' && end && *end == '\0' && x >= lowest && x <= (1ull << highest_log2))
    return x;
  throw std::invalid_argument(std::string(name) + ": expected bytes in [" + std::to_string(lowest) +
                              ", 2^" + std::to_string(highest_log2) + "], got '" + v + "'");
}

}  // namespace

ShmComm::ShmComm(const ShmOptions& o, Deadline deadline) : me_(o.local_rank), n_(o.local_size) {
  if (n_ < 1 || n_ > kMaxLocalSize || me_ < 0 || me_ >= n_)
    throw std::invalid_argument("ShmComm: local rank " + std::to_string(me_) + " of " +
                                std::to_string(n_) + " out of range");
  auto page_up = [](size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; };
  slot_bytes_ = o.slot_bytes
                    ? o.slot_bytes
                    : bytes_from_env("TRUN_SHM_SLOT_BYTES", 4096).value_or(default_slot_bytes(n_));
  // Each slot holds n_ cache-line aligned slices in each half (all_to_all_v).
  slot_bytes_ = page_up(std::max(slot_bytes_, 2 * static_cast<size_t>(n_) * kLine));
  const std::optional<size_t> a2a_env = bytes_from_env("TRUN_SHM_A2A_BYTES", 0);
  const std::optional<size_t> buf_env = bytes_from_env("TRUN_SHM_BUFFER_BYTES", 0, 40);
  const size_t header_bytes = page_up(sizeof(ShmHeader));
  const size_t channel_bytes =
      page_up(sizeof(CopyChannel) * kCopyChannels * static_cast<size_t>(n_));
  // Known once the segment's kind is (named or not: local rank 0 decides).
  auto size_segment = [&] {
    a2a_bytes_ = a2a_env ? *a2a_env : default_a2a_bytes(n_, named_);
    if (a2a_bytes_) a2a_bytes_ = page_up(std::max(a2a_bytes_, 2 * static_cast<size_t>(n_) * kLine));
    buf_bytes_ = page_up(buf_env ? *buf_env : default_buffer_bytes(n_, named_));
    map_bytes_ = header_bytes + channel_bytes +
                 (slot_bytes_ + a2a_bytes_ + buf_bytes_) * static_cast<size_t>(n_);
  };

  const std::string stem = base::shm_segment_stem(o.tag);
  int fd = -1;
  std::string secret;  // memfd mode: what a peer must present to be handed the segment
  if (me_ == 0) {
    named_ = want_named_segment();
    if (!named_) {
      fd = ::memfd_create(stem.c_str(), MFD_CLOEXEC);
      if (fd < 0 && errno != ENOSYS && errno != EINVAL)
        throw CollectiveError(errno_text("memfd_create"));
      named_ = fd < 0;  // kernel without memfd: fall back to a named segment
      name_ = "memfd:" + stem;
    }
    if (named_) {
      name_ = "/" + stem + "-" + random_hex(8);
      fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) throw CollectiveError(errno_text(("shm_open(" + name_ + ")").c_str()));
    }
    size_segment();
    if (::ftruncate(fd, static_cast<off_t>(map_bytes_)) != 0) {
      std::string err = errno_text("ftruncate");
      ::close(fd);
      if (named_) ::shm_unlink(name_.c_str());
      throw CollectiveError("shared memory segment " + name_ + ": " + err);
    }
  } else {
    std::string key = "shm_name";
    o.store->wait({key}, remaining(deadline));
    std::string published = o.store->get(key);
    named_ = published.empty() || published[0] != '@';
    if (named_) {
      name_ = published;
      fd = ::shm_open(name_.c_str(), O_RDWR, 0600);
      if (fd < 0)
        throw CollectiveError(errno_text(
            ("local rank " + std::to_string(me_) + ": shm_open(" + name_ + ")").c_str()));
    } else {
      name_ = "memfd:" + stem;
      fd = fetch_segment_fd(published.substr(1), me_, deadline);
    }
    size_segment();
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != map_bytes_) {
      ::close(fd);
      throw CollectiveError("shared memory segment " + name_ + " has size " +
                            std::to_string(st.st_size) + ", expected " +
                            std::to_string(map_bytes_) +
                            " (TRUN_SHM_SLOT_BYTES, TRUN_SHM_A2A_BYTES or TRUN_SHM_BUFFER_BYTES "
                            "differ between ranks?)");
    }
  }
  // The shared buffer areas are mapped apart (below): they are large in address space, and a
  // rank that cannot map them (RLIMIT_AS, say) still joins, without them.
  const size_t areas_bytes = buf_bytes_ * static_cast<size_t>(n_);
  map_ = ::mmap(nullptr, map_bytes_ - areas_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_errno = errno;
  if (map_ == MAP_FAILED) {
    ::close(fd);
    map_ = nullptr;
    if (me_ == 0 && named_) ::shm_unlink(name_.c_str());
    errno = map_errno;
    throw CollectiveError(errno_text(("mmap(" + name_ + ")").c_str()));
  }
  mapping_ = std::shared_ptr<void>(
      map_, [bytes = map_bytes_ - areas_bytes](void* p) { ::munmap(p, bytes); });
  hdr_ = static_cast<ShmHeader*>(map_);
  channels_ = reinterpret_cast<CopyChannel*>(static_cast<char*>(map_) + header_bytes);
  data_ = static_cast<char*>(map_) + header_bytes + channel_bytes;
  a2a_ = data_ + slot_bytes_ * static_cast<size_t>(n_);
  if (areas_bytes) {
    void* areas = ::mmap(nullptr, areas_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                         static_cast<off_t>(map_bytes_ - areas_bytes));
    if (areas == MAP_FAILED) {
      std::fprintf(stderr,
                   "[trun.worker] local rank %d cannot map the shared buffer areas (%zu bytes: "
                   "%s); its shared_buffer gives ordinary memory (TRUN_SHM_BUFFER_BYTES sets "
                   "their size per rank)\n",
                   me_, areas_bytes, std::strerror(errno));
    } else {
      bufs_ = static_cast<char*>(areas);
      areas_mapping_ =
          std::shared_ptr<void>(areas, [areas_bytes](void* p) { ::munmap(p, areas_bytes); });
    }
  }

  if (me_ == 0) {
    // ftruncate zero-filled the segment; placement-new the atomics for form's sake.
    new (hdr_) ShmHeader();
    // Default-initialized: the rings stay untouched (zero pages) until a message uses them.
    for (int i = 0; i < n_ * kCopyChannels; ++i) new (channels_ + i) CopyChannel;
    hdr_->local_size = static_cast<uint32_t>(n_);
    hdr_->slot_bytes = slot_bytes_;
    hdr_->a2a_bytes = a2a_bytes_;
    hdr_->buf_bytes = buf_bytes_;
    hdr_->abort_owner.store(-1);
    hdr_->magic = kMagic;
    std::atomic_thread_fence(std::memory_order_release);
    try {
      if (named_) {
        o.store->set("shm_name", name_);
      } else {
        // Unnamed segment: hand the descriptor to each peer over an abstract Unix socket (gone
        // with this process; nothing to clean up in any file system).
        FdServer server(n_);
        o.store->set("shm_name", "@" + server.address() + " " + server.secret());
        server.serve(fd, n_ - 1, deadline);
      }
    } catch (...) {
      ::close(fd);
      if (named_) ::shm_unlink(name_.c_str());
      mapping_.reset();
      map_ = nullptr;
      throw;
    }
  } else {
    std::atomic_thread_fence(std::memory_order_acquire);
    if (hdr_->magic != kMagic || hdr_->local_size != static_cast<uint32_t>(n_) ||
        hdr_->slot_bytes != slot_bytes_ || hdr_->a2a_bytes != a2a_bytes_ ||
        hdr_->buf_bytes != buf_bytes_) {
      ::close(fd);
      mapping_.reset();
      map_ = nullptr;
      throw CollectiveError("shared memory segment " + name_ +
                            " does not match this group (local size, slot size, all_to_all area "
                            "or shared buffer area differ)");
    }
  }
  ::close(fd);
  hdr_->ranks[me_].pid.store(static_cast<int32_t>(::getpid()));
  hdr_->ranks[me_].pid_ns.store(pid_namespace());
  hdr_->ranks[me_].areas.store(bufs_ ? 1 : 0);
  // The last rank to map the segment removes its name: from here on nothing in /dev/shm
  // refers to it, and the memory goes away with the last process, however it exits.
  if (hdr_->mapped.fetch_add(1) + 1 == static_cast<uint32_t>(n_) && named_)
    ::shm_unlink(name_.c_str());

  unsigned cpus = std::thread::hardware_concurrency();
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  // Spin only briefly before sleeping on the futex: on a busy or oversubscribed machine a
  // spinning rank steals the core its peer needs.
  core_each_ = cpus >= static_cast<unsigned>(n_);
  spin_limit_ = core_each_ ? 1000 : 64;
  if (const char* v = std::getenv("TRUN_SHM_SPIN")) spin_limit_ = std::atoi(v);  // tuning
  if (const char* v = std::getenv("TRUN_SHM_YIELD_US"))                          // tuning
    yield_for_ = std::chrono::microseconds(std::atoi(v));

  // Everyone mapped (and wrote its pid): wait with the usual barrier machinery.
  try {
    arrive_and_wait(deadline, "shared memory setup");
  } catch (...) {
    if (named_) ::shm_unlink(name_.c_str());  // in case a peer never mapped it
    throw;
  }
  srcs_.assign(n_, nullptr);
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
  if (bufs_)
    area_ = std::make_shared<SharedArea>(areas_mapping_, bufs_ + me_ * buf_bytes_, buf_bytes_);
}

bool ShmComm::maps_shared_areas(int r) const {
  return r >= 0 && r < n_ && hdr_->ranks[r].areas.load(std::memory_order_relaxed) == 1;
}

// This rank's shared buffer area: first fit over the free ranges, in pages. A freed range's
// pages go back to the system (MADV_REMOVE: the segment is shared memory), so the next block
// there is zero-filled again, as a fresh one is.
class SharedArea {
 public:
  SharedArea(std::shared_ptr<void> mapping, char* base, size_t bytes)
      : mapping_(std::move(mapping)), base_(base), total_(bytes) {
    free_.emplace(0, bytes);
  }

  std::shared_ptr<SharedBuffer::Block> allocate(size_t bytes,
                                                const std::shared_ptr<SharedArea>& self) {
    if (bytes > total_) return nullptr;  // (and the rounding below cannot overflow)
    const size_t len = whole_pages(bytes);
    size_t off = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = std::find_if(free_.begin(), free_.end(),
                             [&](const auto& range) { return range.second >= len; });
      if (it == free_.end()) return nullptr;
      off = it->first;
      const size_t rest = it->second - len;
      free_.erase(it);
      if (rest) free_.emplace(off + len, rest);
    }
    auto block = std::make_shared<SharedBuffer::Block>();
    block->data = base_ + off;
    block->size = bytes;
    block->shared = true;
    block->release = [self, off, len] { self->release(off, len); };
    return block;
  }

 private:
  void release(size_t off, size_t len) {
    ::madvise(base_ + off, len, MADV_REMOVE);
    std::lock_guard<std::mutex> lock(mu_);
    auto next = free_.lower_bound(off);
    if (next != free_.end() && next->first == off + len) {  // merge with the range after
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {  // and with the one before
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += len;
        return;
      }
    }
    free_.emplace(off, len);
  }

  std::shared_ptr<void> mapping_;  // keeps the areas mapped while blocks live
  char* base_;
  size_t total_;
  std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> length
};

std::shared_ptr<SharedBuffer::Block> ShmComm::allocate_shared(size_t bytes) {
  if (!area_) return nullptr;
  auto block = area_->allocate(bytes, area_);
  if (!block && !area_full_noted_.exchange(true))
    std::fprintf(stderr,
                 "[trun.worker] shared_buffer: %zu bytes do not fit in what is left of local rank "
                 "%d's shared buffer area (TRUN_SHM_BUFFER_BYTES=%zu); this and later such "
                 "buffers are ordinary memory\n",
                 bytes, me_, buf_bytes_);
  return block;
}

uint64_t ShmComm::shared_offset(const void* p, size_t bytes) const {
  const char* mine = shared_area(me_);
  const char* c = static_cast<const char*>(p);
  if (!mine || c < mine || c > mine + buf_bytes_ ||
      bytes > static_cast<size_t>(mine + buf_bytes_ - c))
    return kNotShared;
  return static_cast<uint64_t>(c - mine);
}

ShmComm::~ShmComm() {
  for (int fd : pidfds_)
    if (fd >= 0) ::close(fd);
  // mapping_ unmaps the segment; areas_mapping_ the shared buffer areas, once no SharedBuffer of
  // this group is left either.
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

void ShmComm::check_aborted(const char* what) {
  if (hdr_ && hdr_->aborted.load(std::memory_order_acquire)) fail_aborted(what);
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
  Clock::time_point yield_until{};
  for (;;) {
    while (next < n_ &&
           static_cast<int32_t>(hdr_->ranks[next].arrived.load(std::memory_order_acquire) -
                                target) >= 0)
      ++next;
    if (next == n_) return;
    check_aborted(what);
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
    // Then yield the core for a while before sleeping: the peers we wait for are often queued
    // behind us on this very core (more ranks than cores), and a yield hands it to them at once
    // with no futex round trip. Long waits (a peer still computing) end up on the futex.
    if (yield_until == Clock::time_point{}) yield_until = now + yield_for_;
    if (now < yield_until) {
      ::sched_yield();
      continue;
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

bool ShmComm::all_arrived(uint32_t target) const {
  for (int r = 0; r < n_; ++r)
    if (static_cast<int32_t>(hdr_->ranks[r].arrived.load() - target) < 0) return false;
  return true;
}

void ShmComm::arrive_and_wait(Deadline deadline, const char* what) {
  ++seq_;
  hdr_->ranks[me_].arrived.store(seq_);  // seq_cst: ordered before the loads below
  // Only the rank that completes the barrier wakes the sleepers: waking them at every arrival
  // costs each a context switch to find the barrier still closed (4 ranks on 2 cores: most of
  // the wake-ups). Of ranks arriving at once, the last store in the total order sees all the
  // others (seq_cst on both sides), so some rank always wakes them.
  if (hdr_->waiters.load() > 0 && all_arrived(seq_)) {
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
  // The constructor makes a slot at least one cache line per rank; else this loop never ends.
  TRUN_CHECK_GT(
      slice_cap, 0u,
      "slot of " << slot_bytes_ << " bytes, " << n_ << " local ranks, " << dtype_name(dtype));
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
      copy_bytes(mine + j * slice_bytes, buf + (off + j * per) * es, slice_len(j) * es);
    }
    arrive_and_wait(deadline, "allreduce");
    const size_t len = slice_len(me_);
    if (len) {
      // One pass: read every rank's copy of my slice (mine from my buffer), in rank order, and
      // store the result both in my buffer and where my peers will copy it from.
      char* dst = buf + (off + me_ * per) * es;
      for (int j = 0; j < n_; ++j) srcs_[j] = j == me_ ? dst : slot(j) + me_ * slice_bytes;
      void* dsts[2] = {dst, mine + me_ * slice_bytes};  // dst is a source too: first
      reduce_n(dsts, 2, srcs_.data(), n_, len, dtype, op);
    }
    arrive_and_wait(deadline, "allreduce");
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      copy_bytes(buf + (off + j * per) * es, slot(j) + j * slice_bytes, slice_len(j) * es);
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
    if (me_ == root) copy_bytes(data_, buf + off, m);
    arrive_and_wait(deadline, "broadcast");
    if (me_ != root) copy_bytes(buf + off, data_, m);
    arrive_and_wait(deadline, "broadcast");
  }
}

void ShmComm::allgather(const void* send, void* recv, size_t bytes, Deadline deadline) {
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (n_ == 1 || bytes == 0) {
    if (bytes) copy_bytes(out, in, bytes);
    return;
  }
  for (size_t off = 0; off < bytes; off += slot_bytes_) {
    const size_t m = std::min(slot_bytes_, bytes - off);
    copy_bytes(slot(me_), in + off, m);
    arrive_and_wait(deadline, "allgather");
    for (int j = 0; j < n_; ++j) copy_bytes(out + j * bytes + off, slot(j), m);
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
    copy_bytes(out, in, count * es);
    return;
  }
  const size_t sub_bytes = (slot_bytes_ / n_) / kLine * kLine;
  const size_t sub = sub_bytes / es;
  TRUN_CHECK_GT(
      sub, 0u,
      "slot of " << slot_bytes_ << " bytes, " << n_ << " local ranks, " << dtype_name(dtype));
  for (size_t off = 0; off < count; off += sub) {
    const size_t m = std::min(sub, count - off);
    for (int d = 0; d < n_; ++d) {
      if (d == me_) continue;
      copy_bytes(slot(me_) + d * sub_bytes, in + (d * count + off) * es, m * es);
    }
    arrive_and_wait(deadline, "reduce_scatter");
    for (int j = 0; j < n_; ++j)
      srcs_[j] = j == me_ ? in + (me_ * count + off) * es : slot(j) + me_ * sub_bytes;
    void* dst = out + off * es;
    reduce_n(&dst, 1, srcs_.data(), n_, m, dtype, op);
    arrive_and_wait(deadline, "reduce_scatter");
  }
}

namespace {
bool cma_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("TRUN_SHM_CMA");
    return !(v && std::string(v) == "0");
  }();
  return enabled;
}
}  // namespace

int ShmComm::readable_pid(int r) const {
  return cma_enabled() && r != me_ && r >= 0 && r < n_ ? pids_[r] : 0;
}

bool ShmComm::cma_usable() const {
  if (cma_failed_ || !cma_enabled()) return false;
  for (int r = 0; r < n_; ++r)
    if (r != me_ && pids_[r] <= 0) return false;  // another pid namespace: no pid to read from
  return true;
}

std::string ShmComm::read_peer(int r, char* dst, uint64_t remote, size_t bytes) {
  return read_process_memory(pids_[r], "local rank " + std::to_string(r), dst, remote, bytes);
}

void ShmComm::all_to_all_v(const void* send, const size_t* send_offsets, const size_t* send_bytes,
                           void* recv, const size_t* recv_offsets, const size_t* recv_bytes,
                           Deadline deadline) {
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (n_ == 1 && send_bytes[0] != recv_bytes[0])
    throw CollectiveError("all_to_all: sends " + std::to_string(send_bytes[0]) +
                          " bytes to itself but receives " + std::to_string(recv_bytes[0]));
  // Large receives are written with non-temporal stores: nothing reads them back soon, and
  // the copies are limited by memory bandwidth. So are large sends into the staging area (see
  // the rounds below).
  size_t total_recv = 0, total_send = 0;
  for (int j = 0; j < n_; ++j) total_recv += recv_bytes[j], total_send += send_bytes[j];
  const bool stream_out = total_recv >= kStreamMinBytes, stream_in = total_send >= kStreamMinBytes;
  auto copy_own_block = [&] {
    if (send_bytes[me_])
      copy_or_stream(stream_out, out + recv_offsets[me_], in + send_offsets[me_], send_bytes[me_]);
  };
  if (n_ > 1) {
    // Row i of the table: local rank i's send sizes, receive sizes, send offsets, the address
    // of its send buffer, whether it can read its peers' memory (cross-memory attach), and
    // where its send buffer lies in its shared buffer area (kNotShared: elsewhere).
    const size_t w = 3 * static_cast<size_t>(n_) + 3;
    size_t send_extent = 0;
    for (int j = 0; j < n_; ++j)
      send_extent = std::max(send_extent, send_offsets[j] + send_bytes[j]);
    std::vector<uint64_t> mine(w), table(w * n_);
    for (int j = 0; j < n_; ++j) {
      mine[j] = send_bytes[j];
      mine[n_ + j] = recv_bytes[j];
      mine[2 * n_ + j] = send_offsets[j];
    }
    mine[3 * n_] = reinterpret_cast<uintptr_t>(in);
    mine[3 * n_ + 1] = cma_usable() ? 1 : 0;
    mine[3 * n_ + 2] = shared_offset(in, send_extent);
    allgather(mine.data(), table.data(), w * sizeof(uint64_t), deadline);
    uint64_t longest = 0;
    bool cma = true, shared = true;
    for (int i = 0; i < n_; ++i) {
      cma = cma && table[i * w + 3 * n_ + 1] == 1;
      shared = shared && table[i * w + 3 * n_ + 2] != kNotShared;
      for (int j = 0; j < n_; ++j) {
        const uint64_t sent = table[i * w + j];           // i -> j, as i says
        const uint64_t expected = table[j * w + n_ + i];  // i -> j, as j says
        if (sent != expected)
          throw CollectiveError("all_to_all on local rank " + std::to_string(me_) +
                                ": local rank " + std::to_string(i) + " sends " +
                                std::to_string(sent) + " bytes to local rank " + std::to_string(j) +
                                ", which expects " + std::to_string(expected));
        if (i != j) longest = std::max(longest, sent);
      }
    }
    if (shared) {
      // Every send buffer is a SharedBuffer: each rank copies its blocks straight out of its
      // peers' (the allgather above was the barrier that has them all written), then a barrier
      // keeps every send buffer untouched until its readers are done. One copy per byte. (A
      // rank that could not map the areas has none of its own, so its row says kNotShared.)
      for (int src = 0; src < n_; ++src) {
        if (src == me_ || recv_bytes[src] == 0) continue;
        copy_or_stream(
            stream_out, out + recv_offsets[src],
            shared_area(src) + table[src * w + 3 * n_ + 2] + table[src * w + 2 * n_ + me_],
            recv_bytes[src]);
      }
      copy_own_block();
      arrive_and_wait(deadline, "all_to_all");
      return;
    }
    // Staged or direct. A round moves one sub-slot per pair through the staging area (or the
    // slots): the sender copies in, the receiver copies out, both with non-temporal stores when
    // large, so each byte crosses memory once each way and every copy is in user space; a direct
    // read is one copy, but the kernel's (process_vm_readv), which costs about three times the
    // CPU time per byte here. Measured (2 cores, 64 MiB per rank, streamed copies in and out,
    // 16 MiB staging per rank): 4 ranks, rounds 5.5-5.7 GB/s against direct reads' 2.3-2.7;
    // 8 ranks, 1.9-2.6 against 1.3. So rounds wherever sub-slots are at least 256 KiB, and
    // direct reads for smaller ones (many local ranks) or messages that short. Every rank must
    // take the same path: decided from the table, which all share.
    // The rounds go through the staging area when there is one, else through the slots; two
    // rounds in flight (each in one half of every rank's part) when the halves are big enough.
    const size_t stage_bytes = a2a_bytes_ ? a2a_bytes_ : slot_bytes_;
    auto stage = [&](int r) { return a2a_bytes_ ? a2a_ + r * a2a_bytes_ : slot(r); };
    const int depth = stage_bytes / 2 / n_ >= kStagedMinSubBytes ? 2 : 1;
    const size_t part = stage_bytes / depth;
    const size_t sub_bytes = (part / n_) / kLine * kLine;
    const bool staged = sub_bytes >= kStagedMinSubBytes && longest >= kStagedMinSubBytes;
    if (cma && !staged && longest > 0) {
      // One copy per block, straight from each peer's send buffer (process_vm_readv); then an
      // allgather of the outcomes, which is also the barrier that keeps every send buffer
      // untouched until its readers are done. If any rank failed to read (EPERM under a
      // seccomp or ptrace policy, say), all fall back to the staged rounds below, and stop
      // trying for this segment.
      std::string why;
      for (int src = 0; src < n_ && why.empty(); ++src) {
        if (src == me_ || recv_bytes[src] == 0) continue;
        const uint64_t remote = table[src * w + 3 * n_] + table[src * w + 2 * n_ + me_];
        why = read_peer(src, out + recv_offsets[src], remote, recv_bytes[src]);
      }
      uint64_t ok = why.empty() ? 1 : 0;
      std::vector<uint64_t> oks(n_);
      allgather(&ok, oks.data(), sizeof ok, deadline);
      if (std::all_of(oks.begin(), oks.end(), [](uint64_t v) { return v == 1; })) {
        copy_own_block();
        return;
      }
      cma_failed_ = true;
      if (!why.empty())
        std::fprintf(stderr,
                     "[trun.worker] all_to_all: cannot read a local peer's memory (%s); using "
                     "the shared-memory rounds from now on\n",
                     why.c_str());
    }
    TRUN_CHECK_GT(sub_bytes, 0u,
                  "staging of " << stage_bytes << " bytes, " << n_ << " local ranks");
    // With two rounds in flight, rounds alternate between the halves of each part and one
    // barrier per round is enough: a rank writes half h in round r only after the barrier of
    // round r - 1, which every rank reaches after it has copied out of half h in round r - 2.
    // With one, a second barrier ends each round before the part is written again.
    uint64_t round = 0;
    for (uint64_t off = 0; off < longest; off += sub_bytes, ++round) {
      const size_t h = (round % depth) * part;
      for (int d = 0; d < n_; ++d) {
        if (d == me_ || send_bytes[d] <= off) continue;
        copy_or_stream(stream_in, stage(me_) + h + d * sub_bytes, in + send_offsets[d] + off,
                       std::min<uint64_t>(sub_bytes, send_bytes[d] - off));
      }
      arrive_and_wait(deadline, "all_to_all");
      for (int s = 0; s < n_; ++s) {
        if (s == me_ || recv_bytes[s] <= off) continue;
        copy_or_stream(stream_out, out + recv_offsets[s] + off, stage(s) + h + me_ * sub_bytes,
                       std::min<uint64_t>(sub_bytes, recv_bytes[s] - off));
      }
      if (depth == 1) arrive_and_wait(deadline, "all_to_all");
    }
    copy_own_block();
    // Nobody returns (and writes its slot for the next collective) while a peer still reads it.
    // The staging area needs no such barrier: the next all_to_all writes it only after its
    // allgather, which nobody passes before every rank has entered it.
    if (depth == 2 && round > 0 && !a2a_bytes_) arrive_and_wait(deadline, "all_to_all");
    return;
  }
  copy_own_block();
}

}  // namespace trun::worker::detail
