#pragma once
// `trun status`, reading: a job's state as the rendezvous left it in the store or etcd (the
// current round, its members, the next round's joiners, why the round ended) and the status
// record each agent publishes there (agent/node_status.h).
//
// Read-only: a Reader only gets keys and counts tickets; it never waits for a key, joins or
// writes. Not thread-safe; one Reader per command. Each read is bounded by the timeout of the
// options the Reader was made with.

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/node_status.h"

namespace trun::store {
struct TcpStoreOptions;
}
namespace trun::rendezvous::etcd {
struct KvOptions;
}

namespace trun::launcher::status {

// Thrown by read_dynamic / read_static when nothing of the job's rendezvous is there.
struct NoSuchJob : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A read-only view of the job's state: keys and the rendezvous' ticket counters.
class Reader {
 public:
  virtual ~Reader() = default;
  // The value, or nullopt when the key does not exist. Never waits for the key.
  virtual std::optional<std::string> get(const std::string& key) = 0;
  // A rendezvous counter (tickets, arrivals); 0 when it does not exist.
  virtual int64_t counter(const std::string& key) = 0;
};

// Connect to the job's store (c10d, static) or etcd cluster. Throw what the client throws when
// it cannot connect (store::StoreError, std::runtime_error).
std::unique_ptr<Reader> make_store_reader(const store::TcpStoreOptions& o);
std::unique_ptr<Reader> make_etcd_reader(const rendezvous::etcd::KvOptions& o);

// One node as status shows it: a member of the current round or a joiner of the next one.
struct NodeRow {
  std::string node_id;
  std::string addr;
  int group_rank = -1;  // in the current round; -1 for a node that waits
  // alive: a member of the current round, which runs; left: it left (or died) and ended it;
  // rejoining: a member that has joined the next round; waiting: joined the next round and
  // not a member of the current one; re-forming: a member that has not joined the next one yet.
  std::string state;
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
};

// c10d and etcd: the round key, the last completed round's result and over log, the tickets of
// the round being gathered. Throws NoSuchJob, rendezvous::RendezvousError (malformed state) or
// store::StoreError.
JobStatus read_dynamic(Reader& r, const std::string& run_id);
// static: the rounds are barriers of every rank. Throws as read_dynamic.
JobStatus read_static(Reader& r, const std::string& run_id);
// Each node's status record, where its agent published one.
void read_records(Reader& r, JobStatus* js);

}  // namespace trun::launcher::status
