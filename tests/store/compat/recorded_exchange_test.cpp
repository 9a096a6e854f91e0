// Recorded exchanges: the exact bytes PyTorch's TCPStore clients send (2.x "validated" protocol and
// 1.13), replayed over raw sockets against an in-process StoreServer, asserting the exact reply
// bytes and that requests without a reply get none. PyTorch 2.x cannot be installed here, so the
// 2.x sequences are derived from its TCPStore sources, as written down in
// docs/tcpstore-protocol.md (sections 4, 6 and 7); the 1.13 ones were also seen from the real
// 1.13 client on this machine.
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <thread>

#include "store/server.h"
#include "tests/store/compat/raw_socket.h"

namespace {

using namespace std::chrono_literals;
using trun::store::StoreServer;
using trun::store::StoreServerOptions;
using trun::test::hex;
using trun::test::RawSocket;
using trun::test::to_hex;

// Wire fragments: a `str` is a u64 LE length followed by the bytes. Keys carry the client's "/"
// prefix, as on the wire.
const char* const kKey = "04 00 00 00 00 00 00 00 2f 6b 65 79";       // "/key"
const char* const kValue = "05 00 00 00 00 00 00 00 76 61 6c 75 65";  // "value"
const char* const kCnt = "04 00 00 00 00 00 00 00 2f 63 6e 74";       // "/cnt"
const char* const kMiss = "05 00 00 00 00 00 00 00 2f 6d 69 73 73";   // "/miss"
const char* const kInit = "05 00 00 00 00 00 00 00 69 6e 69 74 2f";   // "init/" (no "/" prefix)
const char* const kEmpty = "00 00 00 00 00 00 00 00";                 // ""
const char* const kOne = "01 00 00 00 00 00 00 00";                   // u64/i64 1
const char* const kTwo = "02 00 00 00 00 00 00 00";                   // u64/i64 2
const char* const kZero = "00 00 00 00 00 00 00 00";                  // u64/i64 0
const char* const kQueue = "02 00 00 00 00 00 00 00 2f 71";           // "/q"
const char* const kX = "01 00 00 00 00 00 00 00 78";                  // "x"
const char* const kY = "01 00 00 00 00 00 00 00 79";                  // "y"
const char* const kValidate = "00 ce f7 85 3c";                       // VALIDATE + magic
const char* const kPing12345 = "0d 39 30 00 00";                      // PING, nonce 12345
const char* const kPong12345 = "39 30 00 00";

std::string cat(std::initializer_list<const char*> parts) {
  std::string all;
  for (const char* p : parts) all += hex(p);
  return all;
}

struct Fixture {
  Fixture() {
    StoreServerOptions opts;
    opts.host = "127.0.0.1";
    server = StoreServer::start(opts);
  }
  ~Fixture() { server->stop(); }

  // A 2.x client after its connect sequence (VALIDATE, PING echoed).
  std::unique_ptr<RawSocket> v2_client() {
    auto s = std::make_unique<RawSocket>(server->port());
    s->send_bytes(cat({kValidate, kPing12345}));
    REQUIRE(to_hex(s->recv_bytes(4)) == to_hex(hex(kPong12345)));
    return s;
  }

  // Expects exactly `reply` (hex) and then nothing more for a moment.
  static void expect_reply(RawSocket& s, const std::string& reply) {
    std::string want = hex(reply);
    CHECK(to_hex(s.recv_bytes(want.size())) == to_hex(want));
    CHECK(s.silent_for(50ms));
  }

  // Sends a request that PyTorch's server never answers, and checks that none comes back.
  static void expect_no_reply(RawSocket& s, const std::string& request) {
    s.send_bytes(request);
    CHECK(s.silent_for(100ms));
  }

  bool wait_connections(size_t n) {
    for (int i = 0; i < 500 && server->num_connections() != n; ++i)
      std::this_thread::sleep_for(10ms);
    return server->num_connections() == n;
  }

  std::unique_ptr<StoreServer> server;
};

TEST_CASE_METHOD(Fixture, "a 2.x client's connect sequence gets only the ping echo",
                 "[store][compat][v2]") {
  RawSocket s(server->port());
  // VALIDATE has no reply; PING echoes the nonce (the client's pid), sent without waiting.
  s.send_bytes(cat({kValidate, "0d 2a 10 01 00"}));
  expect_reply(s, "2a 10 01 00");
  // Worker registration: ADD "init/" 1 (no "/" prefix), answered with the new count.
  s.send_bytes(cat({"04", kInit, kOne}));
  expect_reply(s, kOne);
  RawSocket t(server->port());
  t.send_bytes(cat({kValidate, kPing12345, "04", kInit, kOne}));
  expect_reply(t, std::string(kPong12345) + kTwo);
}

TEST_CASE_METHOD(Fixture, "the connect sequence split into single bytes is still understood",
                 "[store][compat][v2]") {
  RawSocket s(server->port());
  std::string bytes = cat({kValidate, kPing12345, "04", kInit, kOne});
  for (char b : bytes) {
    s.send_bytes(std::string(1, b));
    std::this_thread::sleep_for(2ms);
  }
  expect_reply(s, std::string(kPong12345) + kOne);
}

TEST_CASE_METHOD(Fixture, "2.x set, wait then get, add, check and num_keys",
                 "[store][compat][v2]") {
  auto s = v2_client();
  expect_no_reply(*s, cat({"01", kKey, kValue}));  // SET "/key" "value"
  s->send_bytes(cat({"06", kOne, kKey}));          // get(): WAIT ["/key"] ...
  expect_reply(*s, "00");                          // STOP_WAITING
  s->send_bytes(cat({"03", kKey}));                // ... then GET "/key"
  expect_reply(*s, kValue);

  s->send_bytes(cat({"04", kCnt, "05 00 00 00 00 00 00 00"}));  // ADD "/cnt" 5 on a new key
  expect_reply(*s, "05 00 00 00 00 00 00 00");
  s->send_bytes(cat({"04", kCnt, "f9 ff ff ff ff ff ff ff"}));  // ADD "/cnt" -7
  expect_reply(*s, "fe ff ff ff ff ff ff ff");                  // -2
  s->send_bytes(cat({"03", kCnt}));                             // stored as decimal text
  expect_reply(*s, "02 00 00 00 00 00 00 00 2d 32");            // "-2"

  s->send_bytes(cat({"05", kOne, kKey}));  // CHECK ["/key"]
  expect_reply(*s, "00");                  // READY
  s->send_bytes(cat({"05", kTwo, kKey, kMiss}));
  expect_reply(*s, "01");  // NOT_READY: one key missing
  s->send_bytes(cat({"05", kZero}));
  expect_reply(*s, "00");  // no keys: READY

  s->send_bytes(hex("07"));  // GETNUMKEYS: "/key" and "/cnt"
  expect_reply(*s, kTwo);
}

TEST_CASE_METHOD(Fixture, "2.x compare_set in its four cases", "[store][compat][v2]") {
  auto s = v2_client();
  const char* k = "02 00 00 00 00 00 00 00 2f 6b";  // "/k"
  const char* x = kX;
  const char* y = kY;
  const char* z = "01 00 00 00 00 00 00 00 7a";  // "z"
  // Missing key, expected not empty: nothing stored, the expected value comes back.
  s->send_bytes(cat({"02", k, y, x}));
  expect_reply(*s, y);
  s->send_bytes(cat({"05", kOne, k}));
  expect_reply(*s, "01");
  // Missing key, empty expected: stores desired and returns it.
  s->send_bytes(cat({"02", k, kEmpty, x}));
  expect_reply(*s, x);
  // Present and equal: swaps.
  s->send_bytes(cat({"02", k, x, y}));
  expect_reply(*s, y);
  // Present and different: unchanged, current value returned.
  s->send_bytes(cat({"02", k, x, z}));
  expect_reply(*s, y);
  s->send_bytes(cat({"03", k}));
  expect_reply(*s, y);
}

TEST_CASE_METHOD(Fixture, "2.x delete_key, append, multi_set and multi_get",
                 "[store][compat][v2]") {
  auto s = v2_client();
  expect_no_reply(*s, cat({"01", kKey, kValue}));
  s->send_bytes(cat({"08", kKey}));  // DELETE_KEY: one deleted
  expect_reply(*s, kOne);
  s->send_bytes(cat({"08", kKey}));  // again: none
  expect_reply(*s, kZero);

  const char* app = "04 00 00 00 00 00 00 00 2f 61 70 70";                 // "/app"
  expect_no_reply(*s, cat({"09", app, "02 00 00 00 00 00 00 00 61 62"}));  // APPEND "ab"
  expect_no_reply(*s, cat({"09", app, "02 00 00 00 00 00 00 00 63 64"}));  // APPEND "cd"
  s->send_bytes(cat({"03", app}));
  expect_reply(*s, "04 00 00 00 00 00 00 00 61 62 63 64");  // "abcd"

  const char* a = "02 00 00 00 00 00 00 00 2f 61";         // "/a"
  const char* b = "02 00 00 00 00 00 00 00 2f 62";         // "/b"
  const char* one = "01 00 00 00 00 00 00 00 31";          // "1"
  const char* two = "01 00 00 00 00 00 00 00 32";          // "2"
  expect_no_reply(*s, cat({"0b", kTwo, a, one, b, two}));  // MULTI_SET
  s->send_bytes(cat({"06", kTwo, b, a}));                  // multi_get(): WAIT ["/b", "/a"] ...
  expect_reply(*s, "00");
  s->send_bytes(cat({"0a", kTwo, b, a}));  // ... then MULTI_GET: values in request order
  expect_reply(*s, std::string(two) + one);
  s->send_bytes(hex("07"));  // "/app", "/a", "/b"
  expect_reply(*s, "03 00 00 00 00 00 00 00");
}

TEST_CASE_METHOD(Fixture, "2.7+ queue_push, queue_pop and queue_len", "[store][compat][v2]") {
  auto s = v2_client();
  const char* q = kQueue;
  const char* x = kX;
  const char* y = kY;
  s->send_bytes(cat({"10", q}));  // QUEUE_LEN of a queue never pushed to
  expect_reply(*s, kZero);
  s->send_bytes(cat({"0f", q}));  // QUEUE_POP on an empty queue: the length 0 and nothing else
  expect_reply(*s, kZero);
  s->send_bytes(cat({"05", kOne, q}));  // CHECK: an empty queue is not a key
  expect_reply(*s, "01");

  expect_no_reply(*s, cat({"0e", q, x}));  // QUEUE_PUSH "x": no reply
  expect_no_reply(*s, cat({"0e", q, y}));  // QUEUE_PUSH "y"
  s->send_bytes(cat({"10", q}));
  expect_reply(*s, kTwo);
  s->send_bytes(cat({"05", kOne, q}));  // CHECK: a non-empty queue counts as present
  expect_reply(*s, "00");
  s->send_bytes(hex("07"));  // GETNUMKEYS: queues are not keys
  expect_reply(*s, kZero);
  s->send_bytes(cat({"0f", q}));  // first in, first out; the length before the pop comes first
  expect_reply(*s, std::string(kTwo) + x);
  s->send_bytes(cat({"06", kOne, q}));  // WAIT on the queue: one element left, so at once
  expect_reply(*s, "00");
  s->send_bytes(cat({"0f", q}));
  expect_reply(*s, std::string(kOne) + y);
  s->send_bytes(cat({"0f", q}));
  expect_reply(*s, kZero);
  // A key and a queue of the same name are separate.
  expect_no_reply(*s, cat({"01", q, kValue}));
  s->send_bytes(cat({"10", q}));
  expect_reply(*s, kZero);
  s->send_bytes(cat({"03", q}));
  expect_reply(*s, kValue);
}

TEST_CASE_METHOD(Fixture, "a queue push wakes one blocked queue_pop at a time, in order",
                 "[store][compat][v2]") {
  // queue_pop(block=True) is WAIT on the queue, then QUEUE_POP. Two clients block; each push
  // must wake exactly one of them, the one that came first, so that no pop finds the queue empty.
  auto first = v2_client();
  auto second = v2_client();
  auto pusher = v2_client();
  const char* q = kQueue;
  const char* x = kX;
  const char* y = kY;
  first->send_bytes(cat({"06", kOne, q, "0f", q}));  // WAIT then QUEUE_POP, pipelined
  CHECK(first->silent_for(100ms));
  second->send_bytes(cat({"06", kOne, q, "0f", q}));
  CHECK(second->silent_for(100ms));

  expect_no_reply(*pusher, cat({"0e", q, x}));
  expect_reply(*first, std::string("00") + kOne + x);  // woken, popped the only element
  CHECK(second->silent_for(100ms));                    // still blocked

  expect_no_reply(*pusher, cat({"0e", q, y}));
  expect_reply(*second, std::string("00") + kOne + y);
  pusher->send_bytes(cat({"10", q}));
  expect_reply(*pusher, kZero);
}

// LIST_KEYS (17) and BARRIER (18) exist only in PyTorch after 2.9; their opcodes follow the
// order of declaration (docs/tcpstore-protocol.md, section 2).
TEST_CASE_METHOD(Fixture, "list_keys names every key and no queue", "[store][compat][v2]") {
  auto s = v2_client();
  s->send_bytes(hex("11"));
  expect_reply(*s, kZero);
  expect_no_reply(*s, cat({"01", kKey, kValue}));
  expect_no_reply(*s, cat({"0e", kQueue, kX}));  // a queue is not a key
  s->send_bytes(hex("11"));
  expect_reply(*s, std::string(kOne) + kKey);
  s->send_bytes(cat({"04", kCnt, kOne, "11"}));  // ADD then LIST_KEYS: two keys, in any order
  CHECK(to_hex(s->recv_bytes(16)) == to_hex(cat({kOne, kTwo})));
  std::string names = to_hex(s->recv_bytes(hex(kKey).size() + hex(kCnt).size()));
  CHECK((names == to_hex(cat({kKey, kCnt})) || names == to_hex(cat({kCnt, kKey}))));
}

TEST_CASE_METHOD(Fixture, "a barrier releases every waiter when the last one arrives",
                 "[store][compat][v2]") {
  const char* b = "02 00 00 00 00 00 00 00 2f 62";  // "/b"
  const char* three = "03 00 00 00 00 00 00 00";
  auto first = v2_client();
  auto second = v2_client();
  auto last = v2_client();
  first->send_bytes(cat({"12", b, three}));
  CHECK(first->silent_for(100ms));
  second->send_bytes(cat({"12", b, three, "07"}));  // GETNUMKEYS queued behind the barrier
  CHECK(second->silent_for(100ms));
  CHECK(first->silent_for(10ms));
  last->send_bytes(cat({"12", b, three}));
  expect_reply(*last, "00");
  expect_reply(*first, "00");
  expect_reply(*second, std::string("00") + kOne);
  last->send_bytes(cat({"03", b}));  // the counter is an ordinary key
  expect_reply(*last, "01 00 00 00 00 00 00 00 33");
  last->send_bytes(cat({"12", b, three}));  // past the count: passes at once
  expect_reply(*last, "00");
}

TEST_CASE_METHOD(Fixture, "a barrier timeout: CANCEL_WAIT, and the arrival still counts",
                 "[store][compat][v2]") {
  const char* b = "02 00 00 00 00 00 00 00 2f 62";
  auto s = v2_client();
  s->send_bytes(cat({"12", b, kTwo}));
  CHECK(s->silent_for(100ms));
  s->send_bytes(hex("0c"));  // the client's timeout: CANCEL_WAIT
  expect_reply(*s, "01");
  s->send_bytes(cat({"03", b}));  // PyTorch's server keeps the arrival too
  expect_reply(*s, "01 00 00 00 00 00 00 00 31");
  auto other = v2_client();
  other->send_bytes(cat({"12", b, kTwo}));
  expect_reply(*other, "00");
  CHECK(s->silent_for(50ms));  // the cancelled wait is not answered again
}

TEST_CASE_METHOD(Fixture, "a barrier on a key that is not a counter closes that connection",
                 "[store][compat][v2]") {
  auto s = v2_client();
  auto other = v2_client();
  expect_no_reply(*other, cat({"01", kKey, kValue}));
  other->send_bytes(cat({"03", kKey}));  // a round trip: the SET is stored
  expect_reply(*other, kValue);
  s->send_bytes(cat({"12", kKey, kTwo}));
  CHECK(s->closed_by_peer());
  other->send_bytes(cat({"03", kKey}));
  expect_reply(*other, kValue);
}

TEST_CASE_METHOD(Fixture, "a 2.x wait is answered when its last key appears",
                 "[store][compat][v2]") {
  auto waiter = v2_client();
  auto setter = v2_client();
  const char* a = "02 00 00 00 00 00 00 00 2f 61";
  const char* b = "02 00 00 00 00 00 00 00 2f 62";
  waiter->send_bytes(cat({"06", kTwo, a, b}));
  CHECK(waiter->silent_for(100ms));
  expect_no_reply(*setter, cat({"01", a, kValue}));
  CHECK(waiter->silent_for(100ms));  // one of two keys: still waiting
  expect_no_reply(*setter, cat({"01", b, kValue}));
  expect_reply(*waiter, "00");
}

TEST_CASE_METHOD(Fixture, "a 2.x wait timeout: CANCEL_WAIT is answered with WAIT_CANCELED",
                 "[store][compat][v2]") {
  auto s = v2_client();
  s->send_bytes(cat({"06", kOne, kMiss}));  // WAIT ["/miss"]
  CHECK(s->silent_for(200ms));              // ... the client's timeout expires ...
  s->send_bytes(hex("0c"));                 // CANCEL_WAIT
  expect_reply(*s, "01");                   // WAIT_CANCELED
  // The registration is gone: setting the key later sends nothing to this connection, and the
  // connection serves the next request normally.
  auto other = v2_client();
  expect_no_reply(*other, cat({"01", kMiss, kValue}));
  CHECK(s->silent_for(100ms));
  s->send_bytes(hex(kPing12345));
  expect_reply(*s, kPong12345);
  // CANCEL_WAIT with nothing pending is still answered.
  s->send_bytes(hex("0c"));
  expect_reply(*s, "01");
}

TEST_CASE_METHOD(Fixture, "a key that arrives before CANCEL_WAIT: 00 then 01",
                 "[store][compat][v2]") {
  auto s = v2_client();
  auto other = v2_client();
  s->send_bytes(cat({"06", kOne, kMiss}));
  CHECK(s->silent_for(100ms));
  other->send_bytes(cat({"01", kMiss, kValue}));
  // The client's timeout expired just as the key arrived: the late STOP_WAITING is in flight
  // when it sends CANCEL_WAIT, and it reads 00 and then expects 01.
  std::this_thread::sleep_for(100ms);
  s->send_bytes(hex("0c"));
  expect_reply(*s, "00 01");
}

TEST_CASE_METHOD(Fixture, "a 2.x connection with a bad validation magic is closed",
                 "[store][compat][v2]") {
  RawSocket bad(server->port());
  // Not the magic: read as a 1.13 SET whose key length (0x...efbeadde) is far over the limit.
  bad.send_bytes(hex("00 de ad be ef 00 00 00 00"));
  CHECK(bad.closed_by_peer());
  auto good = v2_client();  // the server keeps serving
  good->send_bytes(hex("07"));
  expect_reply(*good, kZero);
}

TEST_CASE_METHOD(Fixture, "1.13 exchanges: the legacy numbering on the same store",
                 "[store][compat][v113]") {
  RawSocket s(server->port());
  s.send_bytes(cat({"03", kInit, kOne}));  // ADD "init/" 1: the 1.13 connect sequence
  expect_reply(s, kOne);
  // SET starts with 00 like VALIDATE, but the next bytes are a key length, not the magic.
  expect_no_reply(s, cat({"00", kKey, kValue}));
  s.send_bytes(cat({"05", kOne, kKey}));  // WAIT
  expect_reply(s, "00");
  s.send_bytes(cat({"02", kKey}));  // GET
  expect_reply(s, kValue);
  s.send_bytes(cat({"01", kKey, kValue, kEmpty}));  // COMPARE_SET "value" -> ""
  expect_reply(s, kEmpty);
  s.send_bytes(cat({"04", kOne, kKey}));  // CHECK
  expect_reply(s, "00");
  s.send_bytes(hex("06"));  // GETNUMKEYS: "init/" and "/key"
  expect_reply(s, kTwo);
  s.send_bytes(cat({"08", kKey}));  // DELETE_KEY
  expect_reply(s, kOne);
  // The 2.x client on the same store sees the same data.
  auto v2 = v2_client();
  v2->send_bytes(cat({"03", kInit}));
  expect_reply(*v2, "01 00 00 00 00 00 00 00 31");  // "1"
}

TEST_CASE_METHOD(Fixture,
                 "1.13 wait timeout: the client sends nothing and keeps using the "
                 "connection, like on PyTorch's 1.13 server",
                 "[store][compat][v113]") {
  RawSocket s(server->port());
  s.send_bytes(cat({"05", kOne, kMiss}));  // WAIT ["/miss"]; the client times out silently
  CHECK(s.silent_for(200ms));
  s.send_bytes(hex("06"));  // the next request (num_keys) is served right away
  expect_reply(s, kZero);
  s.send_bytes(cat({"03", kCnt, kTwo}));
  expect_reply(s, kTwo);
  // The registration stays: when the key appears, the server sends the late STOP_WAITING.
  RawSocket other(server->port());
  expect_no_reply(other, cat({"00", kMiss, kValue}));
  expect_reply(s, "00");
}

TEST_CASE_METHOD(Fixture, "a 1.13 WATCH_KEY on the callback socket is confirmed",
                 "[store][compat][v113]") {
  RawSocket callback(server->port());
  callback.send_bytes(cat({"07", kKey}));  // WATCH_KEY "/key" (C++ watchKey() only)
  expect_reply(callback, "03");            // KEY_CALLBACK_REGISTERED
  // trun sends no change notifications; the connection stays usable and silent.
  RawSocket main(server->port());
  expect_no_reply(main, cat({"00", kKey, kValue}));
  CHECK(callback.silent_for(100ms));
}

TEST_CASE_METHOD(Fixture, "an unknown 1.13 query closes only that connection",
                 "[store][compat][v113]") {
  RawSocket good(server->port());
  expect_no_reply(good, cat({"00", kKey, kValue}));
  RawSocket bad(server->port());
  bad.send_bytes(hex("0d 39 30 00 00"));  // PING does not exist in 1.13
  CHECK(bad.closed_by_peer());
  good.send_bytes(cat({"02", kKey}));
  expect_reply(good, kValue);
}

TEST_CASE_METHOD(Fixture, "the 1.13 callback socket that never sends anything disturbs nothing",
                 "[store][compat][v113]") {
  // A 1.13 client opens its idle callback connection next to its main one.
  auto callback = std::make_unique<RawSocket>(server->port());
  RawSocket main(server->port());
  REQUIRE(wait_connections(2));
  main.send_bytes(cat({"03", kInit, kOne}));
  expect_reply(main, kOne);
  // Another client (2.x) is served normally, including a wait that blocks and is woken.
  auto waiter = v2_client();
  waiter->send_bytes(cat({"06", kOne, kKey}));
  expect_no_reply(main, cat({"00", kKey, kValue}));
  expect_reply(*waiter, "00");
  CHECK(callback->silent_for(100ms));  // nothing is ever sent to it
  CHECK(server->num_connections() == 3);
  // Closing it frees it; the others stay.
  callback.reset();
  CHECK(wait_connections(2));
  main.send_bytes(hex("06"));
  expect_reply(main, kTwo);
}

}  // namespace
