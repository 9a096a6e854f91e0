#pragma once
// Private to store/: one agent's connection to a StoreRelay (relay.h), and what it asks of the
// relay (RelayHost, implemented in relay.cpp): requests passed upstream and the answers cut out of
// the upstream stream for it, shared waits, the relay's own lease. The Client parses the agent's
// requests, answers what the relay answers itself (PING, VALIDATE, CANCEL_WAIT, leases), keeps
// its wait's timeout and its lease, and applies back-pressure.
//
// Thread safety: everything here runs on the relay's event-loop thread.

#include <array>
#include <boost/asio.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "store/relay.h"
#include "store/wire.h"

namespace trun::store::relay_detail {

// One read's worth: the relay reads every socket into one buffer (one event-loop thread).
constexpr size_t kReadChunk = 64 * 1024;

// The shape of a passed-through request's answer, to cut it out of the upstream stream.
struct Answer {
  // kStatusValue: a GET_TIMEOUT's (a status, then the value when it is STOP_WAITING).
  // kU32: a PING's (the relay's fences).
  enum class Kind : uint8_t { kBytes, kI64, kU8, kU32, kList, kStatusValue } kind = Kind::kU8;
  size_t count = 0;     // kList: that many byte strings
  uint64_t client = 0;  // 0: the relay's own request (its lease): the answer is dropped
  bool fence = false;   // a PING behind the client's writes: the client's wait may go out now
};

// What a Client needs from its relay.
class RelayHost {
 public:
  virtual boost::asio::io_context& io() = 0;
  virtual std::array<char, kReadChunk>& buffer() = 0;
  virtual const StoreRelayOptions& options() const = 0;
  virtual void count_request() = 0;
  // The client closed: the relay drops it.
  virtual void forget(uint64_t client) = 0;
  // A rate-limited warning.
  virtual void warn(const std::string& text) = 0;
  // Sends `raw` (one request in the store's protocol) upstream; its answer goes to `client`.
  virtual void pass(uint64_t client, std::string_view raw, Answer a) = 0;
  // Sends a request that has no answer (SET, APPEND, MULTI_SET).
  virtual void pass_unanswered(std::string_view raw) = 0;
  // The client waits for `keys` (GET_WAIT when `get`): joins the wait other clients share, or
  // starts it upstream. Returns this wait's id (0: no wait connection could be opened); the
  // client hears wait_done(id, answer). *sig_out is the shared wait's key, for leave_wait.
  virtual uint64_t wait(uint64_t client, bool get, const std::vector<std::string>& keys,
                        std::string* sig_out) = 0;
  virtual void leave_wait(const std::string& sig, uint64_t client) = 0;
  // A PING behind `client`'s writes on the upstream connection; its answer calls fenced().
  virtual void fence(uint64_t client) = 0;
  virtual bool stopping() const = 0;
  // The relay's own lease upstream follows the newest round its clients arm leases for.
  virtual void cover(const wire::Request& lease) = 0;
  // A client's lease fired: its notification goes upstream.
  virtual void fire(const wire::Request& lease) = 0;

 protected:
  ~RelayHost() = default;
};

class Client : public std::enable_shared_from_this<Client> {
 public:
  Client(RelayHost* relay, boost::asio::ip::tcp::socket socket, uint64_t id);
  void start() { read(); }
  void close(const std::string& why);
  // The answer to the request being served (passed through, or a wait's). `in_order`: it came
  // over the relay's one upstream connection, behind every write the client sent before.
  void answer(std::string_view bytes, bool in_order = false);
  // The fence behind this client's writes came back: its parked wait may go upstream now.
  void fenced();
  // The shared wait `wait_id` of this client ended with `bytes` (status [+ value]).
  void wait_done(uint64_t wait_id, std::string_view bytes);
  uint64_t id() const { return id_; }
  bool closed() const { return closed_; }

 private:
  void read();
  void on_read(boost::system::error_code ec);
  void process();
  // Serves one request; false when the client now waits for an answer (or closed).
  bool execute(wire::Request& r, std::string_view raw);
  void flush();
  void arm_lease_timer();
  void fire_lease();
  void end_wait();

  RelayHost* relay_;
  boost::asio::ip::tcp::socket socket_;
  uint64_t id_;
  std::string in_, out_, writing_;
  bool reading_ = false, writing_now_ = false, closed_ = false;
  bool busy_ = false;  // a passed-through request is unanswered
  bool output_full() const;
  // The client sent writes (answered by nothing) since its last answer that came in order: a wait
  // (on another upstream connection) could overtake them, so it waits for a fence first.
  bool unfenced_writes_ = false;
  wire::Request fenced_wait_;  // the wait held back for the fence
  // Joins (or starts) the shared wait for `r`; false when the client was closed.
  bool start_wait(const wire::Request& r);
  wire::Dialect dialect_ = wire::Dialect::kUnknown;
  // A wait shared upstream (the relay's, RelayHost::wait): its key and this client's id for it.
  std::string wait_sig_;
  uint64_t wait_id_ = 0;
  boost::asio::steady_timer wait_timer_;
  // The client's lease, kept here: keys/values as LEASE_ARM sent them.
  bool lease_armed_ = false;
  wire::Request lease_;
  int64_t lease_ttl_ = 0;
  uint64_t lease_generation_ = 0;
  boost::asio::steady_timer lease_timer_;
};

}  // namespace trun::store::relay_detail
