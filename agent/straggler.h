#pragma once
// Straggler scores (issue 37, docs/health.md): which rank the others wait for, from the progress
// board (base/progress_board.h) that libtrun_worker already writes for hang detection.
//
// Per rank, over the last `measure` seconds: its steps (DDP steps and heartbeats), the wall time,
// and the time it spent inside collectives (RankRecord::collective_ns). A step's time is the same
// on every rank of a data-parallel job (the collectives keep them in step); what differs is where
// it goes. A rank that computes slower arrives last at each collective and waits little in it,
// while the others wait for it: its time outside collectives per step ("compute") is the largest.
//
//   compute_s   = (wall - collective time) / steps           over the measure interval
//   slower      = compute_s / median(compute_s of the other ranks) - 1   (0.3: 30 % slower)
//   score       = 1 / (1 + max(slower, 0))                   (1: not behind; NVIDIA's "relative")
//   self_score  = best compute_s this rank had in this group / compute_s now ("individual")
//
// The Judge flags a rank whose `slower` stays above the threshold for the whole window, once,
// and says when it recovers.
//
// Pure and single-threaded: the hang watch's thread feeds the Tracker, the agent's thread scores
// and judges (any set of ranks: one node's, or the whole job's from every node's status record).

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "agent/hang_rules.h"

namespace trun::agent::straggler {

struct Options {
  double threshold = 0.20;    // --straggler-threshold (a fraction: 0.2 = 20 % slower)
  double window_s = 30;       // --straggler-window: how long a rank must stay slower
  double measure_s = 10;      // the interval each rank's step time is measured over
  double sample_every_s = 1;  // the Tracker keeps one sample per this interval
  // --straggler-action=exclude: the flagged rank's node is excluded when a spare waits.
  bool exclude = false;
};

// One rank's numbers. step_s == 0: not measured yet (fewer than one step in the interval).
struct RankStats {
  int rank = -1;
  int local_rank = -1;
  std::string node;     // its host name
  std::string node_id;  // its agent's rendezvous id (empty on one node)
  uint64_t steps = 0;
  double step_s = 0;
  double compute_s = 0;
  double best_compute_s = 0;
  double slower = 0;
  double score = 1;
  double self_score = 1;
};

// Fills `slower` and `score` of every measured rank against the median of the other measured
// ranks; fewer than two measured ranks: nothing to compare (slower 0, score 1).
void score(std::vector<RankStats>& ranks);

// The index of the rank that is furthest behind, when some rank is `threshold` slower.
std::optional<size_t> slowest(const std::vector<RankStats>& ranks, double threshold);

class Tracker {
 public:
  explicit Tracker(Options options = {}) : options_(options) {}
  // A new group: everything measured goes.
  void reset() { ranks_.clear(); }
  // One snapshot of every local rank at `now_ns` (CLOCK_MONOTONIC). Detached ranks are skipped.
  void observe(const std::vector<hang::RankProgress>& ranks, int64_t now_ns);
  // Every rank seen, with step_s, compute_s, best_compute_s and self_score (not scored).
  std::vector<RankStats> stats() const;

 private:
  struct Sample {
    int64_t t_ns = 0;
    uint64_t steps = 0;
    int64_t collective_ns = 0;
  };
  // Seconds per step and, of it, outside collectives, from `a` to `b`: false when the interval is
  // shorter than half of measure_s or holds no step.
  bool measure(const Sample& a, const Sample& b, double* step_s, double* compute_s) const;
  struct Rank {
    int pid = 0;
    int rank = -1;
    int local_rank = -1;
    std::string node;
    std::deque<Sample> samples;  // oldest first, within measure_s (+ one older)
    double best_compute_s = 0;
  };
  Options options_;
  std::map<int, Rank> ranks_;  // by local rank
};

// The persistence rule over scored ranks (keyed by global rank).
class Judge {
 public:
  explicit Judge(Options options = {}) : options_(options) {}
  void reset() { state_.clear(); }
  struct Change {
    enum Kind { kFlagged, kRecovered } kind;
    RankStats rank;
    double slow_for_s = 0;  // how long it had been slower (kFlagged)
  };
  // Feeds one scoring at `now_s` (any monotonic seconds); returns the ranks newly flagged or
  // recovered.
  std::vector<Change> update(const std::vector<RankStats>& scored, double now_s);
  // Ranks flagged now.
  std::vector<int> flagged() const;

 private:
  struct State {
    std::optional<double> slow_since;
    bool flagged = false;
  };
  Options options_;
  std::map<int, State> state_;
};

// "rank 5 (local_rank 1) on node-b is 31% slower than the others (step 0.412 s, 0.301 s outside
// collectives against 0.230 s)".
std::string describe(const RankStats& r, double reference_compute_s);

}  // namespace trun::agent::straggler
