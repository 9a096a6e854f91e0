// The NCCL backend with its ranks as processes, as trun runs them: pg_worker (PG_WORKER_CUDA=1,
// device buffers) against a real store server, and under the trun binary itself. Each "GPU:"
// case needs a CUDA device per rank: on a GPU machine with enough of them (scripts/gpu-check.sh),
// and on every machine under the GPU simulator (ctest's simgpu.* entries, tests/simgpu). The
// others run everywhere: how NCCL and the CUDA runtime are loaded on first use.

#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <map>
#include <string>
#include <thread>

#include <trun/config.h>
#include <trun/process_group.h>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/worker_sdk/job.h"

#if TRUN_HAVE_NCCL
#include "tests/worker_sdk/gpu_ranks.h"
#endif

using namespace trun::worker;
using namespace trun::worker::test;
using trun::testing::Child;
using trun::testing::free_port;
using trun::testing::wait_until;
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

// One rank of pg_worker `matrix` on sizes 0 and 1, `backend` chosen, `env` added.
RankResult one_rank(const char* backend, std::map<std::string, std::string> env) {
  Job job;
  JobSpec spec;
  spec.argv = {worker_binary(), "matrix", "0", "1"};
  spec.nodes = {1};
  spec.run_id = unique_run_id("gpu-libs");
  spec.env = std::move(env);
  spec.env["PG_WORKER_BACKEND"] = backend;
  job.start(spec);
  auto results = job.wait(120s);
  INFO(job.describe(results));
  REQUIRE(results.size() == 1);
  REQUIRE(results[0].exited);
  return results[0];
}

}  // namespace

// libtrun_worker loads NCCL and the CUDA runtime with dlopen when first used. Where one cannot
// be loaded, backend auto must fall back to the CPU (as without a device) and backend nccl must
// fail with a CollectiveError naming the file, dlerror()'s text and the fix. LD_LIBRARY_PATH
// cannot hide them (libtrun_worker's RUNPATH names the CUDA directory), so the override
// variables name a file that does not exist. Under the simulator, which has devices, auto would
// otherwise choose NCCL.
TEST_CASE("NCCL or the CUDA runtime not loadable: auto falls back to CPU, nccl fails clearly",
          "[worker_sdk][nccl][processes]") {
  const struct {
    const char* variable;
    const char* file;
    std::string what;
  } cases[] = {{"TRUN_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", "NCCL, which"},
               {"TRUN_CUDART_LIBRARY", "/nonexistent/libcudart.so",
                "the CUDA " + std::to_string(CUDART_VERSION / 1000) + " runtime, which"}};
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.variable << "=" << c.file) {
      RankResult cpu = one_rank("auto", {{c.variable, c.file}});
      INFO(cpu.output);
      CHECK(cpu.exit_code == 0);
      CHECK(cpu.output.find("rank 0/1 backend cpu") != std::string::npos);

      RankResult nccl = one_rank("nccl", {{c.variable, c.file}});
      INFO(nccl.output);
      CHECK(nccl.exit_code == 3);  // the exception out of init()
      const std::string& out = nccl.output;
      CHECK(out.find("CollectiveError: NCCL backend on rank 0: cannot load " + std::string(c.file) +
                     " (" + c.variable + "), ") != std::string::npos);
      CHECK(out.find(c.what) != std::string::npos);
      CHECK(out.find(std::string(c.file) + ": cannot open shared object file") !=
            std::string::npos);  // dlerror()
      CHECK(out.find("Install ") != std::string::npos);
      CHECK(out.find(", or unset " + std::string(c.variable) + " to search LD_LIBRARY_PATH") !=
            std::string::npos);
    }
  }
}

// The other half of loading them on first use: a program of the CPU backend never loads them,
// so it also runs where they are not installed. group_threads_worker links only libtrun_worker
// (pg_worker links the CUDA runtime itself); the dynamic loader lists every file it loads.
TEST_CASE("a program that uses only the CPU backend never loads NCCL or the CUDA runtime",
          "[worker_sdk][nccl][processes]") {
  Job job;
  JobSpec spec;
  spec.argv = {build_file("tests/worker_sdk/group_threads_worker"), "2"};
  spec.nodes = {2};
  spec.run_id = unique_run_id("gpu-libs-cpu");
  spec.env["LD_DEBUG"] = "files";
  job.start(spec);
  auto results = job.wait(120s);
  INFO(job.describe(results));
  REQUIRE(results.size() == 2);
  for (const RankResult& r : results) {
    REQUIRE(r.exited);
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("file=libtrun_worker.so") != std::string::npos);  // LD_DEBUG works
    CHECK(r.output.find("libnccl") == std::string::npos);
    CHECK(r.output.find("libcudart") == std::string::npos);
  }
}

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

// reduce, gather, scatter, all_to_all (equal and uneven), send/recv and batch_isend_irecv, and
// allreduce with product and int8/uint8/bool, through ncclReduce and grouped ncclSend/ncclRecv.
// NCCL has no bitwise reductions (refused at the call: the scenario's own refusal checks).
TEST_CASE("GPU: NCCL ranks as processes: the rooted, all-to-all and point-to-point collectives",
          "[worker_sdk][nccl][gpu][processes][coll]") {
  for (int world : {2, 3}) {
    DYNAMIC_SECTION(world << " ranks") {
      TRUN_SKIP_WITHOUT_GPUS(world);
      Job job;
      auto spec = nccl_job({"coll", "0", "1", "7", "1001", "65537"}, world, "nccl-coll");
      spec.env["PG_WORKER_SKIP_BITWISE"] = "1";
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

// The survivors' collectives hang until the group's timeout (10 s here) aborts their
// communicators, unless NCCL reports the broken connections first as an asynchronous error (real
// NCCL may; the simulator cannot see a peer die). Every survivor must fail, none may hang.
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
    const auto& out = r.output;
    const bool timed_out = out.find("timed out; NCCL communicator aborted") != std::string::npos;
    const bool nccl_error = out.find("(ncclResult ") != std::string::npos;
    CHECK((timed_out || nccl_error));
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

namespace {

// A trun agent of an elastic c10d job of 1 to 2 nodes, one NCCL worker (pg_worker `scenario`) on
// visible device `device`: CUDA_VISIBLE_DEVICES keeps the "nodes" of this machine apart.
// It logs into `log_dir`: a SIGKILLed trun cannot remove a temporary directory of its own.
std::vector<std::string> elastic_agent(int port, const std::string& run, const char* scenario,
                                       const std::string& log_dir) {
  return {build_file("launcher/trun"),
          "--log-dir=" + log_dir,
          "--nnodes=1:2",
          "--nproc-per-node=1",
          "--rdzv-backend=c10d",
          "--rdzv-endpoint=127.0.0.1:" + std::to_string(port),
          "--rdzv-id=" + run,
          "--rdzv-conf",
          "last_call_timeout=5",
          "--monitor-interval=0.1",
          "--no-python",
          worker_binary(),
          scenario};
}

std::map<std::string, std::string> nccl_worker_env(const char* visible_device) {
  return {{"PG_WORKER_BACKEND", "nccl"},
          {"PG_WORKER_CUDA", "1"},
          {"PG_WORKER_TIMEOUT_MS", "60000"},
          {"CUDA_VISIBLE_DEVICES", visible_device}};
}

}  // namespace

// Elastic scale-down with NCCL: two agents (one per "node") run one NCCL group; one agent is
// SIGKILLed while the group streams allreduces. The other agent sees the node leave, stops its
// worker (stuck in NCCL, which cannot see a peer die) and re-forms alone; its new worker builds
// a communicator of one and passes.
TEST_CASE("GPU: elastic NCCL job: one of two agents SIGKILLed, the other re-forms alone",
          "[worker_sdk][nccl][gpu][processes]") {
  TRUN_SKIP_WITHOUT_GPUS(2);
  const int port = free_port();
  const std::string run = unique_run_id("nccl-shrink");
  trun::testing::TempDir logs;
  Child a(elastic_agent(port, run, "shrink", logs / "a"), nccl_worker_env("0"),
          {"TORCHELASTIC_ERROR_FILE", "LOGLEVEL"});
  Child b(elastic_agent(port, run, "shrink", logs / "b"), nccl_worker_env("1"),
          {"TORCHELASTIC_ERROR_FILE", "LOGLEVEL"});
  bool streaming = wait_until(
      [&] {
        return a.out().find("READY") != std::string::npos &&
               b.out().find("READY") != std::string::npos;
      },
      120s);
  INFO("agent a:\n" << a.out() << a.err() << "\nagent b:\n" << b.out() << b.err());
  REQUIRE(streaming);
  CHECK(a.out().find("/2 backend nccl") != std::string::npos);  // either rank of one world
  CHECK(b.out().find("/2 backend nccl") != std::string::npos);
  b.signal(SIGKILL);
  REQUIRE(b.wait(30s));
  bool finished = a.wait(180s);
  INFO("agent a after b was killed:\n" << a.out() << a.err());
  REQUIRE(finished);
  CHECK(a.exit_code() == 0);
  CHECK(a.out().find("rank 0/1 backend nccl") != std::string::npos);
  CHECK(a.out().find("PASS") != std::string::npos);
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
