// trun::libtorch (trun/torch.h) with real ranks: the DDP wrapper's behaviours (tests/torch/
// torch_worker.cpp), examples/libtorch_toy's digest against PyTorch's own DistributedDataParallel
// on gloo under torchrun (tests/torch/toy_ddp.py) at world sizes 1, 2 and 3, and the example
// killed under `trun --max-restarts=3` resuming from its checkpoint.
//
// no_sanitize (tests/torch/CMakeLists.txt): libtorch, and /usr/bin/python3 with torch.

#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/skip.h"
#include "tests/torchrun_tools.h"

#if TRUN_HAVE_TORCH
#include <nlohmann/json.hpp>

#include "tests/worker_sdk/job.h"
#include "tests/worker_sdk/run_job.h"
#endif

using namespace std::chrono_literals;
using namespace trun::testing;
namespace fs = std::filesystem;

#if !TRUN_HAVE_TORCH

TEST_CASE("trun::torch: built with libtorch", "[torch]") {
  TRUN_SKIP(
      "trun::torch is not built: find_package(Torch) failed or TRUN_WITH_TORCH=OFF "
      "(scripts/setup.sh installs libtorch-dev)",
      kSetup);
}

#else

namespace test = trun::worker::test;

namespace {

std::string torch_worker() { return std::string(TRUN_BINARY_DIR) + "/tests/torch/torch_worker"; }
std::string toy() { return std::string(TRUN_BINARY_DIR) + "/examples/libtorch_toy/libtorch_toy"; }

void run_mode(const std::string& mode, int world, std::vector<std::string> extra = {}) {
  test::JobSpec spec;
  spec.argv = {torch_worker(), mode};
  spec.argv.insert(spec.argv.end(), extra.begin(), extra.end());
  spec.nodes = {world};
  spec.run_id = test::unique_run_id("torch-" + mode);
  auto results = test::run_job_ok(spec, 120s);
  for (const auto& r : results) CHECK_THAT(r.output, Catch::Contains(mode + " OK"));
}

struct RankJson {
  double sum = 0, squares = 0;
  bool identical = false;
  uint64_t steps = 0, resumed_from = 0;
};

RankJson read_rank(const std::string& dir, int rank) {
  const std::string path = dir + "/rank" + std::to_string(rank) + ".json";
  std::ifstream in(path);
  INFO(path);
  REQUIRE(in.good());
  const auto j = nlohmann::json::parse(in);
  RankJson r;
  r.sum = j.at("digest").at(0).get<double>();
  r.squares = j.at("digest").at(1).get<double>();
  r.identical = j.at("replicas_identical").get<bool>();
  r.steps = j.at("steps").get<uint64_t>();
  if (j.contains("resumed_from")) r.resumed_from = j.at("resumed_from").get<uint64_t>();
  return r;
}

// The pid libtorch_toy's rank `rank` wrote to DIR/rank<R>.pid (0 if none yet).
pid_t toy_pid(const std::string& dir, int rank) {
  pid_t pid = 0;
  std::ifstream in(dir + "/rank" + std::to_string(rank) + ".pid");
  in >> pid;
  return pid;
}

// An uninterrupted libtorch_toy run of `steps` steps on 2 ranks, its results in `out`.
void run_toy_reference(const std::string& out, uint64_t steps) {
  fs::create_directories(out);
  test::JobSpec spec;
  spec.argv = {toy(), "--out", out, "--steps", std::to_string(steps)};
  spec.nodes = {2};
  spec.run_id = test::unique_run_id("toy-ref");
  test::run_job_ok(spec, 120s);
}

// tests/torch/toy_ddp.py under torchrun (static rendezvous on a free port) with `world` ranks.
void run_python_twin(int world, const std::string& out) {
  TempDir tmp;  // torchrun leaves a /tmp/torchelastic_* directory behind
  // Underscore flags (1.13); redirects/tee naming a rank that does not exist: see
  // tests/worker_sdk/torchrun_test.cpp.
  Child c({kPython, kTorchrun, "--nnodes=1", "--nproc_per_node=" + std::to_string(world),
           "--master_addr=127.0.0.1", "--master_port=" + std::to_string(free_port()),
           "--monitor_interval=0.2", "--redirects", "9:1", "--tee", "9:1", "--max_restarts=0",
           std::string(TRUN_SOURCE_DIR) + "/tests/torch/toy_ddp.py", "--out", out},
          {{"TMPDIR", tmp.path()}},
          {"TORCHELASTIC_ERROR_FILE", "LOGLEVEL", "OMP_NUM_THREADS", "PET_MASTER_PORT"});
  const bool finished = c.wait(240s);
  if (!finished) {
    c.signal(SIGTERM);
    c.wait(30s);
  }
  INFO("torchrun stdout:\n" << c.out() << "\nstderr:\n" << c.err());
  REQUIRE(finished);
  REQUIRE(c.exit_code() == 0);
}

}  // namespace

TEST_CASE("trun::libtorch: gradients are the average over the ranks, in bucket memory", "[torch]") {
  run_mode("average", 2);
}

TEST_CASE("trun::libtorch: no_sync accumulates locally and the next backward averages the sums",
          "[torch]") {
  run_mode("no_sync", 2);
}

TEST_CASE("trun::libtorch: find_unused_parameters zeroes and names the unused parameters",
          "[torch]") {
  run_mode("unused", 2);
}

TEST_CASE("trun::libtorch: an unused parameter without find_unused_parameters fails backward",
          "[torch]") {
  run_mode("unused_error", 2);
}

TEST_CASE("trun::libtorch: different models across ranks are refused naming the parameter",
          "[torch]") {
  run_mode("mismatch", 2);
}

TEST_CASE("trun::libtorch: buffers are broadcast from rank 0 before each forward", "[torch]") {
  run_mode("buffers", 2);
}

TEST_CASE("trun::libtorch: a checkpoint is readable by torch::load and restores in place",
          "[torch]") {
  TempDir d;
  run_mode("checkpoint", 2, {d / "ck"});
}

TEST_CASE("libtorch_toy: digest equals PyTorch DistributedDataParallel's at world sizes 1, 2, 3",
          "[torch][toy]") {
  if (const auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  for (int world : {1, 2, 3}) {
    INFO("world size " << world);
    TempDir d;
    fs::create_directories(d / "cpp");
    fs::create_directories(d / "py");
    test::JobSpec spec;
    spec.argv = {toy(), "--out", d / "cpp"};
    spec.nodes = {world};
    spec.run_id = test::unique_run_id("toy");
    test::run_job_ok(spec, 120s);
    run_python_twin(world, d / "py");
    const auto py0 = read_rank(d / "py", 0);
    for (int r = 0; r < world; ++r) {
      INFO("rank " << r);
      const auto cpp = read_rank(d / "cpp", r);
      const auto py = read_rank(d / "py", r);
      CHECK(cpp.identical);
      CHECK(py.identical);
      CHECK(cpp.steps == 20);
      CHECK(std::abs(cpp.sum - py0.sum) <= 1e-6);
      CHECK(std::abs(cpp.squares - py0.squares) <= 1e-6);
      CHECK(py.sum == py0.sum);
    }
    if (world != 2) continue;
    // Not a trivial agreement: training moved the parameters away from their initial values.
    test::JobSpec zero = spec;
    zero.argv = {toy(), "--out", d / "cpp", "--steps", "0"};
    zero.run_id = test::unique_run_id("toy0");
    test::run_job_ok(zero, 120s);
    CHECK(std::abs(read_rank(d / "cpp", 0).sum - py0.sum) > 1e-4);
  }
}

TEST_CASE(
    "libtorch_toy: with the resilient loop a killed worker is replaced alone, and the "
    "digest equals an uninterrupted run's bit for bit",
    "[torch][toy][resilient]") {
  if (const auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TempDir d;
  fs::create_directories(d / "out");
  Child trun({trun_binary(), "--standalone", "--nproc-per-node=2", "--max-restarts=3", toy(),
              "--out", d / "out", "--ckpt-dir", d / "ck", "--steps", "60", "--ckpt-every", "1000",
              "--step-sleep-ms", "30"},
             {{"TRUN_JOB_ID", "libtorch-toy-loop"}},
             {"TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "SLURM_JOB_ID"});
  REQUIRE(
      wait_until([&] { return trun.out().find("rank 0 step 20 ") != std::string::npos; }, 120s));
  const pid_t survivor = toy_pid(d / "out", 0), victim = toy_pid(d / "out", 1);
  REQUIRE(survivor > 0);
  REQUIRE(victim > 0);
  REQUIRE(::kill(victim, SIGKILL) == 0);
  REQUIRE(trun.wait(180s));
  INFO("trun stdout:\n" << trun.out() << "\nstderr:\n" << trun.err());
  REQUIRE(trun.exit_code() == 0);
  CHECK(toy_pid(d / "out", 0) == survivor);  // rank 0 kept its process
  CHECK(toy_pid(d / "out", 1) != victim);
  CHECK(trun.err().find("re-formed at generation 1") != std::string::npos);
  CHECK(trun.out().find("resumed from") == std::string::npos);  // no checkpoint was needed
  run_toy_reference(d / "ref", 60);
  for (int r = 0; r < 2; ++r) {
    const auto ref = read_rank(d / "ref", r), got = read_rank(d / "out", r);
    CHECK(got.identical);
    CHECK(got.steps == 60);
    CHECK(got.sum == ref.sum);
    CHECK(got.squares == ref.squares);
  }
}

TEST_CASE(
    "libtorch_toy --classic: a worker killed under trun --max-restarts=3 resumes from its "
    "checkpoint",
    "[torch][toy]") {
  TempDir d;
  fs::create_directories(d / "out");
  Child trun({trun_binary(), "--standalone", "--nproc-per-node=2", "--max-restarts=3", toy(),
              "--classic", "--out", d / "out", "--ckpt-dir", d / "ck", "--steps", "60",
              "--ckpt-every", "5", "--step-sleep-ms", "50"},
             {{"TRUN_JOB_ID", "libtorch-toy-kill"}},
             {"TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "SLURM_JOB_ID"});
  // Wait for a checkpoint beyond the first, then SIGKILL rank 1.
  REQUIRE(wait_until([&] { return fs::exists(d / "ck/step_10"); }, 120s));
  const pid_t victim = toy_pid(d / "out", 1);
  REQUIRE(victim > 0);
  REQUIRE(::kill(victim, SIGKILL) == 0);
  REQUIRE(trun.wait(180s));
  INFO("trun stdout:\n" << trun.out() << "\nstderr:\n" << trun.err());
  REQUIRE(trun.exit_code() == 0);
  std::smatch m;
  const std::string out = trun.out();
  REQUIRE(std::regex_search(out, m, std::regex(R"(resumed from \S+ \(step (\d+))")));
  const uint64_t resumed = std::stoull(m[1]);
  CHECK(resumed >= 10);
  CHECK(resumed % 5 == 0);
  for (int r = 0; r < 2; ++r) {
    const auto j = read_rank(d / "out", r);
    CHECK(j.identical);
    CHECK(j.steps == 60);
    CHECK(j.resumed_from == resumed);
  }
  // The resumed run ends where an uninterrupted one does (the data generator is advanced past
  // the steps already done).
  run_toy_reference(d / "ref", 60);
  const auto ref = read_rank(d / "ref", 0), got = read_rank(d / "out", 0);
  CHECK(std::abs(ref.sum - got.sum) <= 1e-6);
  CHECK(std::abs(ref.squares - got.squares) <= 1e-6);
}

TEST_CASE("libtorch_toy: a checkpoint saved at world size 2 resumes at world size 3",
          "[torch][toy]") {
  TempDir d;
  fs::create_directories(d / "a");
  fs::create_directories(d / "b");
  test::JobSpec spec;
  spec.argv = {toy(), "--out", d / "a", "--ckpt-dir", d / "ck", "--steps", "10"};
  spec.nodes = {2};
  spec.run_id = test::unique_run_id("toy-resize2");
  spec.env["TRUN_JOB_ID"] = "libtorch-toy-resize";
  test::run_job_ok(spec, 120s);
  spec.argv = {toy(), "--out", d / "b", "--ckpt-dir", d / "ck", "--steps", "20"};
  spec.nodes = {3};
  spec.run_id = test::unique_run_id("toy-resize3");
  auto results = test::run_job_ok(spec, 120s);
  CHECK_THAT(results[0].output, Catch::Contains("saved at world size 2, now 3"));
  const auto a = read_rank(d / "a", 0);
  for (int r = 0; r < 3; ++r) {
    const auto b = read_rank(d / "b", r);
    CHECK(b.resumed_from == 10);
    CHECK(b.steps == 20);
    CHECK(b.identical);
    CHECK(b.sum != a.sum);  // trained on from the checkpoint
  }
}

#endif
