// The server under hostile and heavy conditions: many clients, authentication, limits, malformed
// input, stalled and non-reading clients, late servers; and `trun store` as a process.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include "store/server.h"
#include "store/tcp_store.h"
#include "store/wire.h"
#include "tests/skip.h"
#include "tests/store/raw_socket.h"

using namespace trun::store;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using wire::Encoder;
using wire::Op;

namespace {

StoreServerOptions loopback_with(std::string token = "") {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  o.token = std::move(token);
  return o;
}

TcpStoreOptions client_for(const StoreServer& server, std::string token = "") {
  TcpStoreOptions o;
  o.port = server.port();
  o.timeout = 10s;
  o.connect_timeout = 10s;
  o.token = std::move(token);
  return o;
}

using trun::testing::RawSocket;

std::string v2_hello() {
  std::string s;
  Encoder(&s).query(Op::kValidate).u32(wire::kValidationMagic);
  return s;
}

bool eventually(std::function<bool()> pred, std::chrono::milliseconds timeout = 5s) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

}  // namespace

TEST_CASE("1200 clients connected at once are all served, and one set wakes all waiters",
          "[store][server]") {
  auto server = StoreServer::start(loopback_with());
  constexpr int kClients = 1200;
  std::vector<std::unique_ptr<TcpStore>> clients;
  clients.reserve(kClients);
  for (int i = 0; i < kClients; ++i)
    clients.push_back(std::make_unique<TcpStore>(client_for(*server)));
  CHECK(eventually([&] { return server->num_connections() == kClients; }));
  for (auto& c : clients) c->add("joined", 1);
  CHECK(clients[0]->get("joined") == std::to_string(kClients));

  // 1200 more connections block in a wait on one key at the same time; one set wakes them all.
  std::vector<std::unique_ptr<RawSocket>> waiters;
  std::string wait_msg = v2_hello();
  Encoder(&wait_msg).query(Op::kWait).u64(1).bytes("go");
  for (int i = 0; i < kClients; ++i) {
    waiters.push_back(std::make_unique<RawSocket>(server->port()));
    waiters.back()->send(wait_msg);
  }
  CHECK(eventually([&] { return server->num_connections() == 2 * kClients; }));
  std::this_thread::sleep_for(100ms);
  int woken_early = 0;
  for (auto& w : waiters) {
    pollfd p{w->fd(), POLLIN, 0};
    woken_early += ::poll(&p, 1, 0);
  }
  CHECK(woken_early == 0);
  clients[0]->set("go", "1");
  int woken = 0;
  for (auto& w : waiters) {
    pollfd p{w->fd(), POLLIN, 0};
    uint8_t reply = 0xff;
    if (::poll(&p, 1, 10000) == 1 && ::recv(w->fd(), &reply, 1, 0) == 1 &&
        reply == wire::kWaitStop) {
      ++woken;
    }
  }
  CHECK(woken == kClients);
  waiters.clear();
  clients.clear();
  CHECK(eventually([&] { return server->num_connections() == 0; }));
}

TEST_CASE("with a token, the right token is served and others are refused", "[store][auth]") {
  auto server = StoreServer::start(loopback_with("s3cret"));
  TcpStore good(client_for(*server, "s3cret"));
  good.set("k", "v");
  CHECK(good.get("k") == "v");

  SECTION("a wrong token fails at connect, naming authentication") {
    try {
      TcpStore bad(client_for(*server, "guess"));
      FAIL("connected with a wrong token");
    } catch (const StoreError& e) {
      CHECK_THAT(e.what(), Catch::Contains("authentication failed"));
      CHECK_THAT(e.what(), Catch::Contains(std::to_string(server->port())));
    }
  }
  SECTION("no token: the first request closes the connection and changes nothing") {
    TcpStore anonymous(client_for(*server));
    try {
      anonymous.add("k2", 1);
      FAIL("an unauthenticated add was served");
    } catch (const StoreError& e) {
      CHECK_THAT(e.what(), Catch::Contains("TRUN_STORE_TOKEN"));
    }
    CHECK_FALSE(good.check({"k2"}));
  }
  SECTION("a PyTorch-style client (1.13 dialect, no handshake) is disconnected") {
    RawSocket raw(server->port());
    std::string set;
    Encoder(&set).query(Op::kSet, wire::Dialect::kV1).bytes("/intruder").bytes("x");
    raw.send(set);
    CHECK(raw.closed_by_peer(5s));
    CHECK_FALSE(good.check({"/intruder"}));
  }
  SECTION("a proof without a challenge is refused") {
    RawSocket raw(server->port());
    std::string msg = v2_hello();
    Encoder(&msg).query(Op::kAuthProof).bytes(std::string(32, 'a'));
    raw.send(msg);
    CHECK(raw.closed_by_peer(5s));
  }
  CHECK(good.get("k") == "v");
}

TEST_CASE("with a token, a client that does not authenticate in time is closed, one that did waits",
          "[store][auth]") {
  // The server's warnings, captured (and the default logger put back however the test ends).
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  struct Restore {
    std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
    ~Restore() { spdlog::set_default_logger(previous); }
  } restore;
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));

  StoreServerOptions options = loopback_with("s3cret");
  options.auth_timeout = 500ms;
  auto server = StoreServer::start(options);
  TcpStore good(client_for(*server, "s3cret"));  // authenticates as it connects
  const auto start = Clock::now();
  RawSocket silent(server->port());  // connects and sends nothing
  RawSocket partial(server->port());
  partial.send(v2_hello());  // VALIDATE, and never AUTH_HELLO
  std::atomic<bool> woke{false};
  std::thread waiter([&] {
    try {
      TcpStore w(client_for(*server, "s3cret"));
      w.wait({"late"}, 20s);  // parked far past the deadline
      woke = true;
    } catch (const std::exception& e) {
      FAIL_CHECK(e.what());
    }
  });
  CHECK(eventually([&] { return server->num_connections() == 4; }));

  CHECK(silent.closed_by_peer(10s));
  CHECK(partial.closed_by_peer(10s));
  CHECK(Clock::now() - start >= 450ms);  // not before the deadline
  CHECK(eventually([&] { return server->num_connections() == 2; }));

  // Three deadlines later the authenticated clients are still served, the waiter still waits.
  std::this_thread::sleep_until(start + 1500ms);
  CHECK_FALSE(woke.load());
  CHECK(server->num_connections() == 2);
  good.set("late", "now");
  waiter.join();
  CHECK(woke.load());
  CHECK(good.get("late") == "now");

  size_t lines = 0;
  for (const auto& line : sink->last_formatted()) {
    if (line.find("not authenticated within 500 ms") != std::string::npos) ++lines;
  }
  CHECK(lines == 2);  // one per connection closed
}

TEST_CASE("a client announcing a 1 TiB value is cut off without the server allocating it",
          "[store][limits]") {
  auto server = StoreServer::start(loopback_with());
  TcpStore ok(client_for(*server));
  RawSocket raw(server->port());
  std::string msg = v2_hello();
  Encoder(&msg).query(Op::kSet).bytes("huge").u64(1ull << 40);
  raw.send(msg);
  CHECK(raw.closed_by_peer(5s));
  ok.set("still", "serving");
  CHECK(ok.get("still") == "serving");
  CHECK_FALSE(ok.check({"huge"}));
}

TEST_CASE("key and value limits are configurable and enforced for the trun client too",
          "[store][limits]") {
  auto opts = loopback_with();
  opts.limits.max_value_bytes = 1000;
  opts.limits.max_key_bytes = 16;
  auto server = StoreServer::start(opts);
  TcpStore c(client_for(*server));
  c.set("short", std::string(1000, 'v'));
  CHECK(c.get("short").size() == 1000);
  c.set("over", std::string(1001, 'v'));  // no reply: the next call sees the closed connection
  CHECK_THROWS_AS(c.num_keys(), StoreError);
  // The client reconnects on the next call; the oversized value was never stored.
  CHECK_FALSE(c.check({"over"}));
  c.set(std::string(17, 'k'), "v");
  CHECK_THROWS_AS(c.num_keys(), StoreError);
  c.append("short", "x");  // would grow past the limit
  CHECK_THROWS_AS(c.num_keys(), StoreError);
  CHECK(c.get("short").size() == 1000);
}

TEST_CASE("malformed input closes only that connection", "[store][malformed]") {
  auto server = StoreServer::start(loopback_with());
  TcpStore ok(client_for(*server));
  ok.set("a", "1");

  SECTION("an unknown query byte after the 2.x handshake") {
    RawSocket raw(server->port());
    raw.send(v2_hello() + "\x7f garbage");
    CHECK(raw.closed_by_peer(5s));
  }
  SECTION("a wrong validation magic") {
    RawSocket raw(server->port());
    std::string msg;
    Encoder(&msg).query(Op::kValidate).u32(wire::kValidationMagic);
    msg += msg;  // a second VALIDATE is fine...
    raw.send(msg);
    std::string bad;
    Encoder(&bad).query(Op::kValidate).u32(0xdeadbeef);  // ...a wrong magic is not
    raw.send(bad);
    CHECK(raw.closed_by_peer(5s));
  }
  SECTION("ADD on a value that is not a number") {
    RawSocket raw(server->port());
    std::string msg = v2_hello();
    Encoder(&msg).query(Op::kAdd).bytes("a_text").i64(1);
    ok.set("a_text", "hello");
    // SET has no reply: a round trip makes sure it is stored before the raw ADD can arrive.
    REQUIRE(ok.get("a_text") == "hello");
    raw.send(msg);
    CHECK(raw.closed_by_peer(5s));
    CHECK(ok.get("a_text") == "hello");
  }
  SECTION("a key count over the limit") {
    RawSocket raw(server->port());
    std::string msg = v2_hello();
    Encoder(&msg).query(Op::kCheck).u64(1ull << 50);
    raw.send(msg);
    CHECK(raw.closed_by_peer(5s));
  }
  CHECK(ok.get("a") == "1");
  CHECK(ok.add("n", 2) == 2);
}

TEST_CASE("a client stalled mid-message delays nobody, and finishes when it resumes",
          "[store][slow]") {
  auto server = StoreServer::start(loopback_with());
  TcpStore other(client_for(*server));
  RawSocket stalled(server->port());
  std::string msg = v2_hello();
  Encoder(&msg).query(Op::kSet).bytes("slow_key").bytes(std::string(100000, 's'));
  stalled.send(msg.substr(0, 5000));  // half a message, then silence

  auto start = Clock::now();
  for (int i = 0; i < 100; ++i) other.add("fast", 1);
  CHECK(other.get("fast") == "100");
  CHECK(Clock::now() - start < 5s);  // generous: only proves no blocking on the stalled client
  CHECK_FALSE(other.check({"slow_key"}));

  stalled.send(msg.substr(5000));
  other.wait({"slow_key"}, 10s);
  CHECK(other.get("slow_key").size() == 100000);
}

TEST_CASE("a client that never reads its responses does not block others", "[store][slow]") {
  auto opts = loopback_with();
  opts.max_pending_output = 1 << 20;
  auto server = StoreServer::start(opts);
  TcpStore other(client_for(*server));
  other.set("big", std::string(1 << 20, 'b'));
  RawSocket greedy(server->port());
  std::string get;
  Encoder(&get).query(Op::kGet).bytes("big");
  std::string burst = v2_hello();
  for (int i = 0; i < 64; ++i) burst += get;  // 64 MiB of responses it will never read
  std::thread sender([&] { ::send(greedy.fd(), burst.data(), burst.size(), MSG_NOSIGNAL); });
  std::this_thread::sleep_for(200ms);
  auto start = Clock::now();
  for (int i = 0; i < 50; ++i) other.add("served", 1);
  CHECK(Clock::now() - start < 5s);
  CHECK(other.get("served") == "50");
  greedy.close();  // unblocks the sender thread's send with an error
  sender.join();
  CHECK(eventually([&] { return server->num_connections() == 1; }));
}

TEST_CASE("a client that vanishes while waiting is cleaned up", "[store][server]") {
  auto server = StoreServer::start(loopback_with());
  TcpStore observer(client_for(*server));
  {
    RawSocket raw(server->port());
    std::string msg = v2_hello();
    Encoder(&msg).query(Op::kWait).u64(1).bytes("never");
    raw.send(msg);
    CHECK(eventually([&] { return server->num_connections() == 2; }));
  }
  CHECK(eventually([&] { return server->num_connections() == 1; }));
  observer.set("never", "now");  // must not touch the departed connection
  CHECK(observer.get("never") == "now");
}

TEST_CASE("the client retries until a late server comes up", "[store][client]") {
  // Find a free port, release it, and start the server there after the client began dialing.
  uint16_t port;
  {
    auto probe = StoreServer::start(loopback_with());
    port = probe->port();
  }
  std::unique_ptr<StoreServer> server;
  const auto start = Clock::now();  // before the thread: its 300 ms count from here at the latest
  std::thread late([&] {
    std::this_thread::sleep_for(300ms);
    auto o = loopback_with();
    o.port = port;
    server = StoreServer::start(o);
  });
  TcpStoreOptions o;
  o.port = port;
  o.connect_timeout = 20s;
  TcpStore client(o);
  CHECK(Clock::now() - start >= 250ms);
  late.join();
  client.set("k", "v");
  CHECK(client.get("k") == "v");
}

TEST_CASE("connecting to nothing fails at the deadline, naming the endpoint", "[store][client]") {
  uint16_t port;
  {
    auto probe = StoreServer::start(loopback_with());
    port = probe->port();
  }
  TcpStoreOptions o;
  o.port = port;
  o.connect_timeout = 300ms;
  try {
    TcpStore client(o);
    FAIL("connected to a closed port");
  } catch (const StoreTimeoutError& e) {
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + std::to_string(port)));
    CHECK_THAT(e.what(), Catch::Contains("connect"));
  }
}

TEST_CASE("the server listens on IPv6 loopback too", "[store][server]") {
  StoreServerOptions o;
  o.host = "::1";
  std::unique_ptr<StoreServer> server;
  try {
    server = StoreServer::start(o);
  } catch (const StoreError& e) {
    TRUN_SKIP("IPv6 loopback unavailable here: " << e.what(), kEnvironment);
  }
  TcpStoreOptions c;
  c.host = "::1";
  c.port = server->port();
  TcpStore client(c);
  client.set("v6", "yes");
  CHECK(client.get("v6") == "yes");
  CHECK_THAT(client.endpoint(), Catch::Contains("[::1]"));
}

TEST_CASE("binding a port in use fails with a clear error", "[store][server]") {
  auto first = StoreServer::start(loopback_with());
  auto o = loopback_with();
  o.port = first->port();
  try {
    StoreServer::start(o);
    FAIL("two servers on one port");
  } catch (const StoreError& e) {
    CHECK_THAT(e.what(), Catch::Contains(std::to_string(first->port())));
  }
}

TEST_CASE("trun store prints its port, serves, and stops on SIGTERM", "[store][cli]") {
  int out[2];
  REQUIRE(::pipe(out) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::close(out[0]);
    ::execl(TRUN_BINARY_DIR "/launcher/trun", "trun", "store", "--host", "127.0.0.1", "--port", "0",
            nullptr);
    _exit(127);
  }
  ::close(out[1]);
  std::string line;
  char c;
  while (::read(out[0], &c, 1) == 1 && c != '\n') line += c;
  ::close(out[0]);
  INFO(line);
  auto colon = line.rfind(':');
  REQUIRE(colon != std::string::npos);
  TcpStoreOptions o;
  o.port = static_cast<uint16_t>(std::stoi(line.substr(colon + 1)));
  {
    TcpStore client(o);
    client.set("cli", "works");
    CHECK(client.get("cli") == "works");
  }
  ::kill(pid, SIGTERM);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("trun store rejects a bad port with exit code 2", "[store][cli]") {
  std::string cmd = std::string(TRUN_BINARY_DIR) + "/launcher/trun store --port 70000 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string output;
  char buf[256];
  while (std::fgets(buf, sizeof(buf), p)) output += buf;
  int status = ::pclose(p);
  CHECK(WEXITSTATUS(status) == 2);
  CHECK_THAT(output, Catch::Contains("port"));
}

TEST_CASE("LEASE_FIRE performs a lease's notification at once and wakes its waiters",
          "[store][server][lease]") {
  auto server = StoreServer::start(loopback_with());
  TcpStore observer(client_for(*server));
  TcpStore waiter(client_for(*server));
  auto fire = [](std::string set_key, std::string a_value, std::string b_value) {
    std::string msg;
    Encoder(&msg)
        .query(Op::kLeaseFire)
        .bytes(set_key)
        .bytes("set by the fire")
        .bytes("A")
        .bytes(a_value)
        .bytes("B")
        .bytes(b_value)
        .i64(0);
    return msg;
  };
  auto read_u8 = [](RawSocket& raw) {
    pollfd p{raw.fd(), POLLIN, 0};
    REQUIRE(::poll(&p, 1, 10000) == 1);
    uint8_t answer = 0xff;
    REQUIRE(::recv(raw.fd(), &answer, 1, 0) == 1);
    return answer;
  };
  RawSocket raw(server->port());
  raw.send(v2_hello());

  // a_key missing: it is set, and a waiter on it wakes.
  auto parked = [&](std::function<void()> fn) {
    const uint64_t before = server->num_requests();
    std::thread t([fn] {
      try {
        fn();
      } catch (const std::exception& e) {
        FAIL_CHECK(e.what());
      }
    });
    CHECK(eventually([&] { return server->num_requests() > before; }));  // the wait arrived
    return t;
  };
  waiter.ping();
  std::string got_a;
  std::thread wait_a = parked([&] { got_a = waiter.get("A", 20s); });
  raw.send(fire("", "first", "b1\n"));
  CHECK(read_u8(raw) == 1);
  wait_a.join();
  CHECK(got_a == "first");
  CHECK_FALSE(observer.check({"B"}));

  // a_key present: b_value is appended to b_key, and a waiter on b_key wakes; set_key is set.
  std::string got_b;
  std::thread wait_b = parked([&] {
    waiter.wait({"B"}, 20s);
    got_b = waiter.get("B");
  });
  raw.send(fire("S", "second", "b2\n"));
  CHECK(read_u8(raw) == 1);
  wait_b.join();
  CHECK(got_b == "b2\n");
  CHECK(observer.get("A") == "first");
  CHECK(observer.get("S") == "set by the fire");
  raw.send(fire("", "third", "b3\n"));
  CHECK(read_u8(raw) == 1);
  CHECK(observer.get("B") == "b2\nb3\n");

  // It armed nothing on its own connection: closing that fires nothing more.
  const size_t before = server->num_connections();
  raw.close();
  CHECK(eventually([&] { return server->num_connections() == before - 1; }));
  CHECK(observer.get("B") == "b2\nb3\n");
  CHECK(observer.get("A") == "first");
}

TEST_CASE("a barrier arrival wakes plain waits on its key, and only the n-th releases the barrier",
          "[store][server][barrier]") {
  auto server = StoreServer::start(loopback_with());
  TcpStore observer(client_for(*server));
  observer.ping();
  auto read_u8 = [](RawSocket& raw, std::chrono::milliseconds timeout) {
    std::string got = raw.recv(1, timeout);
    return got.size() == 1 ? static_cast<int>(static_cast<uint8_t>(got[0])) : -1;
  };
  auto sent_and_counted = [&](RawSocket& raw, const std::string& msg) {
    const uint64_t before = server->num_requests();
    raw.send(msg);
    REQUIRE(eventually([&] { return server->num_requests() > before; }));
  };
  auto barrier = [](int64_t n) {
    std::string msg = v2_hello();
    Encoder(&msg).query(Op::kBarrier).bytes("b").i64(n);
    return msg;
  };
  // A plain WAIT (PyTorch 2.x's wire) and trun's client, both waiting for the barrier's key.
  RawSocket plain(server->port());
  std::string wait = v2_hello();
  Encoder(&wait).query(Op::kWait).u64(1).bytes("b");
  sent_and_counted(plain, wait);
  std::atomic<bool> client_woke{false};
  const uint64_t before_client = server->num_requests();
  std::thread client([&] {
    try {
      TcpStore c(client_for(*server));
      c.wait({"b"}, 20s);
      client_woke = true;
    } catch (const std::exception& e) {
      FAIL_CHECK(e.what());
    }
  });
  REQUIRE(eventually([&] { return server->num_requests() > before_client; }));

  // The first of two arrivals creates the key: both waits end, the arrival itself waits on.
  RawSocket first(server->port());
  sent_and_counted(first, barrier(2));
  CHECK(read_u8(plain, 5s) == wire::kWaitStop);
  CHECK(eventually([&] { return client_woke.load(); }));
  CHECK(first.silent_for(300ms));
  CHECK(observer.get("b") == "1");

  // Another write of the key that leaves the count below n does not release it either.
  CHECK(observer.add("b", 0) == 1);
  CHECK(first.silent_for(300ms));

  // The second arrival releases both.
  RawSocket second(server->port());
  second.send(barrier(2));
  CHECK(read_u8(second, 5s) == wire::kWaitStop);
  CHECK(read_u8(first, 5s) == wire::kWaitStop);
  CHECK(observer.get("b") == "2");
  client.join();
}
