// The static backend: fixed ranks and node count, node 0 hosts the store, each round a barrier of
// all nodes, and the same push notifications as c10d.
#include <catch2/catch.hpp>
#include <future>

#include "rendezvous/handler.h"
#include "rendezvous/round_rendezvous.h"
#include "rendezvous/static_rendezvous.h"

using namespace trun::rendezvous;
using namespace trun::store;
using namespace std::chrono_literals;
using Kind = RoundEvent::Kind;

namespace {

RendezvousOptions static_options(const std::string& run, uint16_t port, int rank, int world) {
  RendezvousOptions o;
  o.run_id = run;
  o.min_nodes = o.max_nodes = world;
  o.node_rank = rank;
  o.node_id = "node" + std::to_string(rank);
  o.local_addr = "127.0.0.1";
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.keep_alive_interval = 100ms;
  o.join_timeout = 30s;
  o.read_timeout = 10s;
  return o;
}

}  // namespace

TEST_CASE("static: ranks are the given ones and every node restarts together", "[static]") {
  uint16_t port = pick_free_port();
  REQUIRE(port != 0);
  auto n0 = create_rendezvous_handler("static", static_options("s1", port, 0, 3));
  auto n1 = create_rendezvous_handler("static", static_options("s1", port, 1, 3));
  auto n2 = create_rendezvous_handler("static", static_options("s1", port, 2, 3));
  auto f2 = std::async(std::launch::async, [&] { return n2->next_rendezvous(); });
  auto f1 = std::async(std::launch::async, [&] { return n1->next_rendezvous(); });
  auto i0 = n0->next_rendezvous();
  auto i1 = f1.get(), i2 = f2.get();
  CHECK(i0.group_rank == 0);
  CHECK(i1.group_rank == 1);
  CHECK(i2.group_rank == 2);
  for (auto* i : {&i0, &i1, &i2}) {
    CHECK(i->group_world_size == 3);
    CHECK(i->round == 0);
    CHECK(i->master_addr == "127.0.0.1");
    CHECK(i->master_port == port);
    CHECK(i->use_agent_store);
    REQUIRE(i->participants.size() == 3);
    CHECK(i->participants[2].node_id == "node2");
  }
  // The store in the info is shared: what one node writes another reads.
  i0.store->set("k", "v");
  CHECK(i2.store->get("k") == "v");

  n1->report_worker_failure("exit 1");
  auto e0 = n0->wait_round_over(30s);
  REQUIRE(e0);
  CHECK(e0->kind == Kind::kWorkerFailed);
  CHECK(e0->node_id == "node1");
  auto g1 = std::async(std::launch::async, [&] { return n1->next_rendezvous(); });
  auto g2 = std::async(std::launch::async, [&] { return n2->next_rendezvous(); });
  auto j0 = n0->next_rendezvous();
  CHECK(j0.round == 1);
  CHECK(g1.get().round == 1);
  CHECK(g2.get().group_rank == 2);
  CHECK(n0->num_nodes_waiting() == 0);

  n2->set_closed();
  CHECK(n0->is_closed());
  auto closed = n1->wait_round_over(30s);
  REQUIRE(closed);
  CHECK(closed->kind == Kind::kClosed);
  CHECK_THROWS_AS(n1->next_rendezvous(), RendezvousClosedError);
  n1.reset();
  n2.reset();
  n0.reset();  // node 0 last: it hosts the store
}

TEST_CASE("static: a single node may use a free port", "[static]") {
  auto o = static_options("s2", 0, 0, 1);
  auto h = create_rendezvous_handler("static", o);
  auto info = h->next_rendezvous();
  CHECK(info.group_rank == 0);
  CHECK(info.group_world_size == 1);
  CHECK(info.master_port != 0);
  // As an agent with --standalone creates it: 127.0.0.1, a free port, through the registry.
  auto standalone = create_rendezvous_handler(
      BackendKind::kStatic, handler_options(standalone_config(RendezvousConfig{}), "s3", 1, 1));
  const auto alone = standalone->next_rendezvous();
  CHECK(alone.group_world_size == 1);
  CHECK(alone.master_addr == "127.0.0.1");
  CHECK(alone.master_port != 0);
}

TEST_CASE("static: too few nodes time out with a clear error", "[static]") {
  uint16_t port = pick_free_port();
  auto o = static_options("s4", port, 0, 2);
  o.join_timeout = 400ms;
  auto h = create_rendezvous_handler("static", o);
  CHECK_THROWS_WITH(h->next_rendezvous(), Catch::Contains("only some of the 2 nodes"));
}

TEST_CASE("static: node 0 cannot host on a taken port", "[static]") {
  uint16_t port = pick_free_port();
  auto a = create_rendezvous_handler("static", static_options("s5", port, 0, 2));
  // Another job's store holds the port.
  CHECK_THROWS_WITH(create_rendezvous_handler("static", static_options("s5-other", port, 0, 2)),
                    Catch::Contains("cannot host the store"));
  // This job's node 0 holds it: a second node was given --node-rank=0.
  CHECK_THROWS_WITH(create_rendezvous_handler("static", static_options("s5", port, 0, 2)),
                    Catch::Contains("--node-rank=0 was given to two nodes"));
}
