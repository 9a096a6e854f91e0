#pragma once
// StoreRelay: one level of a store tree. Agents connect to a relay as they would to the store;
// the relay holds their connections and passes their requests to the store (its upstream) over
// one connection, so a store serves a few relays instead of every agent: at 100,000 agents one
// process cannot even hold the connections (a descriptor each), and one key's waiters would be
// woken 100,000 times.
//
// What the relay does with each request (trun's dialect only, docs/rendezvous.md "Scale"):
//  - key-value requests (SET, COMPARE_SET, ADD, GET, APPEND, MULTI_GET, MULTI_SET, CHECK,
//    DELETE_KEY, GETNUMKEYS): passed through byte for byte, answered in order;
//  - waits (GET_WAIT, WAIT_KEYS, WAIT): the relay's clients that wait for the same keys share one
//    wait upstream, and all get its answer (the fan-out happens here, not in the store); each
//    client's own timeout is kept here;
//  - leases: kept here, per client. LEASE_ARM's key is set upstream; when the client's connection
//    closes or its keep-alives stop, the relay sends the notification upstream (LEASE_FIRE). The
//    relay arms a lease of its own upstream with the last round's keys, so that the store sees
//    its clients leave if the relay itself dies;
//  - PING, VALIDATE: answered here. Anything else (PyTorch 1.13's dialect, authentication,
//    queues) closes the connection with a log line: a relay is for rendezvous traffic.
// A client gets each answer before its next request is read (as TcpStore clients use the
// store), except a CANCEL_WAIT behind a wait.
//
// Lifetime: start() connects upstream and listens before it returns (StoreError if it cannot);
// losing the upstream closes every client connection (they see a lost store). Thread safety:
// start/stop/port/the counters from any thread; the relay runs on its own thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "store/wire.h"

namespace trun::store {

struct StoreRelayOptions {
  std::string host = "127.0.0.1";  // where agents connect
  uint16_t port = 0;               // 0 picks a free port
  std::string upstream_host = "127.0.0.1";
  uint16_t upstream_port = 0;
  wire::Limits limits;
  // As StoreServerOptions::max_pending_output: a client whose unsent replies pass this many bytes
  // has no more requests passed on, and is not read from, until its writes drain.
  uint64_t max_pending_output = 64ull * 1024 * 1024;
  int backlog = 4096;
};

class StoreRelay {
 public:
  static std::unique_ptr<StoreRelay> start(const StoreRelayOptions& options);
  virtual ~StoreRelay() = default;

  virtual uint16_t port() const = 0;
  // Closes every connection and joins the relay's thread. Idempotent.
  virtual void stop() = 0;
  virtual size_t num_connections() const = 0;
  virtual uint64_t num_requests() const = 0;       // from clients, handshakes excluded
  virtual uint64_t upstream_requests() const = 0;  // sent to the store
};

}  // namespace trun::store
