#pragma once
// TcpStore: the client of a StoreServer (or of PyTorch's own TCPStore server, for the operations
// both understand). Synchronous; one TCP connection; every call bounded by a timeout.
//
// Connecting retries with exponential backoff and jitter until `connect_timeout` passes, so
// agents and workers may start before the server (a refused port is retried); no attempt and no
// pause runs past that deadline. A host name that does not resolve (EAI_NONAME, not the
// transient EAI_AGAIN) and a network with no route to any of the host's addresses (ENETUNREACH,
// EHOSTUNREACH) fail at once with StoreError ("... (not retried)"). Each failure raises
// StoreError naming the endpoint and the operation; a deadline raises StoreTimeoutError. After a
// transport failure the next call reconnects, retrying for `reconnect_timeout` only: a store that
// went away fails that call promptly with a StoreError (deliberately not StoreTimeoutError: no key
// is late) instead of after the whole connect_timeout. Callers that must outlast an outage, like
// the agent rejoining after a partition, retry at their own level with new clients. A trun server
// that stops on purpose tells a client waiting on it so (StoreGoneError); from then on every call
// of that client fails at once with StoreGoneError, without trying to reconnect.
//
// Dialects (TcpStoreOptions::dialect): trun's server with its extensions, a plain PyTorch 2.x
// server, or a PyTorch 1.13 server; kAuto finds out on the first connect with a probe that none
// of the three servers is harmed by (docs/tcpstore-protocol.md §12). Operations a dialect's
// server lacks are emulated from basic ones where the semantics allow, and otherwise fail with a
// StoreError that names the operation and the server.
//
// Thread safety: calls on one TcpStore are serialized by a mutex; use one per thread for
// parallelism.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "store/dialect.h"
#include "store/store.h"

namespace trun::store {

// A lease (trun extension; needs trun's StoreServer: other dialects fail with StoreError): a
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

// "auto", "trun", "torch2", "torch1.13"; parse_store_dialect returns nullopt for anything else.
const char* to_string(StoreDialect dialect);
std::optional<StoreDialect> parse_store_dialect(std::string_view name);

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 29500;
  Store::Duration timeout = Store::kDefaultTimeout;            // each operation
  Store::Duration connect_timeout = std::chrono::seconds(60);  // the first connect, retrying
  // Retrying budget of a reconnect after a lost connection; min(connect_timeout, this, the
  // call's own timeout) applies: a call's timeout covers its reconnect.
  Store::Duration reconnect_timeout = std::chrono::seconds(5);
  std::string token;  // shared secret (kTrun/kAuto only); empty: do not authenticate
  StoreDialect dialect = StoreDialect::kAuto;
};

// One quick look, not retried: whether a store answers at options.host:port within `timeout`
// and holds `key` (the first connect attempt only: a refused port is a "no" at once). False on
// any failure. For finding where a job's store is now (an endpoint list, a failover).
bool probe_store_key(TcpStoreOptions options, const std::string& key,
                     std::chrono::milliseconds timeout);

class TcpStore : public Store {
 public:
  // Connects (with retries) before returning. Throws StoreError (StoreTimeoutError when
  // connect_timeout passed), or std::invalid_argument for a token with a PyTorch dialect.
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
  // Queues and list_keys: trun's server and PyTorch 2.x's that have them (queues since 2.7,
  // list_keys since 2.9; an older server closes the connection); not the 1.13 dialect.
  void queue_push(const std::string& key, std::string_view value) override;
  using Store::queue_pop;
  std::optional<std::string> queue_pop(const std::string& key, bool block,
                                       Duration timeout) override;
  int64_t queue_len(const std::string& key) override;
  std::vector<std::string> list_keys() override;
  // Round trip with the server; returns how long it took. (PING on trun's server, GETNUMKEYS on
  // PyTorch's.)
  Duration ping();

  // Leases (see LeaseSpec). They live on the current connection: after a transport failure the
  // client reconnects without one, and lease_renew() reports false. kTrun only: other dialects
  // fail with StoreError.
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
  // The dialect in use: never kAuto (the probe ran in the constructor).
  StoreDialect dialect() const { return dialect_; }

 private:
  // Sends `request` and lets `reply` read the response (returning what it returns), all under
  // the mutex, reconnecting first if needed. `budget` bounds the whole call, the reconnect
  // included: one deadline for connecting, writing and reading. Waits that end with an answer
  // (trun's GET_TIMEOUT and WAIT_TIMEOUT, timed out by the server; PyTorch 2.x's WAIT, which the
  // reply reader cancels with CANCEL_WAIT at the timeout) pass their timeout plus a grace period
  // (with_grace in tcp_store.cpp: 10 s), so that answer arrives before the socket deadline;
  // PyTorch 1.13's WAIT passes the bare timeout; other calls pass timeout(). A transport failure
  // or the deadline drops the connection: StoreError, or StoreTimeoutError at the deadline.
  template <typename Reply>
  auto call(const char* op, const std::string& request, Duration budget, Reply reply);
  void call_no_reply(const char* op, const std::string& request);
  // Connects, retrying for connect_timeout (reconnect_timeout after a lost connection), at most
  // `cap`.
  void connect_locked(const char* op, Duration cap = Duration::max());
  // Opens and handshakes one connection in dialect_ (resolving kAuto); -1 with *error set when
  // this attempt failed and may be retried.
  // *permanent tells that retrying cannot help (see connect_locked).
  int open_locked(const char* op, std::chrono::steady_clock::time_point deadline,
                  std::string* error, bool* permanent);
  // WAIT without a server-side timeout (kTorch2, kTorch1_13); false when `timeout` passed. At
  // the deadline it sends CANCEL_WAIT when `cancel_wait` (2.x), else drops the connection.
  bool plain_wait(const std::string& op, const std::vector<std::string>& keys, Duration timeout,
                  bool cancel_wait);
  // One quick connection attempt (no handshake): whether anything accepts connections there.
  bool server_listens() const;

  TcpStoreOptions options_;
  std::string endpoint_;
  std::mutex mu_;
  std::mutex fd_mu_;  // guards fd_ changes against interrupt(); taken inside mu_
  int fd_ = -1;
  bool interrupted_ = false;  // under fd_mu_
  bool connected_once_ = false;
  bool answered_ = false;  // the current connection answered a request
  // The server said it stops on purpose (wire::kWaitGoingAway): every later call fails at once
  // with StoreGoneError. Under mu_.
  bool gone_ = false;
  StoreDialect dialect_;
};

}  // namespace trun::store
