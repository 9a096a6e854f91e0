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
  int fd_ = -1;
};

}  // namespace trun::rendezvous
