#include "launcher/cli_hang.h"

#include <algorithm>
#include <string>

#include "launcher/cli_values.h"

namespace trun::launcher {
namespace {

using agent::hang::ClassPolicy;

double seconds_value(const ResolvedOptions& o, Opt id, const char* expected) {
  double s;
  if (!parse_double(trim(o.text(id)), s) || s <= 0 || s > 1e7) {
    throw CliError(o.origin(id) + "=" + o.text(id) + ": expected " + expected);
  }
  return s;
}

// "auto" leaves the policy learning; "off" disables it; else fixed seconds (> 0).
void fixed_or_auto(const ResolvedOptions& o, Opt id, ClassPolicy& p) {
  const std::string v = trim(o.text(id));
  if (v == "auto") return;
  if (v == "off") {
    p.enabled = false;
    return;
  }
  p.fixed_s = seconds_value(o, id, "auto, off or a positive number of seconds");
}

}  // namespace

void hang_detection(const ResolvedOptions& o, agent::LaunchConfig& c) {
  agent::hang::TimeoutOptions& t = c.hang_timeouts;
  const std::string on = trim(o.text(Opt::kHangDetection));
  if (on != "on" && on != "off") {
    throw CliError(o.origin(Opt::kHangDetection) + "=" + o.text(Opt::kHangDetection) +
                   ": expected on or off");
  }
  t.enabled = on == "on";
  const double floor_s =
      seconds_value(o, Opt::kHangTimeoutFloor, "a positive number of seconds (at most 1e7)");
  const double factor = seconds_value(o, Opt::kHangTimeoutFactor, "a positive number");
  const long long warmup = whole_number(o.origin(Opt::kHangWarmup), o.text(Opt::kHangWarmup), 0,
                                        1000000, "a number of intervals, 0 or more");
  double startup_s = 0;
  const bool startup_off = trim(o.text(Opt::kHangStartupTimeout)) == "off";
  if (!startup_off) {
    startup_s = seconds_value(o, Opt::kHangStartupTimeout, "off or a positive number of seconds");
  }
  for (ClassPolicy* p : {&t.step, &t.section}) {
    p->floor_s = floor_s;
    p->factor = factor;
    p->warmup_intervals = static_cast<int>(warmup);
  }
  t.checkpoint.factor = factor;
  t.checkpoint.floor_s = std::max(floor_s, t.checkpoint.floor_s);
  for (ClassPolicy* p : {&t.step, &t.section, &t.checkpoint}) {
    // The warm-up waits as long as the start-up may (off: the warm-up never times out).
    p->warmup_timeout_s = startup_off ? 1e7 : startup_s;
  }
  t.startup.fixed_s = startup_off ? 0 : startup_s;
  t.startup.enabled = !startup_off;
  fixed_or_auto(o, Opt::kHangTimeout, t.step);
  fixed_or_auto(o, Opt::kHangCheckpointTimeout, t.checkpoint);

  const std::string& sections = o.text(Opt::kHangSectionTimeout);
  size_t start = 0;
  while (start < sections.size()) {
    size_t comma = sections.find(',', start);
    if (comma == std::string::npos) comma = sections.size();
    const std::string item = trim(sections.substr(start, comma - start));
    start = comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string name = eq == std::string::npos ? "" : trim(item.substr(0, eq));
    const std::string value = eq == std::string::npos ? "" : trim(item.substr(eq + 1));
    double s = 0;
    if (name.empty() || (value != "off" && (!parse_double(value, s) || s <= 0 || s > 1e7))) {
      throw CliError(o.origin(Opt::kHangSectionTimeout) + "=" + sections + ": '" + item +
                     "': expected NAME=SECONDS or NAME=off");
    }
    ClassPolicy p = t.section;
    if (value == "off") {
      p.enabled = false;
    } else {
      p.fixed_s = s;
    }
    t.sections[name] = p;
  }
}

}  // namespace trun::launcher
