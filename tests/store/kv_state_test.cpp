// KvState, the store's key-value semantics, driven with decoded requests and no sockets: replies
// are compared byte for byte with what the wire encoder makes, and parked waits are woken through
// the Wake callback, which records the waiter (the server resumes it; the tests call resume()).
#include "store/kv_state.h"

#include <catch2/catch.hpp>

using namespace trun::store;
using wire::Op;
using Kind = KvState::Outcome::Kind;

namespace {

wire::Request req(Op op, std::vector<std::string> keys, std::vector<std::string> values = {},
                  int64_t number = 0) {
  wire::Request r;
  r.op = op;
  r.keys = std::move(keys);
  r.values = std::move(values);
  r.number = number;
  return r;
}

std::string bytes(std::string_view s) {
  std::string out;
  wire::Encoder(&out).bytes(s);
  return out;
}
std::string i64(int64_t v) {
  std::string out;
  wire::Encoder(&out).i64(v);
  return out;
}
std::string u8(uint8_t v) { return std::string(1, static_cast<char>(v)); }

struct Fixture {
  std::vector<KvState::Waiter> woken;
  KvState kv{wire::Limits{}, [this](KvState::Waiter w) { woken.push_back(w); }};
  std::string out;

  // Runs one request from `waiter`; the reply bytes are in `out` (replaced on each call).
  KvState::Outcome run(KvState::Waiter waiter, wire::Request r) {
    out.clear();
    return kv.execute(waiter, r, &out);
  }
  KvState::Outcome resume(KvState::Waiter waiter) {
    out.clear();
    return kv.resume(waiter, &out);
  }
};

}  // namespace

TEST_CASE("a get on a missing key parks until a set wakes it, then answers the value",
          "[kv_state]") {
  Fixture f;
  auto o = f.run(1, req(Op::kGet, {"k"}));
  CHECK(o.kind == Kind::kPark);
  CHECK(o.timeout_ms == -1);
  CHECK(f.out.empty());
  CHECK(f.kv.waiting_for(1) == std::vector<std::string>{"k"});
  REQUIRE(f.kv.parked(1) != nullptr);
  CHECK(f.kv.parked(1)->op == Op::kGet);

  CHECK(f.run(2, req(Op::kSet, {"k"}, {"v"})).kind == Kind::kReply);
  CHECK(f.out.empty());  // SET answers nothing
  CHECK(f.woken == std::vector<KvState::Waiter>{1});
  CHECK(f.resume(1).kind == Kind::kReply);
  CHECK(f.out == bytes("v"));
  CHECK(f.kv.parked(1) == nullptr);
}

TEST_CASE("a wait on several keys wakes when the last missing one is written, once", "[kv_state]") {
  Fixture f;
  f.run(9, req(Op::kSet, {"a"}, {"1"}));
  CHECK(f.run(1, req(Op::kWait, {"a", "b", "c", "b"})).kind == Kind::kPark);
  CHECK(f.kv.waiting_for(1) == std::vector<std::string>{"b", "c"});  // missing ones, each once
  f.run(9, req(Op::kSet, {"b"}, {"2"}));
  CHECK(f.woken.empty());
  f.run(9, req(Op::kSet, {"b"}, {"3"}));  // the same key again does not count twice
  CHECK(f.woken.empty());
  f.run(9, req(Op::kAppend, {"c"}, {"x"}));
  CHECK(f.woken == std::vector<KvState::Waiter>{1});
  f.resume(1);
  CHECK(f.out == u8(wire::kWaitStop));
}

TEST_CASE("a key deleted between the wake-up and the resume parks the request anew", "[kv_state]") {
  Fixture f;
  auto first = f.run(1, req(Op::kGet, {"k"}));
  f.run(2, req(Op::kSet, {"k"}, {"v"}));
  f.run(2, req(Op::kDeleteKey, {"k"}));
  auto again = f.resume(1);
  CHECK(again.kind == Kind::kPark);
  CHECK(again.wait_id != first.wait_id);
  CHECK(f.out.empty());
}

TEST_CASE("the wait id tells a current time-out from a stale one", "[kv_state]") {
  Fixture f;
  auto first = f.run(1, req(Op::kGetWait, {"k"}, {}, 100));
  REQUIRE(first.kind == Kind::kPark);
  CHECK(first.timeout_ms == 100);
  CHECK(f.kv.time_out(1, first.wait_id, &f.out));
  CHECK(f.out == u8(wire::kWaitTimedOut));
  CHECK(f.kv.parked(1) == nullptr);

  auto second = f.run(1, req(Op::kWaitKeys, {"k"}, {}, 50));
  CHECK(second.wait_id != first.wait_id);
  f.out.clear();
  CHECK_FALSE(f.kv.time_out(1, first.wait_id, &f.out));  // the first wait's timer, late
  CHECK(f.out.empty());
  CHECK(f.kv.parked(1) != nullptr);
  CHECK_FALSE(f.kv.time_out(2, second.wait_id, &f.out));  // someone else's id
  CHECK(f.kv.parked(1) != nullptr);
}

TEST_CASE("a zero ms server-side timeout answers TIMED_OUT at once for a missing key",
          "[kv_state]") {
  Fixture f;
  CHECK(f.run(1, req(Op::kWaitKeys, {"k"}, {}, 0)).kind == Kind::kReply);
  CHECK(f.out == u8(wire::kWaitTimedOut));
  f.run(2, req(Op::kSet, {"k"}, {"v"}));
  CHECK(f.run(1, req(Op::kGetWait, {"k"}, {}, 0)).kind == Kind::kReply);
  CHECK(f.out == u8(wire::kWaitStop) + bytes("v"));
}

TEST_CASE("a cancelled wait is not woken, and a new park replaces the waiter's old one",
          "[kv_state]") {
  Fixture f;
  f.run(1, req(Op::kWait, {"a"}));
  f.kv.cancel(1);
  CHECK(f.kv.parked(1) == nullptr);
  f.run(2, req(Op::kSet, {"a"}, {"1"}));
  CHECK(f.woken.empty());

  f.run(1, req(Op::kWait, {"b"}));
  f.run(1, req(Op::kWait, {"c"}));  // a 1.13 client gave up on b and waits for c
  f.run(2, req(Op::kSet, {"b"}, {"1"}));
  CHECK(f.woken.empty());
  f.run(2, req(Op::kSet, {"c"}, {"1"}));
  CHECK(f.woken == std::vector<KvState::Waiter>{1});
}

TEST_CASE("waiters of one key wake in the order they came", "[kv_state]") {
  Fixture f;
  for (KvState::Waiter w : {3, 1, 2}) f.run(w, req(Op::kGet, {"k"}));
  f.run(9, req(Op::kSet, {"k"}, {"v"}));
  CHECK(f.woken == std::vector<KvState::Waiter>{3, 1, 2});
}

TEST_CASE("a waiter resumed from inside the wake-up may issue requests of its own", "[kv_state]") {
  // As the server does: Wake resumes at once, and the resumed waiter's next request writes a key
  // another waiter wants.
  std::vector<std::string> replies(3);
  KvState* kv_ptr = nullptr;
  KvState kv(wire::Limits{}, [&](KvState::Waiter w) {
    kv_ptr->resume(w, &replies[w]);
    if (w == 1) {
      auto r = req(Op::kSet, {"b"}, {"from 1"});
      kv_ptr->execute(1, r, &replies[1]);
    }
  });
  kv_ptr = &kv;
  auto get_a = req(Op::kGet, {"a"});
  auto get_b = req(Op::kGet, {"b"});
  kv.execute(1, get_a, &replies[1]);
  kv.execute(2, get_b, &replies[2]);
  auto set_a = req(Op::kSet, {"a"}, {"x"});
  std::string none;
  kv.execute(0, set_a, &none);
  CHECK(replies[1] == bytes("x"));
  CHECK(replies[2] == bytes("from 1"));
  CHECK(kv.parked(1) == nullptr);
  CHECK(kv.parked(2) == nullptr);
}

TEST_CASE("compare_set follows PyTorch", "[kv_state]") {
  Fixture f;
  SECTION("a missing key with an empty expected value is set, and the desired value returned") {
    f.run(1, req(Op::kGet, {"k"}));
    f.run(2, req(Op::kCompareSet, {"k"}, {"", "new"}));
    CHECK(f.out == bytes("new"));
    CHECK(*f.kv.find("k") == "new");
    CHECK(f.woken == std::vector<KvState::Waiter>{1});
  }
  SECTION("a missing key with a non-empty expected value stays missing; expected is returned") {
    f.run(1, req(Op::kGet, {"k"}));
    f.run(2, req(Op::kCompareSet, {"k"}, {"old", "new"}));
    CHECK(f.out == bytes("old"));
    CHECK(f.kv.find("k") == nullptr);
    CHECK(f.woken.empty());
  }
  SECTION("a match swaps and returns the desired value") {
    f.run(2, req(Op::kSet, {"k"}, {"old"}));
    f.run(2, req(Op::kCompareSet, {"k"}, {"old", "new"}));
    CHECK(f.out == bytes("new"));
    CHECK(*f.kv.find("k") == "new");
  }
  SECTION("a mismatch returns the current value and changes nothing") {
    f.run(2, req(Op::kSet, {"k"}, {"cur"}));
    f.run(2, req(Op::kCompareSet, {"k"}, {"old", "new"}));
    CHECK(f.out == bytes("cur"));
    CHECK(*f.kv.find("k") == "cur");
  }
  SECTION("an existing empty value matches an empty expected value") {
    f.run(2, req(Op::kSet, {"k"}, {""}));
    f.run(2, req(Op::kCompareSet, {"k"}, {"", "new"}));
    CHECK(f.out == bytes("new"));
  }
}

TEST_CASE("add counts in decimal strings, wraps, and refuses a non-integer", "[kv_state]") {
  Fixture f;
  f.run(1, req(Op::kAdd, {"n"}, {}, 5));
  CHECK(f.out == i64(5));
  f.run(1, req(Op::kAdd, {"n"}, {}, -7));
  CHECK(f.out == i64(-2));
  CHECK(*f.kv.find("n") == "-2");

  f.run(1, req(Op::kSet, {"big"}, {std::to_string(INT64_MAX)}));
  f.run(1, req(Op::kAdd, {"big"}, {}, 1));
  CHECK(f.out == i64(INT64_MIN));

  f.run(1, req(Op::kSet, {"s"}, {"12abc"}));
  auto o = f.run(1, req(Op::kAdd, {"s"}, {}, 1));
  CHECK(o.kind == Kind::kClose);
  CHECK(o.why == "ADD on key 's' whose value is not an integer");
  CHECK(*f.kv.find("s") == "12abc");
  CHECK_FALSE(f.kv.add("s", 1).has_value());
}

TEST_CASE("append creates, extends, wakes, and stops at the value size limit", "[kv_state]") {
  wire::Limits limits;
  limits.max_value_bytes = 4;
  std::vector<KvState::Waiter> woken;
  KvState kv(limits, [&](KvState::Waiter w) { woken.push_back(w); });
  std::string out;
  auto wait = req(Op::kWait, {"k"});
  kv.execute(1, wait, &out);
  auto a = req(Op::kAppend, {"k"}, {"ab"});
  CHECK(kv.execute(2, a, &out).kind == Kind::kReply);
  CHECK(woken == std::vector<KvState::Waiter>{1});
  auto b = req(Op::kAppend, {"k"}, {"cd"});
  kv.execute(2, b, &out);
  CHECK(*kv.find("k") == "abcd");
  auto c = req(Op::kAppend, {"k"}, {"e"});
  auto o = kv.execute(2, c, &out);
  CHECK(o.kind == Kind::kClose);
  CHECK(o.why == "append would grow 'k' past the value size limit");
  CHECK(*kv.find("k") == "abcd");
  CHECK(out.empty());
}

TEST_CASE("multi_get parks on its missing keys and multi_set wakes it", "[kv_state]") {
  Fixture f;
  f.run(2, req(Op::kSet, {"a"}, {"1"}));
  CHECK(f.run(1, req(Op::kMultiGet, {"a", "b", "c"})).kind == Kind::kPark);
  f.run(2, req(Op::kMultiSet, {"b", "c"}, {"2", "3"}));
  CHECK(f.woken == std::vector<KvState::Waiter>{1});
  f.resume(1);
  CHECK(f.out == bytes("1") + bytes("2") + bytes("3"));
  f.run(1, req(Op::kMultiGet, {"c", "a"}));
  CHECK(f.out == bytes("3") + bytes("1"));
}

TEST_CASE("check, num_keys, delete_key and list_keys", "[kv_state]") {
  Fixture f;
  f.run(1, req(Op::kCheck, {"a"}));
  CHECK(f.out == u8(wire::kCheckNotReady));
  f.run(1, req(Op::kSet, {"a"}, {"1"}));
  f.run(1, req(Op::kSet, {"b"}, {"2"}));
  f.run(1, req(Op::kQueuePush, {"q"}, {"x"}));
  f.run(1, req(Op::kCheck, {"a", "b", "q"}));  // a non-empty queue counts for check
  CHECK(f.out == u8(wire::kCheckReady));
  f.run(1, req(Op::kNumKeys, {}));
  CHECK(f.out == i64(2));  // queues are not keys
  f.run(1, req(Op::kListKeys, {}));
  CHECK((f.out == i64(2) + bytes("a") + bytes("b") || f.out == i64(2) + bytes("b") + bytes("a")));
  f.run(1, req(Op::kDeleteKey, {"a"}));
  CHECK(f.out == i64(1));
  f.run(1, req(Op::kDeleteKey, {"a"}));
  CHECK(f.out == i64(0));
  CHECK(f.kv.num_keys() == 1);
}

TEST_CASE("queues: push, len, pop answer as PyTorch's server does", "[kv_state]") {
  Fixture f;
  f.run(1, req(Op::kQueuePop, {"q"}));
  CHECK(f.out == i64(0));  // empty: the length only
  f.run(1, req(Op::kQueuePush, {"q"}, {"x"}));
  CHECK(f.out.empty());
  f.run(1, req(Op::kQueuePush, {"q"}, {"y"}));
  f.run(1, req(Op::kQueueLen, {"q"}));
  CHECK(f.out == i64(2));
  f.run(1, req(Op::kQueuePop, {"q"}));
  CHECK(f.out == i64(2) + bytes("x"));  // the length before the pop, then the front
  f.run(1, req(Op::kQueuePop, {"q"}));
  CHECK(f.out == i64(1) + bytes("y"));
  f.run(1, req(Op::kQueueLen, {"q"}));
  CHECK(f.out == i64(0));
  CHECK_FALSE(f.kv.present("q", true));  // an emptied queue is gone
}

TEST_CASE("a queue push wakes the first waiting WAIT only, a GET does not see queues",
          "[kv_state]") {
  Fixture f;
  CHECK(f.run(1, req(Op::kGet, {"q"})).kind == Kind::kPark);  // get sees keys only
  f.run(2, req(Op::kWait, {"q"}));
  f.run(3, req(Op::kWait, {"q"}));
  f.run(9, req(Op::kQueuePush, {"q"}, {"x"}));
  // The push counts as a write of "q" for every waiter, so the GET's wait completes first and
  // ends the round; resumed, it finds no key "q" and parks again, behind 2 and 3.
  CHECK(f.woken == std::vector<KvState::Waiter>{1});
  f.resume(1);
  CHECK(f.kv.parked(1) != nullptr);  // re-run: still no key "q", parked again
  f.run(9, req(Op::kQueuePush, {"q"}, {"y"}));
  CHECK(f.woken == std::vector<KvState::Waiter>{1, 2});  // 2 and 3 kept their places, ahead of 1
  f.run(9, req(Op::kQueuePush, {"q"}, {"z"}));
  CHECK(f.woken == std::vector<KvState::Waiter>{1, 2, 3});
  f.resume(2);
  CHECK(f.out == u8(wire::kWaitStop));
  // A WAIT on a key that has a non-empty queue answers at once.
  f.run(4, req(Op::kWait, {"q"}));
  CHECK(f.out == u8(wire::kWaitStop));
}

TEST_CASE("barrier counts arrivals and releases everyone at the n-th", "[kv_state]") {
  Fixture f;
  auto o1 = f.run(1, req(Op::kBarrier, {"b"}, {}, 3));
  CHECK(o1.kind == Kind::kPark);
  CHECK(f.kv.parked(1)->op == Op::kWait);
  CHECK(f.run(2, req(Op::kBarrier, {"b"}, {}, 3)).kind == Kind::kPark);
  CHECK(f.woken.empty());  // arrivals below n wake no one
  CHECK(*f.kv.find("b") == "2");
  CHECK(f.run(3, req(Op::kBarrier, {"b"}, {}, 3)).kind == Kind::kReply);
  CHECK(f.out == u8(wire::kWaitStop));
  CHECK(f.woken == std::vector<KvState::Waiter>{1, 2});
  f.resume(1);
  CHECK(f.out == u8(wire::kWaitStop));
}

TEST_CASE("every barrier arrival wakes the key's waits, but only the n-th releases the arrivals",
          "[kv_state]") {
  Fixture f;
  CHECK(f.run(10, req(Op::kWait, {"b"})).kind == Kind::kPark);
  CHECK(f.run(11, req(Op::kGet, {"b"})).kind == Kind::kPark);
  CHECK(f.run(1, req(Op::kBarrier, {"b"}, {}, 3)).kind == Kind::kPark);
  CHECK(f.woken == std::vector<KvState::Waiter>{10, 11});  // the key exists now
  f.resume(10);
  CHECK(f.out == u8(wire::kWaitStop));
  f.resume(11);
  CHECK(f.out == bytes("1"));
  CHECK(f.kv.waiting_for(1) == std::vector<std::string>{"b"});
  // Writes that leave the count below 3 do not release arrival 1.
  f.run(9, req(Op::kAdd, {"b"}, {}, 0));
  f.run(9, req(Op::kSet, {"b"}, {"1"}));
  CHECK(f.run(2, req(Op::kBarrier, {"b"}, {}, 3)).kind == Kind::kPark);
  CHECK(f.woken == std::vector<KvState::Waiter>{10, 11});
  // A cancelled arrival (a client-side timeout) still counts, and is not woken.
  f.kv.cancel(2);
  CHECK(f.kv.parked(2) == nullptr);
  CHECK(f.run(3, req(Op::kBarrier, {"b"}, {}, 3)).kind == Kind::kReply);
  CHECK(f.out == u8(wire::kWaitStop));
  CHECK(f.woken == std::vector<KvState::Waiter>{10, 11, 1});
  f.resume(1);
  CHECK(f.out == u8(wire::kWaitStop));
  CHECK(f.kv.parked(1) == nullptr);
}

TEST_CASE("barrier arrivals with different world sizes are each released at their own",
          "[kv_state]") {
  Fixture f;
  CHECK(f.run(1, req(Op::kBarrier, {"b"}, {}, 4)).kind == Kind::kPark);
  CHECK(f.run(2, req(Op::kBarrier, {"b"}, {}, 2)).kind == Kind::kReply);  // count 2 >= 2
  CHECK(f.woken.empty());
  CHECK(f.run(3, req(Op::kBarrier, {"b"}, {}, 5)).kind == Kind::kPark);
  // A SET that jumps the count releases whoever it satisfies: 1 (n 4), not 3 (n 5).
  f.run(9, req(Op::kSet, {"b"}, {"4"}));
  CHECK(f.woken == std::vector<KvState::Waiter>{1});
  CHECK(f.kv.parked(3) != nullptr);
  CHECK(f.run(4, req(Op::kBarrier, {"b"}, {}, 5)).kind == Kind::kReply);
  CHECK(f.woken == std::vector<KvState::Waiter>{1, 3});
}

TEST_CASE("requests that are not key-value operations are refused", "[kv_state]") {
  Fixture f;
  auto o = f.run(1, req(Op::kPing, {}, {}, 7));
  CHECK(o.kind == Kind::kClose);
  CHECK(f.out.empty());
}

TEST_CASE("a server-side timeout over kMaxWaitTimeoutMs parks with no deadline, not an overflow",
          "[kv_state]") {
  Fixture f;
  for (int64_t ms : {wire::kMaxWaitTimeoutMs + 1, int64_t(10'000'000'000'000), INT64_MAX}) {
    auto o = f.run(1, req(Op::kWaitKeys, {"late"}, {}, ms));
    CHECK(o.kind == Kind::kPark);
    CHECK(o.timeout_ms == -1);
  }
  auto o = f.run(2, req(Op::kGetWait, {"late"}, {}, wire::kMaxWaitTimeoutMs));
  CHECK(o.kind == Kind::kPark);
  CHECK(o.timeout_ms == wire::kMaxWaitTimeoutMs);  // the largest deadline kept as given
}

TEST_CASE("a MULTI_GET whose values together pass the value limit closes instead of answering",
          "[kv_state]") {
  wire::Limits limits;
  limits.max_value_bytes = 100;
  KvState kv(limits);
  kv.set("a", std::string(60, 'a'));
  kv.set("b", std::string(40, 'b'));
  std::string out;
  wire::Request fits = req(Op::kMultiGet, {"a", "b"});
  CHECK(kv.execute(1, fits, &out).kind == Kind::kReply);
  CHECK(out == bytes(std::string(60, 'a')) + bytes(std::string(40, 'b')));
  out.clear();
  // One key named many times would multiply one value: refused by the total, not per value.
  wire::Request many = req(Op::kMultiGet, {"a", "a"});
  auto o = kv.execute(1, many, &out);
  CHECK(o.kind == Kind::kClose);
  CHECK_THAT(o.why, Catch::Contains("MULTI_GET") && Catch::Contains("120 bytes"));
  CHECK(out.empty());
}

TEST_CASE("a GET_TIMEOUT naming no key closes instead of reading a key that is not there",
          "[kv_state]") {
  Fixture f;
  auto o = f.run(1, req(Op::kGetWait, {}, {}, 0));
  CHECK(o.kind == Kind::kClose);
  CHECK(f.out.empty());
}
