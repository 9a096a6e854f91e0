#pragma once
// ProgressMonitor: the agent's side of the progress board (base/progress_board.h, issue 36,
// docs/hangs.md). It creates one shared-memory segment per agent for `slots` local ranks
// before the workers are spawned (its name goes to them in TRUN_PROGRESS_SHM), reads the
// workers' records as snapshots for the hang rules (hang_rules.h), and unlinks the segment when
// destroyed.
//
// Reading never blocks a worker and never waits for one: a worker writes with atomic stores and
// takes no lock the monitor could hold; a snapshot copies a record and retries (a few times) when
// the record changed meanwhile, then marks it "moving". Everything read is untrusted: counts and
// indices are clamped, names bounded, so a worker that scribbles over the board can make its own
// snapshot wrong but cannot harm the agent.
//
// The resilient loop (docs/launcher.md, "Resilient loops: replacing one worker"): the agent stores
// the generation of the workers meant to run in the header (set_generation) and reads what each
// record says of its worker's loop (member: untrusted, as everything read here).
//
// Thread safety: snapshot(), member(), generation() and process_state() from any thread;
// set_generation() from one thread at a time (the agent's); reset() only while no worker is
// attached (before a group is spawned) and reset_slot(i) only while no worker writes record i
// (its worker is gone, its replacement not yet spawned); the rest is immutable after create().

#include <memory>
#include <string>
#include <vector>

#include "agent/hang_rules.h"
#include "base/progress_board.h"

namespace trun::agent {

class ProgressMonitor {
 public:
  // Creates and maps the board "/<name>" (base::shm_progress_name) for `slots` local ranks
  // (1..kMaxSlots). A segment of that name left by a dead agent of the same pid is replaced.
  // Throws std::system_error (shm_open, ftruncate, mmap) or std::invalid_argument.
  static std::unique_ptr<ProgressMonitor> create(const std::string& name, int slots);
  ~ProgressMonitor();  // unmaps and unlinks
  ProgressMonitor(const ProgressMonitor&) = delete;
  ProgressMonitor& operator=(const ProgressMonitor&) = delete;

  // Unlinks the boards that agents which are gone left in /dev/shm (a trun killed with SIGKILL
  // cannot unlink its own): every "trun-progress-<pid>-..." whose <pid> is no process (kill(pid,
  // 0) fails with ESRCH). A board of a live pid is kept, whoever holds that pid now. At most
  // kMaxStaleScan entries are looked at. Returns how many were removed.
  static int remove_stale_boards(const std::string& dir = "/dev/shm");
  static constexpr int kMaxStaleScan = 65536;

  // The value of TRUN_PROGRESS_SHM for the workers: "/<name>".
  const std::string& shm_name() const { return shm_name_; }
  int slots() const { return slots_; }

  // Clears every record (call before spawning a group: a worker clears its own on attach too).
  void reset();
  // Clears record `slot` alone (a failed worker's, before its replacement is spawned).
  void reset_slot(int slot);

  // Header::generation: the generation of the workers now meant to run. set_generation() stores
  // it (and generation_ns, now) with release, before the workers of that generation are spawned.
  // The board starts at generation 0.
  void set_generation(uint64_t generation);
  uint64_t generation() const;
  // The Formation (base/progress_board.h) of `generation`, then set_generation(generation): what
  // its workers are told of their places and of the names of their groups.
  struct FormationFacts {
    int64_t naming = -1;
    int world_size = 0;
    int group_rank = 0;
    int group_world_size = 0;
    int master_port = 0;
    std::string master_addr;  // cut to kAddrMax - 1 bytes
    std::vector<int> ranks;   // the global rank of each local slot (at most slots())
  };
  void set_generation(uint64_t generation, const FormationFacts& facts);
  // Header::leaving: this node leaves the job; before its workers are signalled. reset() clears it.
  void set_leaving();

  // What record `slot` says of its worker's resilient loop: its pid (0: nobody attached), whether
  // it runs one (RankRecord::resilient is exactly 1), the generation its groups were last built at
  // and the steps it took (RankRecord::steps).
  struct Member {
    int pid = 0;
    bool resilient = false;
    uint64_t generation = 0;
    uint64_t steps = 0;
  };
  Member member(int slot) const;

  // The record of local rank `slot`, as hang::RankProgress (node left empty, process kUnknown).
  hang::RankProgress snapshot(int slot) const;
  // Every slot's, with `node` set and each attached rank's process state read from /proc.
  std::vector<hang::RankProgress> snapshot_all(const std::string& node) const;

  // What /proc/<pid>/stat says of a process: T or t (stopped, traced) -> kStopped, Z or X or no
  // such process -> kGone, else kRunning.
  static hang::ProcessState process_state(int pid);

  // The raw mapping, for tests that play the worker without libtrun_worker.
  base::progress::RankRecord* record_for_testing(int slot) const;

 private:
  ProgressMonitor() = default;
  std::string shm_name_;
  int slots_ = 0;
  size_t bytes_ = 0;
  void* base_ = nullptr;
};

}  // namespace trun::agent
