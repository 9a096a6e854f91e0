#pragma once
// The model behind `trun timeline`'s page (launcher/timeline.h), private to launcher/timeline*:
// events grouped by agent into nodes (their rendezvous waits, restarts, round ends and worker
// lifetimes as bars per local rank) and the rounds formed across nodes, each failed round's
// root cause marked. Pure: no I/O, no drawing (launcher/timeline.cpp draws it).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "launcher/timeline.h"

namespace trun::launcher::timeline_model {

// `s` cut to at most `n` bytes (then ending in "..."), not inside a UTF-8 sequence.
std::string clip(const std::string& s, size_t n);

enum class Outcome { kSucceeded, kFailed, kSignaled, kStopped, kUnknown };

struct WorkerBar {
  int64_t start = 0, end = 0;
  bool ended = false;
  bool root_cause = false;  // the earliest failure of its round across nodes (mark_root_causes)
  Outcome outcome = Outcome::kUnknown;
  std::optional<int64_t> global_rank, role_rank, pid, exitcode, round, attempt;
  std::string signal, raw_error;
};

struct Mark {
  int64_t ts = 0;
  std::string text;  // the tooltip
};

struct Restart {
  int64_t ts = 0;
  bool counted = true;
  std::string text;
};

struct Wait {
  int64_t start = 0, end = 0;
  bool open = true;
  std::string text;
};

// trun.agent.badput: an interval of time lost (agent/goodput.h), drawn under the node's bar.
struct Badput {
  int64_t start = 0, end = 0;
  std::string cause;
};
inline constexpr size_t kMaxBadputPerNode = 4096;

struct Node {
  std::string run_id, hostname, node_id;
  int64_t pid = 0;
  int64_t first = 0, last = 0;
  std::optional<int64_t> start, stop, exit_code, nproc, max_restarts, round, group_rank;
  std::string stop_state, entrypoint;
  std::vector<Wait> waits;
  std::vector<Restart> restarts;
  std::vector<Mark> round_ends;
  std::vector<Mark> hangs;                            // trun.hang: the verdict
  std::vector<Mark> slow_ranks;                       // trun.agent.straggler: the flag
  std::vector<Badput> badput;                         // trun.agent.badput (the first kMax...)
  std::map<int64_t, std::vector<WorkerBar>> workers;  // by local rank
  std::map<int64_t, size_t> open_bars;                // worker pid -> index in workers[lr]
  std::map<int64_t, int64_t> open_rank;               // worker pid -> local rank

  std::string label() const {
    if (!node_id.empty()) return node_id;
    return hostname + ":" + std::to_string(pid);
  }
};

struct RoundMember {
  std::string node;
  std::optional<int64_t> group_rank;
};

struct Round {
  int64_t ts = 0;  // the earliest node's round_formed
  std::string run_id;
  int64_t number = 0;
  std::optional<int64_t> group_world_size, world_size;
  std::vector<RoundMember> members;
};

// Feed it the events in timestamp order (add), then finish() once and read nodes() and
// rounds(). Every text taken from an event is cut (kMaxLabelBytes, kMaxTextBytes).
class TimelineModel {
 public:
  void add(const TimelineEvent& e);
  // Ends what the log leaves open (a worker or a rendezvous wait still running at its node's
  // last event), orders the nodes by their first event and the rounds by time, and marks the
  // root causes.
  void finish();

  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<Round>& rounds() const { return rounds_; }

 private:
  Node& node_of(const nlohmann::json& md, int64_t ts);
  void on_rendezvous_end(Node& n, const TimelineEvent& e, int64_t ts);
  void on_round_formed(Node& n, const nlohmann::json& md, int64_t ts);
  void on_worker_started(Node& n, const nlohmann::json& md, int64_t ts);
  void on_worker_exited(Node& n, const nlohmann::json& md, int64_t ts);
  void mark_root_causes();

  std::vector<Node> nodes_;
  std::map<std::tuple<std::string, std::string, int64_t>, size_t> index_;
  std::vector<Round> rounds_;
  std::map<std::pair<std::string, int64_t>, size_t> round_index_;
};

}  // namespace trun::launcher::timeline_model
