// Store leases (trun extension) and the counters and interrupts the rendezvous relies on: a lease
// fires when its connection closes or its keep-alives stop, exactly once, into the right key.
#include <catch2/catch.hpp>
#include <thread>

#include "store/server.h"
#include "store/tcp_store.h"

using namespace trun::store;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::unique_ptr<StoreServer> loopback_server() {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  return StoreServer::start(o);
}

TcpStoreOptions lease_client_for(const StoreServer& server) {
  TcpStoreOptions o;
  o.port = server.port();
  o.timeout = 10s;
  o.connect_timeout = 10s;
  return o;
}

LeaseSpec lease(std::chrono::milliseconds ttl) {
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

}  // namespace

TEST_CASE("a lease fires into its first key when the connection closes", "[lease]") {
  auto server = loopback_server();
  TcpStore observer(lease_client_for(*server));
  {
    TcpStore node(lease_client_for(*server));
    node.lease_arm(lease(0ms));
    CHECK(observer.get("node/1") == "me");  // arming also set the descriptor
    CHECK_FALSE(observer.check({"result"}));
  }  // the node's connection closes
  auto start = Clock::now();
  CHECK(observer.get("result", 5s) == "aborted: me left");
  CHECK(Clock::now() - start < 5s);
  CHECK_FALSE(observer.check({"over"}));  // fired once, into the first key only
}

TEST_CASE("a lease appends to its second key when the first exists", "[lease]") {
  auto server = loopback_server();
  TcpStore observer(lease_client_for(*server));
  observer.set("result", "complete");
  // A SET has no answer: a round trip on the same connection makes sure the store holds it
  // before the leases fire from other connections.
  REQUIRE(observer.check({"result"}));
  {
    TcpStore a(lease_client_for(*server));
    TcpStore b(lease_client_for(*server));
    auto la = lease(0ms);
    la.b_value = "left a\n";
    auto lb = lease(0ms);
    lb.set_key = "node/2";
    lb.b_value = "left b\n";
    a.lease_arm(la);
    b.lease_arm(lb);
  }
  observer.wait({"over"}, 5s);
  // Both appends arrive; the order is the order the server saw the connections close.
  auto deadline = Clock::now() + 5s;
  std::string over;
  while (Clock::now() < deadline) {
    over = observer.get("over");
    if (over.size() == 14) break;
    std::this_thread::sleep_for(10ms);
  }
  CHECK((over == "left a\nleft b\n" || over == "left b\nleft a\n"));
  CHECK(observer.get("result") == "complete");
}

TEST_CASE("a lease without keep-alives lapses after its ttl, renewals keep it", "[lease]") {
  auto server = loopback_server();
  TcpStore observer(lease_client_for(*server));
  TcpStore node(lease_client_for(*server));
  node.lease_arm(lease(1500ms));
  // 1.5 s of renewals every 250 ms: the lease holds (a ttl that a sanitizer build's stalls of a
  // few hundred ms do not reach)
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_for(250ms);
    REQUIRE(node.lease_renew());
  }
  CHECK_FALSE(observer.check({"result"}));
  auto start = Clock::now();
  CHECK(observer.get("result", 5s) == "aborted: me left");  // no renewals now: it lapses
  auto waited = Clock::now() - start;
  CHECK(waited >= 1000ms);
  CHECK(waited < 5s);
  CHECK_FALSE(node.lease_renew());    // the node learns it was declared dead
  CHECK(node.get("node/1") == "me");  // the connection itself still works
}

TEST_CASE("a released or replaced lease does not fire", "[lease]") {
  auto server = loopback_server();
  TcpStore observer(lease_client_for(*server));
  {
    TcpStore node(lease_client_for(*server));
    node.lease_arm(lease(0ms));
    CHECK(node.lease_release());
    CHECK_FALSE(node.lease_release());
    CHECK_FALSE(node.lease_renew());
    auto second = lease(0ms);
    second.a_key = "result2";
    node.lease_arm(lease(0ms));
    node.lease_arm(second);  // replaces the first: only result2 may fire
  }
  CHECK(observer.get("result2", 5s) == "aborted: me left");
  CHECK_FALSE(observer.check({"result"}));
}

TEST_CASE("a stopping server does not fire leases", "[lease]") {
  auto server = loopback_server();
  TcpStore node(lease_client_for(*server));
  node.lease_arm(lease(0ms));
  server->stop();
  // Nothing to observe after stop except that stop returned without crashing on the lease; a
  // restarted server starts empty anyway. The node's next call fails cleanly.
  CHECK_THROWS_AS(node.lease_renew(), StoreError);
}

TEST_CASE("the server counts requests", "[lease]") {
  auto server = loopback_server();
  TcpStore c(lease_client_for(*server));
  c.ping();  // the handshake's VALIDATE is not answered: sync with a round trip first
  auto before = server->num_requests();
  c.set("a", "1");
  c.add("n", 1);
  c.get("a");
  CHECK(server->num_requests() - before == 3);
}

TEST_CASE("interrupt unblocks a waiting call on another thread", "[lease]") {
  auto server = loopback_server();
  TcpStore waiter(lease_client_for(*server));
  std::string error;
  auto start = Clock::now();
  std::thread t([&] {
    try {
      waiter.get("never", 30s);
    } catch (const StoreError& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);
  waiter.interrupt();
  t.join();
  CHECK(Clock::now() - start < 10s);
  CHECK_THAT(error, Catch::Contains("interrupted"));
  waiter.set("after", "1");  // the next call reconnects
  CHECK(waiter.get("after") == "1");
}
