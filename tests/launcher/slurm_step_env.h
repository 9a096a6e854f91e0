#pragma once
// SLURM's variables inside `srun -N2 -n2` of job 12, step 0, on node `node_id` (as the local test
// cluster sets them), for the tests of what trun derives from them.

#include <map>
#include <string>

namespace trun::testing {

inline std::map<std::string, std::string> slurm_step_env(int node_id) {
  return {{"SLURM_JOB_ID", "12"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEP_NODELIST", "n[1-2]"},
          {"SLURM_JOB_NODELIST", "n[1-2]"},
          {"SLURM_NODELIST", "n[1-2]"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_JOB_NUM_NODES", "2"},
          {"SLURM_NNODES", "2"},
          {"SLURM_NODEID", std::to_string(node_id)},
          {"SLURM_PROCID", std::to_string(node_id)},
          {"SLURM_LOCALID", "0"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
          {"SLURM_TASKS_PER_NODE", "1(x2)"}};
}

}  // namespace trun::testing
