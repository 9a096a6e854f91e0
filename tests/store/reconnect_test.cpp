// A TcpStore whose server went away: the call that finds the connection closed fails, and the
// next one (a reconnect) fails after the short reconnect budget, not the whole connect_timeout,
// with a message naming the endpoint. A server that comes back is found again.
#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>

#include "store/server.h"
#include "store/tcp_store.h"

using namespace trun::store;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

StoreServerOptions loopback_on(uint16_t port = 0) {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  return o;
}

// Calls until one fails with StoreError (the first may still find the closed connection's data
// path open) and returns that error; bounded to a few calls.
std::string next_failure(TcpStore& store) {
  for (int i = 0; i < 3; ++i) {
    try {
      store.num_keys();
    } catch (const StoreError& e) {
      return e.what();
    }
  }
  return "";
}

}  // namespace

TEST_CASE("a client whose store stopped fails promptly on reconnect, naming the endpoint",
          "[store][reconnect]") {
  auto server = StoreServer::start(loopback_on());
  const uint16_t port = server->port();
  TcpStoreOptions o;
  o.port = port;
  o.timeout = 60s;
  o.connect_timeout = 60s;  // the first connect's budget; a reconnect must not use it
  SECTION("default reconnect budget") {}
  SECTION("a configured reconnect budget") { o.reconnect_timeout = 1s; }
  TcpStore store(o);
  store.set("k", "v");
  CHECK(store.get("k") == "v");
  server->stop();
  server.reset();

  // The call that finds the connection closed fails at once.
  std::string first = next_failure(store);
  REQUIRE_FALSE(first.empty());
  CHECK(first.find(store.endpoint()) != std::string::npos);

  // The next call reconnects, within the reconnect budget only.
  auto t0 = Clock::now();
  bool timeout_error = false;
  std::string msg;
  try {
    store.get("k", 1s);
  } catch (const StoreTimeoutError& e) {
    timeout_error = true;
    msg = e.what();
  } catch (const StoreError& e) {
    msg = e.what();
  }
  auto took = Clock::now() - t0;
  INFO(msg);
  CHECK_FALSE(timeout_error);  // not "the key is late": the server is gone
  CHECK(msg.find("store 127.0.0.1:" + std::to_string(port)) != std::string::npos);
  CHECK(msg.find("reconnecting failed") != std::string::npos);
  CHECK(took < 20s);  // generous; the budget is 5 s (or 1 s), the connect_timeout 60 s

  // A server back on the same port is found by the next call.
  auto again = StoreServer::start(loopback_on(port));
  store.set("k2", "v2");
  CHECK(store.get("k2") == "v2");
}

TEST_CASE("a client waiting on a store that stops on purpose hears so and never retries it",
          "[store][reconnect][gone]") {
  auto server = StoreServer::start(loopback_on());
  const uint16_t port = server->port();
  TcpStoreOptions o;
  o.port = port;
  o.dialect = StoreDialect::kTrun;
  o.timeout = 60s;
  o.connect_timeout = 60s;
  o.reconnect_timeout = 30s;  // a retried endpoint would take this long to give up
  TcpStore waiter(o);
  std::string error;
  bool gone = false;
  std::thread t([&] {
    try {
      waiter.get("never", 60s);
    } catch (const StoreGoneError& e) {
      gone = true;
      error = e.what();
    } catch (const StoreError& e) {
      error = e.what();
    }
  });
  // The get is parked on the server before the stop (a bounded wait for it to arrive).
  for (int i = 0; i < 400 && server->num_requests() < 1; ++i) std::this_thread::sleep_for(5ms);
  std::this_thread::sleep_for(20ms);
  server->stop();
  t.join();
  CHECK(gone);
  CHECK(error.find("stopping on purpose") != std::string::npos);
  // Later calls fail at once, without trying the port again (a new server there is not asked).
  auto again = StoreServer::start(loopback_on(port));
  const auto began = Clock::now();
  CHECK_THROWS_AS(waiter.set("k", "v"), StoreGoneError);
  CHECK(Clock::now() - began < 1s);
  CHECK(again->num_requests() == 0);
}

TEST_CASE("a client of a store that dies (no goodbye) gets a plain StoreError, not 'gone'",
          "[store][reconnect][gone]") {
  auto server = StoreServer::start(loopback_on());
  TcpStoreOptions o;
  o.port = server->port();
  o.dialect = StoreDialect::kTrun;
  o.reconnect_timeout = 200ms;
  TcpStore store(o);
  store.set("k", "v");
  server->stop();  // not waiting: nobody is told anything
  server.reset();
  bool plain = false;
  for (int i = 0; i < 3 && !plain; ++i) {
    try {
      store.num_keys();
    } catch (const StoreGoneError&) {
      FAIL("a store nobody was waiting on cannot have said goodbye");
    } catch (const StoreError&) {
      plain = true;
    }
  }
  CHECK(plain);
}
