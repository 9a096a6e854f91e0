// trun timeline's parsing and page, on hand-written event lines (launcher/timeline.h). The real
// run rendered by Chromium is tests/observability/timeline.sh.
#include "launcher/timeline.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

namespace {

using trun::launcher::parse_timeline_event;
using trun::launcher::render_timeline_html;
using trun::launcher::TimelineEvent;

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

TimelineEvent ev(const std::string& name, int64_t ts, int64_t agent_pid, nlohmann::json md) {
  md["run_id"] = "job";
  md["hostname"] = "host";
  md["pid"] = agent_pid;
  TimelineEvent e;
  e.name = name;
  e.timestamp_ms = ts;
  e.metadata = std::move(md);
  return e;
}

}  // namespace

TEST_CASE(
    "a timeline line is an event only with a string name, an integer timestamp and a metadata "
    "object") {
  std::string error;
  auto ok = parse_timeline_event(
      R"({"name":"trun.agent.start","source":"AGENT","timestamp":12,"metadata":{"pid":3}})",
      &error);
  REQUIRE(ok);
  CHECK(ok->name == "trun.agent.start");
  CHECK(ok->timestamp_ms == 12);
  CHECK(ok->metadata["pid"] == 3);
  struct Bad {
    const char* line;
    const char* error;
  };
  for (const Bad& b :
       {Bad{"garbage", "not a JSON value"}, Bad{"[1]", "not a JSON object"},
        Bad{R"({"name":"x","timestamp":1,"metadata":{"a":1})", "not a JSON value"},
        Bad{R"({"timestamp":1,"metadata":{}})", "no string \"name\""},
        Bad{R"({"name":"x","timestamp":"1","metadata":{}})", "no integer \"timestamp\""},
        Bad{R"({"name":"x","timestamp":1.5,"metadata":{}})", "no integer \"timestamp\""},
        Bad{R"({"name":"x","timestamp":1,"metadata":[]})", "no object \"metadata\""}}) {
    INFO(b.line);
    error.clear();
    CHECK_FALSE(parse_timeline_event(b.line, &error));
    CHECK(error == b.error);
  }
}

TEST_CASE("a timeline draws a lane per agent and per local rank and a bar per worker process") {
  std::vector<TimelineEvent> events;
  // Two agents on one host (one file may hold both: the log is appended to), in any order.
  events.push_back(ev("trun.agent.start", 1000, 10, {}));
  events.push_back(ev("trun.rdzv.join", 1001, 10, {{"node_id", "n10"}}));
  events.push_back(ev("trun.rdzv.round_formed", 1100, 10,
                      {{"node_id", "n10"},
                       {"round", 0},
                       {"group_rank", 0},
                       {"group_world_size", 2},
                       {"world_size", 3}}));
  events.push_back(ev("trun.rdzv.round_formed", 1105, 20,
                      {{"node_id", "n20"},
                       {"round", 0},
                       {"group_rank", 1},
                       {"group_world_size", 2},
                       {"world_size", 3}}));
  for (int lr = 0; lr < 2; ++lr) {
    events.push_back(ev("trun.agent.worker_started", 1200, 10,
                        {{"local_rank", lr}, {"global_rank", lr}, {"worker_pid", 100 + lr}}));
  }
  events.push_back(ev("trun.agent.worker_exited", 1500, 10,
                      {{"local_rank", 1},
                       {"worker_pid", 101},
                       {"exitcode", -9},
                       {"signal", "SIGKILL"},
                       {"state", "FAILED"}}));
  events.push_back(ev("trun.agent.worker_exited", 1510, 10,
                      {{"local_rank", 0},
                       {"worker_pid", 100},
                       {"exitcode", -15},
                       {"signal", "SIGTERM"},
                       {"state", "STOPPED"}}));
  events.push_back(ev("trun.agent.restart", 1520, 10, {{"counted", true}, {"reason", "x"}}));
  // A worker that could not start: an exit without a start.
  events.push_back(ev("trun.agent.worker_exited", 1600, 10,
                      {{"local_rank", 0},
                       {"worker_pid", 0},
                       {"exitcode", 127},
                       {"state", "FAILED"},
                       {"raw_error", "no such file"}}));
  // Node 20's worker never exits in its log (its agent was SIGKILLed).
  events.push_back(ev("trun.agent.worker_started", 1210, 20,
                      {{"local_rank", 0}, {"global_rank", 2}, {"worker_pid", 200}}));
  events.push_back(ev("trun.rdzv.node_left", 1700, 10, {{"node_id", "n20"}, {"round", 0}}));
  events.push_back(ev("trun.agent.restart", 1710, 10, {{"counted", false}, {"reason", "y"}}));
  events.push_back(ev("trun.agent.stop", 2000, 10, {{"exit_code", 1}, {"state", "FAILED"}}));
  std::swap(events.front(), events.back());  // the order of the input does not matter

  const std::string html = render_timeline_html(events, "t");
  CHECK(count(html, "class=\"lane node\"") == 2);
  CHECK(count(html, "class=\"lane worker\"") == 3);  // 10: local ranks 0 and 1; 20: 0
  CHECK(count(html, "class=\"bar ") == 4);  // 10: stopped and could not start on 0, killed on 1
  CHECK(count(html, "class=\"bar signaled\"") == 1);
  CHECK(count(html, "class=\"bar stopped\"") == 1);
  CHECK(count(html, "class=\"bar failed\"") == 1);
  CHECK(count(html, "class=\"bar unknown\"") == 1);
  CHECK(count(html, "no such file") == 1);
  CHECK(count(html, "class=\"marker restart\"") == 1);
  CHECK(count(html, "class=\"marker reform\"") == 1);
  // One round, formed on both nodes: one line, both members in its tooltip.
  CHECK(count(html, "class=\"marker round\"") == 1);
  CHECK(count(html, "members: n10 (group rank 0), n20 (group rank 1)") == 1);
  CHECK(count(html, "round 0 ended: node_left (node n20)") == 1);
  CHECK(count(html, "still running when the log ends") == 1);
  // Self-contained: nothing is loaded from elsewhere, no script.
  CHECK(count(html, "<script") == 0);
  CHECK(count(html, "href=") == 0);
  CHECK(count(html, "src=") == 0);
}

TEST_CASE("a timeline escapes what the event logs hold") {
  std::vector<TimelineEvent> events;
  events.push_back(ev("trun.rdzv.join", 5, 1, {{"node_id", "<script>alert(1)</script>&\""}}));
  const std::string html = render_timeline_html(events, "a <b> title");
  CHECK(count(html, "<script") == 0);
  CHECK(count(html, "&lt;script&gt;alert(1)&lt;/script&gt;&amp;&quot;") >= 1);
  CHECK(count(html, "<title>a &lt;b&gt; title</title>") == 1);
}

TEST_CASE("a timeline of no event is refused") {
  CHECK_THROWS_AS(render_timeline_html({}, "t"), std::invalid_argument);
}

TEST_CASE("a timeline shortens long labels without cutting a UTF-8 character") {
  std::vector<TimelineEvent> events;
  // "node " + 29 ASCII + arrows: the cut at 35 bytes falls inside the first arrow's 3 bytes.
  events.push_back(ev("trun.rdzv.join", 5, 1,
                      {{"node_id", std::string(29, 'x') + "\xE2\x86\x92\xE2\x86\x92\xE2\x86\x92"
                                                          "\xE2\x86\x92\xE2\x86\x92"}}));
  const std::string html = render_timeline_html(events, "t");
  const std::string label = ">node " + std::string(29, 'x');
  const size_t at = html.find(label);
  REQUIRE(at != std::string::npos);
  const size_t end = html.find('<', at);
  const std::string shown = html.substr(at + 1, end - at - 1);
  CHECK(shown == "node " + std::string(29, 'x') + "...");
}
