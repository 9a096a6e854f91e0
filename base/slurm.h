#pragma once
// SLURM conventions shared by trun (launcher/cli.cpp) and libtrun_worker (a program started by
// plain `srun -n N`): the task layout variable and the port a job step's store listens on.
//
// Pure functions: thread-safe, no I/O. Errors: std::invalid_argument whose message quotes the
// text and says what is wrong.

#include <cstdint>
#include <string>
#include <vector>

namespace trun::base {

// SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE, e.g. "2(x3),1" -> {2, 2, 2, 1}: the number of
// tasks on each node of the step, in node-list order.
std::vector<int> expand_tasks_per_node(const std::string& text);

// The port of a job step's store when nobody chose one:
//
//   port = 10000 + (job_id mod 2750) * 8 + (step_id mod 8)        (10000 ..= 31999)
//
// Below Linux's ephemeral range (32768-60999), so an outgoing connection never holds it. Two jobs
// get the same port only when their ids differ by a multiple of 2750 (and two steps of one job
// when their ids differ by a multiple of 8); only jobs whose steps share a head node at the same
// time can collide. docs/slurm.md documents the formula.
uint16_t slurm_port(unsigned long long job_id, unsigned long long step_id);

// SLURM's special step ids (the batch script, the extern step, the interactive and pending
// steps: 0xfffffffa..0xffffffff across SLURM versions) start here; none is an srun step.
inline constexpr unsigned long long kFirstSpecialStepId = 0xfffffff0ULL;

// Whether SLURM_STEP_ID's text names an srun step: false for a special step id. Text that is not
// a number counts as a step, so that the caller's own parse reports it.
bool is_srun_step_id(const std::string& text);

inline constexpr uint16_t kSlurmPortBase = 10000;
inline constexpr unsigned kSlurmPortJobs = 2750;
inline constexpr unsigned kSlurmPortSteps = 8;

}  // namespace trun::base
