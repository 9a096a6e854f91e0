// Multi-process DDP tests: ddp_worker ranks launched with the launcher's environment against a
// store in this process (tests/worker_sdk/job.h), checked against single-process training.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <trun/sampler.h>

#include "examples/train_mlp/mlp.h"
#include "tests/worker_sdk/run_job.h"

using namespace trun::worker;
using trun::examples::Mlp;
using trun::examples::Sgd;
using namespace std::chrono_literals;

namespace {

std::string ddp_worker() { return std::string(TRUN_BINARY_DIR) + "/tests/worker_sdk/ddp_worker"; }

// Gradient buffers for a model, as the MLP's backward and Sgd::step take them.
struct Grads {
  std::vector<std::vector<float>> g;
  std::vector<float*> grads;
  std::vector<const float*> cgrads;
  explicit Grads(const Mlp& model) : g(model.num_params()) {
    for (size_t i = 0; i < model.num_params(); ++i) {
      g[i].assign(model.param_numel(i), 0.0f);
      grads.push_back(g[i].data());
      cgrads.push_back(g[i].data());
    }
  }
  void zero() {
    for (auto& v : g) std::fill(v.begin(), v.end(), 0.0f);
  }
};

// What ddp_worker's "train" mode must produce: one process, the concatenated batch.
std::vector<float> reference(int world, int steps, size_t batch, int accum) {
  Mlp model({10, 32, 32, 5});
  model.init(100);  // rank 0's initialization
  SamplerOptions so;
  so.seed = 3;
  DistributedSampler sampler(512, 0, 1, so);
  Sgd sgd(0.05f, 0.5f);
  Grads g(model);
  std::vector<float> x, t;
  for (int s = 0; s < steps; ++s) {
    g.zero();
    for (int m = 0; m < accum; ++m) {
      auto idx = sampler.next_batch(batch * static_cast<size_t>(world));
      model.make_batch(idx, x, t);
      model.forward(x.data(), t.data(), idx.size());
      model.backward(g.grads, nullptr, 1.0f / static_cast<float>(accum));
    }
    sgd.step(model, g.cgrads);
  }
  std::vector<float> out;
  for (size_t i = 0; i < model.num_params(); ++i)
    out.insert(out.end(), model.param(i), model.param(i) + model.param_numel(i));
  return out;
}

// What ddp_worker's "join" mode must produce: the same MLP trained in one process on the union
// of the steps' batches (rank r's step s exists while s < counts[r]), plain SGD, 2 rounds.
// by_initial: each step's gradient scaled by (ranks with input) / world, as when dividing by
// the initial world size.
std::vector<float> join_reference(const std::vector<int>& counts, size_t batch, bool by_initial) {
  Mlp model({10, 32, 32, 5});
  model.init(100);
  Sgd sgd(0.05f, 0.0f);
  const int world = static_cast<int>(counts.size());
  const int most = *std::max_element(counts.begin(), counts.end());
  Grads g(model);
  std::vector<float> x, t;
  for (int round = 0; round < 2; ++round) {
    for (int s = 0; s < most; ++s) {
      std::vector<uint64_t> idx;
      int active = 0;
      for (int r = 0; r < world; ++r) {
        if (s >= counts[r]) continue;
        ++active;
        for (size_t k = 0; k < batch; ++k)
          idx.push_back((static_cast<uint64_t>(round * most + s) * world + r) * batch + k);
      }
      g.zero();
      model.make_batch(idx, x, t);
      model.forward(x.data(), t.data(), idx.size());
      model.backward(g.grads, nullptr, by_initial ? float(active) / float(world) : 1.0f);
      sgd.step(model, g.cgrads);
    }
  }
  std::vector<float> out;
  for (size_t i = 0; i < model.num_params(); ++i)
    out.insert(out.end(), model.param(i), model.param(i) + model.param_numel(i));
  return out;
}

double worst_relative(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::fabs(double(got[i]) - want[i]) / (1e-3 + std::fabs(want[i])));
  return worst;
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

TEST_CASE("ddp: static_graph and compression hooks train like the plain reducer", "[ddp]") {
  // "static": tensors registered in a shuffled order, so that gradients arrive in
  // non-registration order; the worker checks the buckets follow that order after step 1 and
  // not before. fp16/bf16: the gradients are rounded to 16 bits, hence the wider tolerance
  // (their unit roundoff, 2^-11 and 2^-8, times a few steps' accumulated drift).
  struct Case {
    int world;
    double cap, first_cap;
    int accum;
    std::string flags;
    double tolerance;
  };
  const Case cases[] = {{3, 0.002, 0.001, 2, "static", 1e-4},
                        {2, 25, 1, 1, "static", 1e-4},
                        {2, 0.002, 0.001, 1, "fp16", 5e-3},
                        {3, 0.002, 0.001, 1, "bf16,static", 4e-2}};
  char tmpl[] = "/tmp/trun-ddp-test-XXXXXX";
  REQUIRE(::mkdtemp(tmpl));
  const std::string dir = tmpl;
  for (const auto& c : cases) {
    const int steps = 6;
    const size_t batch = 8;
    const std::string out = dir + "/params";
    INFO("world " << c.world << ", caps " << c.cap << "/" << c.first_cap << " MiB, accumulation "
                  << c.accum << ", " << c.flags);
    auto results =
        run(c.world, {ddp_worker(), "train", std::to_string(steps), std::to_string(batch),
                      std::to_string(c.cap), std::to_string(c.first_cap), std::to_string(c.accum),
                      out, c.flags});
    REQUIRE(results[0].output.find("PASS train") != std::string::npos);
    const double worst =
        worst_relative(read_floats(out), reference(c.world, steps, batch, c.accum));
    INFO("worst relative difference " << worst);
    REQUIRE(worst < c.tolerance);
    ::unlink(out.c_str());
  }
  ::rmdir(dir.c_str());
}

TEST_CASE("ddp: join with uneven inputs equals training on the union of the data", "[ddp]") {
  // Ranks with 0, 1 and many fewer batches than the others (rank 0 among them, so the final
  // model must come from another rank), equal counts, nobody with data; with static_graph,
  // the fp16 hook, and PyTorch's divide-by-initial-world-size.
  struct Case {
    std::vector<int> counts;
    std::string flags;
    double tolerance;
  };
  const Case cases[] = {
      {{0, 1, 6}, "", 1e-4},         {{5, 0}, "", 1e-4},        {{6, 6, 2, 5}, "", 1e-4},
      {{3, 3, 3}, "", 1e-4},         {{0, 0}, "", 0},           {{0, 2, 5}, "static", 1e-4},
      {{3, 0, 1}, "userhook", 1e-4}, {{4, 1, 0}, "fp16", 5e-3}, {{1, 4}, "initial", 1e-4}};
  char tmpl[] = "/tmp/trun-ddp-join-XXXXXX";
  REQUIRE(::mkdtemp(tmpl));
  const std::string dir = tmpl;
  for (const auto& c : cases) {
    std::string counts;
    for (int n : c.counts) counts += (counts.empty() ? "" : ",") + std::to_string(n);
    const size_t batch = 4;
    const std::string out = dir + "/params";
    INFO("counts " << counts << " " << c.flags);
    auto results = run(static_cast<int>(c.counts.size()),
                       {ddp_worker(), "join", counts, std::to_string(batch), out, c.flags});
    for (auto& r : results) REQUIRE(r.output.find("PASS join") != std::string::npos);
    const auto got = read_floats(out);
    const double worst = worst_relative(got, join_reference(c.counts, batch, c.flags == "initial"));
    INFO("worst relative difference " << worst);
    REQUIRE(worst <= c.tolerance);
    if (*std::max_element(c.counts.begin(), c.counts.end()) > 0) {
      Mlp init({10, 32, 32, 5});
      init.init(100);
      REQUIRE(std::fabs(got[0] - init.param(0)[0]) > 1e-6);
    }
    ::unlink(out.c_str());
  }
  ::rmdir(dir.c_str());
}

TEST_CASE(
    "ddp: communication hooks: fp16/bf16 within rounding of the average, user hook per bucket",
    "[ddp]") {
  for (int world : {2, 3}) {
    auto results = run(world, {ddp_worker(), "hooks"});
    for (auto& r : results) REQUIRE(r.output.find("PASS hooks") != std::string::npos);
  }
}

TEST_CASE("ddp: static_graph rebuilds buckets in rank 0's arrival order on every rank", "[ddp]") {
  for (int world : {2, 3}) {
    auto results = run(world, {ddp_worker(), "static_order"});
    for (auto& r : results) REQUIRE(r.output.find("PASS static_order") != std::string::npos);
  }
}

TEST_CASE("ddp: join: a peer that dies while others shadow is an error, not a hang", "[ddp]") {
  test::Job job;
  test::JobSpec spec;
  spec.argv = {ddp_worker(), "join_peer_dies"};
  spec.nodes = {2};
  spec.run_id = test::unique_run_id("ddp-join-dies");
  job.start(spec);
  auto results = job.wait(120s);
  INFO(job.describe(results));
  REQUIRE(results[1].exited);
  REQUIRE(results[1].exit_code == 7);
  REQUIRE(results[0].exited);
  REQUIRE(results[0].exit_code == 0);
  REQUIRE(results[0].output.find("PASS join_peer_dies") != std::string::npos);
}

TEST_CASE("ddp: PowerSGD hook: exact at full rank, converges with error feedback at rank 1",
          "[ddp]") {
  for (int world : {2, 3}) {
    auto results = run(world, {ddp_worker(), "powersgd"});
    for (auto& r : results) REQUIRE(r.output.find("PASS powersgd") != std::string::npos);
  }
}

TEST_CASE("ddp: join with throw_on_early_termination fails every rank in the same step", "[ddp]") {
  for (std::string counts : {"3,1", "2,0,4"}) {
    INFO("counts " << counts);
    auto results = run(static_cast<int>(std::count(counts.begin(), counts.end(), ',') + 1),
                       {ddp_worker(), "join", counts, "4", "/nonexistent/unused", "throw"});
    for (auto& r : results) REQUIRE(r.output.find("PASS join") != std::string::npos);
  }
}
