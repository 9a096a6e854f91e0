// Worker output: --tee prefixes whole lines, --redirects writes files only, --local-ranks-filter,
// the log directory layout. Black-box through the trun binary.
#include <algorithm>
#include <catch2/catch.hpp>
#include <regex>

#include "tests/launcher/process_util.h"

using namespace trun::testing;

namespace {

std::string single_dir_in(const std::string& path) {
  std::string found;
  for (const auto& e : std::filesystem::directory_iterator(path)) found = e.path().string();
  return found;
}

}  // namespace

TEST_CASE("tee prefixes every line and never splits one, even under a flood", "[logs]") {
  TempDir d;
  const int kLines = 20000;
  auto r = run_trun({"--nproc-per-node=3", "--tee=3", "--log-dir", d.path(), "--rdzv-id", "flood",
                     test_worker(), "flood", std::to_string(kLines), "partial", "no newline"});
  REQUIRE(r.exit_code == 0);
  std::vector<int> next(3, 0);
  std::vector<bool> partial_seen(3, false);
  const std::regex line_re(
      R"(\[default([0-2])\]:rank ([0-2]) line ([0-9]+) abcdefghijklmnopqrstuvwxyz0123456789)");
  const std::regex partial_re(R"(\[default([0-2])\]:no newline)");
  int bad = 0;
  for (const auto& l : lines_of(r.out)) {
    std::smatch m;
    if (std::regex_match(l, m, line_re)) {
      int prefix_rank = std::stoi(m[1]);
      int rank = std::stoi(m[2]);
      int n = std::stoi(m[3]);
      if (prefix_rank != rank || n != next[rank]) ++bad;
      next[rank] = n + 1;
    } else if (std::regex_match(l, m, partial_re)) {
      partial_seen[std::stoi(m[1])] = true;
    } else {
      ++bad;
      if (bad < 5) FAIL_CHECK("unexpected console line: " << l);
    }
  }
  CHECK(bad == 0);
  for (int rank = 0; rank < 3; ++rank) {
    CHECK(next[rank] == kLines);
    CHECK(partial_seen[rank]);
  }
  // The log files hold the raw bytes, without prefixes.
  std::string log = read_file(d.path() + "/flood/attempt_0/1/stdout.log");
  CHECK(log.rfind("rank 1 line 0 abc", 0) == 0);
  CHECK(log.size() > static_cast<size_t>(kLines) * 40);
  CHECK(log.substr(log.size() - 10) == "no newline");
}

TEST_CASE("redirects send streams to files only, laid out per attempt and rank", "[logs]") {
  TempDir d;
  auto r = run_trun({"--standalone", "--nproc-per-node=2", "--redirects=3", "--log-dir", d.path(),
                     "--max-restarts=1", test_worker(), "print", "to stdout", "eprint", "to stderr",
                     "on-attempt", "0", "sleep", "0.2", "on-attempt", "0", "exit", "1"});
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("to stdout") == std::string::npos);
  CHECK(r.err.find("to stderr") == std::string::npos);
  std::string run_dir = single_dir_in(d.path());  // DIR/<generated run id>
  REQUIRE_FALSE(run_dir.empty());
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (int lr = 0; lr < 2; ++lr) {
      std::string base = run_dir + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(lr);
      CHECK(read_file(base + "/stdout.log") == "to stdout\n");
      CHECK(read_file(base + "/stderr.log") == "to stderr\n");
    }
  }
}

TEST_CASE("per-rank redirect maps and stream selection", "[logs]") {
  TempDir d;
  auto r = run_trun({"--nproc-per-node=2", "--redirects=0:1", "--tee=1:2", "--log-dir", d.path(),
                     test_worker(), "print", "out-line", "eprint", "err-line"});
  REQUIRE(r.exit_code == 0);
  // rank 0: stdout to file only, stderr to console as is; rank 1: stdout to console as is,
  // stderr to file and console with a prefix.
  CHECK(read_file(d.path() + "/none/attempt_0/0/stdout.log") == "out-line\n");
  CHECK_FALSE(file_exists(d.path() + "/none/attempt_0/0/stderr.log"));
  CHECK(read_file(d.path() + "/none/attempt_0/1/stderr.log") == "err-line\n");
  CHECK(r.out == "out-line\n");
  CHECK(r.err.find("[default1]:err-line\n") != std::string::npos);
  bool unprefixed =
      r.err.find("\nerr-line\n") != std::string::npos || r.err.rfind("err-line\n", 0) == 0;
  CHECK(unprefixed);  // rank 0's line, straight from the worker
}

TEST_CASE("the local ranks filter shows only the chosen ranks, files keep everything", "[logs]") {
  TempDir d;
  auto r = run_trun({"--nproc-per-node=3", "--tee=3", "--local-ranks-filter=1", "--log-dir",
                     d.path(), test_worker(), "print", "hello"});
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == "[default1]:hello\n");
  for (int lr = 0; lr < 3; ++lr) {
    CHECK(read_file(d.path() + "/none/attempt_0/" + std::to_string(lr) + "/stdout.log") ==
          "hello\n");
  }
  // Without --tee, hidden ranks' output is discarded and shown ranks print as they are.
  auto plain =
      run_trun({"--nproc-per-node=3", "--local-ranks-filter=0,2", test_worker(), "print", "plain"});
  REQUIRE(plain.exit_code == 0);
  CHECK(plain.out == "plain\nplain\n");
}

TEST_CASE("duplicate filters copy matching tee'd lines of every rank into one file", "[logs]") {
  TempDir d;
  auto r =
      run_trun({"--nproc-per-node=2", "--tee=3", "--log-dir", d.path(),
                "--duplicate-stdout-filters=loss,acc,,top1", "--duplicate_stderr_filters=bad",
                test_worker(), "print", "step 1 loss 0.5", "print", "noise", "print",
                "acc,top1 0.9", "eprint", "bad thing", "eprint", "fine", "partial", "last loss"});
  REQUIRE(r.exit_code == 0);
  const std::string dir = d.path() + "/none/attempt_0/";
  auto sorted_lines = [](const std::string& text) {
    auto l = lines_of(text);
    std::sort(l.begin(), l.end());
    return l;
  };
  // ",," is a comma inside a filter; a last line without a newline counts too.
  CHECK(sorted_lines(read_file(dir + "filtered_stdout.log")) ==
        std::vector<std::string>{"[default0]:acc,top1 0.9", "[default0]:last loss",
                                 "[default0]:step 1 loss 0.5", "[default1]:acc,top1 0.9",
                                 "[default1]:last loss", "[default1]:step 1 loss 0.5"});
  CHECK(sorted_lines(read_file(dir + "filtered_stderr.log")) ==
        std::vector<std::string>{"[default0]:bad thing", "[default1]:bad thing"});
  // The console and the per-rank files are unchanged.
  CHECK(r.out.find("[default1]:noise\n") != std::string::npos);
  CHECK(read_file(dir + "0/stdout.log") == "step 1 loss 0.5\nnoise\nacc,top1 0.9\nlast loss");
  // Without --tee there is nothing to copy, and trun says so.
  auto untee = run_trun({"--nproc-per-node=1", "--log-dir", d.path(), "--rdzv-id", "plain",
                         "--duplicate-stdout-filters=x", test_worker(), "print", "x"});
  REQUIRE(untee.exit_code == 0);
  CHECK(untee.err.find("--duplicate-stdout-filters has no effect") != std::string::npos);
}

TEST_CASE("the line prefix template is configurable", "[logs]") {
  auto r =
      run_trun({"--nproc-per-node=2", "--tee=1", "--role", "actor", test_worker(), "on-rank", "1",
                "print", "x"},
               {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${role_name}-r${rank}-l${local_rank}"}});
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == "[actor-r1-l1]:x\n");
}

TEST_CASE("without --log-dir, error files live in a temporary directory removed at exit",
          "[logs]") {
  TempDir d;
  auto r = run_trun({"--nproc-per-node=1", test_worker(), "env", d.path()}, {{"TMPDIR", d.path()}});
  REQUIRE(r.exit_code == 0);
  // Only the env dump is left in TMPDIR: trun's own directory is gone.
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(d.path())) {
    ++entries;
    CHECK(e.path().filename().string().rfind("env_", 0) == 0);
  }
  CHECK(entries == 1);
}
