#pragma once
// RequestLoop: one store connection's request loop without the socket (private to
// store/). StoreServer's connections feed it the bytes they read and write out what it
// answers; tests/fuzz/server_loop_fuzz.cpp drives the same code with arbitrary input chunks and a
// simulated slow reader.
//
// What it does, per buffered request: detect the dialect, decode, gate on authentication, execute
// (the handshake, PING, WATCH_KEY and CANCEL_WAIT here, the key-value ops through KvState, leases
// through the Host), and apply back-pressure:
//  - Output: before each request it checks the connection's unsent output (out() plus what the
//    Host is writing); over max_pending_output it stops (kOutputFull) and leaves the rest of the
//    input buffered. So unsent output never exceeds the limit by more than one reply, however many
//    requests one read brought in. The caller processes again when its writes drain.
//  - Before authentication (token mode): only VALIDATE, AUTH_HELLO and AUTH_PROOF are accepted.
//    Any other request closes the connection as soon as its first byte is seen (a 50 MiB SET is
//    refused before its value is buffered), and so does more than kMaxPreAuthInput bytes of
//    buffered input.
//  - Fairness: one process() call stops (kYield) once it has produced output_per_turn bytes, and
//    the caller serves other connections before it goes on.
//  - A parked request (WAIT and friends) holds back the requests behind it, except CANCEL_WAIT and,
//    in the 1.13 dialect, requests behind a WAIT (see process() in request_loop.cpp).
//
// Thread safety: none; the owner's thread (the server's event loop). KvState may call back into
// the owner (Wake) while process() runs; process() is not re-entrant, and the owner must not call
// it from inside itself (Connection guards that).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "store/kv_state.h"
#include "store/wire.h"

namespace trun::store {

// Before authenticating, a client needs 5 (VALIDATE) + 1 (AUTH_HELLO) + 41 (AUTH_PROOF) bytes;
// more than this buffered and not yet a complete handshake closes the connection.
inline constexpr size_t kMaxPreAuthInput = 4096;

struct RequestLoopOptions {
  wire::Limits limits;
  // Non-empty: requests other than the handshake need a successful AUTH_PROOF first.
  std::string token;
  // Unsent output over which the loop stops executing requests (StoreServerOptions).
  uint64_t max_pending_output = 64ull * 1024 * 1024;
  // Output one process() call produces before it yields (kYield), so that one connection's burst
  // of large replies does not hold up every other connection for the whole limit's worth of
  // copying (64 MiB took about a second on a loaded 2-core VM).
  uint64_t output_per_turn = 256 * 1024;
  // The challenge AUTH_HELLO answers; empty: auth::make_challenge (tests fix it).
  std::function<std::string()> make_challenge;
};

class RequestLoop {
 public:
  // The connection's side: what needs timers or the socket.
  class Host {
   public:
    virtual ~Host() = default;
    // Bytes of earlier output handed to the socket and not yet written.
    virtual size_t in_flight() const = 0;
    // A request parked (outcome.kind == kPark): arm its timer when outcome.timeout_ms > 0.
    virtual void parked(const KvState::Outcome& outcome) = 0;
    // CANCEL_WAIT dropped the parked wait: disarm its timer.
    virtual void wait_cancelled() = 0;
    // LEASE_ARM / LEASE_RENEW / LEASE_RELEASE / LEASE_FIRE, its reply appended to *out. False
    // (with *why) closes the connection.
    virtual bool lease(wire::Request& r, std::string* out, std::string* why) = 0;
    // A request other than the handshake is about to run (counted before it runs: its wake-ups
    // may answer other clients before it returns).
    virtual void counted() {}
  };

  enum class Stop : uint8_t {
    kNeedInput,   // everything buffered was executed, or the next request is incomplete
    kBlocked,     // a parked request holds back the rest (resume after Wake / time-out)
    kOutputFull,  // unsent output is over the limit: process again when writes drain
    kYield,       // this turn's share of output is made: process again after serving others
    kClose,       // close the connection (after sending out(), e.g. a refused AUTH_PROOF's 0)
  };

  RequestLoop(RequestLoopOptions options, KvState* kv, KvState::Waiter waiter);

  // Bytes read from the client.
  void append(const char* data, size_t n) { in_.append(data, n); }
  // Executes buffered requests until one of the Stop reasons. After kClose, why() says why, and
  // rejected() whether it was a refused client (unauthenticated request, wrong token: logged as
  // "rejected PEER: why") rather than a broken one ("closing connection from PEER: why").
  Stop process(Host& host);

  const std::string& why() const { return why_; }
  bool rejected() const { return rejected_; }
  // Replies not yet handed to the socket; the owner takes them (swap) and writes them.
  std::string& out() { return out_; }
  size_t buffered_input() const { return in_.size(); }
  bool authenticated() const { return authenticated_; }
  bool output_full(const Host& host) const {
    return out_.size() + host.in_flight() > options_.max_pending_output;
  }
  wire::Dialect dialect() const { return dialect_; }
  // Requests executed, handshakes not counted (StoreServer::num_requests).
  uint64_t executed() const { return executed_; }
  const RequestLoopOptions& options() const { return options_; }

 private:
  // Executes one decoded request; false when it blocked or asks for the connection to close.
  bool execute(wire::Request& r, Host& host, Stop* stop);
  bool close(std::string why, Stop* stop, bool rejected = false);

  RequestLoopOptions options_;
  KvState* kv_;
  KvState::Waiter waiter_;
  std::string in_;
  std::string out_;
  std::string why_;
  std::string challenge_;
  wire::Dialect dialect_ = wire::Dialect::kUnknown;
  bool authenticated_;
  bool rejected_ = false;
  uint64_t executed_ = 0;
};

}  // namespace trun::store
