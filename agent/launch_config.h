#pragma once
// LaunchConfig: everything the agent needs to run one job on this node, already validated.
//
// Built once by the launcher (launcher/cli.h, from argv and PET_* variables) and never changed
// afterwards; the agent reads it from its own thread only. Every field holds a checked value:
// the agent does not re-validate. Rank terms (local_rank, group_rank, ...) are defined in
// docs/rank-terms.md.

#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/decisions.h"
#include "agent/hang_rules.h"
#include "agent/numa_binding.h"
#include "agent/straggler.h"
#include "rendezvous/options.h"

namespace trun::agent {

// Which of a worker's standard streams go to a log file (torchrun's Std: 0 none, 1 stdout,
// 2 stderr, 3 both).
enum StdStreams : int { kStdNone = 0, kStdOut = 1, kStdErr = 2, kStdAll = 3 };

// A value for every local rank, or a per-rank map (ranks not in the map get kStdNone), as in
// torchrun's `--redirects 3` or `--redirects 0:1,1:2`.
struct StdSpec {
  int all = kStdNone;
  std::map<int, int> per_rank;
  bool is_map = false;

  int for_rank(int local_rank) const {
    if (!is_map) return all;
    auto it = per_rank.find(local_rank);
    return it == per_rank.end() ? kStdNone : it->second;
  }
};

struct LaunchConfig {
  // --- worker group -------------------------------------------------------------------------
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;  // the local world size, already resolved from cpu/gpu/auto
  // torchrun's --virtual-local-rank: each worker gets LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES
  // naming only its own device (TRUN_LOCAL_RANK keeps the real one for libtrun_worker): entry
  // local_rank of `visible_devices` (trun's own CUDA_VISIBLE_DEVICES, one entry per worker at
  // least), or the local rank itself when that list is empty (the variable is unset).
  bool virtual_local_rank = false;
  std::vector<std::string> visible_devices;
  std::string role = "default";
  int max_restarts = 0;
  // --numa-binding (agent/numa_binding.h): the mode, and one binding per local rank, planned by
  // the launcher (empty for kNone).
  NumaMode numa_binding = NumaMode::kNone;
  std::vector<NumaBinding> numa_bindings;

  // --- rendezvous ---------------------------------------------------------------------------
  // --standalone: the static backend with its store on 127.0.0.1 at a free port
  // (rendezvous::standalone_config), and a run id the agent generates (`run_id` is empty).
  bool standalone = false;
  std::string run_id = "none";  // TORCHELASTIC_RUN_ID, and the rendezvous' job id
  // The backend, its endpoint, the store token and --rdzv-conf, parsed and checked
  // (rendezvous/options.h); rendezvous::handler_options() turns it into a handler's options.
  rendezvous::RendezvousConfig rdzv;

  // --- what to run --------------------------------------------------------------------------
  // The worker's argv: program first. For Python scripts this is {python, "-u", script, ...}.
  std::vector<std::string> entrypoint;
  std::string entrypoint_name;  // short name for the failure summary (script or module name)
  // The interpreter of a Python entrypoint (entrypoint[0]: PYTHON_EXEC, or "python3" found on
  // PATH); empty for any other program. The failure summary names it when a worker fails at once.
  std::string python_interpreter;

  // --- logs ---------------------------------------------------------------------------------
  std::string log_dir;  // empty: error files go to a temporary directory removed at exit
  StdSpec redirects;
  StdSpec tee;
  std::optional<std::set<int>> local_ranks_filter;  // console shows only these local ranks
  std::string log_line_prefix_template;             // "${role_name}${local_rank}" when empty
  // --duplicate-{stdout,stderr}-filters: tee'd lines containing any of these strings are also
  // appended to <attempt dir>/filtered_{stdout,stderr}.log. Empty: no such file.
  std::vector<std::string> duplicate_stdout_filters;
  std::vector<std::string> duplicate_stderr_filters;
  // --event-log: one JSON line per rendezvous and agent event (agent/event_log.h); empty: none.
  std::string event_log;
  // --metrics-port (or TORCHELASTIC_HEALTH_CHECK_PORT): serve /metrics and /healthz on this port
  // (agent/metrics_server.h); 0: a free port, printed; -1: no endpoint.
  int metrics_port = -1;

  // --- supervision --------------------------------------------------------------------------
  std::chrono::milliseconds monitor_interval{5000};  // accepted; exits are event-driven
  std::chrono::milliseconds shutdown_timeout{30000};
  std::chrono::milliseconds exit_barrier_timeout{300000};
  std::vector<int> signals_to_handle;  // signal numbers; forwarded to workers, then stop
  // --signals-to-handle as given; workers see it as TORCHELASTIC_SIGNALS_TO_HANDLE (torchrun 2.x)
  std::string signals_to_handle_text = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";
  // --crash-loop-limit, --crash-loop-uptime (agent/decisions.h CrashLoop, docs/health.md): the
  // job stops with kExitCrashLoop instead of restarting when this many attempts in a row failed
  // the same way without progress (no DDP step or heartbeat of libtrun_worker, and no attempt
  // that ran crash_loop_uptime before it failed); 0: never.
  int crash_loop_limit = 3;
  std::chrono::milliseconds crash_loop_uptime{60000};
  // --health-check, --health-check-timeout, --health-builtin (agent/health_gate.h,
  // docs/health.md): what this node checks before each rendezvous join and after each failure.
  std::string health_check;
  std::chrono::milliseconds health_check_timeout{60000};
  bool health_builtin = true;
  bool health_gpus = false;  // the GPUs too: --nproc-per-node=gpu (or auto that found GPUs)
  // --exclude-after, --exclude-window, --exclude-cooldown (agent/decisions.h, docs/health.md).
  ExclusionPolicy exclusion;
  // --straggler-threshold, --straggler-window (agent/straggler.h, docs/health.md).
  straggler::Options straggler;
  // TORCHELASTIC_ENABLE_FILE_TIMER=1 in trun's environment (read by the launcher, as torchrun
  // reads it): serve PyTorch's watchdog FIFO (agent/file_timer_server.h) at file_timer_path
  // (TORCHELASTIC_TIMER_FILE; empty: a generated path), which every worker gets.
  bool file_timer = false;
  std::string file_timer_path;
  // --hang-* (agent/hang_watch.h, docs/hangs.md): find hung ranks from what libtrun_worker
  // reports; hang_timeouts.enabled false (--hang-detection=off): no board, no watch.
  hang::TimeoutOptions hang_timeouts;
};

}  // namespace trun::agent
