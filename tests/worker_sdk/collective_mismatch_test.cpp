// Ranks whose collective calls disagree (count, dtype, op, root, kind): on the shared-memory
// backend every rank fails with one CollectiveError naming both calls, instead of reducing
// mismatched buffers into a silent wrong result; nobody hangs, and the group stays broken.
// Real processes: tests/worker_sdk/mismatch_worker.

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <vector>

#include "tests/worker_sdk/job.h"

using namespace trun::worker::test;
using namespace std::chrono_literals;

namespace {

// Runs mismatch_worker CASE on `nodes`; every rank must exit 0 (it saw a CollectiveError, and a
// later collective failed at once), and every rank's output must hold each of `expected`.
void expect_mismatch_fails(const std::string& kind, std::vector<int> nodes,
                           const std::vector<std::string>& expected) {
  Job job;
  JobSpec spec;
  spec.argv = {build_file("tests/worker_sdk/mismatch_worker"), kind};
  spec.nodes = std::move(nodes);
  spec.run_id = unique_run_id("mismatch");
  job.start(spec);
  auto results = job.wait(120s);
  INFO(job.describe(results));
  for (auto& r : results) {
    REQUIRE(r.exited);
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("FAILED after") != std::string::npos);
    for (const std::string& e : expected) CHECK(r.output.find(e) != std::string::npos);
  }
  CHECK(shm_segments(spec.run_id).empty());
}

}  // namespace

TEST_CASE("an allreduce whose ranks pass different counts fails on every rank, naming both",
          "[worker_sdk][mismatch]") {
  SECTION("2 ranks") {
    expect_mismatch_fails("count", {2},
                          {"allreduce #21 of group ",
                           ": local rank 1 passed 8 float32 elements "
                           "(sum), where local rank 0 passed 16 float32 elements (sum)"});
  }
  SECTION("2 nodes of 2: the node with the odd rank finds it, the other fails with it") {
    // Node 1's ranks name the calls; node 0's see node 1 leave the Gloo allreduce.
    expect_mismatch_fails("count", {2, 2}, {});
  }
  SECTION("3 ranks: the last differs") {
    expect_mismatch_fails("count", {3},
                          {"allreduce #21 of group ",
                           ": local rank 2 passed 8 float32 elements "
                           "(sum), where local ranks 0-1 passed 16 float32 elements (sum)"});
  }
  SECTION("4 ranks: the one that differs is named against the three others") {
    expect_mismatch_fails("count", {4},
                          {"allreduce #21 of group ",
                           ": local rank 3 passed 8 float32 elements "
                           "(sum), where local ranks 0-2 passed 16 float32 elements (sum)"});
  }
}

TEST_CASE("an allreduce whose ranks pass different dtypes or ops fails on every rank",
          "[worker_sdk][mismatch]") {
  SECTION("dtype") {
    expect_mismatch_fails("dtype", {2},
                          {"allreduce #21 of group ",
                           "local rank 1 passed 16 float64 elements "
                           "(sum), where local rank 0 passed 16 float32"});
  }
  SECTION("op") {
    expect_mismatch_fails(
        "op", {2},
        {"local rank 1 passed 16 float32 elements (max), where local rank 0 passed "
         "16 float32 elements (sum)"});
  }
}

TEST_CASE("broadcast, allgather and reduce_scatter with different sizes or roots fail",
          "[worker_sdk][mismatch]") {
  SECTION("broadcast count") {
    expect_mismatch_fails("broadcast", {2},
                          {"broadcast #21 of group ",
                           "local rank 1 passed 32 bytes from local "
                           "rank 0, where local rank 0 passed 64 bytes"});
  }
  SECTION("broadcast root") {
    expect_mismatch_fails(
        "root", {2},
        {"local rank 1 passed 64 bytes from local rank 1, where local rank 0 passed "
         "64 bytes from local rank 0"});
  }
  SECTION("allgather count") {
    expect_mismatch_fails("allgather", {2},
                          {"allgather #21 of group ",
                           "local rank 1 passed 32 bytes per rank, "
                           "where local rank 0 passed 64 bytes per rank"});
  }
  SECTION("reduce_scatter count") {
    expect_mismatch_fails(
        "reduce_scatter", {2},
        {"reduce_scatter #21 of group ",
         "local rank 1 passed 8 float32 elements per rank (sum), where local rank 0 "
         "passed 16 float32 elements per rank (sum)"});
  }
}

TEST_CASE("ranks in different collectives fail on every rank, naming both",
          "[worker_sdk][mismatch]") {
  SECTION("broadcast against allreduce") {
    expect_mismatch_fails("kind", {2},
                          {"collective #21 of group ",
                           "local rank 1 entered broadcast #21 of 64 "
                           "bytes from local rank 0, where local rank 0 "
                           "entered allreduce #21 of 16 float32"});
  }
  SECTION("barrier against allreduce: the rank past the barrier fails at its next collective") {
    // Rank 1 may already have entered its next collective when rank 0 looks ("local rank 1
    // entered allreduce #22"): a barrier's call is not kept for its peers.
    expect_mismatch_fails(
        "barrier", {2},
        {"collective #21 of group ",
         "differs across local ranks: local rank 1 "
         "entered ",
         ", where local rank 0 entered allreduce #21 of 16 float32 elements (sum)"});
  }
}
