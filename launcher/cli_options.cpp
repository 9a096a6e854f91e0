#include "launcher/cli_options.h"

#include <cctype>

#include "base/check.h"

namespace trun::launcher {
namespace {

constexpr const char* kGroup = "Worker group";
constexpr const char* kRdzv = "Rendezvous";
constexpr const char* kRun = "What to run";
constexpr const char* kLogs = "Logs";
constexpr const char* kSup = "Supervision";
constexpr const char* kLegacy = "Node and master (static)";
constexpr const char* kHang = "Hang detection (docs/hangs.md; a trun extension)";
constexpr const char* kHealth = "Health and crash loops (docs/health.md; a trun extension)";

constexpr OptKind kValue = OptKind::kValue;
constexpr OptKind kFlag = OptKind::kFlag;

}  // namespace

// One flat table, one row per option in --help order: longer than a function should be, but
// there is nothing in it to read but the rows.
const std::vector<OptionDecl>& option_table() {
  static const std::vector<OptionDecl> kTable = {
      {Opt::kNnodes, "nnodes", '\0', kValue, "1:1", kGroup,
       "Number of nodes N, or a range MIN:MAX"},
      {Opt::kNprocPerNode, "nproc-per-node", '\0', kValue, "1", kGroup,
       "Workers on this node: a number, cpu (one per CPU), gpu (one per visible CUDA device), "
       "xpu (one per visible Intel GPU) or auto (gpu if any, else cpu)"},
      {Opt::kRole, "role", '\0', kValue, "default", kGroup,
       "Name of the workers' role (ROLE_NAME, and the log line prefix)"},
      {Opt::kVirtualLocalRank, "virtual-local-rank", '\0', kFlag, "", kGroup,
       "Each worker sees only its own GPU: LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to the "
       "local rank's entry of this process's CUDA_VISIBLE_DEVICES (or the local rank)"},
      {Opt::kMaxRestarts, "max-restarts", '\0', kValue, "0", kGroup,
       "Restarts of the whole worker group allowed after a failure before the job fails"},

      {Opt::kStandalone, "standalone", '\0', kFlag, "", kRdzv,
       "Single node: host the rendezvous store inside trun on a free port with a generated run "
       "id (overrides --rdzv-backend/--rdzv-endpoint/--rdzv-id)"},
      {Opt::kRdzvBackend, "rdzv-backend", '\0', kValue, "static", kRdzv,
       "Rendezvous backend: static, c10d (a store hosted by one agent) or etcd (alias etcd-v2: "
       "an etcd cluster's v3 API over plain HTTP)"},
      {Opt::kRdzvEndpoint, "rdzv-endpoint", '\0', kValue, "", kRdzv,
       "Rendezvous endpoint HOST:PORT (c10d: the store; etcd: a client URL, port 2379 by "
       "default, or several members separated by commas; static: defaults to "
       "MASTER_ADDR:MASTER_PORT)"},
      {Opt::kRdzvId, "rdzv-id", '\0', kValue, "none", kRdzv,
       "Job id shared by all nodes (TORCHELASTIC_RUN_ID)"},
      {Opt::kRdzvConf, "rdzv-conf", '\0', kValue, "", kRdzv,
       "Extra rendezvous settings: key1=value1,key2=value2"},

      {Opt::kModule, "module", 'm', kFlag, "", kRun,
       "Run TRAINING_SCRIPT as a Python module (python -m)"},
      {Opt::kDryRun, "dry-run", '\0', kFlag, "", kRun,
       "Print the resolved launch configuration as JSON on stdout and start nothing (a trun "
       "extension)"},
      {Opt::kNoPython, "no-python", '\0', kFlag, "", kRun,
       "Execute TRAINING_SCRIPT directly, even if it ends in .py"},
      {Opt::kRunPath, "run-path", '\0', kFlag, "", kRun,
       "Run TRAINING_SCRIPT with the Python interpreter (torchrun runs it in-process; trun has "
       "no interpreter, so this equals the default for .py files)"},
      {Opt::kLegacyLaunch, "legacy-launch", '\0', OptKind::kTextFlag, "", kRun,
       "As python -m torch.distributed.launch: each worker also gets --local_rank=N before the "
       "script's arguments (=dash: --local-rank=N, torch 2.x's spelling); LOCAL_RANK is set "
       "either way"},
      {Opt::kUseEnv, "use-env", '\0', kFlag, "", kRun,
       "torch.distributed.launch's --use_env: with --legacy-launch, pass the local rank only in "
       "LOCAL_RANK (torchrun's default)"},

      {Opt::kLogDir, "log-dir", '\0', kValue, "", kLogs,
       "Directory for logs: DIR/<run id>/attempt_<n>/<local_rank>/{stdout,stderr}.log and "
       "error.json"},
      {Opt::kEventLog, "event-log", '\0', kValue, "", kLogs,
       "Append one JSON line per rendezvous and agent event to FILE (torchelastic's event "
       "fields: name, source, timestamp, metadata; a trun extension)"},
      {Opt::kMetricsPort, "metrics-port", '\0', kValue, "", kLogs,
       "Serve /metrics (Prometheus) and /healthz over HTTP on this port, 0 for a free one "
       "(printed); default: TORCHELASTIC_HEALTH_CHECK_PORT, else none (a trun extension)"},
      {Opt::kRedirects, "redirects", 'r', kValue, "0", kLogs,
       "Send workers' streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per "
       "local rank like 0:1,1:3"},
      {Opt::kTee, "tee", 't', kValue, "0", kLogs,
       "Like --redirects, but also copy to the console with a [<role><rank>]: prefix"},
      {Opt::kLocalRanksFilter, "local-ranks-filter", '\0', kValue, "", kLogs,
       "Show only these local ranks' output on the console, e.g. 0 or 0,1 (log files keep all)"},
      {Opt::kDuplicateStdoutFilters, "duplicate-stdout-filters", '\0', kValue, "", kLogs,
       "Also append tee'd stdout lines containing any of these comma-separated strings (,, for "
       "a comma) to LOG_DIR/<run id>/attempt_<n>/filtered_stdout.log"},
      {Opt::kDuplicateStderrFilters, "duplicate-stderr-filters", '\0', kValue, "", kLogs,
       "The same for stderr, into filtered_stderr.log"},
      {Opt::kLogsSpecs, "logs-specs", '\0', kValue, "", kLogs,
       "Refused: a Python entry point in torchrun; trun's log layout is torchrun's default"},
      {Opt::kLogLinePrefixTemplate, "log-line-prefix-template", '\0', kValue, "", kLogs,
       "Console prefix template for tee'd lines, with ${role_name}, ${rank}, ${local_rank} "
       "(default: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE or ${role_name}${local_rank})"},

      {Opt::kMonitorInterval, "monitor-interval", '\0', kValue, "5", kSup,
       "Accepted for compatibility; trun notices worker exits as they happen"},
      {Opt::kStartMethod, "start-method", '\0', kValue, "spawn", kSup,
       "Accepted for compatibility (spawn, fork, forkserver); workers are always exec'd"},
      {Opt::kEventLogHandler, "event-log-handler", '\0', kValue, "null", kSup,
       "Only null (the default): torchrun's event handlers are Python plug-ins; trun logs its "
       "own events"},
      {Opt::kNumaBinding, "numa-binding", '\0', kValue, "", kSup,
       "Bind each worker's CPUs and preferred memory node near its device: none (the default), "
       "node, socket, exclusive or core-complex (docs/launcher.md, NUMA binding; --dry-run "
       "shows the plan)"},
      {Opt::kShutdownTimeout, "shutdown-timeout", '\0', kValue, "30", kSup,
       "Seconds between SIGTERM and SIGKILL when stopping workers (default: "
       "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)"},
      {Opt::kSignalsToHandle, "signals-to-handle", '\0', kValue, "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
       kSup,
       "Signals trun forwards to the workers before stopping them and exiting 128+N (in an "
       "srun step SIGUSR1 is added to the default)"},
      {Opt::kExitBarrierTimeout, "exit-barrier-timeout", '\0', kValue, "300", kSup,
       "Seconds to wait for other nodes to finish after this node's workers succeeded"},

      {Opt::kHangDetection, "hang-detection", '\0', kValue, "on", kHang,
       "on: a rank that makes no progress (as libtrun_worker reports it) for its timeout is hung: "
       "it is named, the workers' stacks are dumped, and the group restarts (a failure); off: "
       "never"},
      {Opt::kHangTimeout, "hang-timeout", '\0', kValue, "auto", kHang,
       "Seconds a rank may go without progress in its training loop; auto: learned, "
       "max(--hang-timeout-floor, --hang-timeout-factor x the longest interval seen after "
       "--hang-warmup intervals)"},
      {Opt::kHangTimeoutFloor, "hang-timeout-floor", '\0', kValue, "10", kHang,
       "The least learned timeout, in seconds (sections too)"},
      {Opt::kHangTimeoutFactor, "hang-timeout-factor", '\0', kValue, "3", kHang,
       "A learned timeout is this factor times the longest interval seen"},
      {Opt::kHangWarmup, "hang-warmup", '\0', kValue, "5", kHang,
       "Intervals between progress events that are not learned from (a first step that loads a "
       "model); until then --hang-startup-timeout applies"},
      {Opt::kHangStartupTimeout, "hang-startup-timeout", '\0', kValue, "1800", kHang,
       "Seconds from a worker's start to its first progress after init(), and during the "
       "warm-up; off: never"},
      {Opt::kHangCheckpointTimeout, "hang-checkpoint-timeout", '\0', kValue, "auto", kHang,
       "Seconds a checkpoint save may take; auto: learned as the loop's, with a floor of 120 s; "
       "off: never"},
      {Opt::kHangSectionTimeout, "hang-section-timeout", '\0', kValue, "", kHang,
       "NAME=SECONDS[,NAME=SECONDS...]: a fixed timeout (or off) for a trun::worker::Section of "
       "that name; other sections learn their own"},

      {Opt::kHealthCheck, "health-check", '\0', kValue, "", kHealth,
       "A shell command this node runs before each rendezvous join and after each failure "
       "(exit 0: healthy); an unhealthy node stays out of the job, says why and checks again "
       "after a back-off (1 s doubling to 60 s); its output goes to the log"},
      {Opt::kHealthCheckTimeout, "health-check-timeout", '\0', kValue, "60", kHealth,
       "Seconds --health-check may run before it is killed (and counts as failed)"},
      {Opt::kHealthBuiltin, "health-builtin", '\0', kValue, "on", kHealth,
       "on: also check, with no configuration, free space in /dev/shm for this node's segments, "
       "that the log directory and TMPDIR are writable, and with --nproc-per-node=gpu that the "
       "GPUs are visible (NVML); off: only --health-check"},
      {Opt::kCrashLoopLimit, "crash-loop-limit", '\0', kValue, "3", kHealth,
       "Stop with exit code 4 instead of restarting when this many attempts in a row failed "
       "the same way without progress (no step reported by libtrun_worker, none ran "
       "--crash-loop-uptime); 0: off"},
      {Opt::kCrashLoopUptime, "crash-loop-uptime", '\0', kValue, "60", kHealth,
       "Seconds an attempt must run before it fails to count as progress (for programs that "
       "report no steps)"},
      {Opt::kExcludeAfter, "exclude-after", '\0', kValue, "3", kHealth,
       "A node whose own workers failed this many times within --exclude-window sits out the "
       "next rounds for --exclude-cooldown (doubling on each repeat, at most an hour), unless "
       "that leaves fewer than --nnodes MIN nodes (c10d and etcd); 0: never"},
      {Opt::kExcludeWindow, "exclude-window", '\0', kValue, "600", kHealth,
       "Seconds over which --exclude-after counts a node's failures"},
      {Opt::kExcludeCooldown, "exclude-cooldown", '\0', kValue, "60", kHealth,
       "Seconds an excluded node sits out the first time (then twice as long each time)"},
      {Opt::kStragglerThreshold, "straggler-threshold", '\0', kValue, "20", kHealth,
       "Percent by which a rank's time per step outside collectives may exceed the median of the "
       "others' before it counts as slow (libtrun_worker programs; docs/health.md)"},
      {Opt::kStragglerWindow, "straggler-window", '\0', kValue, "30", kHealth,
       "Seconds a rank must stay slow before it is flagged (once, on the console, in the event "
       "log, /metrics and trun status)"},
      {Opt::kStragglerAction, "straggler-action", '\0', kValue, "report", kHealth,
       "report: only report a flagged slow rank; exclude: also exclude its node (it leaves the "
       "round and sits out --exclude-cooldown) when a spare node waits to take its place and "
       "the job keeps --nnodes MIN nodes (c10d and etcd)"},

      {Opt::kNodeRank, "node-rank", '\0', kValue, "0", kLegacy,
       "This node's rank (GROUP_RANK) for the static backend"},
      {Opt::kMasterAddr, "master-addr", '\0', kValue, "127.0.0.1", kLegacy,
       "Address of node 0, where the store runs (static backend); MASTER_ADDR for workers"},
      {Opt::kMasterPort, "master-port", '\0', kValue, "29500", kLegacy,
       "Port of the store on node 0 (static backend); MASTER_PORT for workers. 0 picks a free "
       "port (single node)"},
      {Opt::kLocalAddr, "local-addr", '\0', kValue, "", kLegacy,
       "This node's address as other nodes should reach it"},
  };
  return kTable;
}

const OptionDecl& declaration(Opt id) {
  const auto& table = option_table();
  const size_t i = static_cast<size_t>(id);
  TRUN_CHECK(i < table.size() && table[i].id == id, "option table out of Opt order at " << i);
  return table[i];
}

std::string flag_name(Opt id) { return std::string("--") + declaration(id).name; }

std::vector<std::string> long_names(Opt id) {
  const std::string dash = declaration(id).name;
  std::string under = dash;
  for (auto& c : under) c = c == '-' ? '_' : c;
  if (under == dash) return {dash};
  return {dash, under};
}

std::string env_name(Opt id) {
  std::string env = "PET_" + long_names(id).back();
  for (auto& c : env) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return env;
}

}  // namespace trun::launcher
