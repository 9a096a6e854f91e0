#pragma once
// StoreServer: the TCP key-value server that one agent hosts (or `trun store` runs on its own).
//
// Speaks PyTorch TCPStore's protocol, 1.13 and 2.x dialects (detected per connection), plus
// trun's extensions (authentication, server-side wait timeouts). One event-loop thread serves
// every connection; nothing a client does (stalling mid-message, never reading its responses,
// sending garbage) delays the others: a malformed or oversized message closes that connection
// with a log line.
//
// Lifetime: start() binds and listens before it returns (StoreError if it cannot), then serves on
// its own thread until stop() or destruction. port() is valid right after start().
// Thread safety: start/stop/port/num_connections may be called from any thread.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rendezvous/store/wire.h"

namespace trun::rendezvous {

struct StoreServerOptions {
  std::string host = "0.0.0.0";  // address to bind: IPv4, IPv6, or a name that resolves
  uint16_t port = 0;             // 0 picks a free port
  // When non-empty, a client must authenticate (HMAC-SHA256 challenge-response) before any other
  // request is served. Stock PyTorch clients cannot, so they are disconnected.
  std::string token;
  wire::Limits limits;
  // A client that leaves this many response bytes unread stops being read from until it catches up.
  uint64_t max_pending_output = 64ull * 1024 * 1024;
  int backlog = 4096;
  // Keys the store holds before it accepts its first connection (a store taking over from one
  // that was lost: rendezvous/dynamic_decisions.h, failover_seed).
  std::vector<std::pair<std::string, std::string>> seed;
};

class StoreServer {
 public:
  static std::unique_ptr<StoreServer> start(const StoreServerOptions& options);
  virtual ~StoreServer() = default;

  virtual uint16_t port() const = 0;
  virtual std::string host() const = 0;
  // Stops accepting, closes every connection and joins the event loop. Idempotent.
  virtual void stop() = 0;
  // Connections open right now (for tests and diagnostics).
  virtual size_t num_connections() const = 0;
  // Requests served since start, not counting handshakes (VALIDATE, authentication); every
  // dialect. For tests and benchmarks.
  virtual uint64_t num_requests() const = 0;
};

}  // namespace trun::rendezvous
