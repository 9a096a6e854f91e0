// The learned timeouts agreed across nodes (agent/hang_agree.h): the record's text, damaged
// records, the merge, and nodes agreeing through a real store server at once (threads, each with
// its own TCP client, as agents on different hosts would be), with the rule adopting the result.

#include <catch2/catch.hpp>
#include <cmath>
#include <thread>
#include <vector>

#include "agent/hang_agree.h"
#include "store/server.h"
#include "store/tcp_store.h"

using namespace trun::agent::hang;

namespace {

TimeoutClass step_class() { return TimeoutClass{}; }
TimeoutClass section(const std::string& name) { return TimeoutClass{TimeoutClass::kSection, name}; }

trun::store::TcpStoreOptions client(uint16_t port) {
  trun::store::TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.timeout = std::chrono::seconds(10);
  o.connect_timeout = std::chrono::seconds(10);
  return o;
}

}  // namespace

TEST_CASE("hang agree: class names read back, the record round-trips and bad entries are skipped",
          "[hang][agree]") {
  for (const std::string name : {"startup", "step", "checkpoint", "section eval", "section a b"}) {
    TimeoutClass c;
    REQUIRE(class_from_name(name, &c));
    CHECK(c.name() == name);
  }
  TimeoutClass c;
  for (const std::string bad : {"", "section ", "steps", "Step", "section"}) {
    INFO(bad);
    CHECK_FALSE(class_from_name(bad, &c));
  }

  LearnedMap m;
  m[step_class()] = {12, 0.75};
  m[section("eval")] = {4, 31.5};
  m[TimeoutClass{TimeoutClass::kCheckpoint, ""}] = {3, 20};
  CHECK(decode_learned(encode_learned(m)) == m);

  // A foreign or damaged record: nothing, or only its good entries.
  for (const std::string junk : {"", "null", "[1,2]", "{", "\"step\"", "{\"step\": 3}"}) {
    INFO(junk);
    CHECK(decode_learned(junk).empty());
  }
  const LearnedMap partial = decode_learned(
      R"({"step": {"intervals": 9, "longest_s": 1.5},
          "bogus": {"intervals": 9, "longest_s": 1.5},
          "checkpoint": {"intervals": -1, "longest_s": 1.5},
          "section x": {"intervals": 2, "longest_s": -3},
          "section y": {"intervals": 2.5, "longest_s": 3},
          "section z": {"intervals": 2, "longest_s": "3"},
          "startup": {"intervals": 2}})");
  REQUIRE(partial.size() == 1);
  CHECK(partial.at(step_class()) == TimeoutRule::Learned{9, 1.5});
}

TEST_CASE("hang agree: the merge keeps the most intervals and the longest interval per class",
          "[hang][agree]") {
  LearnedMap a, b;
  a[step_class()] = {10, 2.0};
  a[section("eval")] = {3, 40};
  b[step_class()] = {25, 1.5};
  b[section("load")] = {1, 0};
  const LearnedMap m = merge_learned(a, b);
  REQUIRE(m.size() == 3);
  CHECK(m.at(step_class()) == TimeoutRule::Learned{25, 2.0});
  CHECK(m.at(section("eval")) == TimeoutRule::Learned{3, 40});
  CHECK(m.at(section("load")) == TimeoutRule::Learned{1, 0});
}

TEST_CASE(
    "hang agree: a record holds at most 64 sections, the first ones, and keeps its other classes",
    "[hang][agree]") {
  // A program that names a section per step: 100 names from one node, 100 others from another.
  LearnedMap a, b;
  a[step_class()] = {50, 1.0};
  for (int i = 0; i < 100; ++i) a = merge_learned(a, {{section("a" + std::to_string(i)), {2, 1}}});
  for (int i = 0; i < 100; ++i) b[section("b" + std::to_string(i))] = {2, 1};
  b[TimeoutClass{TimeoutClass::kCheckpoint, ""}] = {3, 20};
  const LearnedMap m = merge_learned(a, b);
  int sections = 0;
  for (const auto& [c, l] : m) sections += c.kind == TimeoutClass::kSection;
  CHECK(sections == kMaxLearnedSections);
  CHECK(m.count(section("a0")) == 1);
  CHECK(m.count(section("a63")) == 1);
  CHECK(m.count(section("a64")) == 0);
  CHECK(m.count(section("b0")) == 0);
  CHECK(m.at(step_class()) == TimeoutRule::Learned{50, 1.0});
  CHECK(m.at(TimeoutClass{TimeoutClass::kCheckpoint, ""}) == TimeoutRule::Learned{3, 20});
  // A section already held still merges; a record written by a node without the cap is cut when
  // read.
  CHECK(merge_learned(m, {{section("a5"), {9, 4}}}).at(section("a5")) ==
        TimeoutRule::Learned{9, 4});
  std::string big = "{";
  for (int i = 0; i < 100; ++i)
    big += (i ? "," : "") + std::string("\"section s") + std::to_string(1000 + i) +
           "\": {\"intervals\": 2, \"longest_s\": 1}";
  big += R"(, "step": {"intervals": 7, "longest_s": 0.5}})";
  const LearnedMap read = decode_learned(big);
  CHECK(read.size() == static_cast<size_t>(kMaxLearnedSections) + 1);
  CHECK(read.count(section("s1000")) == 1);
  CHECK(read.count(section("s1099")) == 0);
  CHECK(read.at(step_class()) == TimeoutRule::Learned{7, 0.5});
}

TEST_CASE(
    "hang agree: a rule adopting another node's intervals leaves its warm-up and takes the "
    "longer timeout",
    "[hang][agree]") {
  TimeoutRule mine;  // step: floor 10 s, factor 3, 5 warm-up intervals, 1800 s in the warm-up
  for (int i = 0; i < 3; ++i) mine.observe(step_class(), 0.2);
  CHECK(mine.timeout_s(step_class()) == 1800);  // still in its warm-up
  mine.adopt(step_class(), {40, 6.0});          // another node: 40 intervals, the longest 6 s
  CHECK(mine.timeout_s(step_class()) == Approx(18.0));
  mine.adopt(step_class(), {2, 1.0});  // shorter and fewer: changes nothing
  CHECK(mine.timeout_s(step_class()) == Approx(18.0));
  CHECK(mine.learned(step_class()) == TimeoutRule::Learned{40, 6.0});
  mine.adopt(step_class(), {0, 100});  // no interval behind it: ignored
  CHECK(mine.timeout_s(step_class()) == Approx(18.0));
}

TEST_CASE(
    "hang agree: eight nodes agreeing at once through a store server all end with the "
    "maximum, and a node with nothing new only reads",
    "[hang][agree]") {
  trun::store::StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = trun::store::StoreServer::start(so);
  const std::string key = learned_key("agree-test");
  constexpr int kNodes = 8;
  std::vector<LearnedMap> results(kNodes);
  std::vector<std::thread> nodes;
  for (int n = 0; n < kNodes; ++n) {
    nodes.emplace_back([&, n] {
      trun::store::TcpStore store(client(server->port()));
      LearnedMap local;
      // Node n: n + 1 intervals, its longest step 0.5 + n / 10 s; node 3 alone has a section.
      local[step_class()] = {n + 1, 0.5 + n / 10.0};
      if (n == 3) local[section("eval")] = {7, 12};
      results[n] = agree_learned(store, key, local);
    });
  }
  for (auto& t : nodes) t.join();
  trun::store::TcpStore reader(client(server->port()));
  const LearnedMap final_record = decode_learned(reader.get(key));
  REQUIRE(final_record.size() == 2);
  CHECK(final_record.at(step_class()).intervals == kNodes);
  CHECK(final_record.at(step_class()).longest_s == Approx(0.5 + (kNodes - 1) / 10.0));
  CHECK(final_record.at(section("eval")) == TimeoutRule::Learned{7, 12});
  // The last writer saw every node's values; each node saw at least its own.
  for (int n = 0; n < kNodes; ++n) {
    INFO("node " << n);
    CHECK(results[n].at(step_class()).intervals >= n + 1);
    CHECK(results[n].at(step_class()).longest_s >= 0.5 + n / 10.0 - 1e-9);
  }

  // A node that learned less than the record: it reads and writes nothing.
  const uint64_t before = server->num_requests();
  LearnedMap less;
  less[step_class()] = {1, 0.1};
  const LearnedMap got = agree_learned(reader, key, less);
  CHECK(got == final_record);
  CHECK(reader.get(key) == encode_learned(final_record));
  CHECK(server->num_requests() - before <= 3);  // check, get, and the get just above
}
