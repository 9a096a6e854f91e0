// base/slurm.h: SLURM's tasks-per-node notation and the port derived for a job step.
#include "base/slurm.h"

#include <catch2/catch.hpp>
#include <set>
#include <stdexcept>

using trun::base::expand_tasks_per_node;
using trun::base::is_srun_step_id;
using trun::base::slurm_port;
using Tasks = std::vector<int>;

TEST_CASE("tasks per node: counts, repeats and lists of both", "[slurm]") {
  CHECK(expand_tasks_per_node("4") == Tasks{4});
  CHECK(expand_tasks_per_node("2(x3)") == Tasks{2, 2, 2});
  CHECK(expand_tasks_per_node("2(x3),1") == Tasks{2, 2, 2, 1});
  CHECK(expand_tasks_per_node("1,3(x2),2") == Tasks{1, 3, 3, 2});
}

TEST_CASE("tasks per node: malformed text is refused with the text quoted", "[slurm]") {
  for (const char* bad :
       {"", "x", "2(x)", "2(3)", "2(x3", "0", "2(x0)", "1,,2", "-1", "99999999"}) {
    INFO(bad);
    try {
      expand_tasks_per_node(bad);
      FAIL("accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find(std::string("'") + bad + "'") != std::string::npos);
    }
  }
}

TEST_CASE("the derived port: the documented formula, below the ephemeral range", "[slurm]") {
  CHECK(slurm_port(0, 0) == 10000);
  CHECK(slurm_port(1, 0) == 10008);
  CHECK(slurm_port(1, 1) == 10009);
  CHECK(slurm_port(2749, 7) == 31999);
  CHECK(slurm_port(2750, 0) == 10000);  // the period
  CHECK(slurm_port(12345, 9) == 10000 + (12345 % 2750) * 8 + 1);
  // Consecutive jobs (and the first steps of each) never share a port within a period.
  std::set<uint16_t> seen;
  for (unsigned long long job = 5000; job < 5000 + 2750; ++job)
    for (unsigned long long step = 0; step < 8; ++step) {
      const uint16_t p = slurm_port(job, step);
      CHECK(p >= 10000);
      CHECK(p < 32768);
      seen.insert(p);
    }
  CHECK(seen.size() == 2750u * 8u);
}

TEST_CASE("srun step ids and SLURM's special step ids", "[slurm]") {
  CHECK(is_srun_step_id("0"));
  CHECK(is_srun_step_id("7"));
  CHECK(is_srun_step_id("4294967279"));        // 0xffffffef: the last ordinary id
  CHECK_FALSE(is_srun_step_id("4294967280"));  // 0xfffffff0
  CHECK_FALSE(is_srun_step_id("4294967294"));  // the batch step
  CHECK_FALSE(is_srun_step_id("4294967295"));  // the extern step
  // Not a number: left for the caller's parse to report.
  CHECK(is_srun_step_id("x"));
  CHECK(is_srun_step_id(""));
}
