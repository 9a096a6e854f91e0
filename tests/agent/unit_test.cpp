// The agent's pure parts: decisions, error-file parsing, root cause, summary, line prefixes.
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "agent/console.h"
#include "agent/decisions.h"
#include "agent/failure_report.h"
#include "agent/log_mux.h"
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

TEST_CASE("a failing worker stops a running group; exits during a stop change nothing",
          "[decisions]") {
  CHECK(on_worker_exit(GroupPhase::kRunning, 1, 3) == ExitAction::kStopGroupFailed);
  CHECK(on_worker_exit(GroupPhase::kRunning, -9, 3) == ExitAction::kStopGroupFailed);
  CHECK(on_worker_exit(GroupPhase::kRunning, 0, 2) == ExitAction::kKeepRunning);
  CHECK(on_worker_exit(GroupPhase::kRunning, 0, 0) == ExitAction::kGroupSucceeded);
  CHECK(on_worker_exit(GroupPhase::kStopping, 1, 2) == ExitAction::kKeepRunning);
}

TEST_CASE("after a stop: restart while restarts remain, else the right exit code", "[decisions]") {
  CHECK(decide_after_stop(GroupOutcome::kFailed, 0, 0, 2).restart);
  CHECK(decide_after_stop(GroupOutcome::kFailed, 0, 1, 2).restart);
  auto last = decide_after_stop(GroupOutcome::kFailed, 0, 2, 2);
  CHECK_FALSE(last.restart);
  CHECK(last.exit_code == 1);
  CHECK_FALSE(decide_after_stop(GroupOutcome::kFailed, 0, 0, 0).restart);
  auto sig = decide_after_stop(GroupOutcome::kSignaled, 15, 0, 5);
  CHECK_FALSE(sig.restart);
  CHECK(sig.exit_code == 143);
  CHECK(decide_after_stop(GroupOutcome::kSucceeded, 0, 0, 5).exit_code == 0);
}

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

TEST_CASE("line prefixes follow torchrun's template", "[logs]") {
  CHECK(line_prefix("", "default", 5, 1) == "[default1]:");
  CHECK(line_prefix("${role_name}/${rank}/${local_rank}", "w", 5, 1) == "[w/5/1]:");
  CHECK(line_prefix("${unknown}", "w", 5, 1) == "[${unknown}]:");
}

TEST_CASE("a console writer to a stalled pipe drops whole lines, counts them, and never waits",
          "[console]") {
  int p[2];
  REQUIRE(pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0);  // O_NONBLOCK: for this test's reads only
  fcntl(p[1], F_SETFL, 0);                         // the writer's end blocks, like a terminal
  fcntl(p[1], F_SETPIPE_SZ, 4096);
  const int kTotal = 10000;
  auto line = [](int k) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "line %05d\n", k);
    return std::string(buf);
  };
  std::string received;
  auto read_pipe = [&] {
    char buf[65536];
    for (ssize_t n; (n = read(p[0], buf, sizeof buf)) > 0;) received.append(buf, size_t(n));
  };
  uint64_t dropped = 0;
  {
    ConsoleWriter w(p[1], 64 * 1024);
    REQUIRE(w.threaded());
    // One batch larger than the buffer (only its leading whole lines fit), then single lines:
    // every call returns although nobody reads the pipe.
    std::string batch;
    for (int k = 0; k < 8000; ++k) batch += line(k);
    w.write(batch);
    for (int k = 8000; k < kTotal; ++k) w.write(line(k));
    dropped = w.dropped_lines();
    CHECK(dropped > 0);
    CHECK_FALSE(w.has_room(1024));
    CHECK(trun::testing::wait_until([&] { return w.stalled(std::chrono::milliseconds(20)); },
                                    std::chrono::seconds(10)));
    // Now the reader comes back: what was kept, and a note about the gap, arrive.
    bool flushed = false;
    for (int i = 0; i < 2000 && !flushed; ++i) {
      read_pipe();
      flushed = w.flush(std::chrono::milliseconds(5));
    }
    read_pipe();
    REQUIRE(flushed);
  }
  close(p[0]);
  close(p[1]);
  const std::regex line_re(R"(line ([0-9]{5}))");
  const std::regex note_re(R"(trun: dropped ([0-9]+) console lines here: .*)");
  int last = -1, kept = 0, bad = 0;
  uint64_t noted = 0;
  for (const auto& l : trun::testing::lines_of(received)) {
    std::smatch m;
    if (std::regex_match(l, m, line_re) && std::stoi(m[1]) > last) {
      last = std::stoi(m[1]);
      ++kept;
    } else if (std::regex_match(l, m, note_re)) {
      noted += std::stoull(m[1]);
    } else {
      ++bad;
    }
  }
  CHECK(bad == 0);
  CHECK(received.back() == '\n');
  CHECK(static_cast<uint64_t>(kept) + dropped == kTotal);
  CHECK(noted == dropped);
  CHECK(kept >= 64 * 1024 / 11 - 1);  // the buffer was used before anything was dropped
}

TEST_CASE("a console writer to a regular file writes at once and drops nothing", "[console]") {
  TempDir d;
  const std::string path = d / "console";
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  std::string expected;
  {
    ConsoleWriter w(fd, 16);  // far smaller than what is written: files are not buffered
    CHECK_FALSE(w.threaded());
    for (int k = 0; k < 100; ++k) {
      std::string l = "regular " + std::to_string(k) + "\n";
      w.write(l);
      expected += l;
    }
    CHECK(read_file(path) == expected);  // before any flush
    CHECK(w.dropped_lines() == 0);
    CHECK(w.has_room(1 << 30));
    CHECK_FALSE(w.stalled(std::chrono::milliseconds(0)));
    CHECK(w.flush(std::chrono::milliseconds(0)));
  }
  close(fd);
}
