#pragma once
// `trun status`, reading: a job's state as its rendezvous backend reads it
// (rendezvous::read_job_status: the current round, its members, the next round's joiners, why
// the round ended) and the status record each agent publishes beside it (agent/node_status.h).
//
// Read-only, through a rendezvous::JobReader (rendezvous/job_status.h): bounded by its timeout,
// never waits for a key, joins or writes.

#include <optional>
#include <string>
#include <vector>

#include "agent/node_status.h"
#include "rendezvous/job_status.h"

namespace trun::launcher::status {

// One node as status shows it: a member of the current round or a joiner of the next one.
struct NodeRow {
  std::string node_id;
  std::string addr;
  int group_rank = -1;  // in the current round; -1 for a node that waits
  std::string state;    // rendezvous::JobNode::state
  std::optional<agent::NodeStatus> record;
};

// What status shows of a job. run_id, backend and endpoint are the caller's to fill in.
struct JobStatus {
  std::string run_id, backend, endpoint;
  bool closed = false;
  int64_t round = -1;       // the last round that formed, -1 when none did yet
  int64_t next_round = -1;  // the round nodes join now
  std::string round_state;  // forming, running, over, closed
  std::string over_cause;   // why the current round ended (its first over record)
  std::vector<NodeRow> nodes;
  int waiting = 0;  // nodes that joined the next round and are not members of the current one
  // Nodes kept out of the rounds by their agents (unhealthy, excluded: state "outside"), listed
  // after the others; they listed themselves (agent/node_status.h, outside_slot_key).
  int outside = 0;
};

// Fills *js with the job's rendezvous state and each node's status record, where its agent
// published one (run_id, backend and endpoint kept). Throws rendezvous::NoSuchJobError,
// rendezvous::RendezvousError (malformed state) or store::StoreError.
void read_job(rendezvous::BackendKind backend, rendezvous::JobReader& reader, JobStatus* js);

}  // namespace trun::launcher::status
