// The failure summary of a real libtrun_worker program under the trun binary: it leads with the
// exception's type and message, and its frames name functions and source lines.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "tests/launcher/process_util.h"

using trun::testing::run_trun;

namespace {
std::string train_mlp() { return std::string(TRUN_BINARY_DIR) + "/examples/train_mlp"; }
}  // namespace

TEST_CASE("a failed C++ worker's summary starts with its exception, then symbolised frames",
          "[agent][failures]") {
  auto r = run_trun({"--standalone", "--nproc-per-node=2", "--redirects", "3", train_mlp(),
                     "--ckpt-dir", "/proc/nope"},
                    {}, std::chrono::seconds(120));
  REQUIRE(r.finished);
  CHECK(r.exit_code == 1);
  INFO(r.err);
  // "  traceback : <type>: <what>" is the first line of the root cause's trace. (Rank 1 may fail
  // too, in a collective with the rank that failed, and be listed first, among the others.)
  const size_t root = r.err.find("Root Cause");
  REQUIRE(root != std::string::npos);
  const std::string root_part = r.err.substr(root);
  std::smatch m;
  REQUIRE(std::regex_search(root_part, m, std::regex("traceback : ([^\n]*)\n")));
  const std::string first = m[1];
  CHECK(first.find("CheckpointError") != std::string::npos);
  CHECK(first.find("/proc/nope") != std::string::npos);
  // The frames after it: main, by name, at its source line (the build keeps line tables), as a
  // frame of its own or as the function a frame's call was inlined into ("inlined into main").
  CHECK(std::regex_search(root_part,
                          std::regex(" main at [^\n]*examples/train_mlp/main\\.cpp:[0-9]+")));
}

TEST_CASE("a Python worker failing at once gets a hint naming the interpreter and PYTHON_EXEC",
          "[agent][failures]") {
  trun::testing::TempDir d;
  // A "python3" first on PATH that fails as an interpreter without torch does.
  const std::string bin = d / "bin";
  std::filesystem::create_directories(bin);
  {
    std::ofstream shim(bin + "/python3");
    shim << "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n";
  }
  std::filesystem::permissions(bin + "/python3", std::filesystem::perms::owner_all);
  const std::string script = d / "train.py";
  std::ofstream(script) << "import torch\n";
  const char* path = std::getenv("PATH");
  auto r = run_trun({"--standalone", "--nproc-per-node=1", script},
                    {{"PATH", bin + ":" + (path ? path : "/usr/bin:/bin")}},
                    std::chrono::seconds(60), {"PYTHON_EXEC"});
  REQUIRE(r.finished);
  CHECK(r.exit_code == 1);
  INFO(r.err);
  CHECK_THAT(r.err, Catch::Contains("  hint      : the worker exited with 1 "));
  CHECK_THAT(r.err, Catch::Contains("it ran the Python interpreter 'python3' (" + bin +
                                    "/python3 on PATH)"));
  CHECK_THAT(r.err, Catch::Contains("set PYTHON_EXEC to one that has them"));

  // With PYTHON_EXEC naming it, the hint names that path; a worker that ran longer gets none.
  auto named = run_trun({"--standalone", "--nproc-per-node=1", script},
                        {{"PYTHON_EXEC", bin + "/python3"}}, std::chrono::seconds(60));
  CHECK_THAT(named.err, Catch::Contains("it ran the Python interpreter '" + bin + "/python3'."));
  {
    std::ofstream slow(bin + "/python3");
    slow << "#!/bin/sh\nsleep 1.5\nexit 1\n";
  }
  auto later = run_trun({"--standalone", "--nproc-per-node=1", script},
                        {{"PYTHON_EXEC", bin + "/python3"}}, std::chrono::seconds(60));
  CHECK(later.exit_code == 1);
  CHECK_THAT(later.err, Catch::Contains("Root Cause"));
  CHECK_THAT(later.err, !Catch::Contains("hint"));
}
