#pragma once
// NodeStatus: the small record each agent publishes in the job's store for `trun status`
// (launcher/status_command.h): what the rendezvous keys do not say (workers per node, restarts,
// the last failure, what the agent is doing).
//
// Where: node_status_key(run_id, node_id), in the job's store without a round prefix (the c10d
// or static store, or etcd under its prefix), so a record outlives rounds and the node itself.
// When: the agent writes it (one set) when a round forms, when its workers fail, before a
// restart and when the job ends on this node; never while idle.
//
// Thread safety: plain values and pure functions.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace trun::agent {

// One local rank's step times (agent/straggler.h), as its node measured them.
struct RankStatus {
  int rank = -1;
  int local_rank = -1;
  uint64_t steps = 0;
  double step_s = 0;     // 0: not measured
  double compute_s = 0;  // of it, outside collectives
  double self_score = 1;
};

struct NodeStatus {
  std::string node_id;
  std::string hostname;
  std::string addr;    // how other nodes reach it (the rendezvous' local_addr)
  int64_t pid = 0;     // the agent's pid
  int64_t round = -1;  // the round it last formed
  int group_rank = -1;
  int group_world_size = 0;
  int local_world_size = 0;  // --nproc-per-node
  int restarts = 0;
  int max_restarts = 0;
  // rendezvous, unhealthy, running, stopping, succeeded, failed, signaled
  std::string state;
  // Why the health gate keeps this node out (agent/health_gate.h); empty when it passed.
  std::string unhealthy;
  // While the node sits out an exclusion (state "excluded", docs/health.md): why, and until when
  // (unix seconds); empty and 0 otherwise.
  std::string excluded;
  double excluded_until = 0;
  // The last failure of this node's workers, one line; empty when none.
  std::string last_failure;
  double last_failure_at = 0;  // unix seconds; 0 when none
  // The root cause of the last round that failed, across nodes (agent/failure_report.h,
  // RootCause): the earliest failure of every node's report, which may be another node's.
  std::string root_cause;       // one line (failure_line); empty when none
  std::string root_cause_node;  // the node it happened on
  double root_cause_at = 0;     // when that worker exited, unix seconds; 0 when unknown
  int64_t root_cause_round = -1;
  double updated_at = 0;  // unix seconds
  // This node's ranks' step times while a group runs (a libtrun_worker program); empty otherwise.
  std::vector<RankStatus> ranks;
  // Ranks the judging node flagged as slow (docs/health.md), global ranks; that node's record only.
  std::vector<int> slow_ranks;
  // This node's goodput (agent/goodput.h) when the record was written: its share of the time in
  // the job that moved the model forward (-1: nothing measured yet), that time, and the badput
  // by cause (only causes above 0).
  double goodput_ratio = -1;
  double goodput_wall_s = 0;
  std::map<std::string, double> badput_s;
};

// "trun/status/<run_id>/<node_id>".
std::string node_status_key(const std::string& run_id, const std::string& node_id);
// One JSON object.
std::string encode_node_status(const NodeStatus& status);
// nullopt when `text` is not such a record (a reader of an older or newer agent goes on).
std::optional<NodeStatus> decode_node_status(const std::string& text);

// Nodes outside the rounds (unhealthy before they join, excluded): the rendezvous keys do not
// list them, so each such agent takes a slot once per node id: an add() on
// outside_count_key(run_id) gives k >= 1, and outside_slot_key(run_id, k) holds its node id;
// `trun status` reads the slots (the latest kMaxOutsideSlots) and their status records.
constexpr int64_t kMaxOutsideSlots = 256;
std::string outside_count_key(const std::string& run_id);
std::string outside_slot_key(const std::string& run_id, int64_t k);

// A node's exclusion (docs/health.md), kept in the job's store so that it outlives the agent: a
// restarted agent on the same node sits out what is left of it, and its next exclusion is
// longer. A node here is its host name and --local-addr (several agents on one host need
// distinct --local-addr for their exclusions to be told apart).
struct ExclusionRecord {
  int times = 0;        // exclusions so far
  double until = 0;     // unix seconds: the end of the last one
  std::string reason;   // why the last one
  std::string node_id;  // the agent that wrote it (a restarted agent retires its status record)
};
std::string exclusion_key(const std::string& run_id, const std::string& node_name);
// Where the judging node blames a node for its slow rank (--straggler-action=exclude): a JSON
// object {round, rank, reason} under the blamed node's id.
std::string blame_key(const std::string& run_id, const std::string& node_id);
std::string encode_exclusion(const ExclusionRecord& record);
std::optional<ExclusionRecord> decode_exclusion(const std::string& text);

}  // namespace trun::agent
