#pragma once
// RendezvousHandler: what the agent sees of a rendezvous (torchelastic's RendezvousHandler, plus
// push notifications). The module's contract: the handler interface, the registry that creates a
// backend, and (options.h) the options every backend takes.
//
// A rendezvous gathers the nodes of one job into rounds. Each completed round gives every node
// its group rank, the group world size, the ordered list of participants, MASTER_ADDR/PORT and a
// store namespaced for the round. A round stays current until something ends it: a worker failed
// somewhere, a node joined or left, the job was closed. Every node learns of that at once by a
// blocking wait on one store key (wait_round_over / set_round_over_callback) and then calls
// next_rendezvous() to form the next round. Backends: "c10d" (dynamic membership over the trun
// store, dynamic_rendezvous.h), "etcd" (alias "etcd-v2": the same dynamic protocol with its state
// in an etcd cluster, nobody hosting a store; dynamic_rendezvous.h, etcd/backend.h) and "static"
// (fixed nodes and ranks, static_rendezvous.h).
//
// Thread safety: every method may be called from any thread. next_rendezvous() is called by one
// thread at a time; wait_round_over() by one thread at a time (do not mix it with a callback).
// shutdown() unblocks both.
//
// Blocking: creating a handler and its first next_rendezvous() end within join_timeout together
// (or by first_round_deadline); later next_rendezvous() calls block until the round completes
// (at most join_timeout); wait_round_over() until the round ends (at most its timeout);
// everything else is a few store (or etcd) round trips, bounded by read_timeout.
//
// Errors (all derive from RendezvousError): RendezvousClosedError when the job has finished
// (closed) -- the agent should exit; RendezvousTimeoutError when a round did not complete within
// join_timeout; RendezvousOptionError for bad options (at creation); RendezvousError for lost
// stores and shutdown. Store errors are translated, keeping their message.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "rendezvous/options.h"
#include "store/store.h"

namespace trun::rendezvous {

class RendezvousError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The rendezvous was closed: the job has finished (or was stopped). Not recoverable.
class RendezvousClosedError : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};
// A round did not complete within join_timeout (too few nodes). Not retried by the handler.
class RendezvousTimeoutError : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};
// The store was stopped on purpose (its host agent left, the job ended) while this node needed
// it (StoreGoneError underneath): retrying that endpoint cannot help.
class RendezvousStoreGoneError : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};
// Invalid options or --rdzv-conf entries; the message names the option and the value.
class RendezvousOptionError : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

struct Participant {
  std::string node_id;
  std::string addr;  // the address other nodes reach it at (its local_addr)
};

// The participants of a round in group-rank order. Cheap to copy (the text is shared and
// immutable); an entry is decoded when read, so a node of a 2048-node round does not build 2048
// strings it never looks at.
class ParticipantList {
 public:
  ParticipantList() = default;
  explicit ParticipantList(const std::vector<Participant>& list);
  // `text` holds one participant per line from byte `begin` on: "<node_id> <addr>[ <more>]".
  // Throws RendezvousError when it does not hold exactly `count` lines.
  ParticipantList(std::shared_ptr<const std::string> text, size_t begin, size_t count);

  size_t size() const { return starts_.size(); }
  bool empty() const { return starts_.empty(); }
  Participant operator[](size_t rank) const { return at(rank); }
  Participant at(size_t rank) const;  // std::out_of_range past the end
  // The rank of `node_id`, or -1.
  int find(std::string_view node_id) const;
  // Field `f` (0: node id, 1: addr, 2...: backend data) of entry `rank`; empty when missing.
  std::string_view field(size_t rank, int f) const;
  std::vector<Participant> to_vector() const;

 private:
  std::string_view line(size_t rank) const;
  std::shared_ptr<const std::string> text_;
  std::vector<uint32_t> starts_;
};

struct RendezvousInfo {
  int64_t round = 0;  // increases with every completed round (not every attempt)
  int group_rank = 0;
  int group_world_size = 1;
  // Index = group rank. Every member, except in a round of more than
  // RendezvousOptions::max_inline_members nodes: then the first 8 only (size() < group_world_size).
  ParticipantList participants;
  // The job's store, namespaced for this round (`key_prefix`): what the agent may use for its own
  // keys in this round (e.g. an exit barrier). Owned jointly; valid until shutdown().
  std::shared_ptr<store::Store> store;
  std::string key_prefix;
  // The same store without the round prefix, for records that outlive rounds (the agent's
  // status record for `trun status`, agent/node_status.h). Shared with `store`.
  std::shared_ptr<store::Store> run_store;
  // Where the workers' process-group bootstrap lives (MASTER_ADDR/MASTER_PORT).
  std::string master_addr;
  uint16_t master_port = 0;
  // True: MASTER_ADDR/PORT is the agent's store (TORCHELASTIC_USE_AGENT_STORE=True); false: group
  // rank 0's first worker hosts a TCPStore there (a free port that node picked).
  bool use_agent_store = false;
};

// Why a round ended. Delivered to every node of the round.
struct RoundEvent {
  enum class Kind {
    kWorkerFailed,    // node `node_id` reported failed workers (report_worker_failure)
    kNodeJoined,      // a new node waits to join and there is room
    kNodeLeft,        // a node's agent shut down, died, or missed its keep-alives
    kRestart,         // a node asked for a new round (called next_rendezvous mid-round)
    kClosed,          // the job was closed (set_closed); next_rendezvous will throw Closed
    kMembershipLost,  // this node was declared dead (its keep-alives lapsed): rejoin
    kStoreLost,       // this node cannot reach the store any more; next_rendezvous will fail
    kShutdown,        // shutdown() was called on this handler
  };
  Kind kind = Kind::kRestart;
  int64_t round = 0;
  std::string node_id;  // the node concerned (empty for kStoreLost / kShutdown)
  std::string detail;   // free text from the reporter
  // kStoreLost: the store said it stops on purpose (StoreGoneError), rather than dying or
  // becoming unreachable.
  bool store_stopped = false;
  // One line for logs: "round 3 over: worker failure on node b-123: local_rank 2 exited 1".
  std::string describe() const;
};
const char* to_string(RoundEvent::Kind kind);

// One node's report of its failed workers in a round (report_worker_failure), as every node of
// the round reads it back (round_failures).
struct FailureReport {
  std::string node_id;
  std::string detail;  // one line: "rank R (local_rank L) on HOST exited with ...: message"
  // When that node's root-cause worker exited: wall-clock ms since the epoch; -1: unknown (an
  // older trun). Nodes of one job are assumed to share a clock (as torchrun's timestamps do).
  int64_t failed_at_ms = -1;
};
// The root cause of a round among its failure reports: the earliest failure (failed_at_ms), not
// the first report (a node whose worker was SIGKILLed may report after the peer that failed
// because of it, since it stops its other workers first). Ties and reports without a time: the
// one reported first; a report with a time wins over one without. nullopt when `reports` is
// empty.
std::optional<FailureReport> root_cause(const std::vector<FailureReport>& reports);

// --- store failover (c10d; docs/rendezvous.md) -------------------------------------------------
// Where the job's store is after a failover: the agent creates the next handler there
// (RendezvousOptions::endpoint, is_host and store_seed) and forms the next round with it.
struct StoreTarget {
  std::string endpoint;  // HOST:PORT
  bool host = false;     // this node hosts it, started with `seed`
  std::vector<std::pair<std::string, std::string>> seed;
  std::string host_node_id;  // the member of the lost round that hosts it
};

// What a node knew when it lost its store: the round it last formed, why it lost the store, and
// the agent's clock (the failover's waits go through it, so that a fake clock drives them and a
// stop signal interrupts them).
struct LostStore {
  std::string why;             // for the log line
  bool store_stopped = false;  // the store said it stops on purpose, or its host left on purpose
  int64_t round = -1;          // the last round this node formed (-1: none)
  int group_rank = 0;
  int group_world_size = 0;
  ParticipantList participants;
  std::chrono::steady_clock::time_point deadline;  // the end of the agent's rejoin window
  std::function<std::chrono::steady_clock::time_point()> now;
  // Sleeps for the given time, then throws (the agent's RendezvousInterrupted) to abandon the
  // failover when the agent must stop.
  std::function<void(std::chrono::milliseconds)> pause;
};

// One failover of a lost store: the places to form the next round at, best first. It holds no
// reference to the handler that made it (the agent drops that one before it tries a target).
// Use from one thread.
class StoreFailover {
 public:
  virtual ~StoreFailover() = default;
  // The next place to try, after waiting (bounded by the candidates' time to notice the loss and
  // by LostStore::deadline) for a member before this node to host it. nullopt when none is left,
  // or when the lost store answers again (healed()). Logs the members it skips. Throws what
  // LostStore::pause throws.
  virtual std::optional<StoreTarget> next_target() = 0;
  // The lost store answered again while next_target() looked: rejoin it as before instead.
  virtual bool healed() const = 0;
};

class RendezvousHandler {
 public:
  virtual ~RendezvousHandler() = default;

  // Name of the backend ("c10d", "etcd" (also when created as "etcd-v2"), "static").
  virtual std::string backend() const = 0;
  // The job's run id (TORCHELASTIC_RUN_ID).
  virtual std::string run_id() const = 0;
  // This node's id (unique per agent process).
  virtual std::string node_id() const = 0;
  // c10d: HOST:PORT of the store this handler uses (the entry of an endpoint list it found the
  // store at); empty for the other backends.
  virtual std::string store_endpoint() const { return {}; }

  // Joins the next round and blocks until it completes. Called mid-round (no RoundEvent seen
  // yet), it first ends the current round for every node (kRestart). Throws
  // RendezvousClosedError, RendezvousTimeoutError or RendezvousError.
  virtual RendezvousInfo next_rendezvous() = 0;

  // Push notifications for the current round (the one the last next_rendezvous returned).
  // Blocks until the round is over and returns why, or nullopt after `timeout`. Returns the same
  // event again until next_rendezvous() is called. Throws RendezvousError before the first round.
  virtual std::optional<RoundEvent> wait_round_over(std::chrono::milliseconds timeout) = 0;
  // Alternative to wait_round_over: `callback` runs on a handler-owned thread once per round,
  // when it ends (it must not call next_rendezvous itself; post to the agent's loop instead).
  // Set it once, before the first next_rendezvous; an empty function disables it.
  virtual void set_round_over_callback(std::function<void(const RoundEvent&)> callback) = 0;
  // Ends the current round on every node because this node's workers failed (kWorkerFailed with
  // `detail`; `failed_at_ms`: FailureReport::failed_at_ms). When the round is already over (another
  // node's report ended it) the report is still added to the round's reports, so that the root
  // cause can be chosen among all of them (round_failures). Returns after one store request;
  // no-op before the first round and after next_rendezvous().
  virtual void report_worker_failure(const std::string& detail, int64_t failed_at_ms = -1) = 0;
  // After this node's workers of the current round stopped (and it reported its own failure, if
  // any): says so to the others, then waits until every member of the round did so or left, at
  // most `grace`, and returns the round's failure reports in the order they were made (pass 0 to
  // only say so). One call per round; errors as report_worker_failure. The default (a backend
  // without round reports) returns nothing.
  virtual std::vector<FailureReport> round_failures(std::chrono::milliseconds grace) {
    (void)grace;
    return {};
  }

  // True when the rendezvous was closed (by any node).
  virtual bool is_closed() = 0;
  // Closes the rendezvous for every node: the job is over. Current members get kClosed, waiting
  // and late nodes RendezvousClosedError ("job finished"). Idempotent.
  virtual void set_closed() = 0;
  // Nodes waiting for the next round (joined after the current round completed).
  virtual int num_nodes_waiting() = 0;
  // The ids of the nodes waiting for the next round (num_nodes_waiting's), at most `limit`.
  // The default: none.
  virtual std::vector<std::string> waiting_node_ids(int limit) {
    (void)limit;
    return {};
  }
  // The members of the newest round that formed after round `round` (without this node, which
  // has not joined it), 0 when none did. How an agent that sits out learns that the others
  // already went on without it. The default: 0.
  virtual int nodes_in_round_after(int64_t round) {
    (void)round;
    return 0;
  }

  // This handler's store traffic, for metrics (no I/O: counters only; any thread).
  struct StoreStats {
    uint64_t requests_sent = 0;  // requests to the store (or etcd) by the rendezvous protocol
    uint64_t errors = 0;  // of those, the ones that failed (store::StoreError, timeouts included)
    std::optional<uint64_t> requests_served;  // when this node hosts the store: all it served
    // Adds another handler's counts (requests_served stays unset when neither has one).
    StoreStats& operator+=(const StoreStats& o) {
      requests_sent += o.requests_sent;
      errors += o.errors;
      if (o.requests_served) requests_served = requests_served.value_or(0) + *o.requests_served;
      return *this;
    }
  };
  virtual StoreStats store_stats() const { return {}; }
  // The job's store without a round prefix (RendezvousInfo::run_store), usable before this
  // handler's first round: what an agent outside the rounds (unhealthy, excluded) writes its
  // status and its exclusion to. nullptr for a backend that keeps no such store (static).
  virtual std::shared_ptr<store::Store> job_store() { return nullptr; }
  // Whether this handler hosts the job's store (shutdown() stops it). No I/O.
  virtual bool hosts_store() const { return false; }

  // After this handler's store was lost (the round ended with kStoreLost or kMembershipLost, or
  // next_rendezvous failed on it): when the store itself is gone and the backend can move it
  // (c10d with failover on, the default), returns the failover that moves it to a member of
  // `lost.round` -- having logged the loss and where it looks. nullptr: no move is needed (the
  // store still answers) or possible (logged), or the backend keeps no store (etcd, static): the
  // caller rejoins the same endpoint, or gives up when the store stopped on purpose. Probes the
  // store (up to ~1 s); otherwise no I/O.
  virtual std::unique_ptr<StoreFailover> recover_lost_store(const LostStore& lost) {
    (void)lost;
    return nullptr;
  }
  // Whether `event`, the end of the round with `members`, is the member that hosted the round's
  // store leaving on purpose (its agent shut down): its store went with it. No I/O.
  virtual bool store_host_left(const RoundEvent& event, const ParticipantList& members) const {
    (void)event;
    (void)members;
    return false;
  }
  // Stops keep-alives, leaves the current round (members get kNodeLeft unless the rendezvous is
  // closed), unblocks waiting calls and releases the store (stops it when this node hosts it).
  // Idempotent; the handler is unusable afterwards.
  virtual void shutdown() = 0;
};

// Creates the backend called `name` ("c10d", "etcd" (alias "etcd-v2") or "static") and validates
// `options` for it before any I/O. Then hosts the store when this node should (c10d: the endpoint
// is this machine or is_host=true; static: node_rank 0; etcd: never) and connects to it, or to
// etcd (retrying a refused port until read_timeout or the first round's deadline, whichever comes
// first; static non-zero ranks until join_timeout; a host name that does not resolve or an
// unreachable network fails at once). Throws RendezvousOptionError (unknown backend, bad options)
// or RendezvousError (cannot host or reach the store).
std::unique_ptr<RendezvousHandler> create_rendezvous_handler(const std::string& name,
                                                             const RendezvousOptions& options);
// The same for a backend kind (an agent: handler_options() gives `options`).
std::unique_ptr<RendezvousHandler> create_rendezvous_handler(BackendKind kind,
                                                             const RendezvousOptions& options);
// What create_rendezvous_handler checks of one backend's own options before the common ones, for
// a command line to check early (no I/O): etcd_prefix only with etcd; etcd's endpoint list and
// c10d's HOST[:PORT] (a port in 0..65535, a non-empty host, an IPv6 address in brackets) when
// one is given. Throws RendezvousOptionError naming the option.
void check_backend_options(const std::string& name, const RendezvousOptions& options);

// Makes every store connection in this process that still retries (a client waiting for a store
// to come up, e.g. a static node > 0 before node 0 listens, inside create_rendezvous_handler) give
// up at once with a RendezvousError, and every later one after its first attempt. For an agent
// that is stopping (a stop signal while it waits). One-way; any thread.
void abandon_store_connection_retries();

// The names create_rendezvous_handler accepts.
std::vector<std::string> rendezvous_backend_names();

}  // namespace trun::rendezvous
