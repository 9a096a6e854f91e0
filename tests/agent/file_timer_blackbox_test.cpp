// The trun binary with TORCHELASTIC_ENABLE_FILE_TIMER=1 and a worker that speaks the watchdog
// protocol by hand (a shell script, no torch, so that this runs under the sanitizers): bad
// requests are refused and reported, the agent goes on, and an expired timer kills the worker
// and restarts the group. PyTorch's own client: file_timer_torch_test.cpp.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/launcher/process_util.h"

using trun::testing::run_trun;
using trun::testing::TempDir;

namespace {

// Attempt 0 writes bad requests of four kinds, then arms a timer (SIGKILL, 1-2 s from now) for
// itself and sleeps as the same process; attempt 1 succeeds.
constexpr const char* kWorker = R"SH(#!/bin/sh
f="$TORCHELASTIC_TIMER_FILE"
test -p "$f" || { echo "no FIFO at '$f'" >&2; exit 5; }
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  printf 'not json\n' > "$f"
  head -c 100000 /dev/zero | tr '\0' x > "$f"
  printf '\n' > "$f"
  printf '{"version": 1, "pid": 1, "scope_id": "s", "expiration_time": 0, "signal": 9}\n' > "$f"
  printf '{"version": 1, "pid": %d, "scope_id": "s", "expiration_time": 0, "signal": 19}\n' $$ > "$f"
  d=$(( $(date +%s) + 2 ))
  printf '{"version": 1, "pid": %d, "scope_id": "stuck", "expiration_time": %d, "signal": 9}\n' $$ $d > "$f"
  exec sleep 60
fi
echo "attempt $TORCHELASTIC_RESTART_COUNT ok"
)SH";

std::string write_worker(const TempDir& dir) {
  const std::string path = dir / "worker.sh";
  std::ofstream(path) << kWorker;
  ::chmod(path.c_str(), 0700);
  return path;
}

}  // namespace

TEST_CASE("trun's watchdog FIFO refuses bad requests, then kills an expired worker and restarts",
          "[agent][file_timer]") {
  TempDir dir;
  const std::string fifo = dir / "timer.fifo";
  auto r = run_trun({"--standalone", "--nproc-per-node=1", "--max-restarts=1", write_worker(dir)},
                    {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", fifo}},
                    std::chrono::seconds(120));
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("attempt 1 ok"));
  for (const char* kind : {"(not a JSON object)", "(oversized)", "(not a worker's pid)",
                           "(a signal that is not allowed)"}) {
    CHECK_THAT(r.err, Catch::Contains(std::string("ignored a request ") + kind));
  }
  CHECK_THAT(r.err, Catch::Contains("watchdog timer 'stuck' of worker pid"));
  CHECK_THAT(r.err, Catch::Contains("sent SIGKILL"));
  CHECK_FALSE(std::filesystem::exists(std::filesystem::symlink_status(fifo)));
}

TEST_CASE("trun refuses a watchdog path that is a symbolic link, and starts no worker",
          "[agent][file_timer]") {
  TempDir dir;
  const std::string target = dir / "target";
  std::ofstream(target) << "keep\n";
  const std::string link = dir / "link";
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  const std::string marker = dir / "started";
  auto r = run_trun({"--standalone", "--nproc-per-node=1", "/bin/touch", marker},
                    {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", link}},
                    std::chrono::seconds(60));
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.err, Catch::Contains("is a symbolic link"));
  CHECK_FALSE(trun::testing::file_exists(marker));
  CHECK(std::filesystem::is_symlink(link));
  CHECK(trun::testing::read_file(target) == "keep\n");
}
