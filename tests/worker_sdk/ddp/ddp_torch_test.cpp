// trun's DDP communication hooks against PyTorch 1.13's on the same inputs: ddp_worker's
// hook_dump mode (2 ranks, trun's CPU backend) and ddp_hooks_torch.py (2 ranks, PyTorch DDP on
// gloo) reduce the same gradients without a hook, with the fp16 hook and with the bf16 hook;
// the results must be bit-identical (2 ranks: a sum of two values is the same in any order).
//
// no_sanitize: runs /usr/bin/python3 with torch.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/launcher/process_util.h"
#include "tests/skip.h"
#include "tests/worker_sdk/run_job.h"

using namespace trun::worker;
using namespace std::chrono_literals;

namespace {

const char* kPython = "/usr/bin/python3";

std::vector<char> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("ddp: fp16/bf16 compression hooks give PyTorch 1.13's results bit for bit", "[ddp]") {
  {
    trun::testing::Child probe({kPython, "-c", "import torch.distributed"});
    if (!probe.wait(std::chrono::seconds(60)) || probe.exit_code() != 0)
      TRUN_SKIP(kPython << " cannot import torch.distributed: " << probe.err(), kSetup);
  }
  trun::testing::TempDir tmp;
  const std::string dir = tmp.path();
  const size_t n = 4099;  // odd: the vector loops' tails too
  {
    test::JobSpec spec;
    spec.argv = {std::string(TRUN_BINARY_DIR) + "/tests/worker_sdk/ddp_worker", "hook_dump",
                 dir + "/trun", std::to_string(n)};
    spec.nodes = {2};
    spec.run_id = test::unique_run_id("ddp-torch");
    test::run_job_ok(spec, 120s);
  }
  {
    const std::string script =
        std::string(TRUN_SOURCE_DIR) + "/tests/worker_sdk/ddp/ddp_hooks_torch.py";
    const std::map<std::string, std::string> env = {{"GLOO_SOCKET_IFNAME", "lo"},
                                                    {"OMP_NUM_THREADS", "1"}};
    trun::testing::Child r0(
        {kPython, script, "0", "2", dir + "/init", dir + "/torch", std::to_string(n)}, env);
    trun::testing::Child r1(
        {kPython, script, "1", "2", dir + "/init", dir + "/torch", std::to_string(n)}, env);
    const bool done0 = r0.wait(std::chrono::seconds(180)),
               done1 = r1.wait(std::chrono::seconds(60));
    INFO("rank 0 stderr:\n" << r0.err() << "\nrank 1 stderr:\n" << r1.err());
    REQUIRE(done0);
    REQUIRE(done1);
    REQUIRE(r0.exit_code() == 0);
    REQUIRE(r1.exit_code() == 0);
  }
  for (const char* kind : {"none", "fp16", "bf16"}) {
    INFO("hook " << kind);
    const auto mine = read_all(dir + "/trun." + kind);
    const auto theirs = read_all(dir + "/torch." + kind);
    REQUIRE(mine.size() == n * sizeof(float));
    REQUIRE(theirs.size() == mine.size());
    size_t differ = 0, first = n;
    for (size_t k = 0; k < n; ++k)
      if (std::memcmp(&mine[k * 4], &theirs[k * 4], 4) != 0) {
        if (first == n) first = k;
        ++differ;
      }
    if (differ) {
      float a, b;
      std::memcpy(&a, &mine[first * 4], 4);
      std::memcpy(&b, &theirs[first * 4], 4);
      INFO(differ << " of " << n << " differ; first at " << first << ": trun " << a << ", torch "
                  << b);
      REQUIRE(differ == 0);
    }
  }
}
