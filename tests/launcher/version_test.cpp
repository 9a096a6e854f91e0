// `trun --version` and trun::worker::version(): the version, the commit the binary was built from
// and the features compiled in, the same text from the launcher and the SDK.
#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

#include "tests/launcher/process_util.h"
#include "trun/config.h"
#include "trun/worker.h"

namespace {

using trun::testing::lines_of;
using trun::testing::run_trun;

// The first line `cmd` prints, "" when it fails.
std::string first_line_of(const std::string& cmd) {
  std::string out;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char buf[256];
    if (fgets(buf, sizeof buf, p)) out = buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

}  // namespace

TEST_CASE("trun --version names the version, the commit and the compiled-in features",
          "[cli][version]") {
  const auto r = run_trun({"--version"});
  REQUIRE(r.finished);
  REQUIRE(r.exit_code == 0);
  const auto lines = lines_of(r.out);
  REQUIRE(lines.size() == 4);
  CHECK(lines[0] == std::string("trun ") + TRUN_VERSION + " (torchrun-compatible)");

  // A commit of the checkout trun was built from (written at every build), with -modified when
  // tracked files differed. Not necessarily HEAD: commits may have landed since the last build.
  REQUIRE(lines[1].rfind("commit: ", 0) == 0);
  std::string commit = lines[1].substr(8);
  const std::string git = std::string("git -C '") + TRUN_SOURCE_DIR + "' ";
  if (first_line_of(git + "rev-parse --short=12 HEAD 2>/dev/null").empty()) {
    CHECK(commit == "unknown");  // not a git checkout and no TRUN_GIT_COMMIT given
  } else {
    const std::string suffix = "-modified";
    if (commit.size() > suffix.size() &&
        commit.compare(commit.size() - suffix.size(), suffix.size(), suffix) == 0)
      commit.resize(commit.size() - suffix.size());
    REQUIRE_THAT(commit, Catch::Matches("[0-9a-f]{12}"));
    INFO("commit " << commit);
    CHECK(first_line_of(git + "cat-file -t " + commit + " 2>/dev/null") == "commit");
    CHECK(first_line_of(git + "merge-base --is-ancestor " + commit + " HEAD && echo yes") == "yes");
  }

  CHECK_THAT(lines[2], Catch::StartsWith("features: rendezvous c10d etcd static; "));
  CHECK_THAT(lines[2], Catch::Contains(TRUN_HAVE_NCCL ? "NCCL yes" : "NCCL no"));
  CHECK_THAT(lines[2], Catch::Matches(".*; libtorch adapter (yes|no)"));
  CHECK_THAT(lines[3], Catch::StartsWith("build: "));
  CHECK(r.err.empty());
}

TEST_CASE("libtrun_worker's version() is what trun --version prints", "[cli][version]") {
  const auto r = run_trun({"--version"});
  REQUIRE(r.exit_code == 0);
  CHECK(trun::worker::version() == r.out);
}
