// The status record agents publish for `trun status`: it reads back what was written, and a
// record that is not one (garbage, a field of the wrong type) reads as nothing.
#include "agent/node_status.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using trun::agent::decode_node_status;
using trun::agent::encode_node_status;
using trun::agent::NodeStatus;

TEST_CASE("a node status record reads back what was written", "[node-status]") {
  NodeStatus s;
  s.node_id = "host-12-ab";
  s.hostname = "host";
  s.addr = "10.0.0.7";
  s.pid = 12;
  s.round = 3;
  s.group_rank = 1;
  s.group_world_size = 2;
  s.local_world_size = 4;
  s.restarts = 1;
  s.max_restarts = 3;
  s.state = "running";
  s.last_failure = "rank 5 exited with 1: \"quoted\"\nline \xff";
  s.last_failure_at = 1796191371.5;
  s.updated_at = 1796191372.25;
  s.root_cause = "rank 1 (local_rank 0) on hostB exited with SIGKILL";
  s.root_cause_node = "hostB-9-x";
  s.root_cause_at = 1796191371.25;
  s.root_cause_round = 2;
  const std::string text = encode_node_status(s);
  CHECK(text.find('\n') == std::string::npos);
  auto back = decode_node_status(text);
  REQUIRE(back);
  CHECK(back->node_id == s.node_id);
  CHECK(back->addr == s.addr);
  CHECK(back->pid == 12);
  CHECK(back->round == 3);
  CHECK(back->group_rank == 1);
  CHECK(back->group_world_size == 2);
  CHECK(back->local_world_size == 4);
  CHECK(back->restarts == 1);
  CHECK(back->max_restarts == 3);
  CHECK(back->state == "running");
  // The invalid UTF-8 byte is replaced, the rest kept.
  CHECK(back->last_failure.rfind("rank 5 exited with 1: \"quoted\"\nline ", 0) == 0);
  CHECK(back->last_failure_at == 1796191371.5);
  CHECK(back->updated_at == 1796191372.25);
  CHECK(back->root_cause == s.root_cause);
  CHECK(back->root_cause_node == "hostB-9-x");
  CHECK(back->root_cause_at == 1796191371.25);
  CHECK(back->root_cause_round == 2);
  // A record of an older agent (no root cause) reads with none.
  auto old = decode_node_status(R"({"node_id":"n","state":"running"})");
  REQUIRE(old);
  CHECK(old->root_cause.empty());
  CHECK(old->root_cause_round == -1);
  CHECK(trun::agent::node_status_key("job", "host-12-ab") == "trun/status/job/host-12-ab");
}

TEST_CASE("what is not a node status record reads as none", "[node-status]") {
  CHECK_FALSE(decode_node_status(""));
  CHECK_FALSE(decode_node_status("3"));
  CHECK_FALSE(decode_node_status("{\"node_id\": 3}"));
  CHECK_FALSE(decode_node_status("{\"node_id\": \"a\", \"round\": \"x\"}"));
  CHECK_FALSE(decode_node_status("{\"node_id\": \"a\""));
  // Fields it does not know (a newer agent) are ignored; missing ones take their defaults.
  auto minimal = decode_node_status("{\"node_id\": \"a\", \"future\": [1]}");
  REQUIRE(minimal);
  CHECK(minimal->node_id == "a");
  CHECK(minimal->round == -1);
  CHECK(minimal->state.empty());
}
