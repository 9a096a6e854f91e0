// StoreRelay (store/relay.h) over real sockets: a StoreServer on loopback, a relay in
// front of it, TcpStore clients (trun's dialect) on the relay. Key-value requests pass through
// with the store's answers; waits for the same keys share one wait upstream; leases are kept by
// the relay and reach the store as LEASE_FIRE; the relay's own lease upstream fires when the
// relay goes away; what a relay does not serve closes only that connection; and a c10d
// rendezvous forms and re-forms through a relay. Timeouts are generous bounds so nothing hangs,
// never speed targets.
#include "store/relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "rendezvous/handler.h"
#include "store/server.h"
#include "store/tcp_store.h"
#include "store/wire.h"
#include "tests/rendezvous/test_options.h"
#include "tests/store/raw_socket.h"

using namespace trun::rendezvous;
using namespace trun::store;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using wire::Encoder;
using wire::Op;

namespace {

std::unique_ptr<StoreServer> upstream_server() {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  return StoreServer::start(o);
}

std::unique_ptr<StoreRelay> relay_for(const StoreServer& server) {
  StoreRelayOptions o;
  o.upstream_port = server.port();
  return StoreRelay::start(o);
}

TcpStoreOptions client_on(uint16_t port) {
  TcpStoreOptions o;
  o.port = port;
  o.timeout = 10s;
  o.connect_timeout = 10s;
  o.dialect = StoreDialect::kTrun;
  return o;
}

std::unique_ptr<TcpStore> connect(uint16_t port) {
  return std::make_unique<TcpStore>(client_on(port));
}

LeaseSpec relay_lease(std::chrono::milliseconds ttl) {
  LeaseSpec l;
  l.set_key = "node/1";
  l.set_value = "me";
  l.a_key = "result";
  l.a_value = "aborted: me left";
  l.b_key = "over";
  l.b_value = "left me\n";
  l.ttl = ttl;
  return l;
}

bool relay_eventually(std::function<bool()> pred, std::chrono::milliseconds timeout = 10s) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

using trun::testing::RawSocket;

std::string relay_v2_hello() {
  std::string s;
  Encoder(&s).query(Op::kValidate).u32(wire::kValidationMagic);
  return s;
}

// The same sequence of key-value requests, their results as text, for comparing a store reached
// directly with one reached through a relay.
std::vector<std::string> run_ops(Store& s) {
  std::vector<std::string> r;
  auto timed_out = [&](const std::function<void()>& fn) {
    try {
      fn();
      return std::string("ok");
    } catch (const StoreTimeoutError&) {
      return std::string("timeout");
    }
  };
  s.set("a", "1");
  r.push_back(s.get("a"));
  r.push_back(std::to_string(s.add("n", 5)));
  r.push_back(std::to_string(s.add("n", -2)));
  r.push_back(s.compare_set("a", "1", "2"));
  r.push_back(s.compare_set("a", "x", "3"));
  r.push_back(s.compare_set("fresh", "", "new"));
  s.append("log", "x");
  s.append("log", std::string("\0y", 2));  // binary values pass through untouched
  // A round trip on the relay's upstream connection before the GET: a GET waits on another
  // upstream connection, which may overtake the APPEND (see the read-your-writes case below).
  r.push_back(s.check({"log"}) ? "ready" : "not ready");
  r.push_back(s.get("log"));
  s.multi_set({"m1", "m2"}, {"v1", std::string(200 * 1024, 'z')});  // more than one read chunk
  for (auto& v : s.multi_get({"m1", "m2", "a"})) {
    r.push_back(v.size() > 100 ? std::to_string(v.size()) + " bytes, " +
                                     (v == std::string(200 * 1024, 'z') ? "intact" : "changed")
                               : v);
  }
  r.push_back(s.check({"m1", "zz"}) ? "ready" : "not ready");
  r.push_back(s.check({"m1", "m2"}) ? "ready" : "not ready");
  r.push_back(s.delete_key("m1") ? "deleted" : "absent");
  r.push_back(s.delete_key("m1") ? "deleted" : "absent");
  r.push_back(std::to_string(s.num_keys()));
  r.push_back(s.get("a", 0ms));  // a look, not a wait
  r.push_back(timed_out([&] { s.get("nope", 0ms); }));
  r.push_back(timed_out([&] { s.wait({"a", "n"}, 5s); }));
  r.push_back(timed_out([&] { s.wait({"a", "nope"}, 50ms); }));
  r.push_back(std::to_string(s.add("n", 0)));
  return r;
}

}  // namespace

TEST_CASE("key-value requests through a relay give the store's own answers and are counted",
          "[store][relay]") {
  auto direct_server = upstream_server();
  auto direct_client = connect(direct_server->port());
  direct_client->ping();  // the handshake is not answered: sync with a round trip first
  const uint64_t direct_before = direct_server->num_requests();
  const auto expected = run_ops(*direct_client);
  const uint64_t direct_requests = direct_server->num_requests() - direct_before;

  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto client = connect(relay->port());
  client->ping();  // answered by the relay itself
  const uint64_t server_before = server->num_requests();
  const uint64_t relay_before = relay->num_requests();
  const auto got = run_ops(*client);
  CHECK(got == expected);
  CHECK(got.at(0) == "1");
  CHECK(got.at(1) == "5");
  CHECK(got.at(2) == "3");
  // The relay counts every request its client sent; the store sees each of them once (waits as
  // one upstream wait each: no other client shares them here), plus a fence (a PING) before a
  // wait that follows unanswered writes, so that the wait cannot overtake them.
  CHECK(relay->num_requests() - relay_before == direct_requests);
  CHECK(server->num_requests() - server_before >= direct_requests);
  CHECK(server->num_requests() - server_before <= direct_requests + 4);
  CHECK(relay->upstream_requests() >= direct_requests);

  // PING and the handshake are answered by the relay: the store does not see them.
  const uint64_t server_mid = server->num_requests();
  client->ping();
  CHECK(relay->num_requests() - relay_before == direct_requests + 1);
  auto second = connect(relay->port());
  second->ping();
  CHECK(server->num_requests() == server_mid);
  CHECK(relay->num_connections() == 2);
  // What one client set through the relay, another reads directly from the store.
  CHECK(connect(server->port())->get("a") == "2");
  // An empty MULTI_GET has no answer: the relay answers it (nothing) without the store.
  CHECK(client->multi_get({}).empty());
  CHECK(direct_client->multi_get({}).empty());
  CHECK(client->get("a") == "2");
}

// The relay passes SET and APPEND on its one upstream connection without an answer, and a GET
// (GET_TIMEOUT) on a separate wait connection: the GET can reach the store before writes the
// same client sent before it (a second write waits in the relay for the first one's write to
// complete, while the GET goes out at once).
TEST_CASE("a client reads its own writes through a relay", "[store][relay]") {
  // How many of 300 reads right after the same client's writes miss one of those writes.
  auto stale_reads = [](Store& client, std::string* first_stale) {
    int stale = 0;
    std::string log;
    for (int i = 0; i < 300; ++i) {
      const std::string value = std::to_string(i);
      client.set("k", "old");  // two writes in a row: the second one queues behind the first
      client.set("k", value);
      const std::string got = client.get("k");
      if (got != value && stale++ == 0) {
        *first_stale = "set k=old, set k=" + value + ", then get k gave " + got;
      }
      client.append("log", value);
      client.append("log", ",");
      log += value + ",";
      const std::string got_log = client.get("log");
      if (got_log != log && stale++ == 0) {
        *first_stale = "append log " + value + " and ',', then get log ended in '" +
                       got_log.substr(got_log.size() > 8 ? got_log.size() - 8 : 0) + "'";
      }
    }
    return stale;
  };
  auto server = upstream_server();
  std::string first_stale;
  CHECK(stale_reads(*connect(server->port()), &first_stale) == 0);  // the store itself

  auto relayed_server = upstream_server();
  auto relay = relay_for(*relayed_server);
  const int stale = stale_reads(*connect(relay->port()), &first_stale);
  INFO("first stale read: " << first_stale);
  CHECK(stale == 0);
}

TEST_CASE("clients pipelining through one relay each get their own answers", "[store][relay]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  constexpr int kClients = 8, kOps = 100;
  std::vector<std::future<int>> results;
  for (int c = 0; c < kClients; ++c) {
    results.push_back(std::async(std::launch::async, [&, c] {
      auto s = connect(relay->port());
      int right = 0;
      for (int i = 0; i < kOps; ++i) {
        const std::string key = "k" + std::to_string(c) + "/" + std::to_string(i);
        const std::string value = std::string(static_cast<size_t>(i * 97 % 3000), 'a' + c) + key;
        s->set(key, value);
        s->add("total", 1);
        if (s->get(key) == value && s->multi_get({key})[0] == value) ++right;
      }
      return right;
    }));
  }
  for (auto& r : results) CHECK(r.get() == kOps);
  CHECK(connect(server->port())->get("total") == std::to_string(kClients * kOps));
}

TEST_CASE("clients waiting for one key through a relay share one wait upstream",
          "[store][relay][wait]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto setter = connect(server->port());
  std::vector<std::unique_ptr<TcpStore>> clients;
  for (int i = 0; i < 5; ++i) {
    clients.push_back(connect(relay->port()));
    clients.back()->ping();
  }
  setter->ping();
  const uint64_t server_before = server->num_requests();
  const uint64_t relay_before = relay->num_requests();
  const uint64_t upstream_before = relay->upstream_requests();

  std::vector<std::future<std::string>> gets;
  for (auto& c : clients) {
    gets.push_back(std::async(std::launch::async, [&c] { return c->get("go", 10s); }));
  }
  // All 5 requests reached the relay (each is counted before it is served; the first one's
  // upstream wait is issued before the second is read).
  REQUIRE(relay_eventually([&] { return relay->num_requests() - relay_before == 5; }));
  REQUIRE(relay_eventually([&] { return server->num_requests() - server_before == 1; }));
  CHECK(relay->upstream_requests() - upstream_before == 1);  // one GET_TIMEOUT for all 5
  for (auto& g : gets) CHECK(g.wait_for(0s) == std::future_status::timeout);

  setter->set("go", "value");
  for (auto& g : gets) {
    REQUIRE(g.wait_for(30s) == std::future_status::ready);
    CHECK(g.get() == "value");
  }
  // The store saw the one shared wait and the SET, nothing per waiter.
  CHECK(server->num_requests() - server_before == 2);
  CHECK(relay->upstream_requests() - upstream_before == 1);
  // The clients go on using their connections.
  for (auto& c : clients) CHECK(c->add("after", 1) > 0);
  CHECK(setter->get("after") == "5");
}

TEST_CASE("a relay client whose wait times out leaves others waiting for the same key",
          "[store][relay][wait]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto patient = connect(relay->port());
  auto hasty = connect(relay->port());
  auto setter = connect(relay->port());
  hasty->ping();
  const uint64_t relay_before = relay->num_requests();
  auto late = std::async(std::launch::async, [&] { return patient->get("late", 20s); });
  REQUIRE(relay_eventually([&] { return relay->num_requests() - relay_before == 1; }));
  auto start = Clock::now();
  CHECK_THROWS_AS(hasty->get("late", 300ms), StoreTimeoutError);
  CHECK(Clock::now() - start >= 250ms);  // it did wait (a correctness bound)
  CHECK(late.wait_for(0s) == std::future_status::timeout);
  // The one that timed out is still in step: its next call answers the next request.
  CHECK(hasty->add("n", 7) == 7);
  CHECK_THROWS_AS(hasty->wait({"late"}, 100ms), StoreTimeoutError);
  setter->set("late", "finally");
  REQUIRE(late.wait_for(30s) == std::future_status::ready);
  CHECK(late.get() == "finally");
  CHECK(hasty->get("late") == "finally");
  CHECK(hasty->get("late", 0ms) == "finally");
}

TEST_CASE("clients waiting for the same keys through a relay all wake when the last one is set",
          "[store][relay][wait]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto direct = connect(server->port());
  auto a = connect(relay->port()), b = connect(relay->port()), c = connect(relay->port());
  const uint64_t relay_before = relay->num_requests();
  auto wa = std::async(std::launch::async, [&] { a->wait({"x", "y"}, 20s); });
  auto wb = std::async(std::launch::async, [&] { b->wait({"x", "y"}, 20s); });
  // A different key set is a different wait.
  auto wc = std::async(std::launch::async, [&] { return c->get("x", 20s); });
  REQUIRE(relay_eventually([&] { return relay->num_requests() - relay_before == 3; }));
  direct->set("x", "1");
  REQUIRE(wc.wait_for(30s) == std::future_status::ready);
  CHECK(wc.get() == "1");
  CHECK(wa.wait_for(0s) == std::future_status::timeout);
  direct->set("y", "2");
  REQUIRE(wa.wait_for(30s) == std::future_status::ready);
  REQUIRE(wb.wait_for(30s) == std::future_status::ready);
  CHECK_NOTHROW(wa.get());
  CHECK_NOTHROW(wb.get());
  CHECK(a->multi_get({"x", "y"}) == std::vector<std::string>{"1", "2"});
}

TEST_CASE("a lease armed through a relay sets its key and fires into its first key on close",
          "[store][relay][lease]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto observer = connect(server->port());
  {
    auto node = connect(relay->port());
    node->lease_arm(relay_lease(0ms));
    CHECK(observer->get("node/1", 10s) == "me");  // arming set the descriptor on the store
    CHECK_FALSE(observer->check({"result"}));
  }  // the node's connection to the relay closes
  CHECK(observer->get("result", 10s) == "aborted: me left");
  CHECK_FALSE(observer->check({"over"}));  // fired once, into the first key only
}

TEST_CASE("a lease armed through a relay appends to its second key when the first exists",
          "[store][relay][lease]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto observer = connect(server->port());
  observer->set("result", "complete");
  // A SET has no answer: a round trip on the same connection makes sure the store holds it
  // before the leases fire from other connections.
  REQUIRE(observer->check({"result"}));
  {
    auto a = connect(relay->port());
    auto b = connect(relay->port());
    auto la = relay_lease(0ms);
    la.b_value = "left a\n";
    auto lb = relay_lease(0ms);
    lb.set_key = "node/2";
    lb.b_value = "left b\n";
    a->lease_arm(la);
    b->lease_arm(lb);
  }
  std::string over;
  CHECK(relay_eventually([&] {
    over = observer->get("over", 10s);
    return over.size() == 14;
  }));
  INFO("over: " << over);
  CHECK((over == "left a\nleft b\n" || over == "left b\nleft a\n"));
  CHECK(observer->get("result") == "complete");
  CHECK(observer->get("node/2") == "me");
}

TEST_CASE("a lease through a relay lapses after its ttl without renewals, renewals keep it",
          "[store][relay][lease]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto observer = connect(server->port());
  auto via_relay = connect(relay->port());
  via_relay->ping();
  auto node = connect(relay->port());
  node->lease_arm(relay_lease(1500ms));
  // 1.5 s of renewals every 250 ms: the lease holds (a ttl that a sanitizer build's stalls of a
  // few hundred ms do not reach)
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_for(250ms);
    REQUIRE(node->lease_renew());
  }
  CHECK_FALSE(observer->check({"result"}));
  auto start = Clock::now();
  CHECK(observer->get("result", 10s) == "aborted: me left");  // no renewals now: it lapses
  CHECK(Clock::now() - start >= 1000ms);
  CHECK_FALSE(node->lease_renew());    // the node learns it was declared dead
  CHECK(node->get("node/1") == "me");  // its connection itself still works
  // Closing it now fires nothing more.
  node.reset();
  REQUIRE(relay_eventually([&] { return relay->num_connections() == 1; }));
  CHECK_FALSE(via_relay->check({"over"}));  // a LEASE_FIRE would be ahead of this on the wire
}

TEST_CASE("a lease released through a relay does not fire", "[store][relay][lease]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto observer = connect(server->port());
  auto via_relay = connect(relay->port());
  via_relay->ping();
  {
    auto node = connect(relay->port());
    node->lease_arm(relay_lease(0ms));
    CHECK(node->lease_release());
    CHECK_FALSE(node->lease_release());
    CHECK_FALSE(node->lease_renew());
    auto timed = relay_lease(200ms);
    timed.a_key = "result2";
    node->lease_arm(timed);
    CHECK(node->lease_release());
    std::this_thread::sleep_for(500ms);  // past the released lease's ttl
  }
  // The relay handled the close (it sends any LEASE_FIRE upstream before forgetting the client),
  // and one connection carries everything to the store: an answer through it comes after.
  REQUIRE(relay_eventually([&] { return relay->num_connections() == 1; }));
  CHECK_FALSE(via_relay->check({"result"}));
  CHECK_FALSE(via_relay->check({"result2"}));
  CHECK_FALSE(via_relay->check({"over"}));
  CHECK(observer->get("node/1") == "me");
}

TEST_CASE("a stopped relay's own lease appends to the round's key on the store",
          "[store][relay][lease]") {
  auto server = upstream_server();
  auto observer = connect(server->port());
  observer->ping();
  observer->set("A", "exists");
  auto relay = relay_for(*server);
  auto node = connect(relay->port());
  LeaseSpec l;
  l.set_key = "node/7";
  l.set_value = "n7";
  l.a_key = "A";
  l.a_value = "aborted";
  l.b_key = "B";
  l.b_value = "left n7\n";
  node->lease_arm(l);
  CHECK(observer->get("node/7", 10s) == "n7");
  // The node's own lease is gone: what fires below is the relay's lease upstream.
  CHECK(node->lease_release());
  CHECK(node->check({"node/7"}));  // a round trip on the relay's upstream connection
  CHECK_FALSE(observer->check({"B"}));
  relay->stop();
  CHECK(observer->get("B", 10s) == "left n7\n");
  REQUIRE(relay_eventually([&] { return server->num_connections() == 1; }));  // the observer only
  CHECK(observer->get("B") == "left n7\n");                                   // once
  CHECK(observer->get("A") == "exists");
  relay->stop();  // idempotent
  CHECK_THROWS_AS(node->get("node/7", 1s), StoreError);
}

TEST_CASE("stopping a relay with a client's lease armed notifies the store through both leases",
          "[store][relay][lease]") {
  auto server = upstream_server();
  auto observer = connect(server->port());
  observer->set("A", "exists");
  auto relay = relay_for(*server);
  auto node = connect(relay->port());
  LeaseSpec l;
  l.a_key = "A";
  l.a_value = "aborted";
  l.b_key = "B";
  l.b_value = "left n8\n";
  node->lease_arm(l);
  node->ping();
  relay->stop();
  // The relay closes its clients (each armed lease is sent upstream as LEASE_FIRE when its
  // write gets out before the upstream connection closes) and its upstream connection (its own
  // lease, named after the newest round's keys, fires in the store). Either way the store hears
  // of it in B; A is left alone.
  CHECK(observer->get("B", 10s).rfind("left n8\n", 0) == 0);
  REQUIRE(relay_eventually([&] { return server->num_connections() == 1; }));
  const std::string b = observer->get("B");
  INFO("B = '" << b << "'");
  CHECK((b == "left n8\n" || b == "left n8\nleft n8\n"));
  CHECK(observer->get("A") == "exists");
}

TEST_CASE("a relay closes a connection speaking PyTorch 1.13's dialect, others keep working",
          "[store][relay][errors]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto other = connect(relay->port());
  other->set("k", "v");
  {
    RawSocket raw(relay->port());
    std::string set;
    Encoder(&set).query(Op::kSet, wire::Dialect::kV1).bytes("/old").bytes("x");
    raw.send(set);
    CHECK(raw.closed_by_peer(10s));
  }
  {
    TcpStoreOptions o = client_on(relay->port());
    o.dialect = StoreDialect::kTorch1_13;
    o.reconnect_timeout = 1s;
    TcpStore old(o);  // no handshake in 1.13: connecting succeeds
    CHECK_THROWS_AS(old.get("k", 2s), StoreError);
  }
  CHECK(other->get("k") == "v");
  CHECK_FALSE(other->check({"/old"}));  // nothing of it reached the store
  CHECK(connect(server->port())->get("k") == "v");
}

TEST_CASE("a relay closes a connection that sends a request it does not serve",
          "[store][relay][errors]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  auto other = connect(relay->port());
  other->set("k", "v");
  {
    RawSocket raw(relay->port());
    std::string push = relay_v2_hello();
    Encoder(&push).query(Op::kQueuePush).bytes("q").bytes("item");
    raw.send(push);
    CHECK(raw.closed_by_peer(10s));
  }
  {
    RawSocket raw(relay->port());  // a bad handshake
    std::string hello;
    Encoder(&hello).query(Op::kValidate).u32(wire::kValidationMagic ^ 1);
    raw.send(hello);
    CHECK(raw.closed_by_peer(10s));
  }
  {
    RawSocket raw(relay->port());  // PING is answered by the relay itself
    std::string ping = relay_v2_hello();
    Encoder(&ping).query(Op::kPing).u32(0x12345678);
    raw.send(ping);
    std::string want;
    Encoder(&want).u32(0x12345678);
    CHECK(raw.recv(4, 10s) == want);
  }
  auto client = connect(relay->port());
  client->set("mine", "1");
  CHECK_THROWS_AS(client->queue_len("q"), StoreError);
  CHECK(client->get("mine") == "1");  // the next call reconnects
  CHECK(other->get("k") == "v");
  CHECK(connect(server->port())->queue_len("q") == 0);  // nothing was queued in the store
}

TEST_CASE("stopping the store fails relay clients that wait instead of leaving them hanging",
          "[store][relay][errors]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  std::vector<std::unique_ptr<TcpStore>> clients;
  for (int i = 0; i < 4; ++i) {
    TcpStoreOptions o = client_on(relay->port());
    o.timeout = 30s;
    o.reconnect_timeout = 2s;
    clients.push_back(std::make_unique<TcpStore>(o));
  }
  auto idle = connect(relay->port());
  idle->ping();
  const uint64_t before = relay->num_requests();
  std::vector<std::future<std::string>> waits;
  waits.push_back(std::async(std::launch::async, [&] { return clients[0]->get("never", 30s); }));
  waits.push_back(std::async(std::launch::async, [&] { return clients[1]->get("never", 30s); }));
  waits.push_back(std::async(std::launch::async, [&] {
    clients[2]->wait({"never", "either"}, 30s);
    return std::string();
  }));
  waits.push_back(
      std::async(std::launch::async, [&] { return clients[3]->multi_get({"never"}, 30s).at(0); }));
  REQUIRE(relay_eventually([&] { return relay->num_requests() - before == 4; }));
  auto start = Clock::now();
  server->stop();
  for (auto& w : waits) {
    REQUIRE(w.wait_for(25s) == std::future_status::ready);
    CHECK_THROWS_AS(w.get(), StoreError);
  }
  CHECK(Clock::now() - start < 25s);
  CHECK_THROWS_AS(idle->get("k", 1s), StoreError);
  REQUIRE(relay_eventually([&] { return relay->num_connections() == 0; }));
  relay->stop();
}

TEST_CASE("a relay cannot start without its store", "[store][relay][errors]") {
  uint16_t port = 0;
  {
    auto server = upstream_server();
    port = server->port();
  }
  StoreRelayOptions o;
  o.upstream_port = port;
  CHECK_THROWS_AS(StoreRelay::start(o), StoreError);
}

TEST_CASE("c10d: six nodes rendezvous through a relay and survivors re-form when one leaves",
          "[store][relay][c10d]") {
  auto server = upstream_server();
  auto relay = relay_for(*server);
  const std::string endpoint = "127.0.0.1:" + std::to_string(relay->port());
  const std::string run_id = trun::testing::unique_run_id("relay");
  std::vector<std::unique_ptr<RendezvousHandler>> hs;
  for (int i = 0; i < 6; ++i) {
    auto o = trun::testing::fast_rdzv_options(endpoint, run_id, "n" + std::to_string(i), 1, 6);
    o.is_host = false;
    o.last_call_timeout = 5s;  // the first round completes at max_nodes, the second at once
    hs.push_back(create_rendezvous_handler("c10d", o));
  }
  auto join = [](const std::vector<RendezvousHandler*>& handlers) {
    std::vector<std::future<RendezvousInfo>> futures;
    for (auto* h : handlers) {
      futures.push_back(std::async(std::launch::async, [h] { return h->next_rendezvous(); }));
    }
    std::vector<RendezvousInfo> out;
    for (auto& f : futures) {
      REQUIRE(f.wait_for(90s) == std::future_status::ready);
      out.push_back(f.get());
    }
    return out;
  };
  auto check_round = [](const std::vector<RendezvousInfo>& infos, int world) {
    std::set<int> ranks;
    std::set<std::string> ids;
    for (auto& i : infos) {
      CHECK(i.round == infos[0].round);
      CHECK(i.group_world_size == world);
      REQUIRE(i.participants.size() == static_cast<size_t>(world));
      CHECK(i.participants[i.group_rank].node_id == infos[0].participants[i.group_rank].node_id);
      CHECK(i.store != nullptr);
      ranks.insert(i.group_rank);
    }
    CHECK(ranks.size() == infos.size());
    CHECK(*ranks.begin() == 0);
    CHECK(*ranks.rbegin() == world - 1);
    for (auto& p : infos[0].participants.to_vector()) ids.insert(p.node_id);
    CHECK(ids.size() == static_cast<size_t>(world));
  };
  std::vector<RendezvousHandler*> all;
  for (auto& h : hs) all.push_back(h.get());
  auto first = join(all);
  check_round(first, 6);
  CHECK(server->num_connections() >= 1);
  CHECK(relay->num_connections() >= 6);

  // One node leaves; the other five see the round end and form the next one.
  const std::string leaver = hs[2]->node_id();
  std::vector<std::future<std::optional<RoundEvent>>> events;
  std::vector<RendezvousHandler*> survivors;
  for (size_t i = 0; i < hs.size(); ++i) {
    if (i == 2) continue;
    survivors.push_back(hs[i].get());
  }
  for (auto* h : survivors) {
    events.push_back(std::async(std::launch::async, [h] { return h->wait_round_over(60s); }));
  }
  hs[2]->shutdown();
  for (auto& e : events) {
    REQUIRE(e.wait_for(90s) == std::future_status::ready);
    auto ev = e.get();
    REQUIRE(ev);
    CHECK(ev->kind == RoundEvent::Kind::kNodeLeft);
    CHECK(ev->node_id == leaver);
    CHECK(ev->round == first[0].round);
  }
  auto second = join(survivors);
  check_round(second, 5);
  CHECK(second[0].round == first[0].round + 1);
  for (auto& p : second[0].participants.to_vector()) CHECK(p.node_id != leaver);
  for (auto* h : survivors) h->shutdown();
  hs[2].reset();
}
