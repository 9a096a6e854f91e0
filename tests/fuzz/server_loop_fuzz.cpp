// clang-format off
// fuzz-sources: store/request_loop.cpp store/kv_state.cpp store/wire.cpp store/auth.cpp
// clang-format on
// libFuzzer target for the store server's per-connection request loop (RequestLoop,
// store/request_loop.h, the code StoreServer's connections run): two connections over
// one KvState, fed arbitrary input chunks, with a simulated reader that drains their output
// slowly, time-outs, wake-ups across connections, and authentication (a fixed challenge, so the
// input can prove the token). The Host below stands in for the socket as server.cpp's Connection
// does: what it writes is "in flight" until the reader drains it; after a drain the loop runs
// again, as on a write completion.
//
// Input: byte 0 sets the mode (bit 0: token required; bits 1-3: the output limit, 64 << n
// bytes). Then steps; each step's first byte picks the action (low 3 bits) and the connection
// (bit 3): 0-2: feed the next 1 + b bytes (b: the following byte) as input and process; 3: the
// reader drains up to 16 * b bytes of the connection's in-flight output, then process; 4: the
// parked wait times out; 5: a correct handshake (VALIDATE, AUTH_HELLO, AUTH_PROOF) is fed;
// 6: flush (the connection hands its replies to the socket), then process; 7: process again.
//
// Invariants (abort() on failure):
//  - output: unsent bytes (out() + in flight) never exceed the limit by more than one reply plus
//    one wake-up's answer; kOutputFull is returned only when the output is over the limit;
//  - authentication: nothing but the handshake is executed before AUTH_PROOF succeeds (no
//    request counted, no key written, no lease asked of the Host, nothing parked), and an
//    unauthenticated connection never holds more than kMaxPreAuthInput + one chunk of input;
//  - a connection told to close is fed nothing more; kBlocked means a parked request.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "store/auth.h"
#include "store/kv_state.h"
#include "store/request_loop.h"
#include "store/wire.h"

namespace store = trun::store;
namespace wire = trun::store::wire;
using store::RequestLoop;
using wire::Op;

namespace {

void check(bool ok, int line = __builtin_LINE()) {
  if (ok) return;
  std::fprintf(stderr, "server_loop_fuzz: invariant at line %d failed\n", line);
  std::abort();
}

const std::string kToken = "fuzz-token";
const std::string kChallenge(store::auth::kChallengeBytes, 'c');

// The largest single reply with the limits below: MULTI_GET of 4 keys (4 * 8 bytes of lengths
// plus at most max_value_bytes of values), GET_TIMEOUT (1 + 8 + value), AUTH_HELLO (8 + 32), or
// LIST_KEYS (8 + per key 8 + key), which depends on the number of keys: the most seen between
// steps plus what one input chunk (at most 256 bytes, 17 bytes per SET at least) can add.
size_t keys_seen = 0;
size_t max_reply(const store::KvState& kv, const wire::Limits& limits) {
  keys_seen = std::max(keys_seen, kv.num_keys());
  size_t list = 8 + (keys_seen + 16) * (8 + limits.max_key_bytes);
  size_t other = 4 * 8 + limits.max_value_bytes + 1 + 8;
  return std::max(list, other);
}

class Conn : public RequestLoop::Host {
 public:
  Conn(store::RequestLoopOptions options, store::KvState* kv, uint64_t id)
      : loop(std::move(options), kv, id), kv_(kv), id_(id) {}

  size_t in_flight() const override { return in_flight_; }
  void parked(const store::KvState::Outcome& outcome) override {
    check(loop.authenticated());
    wait_id = outcome.wait_id;
  }
  void wait_cancelled() override { check(loop.authenticated()); }
  bool lease(wire::Request& r, std::string* out, std::string* why) override {
    check(loop.authenticated());
    if ((r.op == Op::kLeaseArm || r.op == Op::kLeaseRenew) && r.number < 0) {
      *why = "negative ttl";
      return false;
    }
    wire::Encoder(out).u8(1);
    return true;
  }

  // As Connection::process: not re-entered (a wake-up inside the loop only queues its answer).
  void process(const store::KvState& kv, const wire::Limits& limits) {
    if (closed || processing_) return;
    processing_ = true;
    max_reply(kv, limits);  // notes the keys there are before
    RequestLoop::Stop stop = loop.process(*this);
    processing_ = false;
    const size_t bound = loop.options().max_pending_output + 2 * max_reply(kv, limits);
    check(loop.out().size() + in_flight_ <= bound);
    if (stop == RequestLoop::Stop::kOutputFull) check(loop.output_full(*this));
    if (stop == RequestLoop::Stop::kBlocked) check(kv_->parked(id_) != nullptr);
    if (stop == RequestLoop::Stop::kClose) {
      check(!loop.why().empty());
      closed = true;
      kv_->cancel(id_);  // as Connection::close
    }
    if (!loop.authenticated() && !closed) {
      check(loop.executed() == 0);
      check(kv_->parked(id_) == nullptr);
      check(loop.buffered_input() <= store::kMaxPreAuthInput + 256);
    }
  }
  void flush() {
    in_flight_ += loop.out().size();
    loop.out().clear();
  }
  void drain(size_t n) { in_flight_ -= std::min(n, in_flight_); }
  void feed(std::string_view bytes) {
    if (!closed) loop.append(bytes.data(), bytes.size());
  }

  RequestLoop loop;
  uint64_t wait_id = 0;
  bool closed = false;

 private:
  store::KvState* kv_;
  uint64_t id_;
  size_t in_flight_ = 0;
  bool processing_ = false;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  wire::Limits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 64;
  limits.max_keys_per_request = 4;
  keys_seen = 0;
  const bool token = data[0] & 1;
  store::RequestLoopOptions options;
  options.limits = limits;
  options.token = token ? kToken : "";
  options.max_pending_output = uint64_t(64) << ((data[0] >> 1) & 7);
  options.output_per_turn = 96;
  options.make_challenge = [] { return kChallenge; };

  Conn* conns[2] = {nullptr, nullptr};
  store::KvState kv(limits, [&](store::KvState::Waiter id) {
    // As Connection::on_keys_ready: answer the parked request, then serve what queued behind it.
    Conn* c = conns[id];
    auto o = kv.resume(id, &c->loop.out());
    if (o.kind == store::KvState::Outcome::Kind::kClose) {
      c->closed = true;
      kv.cancel(id);
    }
    c->process(kv, limits);
  });
  Conn a(options, &kv, 0), b(options, &kv, 1);
  conns[0] = &a;
  conns[1] = &b;

  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  int steps = 0;
  while (!in.empty() && steps++ < 256) {
    const uint8_t step = static_cast<uint8_t>(in[0]);
    in.remove_prefix(1);
    Conn& c = *conns[(step >> 3) & 1];
    const uint8_t arg = in.empty() ? 0 : static_cast<uint8_t>(in[0]);
    const bool wrote_before = kv.num_keys() > 0;
    const bool authenticated_before = c.loop.authenticated();
    switch (step & 7) {
      case 0:
      case 1:
      case 2: {
        if (!in.empty()) in.remove_prefix(1);
        size_t n = std::min<size_t>(size_t(arg) + 1, in.size());
        c.feed(in.substr(0, n));
        in.remove_prefix(n);
        c.process(kv, limits);
        break;
      }
      case 3:
        if (!in.empty()) in.remove_prefix(1);
        c.drain(size_t(arg) * 16);
        c.process(kv, limits);  // as a write completion
        break;
      case 4:
        if (!c.closed && kv.time_out(&c == &a ? 0 : 1, c.wait_id, &c.loop.out())) {
          c.process(kv, limits);
        }
        break;
      case 5: {
        std::string hs;
        wire::Encoder(&hs).query(Op::kValidate).u32(wire::kValidationMagic);
        wire::Encoder(&hs).query(Op::kAuthHello);
        wire::Encoder(&hs)
            .query(Op::kAuthProof)
            .bytes(store::auth::hmac_sha256(kToken, kChallenge));
        c.feed(hs);
        c.process(kv, limits);
        break;
      }
      case 6:
        c.flush();
        c.process(kv, limits);
        break;
      default:
        c.process(kv, limits);
    }
    // Only an authenticated connection writes keys: with a token, none before some connection
    // authenticated.
    if (token && !wrote_before && kv.num_keys() > 0) {
      check(a.loop.authenticated() || b.loop.authenticated() || authenticated_before);
    }
  }
  return 0;
}
