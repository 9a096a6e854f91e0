// Multi-process DDP tests: ddp_worker ranks launched with the launcher's environment against a
// store in this process (tests/worker_sdk/job.h), checked against single-process training.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "examples/train_mlp/mlp.h"
#include "tests/worker_sdk/run_job.h"
#include "trun/sampler.h"

using namespace trun::worker;
using trun::examples::Mlp;
using trun::examples::Sgd;
using namespace std::chrono_literals;

namespace {

std::string ddp_worker() { return std::string(TRUN_BINARY_DIR) + "/tests/worker_sdk/ddp_worker"; }

// What ddp_worker's "train" mode must produce: one process, the concatenated batch.
std::vector<float> reference(int world, int steps, size_t batch, int accum) {
  Mlp model({10, 32, 32, 5});
  model.init(100);  // rank 0's initialization
  SamplerOptions so;
  so.seed = 3;
  DistributedSampler sampler(512, 0, 1, so);
  Sgd sgd(0.05f, 0.5f);
  std::vector<std::vector<float>> g(model.num_params());
  std::vector<float*> grads;
  std::vector<const float*> cgrads;
  for (size_t i = 0; i < model.num_params(); ++i) {
    g[i].assign(model.param_numel(i), 0.0f);
    grads.push_back(g[i].data());
    cgrads.push_back(g[i].data());
  }
  std::vector<float> x, t;
  for (int s = 0; s < steps; ++s) {
    for (auto& v : g) std::fill(v.begin(), v.end(), 0.0f);
    for (int m = 0; m < accum; ++m) {
      auto idx = sampler.next_batch(batch * static_cast<size_t>(world));
      model.make_batch(idx, x, t);
      model.forward(x.data(), t.data(), idx.size());
      model.backward(grads, nullptr, 1.0f / static_cast<float>(accum));
    }
    sgd.step(model, cgrads);
  }
  std::vector<float> out;
  for (size_t i = 0; i < model.num_params(); ++i)
    out.insert(out.end(), model.param(i), model.param(i) + model.param_numel(i));
  return out;
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> v;
  float f;
  while (in.read(reinterpret_cast<char*>(&f), sizeof f)) v.push_back(f);
  return v;
}

std::vector<test::RankResult> run(int world, std::vector<std::string> argv,
                                  std::chrono::milliseconds timeout = 120s) {
  test::JobSpec spec;
  spec.argv = std::move(argv);
  spec.nodes = {world};
  spec.run_id = test::unique_run_id("ddp");
  return test::run_job_ok(spec, timeout);
}

}  // namespace

TEST_CASE("ddp: equals single-process training on the concatenated batch", "[ddp]") {
  struct Case {
    int world;
    double cap, first_cap;
    int accum;
  };
  // Caps in MiB: the model has 1573 floats (6.3 KB) in 6 tensors.
  const Case cases[] = {{1, 25, 1, 1},        {2, 25, 1, 1},          {2, 0.001, 0.0005, 1},
                        {3, 0.002, 0.001, 2}, {4, 0.0005, 0.0005, 1}, {4, 0.004, 1, 2}};
  char tmpl[] = "/tmp/trun-ddp-test-XXXXXX";
  REQUIRE(::mkdtemp(tmpl));
  const std::string dir = tmpl;
  for (const auto& c : cases) {
    const int steps = 6;
    const size_t batch = 8;
    const std::string out = dir + "/params";
    INFO("world " << c.world << ", bucket cap " << c.cap << " MiB, first " << c.first_cap
                  << " MiB, accumulation " << c.accum);
    auto results = run(c.world, {ddp_worker(), "train", std::to_string(steps),
                                 std::to_string(batch), std::to_string(c.cap),
                                 std::to_string(c.first_cap), std::to_string(c.accum), out});
    REQUIRE(results[0].output.find("PASS train") != std::string::npos);
    const auto got = read_floats(out);
    const auto want = reference(c.world, steps, batch, c.accum);
    REQUIRE(got.size() == want.size());
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, std::fabs(double(got[i]) - want[i]) / (1e-3 + std::fabs(want[i])));
    INFO("worst relative difference " << worst);
    REQUIRE(worst < 1e-4);
    // And it is not trivially equal to the initial weights: training moved them.
    Mlp init({10, 32, 32, 5});
    init.init(100);
    REQUIRE(std::fabs(got[0] - init.param(0)[0]) > 1e-6);
    ::unlink(out.c_str());
  }
  ::rmdir(dir.c_str());
}

TEST_CASE("ddp: buckets launch during backward (overlap)", "[ddp]") {
  for (int world : {2, 3}) {
    auto results = run(world, {ddp_worker(), "overlap"});
    for (auto& r : results) REQUIRE(r.output.find("PASS overlap") != std::string::npos);
  }
}

TEST_CASE("ddp: misuse is a clear error, unused parameters are handled on request", "[ddp]") {
  for (int world : {1, 2, 3}) {
    auto results = run(world, {ddp_worker(), "errors"});
    for (auto& r : results) REQUIRE(r.output.find("PASS errors") != std::string::npos);
  }
}
