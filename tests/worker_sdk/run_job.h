#pragma once
// For tests that only need a job to succeed: runs it with the harness (job.h) and requires every
// rank to have exited 0 (describing all ranks otherwise) and no shared-memory segment of the run
// to be left in /dev/shm.

#include <catch2/catch.hpp>

#include "tests/worker_sdk/job.h"

namespace trun::worker::test {

inline std::vector<RankResult> run_job_ok(const JobSpec& spec, std::chrono::milliseconds timeout) {
  Job job;
  job.start(spec);
  auto results = job.wait(timeout);
  INFO(job.describe(results));
  for (const auto& r : results) {
    REQUIRE(r.exited);
    REQUIRE(r.exit_code == 0);
  }
  REQUIRE(shm_segments(spec.run_id).empty());
  return results;
}

}  // namespace trun::worker::test
