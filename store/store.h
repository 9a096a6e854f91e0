#pragma once
// Store: the key-value contract that trun's rendezvous, agents and workers share, with c10d's
// semantics. Implementations: TcpStore (client of StoreServer or of PyTorch's TCPStore server,
// tcp_store.h), the etcd store (the agent's store with the etcd rendezvous backend:
// etcd::make_etcd_store in rendezvous/etcd/kv.h; no queues, no list_keys), PrefixStore (a
// namespaced view, prefix_store.h) and InMemoryStore (unit tests only, in_memory_store.h).
//
// Values are byte strings. Counters written by add() are decimal strings, as in c10d.
//
// Blocking: get, wait and multi_get block until their keys exist, at most `timeout()` (or the
// timeout passed in); every other call is one round trip, bounded by the same timeout.
//
// Errors: StoreTimeoutError when a deadline passes (recoverable: retry or give up); StoreError
// for everything else (connection lost, refused, rejected by the server), its message naming the
// endpoint and the operation. Implementations are safe to call from several threads: calls are
// serialized per object.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace trun::store {

class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StoreTimeoutError : public StoreError {
 public:
  using StoreError::StoreError;
};

// The store was stopped on purpose (its host agent left, the job ended, `trun store` was told to
// stop): trun's server says so to the clients it was answering a wait for before it closes, and a
// client that heard it fails every later call at once instead of retrying the endpoint. Distinct
// from a store that died (a plain StoreError: connection closed, refused or timed out).
class StoreGoneError : public StoreError {
 public:
  using StoreError::StoreError;
};

class Store {
 public:
  using Duration = std::chrono::milliseconds;
  static constexpr Duration kDefaultTimeout = std::chrono::seconds(300);  // c10d's default

  virtual ~Store() = default;

  virtual void set(const std::string& key, std::string_view value) = 0;
  // Blocks until `key` exists (at most `timeout`), then returns its value.
  virtual std::string get(const std::string& key, Duration timeout) = 0;
  std::string get(const std::string& key) { return get(key, timeout_); }
  // Adds `delta` to the integer at `key` (0 when missing) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // c10d's compare_set: if the key holds `expected` (or is missing and `expected` is empty) it is
  // set to `desired` and `desired` is returned; a missing key with a non-empty `expected` returns
  // `expected`; otherwise the current value is returned and nothing changes.
  virtual std::string compare_set(const std::string& key, std::string_view expected,
                                  std::string_view desired) = 0;
  // True when every key exists. Never blocks on the keys.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Blocks until every key exists; StoreTimeoutError after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, Duration timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  // Number of keys in the whole store (a PrefixStore does not narrow it, as in c10d).
  virtual int64_t num_keys() = 0;
  // True when the key existed.
  virtual bool delete_key(const std::string& key) = 0;
  // Blocks until every key exists (at most `timeout`), then returns their values in order.
  virtual std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                             Duration timeout) = 0;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) {
    return multi_get(keys, timeout_);
  }
  virtual void multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) = 0;
  // Appends to the value at `key`, creating it when missing.
  virtual void append(const std::string& key, std::string_view value) = 0;

  // PyTorch 2.x's queues: first-in first-out lists of values, apart from the keys: set/get/
  // num_keys/list_keys do not see a queue, but check and wait count a non-empty one as present
  // (as PyTorch's servers do: a blocking pop is a WAIT, then the pop). Stores without queues
  // (the etcd store; a PyTorch 1.13 server) throw StoreError naming the operation.
  virtual void queue_push(const std::string& key, std::string_view value) {
    no_such_operation("queue_push");
  }
  // Removes and returns the front of `key`'s queue. Without `block`: nullopt when it is empty;
  // with it: waits up to `timeout` for a value (StoreTimeoutError).
  virtual std::optional<std::string> queue_pop(const std::string& key, bool block,
                                               Duration timeout) {
    no_such_operation("queue_pop");
  }
  std::optional<std::string> queue_pop(const std::string& key, bool block) {
    return queue_pop(key, block, timeout_);
  }
  virtual int64_t queue_len(const std::string& key) { no_such_operation("queue_len"); }
  // Every key, unordered (PyTorch 2.9's list_keys); a PrefixStore lists its own keys, without
  // the prefix.
  virtual std::vector<std::string> list_keys() { no_such_operation("list_keys"); }

  // The default timeout of get/wait/multi_get and of every round trip. Not synchronized: set it
  // before the store is shared between threads.
  Duration timeout() const { return timeout_; }
  void set_timeout(Duration timeout) { timeout_ = timeout; }

 protected:
  [[noreturn]] static void no_such_operation(const char* op) {
    throw StoreError(std::string(op) + ": this store has no such operation");
  }

  Duration timeout_ = kDefaultTimeout;
};

}  // namespace trun::store
