// WorkerEnv: which launcher convention gives the ranks, and where the store is (trun/worker.h,
// docs/worker_sdk.md "Environment"). Pure: every variable is read through `lookup`.

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/decimal.h"
#include "base/hostlist.h"
#include "base/slurm.h"
#include "store/tcp_store.h"
#include "trun/worker.h"

namespace trun::worker {
namespace {

using Lookup = std::function<const char*(const char*)>;

// strtoll's syntax as always (a leading '+', and leading whitespace other than blanks, is taken),
// but a blank anywhere is refused.
long long parse_int(const std::string& name, const std::string& v, long long lo, long long hi) {
  if (v.empty()) throw EnvError(name + " is set but empty");
  if (v.find_first_of(" \t") != std::string::npos) {
    throw EnvError(name + "='" + v + "' is not an integer");
  }
  std::string error;
  const auto x = base::parse_decimal_in(v, lo, hi, &error, base::DecimalSyntax{true, true});
  if (!x) throw EnvError(name + "=" + error);
  return *x;
}

int parse_int_var(const Lookup& lookup, const char* name, long long lo, long long hi) {
  return static_cast<int>(parse_int(name, lookup(name), lo, hi));
}

// The first of `names` that is set, or nullptr.
const char* first_set(const Lookup& lookup, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (lookup(n)) return n;
  return nullptr;
}

// Every one of `names` must be set, because `because` is.
void require_all(const Lookup& lookup, std::initializer_list<const char*> names,
                 const std::string& because, const std::string& what) {
  for (const char* n : names)
    if (!lookup(n)) throw EnvError(std::string(n) + " is not set, but " + because + " is: " + what);
}

// What a launcher environment says, before the init method is applied.
struct Launch {
  std::string launcher = "standalone";
  int rank = -1, world_size = -1;
  bool placement = false;  // local_rank .. group_world_size are known
  int local_rank = 0, local_world_size = 1, group_rank = 0, group_world_size = 1;
  // Where env:// finds the store; empty when this launcher does not say (an error for env://).
  std::string master_addr, addr_origin;
  int master_port = 0;
  std::string port_origin;
  std::string no_addr_reason;  // why master_addr is empty
  std::string run_id;          // empty: none
};

void parse_master_vars(const Lookup& lookup, Launch* l) {
  if (const char* a = lookup("MASTER_ADDR")) {
    l->master_addr = a;
    if (l->master_addr.empty()) throw EnvError("MASTER_ADDR is set but empty");
    l->addr_origin = "MASTER_ADDR";
  }
  if (const char* p = lookup("MASTER_PORT")) {
    l->master_port = static_cast<int>(parse_int("MASTER_PORT", p, 1, 65535));
    l->port_origin = "MASTER_PORT";
  }
}

// RANK, WORLD_SIZE, ... (trun, torchrun, or by hand). `need_master`: env://, where MASTER_ADDR
// and MASTER_PORT are part of the convention.
Launch torch_launch(const Lookup& lookup, const char* first, bool need_master) {
  Launch l;
  l.launcher = "torch";
  const std::string what =
      need_master
          ? "the launcher environment is incomplete (need RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT)"
          : "the launcher environment is incomplete (need RANK and WORLD_SIZE)";
  if (need_master)
    require_all(lookup, {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}, first, what);
  else
    require_all(lookup, {"RANK", "WORLD_SIZE"}, first, what);
  l.world_size = parse_int_var(lookup, "WORLD_SIZE", 1, INT_MAX);
  l.rank = parse_int_var(lookup, "RANK", 0, l.world_size - 1);
  parse_master_vars(lookup, &l);

  if (const char* local_first =
          first_set(lookup, {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"})) {
    require_all(lookup, {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}, local_first,
                "LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK go together");
    l.placement = true;
    l.local_world_size = parse_int_var(lookup, "LOCAL_WORLD_SIZE", 1, l.world_size);
    l.local_rank = parse_int_var(lookup, "LOCAL_RANK", 0, l.local_world_size - 1);
    // trun --virtual-local-rank shows every worker LOCAL_RANK=0 (its one GPU is device 0); the
    // node-local collectives still need the real position, which trun passes here.
    if (lookup("TRUN_LOCAL_RANK"))
      l.local_rank = parse_int_var(lookup, "TRUN_LOCAL_RANK", 0, l.local_world_size - 1);
    l.group_rank = parse_int_var(lookup, "GROUP_RANK", 0, l.world_size - 1);
    if (lookup("GROUP_WORLD_SIZE")) {
      l.group_world_size = parse_int_var(lookup, "GROUP_WORLD_SIZE", 1, l.world_size);
      if (l.group_rank >= l.group_world_size)
        throw EnvError("GROUP_RANK=" + std::to_string(l.group_rank) +
                       " is not below GROUP_WORLD_SIZE=" + std::to_string(l.group_world_size));
    } else {
      l.group_world_size = (l.world_size + l.local_world_size - 1) / l.local_world_size;
    }
  }
  if (l.master_addr.empty()) l.no_addr_reason = "MASTER_ADDR is not set";
  return l;
}

// One task per rank under `srun -n N` (inside a job step).
Launch slurm_launch(const Lookup& lookup) {
  Launch l;
  l.launcher = "slurm";
  const char* world_var = lookup("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  const std::string what = "an incomplete srun environment (need SLURM_PROCID, " +
                           std::string(world_var) +
                           ", SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE and "
                           "SLURM_JOB_ID inside a job step)";
  for (const char* n : {"SLURM_PROCID", world_var, "SLURM_LOCALID", "SLURM_NODEID",
                        "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_ID"})
    if (!lookup(n)) throw EnvError(std::string(n) + " is not set, but SLURM_STEP_ID is: " + what);
  l.world_size = parse_int_var(lookup, world_var, 1, INT_MAX);
  l.rank = parse_int_var(lookup, "SLURM_PROCID", 0, l.world_size - 1);
  std::vector<int> per_node;
  try {
    per_node = base::expand_tasks_per_node(lookup("SLURM_STEP_TASKS_PER_NODE"));
  } catch (const std::invalid_argument& e) {
    throw EnvError(std::string("SLURM_STEP_TASKS_PER_NODE: ") + e.what());
  }
  long long total = 0;
  for (int n : per_node) total += n;
  if (per_node.empty() || total != l.world_size)
    throw EnvError(std::string("SLURM_STEP_TASKS_PER_NODE='") +
                   lookup("SLURM_STEP_TASKS_PER_NODE") + "' adds up to " + std::to_string(total) +
                   " tasks, but " + world_var + "=" + std::to_string(l.world_size));
  l.placement = true;
  l.group_world_size = static_cast<int>(per_node.size());
  l.group_rank = parse_int_var(lookup, "SLURM_NODEID", 0, l.group_world_size - 1);
  l.local_world_size = per_node[l.group_rank];
  l.local_rank = parse_int_var(lookup, "SLURM_LOCALID", 0, l.local_world_size - 1);
  const auto job = static_cast<unsigned long long>(
      parse_int("SLURM_JOB_ID", lookup("SLURM_JOB_ID"), 0, LLONG_MAX));
  const auto step = static_cast<unsigned long long>(
      parse_int("SLURM_STEP_ID", lookup("SLURM_STEP_ID"), 0, LLONG_MAX));
  l.run_id = "slurm-" + std::to_string(job) + "." + std::to_string(step);

  parse_master_vars(lookup, &l);
  if (l.master_addr.empty()) {
    if (const char* nodes = lookup("SLURM_STEP_NODELIST")) {
      try {
        l.master_addr = base::first_host(nodes);
      } catch (const std::invalid_argument& e) {
        throw EnvError(std::string("SLURM_STEP_NODELIST: ") + e.what());
      }
      l.addr_origin = "the first host of SLURM_STEP_NODELIST";
    } else {
      l.no_addr_reason = "neither MASTER_ADDR nor SLURM_STEP_NODELIST is set";
    }
  }
  if (l.master_port == 0) {
    l.master_port = base::slurm_port(job, step);
    l.port_origin = "the port of SLURM_JOB_ID.SLURM_STEP_ID (docs/slurm.md)";
  }
  return l;
}

// FNV-1a: a stable hash of the MPI job id, the same in every rank.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// One process per rank under `mpirun -np N` (Open MPI) or `mpiexec` (MPICH/Hydra).
Launch mpi_launch(const Lookup& lookup, bool open_mpi) {
  Launch l;
  l.launcher = "mpi";
  const char* rank_var = open_mpi ? "OMPI_COMM_WORLD_RANK" : "PMI_RANK";
  const char* size_var = open_mpi ? "OMPI_COMM_WORLD_SIZE" : "PMI_SIZE";
  const char* lrank_var = open_mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "MPI_LOCALRANKID";
  const char* lsize_var = open_mpi ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "MPI_LOCALNRANKS";
  const std::string first = lookup(rank_var) ? rank_var : size_var;
  if (open_mpi) {
    require_all(lookup, {rank_var, size_var, lrank_var, lsize_var}, first,
                "an incomplete Open MPI environment (need OMPI_COMM_WORLD_RANK, "
                "OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK and OMPI_COMM_WORLD_LOCAL_SIZE)");
  } else {
    require_all(lookup, {rank_var, size_var}, first,
                "an incomplete MPI environment (need PMI_RANK and PMI_SIZE)");
    if (const char* lf = first_set(lookup, {lrank_var, lsize_var}))
      require_all(lookup, {lrank_var, lsize_var}, lf,
                  "MPI_LOCALRANKID and MPI_LOCALNRANKS go together");
  }
  l.world_size = parse_int_var(lookup, size_var, 1, INT_MAX);
  l.rank = parse_int_var(lookup, rank_var, 0, l.world_size - 1);
  bool all_local = l.world_size == 1;
  if (lookup(lsize_var)) {
    l.local_world_size = parse_int_var(lookup, lsize_var, 1, l.world_size);
    l.local_rank = parse_int_var(lookup, lrank_var, 0, l.local_world_size - 1);
    all_local = l.local_world_size == l.world_size;
    l.placement = true;
    if (all_local) {
      l.group_rank = 0;
      l.group_world_size = 1;
    } else {
      l.group_rank = -1;  // no node index: each rank a node of its own for the groups
      l.group_world_size = -1;
    }
  }

  std::string job_var, job_id;
  for (const char* n : {"OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE"}) {
    const char* v = lookup(n);
    if (v && *v) {
      job_var = n;
      job_id = v;
      break;
    }
  }
  if (!job_id.empty()) l.run_id = "mpi-" + job_id;

  parse_master_vars(lookup, &l);
  if (l.master_addr.empty()) {
    if (all_local) {
      l.master_addr = "127.0.0.1";
      l.addr_origin = lookup(lsize_var) ? std::string("127.0.0.1: every rank is on this node (") +
                                              lsize_var + " == " + size_var + ")"
                                        : std::string("127.0.0.1: a world of one");
    } else {
      l.no_addr_reason = std::string("MASTER_ADDR is not set, and ") +
                         (lookup(lsize_var) ? std::string("the ranks are on several nodes (") +
                                                  lsize_var + " < " + size_var + ")"
                                            : std::string(lsize_var) + " is not set") +
                         ": set MASTER_ADDR to the host of rank 0";
    }
  }
  if (l.master_port == 0) {
    if (job_id.empty())
      throw EnvError(std::string("MASTER_PORT is not set, and no MPI job id to derive a port "
                                 "from (OMPI_MCA_ess_base_jobid, OMPI_MCA_orte_ess_jobid, "
                                 "PMIX_NAMESPACE): set MASTER_PORT (") +
                     size_var + " is set: launched by mpirun)");
    l.master_port = 10000 + static_cast<int>(fnv1a(job_id) % 22000);
    l.port_origin = "the port derived from " + job_var;
  }
  return l;
}

// mpirun inside a SLURM allocation starts its daemons with srun, one task per node, so its
// ranks inherit the daemons' step (SLURM_PROCID = the node's index, SLURM_STEP_NUM_TASKS = the
// number of nodes): when MPI's world size is set and differs from the step's, MPI's is the truth.
// (Under `srun --mpi=pmi2` PMI_SIZE agrees with SLURM's and SLURM's richer variables win.)
bool mpirun_in_allocation(const Lookup& lookup) {
  const char* mpi = lookup("OMPI_COMM_WORLD_SIZE");
  if (!mpi) mpi = lookup("PMI_SIZE");
  const char* step = lookup("SLURM_STEP_NUM_TASKS");
  if (!step) step = lookup("SLURM_NTASKS");
  return mpi && (!step || std::string(mpi) != step);
}

struct Url {
  std::string scheme;  // "env", "tcp", "file"
  std::string rest;    // after "://", without the query
  int rank = -1, world_size = -1;
};

Url parse_url(const std::string& url, const std::string& from) {
  Url u;
  const auto sep = url.find("://");
  if (sep == std::string::npos)
    throw EnvError(from + "='" + url + "': expected env://, tcp://host:port or file:///path");
  u.scheme = url.substr(0, sep);
  if (u.scheme != "env" && u.scheme != "tcp" && u.scheme != "file")
    throw EnvError(from + "='" + url + "': unknown scheme '" + u.scheme +
                   "' (expected env, tcp or file)");
  std::string rest = url.substr(sep + 3);
  const auto q = rest.find('?');
  if (q != std::string::npos) {
    std::string query = rest.substr(q + 1);
    rest.resize(q);
    size_t at = 0;
    while (at <= query.size()) {
      size_t amp = query.find('&', at);
      if (amp == std::string::npos) amp = query.size();
      const std::string kv = query.substr(at, amp - at);
      at = amp + 1;
      if (kv.empty()) continue;
      const auto eq = kv.find('=');
      const std::string k = kv.substr(0, eq);
      const std::string v = eq == std::string::npos ? "" : kv.substr(eq + 1);
      if (k == "rank") {
        u.rank = static_cast<int>(parse_int(from + " query rank", v, 0, INT_MAX - 1));
      } else if (k == "world_size") {
        u.world_size = static_cast<int>(parse_int(from + " query world_size", v, 1, INT_MAX));
      } else if (k != "use_libuv") {  // PyTorch 2.x's TCPStore flag: meaningless here
        throw EnvError(from + "='" + url + "': unknown query parameter '" + k +
                       "' (expected rank and world_size)");
      }
    }
  }
  u.rest = rest;
  return u;
}

// "host:port" or "[v6]:port".
void parse_host_port(const std::string& rest, const std::string& from, const std::string& url,
                     std::string* host, int* port) {
  std::string h, p;
  if (!rest.empty() && rest[0] == '[') {
    const auto close = rest.find(']');
    if (close == std::string::npos || close + 1 >= rest.size() || rest[close + 1] != ':')
      throw EnvError(from + "='" + url + "': expected tcp://[address]:port");
    h = rest.substr(1, close - 1);
    p = rest.substr(close + 2);
  } else {
    const auto colon = rest.rfind(':');
    if (colon == std::string::npos)
      throw EnvError(from + "='" + url + "': the port is missing (expected tcp://host:port)");
    h = rest.substr(0, colon);
    p = rest.substr(colon + 1);
  }
  if (!p.empty() && p.back() == '/') p.pop_back();
  if (h.empty()) throw EnvError(from + "='" + url + "': the host is missing");
  *host = h;
  *port = static_cast<int>(parse_int(from + " port", p, 1, 65535));
}

// The store's client settings: the error file, the token and the dialect.
void read_client_settings(const Lookup& lookup, WorkerEnv* env) {
  if (const char* v = lookup("TORCHELASTIC_ERROR_FILE")) env->error_file = v;
  if (const char* v = lookup("TRUN_STORE_TOKEN")) env->store_token = v;
  if (const char* v = lookup("TRUN_STORE_DIALECT")) {
    auto d = store::parse_store_dialect(v);
    if (!d) {
      throw EnvError(std::string("TRUN_STORE_DIALECT='") + v +
                     "': expected auto, trun, torch2 or torch1.13");
    }
    env->store_dialect = *d;
  }
}

// The init method in effect and the rank and world size the program (or its URL) gives.
struct InitMethod {
  std::string url;   // as given
  std::string from;  // where it came from, for messages
  Url u;
  int given_rank = -1, given_world = -1;  // -1: not given
};

// The init method: the program's, else TRUN_INIT_METHOD, else env://. Then the rank and world
// size: InitOptions' or the URL's query, never both, always together.
InitMethod read_init_method(const Lookup& lookup, const InitOptions& options) {
  InitMethod m;
  m.url = options.init_method;
  m.from = "InitOptions::init_method";
  if (m.url.empty() || m.url == "env://") {
    m.url = "env://";
    if (const char* v = lookup("TRUN_INIT_METHOD")) {
      m.url = v;
      m.from = "TRUN_INIT_METHOD";
      if (m.url.empty()) throw EnvError("TRUN_INIT_METHOD is set but empty");
    }
  }
  m.u = parse_url(m.url, m.from);
  if ((options.rank >= 0 || options.world_size > 0) && (m.u.rank >= 0 || m.u.world_size > 0))
    throw EnvError(m.from + "='" + m.url +
                   "' has rank/world_size in its query, and InitOptions::rank/world_size are set "
                   "too: give them one way");
  m.given_rank = options.rank >= 0 ? options.rank : m.u.rank;
  m.given_world = options.world_size > 0 ? options.world_size : m.u.world_size;
  const std::string given_from = options.rank >= 0 || options.world_size > 0
                                     ? "InitOptions::rank/world_size"
                                     : m.from + "'s query";
  if ((m.given_rank >= 0) != (m.given_world > 0))
    throw EnvError(given_from + ": rank and world_size go together (rank " +
                   std::to_string(m.given_rank) + ", world_size " + std::to_string(m.given_world) +
                   ")");
  if (m.given_rank >= m.given_world && m.given_world > 0)
    throw EnvError(given_from + ": rank " + std::to_string(m.given_rank) +
                   " is not below world_size " + std::to_string(m.given_world));
  return m;
}

// The launcher environment: torch > slurm > mpi > none. nullopt: standalone (env:// and no
// launcher at all), a world of size 1.
std::optional<Launch> read_launch(const Lookup& lookup, const InitMethod& m) {
  const bool is_env = m.u.scheme == "env";
  Launch l;
  if (const char* first = first_set(
          lookup, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"})) {
    l = torch_launch(lookup, first, is_env && m.given_world < 0);
  } else if (const char* step = lookup("SLURM_STEP_ID");
             step && base::is_srun_step_id(step) && !mpirun_in_allocation(lookup)) {
    l = slurm_launch(lookup);
  } else if (lookup("OMPI_COMM_WORLD_RANK") || lookup("OMPI_COMM_WORLD_SIZE")) {
    l = mpi_launch(lookup, true);
  } else if (lookup("PMI_RANK") || lookup("PMI_SIZE")) {
    l = mpi_launch(lookup, false);
  } else if (is_env && m.given_world < 0) {
    if (const char* v = first_set(lookup, {"MASTER_ADDR", "MASTER_PORT"}))
      throw EnvError(std::string("RANK is not set, but ") + v +
                     " is: the launcher environment is incomplete (need RANK, WORLD_SIZE, "
                     "MASTER_ADDR and MASTER_PORT), and there is no srun or mpirun environment");
    return std::nullopt;
  } else {
    parse_master_vars(lookup, &l);
  }
  return l;
}

// Rank, world size and placement: the program's (or the URL's) numbers win, as in PyTorch; the
// launcher's placement only when it describes the same world.
void set_identity(const InitMethod& m, Launch l, WorkerEnv* env) {
  if (m.given_world > 0) {
    const bool same = l.world_size == m.given_world && l.rank == m.given_rank;
    if (!same) l.placement = false;
    l.rank = m.given_rank;
    l.world_size = m.given_world;
    if (l.launcher == "standalone" || !same)
      l.launcher = m.u.scheme == "env" ? "torch" : m.u.scheme;
  } else if (l.world_size < 0) {
    throw EnvError(m.from + "='" + m.url +
                   "' needs a rank and a world size: set InitOptions::rank and world_size, add "
                   "?rank=R&world_size=N, or set RANK and WORLD_SIZE");
  }
  env->launcher = l.launcher;
  env->rank = l.rank;
  env->world_size = l.world_size;
  if (l.placement) {
    env->local_rank = l.local_rank;
    env->local_world_size = l.local_world_size;
    env->group_rank = l.group_rank;
    env->group_world_size = l.group_world_size;
  } else {
    // Placement unknown: every rank is treated as a node of its own.
    env->local_rank = 0;
    env->local_world_size = 1;
    env->group_rank = env->rank;
    env->group_world_size = env->world_size;
  }
}

// The role and the restart count.
void read_role(const Lookup& lookup, WorkerEnv* env) {
  env->role_rank = env->rank;
  if (lookup("ROLE_RANK"))
    env->role_rank = parse_int_var(lookup, "ROLE_RANK", 0, env->world_size - 1);
  if (const char* v = lookup("ROLE_NAME")) env->role_name = v;
  if (lookup("TORCHELASTIC_RESTART_COUNT"))
    env->restart_count = parse_int_var(lookup, "TORCHELASTIC_RESTART_COUNT", 0, INT_MAX);
}

// TORCHELASTIC_USE_AGENT_STORE, as PyTorch reads it (unset: false).
bool read_use_agent_store(const Lookup& lookup) {
  const char* v = lookup("TORCHELASTIC_USE_AGENT_STORE");
  if (!v) return false;
  const std::string s = v;
  if (s == "True" || s == "true" || s == "1") return true;
  if (s != "False" && s != "false" && s != "0")
    throw EnvError("TORCHELASTIC_USE_AGENT_STORE='" + s + "': expected True or False");
  return false;
}

// TORCHELASTIC_RUN_ID, else the launcher's (srun's step, mpirun's job).
void read_run_id(const Lookup& lookup, const Launch& l, WorkerEnv* env) {
  if (const char* v = lookup("TORCHELASTIC_RUN_ID")) {
    env->run_id = v;
    if (env->run_id.empty()) throw EnvError("TORCHELASTIC_RUN_ID is set but empty");
  } else if (!l.run_id.empty()) {
    env->run_id = l.run_id;
  }
}

// Where the store is: env:// from the launcher's MASTER_ADDR/PORT (or its fallbacks), tcp://
// from the URL, file:// a path.
void set_store_location(const InitMethod& m, const Launch& l, bool agent_store, WorkerEnv* env) {
  const Url& u = m.u;
  env->init_method = u.scheme + "://" + u.rest;
  if (u.scheme == "env") {
    if (l.master_addr.empty())
      throw EnvError(
          "env:// needs the store's address: " +
          (l.no_addr_reason.empty() ? std::string("MASTER_ADDR is not set") : l.no_addr_reason));
    if (l.master_port == 0) throw EnvError("env:// needs the store's port: MASTER_PORT is not set");
    env->master_addr = l.master_addr;
    env->master_port = static_cast<uint16_t>(l.master_port);
    env->use_agent_store = agent_store;
    const std::string where = l.addr_origin == "MASTER_ADDR" && l.port_origin == "MASTER_PORT"
                                  ? std::string("MASTER_ADDR/MASTER_PORT")
                                  : l.addr_origin + ", " + l.port_origin;
    env->store_origin =
        where + (agent_store ? "; the agent's store: TORCHELASTIC_USE_AGENT_STORE=True"
                             : "; rank 0 hosts it: TORCHELASTIC_USE_AGENT_STORE is not True");
  } else if (u.scheme == "tcp") {
    std::string host;
    int port = 0;
    parse_host_port(u.rest, m.from, m.url, &host, &port);
    env->master_addr = host;
    env->master_port = static_cast<uint16_t>(port);
    env->use_agent_store = false;
    env->store_origin = m.from + "=" + env->init_method + "; rank 0 hosts it";
  } else {
    const std::string& path = u.rest;
    // file:///abs/path -> /abs/path; file://host/path is not supported (PyTorch ignores the host
    // too, but a host there is almost certainly a mistake).
    if (path.empty() || path[0] != '/')
      throw EnvError(m.from + "='" + m.url + "': expected file:///absolute/path");
    env->store_path = path;
    env->store_origin = m.from + "=" + env->init_method + "; every rank opens the file";
    // master_addr stays empty: Gloo's peers find their own addresses.
    if (!l.master_addr.empty()) env->master_addr = l.master_addr;
  }
}

}  // namespace

WorkerEnv WorkerEnv::parse(const Lookup& lookup) { return parse(lookup, InitOptions{}); }

WorkerEnv WorkerEnv::parse(const Lookup& lookup, const InitOptions& options) {
  WorkerEnv env;
  read_client_settings(lookup, &env);
  const InitMethod m = read_init_method(lookup, options);
  const std::optional<Launch> l = read_launch(lookup, m);
  if (!l) return env;  // standalone: a world of size 1
  env.standalone = false;
  set_identity(m, *l, &env);
  read_role(lookup, &env);
  const bool agent_store = read_use_agent_store(lookup);
  read_run_id(lookup, *l, &env);
  set_store_location(m, *l, agent_store, &env);
  return env;
}

WorkerEnv WorkerEnv::from_environment() { return from_environment(InitOptions{}); }

WorkerEnv WorkerEnv::from_environment(const InitOptions& options) {
  return parse([](const char* name) -> const char* { return std::getenv(name); }, options);
}

}  // namespace trun::worker
