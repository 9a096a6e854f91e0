// trun timeline's parsing and page, on hand-written event lines (launcher/timeline.h). The real
// run rendered by Chromium is tests/observability/timeline.sh.
#include "launcher/timeline.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <climits>
#include <cstdint>
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
  // The SIGKILL (1500) is the first failure of round 0: the root cause, the exit 127 is not.
  CHECK(count(html, "class=\"bar signaled\"") == 1);
  CHECK(count(html,
              "class=\"bar signaled\" data-root-cause=\"true\" data-node=\"n10\" "
              "data-local-rank=\"1\">") == 1);
  CHECK(count(html, "data-root-cause") == 1);
  CHECK(count(html, "class=\"root-cause-label\"") == 1);
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

TEST_CASE("a timeline marks the earliest failure across nodes as the round's root cause") {
  std::vector<TimelineEvent> events;
  // Node a (agent pid 10) and node b (agent pid 20) in round 3. b's worker is SIGKILLed at 1500;
  // a's peer exits 1 at 1520 because of it, and a's agent logs first.
  for (int64_t pid : {10, 20}) {
    const std::string id = pid == 10 ? "a" : "b";
    events.push_back(ev("trun.rdzv.round_formed", 1100, pid,
                        {{"node_id", id}, {"round", 3}, {"group_rank", pid / 10 - 1}}));
    events.push_back(ev("trun.agent.worker_started", 1200, pid,
                        {{"local_rank", 0},
                         {"global_rank", pid / 10 - 1},
                         {"worker_pid", pid * 10},
                         {"agent_restarts", 0}}));
  }
  events.push_back(ev("trun.agent.worker_exited", 1520, 10,
                      {{"local_rank", 0},
                       {"worker_pid", 100},
                       {"exitcode", 1},
                       {"state", "FAILED"},
                       {"agent_restarts", 0}}));
  events.push_back(ev("trun.agent.worker_exited", 1500, 20,
                      {{"local_rank", 0},
                       {"worker_pid", 200},
                       {"exitcode", -9},
                       {"signal", "SIGKILL"},
                       {"state", "FAILED"},
                       {"agent_restarts", 0}}));
  const std::string html = render_timeline_html(events, "t");
  CHECK(count(html,
              "class=\"bar signaled\" data-root-cause=\"true\" data-node=\"b\" "
              "data-local-rank=\"0\">") == 1);
  CHECK(count(html, "class=\"bar failed\" data-node=\"a\" data-local-rank=\"0\">") == 1);
  CHECK(count(html, "data-root-cause") == 1);
  CHECK(count(html, "root-cause") == 3);  // the bar, its label and the legend's key
  CHECK(count(html, "ROOT CAUSE (the first failure of its round across nodes)") == 1);
  CHECK(count(html, "root cause (first failure across nodes)") == 1);  // the legend
  // A worker trun stopped earlier is no failure: it does not take the mark.
  events.push_back(ev("trun.agent.worker_started", 1200, 10,
                      {{"local_rank", 1}, {"worker_pid", 101}, {"agent_restarts", 0}}));
  events.push_back(ev("trun.agent.worker_exited", 1300, 10,
                      {{"local_rank", 1},
                       {"worker_pid", 101},
                       {"exitcode", -15},
                       {"signal", "SIGTERM"},
                       {"state", "STOPPED"},
                       {"agent_restarts", 0}}));
  CHECK(count(render_timeline_html(events, "t"),
              "data-root-cause=\"true\" data-node=\"b\" data-local-rank=\"0\">") == 1);
}

TEST_CASE(
    "a timeline breaks a tie of failure times as the agents do, and marks each attempt's own "
    "root cause") {
  std::vector<TimelineEvent> events;
  // Nodes a (pid 10, its first event at 1000: drawn first) and b (pid 20, at 1001). In attempt
  // 0 both workers exit 1 at 2000: rendezvous::root_cause keeps the one listed first, a's. In
  // attempt 1 b's worker fails first (2600), then a's (2700).
  for (int64_t pid : {10, 20}) {
    const std::string id = pid == 10 ? "a" : "b";
    events.push_back(ev("trun.rdzv.round_formed", 1000 + pid / 10 - 1, pid,
                        {{"node_id", id}, {"round", 0}, {"group_rank", pid / 10 - 1}}));
  }
  auto worker = [&](int64_t agent, int64_t attempt, int64_t start, int64_t end) {
    const int64_t wpid = agent * 10 + attempt;
    events.push_back(ev("trun.agent.worker_started", start, agent,
                        {{"local_rank", 0}, {"worker_pid", wpid}, {"agent_restarts", attempt}}));
    events.push_back(ev("trun.agent.worker_exited", end, agent,
                        {{"local_rank", 0},
                         {"worker_pid", wpid},
                         {"exitcode", 1},
                         {"state", "FAILED"},
                         {"agent_restarts", attempt}}));
  };
  worker(20, 0, 1100, 2000);
  worker(10, 0, 1100, 2000);
  worker(10, 1, 2500, 2700);
  worker(20, 1, 2500, 2600);
  std::stable_sort(events.begin(), events.end(),
                   [](const TimelineEvent& x, const TimelineEvent& y) {
                     return x.timestamp_ms < y.timestamp_ms;
                   });
  const std::string html = render_timeline_html(events, "t");
  CHECK(count(html, "data-root-cause=\"true\"") == 2);
  CHECK(count(html, "data-root-cause=\"true\" data-node=\"a\" data-local-rank=\"0\">") == 1);
  CHECK(count(html, "data-root-cause=\"true\" data-node=\"b\" data-local-rank=\"0\">") == 1);
  CHECK(count(html, "class=\"bar failed\"") == 4);
  // Which bar of each node (worker pid = agent pid * 10 + attempt): a's of attempt 0, b's of
  // attempt 1.
  auto marked_tooltip = [&](const std::string& node) {
    const size_t at = html.find("data-root-cause=\"true\" data-node=\"" + node + "\"");
    if (at == std::string::npos) return std::string();
    return html.substr(at, html.find("</title>", at) - at);
  };
  CHECK(count(marked_tooltip("a"), "pid 100, round 0, restarts used 0") == 1);
  CHECK(count(marked_tooltip("b"), "pid 201, round 0, restarts used 1") == 1);
}

TEST_CASE("a timeline escapes what the event logs hold") {
  std::vector<TimelineEvent> events;
  events.push_back(ev("trun.rdzv.join", 5, 1, {{"node_id", "<script>alert(1)</script>&\""}}));
  const std::string html = render_timeline_html(events, "a <b> title");
  CHECK(count(html, "<script") == 0);
  CHECK(count(html, "&lt;script&gt;alert(1)&lt;/script&gt;&amp;&quot;") >= 1);
  CHECK(count(html, "<title>a &lt;b&gt; title</title>") == 1);
}

TEST_CASE("a timeline marks a hang with its verdict") {
  std::vector<TimelineEvent> events;
  events.push_back(ev("trun.agent.start", 0, 1, {{"nproc_per_node", 2}}));
  events.push_back(
      ev("trun.hang", 5000, 1,
         {{"summary", "rank 1 (node n0, pid 7) made no progress for 10.2 s: <x>"}, {"rank", 1}}));
  events.push_back(ev("trun.agent.stop", 9000, 1, {{"exit_code", 1}}));
  const std::string html = render_timeline_html(events, "t");
  CHECK(count(html, "<g class=\"hang\">") == 1);
  CHECK(count(html, "hang: rank 1 (node n0, pid 7) made no progress for 10.2 s: &lt;x&gt;") == 1);
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

TEST_CASE("a timeline line is refused when too long, too deep or with a timestamp out of range") {
  std::string error;
  const std::string tail = R"(,"metadata":{}})";
  auto line = [&](const std::string& ts) { return R"({"name":"x","timestamp":)" + ts + tail; };
  struct Bad {
    std::string line;
    std::string error;
  };
  const std::string range = " out of range (0..253402300799999 ms since the epoch)";
  for (const Bad& b : {
           Bad{line("-9223372036854775808"), "\"timestamp\" -9223372036854775808" + range},
           Bad{line("-1"), "\"timestamp\" -1" + range},
           Bad{line("9223372036854775807"), "\"timestamp\" 9223372036854775807" + range},
           Bad{line("18446744073709551615"), "\"timestamp\" 18446744073709551615" + range},
           Bad{line("253402300800000"), "\"timestamp\" 253402300800000" + range},
           Bad{line("1e999"), "not a JSON value"},
           Bad{std::string(17, '[') + std::string(17, ']'), "nested deeper than 16 levels"},
           Bad{R"({"name":"x","timestamp":1,"metadata":{"a":)" + std::string(15, '[') +
                   std::string(15, ']') + "}}",
               "nested deeper than 16 levels"},
           Bad{R"({"name":"x","timestamp":1,"metadata":{"a":")" + std::string(1 << 20, 'a') +
                   "\"}}",
               "longer than 1 MiB"},
       }) {
    INFO(b.line.substr(0, 80));
    error.clear();
    CHECK_FALSE(parse_timeline_event(b.line, &error));
    CHECK(error == b.error);
  }
  // The bounds themselves are events; brackets inside strings do not count as nesting.
  CHECK(parse_timeline_event(line("0"), &error));
  CHECK(parse_timeline_event(line("253402300799999"), &error));
  auto deep =
      parse_timeline_event(R"({"name":"[[[[[[[[[[[[[[[[[[[[","timestamp":1,"metadata":{"a":)" +
                               std::string(14, '[') + std::string(14, ']') + "}}",
                           &error);
  CHECK(deep);
}

TEST_CASE("the event-log parser gives the same lines whatever the chunks and skips long ones") {
  const std::string good = R"({"name":"a","timestamp":5,"metadata":{}})";
  const std::string text = good + "\r\n\n   \ngarbage\n" + std::string(3 << 20, 'x') + "\n" + good +
                           "\n" + good.substr(0, 20);
  for (size_t chunk : {size_t{1}, size_t{7}, size_t{4096}, text.size()}) {
    INFO(chunk);
    std::vector<TimelineEvent> events;
    std::vector<std::pair<uint64_t, std::string>> skipped;
    trun::launcher::EventLogParser parser(3, &events, [&](uint64_t line, const std::string& why) {
      skipped.emplace_back(line, why);
    });
    for (size_t at = 0; at < text.size(); at += chunk) {
      parser.feed(text.data() + at, std::min(chunk, text.size() - at));
    }
    parser.finish();
    REQUIRE(events.size() == 2);
    CHECK(parser.events_found() == 2);
    CHECK(events[0].line == 1);
    CHECK(events[1].line == 6);
    CHECK(events[1].file == 3);
    CHECK(events[1].timestamp_ms == 5);
    REQUIRE(skipped.size() == 3);
    CHECK(skipped[0] == std::make_pair(uint64_t{4}, std::string("not a JSON value")));
    CHECK(skipped[1] == std::make_pair(uint64_t{5}, std::string("longer than 1 MiB")));
    CHECK(skipped[2] == std::make_pair(uint64_t{7}, std::string("not a JSON value")));
  }
}

TEST_CASE("printable escapes control characters, bidi overrides and invalid UTF-8 only") {
  using trun::launcher::printable;
  CHECK(printable("plain ascii \\ text") == "plain ascii \\ text");
  CHECK(printable("\x1b]0;title\x07") == "\\x1B]0;title\\x07");
  CHECK(printable("a\nb\tc\r") == "a\\x0Ab\\x09c\\x0D");
  CHECK(printable("a\nb\tc\r", /*keep_newlines=*/true) == "a\nb\tc\\x0D");
  CHECK(printable(std::string("nul\0del\x7f", 8)) == "nul\\x00del\\x7F");
  CHECK(printable("\xc2\x9b"
                  "31m") == "\\u009B31m");  // C1 CSI as UTF-8
  CHECK(printable("\x9b"
                  "31m") == "\\x9B31m");  // and as a lone byte
  CHECK(printable("\xe2\x80\xae"
                  "cod") == "\\u202Ecod");  // RIGHT-TO-LEFT OVERRIDE
  CHECK(printable("\xc3\xa9t\xc3\xa9 \xe2\x86\x92 \xf0\x9f\x98\x80") ==
        "\xc3\xa9t\xc3\xa9 \xe2\x86\x92 \xf0\x9f\x98\x80");  // valid UTF-8 stays
  CHECK(printable("\xc0\xaf") == "\\xC0\\xAF");              // overlong
  CHECK(printable("\xed\xa0\x80") == "\\xED\\xA0\\x80");     // a surrogate
  CHECK(printable("\xe2\x86") == "\\xE2\\x86");              // cut
  CHECK(printable("\xff") == "\\xFF");
}

TEST_CASE("a timeline keeps control characters out of the page and cuts long labels") {
  std::vector<TimelineEvent> events;
  events.push_back(ev("trun.rdzv.join", 5, 1,
                      {{"node_id", "\x1b]0;x\x07" + std::string(10000, 'n')},
                       {"hostname", std::string(10000, 'h')}}));
  events.push_back(ev("trun.agent.worker_started", 6, 1, {{"local_rank", 0}, {"worker_pid", 9}}));
  events.push_back(ev("trun.agent.worker_exited", 7, 1,
                      {{"local_rank", 0},
                       {"worker_pid", 9},
                       {"exitcode", 1},
                       {"raw_error", "\xc2\x9b" + std::string(100000, 'e')}}));
  const std::string html = render_timeline_html(events, "t\x1b");
  CHECK(count(html, "\x1b") == 0);
  CHECK(count(html, "\xc2\x9b") == 0);
  CHECK(count(html, "\\x1B]0;x\\x07nnn") >= 1);
  CHECK(count(html, "<title>t\\x1B</title>") == 1);
  CHECK(count(html, std::string(300, 'n')) == 0);  // the node id: 256 bytes at most
  CHECK(count(html, std::string(300, 'h')) == 0);
  CHECK(count(html, "\\u009B" + std::string(4000, 'e')) == 1);  // the error: 4096 at most
  CHECK(count(html, std::string(4100, 'e')) == 0);
  CHECK(html.size() < 64 * 1024);
}

TEST_CASE("a timeline refuses a page over its bound, and clamps timestamps it is given") {
  std::vector<TimelineEvent> events;
  for (int i = 0; i < 2000; ++i) {
    events.push_back(
        ev("trun.agent.worker_started", 10 + i, 1, {{"local_rank", i}, {"worker_pid", i}}));
  }
  CHECK_THROWS_AS(render_timeline_html(events, "t", 100000), trun::launcher::TimelinePageTooLarge);
  CHECK(render_timeline_html(events, "t", 100 << 20).size() > 100000);
  // Events made without the parser (it refuses such timestamps): no overflow, a sane span.
  std::vector<TimelineEvent> odd;
  odd.push_back(ev("trun.agent.start", INT64_MIN, 1, {}));
  odd.push_back(ev("trun.agent.stop", INT64_MAX, 1, {}));
  const std::string html = render_timeline_html(odd, "t");
  CHECK(count(html, "time 0 is 1970-01-01 00:00:00.000 UTC, spanning 253402300799.999 s") == 1);
}
