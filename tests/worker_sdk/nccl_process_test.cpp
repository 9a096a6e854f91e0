// The NCCL backend with its ranks as processes, as trun runs them: pg_worker (PG_WORKER_CUDA=1,
// device buffers) against a real store server, and under the trun binary itself. Each case
// needs a CUDA device per rank: on a GPU machine with enough of them (scripts/gpu-check.sh),
// and on every machine under the GPU simulator (ctest's simgpu.* entries, tests/simgpu).

#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>

#include "tests/launcher/process_util.h"
#include "tests/worker_sdk/job.h"
#include "trun/config.h"
#include "trun/process_group.h"

#if TRUN_HAVE_NCCL
#include "tests/worker_sdk/gpu_ranks.h"
#endif

using namespace trun::worker;
using namespace trun::worker::test;
using trun::testing::Child;
using namespace std::chrono_literals;

#if TRUN_HAVE_NCCL
namespace {

JobSpec nccl_job(std::vector<std::string> args, int world, const std::string& run_id) {
  JobSpec spec;
  spec.argv = {worker_binary()};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.nodes = {world};
  spec.run_id = unique_run_id(run_id);
  spec.env["PG_WORKER_BACKEND"] = "nccl";
  spec.env["PG_WORKER_CUDA"] = "1";
  return spec;
}

}  // namespace

TEST_CASE("GPU: NCCL ranks as processes: every collective x dtype x size, against a reference",
          "[worker_sdk][nccl][gpu][processes]") {
  for (int world : {2, 3}) {
    DYNAMIC_SECTION(world << " ranks") {
      TRUN_SKIP_WITHOUT_GPUS(world);
      Job job;
      auto spec = nccl_job({"matrix"}, world, "nccl-matrix");
      job.start(spec);
      auto results = job.wait(240s);
      INFO(job.describe(results));
      for (auto& r : results) {
        REQUIRE(r.exited);
        CHECK(r.exit_code == 0);
        CHECK(r.output.find("backend nccl") != std::string::npos);
      }
    }
  }
}

// NCCL cannot see a peer die: the others' collectives hang until the group's timeout (10 s here)
// aborts their communicators. Every survivor must fail, none may hang.
TEST_CASE("GPU: an NCCL rank SIGKILLed mid-stream: every other rank fails at its timeout",
          "[worker_sdk][nccl][gpu][processes]") {
  const int world = 3;
  TRUN_SKIP_WITHOUT_GPUS(world);
  Job job;
  auto spec = nccl_job({"loop"}, world, "nccl-kill");
  spec.env["PG_WORKER_TIMEOUT_MS"] = "10000";
  job.start(spec);
  for (int r = 0; r < world; ++r) REQUIRE(job.wait_for_output(r, "READY", 60s));
  std::this_thread::sleep_for(200ms);
  job.kill_rank(1, SIGKILL);
  auto t0 = std::chrono::steady_clock::now();
  auto results = job.wait(120s);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(job.describe(results));
  for (auto& r : results) {
    if (r.rank == 1) continue;
    REQUIRE(r.exited);
    CHECK(r.exit_code == 11);  // the allreduce failed
    CHECK(r.output.find("timed out; NCCL communicator aborted") != std::string::npos);
  }
  CHECK(s < 60);
}

TEST_CASE("GPU: a stalled NCCL rank: the others time out and the group refuses more work",
          "[worker_sdk][nccl][gpu][processes]") {
  const int world = 2;
  TRUN_SKIP_WITHOUT_GPUS(world);
  Job job;
  auto spec = nccl_job({"stall", "1", "2000"}, world, "nccl-stall");
  job.start(spec);
  REQUIRE(job.wait_for_output(1, "STALLING", 60s));
  REQUIRE(job.wait_for_output(0, "BROKEN", 60s));
  job.kill_rank(1, SIGKILL);
  auto results = job.wait(30s);
  INFO(job.describe(results));
  REQUIRE(results[0].exited);
  CHECK(results[0].exit_code == 10);
  CHECK(results[0].output.find("TIMEOUT after") != std::string::npos);
}

// The whole loop under the real launcher: a worker of an NCCL group dies, trun stops the group
// and starts it again (attempt 1), and the new group forms a fresh communicator and passes.
TEST_CASE("GPU: under trun, an NCCL worker SIGKILLed: the group restarts and the new one works",
          "[worker_sdk][nccl][gpu][processes]") {
  TRUN_SKIP_WITHOUT_GPUS(2);
  Child trun({build_file("launcher/trun"), "--standalone", "--nproc-per-node=2", "--max-restarts=1",
              "--monitor-interval=0.1", "--no-python", worker_binary(), "kill_once"},
             {{"PG_WORKER_BACKEND", "nccl"},
              {"PG_WORKER_CUDA", "1"},
              {"PG_WORKER_TIMEOUT_MS", "30000"},
              {"PET_MASTER_PORT", "0"}},
             {"TORCHELASTIC_ERROR_FILE", "LOGLEVEL"});
  bool finished = trun.wait(180s);
  if (!finished) {
    trun.signal(SIGKILL);
    trun.wait(10s);
  }
  std::string out = trun.out() + trun.err();
  INFO(out);
  REQUIRE(finished);
  CHECK(trun.exit_code() == 0);
  CHECK(out.find("KILLING MYSELF") != std::string::npos);
  CHECK(out.find("restarting the worker group (1/1 restarts)") != std::string::npos);
  size_t passes = 0;
  for (size_t at = out.find("PASS"); at != std::string::npos; at = out.find("PASS", at + 1))
    ++passes;
  CHECK(passes == 2);
}
#endif
