// EventLog on its own: the line format for every metadata type, and that the destructor writes
// what was queued. The black-box cases (a real job, a bad path, a full disk) are in
// event_log_test.cpp.
#include "agent/event_log.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/launcher/process_util.h"

using nlohmann::json;
using trun::agent::EventLog;
using trun::agent::EventMetadata;

TEST_CASE("an event line has torchelastic's four fields and every metadata type", "[event-log]") {
  const EventMetadata md{{"none", std::monostate{}},
                         {"text", std::string("a \"quoted\"\nline \xff")},
                         {"count", int64_t{-3}},
                         {"ratio", 0.5},
                         {"flag", true}};
  const std::string line = EventLog::format("trun.test", 1234, md);
  CHECK(line.find('\n') == std::string::npos);  // one line, whatever the values hold
  const json j = json::parse(line);
  CHECK(j.size() == 4);
  CHECK(j["name"] == "trun.test");
  CHECK(j["source"] == "AGENT");
  CHECK(j["timestamp"] == 1234);
  CHECK(j["metadata"]["none"].is_null());
  CHECK(j["metadata"]["text"] == "a \"quoted\"\nline \xEF\xBF\xBD");  // invalid UTF-8 replaced
  CHECK(j["metadata"]["count"] == -3);
  CHECK(j["metadata"]["ratio"] == 0.5);
  CHECK(j["metadata"]["flag"] == true);
}

TEST_CASE("the event log's destructor writes every queued line, with the common fields",
          "[event-log]") {
  trun::testing::TempDir d;
  const std::string path = d / "events.jsonl";
  {
    auto log = EventLog::open(path);
    log->set_common("run_id", std::string("job"));
    for (int64_t i = 0; i < 100; ++i) log->record("trun.test", {{"i", i}});
    CHECK(log->dropped() == 0);
  }
  std::istringstream in(trun::testing::read_file(path));
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    const json j = json::parse(line);
    CHECK(j["metadata"]["i"] == n);
    CHECK(j["metadata"]["run_id"] == "job");
    ++n;
  }
  CHECK(n == 100);
}
