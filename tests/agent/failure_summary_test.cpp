// The failure summary of a real libtrun_worker program under the trun binary: it leads with the
// exception's type and message, and its frames name functions and source lines.
#include <catch2/catch.hpp>
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
