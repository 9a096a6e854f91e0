#pragma once
// Goodput accounting (issue 39, docs/goodput.md): which share of this node's time in the job moved
// the model forward, and where the rest went, live, from what the agent already knows (its own
// phases) and what libtrun_worker writes on the progress board (steps, the step a group resumed
// from, the time its checkpoint load took).
//
// The node's time since its agent started is cut into consecutive intervals by the agent's phase
// (rendezvous, running, stopping, outside the job, other) and each interval goes to one bucket:
//
//   startup          from the agent's start to the first step of the job's first group (when
//                    this node was in that first group; a node that joined a running job, a spare,
//                    counts its time before its first group as outside)
//   rendezvous       waiting for a round after the job had started
//   restart          a group's start to its first step (spawning, init(), the first step), less
//                    its checkpoint load; after failed workers were replaced alone (a resilient
//                    loop: replaced()), the failure to the replacements' first step (spawning
//                    them, the group's re-formation, the state they get from a live peer)
//   checkpoint_load  what Checkpointer::load_latest took (RankRecord::checkpoint_load_ns)
//   detection        the last step before a group stopped to the moment the stop began
//   stopping         the stop began to the workers gone
//   redone           steps lost: a group that resumed from step S after the job had reached step
//                    M redoes M - S steps, each worth the reference step time
//   slow             a running group's time beyond its steps times the reference step time (a
//                    slow rank, a noisy node, a hang before its verdict)
//   other            the exit barrier, the end of the job
//   (outside)        not in the job: unhealthy, excluded, waiting as a spare before joining; not
//                    part of the wall time
//
// productive = (steps taken - steps redone) x the reference step time, where the reference is the
// median of the step times measured while groups ran (one sample per progress() call with new
// steps). A running interval splits exactly into productive + redone + slow, so
// wall = productive + sum(badput). A program that writes no board (Python, plain programs) has no
// steps: its running time counts as productive and only the agent-side causes are measured.
//
// Pure and single-threaded (the agent's thread); times are monotonic seconds.

#include <array>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace trun::agent::goodput {

enum class Cause : int {
  kStartup,
  kDetection,
  kStopping,
  kRendezvous,
  kRestart,
  kCheckpointLoad,
  kRedone,
  kSlow,
  kOther,
  kCount,  // not a cause: their number
};
inline constexpr int kCauses = static_cast<int>(Cause::kCount);
// "startup", "detection", "stopping", "rendezvous", "restart", "checkpoint_load", "redone",
// "slow", "other": the label values of trun_badput_seconds_total{cause}.
const char* cause_name(Cause c);

// What the board says of the running group, over this node's ranks (the slowest one's steps).
struct Progress {
  bool attached = false;  // a libtrun_worker rank reports; false: no step information
  uint64_t steps = 0;     // steps this group took
  double first_step = 0;  // when its first step ended (0: none yet)
  double last_step = 0;   // when its last step ended
  std::optional<uint64_t> resumed_step;  // the step its checkpoint load resumed from (0: none)
  double load_seconds = 0;               // the checkpoint load
};

struct Totals {
  double wall = 0;        // time in the job: the sum of productive and every badput cause
  double productive = 0;  // steps that count toward the model x step_seconds
  std::array<double, kCauses> badput{};
  double outside = 0;
  double step_seconds = 0;  // the reference step time; 0 before one was measured
  uint64_t steps = 0;       // steps taken by this node's groups
  uint64_t steps_redone = 0;
  double ratio() const { return wall > 0 ? productive / wall : 0; }
  double of(Cause c) const { return badput[static_cast<int>(c)]; }
};

// A closed interval of badput, for the event log and the timeline.
struct Interval {
  Cause cause;
  double begin = 0;
  double end = 0;
};

enum class Phase { kRendezvous, kRunning, kStopping, kOutside, kOther };

class Account {
 public:
  explicit Account(double now) : since_(now) {}

  // The agent's phase changes at `now`. Call progress() first when leaving kRunning, so that the
  // group's last step is known. `joined_late` (on the first kRunning): this node's first group is
  // not the job's first one (a spare, an agent started again): its time so far was outside.
  void set_phase(Phase p, double now, bool joined_late = false);
  // The board of the running group at `now` (kRunning only; ignored otherwise).
  void progress(const Progress& p, double now);
  // Failed workers of the running group were replaced alone at `now` (kRunning only): the group's
  // interval ends here as if it had stopped (from its last step: detection) and a new one begins,
  // whose time to its first step is restart time. From here, progress() must describe the
  // replacements alone (their records start now; the survivors' first steps are old). No step is
  // redone: the survivors keep their state, and a resume the replacements report is not a loss.
  void replaced(double now);
  // The running group's ranks here re-form at `now` without a replacement here (resilient loops:
  // a node joined or left, or a worker was replaced on another node). Call progress() first. The
  // group's interval ends as at replaced(): from its last step to `now` is detection, except that
  // the time after `round_since` (when the round that brought the re-formation began, if one did)
  // is rendezvous; a new interval begins whose time to its first step is restart time. The ranks'
  // records go on counting across a re-formation: from here the account takes only the steps past
  // those it last sampled, and the first of them ended, if it was not sampled alone, as many
  // reference step times before the last one as steps followed it. No step is redone.
  void reformed(double now, std::optional<double> round_since = std::nullopt);

  // The sums up to `now`. A running group's time since its last sampled step counts as
  // productive until the group ends (then it is detection time, if no step followed).
  Totals totals(double now) const;
  // The badput intervals closed since the last call (startup, rendezvous, restart,
  // checkpoint_load, detection, stopping, redone), oldest first; at most kMaxPending are kept.
  std::vector<Interval> take_intervals();

  static constexpr size_t kMaxSamples = 512;
  static constexpr size_t kMaxPending = 256;

 private:
  // Ends the interval under way at `now` into its bucket. `provisional`: for totals() only.
  void close(double now, bool provisional = false);
  void add(Cause c, double begin, double end, bool interval);
  double reference() const;
  // `p` relative to base_ (reformed()).
  Progress since_base(const Progress& p);

  Phase phase_ = Phase::kRendezvous;
  double since_;
  bool started_ = false;      // a group of this node took a step
  bool joined_late_ = false;  // decided at the first kRunning
  bool ran_ = false;          // a kRunning phase began
  bool sdk_seen_ = false;     // a group's ranks wrote the board: a group that does not failed
  std::array<double, kCauses> time_{};
  double outside_ = 0;
  double running_ = 0;           // first step to last step of every group with steps
  double unmeasured_ = 0;        // running time of groups without a board
  uint64_t steps_executed_ = 0;  // steps inside running_ (a group's first step is in restart)
  uint64_t steps_ = 0;
  uint64_t redone_ = 0;
  uint64_t reached_ = 0;  // the highest step of the current chain (M)
  // The running group's board, as last sampled (since the re-formation, if it re-formed).
  Progress group_{};
  // A group that re-formed without a replacement (reformed()): its records as sampled then, when
  // it happened, and when its first step after it ended (once seen).
  Progress raw_{};  // the last sample as given to progress()
  std::optional<Progress> base_;
  double rebased_at_ = 0;
  std::optional<double> first_new_;
  bool resume_seen_ = false;
  uint64_t group_redone_ = 0;  // the running group's steps redone
  // Before this node's first group: startup when that group is the job's first, else outside.
  double pre_job_ = 0;
  std::vector<Interval> pre_job_intervals_;
  std::deque<double> samples_;  // step times
  std::vector<Interval> pending_;
};

}  // namespace trun::agent::goodput
