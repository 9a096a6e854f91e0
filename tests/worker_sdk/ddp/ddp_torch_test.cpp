// trun's DDP communication hooks against PyTorch 1.13's on the same inputs: ddp_worker's
// hook_dump mode (2 ranks, trun's CPU backend) and ddp_hooks_torch.py (2 ranks, PyTorch DDP on
// gloo) reduce the same gradients without a hook, with the fp16 hook and with the bf16 hook;
// the results must be bit-identical (2 ranks: a sum of two values is the same in any order).
// And join_iteration() against PyTorch's Join context with DDP: the same MLP, data and uneven
// schedule (ddp_worker's join mode vs ddp_join_torch.py) end with the same parameters.
//
// no_sanitize: runs /usr/bin/python3 with torch.

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "examples/train_mlp/mlp.h"
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

TEST_CASE("ddp: join equals PyTorch 1.13's Join with DDP on gloo (uneven inputs)", "[ddp]") {
  {
    trun::testing::Child probe({kPython, "-c", "import torch.distributed.algorithms.join"});
    if (!probe.wait(std::chrono::seconds(60)) || probe.exit_code() != 0)
      TRUN_SKIP(kPython << " cannot import torch.distributed.algorithms.join: " << probe.err(),
                kSetup);
  }
  trun::testing::TempDir tmp;
  const std::string dir = tmp.path();
  const std::string counts = "0,2,5";  // one rank without data, one with fewer batches
  const int world = 3;
  {
    test::JobSpec spec;
    spec.argv = {std::string(TRUN_BINARY_DIR) + "/tests/worker_sdk/ddp_worker", "join", counts, "4",
                 dir + "/trun"};
    spec.nodes = {world};
    spec.run_id = test::unique_run_id("ddp-join-torch");
    test::run_job_ok(spec, 120s);
  }
  {
    // The initial parameters ddp_worker broadcasts (rank 0's: Mlp::init(100)).
    trun::examples::Mlp init({10, 32, 32, 5});
    init.init(100);
    std::ofstream f(dir + "/init_params", std::ios::binary);
    for (size_t i = 0; i < init.num_params(); ++i)
      f.write(reinterpret_cast<const char*>(init.param(i)),
              static_cast<std::streamsize>(init.param_numel(i) * sizeof(float)));
  }
  {
    const std::string script =
        std::string(TRUN_SOURCE_DIR) + "/tests/worker_sdk/ddp/ddp_join_torch.py";
    const std::map<std::string, std::string> env = {{"GLOO_SOCKET_IFNAME", "lo"},
                                                    {"OMP_NUM_THREADS", "1"}};
    std::vector<std::unique_ptr<trun::testing::Child>> ranks;
    for (int r = 0; r < world; ++r)
      ranks.push_back(std::make_unique<trun::testing::Child>(
          std::vector<std::string>{kPython, script, std::to_string(r), std::to_string(world),
                                   dir + "/init", dir + "/init_params", counts, "4",
                                   dir + "/torch"},
          env));
    for (int r = 0; r < world; ++r) {
      const bool done = ranks[r]->wait(std::chrono::seconds(180));
      INFO("rank " << r << " stderr:\n" << ranks[r]->err());
      REQUIRE(done);
      REQUIRE(ranks[r]->exit_code() == 0);
    }
  }
  auto floats = [](const std::vector<char>& bytes) {
    std::vector<float> v(bytes.size() / sizeof(float));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
    return v;
  };
  const auto mine = floats(read_all(dir + "/trun"));
  const auto theirs = floats(read_all(dir + "/torch"));
  REQUIRE(mine.size() == 1573);
  REQUIRE(theirs.size() == mine.size());
  double worst = 0;
  for (size_t i = 0; i < mine.size(); ++i)
    worst = std::max(worst, std::fabs(double(mine[i]) - theirs[i]) / (1e-3 + std::fabs(theirs[i])));
  INFO("worst relative difference " << worst);
  // Float summation order differs (PyTorch's kernels vs the MLP's loops).
  REQUIRE(worst < 1e-4);
}
