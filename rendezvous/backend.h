#pragma once
// RendezvousBackend: the shared state under the dynamic rendezvous protocol
// (dynamic_rendezvous.h). The protocol is written once against this interface; the c10d backend
// implements it over the trun store (c10d/backend.h), and an etcd backend can implement it with
// etcd's transactions, leases and watches.
//
// What the protocol needs: a counter (add), compare-and-set on an absent key, append, a blocking
// read of a key that may not exist yet, a multi-key read, and one lease per node: a notification
// that the backend fires when this node stops renewing it or disconnects (LeaseSpec).
//
// Thread safety: quick operations (everything but wait_get) may run concurrently with one
// wait_get; the implementation keeps them on separate channels, so keep-alives never queue behind
// a long wait. Errors: StoreError / StoreTimeoutError from the store layer.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"
#include "store/tcp_store.h"  // LeaseSpec

namespace trun::rendezvous {

class RendezvousBackend {
 public:
  using Duration = std::chrono::milliseconds;
  virtual ~RendezvousBackend() = default;

  virtual std::string name() const = 0;

  // --- quick operations: one round trip each ---
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  // A counter: the value after adding `delta`. The protocol only counts up by one and reads with
  // add(key, 0); a backend may keep counters apart from set/try_get values (etcd does).
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual void append(const std::string& key, const std::string& value) = 0;
  // The value, or nullopt when the key does not exist. Never blocks on the key.
  virtual std::optional<std::string> try_get(const std::string& key) = 0;
  // --- the wait channel ---
  // Blocks until every key exists (at most `timeout`, StoreTimeoutError), returns their values.
  virtual std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                             Duration timeout) = 0;
  // Blocks until `key` exists and returns its value; nullopt after `timeout`. StoreError when
  // interrupted (interrupt_waits) or the store is lost.
  virtual std::optional<std::string> wait_get(const std::string& key, Duration timeout) = 0;
  // Makes a wait_get in progress on another thread fail at once (for shutdown).
  virtual void interrupt_waits() = 0;

  // --- liveness ---
  // Arms this node's lease (replacing the previous one without firing it).
  virtual void arm_lease(const store::LeaseSpec& lease) = 0;
  // Restarts the lease's ttl. False when the lease is gone (it fired: others consider this node
  // dead). StoreError when the store cannot be reached.
  virtual bool renew_lease() = 0;
  // Disarms the lease without firing it.
  virtual void release_lease() = 0;

  // A store for the agent's own keys (a separate connection, created on first use), shared.
  virtual std::shared_ptr<store::Store> agent_store() = 0;

  // Requests sent so far by this backend (every operation above, not counting agent_store()).
  virtual uint64_t requests_sent() const = 0;
};

}  // namespace trun::rendezvous
