// The error file: written by real worker processes that die of an uncaught exception or a
// fatal signal, in the JSON PyTorch's @record writes (and torchrun reads).

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <regex>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include <trun/error_file.h>

#include "tests/worker_sdk/error_file_helpers.h"

using namespace trun::worker::test;

namespace {

void check_shape(const nlohmann::json& j) {
  REQUIRE(j.contains("message"));
  REQUIRE(j["message"].is_object());
  REQUIRE(j["message"]["message"].is_string());
  REQUIRE(j["message"]["extraInfo"]["py_callstack"].is_string());
  REQUIRE(j["message"]["extraInfo"]["timestamp"].is_string());
  long long ts = std::stoll(j["message"]["extraInfo"]["timestamp"].get<std::string>());
  CHECK(std::llabs(ts - static_cast<long long>(std::time(nullptr))) < 600);
}

}  // namespace

TEST_CASE("an uncaught exception writes its type, message and stack to the error file",
          "[worker_sdk][error_file]") {
  Tmp f;
  int status = run_worker("throw", f.path);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  auto j = nlohmann::json::parse(slurp(f.path));
  check_shape(j);
  CHECK(j["message"]["message"] == "std::runtime_error: model diverged at step 42");
  // The trace names the error first (a summary that shows only the trace still says what failed),
  // then frames symbolised by addr2line: functions at source lines (the tests keep line tables).
  const std::string trace = j["message"]["extraInfo"]["py_callstack"];
  CHECK(trace.rfind("std::runtime_error: model diverged at step 42\n#0 ", 0) == 0);
  CHECK(std::regex_search(trace, std::regex("\n#[0-9]+ [^\n]* at [^\n]*\\.cpp:[0-9]+")));
  CHECK(trace.find("main") != std::string::npos);
}

TEST_CASE("a fatal signal writes the signal and a stack, and the worker still dies of it",
          "[worker_sdk][error_file]") {
  Tmp f;
  int status = run_worker("segv", f.path);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
  auto j = nlohmann::json::parse(slurp(f.path));
  check_shape(j);
  CHECK(j["message"]["message"].get<std::string>().find("Fatal signal SIGSEGV (11)") == 0);
  CHECK(j["message"]["extraInfo"]["py_callstack"].get<std::string>().find("#0 0x") == 0);
}

TEST_CASE("write_error_file escapes JSON and record() rethrows", "[worker_sdk][error_file]") {
  Tmp f;
  REQUIRE(trun::worker::write_error_file(f.path, "quote \" backslash \\ newline \n tab \t \x01",
                                         "frame 1\nframe 2"));
  auto j = nlohmann::json::parse(slurp(f.path));
  check_shape(j);
  CHECK(j["message"]["message"] == "quote \" backslash \\ newline \n tab \t \x01");
  CHECK(j["message"]["extraInfo"]["py_callstack"] == "frame 1\nframe 2");
  CHECK_FALSE(trun::worker::write_error_file("/nonexistent-dir/x.json", "m", "s"));
  CHECK_FALSE(trun::worker::write_error_file("", "m", "s"));
}
