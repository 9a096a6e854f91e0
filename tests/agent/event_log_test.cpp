// --event-log, black-box through the trun binary: a real job with a worker crash and a restart
// writes the expected events, one JSON object per line with torchelastic's Event fields; a bad
// path stops trun at start; a failing disk (/dev/full) is one warning and the job goes on.
// And the waiting line: a c10d node waiting for a late second node says so at a steady pace.
#include <catch2/catch.hpp>

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

std::vector<json> read_events(const std::string& path) {
  std::vector<json> events;
  std::istringstream in(read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    INFO(line);
    events.push_back(json::parse(line));  // every line is one JSON object
  }
  return events;
}

// The events named `name`, in order.
std::vector<json> named(const std::vector<json>& events, const std::string& name) {
  std::vector<json> out;
  for (const auto& e : events) {
    if (e["name"] == name) out.push_back(e);
  }
  return out;
}

}  // namespace

TEST_CASE("the event log records a crash, the restart and the stop as JSON lines",
          "[agent][event-log]") {
  TempDir d;
  const std::string log = d / "events.jsonl";
  // Attempt 0: local rank 1 exits 3 while rank 0 sleeps (it is stopped); attempt 1 succeeds.
  auto r = run_trun({"--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--event-log",
                     log, test_worker(), "on-attempt", "0", "on-rank", "1", "exit", "3",
                     "on-attempt", "0", "sleep", "60"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::vector<json> events = read_events(log);
  REQUIRE(events.size() >= 10);

  std::vector<std::string> names;
  for (const auto& e : events) {
    // torchelastic's Event fields, and the fields every trun event carries.
    CHECK(e.size() == 4);
    CHECK(e["name"].is_string());
    CHECK(e["source"] == "AGENT");
    CHECK(e["timestamp"].is_number_integer());
    CHECK(e["metadata"].is_object());
    CHECK(e["metadata"]["run_id"].get<std::string>().size() == 36);
    CHECK(e["metadata"]["hostname"].is_string());
    CHECK(e["metadata"]["pid"].is_number_integer());
    names.push_back(e["name"]);
  }
  for (size_t i = 1; i < events.size(); ++i) {
    CHECK(events[i]["timestamp"] >= events[i - 1]["timestamp"]);
  }
  // The order of the job's life (worker events within an attempt may interleave).
  auto pos = [&](const std::string& name, size_t from = 0) {
    for (size_t i = from; i < names.size(); ++i) {
      if (names[i] == name) return i;
    }
    FAIL("no event " << name << " after position " << from);
    return names.size();
  };
  const size_t start = pos("trun.agent.start");
  // Which trun wrote the log (as `trun --version` names it: tests/launcher/version_test.cpp).
  CHECK_THAT(events[start]["metadata"]["version"].get<std::string>(),
             Catch::Matches("[0-9]+[.][0-9]+[.][0-9]+"));
  CHECK_THAT(events[start]["metadata"]["commit"].get<std::string>(),
             Catch::Matches("[0-9a-f]{12}(-modified)?|unknown"));
  const size_t join = pos("trun.rdzv.join", start);
  const size_t formed = pos("trun.rdzv.round_formed", join);
  const size_t started = pos("trun.agent.worker_started", formed);
  const size_t failure = pos("trun.agent.failure", started);
  const size_t restart = pos("trun.agent.restart", failure);
  const size_t started_again = pos("trun.agent.worker_started", restart);
  const size_t stop = pos("trun.agent.stop", started_again);
  CHECK(stop == names.size() - 1);
  CHECK(start == 0);

  const auto exits = named(events, "trun.agent.worker_exited");
  REQUIRE(exits.size() == 4);
  // Attempt 0: rank 1 failed with 3, rank 0 was stopped by SIGTERM.
  for (int i = 0; i < 2; ++i) {
    const json& m = exits[i]["metadata"];
    CHECK(m["agent_restarts"] == 0);
    if (m["local_rank"] == 1) {
      CHECK(m["exitcode"] == 3);
      CHECK(m["state"] == "FAILED");
    } else {
      CHECK(m["exitcode"] == -15);
      CHECK(m["signal"] == "SIGTERM");
      CHECK(m["state"] == "STOPPED");
    }
  }
  for (int i = 2; i < 4; ++i) {
    CHECK(exits[i]["metadata"]["exitcode"] == 0);
    CHECK(exits[i]["metadata"]["state"] == "SUCCEEDED");
    CHECK(exits[i]["metadata"]["agent_restarts"] == 1);
  }
  const auto starts = named(events, "trun.agent.worker_started");
  REQUIRE(starts.size() == 4);
  CHECK(starts[0]["metadata"]["worker_pid"].get<int64_t>() > 0);
  const json& f = events[failure]["metadata"];
  CHECK(f["global_rank"] == 1);
  CHECK(f["exitcode"] == 3);
  CHECK(f["restart"] == true);
  CHECK(events[restart]["metadata"]["agent_restarts"] == 1);
  CHECK(events[restart]["metadata"]["counted"] == true);
  const json& round = events[formed]["metadata"];
  CHECK(round["group_world_size"] == 1);
  CHECK(round["world_size"] == 2);
  CHECK(round["rdzv_backend"] == "standalone");
  CHECK(events[stop]["metadata"]["exit_code"] == 0);
  CHECK(events[stop]["metadata"]["state"] == "SUCCEEDED");
}

TEST_CASE("an --event-log that cannot be opened stops trun before it starts anything",
          "[agent][event-log]") {
  TempDir d;
  auto r = run_trun({"--standalone", "--nproc-per-node", "1", "--event-log",
                     d / "no-such-dir/events.jsonl", test_worker(), "pidfile", d.path()});
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("trun: error: cannot open the event log " + (d / "no-such-dir")) !=
        std::string::npos);
  CHECK_FALSE(file_exists(d / "pid_0_0"));
}

TEST_CASE("an event log on a full disk is one warning and the job goes on", "[agent][event-log]") {
  auto r = run_trun({"--standalone", "--nproc-per-node", "2", "--event-log", "/dev/full",
                     test_worker(), "exit", "0"});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  const std::string warning = "cannot write the event log /dev/full";
  const size_t at = r.err.find(warning);
  CHECK(at != std::string::npos);
  CHECK(r.err.find(warning, at + 1) == std::string::npos);  // once
}

TEST_CASE("static: node 0 waiting for node 1 prints the progress line at a steady pace",
          "[agent][waiting]") {
  const std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    return std::vector<std::string>{trun_binary(),
                                    "--nnodes=2",
                                    "--node-rank=" + std::to_string(rank),
                                    "--rdzv-id=late-static",
                                    "--master-addr=127.0.0.1",
                                    "--master-port=" + port,
                                    "--rdzv-conf",
                                    "join_timeout=60,progress_interval=0.2",
                                    test_worker(),
                                    "exit",
                                    "0"};
  };
  const std::string waiting =
      "static rendezvous 'late-static': waiting for nodes in round 0: 1 "
      "joined (min 2, max 2); join timeout in ";
  Child first(node(0));
  auto count = [&](const std::string& text) {
    size_t n = 0;
    for (size_t at = text.find(waiting); at != std::string::npos; at = text.find(waiting, at + 1))
      ++n;
    return n;
  };
  REQUIRE(wait_until([&] { return count(first.err()) >= 2 || !first.running(); }, 30s));
  INFO(first.err());
  REQUIRE(first.running());
  Child second(node(1));
  REQUIRE(first.wait(60s));
  REQUIRE(second.wait(60s));
  INFO(second.err());
  CHECK(first.exit_code() == 0);
  CHECK(second.exit_code() == 0);
}

TEST_CASE("a node waiting for a late second node prints a progress line at a steady pace",
          "[agent][event-log][waiting]") {
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  TempDir d0, d1;
  auto node = [&](const std::string& is_host, const TempDir& d) {
    return std::vector<std::string>{trun_binary(),
                                    "--nnodes=2",
                                    "--nproc-per-node=1",
                                    "--rdzv-backend=c10d",
                                    "--rdzv-id=late-node",
                                    "--rdzv-endpoint=" + endpoint,
                                    "--rdzv-conf",
                                    "join_timeout=60,progress_interval=0.2,is_host=" + is_host,
                                    "--event-log",
                                    d / "events.jsonl",
                                    test_worker(),
                                    "exit",
                                    "0"};
  };
  const std::string waiting =
      "waiting for nodes in round 0: 1 joined (min 2, max 2); join timeout in ";
  Child first(node("true", d0));
  // Two progress lines before the second node exists: the line repeats, not only at the end.
  auto count = [&](const std::string& text) {
    size_t n = 0;
    for (size_t at = text.find(waiting); at != std::string::npos; at = text.find(waiting, at + 1)) {
      ++n;
    }
    return n;
  };
  REQUIRE(wait_until([&] { return count(first.err()) >= 2 || !first.running(); }, 30s));
  INFO(first.err());
  REQUIRE(first.running());
  Child second(node("false", d1));
  REQUIRE(first.wait(60s));
  REQUIRE(second.wait(60s));
  INFO(second.err());
  CHECK(first.exit_code() == 0);
  CHECK(second.exit_code() == 0);
  // Each node's log has its join and the round with both nodes.
  for (const TempDir* d : {&d0, &d1}) {
    const auto events = read_events(*d / "events.jsonl");
    const auto formed = named(events, "trun.rdzv.round_formed");
    REQUIRE(formed.size() == 1);
    CHECK(formed[0]["metadata"]["group_world_size"] == 2);
    CHECK(formed[0]["metadata"]["rdzv_backend"] == "c10d");
    CHECK(formed[0]["metadata"]["run_id"] == "late-node");
    CHECK(named(events, "trun.rdzv.join").size() == 1);
    CHECK(named(events, "trun.agent.stop").size() == 1);
  }
}

// [no_tsan]: in two of about five TSan runs at -j2 under load (never alone, never in the ASan or
// plain builds) the store host's agent took over 30 s to exit after the final SIGTERM, with no
// ThreadSanitizer report. Left out of the TSan step until that slow exit is understood (noted on
// issue 15); the case still runs in the ASan+UBSan step.
TEST_CASE("the event log records a node that leaves and one that joins a running c10d job",
          "[agent][event-log][no_tsan]") {
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  TempDir d0, d1, d2;
  auto node = [&](const std::string& is_host, const TempDir& d) {
    return std::vector<std::string>{
        trun_binary(), "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
        "--rdzv-backend=c10d", "--rdzv-id=leave-join", "--rdzv-endpoint=" + endpoint, "--rdzv-conf",
        "join_timeout=30,last_call_timeout=0.5,keep_alive_interval=0.5,is_host=" + is_host,
        // A SIGKILLed agent cannot remove a temporary log directory: keep it in d.
        "--log-dir=" + d / "logs", "--event-log", d / "events.jsonl", test_worker(), "pidfile",
        d.path(), "sleep", "60"};
  };
  auto events_of = [](const TempDir& d) { return read_events(d / "events.jsonl"); };
  auto rounds_with = [&](const TempDir& d, int nodes) {
    int n = 0;
    for (const auto& e : named(events_of(d), "trun.rdzv.round_formed")) {
      n += e["metadata"]["group_world_size"] == nodes ? 1 : 0;
    }
    return n;
  };
  Child a(node("true", d0));
  REQUIRE(wait_until([&] { return file_exists(d0 / "pid_0_0") || !a.running(); }, 30s));
  Child b(node("false", d1));
  // Both in one round of two nodes (the first may have formed alone before b came).
  REQUIRE(wait_until([&] { return rounds_with(d0, 2) >= 1 && rounds_with(d1, 2) >= 1; }, 30s));
  REQUIRE(wait_until([&] { return file_exists(d1 / "pid_0_0") || !b.running(); }, 30s));
  b.signal(SIGKILL);
  REQUIRE(b.wait(10s));
  // a sees b leave and forms a round alone.
  INFO(a.err());
  REQUIRE(wait_until(
      [&] { return !named(events_of(d0), "trun.rdzv.node_left").empty() || !a.running(); }, 30s));
  REQUIRE(wait_until([&] { return rounds_with(d0, 1) >= 1 || !a.running(); }, 30s));
  const size_t alone = rounds_with(d0, 2);
  // A new node joins the running job: a sees it announced, and a round of two forms again.
  Child c(node("false", d2));
  REQUIRE(wait_until([&] { return rounds_with(d0, 2) > static_cast<int>(alone); }, 30s));
  INFO(c.err());
  const auto events = events_of(d0);
  const auto left = named(events, "trun.rdzv.node_left");
  REQUIRE(!left.empty());
  CHECK(left[0]["metadata"]["rdzv_backend"] == "c10d");
  CHECK(left[0]["metadata"]["node_id"].get<std::string>().size() > 0);
  const auto joined = named(events, "trun.rdzv.node_joined");
  REQUIRE(!joined.empty());
  CHECK(joined.back()["metadata"]["node_id"] != left[0]["metadata"]["node_id"]);
  // Membership changes re-form the group without counting restarts.
  for (const auto& r : named(events, "trun.agent.restart")) {
    CHECK(r["metadata"]["counted"] == false);
    CHECK(r["metadata"]["reason"] == "round over");
  }
  CHECK(a.running());
  a.signal(SIGTERM);
  c.signal(SIGTERM);
  CHECK(a.wait(30s));
  CHECK(c.wait(30s));
}
