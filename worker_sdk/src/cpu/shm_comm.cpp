// ShmComm (shm_comm.h): joining the node's segment (create or open it, map it, publish or check
// its header, register this rank, wait for the others) and the shared buffer areas' entry
// points. The rest of the class is in the files shm_comm.h lists.

#include "worker_sdk/src/cpu/shm_comm.h"

#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include "base/decimal.h"
#include "base/shm_names.h"
#include "worker_sdk/src/cpu/shm_area.h"
#include "worker_sdk/src/cpu/shm_handover.h"
#include "worker_sdk/src/cpu/shm_layout.h"
#include "worker_sdk/src/cpu/shm_segment.h"

namespace trun::worker::detail {

namespace {

int pidfd_open(int pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// A tuning variable (TRUN_SHM_SPIN, TRUN_SHM_YIELD_US): a count in [0, INT_MAX], as strtol
// reads it but the whole text. Unset: `fallback`. Anything else: one warning line, and
// `fallback`, since a mistyped tuning knob is no reason to fail the job.
long long tuning_from_env(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  if (!v) return fallback;
  std::string error;
  if (auto x = base::parse_decimal_in(v, 0, INT_MAX, &error, base::DecimalSyntax{true, true}))
    return *x;
  std::fprintf(stderr, "[trun.worker] %s=%s; using the default, %lld\n", name, error.c_str(),
               fallback);
  return fallback;
}

}  // namespace

ShmComm::ShmComm(const ShmOptions& o, Deadline deadline)
    : me_(o.local_rank), n_(o.local_size), group_(o.tag) {
  if (n_ < 1 || n_ > kMaxLocalSize || me_ < 0 || me_ >= n_)
    throw std::invalid_argument("ShmComm: local rank " + std::to_string(me_) + " of " +
                                std::to_string(n_) + " out of range");
  const ShmSizeRequest sizes = ShmSizeRequest::from(o.slot_bytes, n_);
  const std::string stem = base::shm_segment_stem(o.tag);
  ShmSegment seg = me_ == 0 ? create_segment(stem, sizes, n_)
                            : open_segment(*o.store, me_, stem, sizes, n_, deadline);
  map_segment(seg, me_);
  adopt_segment(seg);
  if (me_ == 0)
    publish_segment(seg, *o.store, deadline);
  else
    check_segment_header(seg);
  ::close(seg.fd);
  register_rank();
  tune_waits();

  // Everyone mapped (and wrote its pid): wait with the usual barrier machinery.
  try {
    arrive_and_wait(deadline, "shared memory setup");
  } catch (...) {
    if (named_) ::shm_unlink(name_.c_str());  // in case a peer never mapped it
    throw;
  }
  srcs_.assign(n_, nullptr);
  watch_peers();
  if (bufs_)
    area_ = std::make_shared<SharedArea>(areas_mapping_, bufs_ + me_ * buf_bytes_, buf_bytes_);
}

// Takes over the mapped segment's kind, sizes and mappings, and points into it.
void ShmComm::adopt_segment(ShmSegment& seg) {
  named_ = seg.named;
  name_ = seg.name;
  const ShmLayout& l = seg.layout;
  slot_bytes_ = l.slot_bytes;
  a2a_bytes_ = l.a2a_bytes;
  buf_bytes_ = l.buf_bytes;
  mapping_ = std::move(seg.mapping);
  char* base = static_cast<char*>(seg.base);
  hdr_ = reinterpret_cast<ShmHeader*>(base);
  channels_ = reinterpret_cast<CopyChannel*>(base + l.header_bytes);
  data_ = base + l.data_offset();
  a2a_ = data_ + slot_bytes_ * static_cast<size_t>(n_);
  bufs_ = seg.areas;
  areas_mapping_ = std::move(seg.areas_mapping);
}

// Local rank 0: writes the header, then tells the peers where the segment is (its name, or the
// address of the socket that hands the memfd over, which it serves until every peer has it).
void ShmComm::publish_segment(const ShmSegment& seg, store::Store& store, Deadline deadline) {
  // ftruncate zero-filled the segment; placement-new the atomics for form's sake.
  new (hdr_) ShmHeader();
  // Default-initialized: the rings stay untouched (zero pages) until a message uses them.
  for (int i = 0; i < n_ * kCopyChannels; ++i) new (channels_ + i) CopyChannel;
  hdr_->local_size = static_cast<uint32_t>(n_);
  hdr_->slot_bytes = slot_bytes_;
  hdr_->a2a_bytes = a2a_bytes_;
  hdr_->buf_bytes = buf_bytes_;
  hdr_->abort_owner.store(-1);
  hdr_->magic = kShmMagic;
  std::atomic_thread_fence(std::memory_order_release);
  try {
    if (named_) {
      store.set("shm_name", name_);
    } else {
      // Unnamed segment: hand the descriptor to each peer over an abstract Unix socket (gone
      // with this process; nothing to clean up in any file system).
      FdServer server(n_);
      store.set("shm_name", "@" + server.address() + " " + server.secret());
      server.serve(seg.fd, n_ - 1, deadline);
    }
  } catch (...) {
    ::close(seg.fd);
    if (named_) ::shm_unlink(name_.c_str());
    mapping_.reset();
    throw;
  }
}

// Any other local rank: the header local rank 0 wrote must describe the segment this rank's
// options give.
void ShmComm::check_segment_header(const ShmSegment& seg) {
  std::atomic_thread_fence(std::memory_order_acquire);
  if (hdr_->magic != kShmMagic || hdr_->local_size != static_cast<uint32_t>(n_) ||
      hdr_->slot_bytes != slot_bytes_ || hdr_->a2a_bytes != a2a_bytes_ ||
      hdr_->buf_bytes != buf_bytes_) {
    ::close(seg.fd);
    mapping_.reset();
    throw CollectiveError("shared memory segment " + name_ +
                          " does not match this group (local size, slot size, all_to_all area "
                          "or shared buffer area differ)");
  }
}

// Writes this rank's pid (and pid namespace) into the header, and counts it as mapped.
void ShmComm::register_rank() {
  hdr_->ranks[me_].pid.store(static_cast<int32_t>(::getpid()));
  hdr_->ranks[me_].pid_ns.store(pid_namespace());
  hdr_->ranks[me_].areas.store(bufs_ ? 1 : 0);
  // The last rank to map the segment removes its name: from here on nothing in /dev/shm
  // refers to it, and the memory goes away with the last process, however it exits.
  if (hdr_->mapped.fetch_add(1) + 1 == static_cast<uint32_t>(n_) && named_)
    ::shm_unlink(name_.c_str());
}

// How long a barrier spins and yields before it sleeps on the futex.
void ShmComm::tune_waits() {
  unsigned cpus = std::thread::hardware_concurrency();
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  // Spin only briefly before sleeping on the futex: on a busy or oversubscribed machine a
  // spinning rank steals the core its peer needs.
  core_each_ = cpus >= static_cast<unsigned>(n_);
  spin_limit_ = core_each_ ? 1000 : 64;
  spin_limit_ = static_cast<int>(tuning_from_env("TRUN_SHM_SPIN", spin_limit_));
  yield_for_ = std::chrono::microseconds(
      tuning_from_env("TRUN_SHM_YIELD_US",
                      std::chrono::duration_cast<std::chrono::microseconds>(yield_for_).count()));
}

// Once every rank has registered: the peers' pids, and a pidfd for each to watch it exit.
void ShmComm::watch_peers() {
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

bool ShmComm::maps_shared_areas(int r) const {
  return r >= 0 && r < n_ && hdr_->ranks[r].areas.load(std::memory_order_relaxed) == 1;
}

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

}  // namespace trun::worker::detail
