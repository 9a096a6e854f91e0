// The crash-loop guard and the health gate (docs/health.md), black-box through the trun binary
// with real workers: a worker that fails at every start, failures that differ or come after
// progress (time, or libtrun_worker's steps), a --health-check that fails and then passes, one
// that hangs, a stop signal while unhealthy, and a full /dev/shm in a mount namespace.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/skip.h"

using namespace trun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

std::string train_mlp_binary() { return std::string(TRUN_BINARY_DIR) + "/examples/train_mlp"; }

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The event log's records named `name`, in order.
std::vector<json> records_named(const std::string& path, const std::string& name) {
  std::vector<json> out;
  for (const auto& line : lines_of(read_file(path))) {
    json j = json::parse(line, nullptr, false);
    if (j.is_object() && j.value("name", "") == name) out.push_back(j);
  }
  return out;
}

// A shell script at `path` that fails (printing why) until it has run `fail_first` times, and
// passes after; it counts its runs in `path`.count.
void write_flaky_check(const std::string& path, int fail_first) {
  std::ofstream(path) << "#!/bin/sh\n"
                      << "n=$(cat '" << path << ".count' 2>/dev/null || echo 0)\n"
                      << "n=$((n + 1)); echo $n > '" << path << ".count'\n"
                      << "if [ $n -le " << fail_first << " ]; then\n"
                      << "  echo \"check $n: GPU 3 reports uncorrectable ECC errors\"; exit 1\n"
                      << "fi\n"
                      << "echo \"check $n: all good\"\n";
  ::chmod(path.c_str(), 0755);
}

// An agent of a c10d job of 2 to 3 nodes, one trun_test_worker each running `work`, with
// `options` (the exclusion's) and an event log at `events`; the store's host is `host`.
std::unique_ptr<Child> exclusion_agent(const std::string& ep, const std::string& run, bool host,
                                       const std::vector<std::string>& options,
                                       const std::string& events,
                                       const std::vector<std::string>& work) {
  std::vector<std::string> argv{trun_binary(),
                                "--nnodes=2:3",
                                "--nproc-per-node=1",
                                "--max-restarts=50",
                                "--rdzv-backend=c10d",
                                "--rdzv-endpoint=" + ep,
                                "--rdzv-id=" + run,
                                "--event-log",
                                events,
                                std::string("--rdzv-conf=last_call_timeout=1,join_timeout=60") +
                                    (host ? ",is_host=1" : ",is_host=0")};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.push_back(test_worker());
  argv.insert(argv.end(), work.begin(), work.end());
  return std::make_unique<Child>(argv);
}

}  // namespace

TEST_CASE("a worker that fails the same way at every start stops the job at --crash-loop-limit",
          "[agent][health][crash_loop]") {
  SECTION("default limit: 3 attempts, exit 4, with the repeated cause") {
    auto r = run_trun(
        {"--standalone", "--nproc-per-node=2", "--max-restarts=50", test_worker(), "exit", "1"});
    INFO(r.err);
    REQUIRE(r.finished);
    CHECK(r.exit_code == 4);
    CHECK(r.err.find("the same failure 3 times in a row, no progress: exited with 1") !=
          std::string::npos);
    CHECK(r.err.find("(2 of 50 restarts used") != std::string::npos);
    CHECK(count_of(r.err, "restarting the worker group (") == 2);
    // The usual failure summary comes first, the guard's verdict last.
    const size_t summary = r.err.find("Root Cause");
    REQUIRE(summary != std::string::npos);
    CHECK(r.err.find("trun: error: the same failure", summary) != std::string::npos);
  }
  SECTION("--crash-loop-limit=5") {
    auto r = run_trun(
        {"--standalone", "--max-restarts=50", "--crash-loop-limit=5", test_worker(), "exit", "7"});
    INFO(r.err);
    CHECK(r.exit_code == 4);
    CHECK(count_of(r.err, "restarting the worker group (") == 4);
    CHECK(r.err.find("the same failure 5 times in a row, no progress: exited with 7") !=
          std::string::npos);
  }
  SECTION("--crash-loop-limit=0 spends every restart, as torchrun does") {
    auto r = run_trun(
        {"--standalone", "--max-restarts=5", "--crash-loop-limit=0", test_worker(), "exit", "1"});
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(count_of(r.err, "restarting the worker group (") == 5);
    CHECK(r.err.find("the same failure") == std::string::npos);
  }
  SECTION("the event log records the verdict") {
    TempDir d;
    auto r = run_trun({"--standalone", "--max-restarts=9", "--event-log", d / "events.jsonl",
                       test_worker(), "signal", "11"});
    INFO(r.err);
    CHECK(r.exit_code == 4);
    auto ev = records_named(d / "events.jsonl", "trun.agent.crash_loop");
    REQUIRE(ev.size() == 1);
    CHECK(ev[0]["metadata"]["streak"] == 3);
    CHECK(ev[0]["metadata"]["failure"] == "exited with SIGSEGV");
  }
}

TEST_CASE("failures that differ, or that come after progress, are not a crash loop",
          "[agent][health][crash_loop]") {
  SECTION("a different exit code each time") {
    auto r = run_trun({"--standalone",
                       "--max-restarts=4",
                       test_worker(),
                       "on-attempt",
                       "0",
                       "exit",
                       "1",
                       "on-attempt",
                       "1",
                       "exit",
                       "2",
                       "on-attempt",
                       "2",
                       "exit",
                       "1",
                       "on-attempt",
                       "3",
                       "exit",
                       "2",
                       "exit",
                       "1"});
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(count_of(r.err, "restarting the worker group (") == 4);
  }
  SECTION("each attempt ran past --crash-loop-uptime") {
    auto r = run_trun({"--standalone", "--max-restarts=3", "--crash-loop-uptime=0.3", test_worker(),
                       "sleep", "0.6", "exit", "1"});
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(count_of(r.err, "restarting the worker group (") == 3);
  }
  SECTION("the attempt completed steps (libtrun_worker's progress board)") {
    // With a limit of 1, any failure without progress would stop the job; the first attempt
    // crashes after 3 steps (uptime cannot count: 1000 s), so it restarts and finishes.
    auto r =
        run_trun({"--standalone", "--nproc-per-node=2", "--max-restarts=3", "--crash-loop-limit=1",
                  "--crash-loop-uptime=1000", train_mlp_binary(), "--classic", "--no-ckpt",
                  "--dataset-size", "256", "--crash-at-step", "3", "--crash-rank", "1"},
                 {}, 120s);
    INFO(r.err);
    REQUIRE(r.finished);
    CHECK(r.exit_code == 0);
    CHECK(count_of(r.err, "restarting the worker group (") == 1);
    CHECK(r.err.find("the same failure") == std::string::npos);
  }
  SECTION("--crash-loop-limit=1 stops at the first failure without progress") {
    auto r = run_trun(
        {"--standalone", "--max-restarts=3", "--crash-loop-limit=1", test_worker(), "exit", "1"});
    INFO(r.err);
    CHECK(r.exit_code == 4);
    CHECK(count_of(r.err, "restarting the worker group (") == 0);
  }
}

TEST_CASE("a node whose --health-check fails stays out of the job until it passes",
          "[agent][health]") {
  TempDir d;
  const std::string check = d / "check.sh";
  SECTION("fails twice before the first join, then passes: the job runs") {
    write_flaky_check(check, 2);
    auto r = run_trun({"--standalone", "--event-log", d / "events.jsonl", "--health-check", check,
                       test_worker(), "exit", "0"});
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK(count_of(r.err, "is unhealthy before joining: --health-check exited with 1: check ") ==
          2);
    CHECK(r.err.find("uncorrectable ECC errors; it stays out of the job and checks again in 1 s") !=
          std::string::npos);
    CHECK(r.err.find("checks again in 2 s") != std::string::npos);
    CHECK(r.err.find("healthy again after 2 failed check(s)") != std::string::npos);
    CHECK(read_file(check + ".count") == "3\n");
    auto ev = records_named(d / "events.jsonl", "trun.agent.health");
    REQUIRE(ev.size() == 3);
    CHECK(ev[0]["metadata"]["healthy"] == false);
    CHECK(ev[0]["metadata"]["output"] == "check 1: GPU 3 reports uncorrectable ECC errors\n");
    CHECK(ev[2]["metadata"]["healthy"] == true);
    // Never a failure of the job: no restart was spent on it.
    CHECK(records_named(d / "events.jsonl", "trun.agent.restart").empty());
  }
  SECTION("after a failure of this node's workers, before the restart") {
    write_flaky_check(check, 0);  // passes at the first join
    // The second run of the check (after attempt 0 failed) fails once.
    std::ofstream(check, std::ios::app)
        << "[ $n -eq 2 ] && { echo 'scratch disk read-only'; exit 1; }\n"
        << "exit 0\n";
    auto r = run_trun({"--standalone", "--max-restarts=1", "--health-check", check, test_worker(),
                       "on-attempt", "0", "exit", "3", "exit", "0"});
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK(count_of(r.err,
                   "is unhealthy after the failure: --health-check exited with 1: "
                   "scratch disk read-only") == 1);
    CHECK(read_file(check + ".count") == "3\n");
  }
  SECTION("a check that hangs is killed at --health-check-timeout, with what it started") {
    auto r = run_trun({"--standalone", "--health-check",
                       "sleep 30 & echo $! > '" + d.path() + "/bg.pid'; sleep 30",
                       "--health-check-timeout=0.5", test_worker(), "exit", "0"},
                      {}, 6s);
    INFO(r.err);
    CHECK(r.err.find("--health-check ran past its timeout (0.5 s): killed") != std::string::npos);
    const pid_t bg = read_pid(d / "bg.pid");
    REQUIRE(bg > 0);
    CHECK(wait_until([&] { return !pid_alive(bg); }, 10s));
  }
  SECTION("a stop signal while the node waits unhealthy ends trun with 128+N") {
    Child c(
        {trun_binary(), "--standalone", "--health-check", "exit 1", test_worker(), "exit", "0"});
    REQUIRE(wait_until(
        [&] { return c.err().find("is unhealthy before joining") != std::string::npos; }, 20s));
    c.signal(SIGTERM);
    REQUIRE(c.wait(10s));
    CHECK(c.exit_code() == 143);
  }
  SECTION("bad values are usage errors") {
    for (const auto& args : std::vector<std::vector<std::string>>{{"--health-check="},
                                                                  {"--health-check-timeout=-1"},
                                                                  {"--health-builtin=maybe"},
                                                                  {"--crash-loop-limit=-2"},
                                                                  {"--crash-loop-uptime=soon"}}) {
      std::vector<std::string> argv{"--standalone"};
      argv.insert(argv.end(), args.begin(), args.end());
      argv.push_back(test_worker());
      auto r = run_trun(argv);
      INFO(args[0] << ": " << r.err);
      CHECK(r.exit_code == 2);
      CHECK(r.err.find("trun: error: " + args[0].substr(0, args[0].find('='))) !=
            std::string::npos);
    }
  }
}

TEST_CASE("a full /dev/shm keeps the node out until space is freed (mount namespace)",
          "[agent][health]") {
  if (::geteuid() != 0 || ::access("/usr/bin/unshare", X_OK) != 0) {
    TRUN_SKIP("needs root and unshare(1) for a private /dev/shm (util-linux)", kSetup);
  }
  TempDir d;
  // A private mount namespace whose /dev/shm is a 16 MiB tmpfs, filled; trun runs in it (unshare
  // and sh exec it: the Child's pid is trun's).
  const std::string script =
      "mount -t tmpfs -o size=16m tmpfs /dev/shm && "
      "dd if=/dev/zero of=/dev/shm/filler bs=1M count=16 2>/dev/null; "
      "exec '" +
      trun_binary() + "' --standalone --event-log '" + d.path() + "/events.jsonl' '" +
      test_worker() + "' exit 0";
  Child c({"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script});
  REQUIRE(wait_until(
      [&] { return c.err().find("is unhealthy before joining") != std::string::npos; }, 20s));
  INFO(c.err());
  CHECK(c.err().find("/dev/shm has 0.0 MiB free, 8.") != std::string::npos);
  // The test's /dev/shm is not trun's: it frees trun's through /proc/<pid>/root.
  const std::string filler = "/proc/" + std::to_string(c.pid()) + "/root/dev/shm/filler";
  REQUIRE(file_exists(filler));
  REQUIRE(::unlink(filler.c_str()) == 0);
  REQUIRE(c.wait(30s));
  CHECK(c.exit_code() == 0);
  CHECK(c.err().find("healthy again after") != std::string::npos);
}

TEST_CASE(
    "a node whose workers fail at every start is excluded, rejoins after its cooldown, and "
    "is excluded twice as long when it fails again",
    "[agent][health][exclusion]") {
  TempDir d;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "exclude-" + std::to_string(::getpid());
  auto agent = [&](const std::string& name, bool host, std::vector<std::string> work) {
    return exclusion_agent(ep, run, host, {"--exclude-after=2", "--exclude-cooldown=2"},
                           d / (name + ".jsonl"), work);
  };
  // A and C train for 6 s; B's worker fails 0.2 s after each start.
  auto a = agent("a", true, {"sleep", "6", "exit", "0"});
  std::this_thread::sleep_for(500ms);  // the store host first
  auto c = agent("c", false, {"sleep", "6", "exit", "0"});
  auto b = agent("b", false, {"sleep", "0.2", "exit", "1"});
  // While B sits out its second exclusion, trun status says so.
  REQUIRE(wait_until([&] { return b->err().find("(exclusion 2)") != std::string::npos; }, 60s));
  RunResult st = run_trun_until(
      {"status", "--rdzv-backend=c10d", "--rdzv-endpoint=" + ep, "--rdzv-id=" + run}, "excluded: ");
  INFO("status:\n" << st.out << st.err);
  CHECK(st.out.find("excluded: ") != std::string::npos);
  CHECK(st.out.find("its workers failed 2 times within 600 s") != std::string::npos);
  REQUIRE(a->wait(120s));
  REQUIRE(c->wait(30s));
  const std::string berr = b->err();
  INFO("a:\n" << a->err() << "\nb:\n" << berr);
  CHECK(a->exit_code() == 0);
  CHECK(c->exit_code() == 0);
  CHECK(berr.find("is excluded for 2 s (exclusion 1): its workers failed 2 times") !=
        std::string::npos);
  CHECK(berr.find("is excluded for 4 s (exclusion 2)") != std::string::npos);
  CHECK(berr.find("the exclusion of this node is over; joining again") != std::string::npos);
  auto ev = records_named(d / "b.jsonl", "trun.agent.excluded");
  REQUIRE(ev.size() >= 2);
  CHECK(ev[0]["metadata"]["cooldown_s"] == 2.0);
  CHECK(ev[1]["metadata"]["cooldown_s"] == 4.0);
  b->signal(SIGTERM);  // it may still sit out an exclusion, or wait for a job that is over
  REQUIRE(b->wait(30s));
}

TEST_CASE("a node is not excluded when the others are fewer than --nnodes MIN",
          "[agent][health][exclusion]") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "keep-" + std::to_string(::getpid());
  auto agent = [&](bool host, std::vector<std::string> work) {
    std::vector<std::string> argv{
        trun_binary(),
        "--nnodes=2:2",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--crash-loop-limit=0",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=" + ep,
        "--rdzv-id=" + run,
        "--exclude-after=1",
        host ? "--rdzv-conf=is_host=1" : "--rdzv-conf=join_timeout=60,is_host=0"};
    argv.push_back(test_worker());
    argv.insert(argv.end(), work.begin(), work.end());
    return std::make_unique<Child>(argv);
  };
  auto a = agent(true, {"sleep", "30", "exit", "0"});
  std::this_thread::sleep_for(500ms);  // the store host first (the other waits for it)
  auto b = agent(false, {"exit", "1"});
  REQUIRE(b->wait(90s));
  REQUIRE(a->wait(60s));
  INFO("a:\n" << a->err() << "\nb:\n" << b->err());
  CHECK(b->err().find("but the job keeps it: without it 1 node(s) are left, fewer than --nnodes "
                      "MIN 2") != std::string::npos);
  CHECK(b->err().find("is excluded for") == std::string::npos);
  CHECK(b->exit_code() == 1);  // every restart spent, as without exclusion
}

TEST_CASE("a node that is unhealthy before its first join shows in trun status",
          "[agent][health][status]") {
  TempDir d;
  const std::string check = d / "check.sh";
  write_flaky_check(check, 4);  // out for 1 + 2 + 4 + 8 s
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "unhealthy-" + std::to_string(::getpid());
  Child a({trun_binary(), "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
           "--rdzv-endpoint=" + ep, "--rdzv-id=" + run, "--rdzv-conf=is_host=1", "--health-check",
           check, test_worker(), "exit", "0"});
  REQUIRE(
      wait_until([&] { return a.err().find("checks again in 2 s") != std::string::npos; }, 30s));
  RunResult st =
      run_trun_until({"status", "--rdzv-backend=c10d", "--rdzv-endpoint=" + ep, "--rdzv-id=" + run},
                     "1 outside (unhealthy or excluded)");
  INFO("status:\n" << st.out << st.err << "\ntrun:\n" << a.err());
  CHECK(st.exit_code == 0);
  CHECK(st.out.find("1 outside (unhealthy or excluded)") != std::string::npos);
  CHECK(st.out.find("unhealthy: ") != std::string::npos);
  CHECK(st.out.find("--health-check exited with 1: check ") != std::string::npos);
  CHECK(st.out.find("GPU 3 reports uncorrectable ECC errors") != std::string::npos);
  RunResult js = run_trun(
      {"status", "--json", "--rdzv-backend=c10d", "--rdzv-endpoint=" + ep, "--rdzv-id=" + run});
  const json j = json::parse(js.out, nullptr, false);
  REQUIRE(j.is_object());
  CHECK(j["outside"] == 1);
  REQUIRE(j["nodes"].size() == 1);
  CHECK(j["nodes"][0]["state"] == "outside");
  CHECK(j["nodes"][0]["agent_state"] == "unhealthy");
  REQUIRE(a.wait(60s));
  CHECK(a.exit_code() == 0);
}

TEST_CASE(
    "an agent restarted during its node's exclusion sits out what is left of it, and the next "
    "exclusion is twice as long",
    "[agent][health][exclusion]") {
  TempDir d;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "reexclude-" + std::to_string(::getpid());
  auto agent = [&](const std::string& name, bool host, std::vector<std::string> work) {
    return exclusion_agent(ep, run, host,
                           {"--crash-loop-limit=0", "--exclude-after=1", "--exclude-cooldown=5"},
                           d / (name + ".jsonl"), work);
  };
  auto a = agent("a", true, {"sleep", "25", "exit", "0"});
  std::this_thread::sleep_for(500ms);  // the store host first
  auto c = agent("c", false, {"sleep", "25", "exit", "0"});
  auto b = agent("b", false, {"sleep", "0.5", "exit", "1"});
  REQUIRE(wait_until([&] { return b->err().find("(exclusion 1)") != std::string::npos; }, 60s));
  b->signal(SIGKILL);  // the agent itself dies while its node sits out
  REQUIRE(b->wait(10s));
  auto b2 = agent("b2", false, {"sleep", "0.5", "exit", "1"});
  REQUIRE(wait_until([&] { return b2->err().find("is still excluded for") != std::string::npos; },
                     30s));
  RunResult st = run_trun_until(
      {"status", "--rdzv-backend=c10d", "--rdzv-endpoint=" + ep, "--rdzv-id=" + run}, "excluded: ");
  // It sits out the rest, then joins, fails again and is excluded for twice as long.
  REQUIRE(wait_until([&] { return b2->err().find("(exclusion 2)") != std::string::npos; }, 60s));
  const std::string berr = b2->err();
  INFO("b:\n" << b->err() << "\nb2:\n" << berr << "\nstatus:\n" << st.out << st.err);
  CHECK(berr.find("(exclusion 1, kept in the job's store): its workers failed 1 times") !=
        std::string::npos);
  CHECK(berr.find("is excluded for 10 s (exclusion 2)") != std::string::npos);
  CHECK(st.out.find("1 outside (unhealthy or excluded)") != std::string::npos);
  CHECK(st.out.find("excluded: ") != std::string::npos);
  b2->signal(SIGTERM);
  REQUIRE(b2->wait(30s));  // its event log is complete
  auto ev = records_named(d / "b2.jsonl", "trun.agent.excluded");
  REQUIRE(ev.size() >= 2);
  CHECK(ev[0]["metadata"]["restored"] == true);
  CHECK(ev[0]["metadata"]["cooldown_s"].get<double>() <= 5.0);
  CHECK(ev[1]["metadata"]["cooldown_s"] == 10.0);
  REQUIRE(a->wait(90s));
  REQUIRE(c->wait(30s));
  CHECK(a->exit_code() == 0);
  CHECK(c->exit_code() == 0);
}
