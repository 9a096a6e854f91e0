#pragma once
// TcpStore: the client of a StoreServer (or of PyTorch's own TCPStore server, for the operations
// both understand). Synchronous; one TCP connection; every call bounded by a timeout.
//
// Connecting retries with exponential backoff and jitter until `connect_timeout` passes, so
// agents and workers may start before the server. Each failure raises StoreError naming the
// endpoint and the operation; a deadline raises StoreTimeoutError. After a transport failure the
// next call reconnects.
//
// Thread safety: calls on one TcpStore are serialized by a mutex; use one per thread for
// parallelism.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

#include "rendezvous/store/store.h"

namespace trun::rendezvous {

// A lease (trun extension; needs a trun StoreServer, a PyTorch server closes the connection): a
// notification bound to this client's connection. When the connection closes (the process died,
// or the client was destroyed) or no lease call arrives for `ttl` (a partition, a hung process),
// the server fires it once: if `a_key` is non-empty and missing it is set to `a_value`; otherwise
// `b_value` is appended to `b_key` (when non-empty). Either way waiters on that key wake at once.
// Arming also sets `set_key` = `set_value` in the same request (skipped when `set_key` is empty).
// A connection holds at most one lease; arming again replaces it without firing.
struct LeaseSpec {
  std::string set_key, set_value;
  std::string a_key, a_value;
  std::string b_key, b_value;
  std::chrono::milliseconds ttl{0};  // 0: bound to the connection only
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 29500;
  Store::Duration timeout = Store::kDefaultTimeout;            // each operation
  Store::Duration connect_timeout = std::chrono::seconds(60);  // retrying included
  std::string token;  // shared secret; empty: do not authenticate
};

class TcpStore : public Store {
 public:
  // Connects (with retries) before returning.
  explicit TcpStore(TcpStoreOptions options);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, std::string_view value) override;
  using Store::get;
  std::string get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) override;
  bool check(const std::vector<std::string>& keys) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  int64_t num_keys() override;
  bool delete_key(const std::string& key) override;
  using Store::multi_get;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override;
  void append(const std::string& key, std::string_view value) override;
  // Round trip with the server; returns how long it took.
  Duration ping();

  // Leases (see LeaseSpec). They live on the current connection: after a transport failure the
  // client reconnects without one, and lease_renew() reports false.
  void lease_arm(const LeaseSpec& lease);
  // Restarts the lease's ttl (and changes it when `ttl` > 0). False when no lease is armed on this
  // connection any more (it lapsed and fired, or the connection was replaced).
  bool lease_renew(std::chrono::milliseconds ttl = std::chrono::milliseconds(0));
  // Disarms the lease without firing it. False when none was armed.
  bool lease_release();

  // Unblocks a call in progress on another thread (e.g. a long get): it fails with StoreError
  // ("interrupted"); when none is in progress, the next call fails so instead. Safe from any
  // thread; the call after that reconnects.
  void interrupt();

  const std::string& endpoint() const { return endpoint_; }

 private:
  // Sends `request` and, when `reply` is given, lets it read the response; all under the
  // mutex, reconnecting first if needed. `deadline_extra` stretches the socket deadline past
  // the operation timeout for server-side waits.
  template <typename Reply>
  auto call(const char* op, const std::string& request, Duration deadline, Reply reply);
  void call_no_reply(const char* op, const std::string& request);
  void connect_locked(const char* op);

  TcpStoreOptions options_;
  std::string endpoint_;
  std::mutex mu_;
  std::mutex fd_mu_;  // guards fd_ changes against interrupt(); taken inside mu_
  int fd_ = -1;
  bool interrupted_ = false;  // under fd_mu_
};

}  // namespace trun::rendezvous
