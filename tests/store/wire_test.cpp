// The wire codec on its own: dialect detection, every query's layout, limits, partial input.
#include "store/wire.h"

#include <catch2/catch.hpp>

using namespace trun::store::wire;

namespace {
std::string v2(Op op) {
  std::string s;
  Encoder(&s).query(op, Dialect::kV2);
  return s;
}
}  // namespace

TEST_CASE("a 2.x connection is recognised by VALIDATE and its magic", "[wire]") {
  std::string hello;
  Encoder(&hello).u8(0).u32(kValidationMagic);
  CHECK(detect_dialect(hello) == Dialect::kV2);
  CHECK(detect_dialect(hello.substr(0, 3)) == Dialect::kUnknown);
  CHECK(detect_dialect("") == Dialect::kUnknown);
}

TEST_CASE("a 1.13 connection is recognised by any other opening", "[wire]") {
  std::string add;  // 1.13 ADD "init/" 1: what a 1.13 client sends first
  Encoder(&add).u8(3).bytes("init/").i64(1);
  CHECK(detect_dialect(add) == Dialect::kV1);
  std::string set;  // 1.13 SET starts with byte 0, like VALIDATE, but no magic follows
  Encoder(&set).u8(0).bytes("/k").bytes("v");
  CHECK(detect_dialect(set) == Dialect::kV1);
}

TEST_CASE("1.13 and 2.x number their queries differently", "[wire]") {
  CHECK(query_byte(Op::kSet, Dialect::kV1) == 0);
  CHECK(query_byte(Op::kSet, Dialect::kV2) == 1);
  CHECK(query_byte(Op::kGet, Dialect::kV1) == 2);
  CHECK(query_byte(Op::kGet, Dialect::kV2) == 3);
  CHECK(query_byte(Op::kDeleteKey, Dialect::kV1) == 8);
  CHECK(query_byte(Op::kDeleteKey, Dialect::kV2) == 8);
  CHECK(query_byte(Op::kWatchKey, Dialect::kV2) == -1);
  CHECK(query_byte(Op::kAppend, Dialect::kV1) == -1);
  CHECK(query_byte(Op::kPing, Dialect::kV2) == 13);
}

TEST_CASE("every request decodes only once all of its bytes are there", "[wire]") {
  Limits limits;
  std::string msg;
  Encoder(&msg).query(Op::kCompareSet).bytes("key").bytes("old").bytes("new");
  for (size_t cut = 0; cut < msg.size(); ++cut) {
    Request r;
    auto res = decode(std::string_view(msg).substr(0, cut), Dialect::kV2, limits, &r);
    INFO("cut at " << cut);
    CHECK(res.status == Status::kNeedMore);
  }
  Request r;
  auto res = decode(msg + "trailing", Dialect::kV2, limits, &r);
  REQUIRE(res.status == Status::kOk);
  CHECK(res.consumed == msg.size());
  CHECK(r.op == Op::kCompareSet);
  CHECK(r.keys == std::vector<std::string>{"key"});
  CHECK(r.values == std::vector<std::string>{"old", "new"});
}

TEST_CASE("multi-key requests carry their keys and values in order", "[wire]") {
  Limits limits;
  std::string msg;
  Encoder(&msg).query(Op::kMultiSet).u64(2).bytes("a").bytes("1").bytes("b").bytes("2");
  Request r;
  REQUIRE(decode(msg, Dialect::kV2, limits, &r).status == Status::kOk);
  CHECK(r.keys == std::vector<std::string>{"a", "b"});
  CHECK(r.values == std::vector<std::string>{"1", "2"});

  std::string wait;
  Encoder(&wait).query(Op::kWait, Dialect::kV1).u64(3).bytes("x").bytes("").bytes("z");
  REQUIRE(decode(wait, Dialect::kV1, limits, &r).status == Status::kOk);
  CHECK(r.op == Op::kWait);
  CHECK(r.keys == std::vector<std::string>{"x", "", "z"});
}

TEST_CASE("a length over the limit is rejected as soon as the length arrives", "[wire]") {
  Limits limits;
  limits.max_value_bytes = 1024;
  std::string msg;
  Encoder(&msg).query(Op::kSet).bytes("k").u64(1ull << 40);  // announces 1 TiB, sends nothing
  Request r;
  auto res = decode(msg, Dialect::kV2, limits, &r);
  CHECK(res.status == Status::kMalformed);
  CHECK_THAT(res.error, Catch::Contains("exceeds the limit"));

  std::string many;
  Encoder(&many).query(Op::kCheck).u64(limits.max_keys_per_request + 1);
  CHECK(decode(many, Dialect::kV2, limits, &r).status == Status::kMalformed);

  std::string big_key;
  Encoder(&big_key).query(Op::kGet).u64(limits.max_key_bytes + 1);
  CHECK(decode(big_key, Dialect::kV2, limits, &r).status == Status::kMalformed);
}

TEST_CASE("unknown query bytes are malformed in each dialect", "[wire]") {
  Limits limits;
  Request r;
  CHECK(decode("\x09", Dialect::kV1, limits, &r).status == Status::kMalformed);  // APPEND is 2.x
  CHECK(decode("\x7f", Dialect::kV2, limits, &r).status == Status::kMalformed);
  CHECK(decode(v2(Op::kNumKeys), Dialect::kV2, limits, &r).status == Status::kOk);
}

TEST_CASE("GET_TIMEOUT takes exactly one key, and another count is malformed", "[wire]") {
  Limits limits;
  for (uint64_t n : {0, 2}) {
    std::string msg = v2(Op::kGetWait);
    Encoder enc(&msg);
    enc.u64(n);
    for (uint64_t i = 0; i < n; ++i) enc.bytes("k");
    enc.i64(100);
    Request r;
    auto result = decode(msg, Dialect::kV2, limits, &r);
    CHECK(result.status == Status::kMalformed);
    CHECK_THAT(result.error, Catch::Contains("GET_TIMEOUT takes one key"));
  }
  std::string one = v2(Op::kGetWait);
  Encoder(&one).u64(1).bytes("k").i64(100);
  Request r;
  CHECK(decode(one, Dialect::kV2, limits, &r).status == Status::kOk);
  CHECK(r.keys == std::vector<std::string>{"k"});
}

TEST_CASE("lookup_op is query_byte's inverse in each dialect", "[wire]") {
  for (Dialect d : {Dialect::kV1, Dialect::kV2}) {
    for (int b = 0; b < 256; ++b) {
      Op op;
      if (lookup_op(static_cast<uint8_t>(b), d, &op)) CHECK(query_byte(op, d) == b);
    }
  }
  Op op;
  CHECK_FALSE(lookup_op(0xff, Dialect::kV2, &op));
  CHECK(lookup_op(0, Dialect::kV2, &op));
  CHECK(op == Op::kValidate);
}
