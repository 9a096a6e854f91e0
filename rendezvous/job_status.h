#pragma once
// A job's rendezvous state as `trun status` shows it, read through one API that each backend
// implements: the current round, its members, the next round's joiners and why the round ended.
//
// Read-only: a JobReader only gets keys and counts tickets; it never waits for a key, joins or
// writes, so the job does not notice it. Not thread-safe; one reader per command. Each read is
// bounded by the reader's timeout.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rendezvous/handler.h"
#include "rendezvous/options.h"

namespace trun::rendezvous {

// Nothing of the job's rendezvous is where read_job_status looked.
class NoSuchJobError : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

// A read-only view of where a job's state is (its store, or its etcd cluster).
class JobReader {
 public:
  virtual ~JobReader() = default;
  // The value, or nullopt when the key does not exist. Never waits for the key.
  virtual std::optional<std::string> get(const std::string& key) = 0;
  // A rendezvous counter (tickets, arrivals); 0 when it does not exist.
  virtual int64_t counter(const std::string& key) = 0;
};

// Where a job's state is.
struct JobStateSource {
  BackendKind backend = BackendKind::kStatic;
  // c10d and static: the store (the first entry); etcd: the cluster's members, tried in order.
  std::vector<std::pair<std::string, uint16_t>> endpoints;
  std::string etcd_prefix = "/";                               // etcd: --rdzv-conf etcd_prefix
  std::string store_token;                                     // c10d and static
  std::chrono::milliseconds timeout{std::chrono::seconds(5)};  // each read
  // Connecting, retries included: nothing listening is an answer, not something to wait for.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(1)};
};

// Connects to the job's store or etcd cluster. Throws what the client throws when it cannot
// (store::StoreError, std::runtime_error).
std::unique_ptr<JobReader> open_job_reader(const JobStateSource& source);

// c10d: of an --rdzv-endpoint list, the entry where the job's store is now, as an agent picks
// it: a later entry whose store took over after a failover (it answers for `run_id`'s failover
// key, each probe within 500 ms), else the first.
size_t current_c10d_store(const std::vector<std::pair<std::string, uint16_t>>& endpoints,
                          const std::string& run_id, const std::string& store_token);

// One node: a member of the current round or a joiner of the next one.
struct JobNode {
  std::string node_id;
  std::string addr;
  int group_rank = -1;  // in the current round; -1 for a node that waits
  // alive: a member of the current round, which runs; left: it left (or died) and ended it;
  // rejoining: a member that has joined the next round; waiting: joined the next round and
  // not a member of the current one; re-forming: a member that has not joined the next one yet;
  // finished: a member of the last round of a closed job.
  std::string state;
};

struct JobState {
  bool closed = false;
  int64_t round = -1;       // the last round that formed, -1 when none did yet
  int64_t next_round = -1;  // the round nodes join now (-1: closed)
  std::string round_state;  // forming, running, over, closed
  std::string over_cause;   // why the current round ended (the root cause of a failure)
  std::vector<JobNode> nodes;
  int waiting = 0;  // nodes that joined the next round and are not members of the current one
};

// The state of job `run_id` as backend `backend` keeps it: c10d and etcd, the round key, the
// last completed round's result and over log, and the tickets of the round being gathered;
// static, its rounds of barriers. At most 4096 nodes. Throws NoSuchJobError, RendezvousError
// (malformed state) or store::StoreError.
JobState read_job_status(BackendKind backend, JobReader& reader, const std::string& run_id);

}  // namespace trun::rendezvous
