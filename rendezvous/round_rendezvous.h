#pragma once
// Private to rendezvous/: what the c10d and static handlers share. A round-based handler over a
// RendezvousBackend: the keep-alive thread, the per-round "over" key that pushes round ends to
// every node, the callback thread, closing and shutdown. Subclasses implement join_round().
//
// Three files implement it: round_setup.cpp (the free functions below, up to host_store:
// endpoints, node ids, options, the first round's clock, hosting the store), round_rendezvous.cpp
// (the handler: joining, the lease, keep-alives, closing, shutdown) and round_over.cpp (the
// round-over side: wait_round_over, the callback thread, failure reports).
//
// Locking: mu_ guards the round state below; no backend call is made while holding it.

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "rendezvous/backend.h"
#include "rendezvous/dynamic_decisions.h"
#include "rendezvous/handler.h"
#include "store/server.h"

namespace trun::rendezvous {

struct Endpoint {
  std::string host;
  uint16_t port = 0;
};
// "host", "host:port", "[v6]:port" or a bare IPv6 address. Throws RendezvousOptionError.
Endpoint parse_endpoint(const std::string& text, uint16_t default_port, const char* what);
// True when `host` names this machine: localhost, a loopback address, this host's name, or an
// address of one of its interfaces (or `local_addr`).
bool endpoint_is_local(const std::string& host, const std::string& local_addr);
std::string default_node_id();
std::string default_local_addr();
// A free TCP port on this machine (bound and released), 0 when none could be found.
uint16_t pick_free_port();
// Checks what every backend needs; throws RendezvousOptionError naming the option.
void validate_common_options(const RendezvousOptions& o, const char* backend);
// Starts the first round's clock: sets o->first_round_deadline to join_timeout from now unless
// the caller set it, and returns what the store connection may spend retrying: what is left of
// that deadline (at least 1 ms; join_timeout when the clock starts here), never more than `cap`.
std::chrono::milliseconds start_first_round(RendezvousOptions* o, std::chrono::milliseconds cap);
// What is left until `deadline`, at least 1 ms and at most `cap`.
std::chrono::milliseconds time_left(std::chrono::steady_clock::time_point deadline,
                                    std::chrono::milliseconds cap);
// Hosts a StoreServer for `endpoint` (binding its address when it is numeric, else every
// interface). Returns null when the port is taken and hosting was not forced, with the reason in
// *not_hosted when given. A failure while nothing listens on the port is retried a few times.
std::unique_ptr<store::StoreServer> host_store(
    const Endpoint& endpoint, const std::string& token, bool forced, const char* backend,
    const std::vector<std::pair<std::string, std::string>>& seed = {},
    std::string* not_hosted = nullptr);

class RoundRendezvous : public RendezvousHandler {
 public:
  ~RoundRendezvous() override;

  std::string backend() const override { return backend_name_; }
  std::string run_id() const override { return options_.run_id; }
  std::string node_id() const override { return options_.node_id; }

  RendezvousInfo next_rendezvous() override;
  std::optional<RoundEvent> wait_round_over(std::chrono::milliseconds timeout) override;
  void set_round_over_callback(std::function<void(const RoundEvent&)> callback) override;
  void report_worker_failure(const std::string& detail, int64_t failed_at_ms = -1) override;
  std::vector<FailureReport> round_failures(std::chrono::milliseconds grace) override;
  void set_closed() override;
  void shutdown() override;

  // Requests this handler's backend sent (tests, benchmarks).
  uint64_t requests_sent() const { return backend_->requests_sent(); }
  StoreStats store_stats() const override;
  std::shared_ptr<store::Store> job_store() override { return backend_->agent_store(); }
  bool hosts_store() const override { return server_ != nullptr; }
  const store::StoreServer* hosted_store() const { return server_.get(); }

 protected:
  RoundRendezvous(std::string backend_name, RendezvousOptions options,
                  std::unique_ptr<RendezvousBackend> backend,
                  std::unique_ptr<store::StoreServer> server);

  // Joins rounds until one completes with this node in it. `last_round` is the last round this
  // node completed (-1: none). Runs on the caller's thread of next_rendezvous.
  virtual RendezvousInfo join_round(int64_t last_round, int last_rank) = 0;
  // The key whose creation ends round k (appended to by whoever ends it).
  virtual std::string over_key(int64_t k) const = 0;
  // Marks the rendezvous closed in the backend (subclass keys), then the base appends kClosed.
  virtual void close_rendezvous(int64_t current_round, int64_t joining_round) = 0;

  // When the round join_round() is joining must complete: join_timeout from now, and for the
  // first round no later than options_.first_round_deadline (the creation and the first join
  // share one bound). Call once per join_round(), on its thread.
  std::chrono::steady_clock::time_point join_deadline();
  // Arms this node's lease for round k and starts its keep-alives: `node_key` holds `node_value`
  // while the node lives; when the lease lapses (the node died, or its connection closed) the
  // backend writes `abort_value` to `abort_key` and ends round k with kNodeLeft for this node
  // (over_key(k)). Both backends' join_round() call it once per round they join.
  void arm_node_lease(int64_t k, std::string node_key, std::string node_value,
                      std::string abort_key, std::string abort_value);
  // After a join timed out: ends the round it joined (the abort its lease would write) and says so
  // in that round's over key. Store errors are logged at debug level and ignored.
  void leave_joined_round();
  void check_not_shut_down() const;
  std::string error_prefix() const {
    return backend_name_ + " rendezvous '" + options_.run_id + "'";
  }

  // Failed backend operations (counted by the wrapper around backend_; declared
  // first: the constructor hands it to that wrapper).
  std::shared_ptr<std::atomic<uint64_t>> backend_errors_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  RendezvousOptions options_;
  std::unique_ptr<RendezvousBackend> backend_;
  std::unique_ptr<store::StoreServer> server_;
  std::atomic<int64_t> joining_round_{-1};
  // Set by a backend whose join saw the round aborted before it formed: how many other nodes
  // joined it. The node hosting the store then waits (bounded) for their goodbyes before it
  // stops the store, so each of them can still read why the round ended.
  std::atomic<int> aborted_peers_{0};

 private:
  void keep_alive_loop();
  void callback_loop();
  void start_keep_alive();

  std::string backend_name_;
  bool first_join_ = true;  // join_deadline() was not called yet

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool shut_down_ = false;
  bool closed_here_ = false;  // set_closed() was called on this handler
  int64_t round_ = -1;        // the current (last completed) round
  int rank_ = -1;
  int world_size_ = 0;               // nodes in round_
  bool in_round_ = false;            // a member of round_, and next_rendezvous was not called since
  std::optional<RoundEvent> event_;  // why round_ ended, once known
  std::optional<RoundEvent> local_event_;  // raised here (store lost), delivered to waiters
  bool store_unreachable_ = false;         // the last next_rendezvous failed on a store error
  bool lease_ = false;                     // a lease is armed
  // The armed lease's actions, which shutdown() carries out itself when it interrupts a join
  // (so the others see this node leave at once, not when its lease lapses).
  std::string lease_a_key_, lease_a_value_, lease_b_key_;
  std::function<void(const RoundEvent&)> callback_;
  int64_t delivered_round_ = -1;
  int64_t stopped_round_ = -1;  // the last round round_failures() said this node stopped in

  std::thread keep_alive_thread_;
  std::thread callback_thread_;
};

}  // namespace trun::rendezvous
