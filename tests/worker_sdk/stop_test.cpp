// Stopping on request (trun/stop.h): the signal names, the handlers' idempotence with real
// signals, and StopAgreement across the ranks of a job (stop_worker is the program).

#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <trun/stop.h>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/worker_sdk/job.h"
#include "tests/worker_sdk/signal_pending.h"

using namespace trun::worker;
using namespace std::chrono_literals;
using trun::testing::Child;

namespace {

std::string stop_worker() { return test::build_file("tests/worker_sdk/stop_worker"); }

const std::vector<std::string> kLauncherVars = {"TORCHELASTIC_SIGNALS_TO_HANDLE",
                                                "SLURM_JOB_ID",
                                                "RANK",
                                                "WORLD_SIZE",
                                                "MASTER_ADDR",
                                                "MASTER_PORT"};

std::string watched(const std::map<std::string, std::string>& env,
                    std::vector<std::string> args = {}) {
  std::vector<std::string> argv = {stop_worker(), "signals"};
  argv.insert(argv.end(), args.begin(), args.end());
  Child c(argv, env, kLauncherVars);
  REQUIRE(c.wait(30s));
  INFO(c.err());
  REQUIRE(c.exit_code() == 0);
  return c.out();
}

}  // namespace

TEST_CASE("stop signal names are read as torchrun writes them", "[stop]") {
  CHECK(parse_stop_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT") ==
        std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(parse_stop_signals(" sigterm , USR1,SIGUSR1,,SIGTERM ") ==
        std::vector<int>{SIGTERM, SIGUSR1});
  std::vector<std::string> unknown;
  CHECK(parse_stop_signals("SIGBOGUS,SIGUSR2,KILL9", &unknown) == std::vector<int>{SIGUSR2});
  CHECK(unknown == std::vector<std::string>{"SIGBOGUS", "KILL9"});
  CHECK(parse_stop_signals("").empty());
  CHECK(default_stop_signals(false) == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(default_stop_signals(true) == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1});
  CHECK(stop_signal_name(SIGUSR1) == "SIGUSR1");
  CHECK(stop_signal_name(SIGPWR) == "SIGPWR");
  CHECK(stop_signal_name(63) == "signal 63");
}

TEST_CASE("the stop signals watched come from TORCHELASTIC_SIGNALS_TO_HANDLE, else the defaults",
          "[stop]") {
  CHECK(watched({{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1"}}) == "SIGTERM SIGUSR1\n");
  CHECK(watched({}) == "SIGTERM SIGINT SIGHUP SIGQUIT\n");
  CHECK(watched({{"SLURM_JOB_ID", "4242"}}) == "SIGTERM SIGINT SIGHUP SIGQUIT SIGUSR1\n");
  // Ignored on purpose (nohup): it stays ignored.
  CHECK(watched({}, {"--ignore-hup"}) == "SIGTERM SIGINT SIGQUIT\n");
  Child c({stop_worker(), "signals"}, {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGBOGUS"}},
          kLauncherVars);
  REQUIRE(c.wait(30s));
  CHECK(c.out() == "SIGTERM\n");
  CHECK_THAT(c.err(), Catch::Contains("unknown signal 'SIGBOGUS': not watched"));
}

TEST_CASE("a program that never asks about stop signals still dies by SIGTERM", "[stop]") {
  Child c({stop_worker(), "never-asks"}, {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM"}},
          kLauncherVars);
  REQUIRE(c.wait(30s));
  CHECK(c.signaled());
  CHECK(c.exit_code() == 128 + SIGTERM);
}

TEST_CASE("a stop signal while init() waits for the store ends the program by that signal",
          "[stop]") {
  // Rank 1 of 2 with nobody hosting the store on MASTER_PORT: init() waits (up to 60 s here,
  // 10 min by default) and says so after 5 s; the signal then must not wait for a stop_requested()
  // that the program cannot reach.
  const std::string port = std::to_string(trun::testing::free_port());
  Child c({stop_worker(), "init-waits"},
          {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM"},
           {"RANK", "1"},
           {"WORLD_SIZE", "2"},
           {"MASTER_ADDR", "127.0.0.1"},
           {"MASTER_PORT", port}},
          kLauncherVars);
  REQUIRE(trun::testing::wait_until(
      [&] { return c.err().find("waiting 5 s so far for the store") != std::string::npos; }, 30s));
  c.signal(SIGTERM);
  REQUIRE(c.wait(30s));
  INFO(c.err());
  CHECK(c.signaled());
  CHECK(c.exit_code() == 128 + SIGTERM);
}

TEST_CASE("exit_by_stop_signal ends a program that handles the signal by that signal", "[stop]") {
  Child c({stop_worker(), "exit-by-signal"}, {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM"}},
          kLauncherVars);
  REQUIRE(c.wait(30s));
  INFO(c.err());
  CHECK(c.signaled());
  CHECK(c.exit_code() == 128 + SIGTERM);
}

TEST_CASE("stop signals raised twice and of two kinds count once, with one callback run",
          "[stop]") {
  Child c({stop_worker(), "twice"}, {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1"}},
          kLauncherVars);
  REQUIRE(c.wait(30s));
  INFO(c.err());
  REQUIRE(c.exit_code() == 0);
  CHECK(c.out() == "first=SIGTERM callbacks=1 late=1\n");
}

TEST_CASE("a stop signal sent twice from outside leaves the worker running, asked to stop once",
          "[stop]") {
  trun::testing::TempDir d;
  Child c({stop_worker(), "wait", d / "go"}, {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM"}},
          kLauncherVars);
  REQUIRE(trun::testing::wait_until([&] { return c.out() == "ready\n"; }, 30s));
  for (int i = 0; i < 2; ++i) {
    c.signal(SIGTERM);
    // Delivered (no longer pending) before the next one, so that the two do not merge.
    REQUIRE(
        trun::testing::wait_until([&] { return !test::signal_pending(c.pid(), SIGTERM); }, 30s));
  }
  REQUIRE(c.running());
  { std::ofstream(d / "go") << "go\n"; }
  REQUIRE(c.wait(30s));
  INFO(c.err());
  REQUIRE(c.exit_code() == 0);
  CHECK(c.out() == "ready\nstopped=SIGTERM callbacks=1\n");
}

TEST_CASE("StopAgreement stops every rank at the step where one rank got the signal", "[stop]") {
  struct Case {
    int every;
    int signal_step;
    int expected;
  };
  for (Case k : {Case{1, 5, 5}, Case{4, 5, 8}, Case{4, 8, 8}}) {
    INFO("check_every " << k.every << ", signal at step " << k.signal_step);
    test::Job job;
    test::JobSpec spec;
    spec.argv = {stop_worker(),          "agree", "40", "2", std::to_string(k.signal_step),
                 std::to_string(k.every)};
    spec.nodes = {3};
    spec.run_id = test::unique_run_id("stop-agree");
    spec.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGUSR1";
    job.start(spec);
    auto results = job.wait(120s);
    INFO(job.describe(results));
    for (const auto& r : results) {
      REQUIRE(r.exited);
      CHECK(r.exit_code == 75);
      CHECK_THAT(r.output, Catch::Contains("rank " + std::to_string(r.rank) + " stopped at step " +
                                           std::to_string(k.expected) + " (SIGUSR1)"));
    }
    CHECK(test::shm_segments(spec.run_id).empty());
  }
}

TEST_CASE("StopAgreement without a stop signal never stops", "[stop]") {
  test::Job job;
  test::JobSpec spec;
  spec.argv = {stop_worker(), "agree", "30", "-1", "0", "1"};
  spec.nodes = {2};
  spec.run_id = test::unique_run_id("stop-none");
  spec.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGUSR1";
  job.start(spec);
  auto results = job.wait(120s);
  INFO(job.describe(results));
  for (const auto& r : results) {
    REQUIRE(r.exited);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.output, Catch::Contains("ran 30 steps"));
  }
}

// Not run by default: prints the cost of one should_stop (docs/checkpoints.md).
TEST_CASE("StopAgreement cost per call on the CPU backend", "[.][bench][stop]") {
  for (int world : {2, 3, 4}) {
    test::Job job;
    test::JobSpec spec;
    spec.argv = {stop_worker(), "bench", "20000"};
    spec.nodes = {world};
    spec.run_id = test::unique_run_id("stop-bench");
    job.start(spec);
    auto results = job.wait(300s);
    INFO(job.describe(results));
    for (const auto& r : results) REQUIRE(r.exit_code == 0);
    WARN(results[0].output);
  }
}
