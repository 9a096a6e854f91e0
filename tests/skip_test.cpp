// tests/skip.h: a kSetup skip fails in strict mode (CI=true, TRUN_STRICT_SKIPS=1) and is listed in
// $TRUN_SKIP_LOG otherwise; a kEnvironment skip never fails and is always listed. The skipping
// cases are hidden ([.]: ctest does not run them); the visible cases run this executable again
// on one of them, in a process of its own as under ctest, with the environment under test.

#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/launcher/process_util.h"
#include "tests/skip.h"

using namespace trun::testing;

namespace {

const char* const kSetupCase = "skip_test: a setup skip";
const char* const kEnvironmentCase = "skip_test: an environment skip";
const char* const kReportCase = "skip_test: a setup skip reported by a helper";

std::string self() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

struct Run {
  int exit_code = -1;
  std::string out;
  std::vector<std::string> log;  // the lines of TRUN_SKIP_LOG
};

// Runs the hidden case `name` with `env` on top of an environment without CI and
// TRUN_STRICT_SKIPS (scripts/test.sh exports TRUN_STRICT_SKIPS=1).
Run run_case(const std::string& name, const std::map<std::string, std::string>& env) {
  TempDir d;
  std::map<std::string, std::string> full = env;
  full["TRUN_SKIP_LOG"] = d / "skips";
  // The compact reporter keeps each message on one line (the console one wraps them).
  Child c({self(), "-r", "compact", name}, full, {"CI", "TRUN_STRICT_SKIPS", "TRUN_SKIP_LOG"});
  REQUIRE(c.wait(std::chrono::seconds(30)));
  Run r;
  r.exit_code = c.exit_code();
  r.out = c.out() + c.err();
  r.log = lines_of(read_file(d / "skips"));
  return r;
}

bool helper_that_skips() {
  TRUN_SKIP_REPORT("the helper's reason", kSetup);
  return false;
}

}  // namespace

TEST_CASE("skip_test: a setup skip", "[.][skip_demo]") {
  TRUN_SKIP("etcd is missing " << 42, kSetup);
  FAIL("went on after the skip");
}

TEST_CASE("skip_test: an environment skip", "[.][skip_demo]") {
  TRUN_SKIP("no GPU " << 7, kEnvironment);
  FAIL("went on after the skip");
}

TEST_CASE("skip_test: a setup skip reported by a helper", "[.][skip_demo]") {
  if (!helper_that_skips()) return;
  FAIL("the helper did not report a skip");
}

TEST_CASE("a setup skip passes, listed in TRUN_SKIP_LOG, outside strict mode", "[skip]") {
  for (const char* name : {kSetupCase, kReportCase}) {
    for (const auto& env : std::vector<std::map<std::string, std::string>>{
             {}, {{"CI", "false"}}, {{"TRUN_STRICT_SKIPS", "0"}}}) {
      auto r = run_case(name, env);
      INFO(name << ", " << env.size() << " variable(s) set:\n" << r.out);
      CHECK(r.exit_code == 0);
      CHECK(r.out.find("skipped: ") != std::string::npos);
      REQUIRE(r.log.size() == 1);
      const std::string reason =
          name == std::string(kSetupCase) ? "etcd is missing 42" : "the helper's reason";
      CHECK(r.log[0] == std::string(name) + " (skip_test): " + reason + " [setup]");
    }
  }
}

TEST_CASE("a setup skip fails with its reason under CI=true or TRUN_STRICT_SKIPS=1", "[skip]") {
  for (const char* name : {kSetupCase, kReportCase}) {
    for (const auto& env : std::vector<std::map<std::string, std::string>>{
             {{"CI", "true"}}, {{"TRUN_STRICT_SKIPS", "1"}}}) {
      auto r = run_case(name, env);
      INFO(name << ", " << env.begin()->first << ":\n" << r.out);
      CHECK(r.exit_code != 0);
      CHECK(r.out.find(name == std::string(kSetupCase)
                           ? "etcd is missing 42"
                           : "the helper's reason") != std::string::npos);
      CHECK(r.out.find("strict mode") != std::string::npos);
      CHECK(r.out.find("went on after the skip") == std::string::npos);
      CHECK(r.log.empty());  // a failure, not a skip
    }
  }
}

TEST_CASE("an environment skip never fails and is always listed", "[skip]") {
  for (const auto& env : std::vector<std::map<std::string, std::string>>{
           {}, {{"CI", "true"}}, {{"TRUN_STRICT_SKIPS", "1"}}}) {
    auto r = run_case(kEnvironmentCase, env);
    INFO(env.size() << " variable(s) set:\n" << r.out);
    CHECK(r.exit_code == 0);
    CHECK(r.out.find("went on after the skip") == std::string::npos);
    REQUIRE(r.log.size() == 1);
    CHECK(r.log[0] == std::string(kEnvironmentCase) + " (skip_test): no GPU 7 [environment]");
  }
}

TEST_CASE("skip lines from several processes append to one log", "[skip]") {
  TempDir d;
  std::vector<std::unique_ptr<Child>> children;
  for (int i = 0; i < 8; ++i) {
    children.push_back(
        std::make_unique<Child>(std::vector<std::string>{self(), kEnvironmentCase},
                                std::map<std::string, std::string>{{"TRUN_SKIP_LOG", d / "skips"}},
                                std::vector<std::string>{"CI", "TRUN_STRICT_SKIPS"}));
  }
  for (auto& c : children) {
    REQUIRE(c->wait(std::chrono::seconds(30)));
    CHECK(c->exit_code() == 0);
  }
  auto lines = lines_of(read_file(d / "skips"));
  REQUIRE(lines.size() == 8);
  for (const auto& l : lines) CHECK(l.find("no GPU 7 [environment]") != std::string::npos);
}
