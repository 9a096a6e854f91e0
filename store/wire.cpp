#include "store/wire.h"

#include <algorithm>
#include <cstring>

namespace trun::store::wire {
namespace {

// Query numbering per dialect (PyTorch's QueryType enums; see docs/tcpstore-protocol.md).
struct QueryEntry {
  uint8_t byte;
  Op op;
};
constexpr QueryEntry kV1Queries[] = {
    {0, Op::kSet},  {1, Op::kCompareSet}, {2, Op::kGet},      {3, Op::kAdd},       {4, Op::kCheck},
    {5, Op::kWait}, {6, Op::kNumKeys},    {7, Op::kWatchKey}, {8, Op::kDeleteKey},
};
constexpr QueryEntry kV2Queries[] = {
    {0, Op::kValidate},
    {1, Op::kSet},
    {2, Op::kCompareSet},
    {3, Op::kGet},
    {4, Op::kAdd},
    {5, Op::kCheck},
    {6, Op::kWait},
    {7, Op::kNumKeys},
    {8, Op::kDeleteKey},
    {9, Op::kAppend},
    {10, Op::kMultiGet},
    {11, Op::kMultiSet},
    {12, Op::kCancelWait},
    {13, Op::kPing},
    {14, Op::kQueuePush},
    {15, Op::kQueuePop},
    {16, Op::kQueueLen},
    {17, Op::kListKeys},  // 17 and 18: order of declaration, not seen in a released enum
    {18, Op::kBarrier},
    {kExtBase + 0, Op::kAuthHello},
    {kExtBase + 1, Op::kAuthProof},
    {kExtBase + 2, Op::kWaitKeys},
    {kExtBase + 3, Op::kGetWait},
    {kExtBase + 4, Op::kLeaseArm},
    {kExtBase + 5, Op::kLeaseRenew},
    {kExtBase + 6, Op::kLeaseRelease},
    {kExtBase + 7, Op::kLeaseFire},
};

template <size_t N>
bool Lookup(const QueryEntry (&table)[N], uint8_t byte, Op* op) {
  for (const auto& e : table) {
    if (e.byte == byte) {
      *op = e.op;
      return true;
    }
  }
  return false;
}

// Reads fields from the front of a buffer. Every read either succeeds, reports that more bytes
// are needed, or reports a malformed field; the first failure sticks.
class Cursor {
 public:
  Cursor(std::string_view data, const Limits& limits) : data_(data), limits_(limits) {}

  bool ok() const { return status_ == Status::kOk; }
  Status status() const { return status_; }
  const std::string& error() const { return error_; }
  size_t pos() const { return pos_; }

  template <typename T>
  bool Fixed(T* v) {
    if (!ok()) return false;
    if (data_.size() - pos_ < sizeof(T)) return Fail(Status::kNeedMore, "");
    std::memcpy(v, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }

  bool Bytes(std::string* s, uint64_t limit, const char* what) {
    uint64_t len = 0;
    if (!Fixed(&len)) return false;
    if (len > limit) {
      return Fail(Status::kMalformed, std::string(what) + " of " + std::to_string(len) +
                                          " bytes exceeds the limit of " + std::to_string(limit));
    }
    if (data_.size() - pos_ < len) return Fail(Status::kNeedMore, "");
    s->assign(data_.data() + pos_, len);
    pos_ += len;
    return true;
  }

  bool Key(std::string* s) { return Bytes(s, limits_.max_key_bytes, "key"); }
  bool Value(std::string* s) { return Bytes(s, limits_.max_value_bytes, "value"); }

  bool Count(uint64_t* n) {
    if (!Fixed(n)) return false;
    if (*n > limits_.max_keys_per_request) {
      return Fail(Status::kMalformed, "request names " + std::to_string(*n) +
                                          " keys, more than the limit of " +
                                          std::to_string(limits_.max_keys_per_request));
    }
    return true;
  }

  bool Keys(std::vector<std::string>* keys) {
    uint64_t n = 0;
    if (!Count(&n)) return false;
    // Reserve only what the bytes already received can hold (each key needs 8 bytes at least).
    keys->reserve(std::min<uint64_t>(n, (data_.size() - pos_) / 8));
    for (uint64_t i = 0; i < n; ++i) {
      keys->emplace_back();
      if (!Key(&keys->back())) return false;
    }
    return true;
  }

  bool Fail(Status s, std::string error) {
    if (ok()) {
      status_ = s;
      error_ = std::move(error);
    }
    return false;
  }

 private:
  std::string_view data_;
  const Limits& limits_;
  size_t pos_ = 0;
  Status status_ = Status::kOk;
  std::string error_;
};

void DecodeBody(Op op, Cursor& c, Request* r) {
  switch (op) {
    case Op::kValidate: {
      uint32_t magic = 0;
      if (c.Fixed(&magic)) r->number = magic;
      return;
    }
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      r->keys.resize(1);
      r->values.resize(1);
      c.Key(&r->keys[0]) && c.Value(&r->values[0]);
      return;
    case Op::kCompareSet:
      r->keys.resize(1);
      r->values.resize(2);
      c.Key(&r->keys[0]) && c.Value(&r->values[0]) && c.Value(&r->values[1]);
      return;
    case Op::kGet:
    case Op::kDeleteKey:
    case Op::kWatchKey:
    case Op::kQueueLen:
    case Op::kQueuePop:  // just the key: a blocking pop is a WAIT first, sent by the client
      r->keys.resize(1);
      c.Key(&r->keys[0]);
      return;
    case Op::kAdd:
    case Op::kBarrier: {
      r->keys.resize(1);
      int64_t n = 0;  // the delta, or the barrier's world size
      if (c.Key(&r->keys[0]) && c.Fixed(&n)) r->number = n;
      return;
    }
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
      c.Keys(&r->keys);
      return;
    case Op::kWaitKeys:
    case Op::kGetWait: {
      int64_t ms = 0;
      if (!c.Keys(&r->keys)) return;
      if (op == Op::kGetWait && r->keys.size() != 1) {
        // Its answer is one value: a count of 0 left the server nothing to answer (found by
        // tests/fuzz/kv_sequence_fuzz.cpp: it read keys[0] of an empty list).
        c.Fail(Status::kMalformed,
               "GET_TIMEOUT takes one key, not " + std::to_string(r->keys.size()));
        return;
      }
      if (c.Fixed(&ms)) r->number = ms;
      return;
    }
    case Op::kMultiSet: {
      uint64_t n = 0;
      if (!c.Count(&n)) return;
      for (uint64_t i = 0; i < n; ++i) {
        r->keys.emplace_back();
        r->values.emplace_back();
        if (!c.Key(&r->keys.back()) || !c.Value(&r->values.back())) return;
      }
      return;
    }
    case Op::kLeaseArm:
    case Op::kLeaseFire: {
      r->keys.resize(3);
      r->values.resize(3);
      int64_t ttl = 0;
      for (int i = 0; i < 3; ++i) {
        if (!c.Key(&r->keys[i]) || !c.Value(&r->values[i])) return;
      }
      if (c.Fixed(&ttl)) r->number = ttl;
      return;
    }
    case Op::kLeaseRenew: {
      int64_t ttl = 0;
      if (c.Fixed(&ttl)) r->number = ttl;
      return;
    }
    case Op::kNumKeys:
    case Op::kListKeys:
    case Op::kCancelWait:
    case Op::kAuthHello:
    case Op::kLeaseRelease:
      return;
    case Op::kPing: {
      uint32_t nonce = 0;
      if (c.Fixed(&nonce)) r->number = nonce;
      return;
    }
    case Op::kAuthProof: {
      r->values.resize(1);
      c.Bytes(&r->values[0], 64, "auth proof");
      return;
    }
  }
}

}  // namespace

Dialect detect_dialect(std::string_view data) {
  if (data.empty()) return Dialect::kUnknown;
  if (static_cast<uint8_t>(data[0]) != 0) return Dialect::kV1;
  // Byte 0 is 1.13's SET or 2.x's VALIDATE. VALIDATE carries the magic; a 1.13 SET carries the
  // low half of a key length there, and a key of ~1 GB is far over any limit, so no real 1.13
  // client sends these bytes.
  if (data.size() < 1 + sizeof(uint32_t)) return Dialect::kUnknown;
  uint32_t magic = 0;
  std::memcpy(&magic, data.data() + 1, sizeof(magic));
  return magic == kValidationMagic ? Dialect::kV2 : Dialect::kV1;
}

DecodeResult decode(std::string_view data, Dialect dialect, const Limits& limits, Request* out) {
  DecodeResult result;
  if (data.empty()) return result;
  uint8_t byte = static_cast<uint8_t>(data[0]);
  Op op;
  if (!lookup_op(byte, dialect, &op)) {
    result.status = Status::kMalformed;
    result.error = "unknown query type " + std::to_string(byte);
    return result;
  }
  *out = Request{};
  out->op = op;
  Cursor c(data.substr(1), limits);
  DecodeBody(op, c, out);
  result.status = c.status();
  if (c.ok()) {
    result.consumed = 1 + c.pos();
  } else {
    result.error = c.error();
  }
  return result;
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kValidate:
      return "VALIDATE";
    case Op::kSet:
      return "SET";
    case Op::kCompareSet:
      return "COMPARE_SET";
    case Op::kGet:
      return "GET";
    case Op::kAdd:
      return "ADD";
    case Op::kCheck:
      return "CHECK";
    case Op::kWait:
      return "WAIT";
    case Op::kNumKeys:
      return "GETNUMKEYS";
    case Op::kWatchKey:
      return "WATCH_KEY";
    case Op::kDeleteKey:
      return "DELETE_KEY";
    case Op::kAppend:
      return "APPEND";
    case Op::kMultiGet:
      return "MULTI_GET";
    case Op::kMultiSet:
      return "MULTI_SET";
    case Op::kCancelWait:
      return "CANCEL_WAIT";
    case Op::kPing:
      return "PING";
    case Op::kQueuePush:
      return "QUEUE_PUSH";
    case Op::kQueuePop:
      return "QUEUE_POP";
    case Op::kQueueLen:
      return "QUEUE_LEN";
    case Op::kListKeys:
      return "LIST_KEYS";
    case Op::kBarrier:
      return "BARRIER";
    case Op::kAuthHello:
      return "AUTH_HELLO";
    case Op::kAuthProof:
      return "AUTH_PROOF";
    case Op::kWaitKeys:
      return "WAIT_TIMEOUT";
    case Op::kGetWait:
      return "GET_TIMEOUT";
    case Op::kLeaseArm:
      return "LEASE_ARM";
    case Op::kLeaseRenew:
      return "LEASE_RENEW";
    case Op::kLeaseRelease:
      return "LEASE_RELEASE";
    case Op::kLeaseFire:
      return "LEASE_FIRE";
  }
  return "?";
}

int query_byte(Op op, Dialect dialect) {
  auto find = [op](const auto& table) {
    for (const auto& e : table) {
      if (e.op == op) return static_cast<int>(e.byte);
    }
    return -1;
  };
  return dialect == Dialect::kV1 ? find(kV1Queries) : find(kV2Queries);
}

bool lookup_op(uint8_t byte, Dialect dialect, Op* op) {
  return dialect == Dialect::kV1 ? Lookup(kV1Queries, byte, op) : Lookup(kV2Queries, byte, op);
}

Encoder& Encoder::query(Op op, Dialect dialect) {
  return u8(static_cast<uint8_t>(query_byte(op, dialect)));
}
Encoder& Encoder::u8(uint8_t v) {
  out_->push_back(static_cast<char>(v));
  return *this;
}
Encoder& Encoder::u32(uint32_t v) {
  out_->append(reinterpret_cast<const char*>(&v), sizeof(v));
  return *this;
}
Encoder& Encoder::i64(int64_t v) {
  out_->append(reinterpret_cast<const char*>(&v), sizeof(v));
  return *this;
}
Encoder& Encoder::u64(uint64_t v) {
  out_->append(reinterpret_cast<const char*>(&v), sizeof(v));
  return *this;
}
Encoder& Encoder::bytes(std::string_view s) {
  u64(s.size());
  out_->append(s.data(), s.size());
  return *this;
}

}  // namespace trun::store::wire
