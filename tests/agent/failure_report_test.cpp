// agent/failure_report.h: error files, the root cause, torchrun's summary.
#include <catch2/catch.hpp>
#include <filesystem>
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

TEST_CASE("a summary of a multi-node job names the earliest failure across nodes as root cause",
          "[failures][root-cause]") {
  std::vector<WorkerFailure> fs(1);
  fs[0].rank = 0;
  fs[0].local_rank = 0;
  fs[0].pid = 10;
  fs[0].exitcode = 1;
  fs[0].error_file = "<N/A>";
  fs[0].message = "Connection closed by peer";
  fs[0].timestamp = 100;
  // Another node's worker failed first: this node's failure is listed, not the root cause.
  RootCause remote{"nodeB", "rank 1 (local_rank 0) on hostB exited with SIGKILL", 1733470000123,
                   false};
  std::string s = format_summary("train.py", fs, "hostA", &remote);
  INFO(s);
  CHECK(s.find("Failures:\n[0]:\n") != std::string::npos);
  CHECK(s.find("<NO_OTHER_FAILURES>") == std::string::npos);
  auto root = s.find("Root Cause (earliest failure across nodes):\n[0]:\n");
  REQUIRE(root != std::string::npos);
  CHECK(s.find("  node      : nodeB\n", root) != std::string::npos);
  CHECK(s.find("  failure   : rank 1 (local_rank 0) on hostB exited with SIGKILL", root) !=
        std::string::npos);
  CHECK(s.find("Connection closed by peer", root) == std::string::npos);
  CHECK(s.find(".123\n", root) != std::string::npos);  // the time to the millisecond
  // This node's own failure is the root cause: shown as before, under the new heading.
  RootCause local{"nodeA", "x", 5, true};
  std::string l = format_summary("train.py", fs, "hostA", &local);
  auto lroot = l.find("Root Cause (earliest failure across nodes):\n[0]:\n");
  REQUIRE(lroot != std::string::npos);
  CHECK(l.find("Connection closed by peer", lroot) != std::string::npos);
  CHECK(l.find("<NO_OTHER_FAILURES>") != std::string::npos);
  CHECK(root_cause_line(remote).rfind(
            "root cause: rank 1 (local_rank 0) on hostB exited with SIGKILL (node nodeB, at ", 0) ==
        0);
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

TEST_CASE("a C++ worker's error leads its traceback, and a Python traceback stays as it is",
          "[failures]") {
  TempDir d;
  std::string path = d / "error.json";
  // libtrun_worker before this change: the message, and a frame list that does not name it.
  write(path, R"({"message": {"message": "trun::worker::CheckpointError: cannot create /x",
      "extraInfo": {"py_callstack": "#0 main at main.cpp:12\n", "timestamp": "1700000000"}}})");
  auto f = read_failure(0, 0, 1, 1, path, 0);
  CHECK(f.message == "trun::worker::CheckpointError: cannot create /x\n#0 main at main.cpp:12\n");
  // A trace that names the error already (Python's ends with it) is shown unchanged.
  write(path, R"({"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack":
      "Traceback (most recent call last):\nValueError: boom\n", "timestamp": "1"}}})");
  CHECK(read_failure(0, 0, 1, 1, path, 0).message ==
        "Traceback (most recent call last):\nValueError: boom\n");
  // No trace at all: the message.
  write(path, R"({"message": {"message": "only this", "extraInfo": {"timestamp": "1"}}})");
  CHECK(read_failure(0, 0, 1, 1, path, 0).message == "only this");
}

TEST_CASE("an error file over 1 MiB is not read whole, and the summary says so", "[failures]") {
  TempDir d;
  std::string path = d / "error.json";
  {
    std::ofstream out(path);
    out << R"({"message": "x)";
    out << std::string(3 << 20, 'y');
    out << R"("})";
  }
  auto f = read_failure(0, 0, 1, 1, path, 0);
  CHECK(f.message.find("is " + std::to_string(std::filesystem::file_size(path)) +
                       " bytes, over the 1048576 that trun reads of one") != std::string::npos);
  CHECK(f.message.size() < 1000);
}

TEST_CASE("a Python worker failing in its first second gets a hint naming its interpreter",
          "[failures]") {
  TempDir d;
  // A "python3" on a PATH of two folders, the first without one.
  std::string bin = d / "bin";
  std::filesystem::create_directories(bin);
  write(bin + "/python3", "#!/bin/sh\nexit 1\n");
  std::filesystem::permissions(bin + "/python3", std::filesystem::perms::owner_all);
  const std::string path = std::string(d / "empty") + ":" + bin;

  std::string h = python_start_hint("python3", path, 0.2, 1, "ModuleNotFoundError: torch");
  CHECK(h.find("failed to import a module") != std::string::npos);
  CHECK(h.find("'python3' (" + bin + "/python3 on PATH)") != std::string::npos);
  CHECK(h.find("PYTHON_EXEC") != std::string::npos);
  // Without the import error in the message: the timing is what it says.
  h = python_start_hint("python3", path, 0.25, 1, "");
  CHECK(h.find("exited with 1 0.25 s after it started") != std::string::npos);
  CHECK(python_start_hint("python3", std::string(d / "empty"), 0.2, 1, "")
            .find("(not found on PATH)") != std::string::npos);
  // An interpreter given by path (PYTHON_EXEC) is named as given.
  CHECK(python_start_hint(bin + "/python3", "", 0.2, 1, "").find("'" + bin + "/python3'.") !=
        std::string::npos);
  // No hint after the first second, for a clean exit or a signal, or for a program that is not
  // Python.
  CHECK(python_start_hint("python3", path, 1.5, 1, "").empty());
  CHECK(python_start_hint("python3", path, 0.2, 0, "").empty());
  CHECK(python_start_hint("python3", path, 0.2, -9, "").empty());
  CHECK(python_start_hint("", path, 0.2, 1, "").empty());
}
