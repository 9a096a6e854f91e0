#pragma once
// Hang detection's rules (issue 36, docs/hangs.md), as pure functions and one learner, with no
// I/O: what the progress board (base/progress_board.h) says about each rank, as plain data
// (RankProgress, which ProgressMonitor's snapshots fill and tests write by hand); the timeout
// rule (TimeoutRule: how long a rank may go without progress, learned per section class); and
// the wavefront verdict (judge: which rank is behind the others, in one line).
//
// Wired into the agent by agent/hang_watch.h; agreed across nodes by agent/hang_agree.h.

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/progress_board.h"

namespace trun::agent::hang {

using base::progress::Op;
using base::progress::Phase;
using base::progress::State;

// One collective of a group's ring.
struct CollectiveRecord {
  uint64_t seq = 0;
  Op op = Op::kNone;
  uint32_t dtype = 0;  // base::progress::dtype_name
  uint64_t count = 0;
  State state = State::kEmpty;
  int64_t issued_ns = 0;
  int64_t started_ns = 0;
  int64_t finished_ns = 0;
};

// One process group as one rank sees it.
struct GroupProgress {
  uint64_t key = 0;  // the same group on every rank
  int number = -1;   // Worker::new_group's number; -1: a group built another way
  int group_rank = 0;
  int group_size = 0;
  uint64_t issued = 0;                   // last issued seq (0: none)
  uint64_t completed = 0;                // last finished seq
  std::vector<CollectiveRecord> recent;  // oldest first

  // The ring's record of `seq`, if still there.
  const CollectiveRecord* find(uint64_t seq) const;
  // "group 0", or "group <key in hex>" for a group without a number.
  std::string name() const;
};

enum class ProcessState { kUnknown, kRunning, kStopped, kGone };

// One rank, from a snapshot of its record (plus where it runs, which the board does not hold).
struct RankProgress {
  int rank = -1;
  int local_rank = -1;
  int pid = 0;
  std::string node;              // the node's name in messages
  bool attached = false;         // a worker took the record (pid != 0)
  bool moving = false;           // the record changed while it was read: it is making progress
  uint64_t heartbeat = 0;        // progress events so far
  int64_t last_progress_ns = 0;  // CLOCK_MONOTONIC
  int64_t attached_ns = 0;
  Phase phase = Phase::kNone;
  std::string section;   // Phase::kSection: its name ("other" past the table)
  bool starting = true;  // in init(), or no progress since init() returned
  uint64_t steps = 0;
  int64_t collective_ns = 0;  // time inside collectives so far (RankRecord::collective_ns)
  // The goodput fields (RankRecord::first_step_ns ... checkpoint_load_ns; agent/goodput.h).
  int64_t first_step_ns = 0;
  int64_t last_step_ns = 0;
  uint64_t resumed_step_plus1 = 0;
  int64_t checkpoint_load_ns = 0;
  ProcessState process = ProcessState::kUnknown;
  std::vector<GroupProgress> groups;

  // The first collective it issued and has not finished, in any group (nullptr: none).
  const GroupProgress* waiting_group() const;
};

// ---- The timeout rule -------------------------------------------------------------------------

// Which timeout applies: start-up (until the first progress after init()), a checkpoint save, a
// named section, or everything else (the training loop: "step").
struct TimeoutClass {
  enum Kind { kStartup, kStep, kCheckpoint, kSection };
  Kind kind = kStep;
  std::string section;  // kSection only

  bool operator<(const TimeoutClass& o) const {
    return kind != o.kind ? kind < o.kind : section < o.section;
  }
  bool operator==(const TimeoutClass& o) const { return kind == o.kind && section == o.section; }
  // "startup", "step", "checkpoint", "section eval".
  std::string name() const;
};

TimeoutClass class_of(const RankProgress& r);

// How one class's timeout is computed: until `warmup_intervals` intervals have been seen, a rank
// may go `warmup_timeout_s` without progress (and those intervals are not learned from: a first
// step that loads a model for minutes does not inflate the timeout of every later step); after
// that, max(floor_s, factor x the longest interval seen since). `fixed_s` > 0 replaces all that
// with a fixed timeout; `enabled` false never times the class out.
struct ClassPolicy {
  double floor_s = 10;
  double factor = 3;
  int warmup_intervals = 5;
  double warmup_timeout_s = 1800;
  double fixed_s = 0;
  bool enabled = true;
};

struct TimeoutOptions {
  bool enabled = true;
  ClassPolicy startup{0, 0, 0, 0, 1800, true};       // fixed: 30 min to first progress
  ClassPolicy step{10, 3, 5, 1800, 0, true};         // the training loop
  ClassPolicy checkpoint{120, 3, 2, 1800, 0, true};  // a checkpoint save
  ClassPolicy section{10, 3, 3, 1800, 0, true};      // each named section (learned apart)
  std::map<std::string, ClassPolicy> sections;       // per section name, replacing it
};

// The learner: intervals between progress events, per class, fed from successive snapshots.
// Not thread-safe (one monitor owns it).
class TimeoutRule {
 public:
  explicit TimeoutRule(TimeoutOptions options = {});

  // An interval of `seconds` without progress ended in class `c` (the rank made progress).
  void observe(const TimeoutClass& c, double seconds);
  // Feeds a fresh set of snapshots: for each rank whose heartbeat moved since the previous call,
  // the interval from its previous last progress to the new one, in the class it was in.
  // (Sampled, so an interval may span several events: an upper bound, which errs on the side of
  // a longer timeout.) A rank whose pid changed starts afresh.
  void update(const std::vector<RankProgress>& ranks);
  // Forgets each rank's last progress: the next update() starts afresh, so that no interval is
  // learned across what came before (a group's re-formation around a replaced worker, whose pause
  // is no step: agent/hang_watch.h).
  void forget_progress() { last_.clear(); }

  // How long a rank of class `c` may go without progress; nullopt: never timed out.
  std::optional<double> timeout_s(const TimeoutClass& c) const;

  struct Learned {
    int intervals = 0;     // seen, warm-up included
    double longest_s = 0;  // longest after the warm-up
    bool operator==(const Learned& o) const {
      return intervals == o.intervals && longest_s == o.longest_s;
    }
    // The most intervals and the longest interval of this and `o` (how nodes' values combine).
    void merge(const Learned& o) {
      intervals = std::max(intervals, o.intervals);
      longest_s = std::max(longest_s, o.longest_s);
    }
  };
  Learned learned(const TimeoutClass& c) const;
  // Every class seen so far.
  const std::map<TimeoutClass, Learned>& all_learned() const { return learned_; }
  // What other nodes learned (agent/hang_agree.h), or an earlier group: per class, the most
  // intervals and the longest interval of this rule's and `other`. A class whose adopted
  // intervals complete its warm-up is out of the warm-up here too.
  void adopt(const TimeoutClass& c, const Learned& other);
  const TimeoutOptions& options() const { return options_; }

 private:
  const ClassPolicy& policy(const TimeoutClass& c) const;
  struct Last {
    int pid = 0;
    uint64_t heartbeat = 0;
    int64_t last_progress_ns = 0;
    TimeoutClass cls;
  };
  TimeoutOptions options_;
  std::map<TimeoutClass, Learned> learned_;
  std::map<int, Last> last_;  // by rank
};

// ---- The wavefront verdict --------------------------------------------------------------------

struct Verdict {
  enum Kind {
    kNone,               // nobody is over its timeout
    kNeverIssued,        // the culprit never issued the collective the others wait in
    kMismatch,           // it issued a different op, dtype or count at that sequence number
    kStopped,            // it is stopped (SIGSTOP, a debugger) in the collective the others wait in
    kOutsideCollective,  // no progress and in no collective, with nobody waiting for it
    kAllWaiting,         // every rank waits in the same collective: no rank is behind
  };
  Kind kind = kNone;
  bool hung = false;
  std::vector<int> culprits;  // global ranks (first: the one the summary names)
  std::vector<int> waiting;   // the ranks that wait for them
  int group = -1;             // the group's number (-1: none or unnumbered)
  uint64_t seq = 0;           // the collective's sequence number in that group
  double idle_s = 0;          // the culprit's time without progress
  std::string summary;        // one line, e.g. "rank 3 (node n1, pid 4711) made no progress ..."
};

// "rank 3", "ranks 0-2 and 4-7", "ranks 0, 2 and 5".
std::string format_ranks(std::vector<int> ranks);

// The verdict at `now_ns` (CLOCK_MONOTONIC) over the snapshots of every rank (of one node now;
// of every node once snapshots go through the store). A rank that waits in a collective is
// judged by the rank it waits for: the job is hung when a culprit (the rank behind the
// wavefront) is over its own class's timeout, or when nobody is behind and the waiters are over
// theirs. Ranks not attached, or moving, are never culprits.
Verdict judge(const std::vector<RankProgress>& ranks, const TimeoutRule& rule, int64_t now_ns);

}  // namespace trun::agent::hang
