#include "launcher/slurm_options.h"

#include <algorithm>
#include <utility>

#include "base/hostlist.h"
#include "base/slurm.h"

namespace trun::launcher {
namespace {

// Strict unsigned decimal: the whole string, at most 19 digits.
bool parse_unsigned(const std::string& s, unsigned long long& out) {
  if (s.empty() || s.size() > 19) return false;
  unsigned long long v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<unsigned long long>(c - '0');
  }
  out = v;
  return true;
}

struct Var {
  std::string name;
  std::string value;
};

// The first of `names` that is set (and not empty).
std::optional<Var> first_set(const EnvLookup& env, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (auto v = env(n); v && !v->empty()) return Var{n, *v};
  }
  return std::nullopt;
}

[[noreturn]] void bad_variable(const Var& v, const std::string& expected) {
  throw SlurmOptionError(v.name + "=" + v.value + ": " + expected);
}

unsigned long long unsigned_var(const Var& v, const std::string& expected) {
  unsigned long long n;
  if (!parse_unsigned(v.value, n)) bad_variable(v, expected);
  return n;
}

// --nnodes as given: N or MIN:MAX. False when it is not of that form (the launcher's own check
// then reports it).
bool parse_nnodes_range(const std::string& text, unsigned long long& lo, unsigned long long& hi) {
  auto colon = text.find(':');
  if (colon == std::string::npos) {
    if (!parse_unsigned(text, lo)) return false;
    hi = lo;
    return true;
  }
  return parse_unsigned(text.substr(0, colon), lo) && parse_unsigned(text.substr(colon + 1), hi);
}

// An option derived from `from`, named as the launcher names it.
SlurmDerived derived(Opt id, std::string value, std::vector<std::string> from,
                     bool presence = false, std::string detail = "") {
  return {id, flag_name(id), std::move(value), std::move(from), presence, std::move(detail)};
}

}  // namespace

std::string describe(const SlurmDerived& d) {
  std::string s = d.option + "=" + d.value + " (";
  for (size_t i = 0; i < d.from.size(); ++i) s += (i ? ", " : "") + d.from[i];
  if (d.presence) s += " set";
  if (!d.detail.empty()) s += (d.from.empty() ? "" : "; ") + d.detail;
  return s + ")";
}

SlurmOptions derive_slurm_options(const EnvLookup& env, const GivenOptions& given) {
  SlurmOptions out;
  const auto job = first_set(env, {"SLURM_JOB_ID"});
  if (!job) return out;
  out.job_id = job->value;
  if (const auto flag = first_set(env, {"TRUN_SLURM"})) {
    if (flag->value == "0") {
      out.context = SlurmContext::kDisabled;
      return out;
    }
    if (flag->value != "1") bad_variable(*flag, "expected 0 (ignore SLURM's environment) or 1");
  }
  const unsigned long long job_id = unsigned_var(*job, "expected a numeric job id");

  const auto step = first_set(env, {"SLURM_STEP_ID"});
  unsigned long long step_id = 0;
  if (step) {
    out.step_id = step->value;
    step_id = unsigned_var(*step, "expected a numeric step id");
  }
  if (!step || !base::is_srun_step_id(step->value)) {
    out.context = SlurmContext::kOutsideStep;
    out.log_line = "in SLURM job " + job->value + " but not in an srun step (" +
                   (step ? "SLURM_STEP_ID=" + step->value + " is the batch or extern step"
                         : std::string("SLURM_STEP_ID is unset")) +
                   "): deriving no options from SLURM; start trun with srun, one per node "
                   "(docs/slurm.md)";
    return out;
  }
  out.context = SlurmContext::kStep;
  const std::string run_id = job->value + "." + step->value;

  // This node's place in the step, and the step's size.
  std::optional<unsigned long long> node_id;
  const auto node_var = first_set(env, {"SLURM_NODEID"});
  if (node_var)
    node_id = unsigned_var(*node_var, "expected this node's index in the step (0, 1, ...)");

  const auto count_var = first_set(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES"});
  std::optional<unsigned long long> nodes;
  if (count_var) {
    nodes = unsigned_var(*count_var, "expected the step's node count (a positive number)");
    if (*nodes == 0 || *nodes > base::kMaxHosts) {
      bad_variable(*count_var, "expected the step's node count (a positive number)");
    }
  }
  // srun always sets SLURM_STEP_NODELIST in a step. Set but empty, it names no host: the job's
  // list is not a stand-in (the step may run on some of the job's nodes only), and the endpoint
  // cannot be derived from it (reported below, where it is needed).
  const auto step_list = env("SLURM_STEP_NODELIST");
  const bool empty_step_list = step_list && step_list->empty();
  const auto list_var =
      empty_step_list
          ? std::nullopt
          : first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  std::vector<std::string> hosts;
  if (list_var) {
    try {
      hosts = base::expand_hostlist(list_var->value);
    } catch (const std::invalid_argument& e) {
      bad_variable(*list_var, e.what());
    }
    if (list_var->name == "SLURM_STEP_NODELIST" && nodes && hosts.size() != *nodes) {
      throw SlurmOptionError(list_var->name + "=" + list_var->value + " lists " +
                             std::to_string(hosts.size()) + " hosts, but " + count_var->name + "=" +
                             count_var->value);
    }
    if (!nodes) nodes = hosts.size();
  }
  // Where the node count came from, "NAME=VALUE", for messages.
  const std::string nodes_given = count_var  ? count_var->name + "=" + count_var->value
                                  : list_var ? list_var->name + "=" + list_var->value
                                             : std::string();
  if (node_id && nodes && *node_id >= *nodes) {
    throw SlurmOptionError(node_var->name + "=" + node_var->value + " is not a node of the step (" +
                           nodes_given + ")");
  }

  // One trun per node: trun itself starts the node's workers.
  if (const auto tasks_var =
          first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})) {
    std::vector<int> tasks;
    try {
      tasks = base::expand_tasks_per_node(tasks_var->value);
    } catch (const std::invalid_argument& e) {
      bad_variable(*tasks_var, e.what());
    }
    int here = 0;
    if (node_id && *node_id < tasks.size()) {
      here = tasks[*node_id];
    } else if (!node_id) {
      here = *std::max_element(tasks.begin(), tasks.end());
    }
    if (here > 1) {
      throw SlurmOptionError(
          "srun started " + std::to_string(here) + " trun processes on this node (" +
          tasks_var->name + "=" + tasks_var->value +
          "): use --ntasks-per-node=1 (one trun per node; it starts --nproc-per-node workers "
          "itself), or set TRUN_SLURM=0 to run several on purpose");
    }
  }

  const std::string nodes_text = nodes ? std::to_string(*nodes) : "";
  const std::string nodes_source =
      count_var ? count_var->name : (list_var ? list_var->name : std::string());
  if (given.standalone && nodes && *nodes > 1) {
    throw SlurmOptionError("--standalone runs on one node, but this srun step has " + nodes_text +
                           " nodes (" + nodes_given +
                           "): leave --standalone out and trun meets the other nodes at the "
                           "step's first node");
  }
  if (given.nnodes && nodes) {
    unsigned long long lo, hi;
    if (parse_nnodes_range(*given.nnodes, lo, hi) && (*nodes < lo || *nodes > hi)) {
      throw SlurmOptionError("--nnodes=" + *given.nnodes + " contradicts " + nodes_given +
                             ": this srun step has " + nodes_text +
                             " nodes (leave --nnodes out, or give a count or range that includes " +
                             nodes_text + ")");
    }
  }

  if (!given.standalone) {
    std::string backend = given.rdzv_backend.value_or("c10d");
    if (!given.rdzv_backend) {
      out.derived.push_back(derived(Opt::kRdzvBackend, "c10d", {"SLURM_STEP_ID"}, true));
    }
    if (!given.rdzv_id) {
      out.derived.push_back(derived(Opt::kRdzvId, run_id, {"SLURM_JOB_ID", "SLURM_STEP_ID"}));
    }
    if (!given.nnodes && nodes) {
      out.derived.push_back(derived(Opt::kNnodes, nodes_text, {nodes_source}));
    }
    if (backend == "static" && node_id) {
      if (!given.node_rank) {
        out.derived.push_back(derived(Opt::kNodeRank, std::to_string(*node_id), {node_var->name}));
      } else if (unsigned long long r; !parse_unsigned(*given.node_rank, r) || r != *node_id) {
        throw SlurmOptionError("--node-rank=" + *given.node_rank + " contradicts " +
                               node_var->name + "=" + node_var->value +
                               " (the static backend needs this node's rank in the step; leave "
                               "--node-rank out)");
      }
    }
    const bool endpoint_applies =
        backend == "c10d" || (backend == "static" && !given.master_addr && !given.master_port);
    if (!given.rdzv_endpoint && endpoint_applies && empty_step_list) {
      throw SlurmOptionError(
          "SLURM_STEP_NODELIST is set but empty, so the step's first host (where the " +
          std::string(backend == "c10d" ? "c10d store" : "static backend's node 0") +
          " runs) is unknown and --rdzv-endpoint cannot be derived: give --rdzv-endpoint=HOST:PORT "
          "(the same on every node), or run trun under srun, which sets it");
    }
    if (!given.rdzv_endpoint && endpoint_applies && !hosts.empty()) {
      const uint16_t port = base::slurm_port(job_id, step_id);
      out.derived.push_back(derived(
          Opt::kRdzvEndpoint, hosts.front() + ":" + std::to_string(port), {list_var->name}, false,
          "port " + std::to_string(base::kSlurmPortBase) + "+(" + job->value + " mod " +
              std::to_string(base::kSlurmPortJobs) + ")*" + std::to_string(base::kSlurmPortSteps) +
              "+" +
              (base::kSlurmPortSteps > step_id
                   ? step->value
                   : "(" + step->value + " mod " + std::to_string(base::kSlurmPortSteps) + ")")));
    }
  }
  if (!given.signals_to_handle) {
    out.derived.push_back(derived(Opt::kSignalsToHandle, kSlurmSignals, {"SLURM_STEP_ID"}, true,
                                  "SIGUSR1 added: scancel --signal=USR1 reaches the workers"));
  }

  if (out.derived.empty()) {
    out.log_line =
        "in SLURM step " + run_id + ": every option SLURM implies was given; derived none";
  } else {
    out.log_line = "from SLURM: ";
    for (size_t i = 0; i < out.derived.size(); ++i) {
      out.log_line += (i ? ", " : "") + describe(out.derived[i]);
    }
  }
  return out;
}

}  // namespace trun::launcher
