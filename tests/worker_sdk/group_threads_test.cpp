// Worker::new_group from several threads at once (trun/worker.h: a Worker may be used from
// several threads): every call gets a group number of its own and a working group.

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <trun/worker.h>

#include "tests/worker_sdk/job.h"

using namespace trun::worker;
using namespace trun::worker::test;
using namespace std::chrono_literals;

namespace {

void run_ranks(std::vector<int> nodes, bool no_placement) {
  Job job;
  JobSpec spec;
  spec.argv = {build_file("tests/worker_sdk/group_threads_worker"), "4"};
  spec.nodes = std::move(nodes);
  spec.no_placement = no_placement;
  spec.run_id = unique_run_id("groups");
  job.start(spec);
  auto results = job.wait(180s);
  for (auto& r : results) {
    INFO(job.describe(results));
    REQUIRE(r.exited);
    REQUIRE(r.exit_code == 0);
  }
  CHECK(shm_segments(spec.run_id).empty());
}

}  // namespace

TEST_CASE("new_group called from several threads at once gives each its own working group",
          "[worker_sdk][groups]") {
  SECTION("3 ranks on one node (shared memory)") { run_ranks({3}, false); }
  SECTION("2 ranks without placement (gloo)") { run_ranks({1, 1}, true); }
}

TEST_CASE("a standalone Worker builds groups from several threads and its copies",
          "[worker_sdk][groups]") {
  // Standalone (a world of size 1): the race on the group numbering is all that is left, which
  // is what ThreadSanitizer checks here.
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
  InitOptions io;
  io.backend = Backend::kCpu;
  io.install_error_handler = false;
  Worker w = init(io);
  REQUIRE(w.env().standalone);
  constexpr int kThreads = 8;
  std::vector<std::unique_ptr<ProcessGroup>> groups(kThreads);
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      Worker copy = w;
      groups[t] = (t % 2 ? copy : w).new_group();
      float x = 2.5f;
      groups[t]->allreduce(&x, 1, DataType::kFloat32, ReduceOp::kSum);
      if (x != 2.5f) groups[t].reset();
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t) {
    INFO("thread " << t);
    REQUIRE(groups[t]);
    CHECK(groups[t]->size() == 1);
  }
}
