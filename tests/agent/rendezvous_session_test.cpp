// agent/rendezvous_session.h: rounds, ranks and round ends on the agent's event loop, over real
// stores on 127.0.0.1 (the embedded one of --standalone, and a c10d store this test hosts).
#include <catch2/catch.hpp>
#include <chrono>

#include "agent/rendezvous_session.h"
#include "store/server.h"

using namespace trun::agent;
using namespace std::chrono_literals;
using trun::rendezvous::RoundEvent;

namespace {
LaunchConfig standalone(int nproc) {
  LaunchConfig c;
  c.standalone = true;
  c.nproc_per_node = nproc;
  return c;
}

// Runs the loop until `done` or `timeout` (real time) passes.
bool run_until(EventLoop& loop, const std::function<bool()>& done, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!done() && std::chrono::steady_clock::now() < end) {
    loop.run_once(std::chrono::steady_clock::now() + 50ms);
  }
  return done();
}
}  // namespace

TEST_CASE("a standalone session forms one round with this node's ranks, nothing multi-node",
          "[rendezvous_session]") {
  const LaunchConfig c = standalone(3);
  EventLoop loop;
  int events = 0;
  RendezvousSession s(c, "run-a", loop, steady_clock(), [&](const RoundEvent&) {
    ++events;
    return true;
  });
  s.start();
  CHECK(s.backend() == "standalone");
  CHECK_FALSE(s.dynamic());
  CHECK_FALSE(s.multi_node());
  CHECK(s.info().group_world_size == 1);
  CHECK(s.info().master_addr == "127.0.0.1");
  CHECK(s.info().master_port > 0);
  CHECK(s.ranks().global == std::vector<int>{0, 1, 2});
  CHECK(s.ranks().world_size == 3);
  CHECK_FALSE(s.round_over().has_value());
  s.close_job();                        // single node: nothing to close
  s.exit_barrier(1s);                   // nor to wait for
  s.report_worker_failure("x", 1);      // nor to tell
  CHECK(s.round_failures(1s).empty());  // nor to hear
  s.shutdown();
  s.shutdown();  // idempotent
  CHECK(events == 0);
}

TEST_CASE("a c10d session sees its store's loss on the loop and cannot rejoin past its window",
          "[rendezvous_session]") {
  trun::store::StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = trun::store::StoreServer::start(so);
  LaunchConfig c;
  c.rdzv.backend = trun::rendezvous::BackendKind::kC10d;
  c.rdzv.endpoint = "127.0.0.1:" + std::to_string(server->port());
  c.run_id = "session-test";
  c.nproc_per_node = 2;
  c.rdzv.conf = trun::rendezvous::read_rdzv_conf(
      {{"join_timeout", "2"}, {"keep_alive_interval", "0.2"}, {"is_host", "false"}});
  EventLoop loop;
  std::vector<RoundEvent> seen;
  bool accept = false;
  RendezvousSession s(c, c.run_id, loop, steady_clock(), [&](const RoundEvent& e) {
    seen.push_back(e);
    return accept;
  });
  s.start();
  CHECK(s.backend() == "c10d");
  CHECK(s.dynamic());
  CHECK(s.multi_node());
  CHECK(s.store_endpoint() == c.rdzv.endpoint);
  CHECK(s.ranks().global == std::vector<int>{0, 1});

  SECTION("an event the agent does not take leaves the round running") {
    server->stop();
    REQUIRE(run_until(
        loop, [&] { return !seen.empty(); }, 30s));
    CHECK(seen[0].kind == RoundEvent::Kind::kStoreLost);
    CHECK_FALSE(s.round_over().has_value());
  }
  SECTION("a taken event ends the attempt; the rejoin gives up within join_timeout") {
    accept = true;
    server->stop();
    REQUIRE(run_until(
        loop, [&] { return s.round_over().has_value(); }, 30s));
    CHECK(s.round_over()->kind == RoundEvent::Kind::kStoreLost);
    CHECK(seen.size() == 1);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(s.rejoin("store gone"));
    // The window is join_timeout (2 s); generous slack against a loaded machine.
    CHECK(std::chrono::steady_clock::now() - t0 < 20s);
  }
}
