#pragma once
// The store's wire format: PyTorch TCPStore's protocol in its two dialects (1.13 and 2.x) plus
// trun's own extensions, decoded into one canonical Request.
//
// This header is dependency-free (standard library only) so that the decoder can be fuzzed on its
// own (tests/fuzz/). Byte layouts are documented in docs/tcpstore-protocol.md.
//
// Thread safety: all functions are pure; the types are plain values.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace trun::store::wire {

// Which protocol a connection speaks. Decided from its first message.
enum class Dialect : uint8_t {
  kUnknown,
  kV1,  // PyTorch 1.13: no handshake, SET is query 0.
  kV2,  // PyTorch 2.x: opens with VALIDATE + magic; trun's clients speak this plus extensions.
};

// Canonical operations, independent of the dialect's numbering.
enum class Op : uint8_t {
  kValidate,
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kNumKeys,
  kWatchKey,  // 1.13 only; confirmed (KEY_CALLBACK_REGISTERED) but never notified.
  kDeleteKey,
  kAppend,
  kMultiGet,
  kMultiSet,
  kCancelWait,
  kPing,
  kQueuePush,
  kQueuePop,
  kQueueLen,
  kListKeys,  // PyTorch after 2.9: every key (not the queues); the opcode is inferred, see docs
  kBarrier,   // PyTorch after 2.9: add 1 to the counter at the key, wait until it reaches n
  // trun extensions (V2 dialect only). Query numbers from kExtBase up; PyTorch never sends them.
  kAuthHello,  // client asks for a challenge; server answers 32 random bytes
  kAuthProof,  // client sends HMAC-SHA256(token, challenge); server answers 1 byte (1 = accepted)
  kWaitKeys,   // wait with a server-side timeout (ms): answers kWaitStop or kWaitTimedOut
  kGetWait,    // get with a server-side timeout (ms): answers kWaitStop + value, or kWaitTimedOut
  // Leases (rendezvous liveness): a notification bound to one connection, fired by the server
  // when that connection closes or its keep-alives stop. See LeaseSpec in tcp_store.h.
  kLeaseArm,      // keys: set, a, b; values: set, a, b; number: ttl ms. Answers u8 1.
  kLeaseRenew,    // number: new ttl ms (0 keeps it). Answers u8 1, or 0 when no lease is armed.
  kLeaseRelease,  // disarms without firing. Answers u8 1, or 0 when no lease was armed.
  // A lease's notification now, for a connection that is not the agent's own (a relay's agent
  // went away): as LEASE_ARM followed by its firing. Answers u8 1.
  kLeaseFire,
};

inline constexpr uint32_t kValidationMagic = 0x3C85F7CE;
inline constexpr uint8_t kExtBase = 0xE0;

// Response codes shared by both dialects.
inline constexpr uint8_t kCheckReady = 0;
inline constexpr uint8_t kCheckNotReady = 1;
inline constexpr uint8_t kWaitStop = 0;      // WaitResponseType::STOP_WAITING
inline constexpr uint8_t kWaitCanceled = 1;  // WaitResponseType::WAIT_CANCELED
inline constexpr uint8_t kWaitTimedOut = 2;  // trun extension (kWaitKeys only)
// trun extension (kWaitKeys, kGetWait): the server is stopping on purpose and will close the
// connection right after this byte; the wait did not complete.
inline constexpr uint8_t kWaitGoingAway = 3;

// A server-side wait timeout (WAIT_TIMEOUT, GET_TIMEOUT) above this, about 31.7 years, means no
// deadline: a steady clock counts nanoseconds in 64 bits, so a deadline much further out (from
// about 9.2e12 ms) would overflow and expire at once.
inline constexpr int64_t kMaxWaitTimeoutMs = 1'000'000'000'000;

struct Limits {
  uint64_t max_key_bytes = 64 * 1024;  // one key
  // One value, also the result of an append, and the values of one MULTI_GET's reply together
  // (a reply is bounded like a value: many keys naming one large value must not multiply it).
  uint64_t max_value_bytes = 64ull * 1024 * 1024;
  uint64_t max_keys_per_request = 64 * 1024;  // check / wait / multi_get / multi_set
};

struct Request {
  Op op = Op::kPing;
  std::vector<std::string> keys;
  std::vector<std::string> values;  // set/append: 1; compare_set: expected, desired; multi_set: n
  int64_t number = 0;  // add: delta; ping: nonce; validate: magic; wait_keys: ms; barrier: n
};

enum class Status : uint8_t { kOk, kNeedMore, kMalformed };

struct DecodeResult {
  Status status = Status::kNeedMore;
  size_t consumed = 0;  // bytes of the input that formed the request (kOk only)
  std::string error;    // kMalformed only: what was wrong, for the log line
};

// Detects the dialect from the first bytes of a connection: kUnknown while more bytes are needed.
Dialect detect_dialect(std::string_view data);

// Decodes one request from the front of `data`. Never allocates more than the limits allow, and
// rejects a length prefix over its limit as soon as the prefix itself has arrived.
DecodeResult decode(std::string_view data, Dialect dialect, const Limits& limits, Request* out);

// PyTorch's name for `op` (its QueryType's, e.g. "GETNUMKEYS"), or trun's for an extension: for
// log lines and error messages. "?" for a value outside the enum.
const char* op_name(Op op);

// The query byte that `op` has in `dialect` (for encoders); -1 if the dialect lacks it.
int query_byte(Op op, Dialect dialect);
// The op that query byte `byte` starts in `dialect` (kV1 or kV2); false for an unknown byte.
bool lookup_op(uint8_t byte, Dialect dialect, Op* op);

// Appends values in the wire encoding (native little-endian, uint64 length prefixes).
class Encoder {
 public:
  explicit Encoder(std::string* out) : out_(out) {}
  Encoder& query(Op op, Dialect dialect = Dialect::kV2);
  Encoder& u8(uint8_t v);
  Encoder& u32(uint32_t v);
  Encoder& i64(int64_t v);
  Encoder& u64(uint64_t v);
  Encoder& bytes(std::string_view s);  // uint64 length + bytes (strings and byte vectors alike)

 private:
  std::string* out_;
};

}  // namespace trun::store::wire
