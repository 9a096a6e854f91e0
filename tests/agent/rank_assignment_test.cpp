// agent/rank_assignment.h: torchelastic's ranks, computed and exchanged through a real store.
#include <catch2/catch.hpp>
#include <future>

#include "agent/rank_assignment.h"
#include "store/in_memory_store.h"
#include "store/prefix_store.h"

using namespace trun::agent;
using namespace std::chrono_literals;

TEST_CASE("global ranks follow group rank order, role ranks count only the same role", "[ranks]") {
  // Nodes listed out of order: 0 trainer x2, 1 server x1, 2 trainer x3.
  const std::vector<NodeRoleInfo> nodes = {{2, "trainer", 3}, {0, "trainer", 2}, {1, "server", 1}};
  const Ranks r2 = compute_ranks(nodes, 2, "trainer", 3);
  CHECK(r2.global == std::vector<int>{3, 4, 5});
  CHECK(r2.role == std::vector<int>{2, 3, 4});
  CHECK(r2.world_size == 6);
  CHECK(r2.role_world_size == 5);

  const Ranks r1 = compute_ranks(nodes, 1, "server", 1);
  CHECK(r1.global == std::vector<int>{2});
  CHECK(r1.role == std::vector<int>{0});
  CHECK(r1.role_world_size == 1);

  const Ranks single = compute_ranks({{0, "default", 4}}, 0, "default", 4);
  CHECK(single.global == std::vector<int>{0, 1, 2, 3});
  CHECK(single.world_size == 4);
}

TEST_CASE("role info round-trips, malformed entries name the node", "[ranks]") {
  const NodeRoleInfo i = parse_role_info(3, format_role_info("my role", 8));
  CHECK(i.group_rank == 3);
  CHECK(i.role == "my role");
  CHECK(i.nproc == 8);
  for (const std::string bad : {"", "trainer", "trainer\n", "trainer\nx", "trainer\n0",
                                "trainer\n-2", "trainer\n4x", "trainer\n99999999999"}) {
    INFO(bad);
    try {
      parse_role_info(5, bad);
      FAIL("accepted");
    } catch (const trun::rendezvous::RendezvousError& e) {
      CHECK(std::string(e.what()).find("node 5") != std::string::npos);
    }
  }
}

TEST_CASE("nodes exchange their roles through the round's store and agree on the world",
          "[ranks]") {
  auto shared = std::make_shared<trun::store::InMemoryStore>();
  auto info_of = [&](int group_rank) {
    trun::rendezvous::RendezvousInfo info;
    info.group_rank = group_rank;
    info.group_world_size = 3;
    info.store = std::make_shared<trun::store::PrefixStore>("round_1", shared);
    return info;
  };
  const int nproc[] = {2, 1, 3};
  const char* role[] = {"trainer", "server", "trainer"};
  std::vector<std::future<Ranks>> nodes;
  for (int g = 2; g >= 0; --g) {  // the last node publishes first
    nodes.push_back(std::async(
        std::launch::async, [&, g] { return assign_ranks(info_of(g), role[g], nproc[g], 10s); }));
  }
  const Ranks r2 = nodes[0].get(), r1 = nodes[1].get(), r0 = nodes[2].get();
  CHECK(r0.global == std::vector<int>{0, 1});
  CHECK(r1.global == std::vector<int>{2});
  CHECK(r2.global == std::vector<int>{3, 4, 5});
  CHECK(r2.role == std::vector<int>{2, 3, 4});
  for (const Ranks* r : {&r0, &r1, &r2}) CHECK(r->world_size == 6);
}

TEST_CASE("a node whose peer never publishes fails with the store's timeout", "[ranks]") {
  trun::rendezvous::RendezvousInfo info;
  info.group_rank = 0;
  info.group_world_size = 2;
  info.store = std::make_shared<trun::store::InMemoryStore>();
  CHECK_THROWS_AS(assign_ranks(info, "default", 1, 200ms), trun::store::StoreTimeoutError);
}
