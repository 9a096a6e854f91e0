#include "launcher/cli_config.h"

#include <cctype>
#include <cstring>
#include <optional>
#include <tuple>

#include "agent/job_local.h"
#include "launcher/cli_hang.h"
#include "launcher/cli_health.h"
#include "launcher/cli_values.h"
#include "rendezvous/handler.h"

namespace trun::launcher {
namespace {

using agent::LaunchConfig;
using Notes = std::vector<std::string>;

std::optional<std::string> variable(const Environment& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int parse_nproc_per_node(const std::string& value, const Environment& env, const HostProbe& host) {
  long long n;
  if (parse_int(value, n)) {
    if (n < 1 || n > 4096) {
      throw CliError("--nproc-per-node=" + value +
                     ": expected a positive worker count (1..4096), cpu, gpu, xpu or auto");
    }
    return static_cast<int>(n);
  }
  if (value == "cpu") return host.cpus();
  if (value == "gpu") {
    int g = host.cuda_devices(variable(env, "CUDA_VISIBLE_DEVICES"));
    if (g == 0) {
      throw CliError(
          "--nproc-per-node=gpu: no CUDA device is visible on this host (checked "
          "/proc/driver/nvidia/gpus and CUDA_VISIBLE_DEVICES); use a number or cpu");
    }
    return g;
  }
  if (value == "auto") {
    int g = host.cuda_devices(variable(env, "CUDA_VISIBLE_DEVICES"));
    return g > 0 ? g : host.cpus();
  }
  if (value == "xpu") {
    int x = host.xpu_devices(variable(env, "ZE_AFFINITY_MASK"));
    if (x == 0) {
      throw CliError(
          "--nproc-per-node=xpu: no Intel XPU device is visible on this host (checked "
          "/sys/class/drm/renderD* for Intel devices on the i915 or xe driver, and "
          "ZE_AFFINITY_MASK); use a number or cpu");
    }
    return x;
  }
  throw CliError("--nproc-per-node=" + value +
                 ": expected a positive worker count, cpu, gpu, xpu or auto");
}

// TRAINING_SCRIPT must be there, and must not be an option CLI11 did not know.
void check_script_given(const std::vector<std::string>& rest) {
  if (rest.empty()) {
    throw CliError("missing TRAINING_SCRIPT: usage: trun [options] TRAINING_SCRIPT [args...]");
  }
  if (!rest.front().empty() && rest.front()[0] == '-' && rest.front() != "-") {
    throw CliError("unknown option " + rest.front() + " (see trun --help)");
  }
}

void worker_group(const ResolvedOptions& o, const Environment& env, const HostProbe& host,
                  LaunchConfig& c) {
  parse_nnodes(o.text(Opt::kNnodes), c.min_nodes, c.max_nodes);
  c.nproc_per_node = parse_nproc_per_node(o.text(Opt::kNprocPerNode), env, host);
  c.virtual_local_rank = o.flag(Opt::kVirtualLocalRank);
  if (const auto cvd = variable(env, "CUDA_VISIBLE_DEVICES"); c.virtual_local_rank && cvd) {
    for (const auto& d : split(*cvd, ',')) c.visible_devices.push_back(trim(d));
    if (static_cast<size_t>(c.nproc_per_node) > c.visible_devices.size()) {
      throw CliError("--virtual-local-rank: " + std::to_string(c.nproc_per_node) +
                     " workers per node, but CUDA_VISIBLE_DEVICES=" + *cvd + " lists " +
                     std::to_string(c.visible_devices.size()) +
                     " device(s), one per worker is needed");
    }
  }
  c.max_restarts = static_cast<int>(whole_number("--max-restarts", o.text(Opt::kMaxRestarts), 0,
                                                 1000000, "a number >= 0 (up to 1000000)"));
  if (o.text(Opt::kRole).empty()) throw CliError("--role=: expected a non-empty name");
  c.role = o.text(Opt::kRole);
}

// The backend's name, and --rdzv-conf checked for every backend with the backend's own options
// (etcd's endpoint list), so that a bad entry is a usage error before anything runs.
void rendezvous_conf(const ResolvedOptions& o, LaunchConfig& c, Notes& notes) {
  const std::string& backend = o.text(Opt::kRdzvBackend);
  const auto kind = rendezvous::parse_backend_kind(backend);
  if (!kind) {
    throw CliError("--rdzv-backend=" + backend +
                   ": unknown backend; expected one of static, c10d, etcd, etcd-v2");
  }
  c.rdzv.backend = *kind;
  auto& entries = c.rdzv.conf_entries;
  try {
    entries = rendezvous::parse_rdzv_conf(o.text(Opt::kRdzvConf));
    // As torchrun, which hands the whole map to the backend and lets it read what it knows
    // (a Kubeflow elasticPolicy passes keys of its own): unknown keys are dropped, with one
    // warning naming them, so that a typo does not go unnoticed.
    std::string unknown;
    for (auto it = entries.begin(); it != entries.end();) {
      if (rendezvous::is_rdzv_conf_key(it->first)) {
        ++it;
        continue;
      }
      unknown += (unknown.empty() ? "'" : ", '") + it->first + "'";
      it = entries.erase(it);
    }
    if (!unknown.empty()) {
      notes.push_back("--rdzv-conf: ignoring unknown key(s) " + unknown +
                      " (trun reads join_timeout, timeout, last_call_timeout, close_timeout, "
                      "keep_alive_interval, keep_alive_max_attempt, read_timeout, is_host, "
                      "failover, store_type, "
                      "use_libuv, etcd_prefix, protocol)");
    }
    c.rdzv.conf = rendezvous::read_rdzv_conf(entries);
    rendezvous::RendezvousOptions checked;
    rendezvous::apply_rdzv_conf(c.rdzv.conf, &checked);
    checked.endpoint = o.text(Opt::kRdzvEndpoint);
    // --standalone means static.
    rendezvous::check_backend_options(o.flag(Opt::kStandalone) ? "static" : backend, checked);
  } catch (const rendezvous::RendezvousOptionError& e) {
    throw CliError(e.what());
  }
}

// Without --standalone: the backend, its endpoint and the node count and rank it allows.
void rendezvous_backend(const ResolvedOptions& o, LaunchConfig& c) {
  const std::string& backend = o.text(Opt::kRdzvBackend);
  const std::string& endpoint = o.text(Opt::kRdzvEndpoint);
  const std::string& nnodes = o.text(Opt::kNnodes);
  c.rdzv.endpoint = endpoint;
  c.run_id = o.text(Opt::kRdzvId);
  const bool dynamic = c.rdzv.backend != rendezvous::BackendKind::kStatic;  // c10d, etcd
  if (dynamic) {
    if (endpoint.empty()) {
      throw CliError(c.rdzv.backend == rendezvous::BackendKind::kC10d
                         ? "--rdzv-backend=c10d needs --rdzv-endpoint=HOST[:PORT] (the store is "
                           "hosted by the node whose address matches it)"
                         : "--rdzv-backend=" + backend +
                               " needs --rdzv-endpoint=HOST[:PORT] (etcd's client URL)");
    }
    if (c.max_nodes > 1 && c.run_id == "none") {
      throw CliError(
          "--rdzv-id is required for a multi-node " + backend + " job (--nnodes=" + nnodes +
          "): give every node the same job id, e.g. --rdzv-id=myjob-1; the default 'none' "
          "lets two jobs on the same store collide");
    }
    // The rest is validated by the rendezvous module when the agent creates the handler.
  } else if (c.min_nodes != c.max_nodes) {
    throw CliError("--nnodes=" + nnodes +
                   ": the static backend needs a fixed node count, not a range");
  }
  if (c.rdzv.node_rank >= c.max_nodes) {
    throw CliError("--node-rank=" + o.text(Opt::kNodeRank) + ": expected 0.." +
                   std::to_string(c.max_nodes - 1) + " for --nnodes=" + nnodes);
  }
  if (!endpoint.empty() && !dynamic) {
    auto colon = endpoint.rfind(':');
    long long port;
    if (colon == std::string::npos || colon == 0 || !parse_int(endpoint.substr(colon + 1), port) ||
        port < 0 || port > 65535) {
      throw CliError("--rdzv-endpoint=" + endpoint + ": expected HOST:PORT");
    }
    std::string host = endpoint.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    c.rdzv.master_addr = host;
    c.rdzv.master_port = static_cast<int>(port);
  }
  if (!dynamic && c.rdzv.master_port == 0 && c.max_nodes > 1) {
    throw CliError("--master-port=0 picks a free port and only works with --nnodes=1");
  }
}

void check_run_id(const std::string& run_id) {
  if (run_id.empty()) {
    throw CliError(
        "--rdzv-id=: an empty job id (torchrun would make up a random one, which other nodes "
        "cannot know); give every node the same id of letters, digits, '.', '_' and '-'");
  }
  if (run_id.size() > agent::kMaxRunIdBytes) {
    // Not echoed: it may be 100 KiB.
    throw CliError("--rdzv-id: " + std::to_string(run_id.size()) + " bytes; a job id has at most " +
                   std::to_string(agent::kMaxRunIdBytes) +
                   " (it names the log directory DIR/<run id> and is part of every "
                   "rendezvous store key)");
  }
  bool ok = true;
  for (char ch : run_id) {
    ok =
        ok && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-');
  }
  if (!ok) {
    throw CliError("--rdzv-id=" + run_id +
                   ": expected a non-empty id of letters, digits, '.', '_' and '-'");
  }
}

void rendezvous(const ResolvedOptions& o, const Environment& env, LaunchConfig& c, Notes& notes) {
  rendezvous_conf(o, c, notes);
  c.rdzv.master_port = static_cast<int>(
      whole_number("--master-port", o.text(Opt::kMasterPort), 0, 65535, "a port number 0..65535"));
  if (o.text(Opt::kMasterAddr).empty()) {
    throw CliError("--master-addr=: expected a host name or address");
  }
  c.rdzv.master_addr = o.text(Opt::kMasterAddr);
  c.rdzv.local_addr = o.text(Opt::kLocalAddr);
  c.rdzv.store_token = variable(env, "TRUN_STORE_TOKEN").value_or("");
  c.rdzv.node_rank = static_cast<int>(
      whole_number("--node-rank", o.text(Opt::kNodeRank), 0, 1000000, "a node rank >= 0"));
  c.standalone = o.flag(Opt::kStandalone);
  if (c.standalone) {
    // As torchrun: --standalone overrides the rendezvous settings.
    if (c.max_nodes != 1) {
      throw CliError("--standalone runs on one node; got --nnodes=" + o.text(Opt::kNnodes));
    }
    c.rdzv.backend = rendezvous::BackendKind::kStatic;
    c.rdzv.node_rank = 0;
    c.run_id.clear();  // generated by the agent
  } else {
    rendezvous_backend(o, c);
    check_run_id(c.run_id);
  }
}

void supervision(const ResolvedOptions& o, const Environment& env, const HostProbe& host,
                 LaunchConfig& c, Notes& notes) {
  const std::string& monitor = o.text(Opt::kMonitorInterval);
  double mi;
  if (!parse_double(monitor, mi) || mi <= 0 || mi > 1e7) {
    throw CliError("--monitor-interval=" + monitor +
                   ": expected a positive number of seconds (at most 1e7)");
  }
  c.monitor_interval = std::chrono::milliseconds(static_cast<long long>(mi * 1000));
  const std::string& start_method = o.text(Opt::kStartMethod);
  if (start_method != "spawn" && start_method != "fork" && start_method != "forkserver") {
    throw CliError("--start-method=" + start_method + ": expected spawn, fork or forkserver");
  }
  if (start_method != "spawn") {
    notes.push_back("--start-method=" + start_method +
                    " is ignored: trun always starts workers as new programs (exec)");
  }
  if (o.text(Opt::kEventLogHandler) != "null") {
    throw CliError("--event-log-handler=" + o.text(Opt::kEventLogHandler) +
                   ": torchrun's event handlers are Python plug-ins, which trun cannot "
                   "load; leave it out (trun logs its events on stderr, and --event-log FILE "
                   "writes them as torchelastic Event JSON lines)");
  }
  if (!o.text(Opt::kLogsSpecs).empty()) {
    throw CliError("--logs-specs=" + o.text(Opt::kLogsSpecs) +
                   ": torchrun's logs specs are Python entry points, which trun cannot "
                   "load; leave it out and use --log-dir, --redirects, --tee and "
                   "--local-ranks-filter (torchrun's default layout)");
  }
  if (o.given(Opt::kNumaBinding) && o.text(Opt::kNumaBinding).empty()) {
    throw CliError("--numa-binding=: expected none, node, socket, exclusive or core-complex");
  }
  try {
    c.numa_binding = agent::parse_numa_mode(o.text(Opt::kNumaBinding));
    if (c.numa_binding != agent::NumaMode::kNone) {
      const agent::CpuTopology topology = host.cpu_topology(variable(env, "CUDA_VISIBLE_DEVICES"));
      c.numa_bindings = agent::plan_numa_bindings(topology, c.numa_binding, c.nproc_per_node);
    }
  } catch (const std::exception& e) {
    throw CliError(e.what());
  }
  c.shutdown_timeout =
      parse_seconds(o.origin(Opt::kShutdownTimeout), o.text(Opt::kShutdownTimeout), true);
  c.exit_barrier_timeout =
      parse_seconds("--exit-barrier-timeout", o.text(Opt::kExitBarrierTimeout), true);
  c.signals_to_handle = parse_signals(o.text(Opt::kSignalsToHandle));
  c.signals_to_handle_text = o.text(Opt::kSignalsToHandle);
}

void logs(const ResolvedOptions& o, LaunchConfig& c, Notes& notes) {
  c.log_dir = o.text(Opt::kLogDir);
  c.event_log = o.text(Opt::kEventLog);
  // The option, else TORCHELASTIC_HEALTH_CHECK_PORT (launcher/cli_resolve.h), else none.
  if (const std::string& text = o.text(Opt::kMetricsPort); !text.empty()) {
    long long v;
    if (!parse_int(text, v) || v < 0 || v > 65535) {
      throw CliError(o.origin(Opt::kMetricsPort) + "=" + text +
                     ": expected a port number 0..65535 (0: a free port)");
    }
    c.metrics_port = static_cast<int>(v);
  }
  c.redirects = parse_std("--redirects", o.text(Opt::kRedirects));
  c.tee = parse_std("--tee", o.text(Opt::kTee));
  c.duplicate_stdout_filters = parse_filters(o.text(Opt::kDuplicateStdoutFilters));
  c.duplicate_stderr_filters = parse_filters(o.text(Opt::kDuplicateStderrFilters));
  for (const auto& [name, filters, stream] :
       {std::tuple<const char*, const std::vector<std::string>&, int>{
            "--duplicate-stdout-filters", c.duplicate_stdout_filters, agent::kStdOut},
        {"--duplicate-stderr-filters", c.duplicate_stderr_filters, agent::kStdErr}}) {
    if (filters.empty()) continue;
    bool teed = (c.tee.all & stream) != 0;
    for (const auto& [rank, mode] : c.tee.per_rank) teed = teed || (mode & stream) != 0;
    if (!teed) {
      notes.push_back(std::string(name) +
                      " has no effect: it copies lines of tee'd streams, and --tee does not "
                      "cover this one");
    } else if (c.log_dir.empty()) {
      notes.push_back(std::string(name) +
                      ": without --log-dir the filtered file is in a temporary directory "
                      "removed when trun exits");
    }
  }
  const std::string& ranks_filter = o.text(Opt::kLocalRanksFilter);
  if (!trim(ranks_filter).empty()) c.local_ranks_filter = parse_ranks_filter(ranks_filter);
  c.log_line_prefix_template = o.text(Opt::kLogLinePrefixTemplate);
}

// A program found the way execvp would through $PATH (`program` has no '/').
bool in_path(const std::string& program, const Environment& env, const HostProbe& host) {
  const auto path = variable(env, "PATH");
  for (const auto& dir : split(path ? *path : "/usr/local/bin:/usr/bin:/bin", ':')) {
    const FileFacts f = host.file((dir.empty() ? "." : dir) + "/" + program);
    if (f.error == 0 && f.regular && f.executable) return true;
  }
  return false;
}

// What to run: the interpreter (for Python), the script and its arguments.
void entrypoint(const ResolvedOptions& o, const std::vector<std::string>& rest,
                const Environment& env, const HostProbe& host, LaunchConfig& c) {
  const std::string& script = rest.front();
  const bool module = o.flag(Opt::kModule);
  if (module && o.flag(Opt::kNoPython)) {
    throw CliError("--module and --no-python cannot be combined");
  }
  const bool use_python =
      module || o.flag(Opt::kRunPath) || (!o.flag(Opt::kNoPython) && ends_with(script, ".py"));
  if (!module) {
    if (use_python || script.find('/') != std::string::npos) {
      const FileFacts f = host.file(script);
      if (f.error != 0) {
        throw CliError("training script " + script + " not found: " + std::strerror(f.error));
      }
      if (f.directory) throw CliError("training script " + script + " is a directory");
      if (!use_python && !f.executable) {
        throw CliError("training script " + script +
                       " is not executable (chmod +x it, or run a .py file)");
      }
    } else if (!in_path(script, env, host)) {
      throw CliError("training program " + script + " not found in PATH");
    }
  }
  if (use_python) {
    const auto py = variable(env, "PYTHON_EXEC");
    c.entrypoint.push_back(py && !py->empty() ? *py : "python3");
    c.python_interpreter = c.entrypoint.back();
    c.entrypoint.push_back("-u");
    if (module) c.entrypoint.push_back("-m");
  }
  c.entrypoint.push_back(script);
  // The bare flag reads as "true" (CLI11), PET_LEGACY_LAUNCH=1 as "1".
  std::string legacy_launch = o.text(Opt::kLegacyLaunch);
  if (legacy_launch == "true" || legacy_launch == "1") legacy_launch = "underscore";
  if (legacy_launch == "false" || legacy_launch == "0") legacy_launch.clear();
  if (!legacy_launch.empty() && legacy_launch != "underscore" && legacy_launch != "dash") {
    throw CliError("--legacy-launch=" + legacy_launch +
                   ": expected underscore (--local_rank=N, the default) or dash "
                   "(--local-rank=N)");
  }
  if (!legacy_launch.empty() && !o.flag(Opt::kUseEnv)) {
    // Where torch.distributed.launch puts it: before the script's own arguments, as a macro
    // the agent replaces per worker (agent/worker_env.h).
    c.entrypoint.push_back(std::string(legacy_launch == "dash" ? "--local-rank" : "--local_rank") +
                           "=${local_rank}");
  }
  c.entrypoint.insert(c.entrypoint.end(), rest.begin() + 1, rest.end());
  c.entrypoint_name = script;  // as torchrun titles its summary
}

}  // namespace

BuiltConfig build_launch_config(const ResolvedOptions& options, std::vector<std::string> rest,
                                const Environment& env, const HostProbe& host) {
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  check_script_given(rest);
  BuiltConfig out;
  worker_group(options, env, host, out.config);
  rendezvous(options, env, out.config, out.notes);
  supervision(options, env, host, out.config, out.notes);
  hang_detection(options, out.config);
  health_options(options, out.config);
  logs(options, out.config, out.notes);
  entrypoint(options, rest, env, host, out.config);
  return out;
}

}  // namespace trun::launcher
