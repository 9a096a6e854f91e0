#pragma once
// StoreServer: the TCP key-value server that one agent hosts (or `trun store` runs on its own).
//
// Speaks PyTorch TCPStore's protocol, 1.13 and 2.x dialects (detected per connection), plus
// trun's extensions (authentication, server-side wait timeouts). One event-loop thread serves
// every connection; nothing a client does (stalling mid-message, never reading its responses,
// sending garbage) delays the others: a malformed or oversized message closes that connection
// with a log line. The per-connection request loop (decoding, the authentication gate, output
// back-pressure) is RequestLoop (request_loop.h); the limits are listed in
// docs/tcpstore-protocol.md, section 3.
//
// Lifetime: start() binds and listens before it returns (StoreError if it cannot), then serves on
// its own thread until stop() or destruction. port() is valid right after start().
// Thread safety: start/stop/port/num_connections may be called from any thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "store/wire.h"

namespace trun::store {

struct StoreServerOptions {
  std::string host = "0.0.0.0";  // address to bind: IPv4, IPv6, or a name that resolves
  uint16_t port = 0;             // 0 picks a free port
  // When non-empty, a client must authenticate (HMAC-SHA256 challenge-response) before any other
  // request is served. Stock PyTorch clients cannot, so they are disconnected. Before that only
  // the handshake is accepted: another query closes the connection at its first byte, and so
  // does more than kMaxPreAuthInput (4 KiB) of buffered input. The token authenticates the
  // client; it does not encrypt the traffic.
  std::string token;
  // Token mode: a client that has not authenticated this long after connecting (one that
  // connects and sends nothing, or dribbles its handshake) is closed, with one log line
  // ("rejected PEER: not authenticated within 30000 ms"), so it cannot hold a descriptor
  // forever. A deadline from the connect, not an idle time. Authenticated clients are never timed
  // out: a WAIT may legitimately last hours. 0: no limit. Unused without a token.
  std::chrono::milliseconds auth_timeout{std::chrono::seconds(30)};
  wire::Limits limits;
  // Back-pressure per connection: before each request the server checks the connection's unsent
  // replies, and over this many bytes it executes none of that connection's requests (and reads
  // none) until its writes drain. So a client that never reads costs the server this much plus
  // one reply (at most wire::Limits::max_value_bytes of values and framing), however many
  // requests it pipelines. Other connections are served meanwhile.
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

}  // namespace trun::store
