#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

#include "trun/worker.h"

namespace trun::worker {
namespace {

using Lookup = std::function<const char*(const char*)>;

const char* get(const Lookup& lookup, const char* name) {
  const char* v = lookup(name);
  return v;
}

long long parse_int(const char* name, const char* value, long long lo, long long hi) {
  std::string v(value);
  if (v.empty()) throw EnvError(std::string(name) + " is set but empty");
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v.find_first_of(" \t") != std::string::npos)
    throw EnvError(std::string(name) + "='" + v + "' is not an integer");
  if (x < lo || x > hi)
    throw EnvError(std::string(name) + "=" + v + " is outside [" + std::to_string(lo) + ", " +
                   std::to_string(hi) + "]");
  return x;
}

}  // namespace

WorkerEnv WorkerEnv::parse(const Lookup& lookup) {
  WorkerEnv env;
  static const char* const kCore[] = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  static const char* const kLocal[] = {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"};
  const char* first_set = nullptr;
  for (const char* n : kCore)
    if (!first_set && get(lookup, n)) first_set = n;
  for (const char* n : kLocal)
    if (!first_set && get(lookup, n)) first_set = n;

  if (const char* v = get(lookup, "TORCHELASTIC_ERROR_FILE")) env.error_file = v;
  if (const char* v = get(lookup, "TRUN_STORE_TOKEN")) env.store_token = v;
  if (const char* v = get(lookup, "TRUN_STORE_DIALECT")) {
    auto d = rendezvous::parse_store_dialect(v);
    if (!d) {
      throw EnvError(std::string("TRUN_STORE_DIALECT='") + v +
                     "': expected auto, trun, torch2 or torch1.13");
    }
    env.store_dialect = *d;
  }
  if (!first_set) return env;  // standalone: a world of size 1

  for (const char* n : kCore)
    if (!get(lookup, n))
      throw EnvError(std::string(n) + " is not set, but " + first_set +
                     " is: the launcher environment is incomplete (need RANK, WORLD_SIZE, "
                     "MASTER_ADDR and MASTER_PORT)");
  env.standalone = false;
  env.world_size = static_cast<int>(parse_int("WORLD_SIZE", get(lookup, "WORLD_SIZE"), 1, INT_MAX));
  env.rank = static_cast<int>(parse_int("RANK", get(lookup, "RANK"), 0, env.world_size - 1));
  env.master_addr = get(lookup, "MASTER_ADDR");
  if (env.master_addr.empty()) throw EnvError("MASTER_ADDR is set but empty");
  env.master_port =
      static_cast<uint16_t>(parse_int("MASTER_PORT", get(lookup, "MASTER_PORT"), 1, 65535));

  const char* local_first = nullptr;
  for (const char* n : kLocal)
    if (!local_first && get(lookup, n)) local_first = n;
  if (local_first) {
    for (const char* n : kLocal)
      if (!get(lookup, n))
        throw EnvError(std::string(n) + " is not set, but " + local_first +
                       " is (LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK go together)");
    env.local_world_size = static_cast<int>(
        parse_int("LOCAL_WORLD_SIZE", get(lookup, "LOCAL_WORLD_SIZE"), 1, env.world_size));
    env.local_rank = static_cast<int>(
        parse_int("LOCAL_RANK", get(lookup, "LOCAL_RANK"), 0, env.local_world_size - 1));
    // trun --virtual-local-rank shows every worker LOCAL_RANK=0 (its one GPU is device 0); the
    // node-local collectives still need the real position, which trun passes here.
    if (const char* v = get(lookup, "TRUN_LOCAL_RANK"))
      env.local_rank =
          static_cast<int>(parse_int("TRUN_LOCAL_RANK", v, 0, env.local_world_size - 1));
    env.group_rank =
        static_cast<int>(parse_int("GROUP_RANK", get(lookup, "GROUP_RANK"), 0, env.world_size - 1));
    if (const char* v = get(lookup, "GROUP_WORLD_SIZE")) {
      env.group_world_size = static_cast<int>(parse_int("GROUP_WORLD_SIZE", v, 1, env.world_size));
      if (env.group_rank >= env.group_world_size)
        throw EnvError("GROUP_RANK=" + std::to_string(env.group_rank) +
                       " is not below GROUP_WORLD_SIZE=" + std::to_string(env.group_world_size));
    } else {
      env.group_world_size = (env.world_size + env.local_world_size - 1) / env.local_world_size;
    }
  } else {
    // Placement unknown: every rank is treated as a node of its own.
    env.local_rank = 0;
    env.local_world_size = 1;
    env.group_rank = env.rank;
    env.group_world_size = env.world_size;
  }
  env.role_rank = env.rank;
  if (const char* v = get(lookup, "ROLE_RANK"))
    env.role_rank = static_cast<int>(parse_int("ROLE_RANK", v, 0, env.world_size - 1));
  if (const char* v = get(lookup, "ROLE_NAME")) env.role_name = v;
  if (const char* v = get(lookup, "TORCHELASTIC_RESTART_COUNT"))
    env.restart_count = static_cast<int>(parse_int("TORCHELASTIC_RESTART_COUNT", v, 0, INT_MAX));
  if (const char* v = get(lookup, "TORCHELASTIC_USE_AGENT_STORE")) {
    std::string s = v;
    if (s == "False" || s == "false" || s == "0") {
      env.use_agent_store = false;
    } else if (s != "True" && s != "true" && s != "1") {
      throw EnvError("TORCHELASTIC_USE_AGENT_STORE='" + s + "': expected True or False");
    }
  }
  if (const char* v = get(lookup, "TORCHELASTIC_RUN_ID")) {
    env.run_id = v;
    if (env.run_id.empty()) throw EnvError("TORCHELASTIC_RUN_ID is set but empty");
  }
  return env;
}

WorkerEnv WorkerEnv::from_environment() {
  return parse([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace trun::worker
