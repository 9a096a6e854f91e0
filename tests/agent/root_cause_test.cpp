// The root cause across nodes (issue 43), black-box: two c10d agents on 127.0.0.1. Node b's
// worker dies by SIGKILL; node a's peer exits 1 because of it 300 ms later and, with nothing
// else to stop, reports first, while b still stops a worker that ignores SIGTERM (1 s). The
// earliest failure (b's SIGKILL), not the first report, is the root cause in both summaries, in
// `trun status`, in both event logs and on the timeline.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"

using namespace trun::testing;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

std::vector<json> events_named(const std::string& path, const std::string& name) {
  std::vector<json> out;
  std::istringstream in(read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    json e = json::parse(line, nullptr, false);
    if (e.is_object() && e.value("name", "") == name) out.push_back(std::move(e));
  }
  return out;
}

// A worker script: `text` split at spaces, "DIR" at the start of a word replaced by `dir` (a
// temporary directory: no spaces).
std::vector<std::string> words(const std::string& text, const std::string& dir) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string w; in >> w;) out.push_back(w.rfind("DIR", 0) == 0 ? dir + w.substr(3) : w);
  return out;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("the earliest failure across two nodes is the root cause, not the first report",
          "[agent][root-cause]") {
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  const std::string run_id = "root-cause-" + std::to_string(getpid());
  TempDir da, db;
  auto node = [&](bool host, const TempDir& d, const std::vector<std::string>& script) {
    std::vector<std::string> argv{
        trun_binary(),          "--nnodes=2",
        "--nproc-per-node=2",   "--max-restarts=1",
        "--shutdown-timeout=1", "--rdzv-backend=c10d",
        "--rdzv-id=" + run_id,  "--rdzv-endpoint=" + endpoint,
        "--rdzv-conf",          std::string("join_timeout=30,is_host=") + (host ? "true" : "false"),
        "--event-log",          d / "events.jsonl",
        test_worker()};
    argv.insert(argv.end(), script.begin(), script.end());
    return argv;
  };
  // b (the store host): local rank 1 ignores SIGTERM (so b's stop takes --shutdown-timeout)
  // and then writes its pid file; local rank 0 waits for that, writes its own pid file and dies by
  // SIGKILL (in attempt 1 once the test says go).
  Child b(node(true, db,
               words("on-attempt 1 wait-file DIR/go "  // attempt 1: on the test's cue
                     "on-rank 1 ignore-term on-rank 1 pidfile DIR "
                     "on-attempt 0 on-rank 0 wait-file DIR/pid_0_1 "
                     "on-attempt 1 on-rank 0 wait-file DIR/pid_1_1 "
                     "on-rank 0 pidfile DIR on-rank 0 signal 9 sleep 60",
                     db.path())));
  // a: local rank 0 exits 1 300 ms after b's rank 0 died (its connection closed); rank 1 sleeps.
  Child a(node(false, da,
               words("on-attempt 0 on-rank 0 wait-file DIR/pid_0_0 "
                     "on-attempt 1 on-rank 0 wait-file DIR/pid_1_0 "
                     "on-rank 0 sleep 0.3 on-rank 0 exit 1 sleep 60",
                     db.path())));

  // Round 0 failed; both agents resolved its root cause and formed round 1.
  auto resolved = [&](const TempDir& d) {
    return events_named(d / "events.jsonl", "trun.agent.root_cause").size() >= 1 &&
           events_named(d / "events.jsonl", "trun.rdzv.round_formed").size() >= 2;
  };
  REQUIRE(wait_until([&] { return (resolved(da) && resolved(db)) || !a.running() || !b.running(); },
                     30s));
  INFO("a: " << a.err());
  INFO("b: " << b.err());
  REQUIRE(a.running());
  REQUIRE(b.running());
  const auto formed = events_named(db / "events.jsonl", "trun.rdzv.round_formed");
  const std::string b_id = formed.at(0)["metadata"]["node_id"];
  const std::string a_id =
      events_named(da / "events.jsonl", "trun.rdzv.round_formed").at(0)["metadata"]["node_id"];
  REQUIRE(a_id != b_id);

  // The event logs: both name b's SIGKILL, b as its own, a as another node's.
  for (const TempDir* d : {&da, &db}) {
    const auto roots = events_named(*d / "events.jsonl", "trun.agent.root_cause");
    REQUIRE(roots.size() == 1);
    const json& md = roots[0]["metadata"];
    CHECK(md["node_id"] == b_id);
    CHECK(md["round"] == 0);
    CHECK(md["reports"] == 2);
    CHECK(md["message"].get<std::string>().find("exited with SIGKILL") != std::string::npos);
    CHECK(md["local"] == (d == &db));
    CHECK(md["failed_at_ms"].get<int64_t>() > 0);
  }
  // b's failure was reported after a's (the order the old rule took as the cause).
  const auto a_exit = events_named(da / "events.jsonl", "trun.agent.failure");
  const auto b_exit = events_named(db / "events.jsonl", "trun.agent.failure");
  REQUIRE(a_exit.size() == 1);
  REQUIRE(b_exit.size() == 1);
  CHECK(a_exit[0]["timestamp"].get<int64_t>() < b_exit[0]["timestamp"].get<int64_t>());

  // trun status: the root cause line, and in --json.
  const std::vector<std::string> where{"status", "--rdzv-backend=c10d", "--rdzv-id=" + run_id,
                                       "--rdzv-endpoint=" + endpoint};
  RunResult table;
  REQUIRE(wait_until(
      [&] {
        table = run_trun(where, {}, 20s);
        return table.out.find("root cause:   ") != std::string::npos;
      },
      20s));
  INFO(table.out);
  CHECK(table.out.find("exited with SIGKILL") != std::string::npos);
  CHECK(table.out.find("(node " + b_id + ", round 0") != std::string::npos);
  std::vector<std::string> as_json = where;
  as_json.push_back("--json");
  const RunResult j = run_trun(as_json, {}, 20s);
  const json status = json::parse(j.out, nullptr, false);
  REQUIRE(status.is_object());
  CHECK(status["root_cause"]["node_id"] == b_id);
  CHECK(status["root_cause"]["round"] == 0);

  // Attempt 1 fails the same way with no restart left: both summaries name b's SIGKILL.
  std::ofstream(db / "go") << "go\n";
  REQUIRE(a.wait(30s));
  REQUIRE(b.wait(30s));
  CHECK(a.exit_code() == 1);
  CHECK(b.exit_code() == 1);
  const std::string line = "trun: root cause: ";
  for (const Child* c : {&a, &b}) {
    const std::string err = c->err();
    const auto heading = err.find("Root Cause (earliest failure across nodes):");
    REQUIRE(heading != std::string::npos);
    const auto at = err.find(line, heading);
    REQUIRE(at != std::string::npos);
    const std::string root = err.substr(at, err.find('\n', at) - at);
    CHECK(root.find("exited with SIGKILL") != std::string::npos);
    CHECK(root.find("(node " + b_id + ", at ") != std::string::npos);
  }
  // a lists its own exit 1 as a failure and b's report as the root cause.
  CHECK(a.err().find("  node      : " + b_id) != std::string::npos);

  // The timeline of both logs marks b's SIGKILLed worker in each round, none of a's.
  const std::string html = da / "run.html";
  const RunResult t =
      run_trun({"timeline", da / "events.jsonl", db / "events.jsonl", "-o", html}, {}, 20s);
  REQUIRE(t.exit_code == 0);
  const std::string page = read_file(html);
  CHECK(count(page, "class=\"bar signaled\" data-root-cause=\"true\" data-node=\"" + b_id +
                        "\" data-local-rank=\"0\">") == 2);
  CHECK(count(page, "data-root-cause") == 2);
  CHECK(count(page, "class=\"bar failed\" data-node=\"" + a_id + "\" data-local-rank=\"0\">") == 2);
}
