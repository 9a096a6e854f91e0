#pragma once
// A small etcd v3 client over etcd's HTTP/JSON gateway (`/v3/...` on the client URL, etcd >= 3.4;
// plain HTTP only). Debian has no C++ etcd client and the gateway needs nothing beyond Beast and
// nlohmann/json. Keys and values are byte strings (base64 on the wire, done here).
//
// Client: one keep-alive HTTP connection, requests serialized under a mutex; safe from any
// thread. Every call is bounded by the client's timeout. Watch: one streaming request on a
// connection of its own, used by one thread; interrupt() from any other.
//
// Several endpoints (members of one etcd cluster): a connection goes to the first that accepts,
// starting from the one last used; a member that dies or stops answering is left for the next.
//
// Errors: StoreTimeoutError when a deadline passes, StoreError for everything else (cannot
// connect, connection lost, etcd rejected the request), the message naming the endpoint, the
// request and etcd's own message.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/store.h"

namespace trun::rendezvous::etcd {

using Clock = std::chrono::steady_clock;
using Duration = std::chrono::milliseconds;

// etcd refused a request; code() is its gRPC status (kNotFound: e.g. an expired lease).
class EtcdError : public store::StoreError {
 public:
  static constexpr int kNotFound = 5;
  EtcdError(const std::string& what, int code) : store::StoreError(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
};

struct Endpoint {
  std::string host;
  uint16_t port = 2379;
  std::string text() const { return host + ":" + std::to_string(port); }
};
using Endpoints = std::vector<Endpoint>;
// "h1:p1,h2:p2" for messages.
std::string to_string(const Endpoints& endpoints);

// One comparison of a transaction; all must hold for its success branch.
struct Compare {
  enum class Target { kCreateRevision, kModRevision, kValue };
  std::string key;
  Target target = Target::kCreateRevision;
  int64_t revision = 0;  // kCreateRevision / kModRevision: must equal (0: the key is missing)
  std::string value;     // kValue: must equal (a missing key never matches)

  static Compare missing(std::string key) {
    return {std::move(key), Target::kCreateRevision, 0, {}};
  }
  static Compare mod_revision_is(std::string key, int64_t rev) {
    return {std::move(key), Target::kModRevision, rev, {}};
  }
  static Compare value_is(std::string key, std::string value) {
    return {std::move(key), Target::kValue, 0, std::move(value)};
  }
};

// One operation of a transaction branch.
struct Op {
  enum class Kind { kPut, kRange, kCountPrefix };
  Kind kind = Kind::kRange;
  std::string key;
  std::string value;
  int64_t lease = 0;  // kPut: attach to this lease (0: none)

  static Op put(std::string key, std::string value, int64_t lease = 0) {
    return {Kind::kPut, std::move(key), std::move(value), lease};
  }
  static Op range(std::string key) { return {Kind::kRange, std::move(key), {}, 0}; }
  // The number of keys starting with `prefix` (counting the branch's earlier puts).
  static Op count_prefix(std::string prefix) {
    return {Kind::kCountPrefix, std::move(prefix), {}, 0};
  }
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;  // the store's revision after the transaction
  // One entry per operation of the branch that ran: the key read by a kRange (nullopt: missing);
  // nullopt for the others.
  std::vector<std::optional<KeyValue>> reads;
  // One entry per operation of the branch that ran: a kCountPrefix's count; 0 for the others.
  std::vector<int64_t> counts;
};

class HttpConnection;

class Client {
 public:
  // Connects, retrying until `connect_timeout` (etcd may still be starting). `endpoints` is not
  // empty.
  Client(Endpoints endpoints, Duration timeout, Duration connect_timeout);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& endpoint() const { return endpoint_; }  // "host:port[,host:port...]"

  // The value at `key`, or nullopt. `revision` (optional) receives the store's revision.
  std::optional<KeyValue> get(const std::string& key, int64_t* revision = nullptr);
  // Returns the revision of the write (the key's mod_revision, and create_revision when new).
  int64_t put(const std::string& key, const std::string& value, int64_t lease = 0);
  // True when the key existed.
  bool erase(const std::string& key);
  // Number of keys starting with `prefix`.
  int64_t count_prefix(const std::string& prefix);
  TxnResult txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                const std::vector<Op>& failure = {});

  // A lease of `ttl` (rounded up to whole seconds, at least 1 s); returns its id.
  int64_t lease_grant(Duration ttl);
  // Restarts the lease's ttl; false when the lease is gone (expired or revoked).
  bool lease_keep_alive(int64_t id);
  // Revokes the lease, deleting its keys; a lease already gone is not an error.
  void lease_revoke(int64_t id);

  // HTTP requests sent so far.
  uint64_t requests() const { return requests_.load(); }

 private:
  std::string call(const std::string& path, const std::string& body, bool idempotent);
  void connect_any(Clock::time_point deadline);  // under mu_

  Endpoints endpoints_;
  size_t current_ = 0;  // under mu_: the endpoint conn_ talks (or last talked) to
  std::string endpoint_;
  Duration timeout_;
  static constexpr Duration kIdleReconnect{std::chrono::seconds(30)};
  std::mutex mu_;
  std::unique_ptr<HttpConnection> conn_;
  Clock::time_point last_used_;  // under mu_: the last answer on conn_
  std::atomic<uint64_t> requests_{0};
};

struct WatchEvent {
  bool is_delete = false;
  KeyValue kv;                      // for a delete: the key and the revision of the deletion
  std::optional<KeyValue> prev_kv;  // the value before the event (when the watch asked for it)
};

// A watch on [key, range_end) (range_end empty: `key` alone) from `start_revision` on.
class Watch {
 public:
  struct Options {
    std::string key;
    std::string range_end;
    int64_t start_revision = 0;  // 0: from now
    bool prev_kv = false;
    size_t first_endpoint = 0;  // tried first (modulo their number); then the others in order
  };
  // No I/O yet: open() connects and creates the watch. interrupt() works from construction on.
  Watch(Endpoints endpoints, Options options);
  // Connects (to the first endpoint that accepts) and creates the watch, both before `deadline`
  // (StoreTimeoutError).
  void open(Clock::time_point deadline);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // The next batch of events (possibly empty: a progress notice); nullopt when `deadline`
  // passes first. StoreError when etcd ends the watch (e.g. the start revision was compacted:
  // compact_revision() then says from where to resume), the connection is lost, or interrupt().
  std::optional<std::vector<WatchEvent>> next(Clock::time_point deadline);
  // The revision covered so far: every event up to it has been returned.
  int64_t revision() const { return revision_; }
  int64_t compact_revision() const { return compact_revision_; }
  // Makes the next() in progress, or the next call to it, fail with StoreError. Any thread.
  void interrupt();
  bool interrupted() const;

 private:
  std::unique_ptr<HttpConnection> conn_;
  Endpoints endpoints_;
  std::string endpoint_;
  Options options_;
  std::string pending_;  // stream bytes not yet parsed into a message
  int64_t revision_ = 0;
  int64_t compact_revision_ = 0;
  bool created_ = false;
};

// etcd's range_end for "every key starting with prefix".
std::string prefix_end(const std::string& prefix);

// The gateway's encoding of keys and values (standard base64 with padding).
std::string base64(std::string_view bytes);
std::string unbase64(std::string_view text);

}  // namespace trun::rendezvous::etcd
