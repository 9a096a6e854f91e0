#include "launcher/dry_run.h"

#include <nlohmann/json.hpp>

#include "agent/failure_report.h"
#include "rendezvous/options.h"

namespace trun::launcher {
namespace {

using json = nlohmann::ordered_json;

json std_spec(const agent::StdSpec& s) {
  if (!s.is_map) return s.all;
  json m = json::object();
  for (const auto& [rank, mode] : s.per_rank) m[std::to_string(rank)] = mode;
  return m;
}

double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

const char* context_name(SlurmContext c) {
  switch (c) {
    case SlurmContext::kNone:
      return "none";
    case SlurmContext::kDisabled:
      return "disabled";
    case SlurmContext::kOutsideStep:
      return "outside_step";
    case SlurmContext::kStep:
      return "step";
  }
  return "none";
}

}  // namespace

std::string dry_run_json(const CliResult& cli) {
  const agent::LaunchConfig& c = *cli.config;
  json j;
  j["nnodes"] = {{"min", c.min_nodes}, {"max", c.max_nodes}};
  j["nproc_per_node"] = c.nproc_per_node;
  j["virtual_local_rank"] = c.virtual_local_rank;
  j["visible_devices"] = c.visible_devices;
  j["role"] = c.role;
  j["max_restarts"] = c.max_restarts;
  json bindings = json::array();
  for (size_t r = 0; r < c.numa_bindings.size(); ++r) {
    const agent::NumaBinding& b = c.numa_bindings[r];
    bindings.push_back({{"local_rank", r},
                        {"cpus", agent::format_cpu_list(b.cpus)},
                        {"memory_node", b.memory_node},
                        {"device", b.device}});
  }
  j["numa_binding"] = {{"mode", agent::numa_mode_name(c.numa_binding)}, {"workers", bindings}};
  j["rendezvous"] = {
      {"standalone", c.standalone},
      {"backend", rendezvous::backend_name(c.rdzv.backend)},
      {"endpoint", c.rdzv.endpoint},
      {"run_id", c.standalone ? json(nullptr) : json(c.run_id)},  // null: generated at start
      {"conf", c.rdzv.conf_entries},
      {"node_rank", c.rdzv.node_rank},
      {"master_addr", c.rdzv.master_addr},
      {"master_port", c.rdzv.master_port},
      {"local_addr", c.rdzv.local_addr},
  };
  j["entrypoint"] = c.entrypoint;
  j["entrypoint_name"] = c.entrypoint_name;
  j["logs"] = {
      {"log_dir", c.log_dir},
      {"event_log", c.event_log},
      {"metrics_port", c.metrics_port},
      {"redirects", std_spec(c.redirects)},
      {"tee", std_spec(c.tee)},
      {"local_ranks_filter", c.local_ranks_filter ? json(*c.local_ranks_filter) : json(nullptr)},
      {"log_line_prefix_template", c.log_line_prefix_template},
      {"duplicate_stdout_filters", c.duplicate_stdout_filters},
      {"duplicate_stderr_filters", c.duplicate_stderr_filters},
  };
  json signals = json::array();
  for (int s : c.signals_to_handle) signals.push_back(agent::signal_name(s));
  j["supervision"] = {
      {"monitor_interval_s", seconds(c.monitor_interval)},
      {"shutdown_timeout_s", seconds(c.shutdown_timeout)},
      {"exit_barrier_timeout_s", seconds(c.exit_barrier_timeout)},
      {"signals_to_handle", signals},
      {"signals_to_handle_text", c.signals_to_handle_text},
  };
  const auto& h = c.hang_timeouts;
  auto policy = [](const agent::hang::ClassPolicy& p) {
    return json{{"enabled", p.enabled},
                {"fixed_s", p.fixed_s},
                {"floor_s", p.floor_s},
                {"factor", p.factor},
                {"warmup_intervals", p.warmup_intervals},
                {"warmup_timeout_s", p.warmup_timeout_s}};
  };
  json sections = json::object();
  for (const auto& [name, p] : h.sections) sections[name] = policy(p);
  j["hang_detection"] = {{"enabled", h.enabled},         {"startup", policy(h.startup)},
                         {"step", policy(h.step)},       {"checkpoint", policy(h.checkpoint)},
                         {"section", policy(h.section)}, {"sections", sections}};
  j["health"] = {{"check", c.health_check.empty() ? json(nullptr) : json(c.health_check)},
                 {"check_timeout_s", seconds(c.health_check_timeout)},
                 {"builtin", c.health_builtin},
                 {"gpus", c.health_gpus},
                 {"crash_loop_limit", c.crash_loop_limit},
                 {"crash_loop_uptime_s", seconds(c.crash_loop_uptime)},
                 {"exclude_after", c.exclusion.after},
                 {"exclude_window_s", c.exclusion.window_s},
                 {"exclude_cooldown_s", c.exclusion.cooldown_s},
                 {"exclude_cooldown_cap_s", c.exclusion.cap_s},
                 {"straggler_threshold", c.straggler.threshold},
                 {"straggler_window_s", c.straggler.window_s},
                 {"straggler_action", c.straggler.exclude ? "exclude" : "report"}};
  j["slurm"] = {{"context", context_name(cli.slurm.context)},
                {"job_id", cli.slurm.job_id.empty() ? json(nullptr) : json(cli.slurm.job_id)},
                {"step_id", cli.slurm.step_id.empty() ? json(nullptr) : json(cli.slurm.step_id)}};
  json derived = json::array();
  for (const auto& d : cli.slurm.derived) {
    derived.push_back({{"option", d.option}, {"value", d.value}, {"from", d.from}});
  }
  j["derived"] = derived;
  j["environment"] = cli.environment;
  j["notes"] = cli.notes;
  return j.dump(2) + "\n";
}

}  // namespace trun::launcher
