#pragma once
// HangWatch: hang detection running beside the agent's event loop (issue 36, docs/hangs.md). It
// owns the node's progress board (ProgressMonitor) and a thread that, every poll interval while a
// worker group runs, snapshots every local rank, feeds the learned timeouts (hang::TimeoutRule)
// and asks for the wavefront verdict (hang::judge). The first hung verdict of a group is kept and
// announced on an eventfd that the agent's loop watches; the loop then dumps and stops the group
// (Agent::on_hang). Nothing here signals a process.
//
// Across nodes: a node's snapshots hold only its own ranks. When its ranks all wait in a
// collective whose other members are elsewhere, the rank behind is on another node, whose agent
// names it within its own timeout; this node then waits `remote_grace` longer before declaring
// a hang without a culprit (a transport hang, or a node whose agent cannot judge), so that the
// node that can name the culprit speaks first. Its failure report then ends the round on every
// node, as any worker failure does.
//
// The learned intervals live as long as the watch (the whole job on this node), so a restarted
// group keeps its predecessor's timeouts; between groups the agent merges them with every other
// node's through the store and adopts the result (agent/hang_agree.h).
//
// A worker replaced alone (a resilient loop: docs/launcher.md, "Resilient loops: replacing one
// worker"): begin_reformation() clears the failed worker's record and stops judging while the
// survivors leave their process groups and build new ones with the replacement (a pause that is
// no hang, and that the learned intervals must not include); end_reformation() judges again, from
// fresh intervals. The agent bounds the re-formation itself.
//
// Threads: the watch's thread only reads the board and computes; begin_group(), end_group(),
// begin_reformation(), end_reformation(), set_generation(), take_verdict() and the destructor are
// for the agent's thread. The eventfd stays readable from the verdict until take_verdict().

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "agent/goodput.h"
#include "agent/hang_rules.h"
#include "agent/progress_monitor.h"
#include "agent/straggler.h"

namespace trun::agent {

struct HangWatchOptions {
  hang::TimeoutOptions timeouts;
  std::chrono::milliseconds poll{200};
  // After a rank's own timeout, how much longer a verdict that names nobody on this node waits
  // (see above): a multiple of that timeout plus a constant.
  double remote_grace_factor = 1.0;
  std::chrono::milliseconds remote_grace{5000};
  std::string node;              // this node's name in verdicts
  straggler::Options straggler;  // each poll also feeds the straggler scores' measurements
};

class HangWatch {
 public:
  // Takes the board (ProgressMonitor::create) and starts the thread, idle until begin_group().
  // Throws std::system_error when the eventfd cannot be made.
  HangWatch(std::unique_ptr<ProgressMonitor> board, HangWatchOptions options);
  ~HangWatch();  // stops the thread; the board is unlinked
  HangWatch(const HangWatch&) = delete;
  HangWatch& operator=(const HangWatch&) = delete;

  // TRUN_PROGRESS_SHM for the workers.
  const std::string& shm_name() const { return board_->shm_name(); }
  // Readable when a verdict waits in take_verdict().
  int notify_fd() const { return event_fd_; }

  // Before a group is spawned: clears the board (and a verdict of an earlier group), then
  // watches it.
  void begin_group();
  // The group stops (for any reason): stop judging it. Waits for a poll under way.
  void end_group();

  // Header::generation (ProgressMonitor::set_generation): before the workers of `generation`
  // are spawned, whole groups and replacements alike.
  void set_generation(uint64_t generation) { board_->set_generation(generation); }
  void set_generation(uint64_t generation, const ProgressMonitor::FormationFacts& facts) {
    board_->set_generation(generation, facts);
  }
  // This node leaves the job (ProgressMonitor::set_leaving): before its workers are signalled.
  void mark_node_leaving() { board_->set_leaving(); }
  // What local rank `slot`'s record says of its resilient loop (any thread).
  ProgressMonitor::Member member(int slot) const { return board_->member(slot); }
  // Local ranks `slots` failed and are replaced alone (before their replacements are spawned):
  // clears their records, drops a verdict not yet taken, starts the straggler measurements
  // afresh and stops judging until end_reformation(). Waits for a poll under way.
  void begin_reformation(const std::vector<int>& slots);
  // The group re-formed: judging resumes; no interval learned spans the re-formation.
  void end_reformation();
  // The hung verdict, once (with the snapshots it was made from); nullopt when none is ready.
  // A verdict ends the watching of its group, as end_group() does.
  struct Finding {
    hang::Verdict verdict;
    std::vector<hang::RankProgress> ranks;
    std::vector<std::pair<std::string, double>> timeouts;  // class name -> timeout applied (s)
  };
  std::optional<Finding> take_verdict();

  // What the rule learned so far, per class (any thread).
  std::map<hang::TimeoutClass, hang::TimeoutRule::Learned> learned() const;
  // Adopts what other nodes learned (agent/hang_agree.h): TimeoutRule::adopt per class. Returns
  // one line per class whose timeout changed, e.g. "step 12.0 s (was 1800 s)". Between groups
  // (after end_group(), before begin_group()).
  std::vector<std::string> adopt(
      const std::map<hang::TimeoutClass, hang::TimeoutRule::Learned>& others);

  // The most steps (DDP steps and heartbeats, RankRecord::steps) any local rank of the current or
  // last group reported: 0 when none made progress (the crash-loop guard; any thread).
  uint64_t steps_taken() const;

  // This node's ranks' step and compute times for the straggler scores (straggler::Tracker, not
  // scored), of the group being watched; empty before the first poll (any thread).
  std::vector<straggler::RankStats> straggler_stats() const;

  // The running group's progress for the goodput accounting (agent/goodput.h), read from the
  // board now: the slowest attached rank's steps and last step, the latest first step, the
  // first resume any rank reported and the longest checkpoint load (any thread). Of the local
  // ranks `only` alone when it is not empty (the replacements of a re-formed group, whose
  // records start with it).
  goodput::Progress goodput_progress(const std::vector<int>& only = {}) const;

  // The sum of the attached ranks' heartbeats (every progress event adds 1), read now; nullopt
  // when no rank is attached (a program without libtrun_worker). Any thread.
  std::optional<uint64_t> progress_events() const;

  // Polls made so far (tests wait on it).
  uint64_t polls() const { return polls_.load(std::memory_order_relaxed); }

 private:
  void thread_main();
  void poll_once();
  // Empties the eventfd (it is non-blocking).
  void drain_notify();
  // Whether the verdict names nobody on this node while members of its group are elsewhere.
  static bool waits_for_other_nodes(const hang::Verdict& v,
                                    const std::vector<hang::RankProgress>& ranks);

  std::unique_ptr<ProgressMonitor> board_;
  HangWatchOptions options_;
  hang::TimeoutRule rule_;      // the thread's alone while it runs (begin_group resets nothing)
  straggler::Tracker tracker_;  // under mu_; reset by begin_group
  int event_fd_ = -1;

  mutable std::mutex mu_;  // guards rule_, active_, reforming_, finding_, stop_; held for a poll
  std::condition_variable cv_;
  bool active_ = false;
  bool reforming_ = false;  // begin_reformation() .. end_reformation(): no judging
  bool stop_ = false;
  std::optional<Finding> finding_;
  std::atomic<uint64_t> polls_{0};
  std::thread thread_;
};

}  // namespace trun::agent
