// trun's TcpStore client in each dialect: against PyTorch 1.13's own TCPStore server (a Python
// process), explicitly (torch1.13) and through the probe (auto); and against trun's server, where
// auto must pick trun's dialect, and where the plain PyTorch 2.x dialect (WAIT + CANCEL_WAIT, no
// extensions) can be exercised too, since trun's server speaks it.
//
// Not labelled no_sanitize: PyTorch runs in a separate, uninstrumented process; the client under
// test runs instrumented in this one.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "store/server.h"
#include "store/tcp_store.h"
#include "tests/skip.h"
#include "tests/store/compat/child_process.h"
#include "tests/store/compat/torch_server.h"

namespace {

using namespace std::chrono_literals;
using namespace trun::store;
using trun::test::ChildProcess;
using Clock = std::chrono::steady_clock;

using trun::test::torch_missing;
using trun::test::TorchServer;

std::unique_ptr<TcpStore> client(uint16_t port, StoreDialect dialect) {
  TcpStoreOptions o;
  o.port = port;
  o.timeout = 10s;
  o.connect_timeout = 30s;
  o.dialect = dialect;
  return std::make_unique<TcpStore>(o);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// The Store operations PyTorch 1.13's server supports (or that are emulated from them), through
// `a`, with `b` as a second client of the same server. Keys are under `p` so that runs on the
// same server do not meet.
void run_supported_operations(TcpStore& a, TcpStore& b, const std::string& p) {
  // set / get, with empty and binary values.
  a.set(p + "k", "v1");
  CHECK(b.get(p + "k") == "v1");
  a.set(p + "empty", "");
  CHECK(b.get(p + "empty").empty());
  const std::string binary("\0\xff\x01zz\0", 6);
  a.set(p + "bin", binary);
  CHECK(b.get(p + "bin") == binary);

  // get blocks until another client sets the key.
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    b.set(p + "late", "here");
  });
  auto t0 = Clock::now();
  CHECK(a.get(p + "late", 10s) == "here");
  CHECK(Clock::now() - t0 >= 250ms);
  setter.join();

  // A get that times out is a StoreTimeoutError; the connection it leaves out of step is
  // replaced, so a later STOP_WAITING for that key cannot be misread as another reply.
  CHECK_THROWS_AS(a.get(p + "missing", 300ms), StoreTimeoutError);
  b.set(p + "missing", "now");
  CHECK(a.add(p + "cnt", 5) == 5);
  CHECK(a.get(p + "missing") == "now");
  CHECK(b.add(p + "cnt", -2) == 3);
  CHECK(a.get(p + "cnt") == "3");

  // compare_set: c10d's four cases.
  CHECK(a.compare_set(p + "cas", "", "x") == "x");
  CHECK(a.compare_set(p + "cas", "x", "y") == "y");
  CHECK(a.compare_set(p + "cas", "nope", "z") == "y");
  CHECK(a.compare_set(p + "cas_missing", "e", "d") == "e");
  CHECK_FALSE(a.check({p + "cas_missing"}));

  // check and wait.
  CHECK(a.check({p + "k", p + "cnt"}));
  CHECK_FALSE(a.check({p + "k", p + "nothere"}));
  a.wait({p + "k", p + "cnt"}, 5s);
  CHECK_THROWS_AS(a.wait({p + "k", p + "nothere"}, 300ms), StoreTimeoutError);
  CHECK(a.get(p + "k", 0ms) == "v1");  // a zero timeout still finds an existing key
  CHECK_THROWS_AS(a.get(p + "nothere", 0ms), StoreTimeoutError);

  // num_keys counts the whole store; delete_key reports whether the key existed.
  int64_t n = a.num_keys();
  CHECK(n >= 7);
  CHECK(a.delete_key(p + "k"));
  CHECK_FALSE(a.delete_key(p + "k"));
  CHECK(b.num_keys() == n - 1);

  // multi_set / multi_get keep the order of the keys.
  a.multi_set({p + "m1", p + "m2", p + "m3"}, {"one", "", "three"});
  CHECK(b.multi_get({p + "m3", p + "m1", p + "m2"}) ==
        std::vector<std::string>{"three", "one", ""});
  CHECK_THROWS_AS(b.multi_get({p + "m1", p + "m_missing"}, 300ms), StoreTimeoutError);
  CHECK(b.multi_get({p + "m1"}) == std::vector<std::string>{"one"});

  CHECK(a.ping() >= 0ms);
}

}  // namespace

TEST_CASE("TcpStore runs the Store operations against PyTorch 1.13's own server",
          "[store][compat][torch]") {
  if (auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TorchServer server;
  for (auto dialect : {StoreDialect::kTorch1_13, StoreDialect::kAuto}) {
    INFO("dialect " << to_string(dialect));
    auto a = client(server.port, dialect);
    auto b = client(server.port, dialect);
    CHECK(a->dialect() == StoreDialect::kTorch1_13);
    CHECK(b->dialect() == StoreDialect::kTorch1_13);
    run_supported_operations(*a, *b, std::string("/") + to_string(dialect) + "/");

    // What 1.13 lacks fails with a message naming the server; the connection stays usable.
    try {
      a->append("/x", "y");
      FAIL("append succeeded");
    } catch (const StoreError& e) {
      CHECK(contains(e.what(), "PyTorch 1.13"));
      CHECK(contains(e.what(), a->endpoint()));
    }
    CHECK_THROWS_WITH(a->lease_arm(LeaseSpec{}), Catch::Contains("PyTorch 1.13"));
    CHECK(a->num_keys() > 0);
  }
}

TEST_CASE("the auto probe leaves PyTorch 1.13's server serving its other clients",
          "[store][compat][torch]") {
  if (auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TorchServer server;
  auto plain = client(server.port, StoreDialect::kTorch1_13);
  plain->set("/before", "1");
  // Several probing clients, kept connected: PyTorch's server serves every connection from one
  // thread, so a probe that left it reading a partial request would stall `plain` below.
  std::vector<std::unique_ptr<TcpStore>> probed;
  for (int i = 0; i < 3; ++i) probed.push_back(client(server.port, StoreDialect::kAuto));
  TcpStoreOptions o;
  o.port = server.port;
  o.timeout = 5s;
  o.dialect = StoreDialect::kTorch1_13;
  TcpStore other(o);
  CHECK(other.get("/before") == "1");
  other.set("/after", "2");
  for (auto& c : probed) CHECK(c->get("/after") == "2");
}

TEST_CASE("auto against trun's server speaks trun's dialect on the probe's connection",
          "[store][compat]") {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = StoreServer::start(so);
  auto a = client(server->port(), StoreDialect::kAuto);
  CHECK(a->dialect() == StoreDialect::kTrun);
  // The probe's connection became the client's connection.
  for (int i = 0; i < 500 && server->num_connections() != 1; ++i) std::this_thread::sleep_for(10ms);
  CHECK(server->num_connections() == 1);
  // trun's extensions work: append, leases, server-side get timeouts.
  a->append("ap", "x");
  a->append("ap", "y");
  CHECK(a->get("ap") == "xy");
  a->lease_arm(LeaseSpec{});
  CHECK(a->lease_release());
  CHECK_THROWS_AS(a->get("nothere", 200ms), StoreTimeoutError);
  CHECK(a->get("ap") == "xy");
  CHECK(server->num_connections() == 1);  // a trun-side timeout keeps the connection
}

TEST_CASE("the plain PyTorch 2.x dialect works against trun's server", "[store][compat]") {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = StoreServer::start(so);
  auto a = client(server->port(), StoreDialect::kTorch2);
  auto b = client(server->port(), StoreDialect::kTorch2);
  run_supported_operations(*a, *b, "t2/");
  a->append("t2/ap", "x");
  a->append("t2/ap", "y");
  CHECK(b->get("t2/ap") == "xy");
  // A 2.x wait that times out is cancelled (CANCEL_WAIT), so the connection is kept.
  for (int i = 0; i < 500 && server->num_connections() != 2; ++i) std::this_thread::sleep_for(10ms);
  CHECK(server->num_connections() == 2);
  CHECK_THROWS_AS(a->wait({"t2/never"}, 200ms), StoreTimeoutError);
  CHECK(a->num_keys() > 0);
  CHECK(server->num_connections() == 2);
  CHECK_THROWS_WITH(a->lease_arm(LeaseSpec{}), Catch::Contains("PyTorch 2.x"));
}

TEST_CASE("a store token needs trun's dialect", "[store][compat]") {
  TcpStoreOptions o;
  o.token = "secret";
  o.dialect = StoreDialect::kTorch1_13;
  CHECK_THROWS_AS(TcpStore(o), std::invalid_argument);
  CHECK(parse_store_dialect("torch1.13") == StoreDialect::kTorch1_13);
  CHECK(parse_store_dialect("auto") == StoreDialect::kAuto);
  CHECK_FALSE(parse_store_dialect("torch1.12").has_value());
}
