// ProgressMonitor (progress_monitor.h): the board's creator and reader.

#include "agent/progress_monitor.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <system_error>

namespace trun::agent {

namespace board = base::progress;
using std::memory_order_acquire;
using std::memory_order_relaxed;
using std::memory_order_release;

std::unique_ptr<ProgressMonitor> ProgressMonitor::create(const std::string& name, int slots) {
  if (slots < 1 || slots > board::kMaxSlots)
    throw std::invalid_argument("progress board: " + std::to_string(slots) +
                                " slots is outside [1, " + std::to_string(board::kMaxSlots) + "]");
  if (name.empty() || name.find('/') != std::string::npos)
    throw std::invalid_argument("progress board: bad name '" + name + "'");
  std::unique_ptr<ProgressMonitor> m(new ProgressMonitor());
  m->shm_name_ = "/" + name;
  m->slots_ = slots;
  m->bytes_ = board::board_bytes(static_cast<uint32_t>(slots));
  int fd = ::shm_open(m->shm_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) {
    // Left by a dead agent that had our pid (the name holds it): ours now.
    ::shm_unlink(m->shm_name_.c_str());
    fd = ::shm_open(m->shm_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "shm_open " + m->shm_name_);
  if (::ftruncate(fd, static_cast<off_t>(m->bytes_)) != 0) {
    const int e = errno;
    ::close(fd);
    ::shm_unlink(m->shm_name_.c_str());
    throw std::system_error(e, std::generic_category(), "ftruncate " + m->shm_name_);
  }
  void* p = ::mmap(nullptr, m->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(m->shm_name_.c_str());
    throw std::system_error(e, std::generic_category(), "mmap " + m->shm_name_);
  }
  m->base_ = p;  // zero-filled by ftruncate
  auto* h = static_cast<board::Header*>(p);
  h->version.store(board::kVersion, memory_order_relaxed);
  h->slots.store(static_cast<uint32_t>(slots), memory_order_relaxed);
  h->record_size.store(sizeof(board::RankRecord), memory_order_relaxed);
  h->max_groups.store(board::kMaxGroups, memory_order_relaxed);
  h->ring_size.store(board::kRingSize, memory_order_relaxed);
  const int64_t now = board::monotonic_ns();
  h->created_ns.store(now, memory_order_relaxed);
  h->generation.store(0, memory_order_relaxed);
  h->generation_ns.store(now, memory_order_relaxed);
  h->magic.store(board::kMagic, memory_order_release);
  return m;
}

int ProgressMonitor::remove_stale_boards(const std::string& dir) {
  // shm_progress_name's stem: "trun-progress-<pid>-<run id>".
  static const std::string kPrefix = "trun-progress-";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return 0;
  int removed = 0;
  for (int seen = 0; seen < kMaxStaleScan; ++seen) {
    const dirent* e = ::readdir(d);
    if (!e) break;
    const std::string name = e->d_name;
    if (name.compare(0, kPrefix.size(), kPrefix) != 0) continue;
    const size_t dash = name.find('-', kPrefix.size());
    if (dash == std::string::npos || dash == kPrefix.size() || dash - kPrefix.size() > 9) continue;
    long pid = 0;
    bool digits = true;
    for (size_t i = kPrefix.size(); i < dash; ++i) {
      digits = digits && name[i] >= '0' && name[i] <= '9';
      pid = pid * 10 + (name[i] - '0');
    }
    if (!digits || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

ProgressMonitor::~ProgressMonitor() {
  if (base_) ::munmap(base_, bytes_);
  ::shm_unlink(shm_name_.c_str());
}

board::RankRecord* ProgressMonitor::record_for_testing(int slot) const {
  return board::record_at(base_, static_cast<uint32_t>(slot));
}

void ProgressMonitor::reset() {
  static_cast<board::Header*>(base_)->leaving.store(0, memory_order_relaxed);
  for (int i = 0; i < slots_; ++i) {
    board::RankRecord* r = board::record_at(base_, static_cast<uint32_t>(i));
    std::memset(static_cast<void*>(r), 0, sizeof(*r));
  }
}

void ProgressMonitor::reset_slot(int slot) {
  if (slot < 0 || slot >= slots_)
    throw std::out_of_range("progress board: no slot " + std::to_string(slot));
  board::RankRecord* r = board::record_at(base_, static_cast<uint32_t>(slot));
  std::memset(static_cast<void*>(r), 0, sizeof(*r));
}

void ProgressMonitor::set_generation(uint64_t generation) {
  auto* h = static_cast<board::Header*>(base_);
  h->generation_ns.store(board::monotonic_ns(), memory_order_relaxed);
  h->generation.store(generation, memory_order_release);
}

void ProgressMonitor::set_generation(uint64_t generation, const FormationFacts& facts) {
  board::Formation* f = board::formation_at(base_);
  f->generation.store(0, memory_order_release);  // a reader that copies now retries
  f->naming.store(facts.naming, memory_order_relaxed);
  f->world_size.store(facts.world_size, memory_order_relaxed);
  f->group_rank.store(facts.group_rank, memory_order_relaxed);
  f->group_world_size.store(facts.group_world_size, memory_order_relaxed);
  f->master_port.store(facts.master_port, memory_order_relaxed);
  const size_t n = std::min(facts.master_addr.size(), size_t{board::kAddrMax - 1});
  std::memcpy(f->master_addr, facts.master_addr.data(), n);
  f->master_addr[n] = '\0';
  const size_t slots = std::min(facts.ranks.size(), static_cast<size_t>(slots_));
  for (size_t i = 0; i < slots; ++i) f->ranks[i].store(facts.ranks[i], memory_order_relaxed);
  f->generation.store(generation, memory_order_release);
  set_generation(generation);
}

void ProgressMonitor::set_leaving() {
  static_cast<board::Header*>(base_)->leaving.store(1, memory_order_release);
}

uint64_t ProgressMonitor::generation() const {
  return static_cast<const board::Header*>(base_)->generation.load(memory_order_acquire);
}

ProgressMonitor::Member ProgressMonitor::member(int slot) const {
  if (slot < 0 || slot >= slots_)
    throw std::out_of_range("progress board: no slot " + std::to_string(slot));
  const board::RankRecord& rec = *board::record_at(base_, static_cast<uint32_t>(slot));
  Member m;
  m.pid = std::max(0, rec.pid.load(memory_order_acquire));
  m.resilient = rec.resilient.load(memory_order_acquire) == 1;
  m.generation = rec.generation.load(memory_order_acquire);
  m.steps = rec.steps.load(memory_order_acquire);
  return m;
}

namespace {

// Both readers below are seqlock reads: a counter, the fields, the counter again. Every field is an
// acquire load, so the second counter load cannot move before any of them; that is what an acquire
// fence before it would give, but ThreadSanitizer does not model fences (GCC warns, -Wtsan), and
// on x86 an acquire load is a plain load.
hang::CollectiveRecord read_entry(const board::CollectiveEntry& e, bool* ok) {
  hang::CollectiveRecord c;
  const uint64_t s1 = e.seq.load(memory_order_acquire);
  const uint32_t op = e.op.load(memory_order_acquire);
  c.op =
      op < static_cast<uint32_t>(board::Op::kCount) ? static_cast<board::Op>(op) : board::Op::kNone;
  c.dtype = e.dtype.load(memory_order_acquire);
  c.count = e.count.load(memory_order_acquire);
  const uint32_t st = e.state.load(memory_order_acquire);
  c.state = st <= static_cast<uint32_t>(board::State::kFailed) ? static_cast<board::State>(st)
                                                               : board::State::kEmpty;
  c.issued_ns = e.issued_ns.load(memory_order_acquire);
  c.started_ns = e.started_ns.load(memory_order_acquire);
  c.finished_ns = e.finished_ns.load(memory_order_acquire);
  const uint64_t s2 = e.seq.load(memory_order_relaxed);
  c.seq = s1;
  *ok = s1 != 0 && s1 == s2;
  return c;
}

hang::RankProgress read_record(const board::RankRecord& rec) {
  hang::RankProgress r;
  r.pid = rec.pid.load(memory_order_acquire);
  r.attached = r.pid > 0;
  r.rank = rec.rank.load(memory_order_acquire);
  r.local_rank = rec.local_rank.load(memory_order_acquire);
  const uint32_t phase = rec.phase.load(memory_order_acquire);
  r.phase = phase <= static_cast<uint32_t>(board::Phase::kSection)
                ? static_cast<board::Phase>(phase)
                : board::Phase::kNone;
  r.last_progress_ns = rec.last_progress_ns.load(memory_order_acquire);
  r.attached_ns = rec.attached_ns.load(memory_order_acquire);
  r.steps = rec.steps.load(memory_order_acquire);
  r.collective_ns = rec.collective_ns.load(memory_order_acquire);
  r.first_step_ns = rec.first_step_ns.load(memory_order_acquire);
  r.last_step_ns = rec.last_step_ns.load(memory_order_acquire);
  r.resumed_step_plus1 = rec.resumed_step_plus1.load(memory_order_acquire);
  r.checkpoint_load_ns = rec.checkpoint_load_ns.load(memory_order_acquire);
  const uint64_t init_end = rec.init_end_heartbeat.load(memory_order_acquire);
  r.heartbeat = rec.heartbeat.load(memory_order_acquire);
  r.starting = r.phase == board::Phase::kInit || init_end == 0 || r.heartbeat == init_end;
  if (r.phase == board::Phase::kSection) {
    const uint32_t n =
        std::min<uint32_t>(rec.num_sections.load(memory_order_acquire), board::kMaxSections);
    const uint32_t s = rec.section.load(memory_order_acquire);
    if (s >= 1 && s <= n)
      r.section.assign(rec.section_names[s - 1],
                       strnlen(rec.section_names[s - 1], board::kNameMax - 1));
    else
      r.section = s == board::kMaxSections + 1 ? "other" : "?";
  }
  const uint32_t groups =
      std::min<uint32_t>(rec.num_groups.load(memory_order_acquire), board::kMaxGroups);
  for (uint32_t i = 0; i < groups; ++i) {
    const board::GroupRecord& g = rec.groups[i];
    hang::GroupProgress gp;
    gp.key = g.key.load(memory_order_acquire);
    gp.number = g.number.load(memory_order_acquire);
    gp.group_rank = g.group_rank.load(memory_order_acquire);
    gp.group_size = g.group_size.load(memory_order_acquire);
    gp.completed = g.completed.load(memory_order_acquire);
    gp.issued = g.issued.load(memory_order_acquire);
    gp.completed = std::min(gp.completed, gp.issued);
    for (const auto& e : g.ring) {
      bool ok = false;
      hang::CollectiveRecord c = read_entry(e, &ok);
      // Only what the ring may hold for this issued count (a scribbled seq is dropped).
      if (ok && c.seq <= gp.issued && c.seq + board::kRingSize > gp.issued) gp.recent.push_back(c);
    }
    std::sort(gp.recent.begin(), gp.recent.end(),
              [](const auto& a, const auto& b) { return a.seq < b.seq; });
    r.groups.push_back(std::move(gp));
  }
  return r;
}

}  // namespace

hang::RankProgress ProgressMonitor::snapshot(int slot) const {
  if (slot < 0 || slot >= slots_)
    throw std::out_of_range("progress board: no slot " + std::to_string(slot));
  const board::RankRecord& rec = *board::record_at(base_, static_cast<uint32_t>(slot));
  hang::RankProgress r;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const uint64_t before = rec.heartbeat.load(memory_order_acquire);
    r = read_record(rec);
    if (rec.heartbeat.load(memory_order_relaxed) == before) return r;
  }
  r.moving = true;  // it kept changing under us: progressing
  return r;
}

std::vector<hang::RankProgress> ProgressMonitor::snapshot_all(const std::string& node) const {
  std::vector<hang::RankProgress> out;
  for (int i = 0; i < slots_; ++i) {
    hang::RankProgress r = snapshot(i);
    r.node = node;
    if (r.attached) r.process = process_state(r.pid);
    out.push_back(std::move(r));
  }
  return out;
}

hang::ProcessState ProgressMonitor::process_state(int pid) {
  if (pid <= 0) return hang::ProcessState::kUnknown;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line)) return hang::ProcessState::kGone;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return hang::ProcessState::kUnknown;
  switch (line[paren + 2]) {
    case 'T':
    case 't':
      return hang::ProcessState::kStopped;
    case 'Z':
    case 'X':
      return hang::ProcessState::kGone;
    default:
      return hang::ProcessState::kRunning;
  }
}

}  // namespace trun::agent
