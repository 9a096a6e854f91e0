#pragma once
// c10d store semantics over etcd: what the etcd rendezvous backend and the agent's store
// (EtcdStore) share. Keys given here are relative: etcd holds them under `prefix`.
//
// Counters and appends are optimistic read-modify-write transactions (etcd has no increment),
// retried under contention until the timeout. Blocking reads are etcd watches, each on a
// connection of its own, so quick operations never queue behind them.
//
// Thread safety: every method may be called from any thread. Errors: StoreTimeoutError /
// StoreError (client.h).

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rendezvous/etcd/client.h"
#include "store/store.h"

namespace trun::rendezvous::etcd {

struct KvOptions {
  Endpoints endpoints{{"127.0.0.1", 2379}};            // members of one cluster, tried in order
  std::string prefix = "/";                            // prepended to every key
  Duration timeout{std::chrono::seconds(60)};          // each request
  Duration connect_timeout{std::chrono::seconds(60)};  // the first connection, retrying
};

class Kv {
 public:
  // Connects (retrying until connect_timeout).
  explicit Kv(const KvOptions& options);

  std::string full(const std::string& key) const { return options_.prefix + key; }
  Client& client() { return client_; }
  const KvOptions& options() const { return options_; }

  std::optional<std::string> try_get(const std::string& key);
  void set(const std::string& key, const std::string& value);
  // c10d's compare_set (store.h).
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired);
  int64_t add(const std::string& key, int64_t delta);
  void append(const std::string& key, const std::string& value);
  bool check(const std::vector<std::string>& keys);
  bool erase(const std::string& key);
  int64_t num_keys();  // every key under the prefix
  // Atomic for up to 128 keys (etcd's default --max-txn-ops); larger sets go in several steps.
  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values);

  // Blocks until `key` exists and returns its value; nullopt after `timeout`. StoreError when
  // interrupted or etcd is lost.
  std::optional<std::string> wait_get(const std::string& key, Duration timeout);
  // Blocks until every key exists (StoreTimeoutError after `timeout`); their values, read at once
  // (one snapshot per 128 keys: etcd's default limit of operations per transaction).
  std::vector<std::string> multi_get(const std::vector<std::string>& keys, Duration timeout);
  // Makes the wait_get/multi_get in progress fail with StoreError; with none, the next one.
  void interrupt_waits();

  // Atomically replaces the value at full key `key` with `f(current)` (nullopt: missing), retrying
  // on contention until the timeout. Every key in `absent` must be missing as well, and `also`
  // runs in the same transaction. Returns the value written, or nullopt when an `absent` key
  // exists. Keys here are full keys (full()).
  std::optional<std::string> update(
      const std::string& key,
      const std::function<std::string(const std::optional<std::string>&)>& f,
      const std::vector<std::string>& absent = {}, const std::vector<Op>& also = {});

  // Requests sent so far (HTTP requests and watches).
  uint64_t requests() const { return client_.requests() + watches_.load(); }

 private:
  std::vector<std::optional<KeyValue>> read_all(const std::vector<std::string>& keys);
  // `ops` as transactions without conditions of at most 128 operations each (etcd's default
  // --max-txn-ops), in order; the reads of all of them.
  std::vector<std::optional<KeyValue>> txn_in_chunks(const std::vector<Op>& ops);

  KvOptions options_;
  Client client_;
  std::atomic<uint64_t> watches_{0};
  std::mutex watch_mu_;
  std::vector<Watch*> active_;  // under watch_mu_
  bool interrupt_pending_ = false;
};

// The Store contract (store.h) over etcd: the agent's own keys with the etcd backend.
std::shared_ptr<store::Store> make_etcd_store(const KvOptions& options);

}  // namespace trun::rendezvous::etcd
