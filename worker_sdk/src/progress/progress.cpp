// The worker's side of the progress board (progress.h), and the public trun/progress.h.

#include "worker_sdk/src/progress/progress.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

#include "base/decimal.h"
#include "base/shm_names.h"
#include "trun/process_group.h"
#include "trun/progress.h"

namespace trun::worker::detail::progress {
namespace {

using std::memory_order_acquire;
using std::memory_order_relaxed;
using std::memory_order_release;

// The board's data type codes are 1 + DataType's values (base/progress_board.h's dtype_name).
static_assert(static_cast<int>(DataType::kFloat32) == 0 && static_cast<int>(DataType::kBool) == 8,
              "base/progress_board.h's dtype names follow trun::worker::DataType");

std::atomic<board::RankRecord*> g_record{nullptr};
std::atomic<board::Header*> g_header{nullptr};
std::once_flag g_attach_once;
std::mutex g_mu;  // registering groups and section names

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  int n = 0;
  if (!v || !base::parse_decimal(v, &n)) return fallback;
  return n;
}

// Clears what a previous worker of this local rank left in the record (the agent also resets the
// board before it spawns a group). Atomic stores only: the agent may be reading.
void clear(board::RankRecord* r) {
  r->num_groups.store(0, memory_order_relaxed);
  r->num_sections.store(0, memory_order_relaxed);
  r->untracked_groups.store(0, memory_order_relaxed);
  r->section.store(0, memory_order_relaxed);
  r->init_end_heartbeat.store(0, memory_order_relaxed);
  r->steps.store(0, memory_order_relaxed);
  r->collective_ns.store(0, memory_order_relaxed);
  r->first_step_ns.store(0, memory_order_relaxed);
  r->last_step_ns.store(0, memory_order_relaxed);
  r->resumed_step_plus1.store(0, memory_order_relaxed);
  r->checkpoint_load_ns.store(0, memory_order_relaxed);
  r->resilient.store(0, memory_order_relaxed);
  r->generation.store(0, memory_order_relaxed);
  for (auto& g : r->groups) {
    g.key.store(0, memory_order_relaxed);
    g.issued.store(0, memory_order_relaxed);
    g.completed.store(0, memory_order_relaxed);
    for (auto& e : g.ring) e.seq.store(0, memory_order_relaxed);
  }
}

void take(board::RankRecord* r, int rank, int local_rank) {
  // A child forked by the worker (a data-loader process, say) is not the rank: it reports
  // nothing, instead of writing into the rank's record.
  static const int atfork =
      ::pthread_atfork(nullptr, nullptr, [] { g_record.store(nullptr, memory_order_relaxed); });
  (void)atfork;
  clear(r);
  const int64_t now = now_ns();
  r->rank.store(rank, memory_order_relaxed);
  r->local_rank.store(local_rank, memory_order_relaxed);
  r->attached_ns.store(now, memory_order_relaxed);
  r->phase_since_ns.store(now, memory_order_relaxed);
  r->phase.store(static_cast<uint32_t>(board::Phase::kRunning), memory_order_relaxed);
  r->pid.store(static_cast<int32_t>(::getpid()), memory_order_relaxed);
  bump(r);
  g_record.store(r, memory_order_release);
}

void attach_from_environment() {
  const char* name = std::getenv(board::kEnvVar);
  if (!name || !*name) return;
  auto fail = [&](const char* why) {
    std::fprintf(stderr, "[trun.worker] %s=%s: %s; progress is not reported\n", board::kEnvVar,
                 name, why);
  };
  const int local_rank = env_int("LOCAL_RANK", -1);
  if (local_rank < 0) return fail("LOCAL_RANK is not set");
  const int fd = ::shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return fail(std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(board::Header)) {
    ::close(fd);
    return fail("not a progress board (too small)");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return fail(std::strerror(errno));
  auto* h = static_cast<board::Header*>(p);
  const uint32_t slots = h->slots.load(memory_order_relaxed);
  const char* why = nullptr;
  if (h->magic.load(memory_order_acquire) != board::kMagic)
    why = "not a progress board";
  else if (h->version.load(memory_order_relaxed) != board::kVersion ||
           h->record_size.load(memory_order_relaxed) != sizeof(board::RankRecord))
    why = "a board of another version";
  else if (slots > static_cast<uint32_t>(board::kMaxSlots) || board::board_bytes(slots) > size)
    why = "a board whose size does not match its header";
  else if (static_cast<uint32_t>(local_rank) >= slots)
    why = "LOCAL_RANK is outside the board";
  if (why) {
    ::munmap(p, size);
    return fail(why);
  }
  // Mapped for the life of the process: hooks may run until exit.
  g_header.store(h, memory_order_release);
  take(board::record_at(p, static_cast<uint32_t>(local_rank)), env_int("RANK", local_rank),
       local_rank);
}

void set_phase(board::RankRecord* r, uint32_t phase, uint32_t section) {
  r->section.store(section, memory_order_relaxed);
  r->phase.store(phase, memory_order_relaxed);
  r->phase_since_ns.store(now_ns(), memory_order_relaxed);
  bump(r);
}

}  // namespace

board::RankRecord* record() { return g_record.load(memory_order_acquire); }

void declare_resilient() {
  if (board::RankRecord* r = record()) {
    r->resilient.store(1, memory_order_relaxed);
    bump(r);
  }
}

bool resilient_declared() {
  board::RankRecord* r = record();
  return r && r->resilient.load(memory_order_relaxed) != 0;
}

bool node_leaving() {
  board::Header* h = g_header.load(memory_order_acquire);
  return h && h->leaving.load(memory_order_acquire) != 0;
}

std::optional<uint64_t> board_generation() {
  board::Header* h = g_header.load(memory_order_acquire);
  if (!h || !record()) return std::nullopt;
  return h->generation.load(memory_order_acquire);
}

std::optional<FormationView> board_formation(uint64_t generation) {
  board::Header* h = g_header.load(memory_order_acquire);
  board::RankRecord* r = record();
  if (!h || !r) return std::nullopt;
  const board::Formation* f = board::formation_at(h);
  const uint32_t slots = h->slots.load(memory_order_relaxed);
  const int local_rank = r->local_rank.load(memory_order_relaxed);
  if (local_rank < 0 || static_cast<uint32_t>(local_rank) >= slots) return std::nullopt;
  // The agent may be writing the next formation: a copy between two equal reads of `generation`
  // is one formation's (a few tries; the agent writes one in microseconds).
  for (int attempt = 0; attempt < 100; ++attempt) {
    if (f->generation.load(memory_order_acquire) != generation) return std::nullopt;
    FormationView v;
    v.generation = generation;
    v.naming = f->naming.load(memory_order_relaxed);
    v.rank = f->ranks[local_rank].load(memory_order_relaxed);
    v.world_size = f->world_size.load(memory_order_relaxed);
    v.group_rank = f->group_rank.load(memory_order_relaxed);
    v.group_world_size = f->group_world_size.load(memory_order_relaxed);
    v.master_port = f->master_port.load(memory_order_relaxed);
    char addr[board::kAddrMax];
    std::memcpy(addr, f->master_addr, sizeof addr);
    addr[board::kAddrMax - 1] = '\0';
    v.master_addr = addr;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (f->generation.load(memory_order_relaxed) != generation) continue;
    // Untrusted (a worker may write anything on the board): a formation that does not hold
    // together is none.
    if (v.world_size < 1 || v.rank < 0 || v.rank >= v.world_size || v.group_world_size < 1 ||
        v.group_rank < 0 || v.group_rank >= v.group_world_size || v.master_port < 0 ||
        v.master_port > 65535 || v.naming < -1)
      return std::nullopt;
    return v;
  }
  return std::nullopt;
}

void joined_generation(uint64_t generation) {
  if (board::RankRecord* r = record()) {
    r->generation.store(generation, memory_order_relaxed);
    bump(r);
  }
}

void forget_groups() {
  board::RankRecord* r = record();
  if (!r) return;
  std::lock_guard<std::mutex> lock(g_mu);
  r->num_groups.store(0, memory_order_release);
  r->untracked_groups.store(0, memory_order_relaxed);
  for (auto& g : r->groups) g.key.store(0, memory_order_relaxed);
  bump(r);
}

void attach() { std::call_once(g_attach_once, attach_from_environment); }

void attach_record_for_testing(board::RankRecord* r, int rank, int local_rank) {
  std::call_once(g_attach_once, [] {});  // the environment no longer decides
  if (r)
    take(r, rank, local_rank);
  else
    g_record.store(nullptr, memory_order_release);
}

void init_begin() {
  attach();
  if (auto* r = record()) set_phase(r, static_cast<uint32_t>(board::Phase::kInit), 0);
}

void init_end() {
  auto* r = record();
  if (!r) return;
  set_phase(r, static_cast<uint32_t>(board::Phase::kRunning), 0);
  r->init_end_heartbeat.store(r->heartbeat.load(memory_order_relaxed), memory_order_relaxed);
}

void step() {
  if (auto* r = record()) {
    const int64_t now = now_ns();
    if (r->steps.load(memory_order_relaxed) == 0) r->first_step_ns.store(now, memory_order_relaxed);
    r->last_step_ns.store(now, memory_order_relaxed);
    r->steps.fetch_add(1, memory_order_relaxed);
    bump(r);
  }
}

void resumed(uint64_t step, int64_t load_ns) {
  if (auto* r = record()) {
    r->checkpoint_load_ns.store(load_ns, memory_order_relaxed);
    r->resumed_step_plus1.store(step + 1, memory_order_relaxed);
    bump(r);
  }
}

void heartbeat() {
  if (auto* r = record()) bump(r);
}

PhaseScope::PhaseScope(board::Phase phase, uint32_t section) : r_(record()) {
  if (!r_) return;
  prev_phase_ = r_->phase.load(memory_order_relaxed);
  prev_section_ = r_->section.load(memory_order_relaxed);
  set_phase(r_, static_cast<uint32_t>(phase), section);
}

PhaseScope::~PhaseScope() {
  if (r_) set_phase(r_, prev_phase_, prev_section_);
}

uint32_t section_index(const char* name) {
  auto* r = record();
  if (!r) return 0;
  std::lock_guard<std::mutex> lock(g_mu);
  const uint32_t n = r->num_sections.load(memory_order_relaxed);
  for (uint32_t i = 0; i < n && i < board::kMaxSections; ++i)
    if (std::strncmp(r->section_names[i], name, board::kNameMax - 1) == 0) return i + 1;
  if (n >= board::kMaxSections) return board::kMaxSections + 1;
  std::strncpy(r->section_names[n], name, board::kNameMax - 1);
  r->section_names[n][board::kNameMax - 1] = '\0';
  r->num_sections.store(n + 1, memory_order_release);
  return n + 1;
}

std::unique_ptr<GroupProgress> GroupProgress::make(const std::string& tag, int group_rank,
                                                   int group_size) {
  auto* r = record();
  if (!r) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  const uint32_t n = r->num_groups.load(memory_order_relaxed);
  if (n >= board::kMaxGroups) {
    r->untracked_groups.fetch_add(1, memory_order_relaxed);
    return nullptr;
  }
  board::GroupRecord* g = &r->groups[n];
  g->key.store(board::group_key(tag.data(), tag.size()), memory_order_relaxed);
  g->number.store(base::shm_group_number(tag), memory_order_relaxed);
  g->group_rank.store(group_rank, memory_order_relaxed);
  g->group_size.store(group_size, memory_order_relaxed);
  g->issued.store(0, memory_order_relaxed);
  g->completed.store(0, memory_order_relaxed);
  for (auto& e : g->ring) e.seq.store(0, memory_order_relaxed);
  r->num_groups.store(n + 1, memory_order_release);
  return std::make_unique<GroupProgress>(r, g);
}

uint64_t GroupProgress::issue(board::Op op, uint32_t dtype, uint64_t count) {
  const uint64_t seq = next_.fetch_add(1, memory_order_relaxed) + 1;
  board::CollectiveEntry& e = g_->ring[seq % board::kRingSize];
  const int64_t now = now_ns();
  e.seq.store(0, memory_order_relaxed);  // being rewritten
  e.op.store(static_cast<uint32_t>(op), memory_order_relaxed);
  e.dtype.store(dtype, memory_order_relaxed);
  e.count.store(count, memory_order_relaxed);
  e.state.store(static_cast<uint32_t>(board::State::kIssued), memory_order_relaxed);
  e.issued_ns.store(now, memory_order_relaxed);
  e.started_ns.store(0, memory_order_relaxed);
  e.finished_ns.store(0, memory_order_relaxed);
  e.seq.store(seq, memory_order_release);
  g_->issued.store(seq, memory_order_release);
  r_->last_progress_ns.store(now, memory_order_relaxed);
  r_->heartbeat.fetch_add(1, memory_order_release);
  return seq;
}

// A start is not progress (the rank may wait in here for ever): no heartbeat.
void GroupProgress::start(uint64_t seq) {
  board::CollectiveEntry& e = g_->ring[seq % board::kRingSize];
  if (e.seq.load(memory_order_relaxed) != seq) return;  // overwritten: kRingSize issued since
  e.started_ns.store(now_ns(), memory_order_relaxed);
  e.state.store(static_cast<uint32_t>(board::State::kStarted), memory_order_release);
}

void GroupProgress::finish(uint64_t seq, bool ok) {
  board::CollectiveEntry& e = g_->ring[seq % board::kRingSize];
  const int64_t now = now_ns();
  if (e.seq.load(memory_order_relaxed) == seq) {
    if (const int64_t started = e.started_ns.load(memory_order_relaxed); started > 0) {
      r_->collective_ns.fetch_add(now - started, memory_order_relaxed);
    }
    e.finished_ns.store(now, memory_order_relaxed);
    e.state.store(static_cast<uint32_t>(ok ? board::State::kCompleted : board::State::kFailed),
                  memory_order_relaxed);
  }
  g_->completed.store(seq, memory_order_release);
  r_->last_progress_ns.store(now, memory_order_relaxed);
  r_->heartbeat.fetch_add(1, memory_order_release);
}

}  // namespace trun::worker::detail::progress

namespace trun::worker {

namespace progress = detail::progress;

void heartbeat() { progress::heartbeat(); }

bool progress_reported() { return progress::record() != nullptr; }

Section::Section(const char* name) {
  auto* r = progress::record();
  if (!r) return;
  prev_phase_ = r->phase.load(std::memory_order_relaxed);
  prev_section_ = r->section.load(std::memory_order_relaxed);
  active_ = true;
  const uint32_t index = progress::section_index(name ? name : "");
  r->section.store(index, std::memory_order_relaxed);
  r->phase.store(static_cast<uint32_t>(base::progress::Phase::kSection), std::memory_order_relaxed);
  r->phase_since_ns.store(progress::now_ns(), std::memory_order_relaxed);
  progress::bump(r);
}

Section::Section(const std::string& name) : Section(name.c_str()) {}

Section::~Section() {
  if (!active_) return;
  if (auto* r = progress::record()) {
    r->section.store(prev_section_, std::memory_order_relaxed);
    r->phase.store(prev_phase_, std::memory_order_relaxed);
    r->phase_since_ns.store(progress::now_ns(), std::memory_order_relaxed);
    progress::bump(r);
  }
}

}  // namespace trun::worker
