#include "launcher/cli_health.h"

#include <algorithm>
#include <string>

#include "launcher/cli_values.h"

namespace trun::launcher {

void health_options(const ResolvedOptions& o, agent::LaunchConfig& c) {
  c.health_check = trim(o.text(Opt::kHealthCheck));
  if (o.given(Opt::kHealthCheck) && c.health_check.empty()) {
    throw CliError(o.origin(Opt::kHealthCheck) +
                   "=: expected a shell command (exit 0: healthy), e.g. --health-check "
                   "'nvidia-smi -L'");
  }
  c.health_check_timeout =
      parse_seconds(o.origin(Opt::kHealthCheckTimeout), o.text(Opt::kHealthCheckTimeout), false);
  const std::string builtin = trim(o.text(Opt::kHealthBuiltin));
  if (builtin != "on" && builtin != "off") {
    throw CliError(o.origin(Opt::kHealthBuiltin) + "=" + o.text(Opt::kHealthBuiltin) +
                   ": expected on or off");
  }
  c.health_builtin = builtin == "on";
  const std::string nproc = trim(o.text(Opt::kNprocPerNode));
  c.health_gpus = nproc == "gpu";
  c.crash_loop_limit =
      static_cast<int>(whole_number(o.origin(Opt::kCrashLoopLimit), o.text(Opt::kCrashLoopLimit), 0,
                                    1000000, "a number of attempts >= 0 (0: off)"));
  c.crash_loop_uptime =
      parse_seconds(o.origin(Opt::kCrashLoopUptime), o.text(Opt::kCrashLoopUptime), true);
  c.exclusion.after =
      static_cast<int>(whole_number(o.origin(Opt::kExcludeAfter), o.text(Opt::kExcludeAfter), 0,
                                    1000000, "a number of failures >= 0 (0: never exclude)"));
  auto secs = [&o](Opt id) {
    return std::chrono::duration<double>(parse_seconds(o.origin(id), o.text(id), false)).count();
  };
  c.exclusion.window_s = secs(Opt::kExcludeWindow);
  c.exclusion.cooldown_s = secs(Opt::kExcludeCooldown);
  c.exclusion.cap_s = std::max(3600.0, c.exclusion.cooldown_s);
  double pct = 0;
  if (!parse_double(trim(o.text(Opt::kStragglerThreshold)), pct) || pct <= 0 || pct > 10000) {
    throw CliError(o.origin(Opt::kStragglerThreshold) + "=" + o.text(Opt::kStragglerThreshold) +
                   ": expected a percentage above 0 (20: a rank 20% slower than the others)");
  }
  c.straggler.threshold = pct / 100;
  const auto window =
      parse_seconds(o.origin(Opt::kStragglerWindow), o.text(Opt::kStragglerWindow), false);
  c.straggler.window_s = std::chrono::duration<double>(window).count();
  const std::string action = trim(o.text(Opt::kStragglerAction));
  if (action != "report" && action != "exclude") {
    throw CliError(o.origin(Opt::kStragglerAction) + "=" + o.text(Opt::kStragglerAction) +
                   ": expected report or exclude");
  }
  c.straggler.exclude = action == "exclude";
}

}  // namespace trun::launcher
