#pragma once
// The worker's side of the progress board (base/progress_board.h; private to libtrun_worker).
// attach() maps the board named by TRUN_PROGRESS_SHM (the agent created it) and takes the record
// of this process's LOCAL_RANK; without the variable, or with a board this build cannot read, it
// does nothing and every hook below is one load of a null pointer and a branch.
//
// Cost of a hook when attached: a clock read (vDSO, no system call) and a few relaxed or release
// stores into this rank's record; a collective costs three of those (issued, started, finished).
//
// Thread safety: every function from any thread. The phase is the process's, as its main
// thread's scopes (init, stop check, checkpoint save, Section) last set it.

#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>

#include "base/progress_board.h"

namespace trun::worker::detail::progress {

namespace board = base::progress;

// This process's record; nullptr when not attached.
board::RankRecord* record();

// CLOCK_MONOTONIC at tick resolution: see base/progress_board.h, "Times".
inline int64_t now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// One progress event on `r`: its time, then the heartbeat that publishes it.
inline void bump(board::RankRecord* r) {
  r->last_progress_ns.store(now_ns(), std::memory_order_relaxed);
  r->heartbeat.fetch_add(1, std::memory_order_release);
}

// Maps the board from the environment, once per process (later calls do nothing). Never throws;
// a board that cannot be used is reported once on stderr.
void attach();
// For tests: use `r` (a record of a board the test mapped itself) as this process's record, or
// detach with nullptr.
void attach_record_for_testing(board::RankRecord* r, int rank, int local_rank);

void init_begin();  // attach(), phase kInit
void init_end();    // phase kRunning; remembers the heartbeat as the end of start-up
void step();        // a DDP step finished
// Checkpointer::load_latest resumed from `step` (0: it found nothing to load) in `load_ns`.
void resumed(uint64_t step, int64_t load_ns);
void heartbeat();  // trun::worker::heartbeat()

// The resilient loop (trun/resilient.h). declare_resilient(): this process runs one (its agent
// may then replace a failed local rank alone). board_generation(): the generation of the workers
// now meant to run (Header::generation); nullopt when not attached. joined_generation(): this
// process's groups now run at `generation`. forget_groups(): the process's groups were destroyed;
// the next ones take the record's group slots from the first (call before building new ones).
void declare_resilient();
bool resilient_declared();  // declare_resilient() ran with a board attached
bool node_leaving();  // the agent stops this node's workers as the node leaves (Header::leaving)
std::optional<uint64_t> board_generation();
// board_formation(): the board's Formation (base/progress_board.h) of `generation` as the agent
// described it, with this local rank's global rank; nullopt when not attached, or when the board
// describes no formation of that generation (it moved on, or its agent sets none).
struct FormationView {
  uint64_t generation = 0;
  int64_t naming = -1;
  int rank = 0;
  int world_size = 0;
  int group_rank = 0;
  int group_world_size = 0;
  int master_port = 0;
  std::string master_addr;
};
std::optional<FormationView> board_formation(uint64_t generation);
void joined_generation(uint64_t generation);
void forget_groups();

// Sets a phase for its lifetime and restores the previous one after (nesting works).
class PhaseScope {
 public:
  explicit PhaseScope(board::Phase phase, uint32_t section = 0);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  board::RankRecord* r_;
  uint32_t prev_phase_ = 0;
  uint32_t prev_section_ = 0;
};

// The section index for `name` (1-based; kMaxSections + 1 when the table is full), registered in
// the record on first use; 0 when not attached.
uint32_t section_index(const char* name);

// One process group's collectives on the board: issue() when the program calls one (returns its
// sequence number), start() when the backend begins it, finish() when it returns.
class GroupProgress {
 public:
  // nullptr when not attached (or every group slot of the record is taken: counted there).
  static std::unique_ptr<GroupProgress> make(const std::string& tag, int group_rank,
                                             int group_size);

  uint64_t issue(board::Op op, uint32_t dtype, uint64_t count);
  void start(uint64_t seq);
  void finish(uint64_t seq, bool ok);

  explicit GroupProgress(board::RankRecord* r, board::GroupRecord* g) : r_(r), g_(g) {}

 private:
  board::RankRecord* r_;
  board::GroupRecord* g_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace trun::worker::detail::progress
