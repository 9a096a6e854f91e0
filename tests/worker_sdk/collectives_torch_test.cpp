// libtrun_worker's collectives against PyTorch 1.13's gloo on the same inputs: torchrun runs
// tests/worker_sdk/torch_collectives.py with 3 ranks, trun's harness runs pg_worker's "dump"
// scenario (the same input formulas) on the shared-memory path and on the Gloo path, and every
// result file must be byte for byte the same: reduce and allreduce with SUM, PRODUCT, MIN, MAX,
// BAND, BOR, BXOR on int32, int64, int8, uint8 (and the non-bitwise ones on float32), gather,
// scatter, all_to_all_single with uneven splits, and a send/recv ring.
//
// no_sanitize: runs /usr/bin/torchrun (Python with torch).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/skip.h"
#include "tests/torchrun_tools.h"
#include "tests/worker_sdk/job.h"

using namespace trun::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// rank/name -> contents, for every file under dir.
std::map<std::string, std::string> results_in(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = read_all(e.path());
  return out;
}

void run_trun(const std::string& dir, bool gloo_only) {
  fs::create_directories(dir);
  trun::worker::test::JobSpec spec;
  spec.argv = {trun::worker::test::worker_binary(), "dump", dir};
  spec.nodes = gloo_only ? std::vector<int>{1, 1, 1} : std::vector<int>{3};
  spec.no_placement = gloo_only;
  spec.run_id = trun::worker::test::unique_run_id("torch-dump");
  trun::worker::test::Job job;
  job.start(spec);
  auto results = job.wait(120s);
  INFO(job.describe(results));
  for (const auto& r : results) {
    REQUIRE(r.exited);
    REQUIRE(r.exit_code == 0);
  }
}

}  // namespace

TEST_CASE("reduce, gather, scatter, all_to_all, send/recv and the bitwise ops match PyTorch gloo",
          "[worker_sdk][torch][collectives]") {
  if (auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TempDir tmp;
  const std::string torch_dir = tmp / "torch";
  fs::create_directories(torch_dir);
  {
    std::vector<std::string> argv{kPython,
                                  kTorchrun,
                                  "--nproc_per_node=3",
                                  "--nnodes=1",
                                  "--master_addr=127.0.0.1",
                                  "--master_port=" + std::to_string(free_port()),
                                  "--monitor_interval=0.2",
                                  "--redirects",
                                  "9:1",
                                  "--tee",
                                  "9:1",
                                  "--max_restarts=0",
                                  TRUN_SOURCE_DIR "/tests/worker_sdk/torch_collectives.py",
                                  torch_dir};
    Child c(argv, {{"TMPDIR", tmp.path()}, {"OMP_NUM_THREADS", "1"}},
            {"TORCHELASTIC_ERROR_FILE", "LOGLEVEL", "PET_MASTER_PORT"});
    const bool finished = c.wait(std::chrono::seconds(240));
    if (!finished) {
      c.signal(SIGTERM);
      c.wait(std::chrono::seconds(30));
    }
    INFO("torchrun stdout:\n" << c.out() << "\nstderr:\n" << c.err());
    REQUIRE(finished);
    REQUIRE(c.exit_code() == 0);
  }
  const auto want = results_in(torch_dir);
  // 3 ranks x 5 dtypes x (allreduce per op, sendrecv, scatter, all_to_all_v) plus reduce and
  // gather on their roots: a wrong count means the script did not run as written.
  REQUIRE(want.size() == 3 * (4 * (7 + 3) + (4 + 3)) + (4 * 7 + 4) + 5);
  for (bool gloo_only : {false, true}) {
    DYNAMIC_SECTION((gloo_only ? "gloo only" : "shared memory")) {
      const std::string dir = tmp / (gloo_only ? "trun-gloo" : "trun-shm");
      run_trun(dir, gloo_only);
      const auto got = results_in(dir);
      std::set<std::string> names;
      for (const auto& [k, v] : want) names.insert(k);
      for (const auto& [k, v] : got) names.insert(k);
      for (const auto& name : names) {
        INFO(name);
        REQUIRE(got.count(name) == 1);
        REQUIRE(want.count(name) == 1);
        CHECK(got.at(name) == want.at(name));
      }
    }
  }
}
