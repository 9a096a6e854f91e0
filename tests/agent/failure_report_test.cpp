// agent/failure_report.h: error files, the root cause, torchrun's summary.
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>

#include "agent/failure_report.h"
#include "tests/launcher/process_util.h"

using namespace trun::agent;
using trun::testing::read_file;
using trun::testing::TempDir;

namespace {
void write(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}
}  // namespace

TEST_CASE("error files in @record's format give the traceback and timestamp", "[failures]") {
  TempDir d;
  std::string path = d / "error.json";
  write(path, R"({"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack":
      "Traceback (most recent call last):\n  x\nValueError: boom\n", "timestamp": "1700000000"}}})");
  auto f = read_failure(1, 5, 1234, 1, path, 0);
  CHECK(f.error_file == path);
  CHECK(f.timestamp == 1700000000);
  CHECK(f.message.find("Traceback (most recent call last):") == 0);
  CHECK(f.rank == 5);
  CHECK(f.local_rank == 1);
}

TEST_CASE("the older error file format with a string message is read too", "[failures]") {
  TempDir d;
  std::string path = d / "error.json";
  write(path, R"({"message": "plain message", "timestamp": 42})");
  auto f = read_failure(0, 0, 1, 2, path, 0);
  CHECK(f.message == "plain message");
  CHECK(f.timestamp == 42);
}

TEST_CASE("a missing or malformed error file is reported, not thrown", "[failures]") {
  TempDir d;
  auto none = read_failure(0, 0, 77, -11, d / "missing.json", 0);
  CHECK(none.error_file == "<N/A>");
  CHECK(none.message == "Signal 11 (SIGSEGV) received by PID 77");
  auto code = read_failure(0, 0, 77, 3, "", 0);
  CHECK(code.message.find("pytorch.org/docs/stable/elastic/errors.html") != std::string::npos);
  std::string bad = d / "bad.json";
  write(bad, "{not json");
  auto malformed = read_failure(0, 0, 77, 3, bad, 0);
  CHECK(malformed.message.find("not in @record's JSON format") != std::string::npos);
}

TEST_CASE("the root cause is the earliest timestamp, then the first observed", "[failures]") {
  std::vector<WorkerFailure> fs(3);
  fs[0].timestamp = 100;
  fs[0].sequence = 0;
  fs[1].timestamp = 50;
  fs[1].sequence = 1;
  fs[2].timestamp = 50;
  fs[2].sequence = 2;
  CHECK(root_cause_index(fs) == 1);
  fs[2].sequence = 0;
  fs[1].sequence = 1;
  CHECK(root_cause_index(fs) == 2);
}

TEST_CASE("the summary looks like torchrun's", "[failures]") {
  std::vector<WorkerFailure> fs(2);
  fs[0].rank = 3;
  fs[0].local_rank = 1;
  fs[0].pid = 10;
  fs[0].exitcode = -9;
  fs[0].error_file = "<N/A>";
  fs[0].message = "Signal 9 (SIGKILL) received by PID 10";
  fs[0].timestamp = 200;
  fs[1].rank = 2;
  fs[1].local_rank = 0;
  fs[1].pid = 11;
  fs[1].exitcode = 1;
  fs[1].error_file = "/x/error.json";
  fs[1].message = "Traceback:\nline2";
  fs[1].timestamp = 100;
  std::string s = format_summary("train.py", fs, "hostA");
  CHECK(s.find("train.py FAILED\n") != std::string::npos);
  CHECK(s.find("Failures:\n[1]:\n") != std::string::npos);
  CHECK(s.find("  rank      : 3 (local_rank: 1)\n  exitcode  : -9 (SIGKILL) (pid: 10)") !=
        std::string::npos);
  auto root = s.find("Root Cause (first observed failure):\n[0]:\n");
  REQUIRE(root != std::string::npos);
  CHECK(s.find("  host      : hostA", root) != std::string::npos);
  CHECK(s.find("  traceback : Traceback:\n  line2", root) != std::string::npos);
  CHECK(s.find("  error_file: /x/error.json", root) != std::string::npos);
}

TEST_CASE("the root cause is written in @record's format with the exit code", "[failures]") {
  TempDir d;
  std::string src = d / "error.json";
  write(src,
        R"({"message": {"message": "E", "extraInfo": {"py_callstack": "tb", "timestamp": "9"}}})");
  auto f = read_failure(0, 0, 1, 7, src, 0);
  std::string out = d / "out.json";
  REQUIRE(write_root_cause(out, f));
  auto j = nlohmann::json::parse(read_file(out));
  CHECK(j["message"]["message"] == "E");
  CHECK(j["message"]["errorCode"] == 7);
  CHECK(j["message"]["extraInfo"]["py_callstack"] == "tb");

  auto sig = read_failure(0, 0, 55, -6, "", 0);
  REQUIRE(write_root_cause(out, sig));
  j = nlohmann::json::parse(read_file(out));
  CHECK(j["message"]["message"] == "Signal 6 (SIGABRT) received by PID 55");
  CHECK(j["message"]["errorCode"] == -6);
}

TEST_CASE("the line for other nodes names the root cause's rank, host, code and message",
          "[failures]") {
  CHECK(failure_line({}, "h1") == "worker failure on h1");
  WorkerFailure later = read_failure(0, 4, 10, 1, "", 1);
  WorkerFailure first = read_failure(2, 6, 11, -9, "", 0);
  first.message = "boom\nsecond line " + std::string(300, 'x');
  const std::string line = failure_line({later, first}, "h1");
  CHECK(line.rfind("rank 6 (local_rank 2) on h1 exited with SIGKILL: boom second line xx", 0) == 0);
  CHECK(line.find('\n') == std::string::npos);
  CHECK(line.size() < 260);  // the message is cut at 200 characters
}
