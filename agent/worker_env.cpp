#include "agent/worker_env.h"

#include <cctype>
#include <cstring>

#include "base/progress_board.h"

namespace trun::agent {

EnvMap env_map(const char* const* env) {
  EnvMap out;
  for (const char* const* e = env; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq) out[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  return out;
}

EnvMap base_worker_env(EnvMap parent, int nproc_per_node, bool* omp_defaulted) {
  *omp_defaulted = false;
  if (!parent.count("OMP_NUM_THREADS") && nproc_per_node > 1) {
    parent["OMP_NUM_THREADS"] = "1";
    *omp_defaulted = true;
  }
  for (const char* k : {"NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}) {
    if (!parent.count(k)) parent[k] = "1";
  }
  return parent;
}

std::vector<std::string> worker_env(const EnvMap& base, const LaunchConfig& config,
                                    const AttemptEnv& attempt, const WorkerIdentity& worker) {
  EnvMap env = base;
  env["LOCAL_RANK"] = std::to_string(worker.local_rank);
  env.erase("TRUN_LOCAL_RANK");  // a trun started by a worker of another must not pass it on
  if (config.virtual_local_rank) {
    // Each worker sees one device, as its device 0 (see LaunchConfig::visible_devices).
    env["LOCAL_RANK"] = "0";
    env["TRUN_LOCAL_RANK"] = std::to_string(worker.local_rank);
    env["CUDA_VISIBLE_DEVICES"] =
        config.visible_devices.empty()
            ? std::to_string(worker.local_rank)
            : config.visible_devices[static_cast<size_t>(worker.local_rank)];
  }
  env["RANK"] = std::to_string(worker.rank);
  env["GROUP_RANK"] = std::to_string(attempt.group_rank);
  env["ROLE_RANK"] = std::to_string(worker.role_rank);
  env["ROLE_NAME"] = config.role;
  env["LOCAL_WORLD_SIZE"] = std::to_string(config.nproc_per_node);
  env["WORLD_SIZE"] = std::to_string(attempt.world_size);
  env["GROUP_WORLD_SIZE"] = std::to_string(attempt.group_world_size);
  env["ROLE_WORLD_SIZE"] = std::to_string(attempt.role_world_size);
  env["MASTER_ADDR"] = attempt.master_addr;
  env["MASTER_PORT"] = std::to_string(attempt.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(config.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = attempt.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = attempt.use_agent_store ? "True" : "False";
  env["TORCHELASTIC_ERROR_FILE"] = worker.error_file;
  env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle_text;
  if (!attempt.timer_file.empty()) env["TORCHELASTIC_TIMER_FILE"] = attempt.timer_file;
  if (attempt.python_fault_handler && !env.count("PYTHONFAULTHANDLER")) {
    env["PYTHONFAULTHANDLER"] = "1";
  }
  if (attempt.progress_shm.empty()) {
    env.erase(base::progress::kEnvVar);
  } else {
    env[base::progress::kEnvVar] = attempt.progress_shm;
  }
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

namespace {

bool identifier_start(char c) { return c == '_' || std::isalpha(static_cast<unsigned char>(c)); }
bool identifier_char(char c) { return c == '_' || std::isalnum(static_cast<unsigned char>(c)); }

// Python's string.Template(arg).safe_substitute(local_rank=value): the delimiter is '$', an
// identifier is [_a-zA-Z][_a-zA-Z0-9]* (ASCII), braced or not; unknown names and a lone '$'
// stay as they are.
std::string substitute_local_rank(const std::string& arg, const std::string& value) {
  static const std::string kName = "local_rank";
  std::string out;
  out.reserve(arg.size());
  for (size_t i = 0; i < arg.size();) {
    if (arg[i] != '$' || i + 1 == arg.size()) {
      out.push_back(arg[i++]);
      continue;
    }
    const char next = arg[i + 1];
    if (next == '$') {
      out.push_back('$');
      i += 2;
    } else if (next == '{') {
      size_t j = i + 2;
      if (j < arg.size() && identifier_start(arg[j])) {
        while (j < arg.size() && identifier_char(arg[j])) ++j;
      }
      if (j < arg.size() && arg[j] == '}' && arg.compare(i + 2, j - i - 2, kName) == 0) {
        out += value;
        i = j + 1;
      } else {
        out.push_back(arg[i++]);  // "${" not closing a known name: kept literally
      }
    } else if (identifier_start(next)) {
      size_t j = i + 1;
      while (j < arg.size() && identifier_char(arg[j])) ++j;
      if (arg.compare(i + 1, j - i - 1, kName) == 0) {
        out += value;
      } else {
        out.append(arg, i, j - i);
      }
      i = j;
    } else {
      out.push_back(arg[i++]);
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> worker_argv(const std::vector<std::string>& entrypoint, int local_rank) {
  std::vector<std::string> argv = entrypoint;
  const std::string value = std::to_string(local_rank);
  for (size_t i = 1; i < argv.size(); ++i) argv[i] = substitute_local_rank(argv[i], value);
  return argv;
}

}  // namespace trun::agent
