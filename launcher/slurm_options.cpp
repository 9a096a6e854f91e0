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

// An srun step as SLURM's variables describe it, checked.
struct Step {
  Var job, step;
  unsigned long long job_id = 0, step_id = 0;
  std::optional<Var> node_var;  // SLURM_NODEID
  std::optional<unsigned long long> node_id;
  std::optional<Var> count_var;  // the step's node count
  std::optional<Var> list_var;   // the step's (or the job's) host list
  std::optional<unsigned long long> nodes;
  bool empty_step_list = false;  // SLURM_STEP_NODELIST set but empty
  std::vector<std::string> hosts;
  std::string nodes_given;   // where the node count came from, "NAME=VALUE", for messages
  std::string nodes_text;    // the node count, "" when unknown
  std::string nodes_source;  // the variable it came from
};

// This node's place in the step, and the step's size.
void read_step_shape(const EnvLookup& env, Step& s) {
  s.node_var = first_set(env, {"SLURM_NODEID"});
  if (s.node_var) {
    s.node_id = unsigned_var(*s.node_var, "expected this node's index in the step (0, 1, ...)");
  }
  s.count_var = first_set(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES"});
  if (s.count_var) {
    s.nodes = unsigned_var(*s.count_var, "expected the step's node count (a positive number)");
    if (*s.nodes == 0 || *s.nodes > base::kMaxHosts) {
      bad_variable(*s.count_var, "expected the step's node count (a positive number)");
    }
  }
  // srun always sets SLURM_STEP_NODELIST in a step. Set but empty, it names no host: the job's
  // list is not a stand-in (the step may run on some of the job's nodes only), and the endpoint
  // cannot be derived from it (reported by derive(), where it is needed).
  const auto step_list = env("SLURM_STEP_NODELIST");
  s.empty_step_list = step_list && step_list->empty();
  s.list_var =
      s.empty_step_list
          ? std::nullopt
          : first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (s.list_var) {
    try {
      s.hosts = base::expand_hostlist(s.list_var->value);
    } catch (const std::invalid_argument& e) {
      bad_variable(*s.list_var, e.what());
    }
    if (s.list_var->name == "SLURM_STEP_NODELIST" && s.nodes && s.hosts.size() != *s.nodes) {
      throw SlurmOptionError(s.list_var->name + "=" + s.list_var->value + " lists " +
                             std::to_string(s.hosts.size()) + " hosts, but " + s.count_var->name +
                             "=" + s.count_var->value);
    }
    if (!s.nodes) s.nodes = s.hosts.size();
  }
  s.nodes_given = s.count_var  ? s.count_var->name + "=" + s.count_var->value
                  : s.list_var ? s.list_var->name + "=" + s.list_var->value
                               : std::string();
  if (s.node_id && s.nodes && *s.node_id >= *s.nodes) {
    throw SlurmOptionError(s.node_var->name + "=" + s.node_var->value +
                           " is not a node of the step (" + s.nodes_given + ")");
  }
  s.nodes_text = s.nodes ? std::to_string(*s.nodes) : "";
  s.nodes_source =
      s.count_var ? s.count_var->name : (s.list_var ? s.list_var->name : std::string());
}

// One trun per node: trun itself starts the node's workers.
void check_one_task_per_node(const EnvLookup& env, const Step& s) {
  const auto tasks_var = first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  if (!tasks_var) return;
  std::vector<int> tasks;
  try {
    tasks = base::expand_tasks_per_node(tasks_var->value);
  } catch (const std::invalid_argument& e) {
    bad_variable(*tasks_var, e.what());
  }
  int here = 0;
  if (s.node_id && *s.node_id < tasks.size()) {
    here = tasks[*s.node_id];
  } else if (!s.node_id) {
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

Step read_step(const EnvLookup& env, const Var& job, unsigned long long job_id, const Var& step,
               unsigned long long step_id) {
  Step s;
  s.job = job;
  s.step = step;
  s.job_id = job_id;
  s.step_id = step_id;
  read_step_shape(env, s);
  check_one_task_per_node(env, s);
  return s;
}

// The options the user gave that contradict the step.
void check_given(const Step& s, const GivenOptions& given) {
  if (given.standalone && s.nodes && *s.nodes > 1) {
    throw SlurmOptionError("--standalone runs on one node, but this srun step has " + s.nodes_text +
                           " nodes (" + s.nodes_given +
                           "): leave --standalone out and trun meets the other nodes at the "
                           "step's first node");
  }
  if (given.nnodes && s.nodes) {
    unsigned long long lo, hi;
    if (parse_nnodes_range(*given.nnodes, lo, hi) && (*s.nodes < lo || *s.nodes > hi)) {
      throw SlurmOptionError("--nnodes=" + *given.nnodes + " contradicts " + s.nodes_given +
                             ": this srun step has " + s.nodes_text +
                             " nodes (leave --nnodes out, or give a count or range that includes " +
                             s.nodes_text + ")");
    }
  }
}

// The c10d store (or the static backend's node 0) on the step's first host, at the port the
// job and step ids give (base/slurm.h).
SlurmDerived endpoint(const Step& s) {
  const uint16_t port = base::slurm_port(s.job_id, s.step_id);
  return derived(
      Opt::kRdzvEndpoint, s.hosts.front() + ":" + std::to_string(port), {s.list_var->name}, false,
      "port " + std::to_string(base::kSlurmPortBase) + "+(" + s.job.value + " mod " +
          std::to_string(base::kSlurmPortJobs) + ")*" + std::to_string(base::kSlurmPortSteps) +
          "+" +
          (base::kSlurmPortSteps > s.step_id
               ? s.step.value
               : "(" + s.step.value + " mod " + std::to_string(base::kSlurmPortSteps) + ")"));
}

// What the step implies for the options the user did not give.
std::vector<SlurmDerived> derive(const Step& s, const GivenOptions& given) {
  std::vector<SlurmDerived> out;
  if (!given.standalone) {
    std::string backend = given.rdzv_backend.value_or("c10d");
    if (!given.rdzv_backend) {
      out.push_back(derived(Opt::kRdzvBackend, "c10d", {"SLURM_STEP_ID"}, true));
    }
    if (!given.rdzv_id) {
      out.push_back(derived(Opt::kRdzvId, s.job.value + "." + s.step.value,
                            {"SLURM_JOB_ID", "SLURM_STEP_ID"}));
    }
    if (!given.nnodes && s.nodes) {
      out.push_back(derived(Opt::kNnodes, s.nodes_text, {s.nodes_source}));
    }
    if (backend == "static" && s.node_id) {
      if (!given.node_rank) {
        out.push_back(derived(Opt::kNodeRank, std::to_string(*s.node_id), {s.node_var->name}));
      } else if (unsigned long long r; !parse_unsigned(*given.node_rank, r) || r != *s.node_id) {
        throw SlurmOptionError("--node-rank=" + *given.node_rank + " contradicts " +
                               s.node_var->name + "=" + s.node_var->value +
                               " (the static backend needs this node's rank in the step; leave "
                               "--node-rank out)");
      }
    }
    const bool endpoint_applies =
        backend == "c10d" || (backend == "static" && !given.master_addr && !given.master_port);
    if (!given.rdzv_endpoint && endpoint_applies && s.empty_step_list) {
      throw SlurmOptionError(
          "SLURM_STEP_NODELIST is set but empty, so the step's first host (where the " +
          std::string(backend == "c10d" ? "c10d store" : "static backend's node 0") +
          " runs) is unknown and --rdzv-endpoint cannot be derived: give --rdzv-endpoint=HOST:PORT "
          "(the same on every node), or run trun under srun, which sets it");
    }
    if (!given.rdzv_endpoint && endpoint_applies && !s.hosts.empty()) {
      out.push_back(endpoint(s));
    }
  }
  if (!given.signals_to_handle) {
    out.push_back(derived(Opt::kSignalsToHandle, kSlurmSignals, {"SLURM_STEP_ID"}, true,
                          "SIGUSR1 added: scancel --signal=USR1 reaches the workers"));
  }
  return out;
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
  const Step s = read_step(env, *job, job_id, *step, step_id);
  check_given(s, given);
  out.derived = derive(s, given);

  const std::string run_id = job->value + "." + step->value;
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
