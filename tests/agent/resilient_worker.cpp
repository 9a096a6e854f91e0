// resilient_worker: plays a libtrun_worker program that runs a resilient loop, for the agent's
// in-place replacement tests (tests/agent/resilient_test.cpp), without libtrun_worker: it maps
// the progress board named by TRUN_PROGRESS_SHM itself (base/progress_board.h, as
// worker_sdk/src/progress/progress.cpp does), takes its LOCAL_RANK record, declares the loop
// (resilient = 1, its pid) and writes the generation its groups were "built" at: its
// TORCHELASTIC_RESTART_COUNT. It then reads Header::generation every 10 ms; when that rises, it
// writes the new value to its record's generation (as the SDK does once its groups are rebuilt
// with the replacement).
//
// Usage: resilient_worker DIR [OPTION...]
//   DIR/pid_<restart count>_<local rank>  its pid, written once its record is taken
//   DIR/log_<local rank>                  one line per event: "start pid=P generation=G",
//                                         "saw generation N pid=P", "joined N pid=P"
// It exits 0 once DIR/finish exists, and 2 after 300 s (a bound: the tests end trun by pid).
// Options:
//   not-resilient R  local rank R does not declare the loop (a program without one)
//   never-join       the process never writes a generation later than its own start's (a group
//                    that cannot re-form: its survivors stay at the old generation)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "base/progress_board.h"

namespace {

namespace board = trun::base::progress;
using std::memory_order_acquire;
using std::memory_order_relaxed;
using std::memory_order_release;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

void append(const std::string& path, const std::string& line) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  const std::string text = line + "\n";
  (void)!::write(fd, text.data(), text.size());
  ::close(fd);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The board's header, or nullptr (no board, another layout).
board::Header* map_board(int local_rank) {
  const char* name = std::getenv(board::kEnvVar);
  if (!name || !*name) return nullptr;
  const int fd = ::shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(board::Header)) {
    ::close(fd);
    return nullptr;
  }
  const auto size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return nullptr;
  auto* h = static_cast<board::Header*>(p);
  const uint32_t slots = h->slots.load(memory_order_relaxed);
  if (h->magic.load(memory_order_acquire) != board::kMagic ||
      h->version.load(memory_order_relaxed) != board::kVersion ||
      h->record_size.load(memory_order_relaxed) != sizeof(board::RankRecord) ||
      slots > static_cast<uint32_t>(board::kMaxSlots) || board::board_bytes(slots) > size ||
      local_rank < 0 || static_cast<uint32_t>(local_rank) >= slots) {
    ::munmap(p, size);
    return nullptr;
  }
  return h;
}

void bump(board::RankRecord* r) {
  r->last_progress_ns.store(board::monotonic_ns(), memory_order_relaxed);
  r->heartbeat.fetch_add(1, memory_order_release);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: resilient_worker DIR [OPTION...]\n");
    return 64;
  }
  const std::string dir = argv[1];
  int not_resilient = -1;
  bool never_join = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "not-resilient" && i + 1 < argc) {
      not_resilient = std::atoi(argv[++i]);
    } else if (a == "never-join") {
      never_join = true;
    } else {
      std::fprintf(stderr, "resilient_worker: unknown option %s\n", a.c_str());
      return 64;
    }
  }
  const int local_rank = env_int("LOCAL_RANK", -1);
  const int rank = env_int("RANK", local_rank);
  const auto start_generation = static_cast<uint64_t>(env_int("TORCHELASTIC_RESTART_COUNT", 0));
  const std::string log = dir + "/log_" + std::to_string(local_rank);
  const std::string pid = std::to_string(::getpid());

  board::Header* h = map_board(local_rank);
  board::RankRecord* r = h ? board::record_at(h, static_cast<uint32_t>(local_rank)) : nullptr;
  if (r) {
    // What the SDK's attach does: clear what a predecessor left, then take the record.
    r->num_groups.store(0, memory_order_relaxed);
    r->steps.store(0, memory_order_relaxed);
    r->init_end_heartbeat.store(0, memory_order_relaxed);
    r->rank.store(rank, memory_order_relaxed);
    r->local_rank.store(local_rank, memory_order_relaxed);
    r->attached_ns.store(board::monotonic_ns(), memory_order_relaxed);
    r->phase.store(static_cast<uint32_t>(board::Phase::kRunning), memory_order_relaxed);
    r->resilient.store(local_rank == not_resilient ? 0 : 1, memory_order_relaxed);
    r->generation.store(start_generation, memory_order_relaxed);
    r->pid.store(static_cast<int32_t>(::getpid()), memory_order_relaxed);
    bump(r);
  }
  append(log, "start pid=" + pid + " generation=" + std::to_string(start_generation) +
                  (r ? "" : " (no board)"));
  {
    const std::string pidfile =
        dir + "/pid_" + std::to_string(start_generation) + "_" + std::to_string(local_rank);
    const std::string tmp = pidfile + ".tmp";
    append(tmp, pid);
    ::rename(tmp.c_str(), pidfile.c_str());  // whole, or not there
  }

  uint64_t seen = start_generation;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  while (std::chrono::steady_clock::now() < end) {
    if (exists(dir + "/finish")) return 0;
    if (h) {
      const uint64_t g = h->generation.load(memory_order_acquire);
      if (g > seen) {
        seen = g;
        append(log, "saw generation " + std::to_string(g) + " pid=" + pid);
        if (!never_join) {
          r->generation.store(g, memory_order_relaxed);
          bump(r);
          append(log, "joined " + std::to_string(g) + " pid=" + pid);
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return 2;
}
