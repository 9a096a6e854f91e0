// Creating, opening and mapping ShmComm's segment (shm_segment.h).

#include "worker_sdk/src/cpu/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "worker_sdk/src/cpu/shm_handover.h"

namespace trun::worker::detail {

namespace {

// TRUN_SHM_NAMED=1: share segments by name in /dev/shm (as before memfds) instead of passing a
// memfd over an abstract Unix socket; needed only when the ranks of a node share /dev/shm but
// not a network namespace.
bool want_named_segment() {
  const char* v = std::getenv("TRUN_SHM_NAMED");
  if (!v || !*v || std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  throw std::invalid_argument(std::string("TRUN_SHM_NAMED: expected 0 or 1, got '") + v + "'");
}

}  // namespace

ShmSegment create_segment(const std::string& stem, const ShmSizeRequest& sizes, int local_size) {
  ShmSegment seg;
  seg.named = want_named_segment();
  if (!seg.named) {
    seg.fd = ::memfd_create(stem.c_str(), MFD_CLOEXEC);
    if (seg.fd < 0 && errno != ENOSYS && errno != EINVAL)
      throw CollectiveError(errno_text("memfd_create"));
    seg.named = seg.fd < 0;  // kernel without memfd: fall back to a named segment
    seg.name = "memfd:" + stem;
  }
  if (seg.named) {
    seg.name = "/" + stem + "-" + random_hex(8);
    seg.fd = ::shm_open(seg.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (seg.fd < 0) throw CollectiveError(errno_text(("shm_open(" + seg.name + ")").c_str()));
  }
  seg.layout = sizes.layout(local_size, seg.named);
  if (::ftruncate(seg.fd, static_cast<off_t>(seg.layout.map_bytes)) != 0) {
    std::string err = errno_text("ftruncate");
    ::close(seg.fd);
    if (seg.named) ::shm_unlink(seg.name.c_str());
    throw CollectiveError("shared memory segment " + seg.name + ": " + err);
  }
  return seg;
}

ShmSegment open_segment(store::Store& store, int local_rank, const std::string& stem,
                        const ShmSizeRequest& sizes, int local_size, Deadline deadline) {
  ShmSegment seg;
  std::string key = "shm_name";
  store.wait({key}, remaining(deadline));
  std::string published = store.get(key);
  seg.named = published.empty() || published[0] != '@';
  if (seg.named) {
    seg.name = published;
    seg.fd = ::shm_open(seg.name.c_str(), O_RDWR, 0600);
    if (seg.fd < 0)
      throw CollectiveError(errno_text(
          ("local rank " + std::to_string(local_rank) + ": shm_open(" + seg.name + ")").c_str()));
  } else {
    seg.name = "memfd:" + stem;
    seg.fd = fetch_segment_fd(published.substr(1), local_rank, deadline);
  }
  seg.layout = sizes.layout(local_size, seg.named);
  struct stat st {};
  if (::fstat(seg.fd, &st) != 0 || static_cast<size_t>(st.st_size) != seg.layout.map_bytes) {
    ::close(seg.fd);
    throw CollectiveError("shared memory segment " + seg.name + " has size " +
                          std::to_string(st.st_size) + ", expected " +
                          std::to_string(seg.layout.map_bytes) +
                          " (TRUN_SHM_SLOT_BYTES, TRUN_SHM_A2A_BYTES or TRUN_SHM_BUFFER_BYTES "
                          "differ between ranks?)");
  }
  return seg;
}

void map_segment(ShmSegment& seg, int local_rank) {
  const size_t areas_bytes = seg.layout.areas_bytes();
  const size_t main_bytes = seg.layout.map_bytes - areas_bytes;
  void* base = ::mmap(nullptr, main_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, seg.fd, 0);
  int map_errno = errno;
  if (base == MAP_FAILED) {
    ::close(seg.fd);
    if (local_rank == 0 && seg.named) ::shm_unlink(seg.name.c_str());
    errno = map_errno;
    throw CollectiveError(errno_text(("mmap(" + seg.name + ")").c_str()));
  }
  seg.base = base;
  seg.mapping = std::shared_ptr<void>(base, [main_bytes](void* p) { ::munmap(p, main_bytes); });
  if (!areas_bytes) return;
  void* areas = ::mmap(nullptr, areas_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, seg.fd,
                       static_cast<off_t>(main_bytes));
  if (areas == MAP_FAILED) {
    std::fprintf(stderr,
                 "[trun.worker] local rank %d cannot map the shared buffer areas (%zu bytes: "
                 "%s); its shared_buffer gives ordinary memory (TRUN_SHM_BUFFER_BYTES sets "
                 "their size per rank)\n",
                 local_rank, areas_bytes, std::strerror(errno));
    return;
  }
  seg.areas = static_cast<char*>(areas);
  seg.areas_mapping =
      std::shared_ptr<void>(areas, [areas_bytes](void* p) { ::munmap(p, areas_bytes); });
}

}  // namespace trun::worker::detail
