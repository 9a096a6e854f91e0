#include "launcher/status_render.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "agent/straggler.h"
#include "launcher/timeline.h"  // printable()

namespace trun::launcher::status {

// Text from the store, for the terminal: no control character reaches it (an OSC or CSI
// sequence in a record would retitle the window or rewrite the screen).
std::string safe(const std::string& text) { return printable(text); }

namespace {

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A record's time (unix seconds) that can be one: after 1970 and at most a day ahead of this
// clock (another node's clock may be a little ahead). A record holds whatever was written to the
// store: -2^63, NaN or 1e300 is shown as invalid, never as a nonsense age.
constexpr double kMaxClockAheadS = 86400;
bool valid_time(double at) {
  return std::isfinite(at) && at > 0 && at <= unix_now() + kMaxClockAheadS;
}

std::string ago(double at) {
  if (!valid_time(at)) return "invalid time";
  const double s = std::max(0.0, unix_now() - at);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f s ago", s);
  return buf;
}

// A JSON text whose bytes are all printable ASCII but for its own newlines: \u escapes for the
// control and non-ASCII characters of every string (nlohmann escapes C0 itself; ensure_ascii
// the rest) and for DEL, which JSON leaves raw (it only occurs inside strings).
std::string ascii_json(const nlohmann::json& j) {
  std::string text =
      j.dump(2, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\x7f') {
      out += "\\u007f";
    } else {
      out += c;
    }
  }
  return out;
}

// Every running node's ranks of the current round, scored against each other (agent/straggler.h),
// and the ranks the judging node flagged.
struct Scored {
  std::vector<agent::straggler::RankStats> ranks;  // node = the node id
  std::vector<int> flagged;
};

Scored score_ranks(const JobStatus& js) {
  Scored s;
  for (const auto& n : js.nodes) {
    if (!n.record || n.record->state != "running" || n.record->round != js.round) continue;
    for (const auto& r : n.record->ranks) {
      agent::straggler::RankStats st;
      st.rank = r.rank;
      st.local_rank = r.local_rank;
      st.node = n.node_id;
      st.steps = r.steps;
      st.step_s = r.step_s;
      st.compute_s = r.compute_s;
      st.self_score = r.self_score;
      s.ranks.push_back(std::move(st));
    }
    s.flagged.insert(s.flagged.end(), n.record->slow_ranks.begin(), n.record->slow_ranks.end());
  }
  agent::straggler::score(s.ranks);
  return s;
}

// The SLOWEST column: the node's rank furthest behind the others ("rank 5 +31%", "SLOW" when
// flagged), "ok" when none is slower, "-" when nothing is measured.
std::string slowest_cell(const Scored& s, const std::string& node_id) {
  const agent::straggler::RankStats* worst = nullptr;
  bool measured = false;
  for (const auto& r : s.ranks) {
    if (r.node != node_id || r.step_s <= 0) continue;
    measured = true;
    if (!worst || r.slower > worst->slower) worst = &r;
  }
  if (!measured) return "-";
  if (worst->slower < 0.005) return "ok";
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank %d +%.0f%%", worst->rank, worst->slower * 100);
  std::string cell = buf;
  if (std::find(s.flagged.begin(), s.flagged.end(), worst->rank) != s.flagged.end()) {
    cell += " SLOW";
  }
  return cell;
}

// The most restarts any node counted (every node restarts together), the newest failure and
// the root cause of the newest failed round (every node of it records the same one).
struct Summary {
  int restarts = 0;
  int max_restarts = -1;
  const agent::NodeStatus* last_failure = nullptr;
  const agent::NodeStatus* root_cause = nullptr;
};
Summary summarize(const JobStatus& js) {
  Summary s;
  for (const auto& n : js.nodes) {
    if (!n.record) continue;
    s.restarts = std::max(s.restarts, n.record->restarts);
    s.max_restarts = std::max(s.max_restarts, n.record->max_restarts);
    // A failure with an invalid time is still shown, but never wins over one with a valid time.
    const auto at = [](const agent::NodeStatus* r) {
      return valid_time(r->last_failure_at) ? r->last_failure_at : -1.0;
    };
    if (!n.record->last_failure.empty() &&
        (!s.last_failure || at(&*n.record) > at(s.last_failure))) {
      s.last_failure = &*n.record;
    }
    if (!n.record->root_cause.empty() &&
        (!s.root_cause || n.record->root_cause_round > s.root_cause->root_cause_round)) {
      s.root_cause = &*n.record;
    }
  }
  return s;
}

// The GOODPUT column: the node's goodput ratio as a percentage, "-" before anything is measured.
std::string goodput_cell(const agent::NodeStatus& r) {
  if (!(r.goodput_ratio >= 0) || !std::isfinite(r.goodput_ratio)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", std::min(r.goodput_ratio, 1.0) * 100);
  return buf;
}

// The goodput line: the node in the job longest (its account covers the most of the job), with
// its badput causes, largest first; empty when no node measured any.
std::string goodput_line(const JobStatus& js) {
  const agent::NodeStatus* best = nullptr;
  for (const auto& n : js.nodes) {
    if (!n.record || !(n.record->goodput_ratio >= 0) || !std::isfinite(n.record->goodput_wall_s))
      continue;
    if (!best || n.record->goodput_wall_s > best->goodput_wall_s) best = &*n.record;
  }
  if (!best) return {};
  std::vector<std::pair<double, std::string>> causes;
  for (const auto& [cause, s] : best->badput_s) {
    if (std::isfinite(s) && s > 0) causes.emplace_back(s, cause);
  }
  std::sort(causes.rbegin(), causes.rend());
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1f%% of %.0f s (node ",
                std::min(best->goodput_ratio, 1.0) * 100, best->goodput_wall_s);
  std::string out = buf + safe(best->node_id) + ")";
  if (!causes.empty()) {
    out += "; badput:";
    for (size_t i = 0; i < causes.size() && i < 9; ++i) {
      std::snprintf(buf, sizeof buf, "%s %.1f s", i ? "," : "", causes[i].first);
      out += " " + safe(causes[i].second) + buf;
    }
  }
  return out;
}

}  // namespace

std::string to_json(const JobStatus& js) {
  using nlohmann::json;
  const Summary sum = summarize(js);
  const Scored scored = score_ranks(js);
  json nodes = json::array();
  for (const auto& n : js.nodes) {
    json j = {{"node_id", n.node_id},
              {"addr", n.addr},
              {"group_rank", n.group_rank >= 0 ? json(n.group_rank) : json(nullptr)},
              {"state", n.state}};
    if (n.record) {
      j["hostname"] = n.record->hostname;
      j["pid"] = n.record->pid;
      j["local_world_size"] = n.record->local_world_size;
      j["agent_state"] = n.record->state;
      j["restarts"] = n.record->restarts;
      j["max_restarts"] = n.record->max_restarts;
      j["record_round"] = n.record->round;
      j["last_failure"] =
          n.record->last_failure.empty() ? json(nullptr) : json(n.record->last_failure);
      j["unhealthy"] = n.record->unhealthy.empty() ? json(nullptr) : json(n.record->unhealthy);
      j["excluded"] = n.record->excluded.empty() ? json(nullptr) : json(n.record->excluded);
      j["excluded_until"] =
          valid_time(n.record->excluded_until) ? json(n.record->excluded_until) : json(nullptr);
      json ranks = json::array();
      for (const auto& r : scored.ranks) {
        if (r.node != n.node_id) continue;
        ranks.push_back({{"rank", r.rank},
                         {"local_rank", r.local_rank},
                         {"steps", r.steps},
                         {"step_s", r.step_s > 0 ? json(r.step_s) : json(nullptr)},
                         {"compute_s", r.step_s > 0 ? json(r.compute_s) : json(nullptr)},
                         {"slower", r.slower},
                         {"score", r.score},
                         {"self_score", r.self_score},
                         {"flagged", std::find(scored.flagged.begin(), scored.flagged.end(),
                                               r.rank) != scored.flagged.end()}});
      }
      j["ranks"] = ranks;
      j["updated_at"] =
          valid_time(n.record->updated_at) ? json(n.record->updated_at) : json(nullptr);
      if (n.record->goodput_ratio >= 0 && std::isfinite(n.record->goodput_ratio)) {
        json badput = json::object();
        for (const auto& [cause, s] : n.record->badput_s) {
          if (std::isfinite(s)) badput[cause] = s;
        }
        j["goodput"] = {
            {"ratio", n.record->goodput_ratio},
            {"wall_s", std::isfinite(n.record->goodput_wall_s) ? json(n.record->goodput_wall_s)
                                                               : json(nullptr)},
            {"badput_s", std::move(badput)}};
      } else {
        j["goodput"] = nullptr;
      }
    } else {
      j["local_world_size"] = nullptr;
      j["agent_state"] = nullptr;
    }
    nodes.push_back(std::move(j));
  }
  json out = {{"run_id", js.run_id},
              {"backend", js.backend},
              {"endpoint", js.endpoint},
              {"round", js.round >= 0 ? json(js.round) : json(nullptr)},
              {"round_state", js.round_state},
              {"next_round", js.next_round >= 0 ? json(js.next_round) : json(nullptr)},
              {"round_over_cause", js.over_cause.empty() ? json(nullptr) : json(js.over_cause)},
              {"closed", js.closed},
              {"restarts", sum.restarts},
              {"max_restarts", sum.max_restarts >= 0 ? json(sum.max_restarts) : json(nullptr)},
              {"waiting", js.waiting},
              {"outside", js.outside},
              {"nodes", std::move(nodes)}};
  if (sum.last_failure) {
    out["last_failure"] = {{"node_id", sum.last_failure->node_id},
                           {"message", sum.last_failure->last_failure},
                           {"at", valid_time(sum.last_failure->last_failure_at)
                                      ? json(sum.last_failure->last_failure_at)
                                      : json(nullptr)}};
  } else {
    out["last_failure"] = nullptr;
  }
  if (sum.root_cause) {
    const auto* r = sum.root_cause;
    out["root_cause"] = {
        {"node_id", r->root_cause_node},
        {"message", r->root_cause},
        {"round", r->root_cause_round},
        {"at", valid_time(r->root_cause_at) ? json(r->root_cause_at) : json(nullptr)}};
  } else {
    out["root_cause"] = nullptr;
  }
  return ascii_json(out) + "\n";
}

std::string to_table(const JobStatus& js) {
  const Summary sum = summarize(js);
  std::string out =
      "job '" + safe(js.run_id) + "' (" + js.backend + " at " + safe(js.endpoint) + ")\n";
  out += "round:        ";
  if (js.round < 0) {
    out += "none formed yet";
  } else {
    out += std::to_string(js.round) + " (" + js.round_state + ")";
  }
  if (!js.over_cause.empty()) out += ": " + safe(js.over_cause);
  if (js.next_round >= 0 && (js.round_state != "running" || js.waiting > 0)) {
    out += "; nodes join round " + std::to_string(js.next_round);
  }
  out += "\nnodes:        " + std::to_string(js.nodes.size() - js.waiting - js.outside) +
         " in the round, " + std::to_string(js.waiting) + " waiting";
  if (js.outside > 0) out += ", " + std::to_string(js.outside) + " outside (unhealthy or excluded)";
  out += "\n";
  out += "restarts:     " + std::to_string(sum.restarts);
  if (sum.max_restarts >= 0) {
    out += " of " + std::to_string(sum.max_restarts) + " (" +
           std::to_string(std::max(0, sum.max_restarts - sum.restarts)) + " left)";
  }
  out += "\nlast failure: ";
  if (sum.last_failure) {
    out += safe(sum.last_failure->last_failure) + " (node " + safe(sum.last_failure->node_id) +
           ", " + ago(sum.last_failure->last_failure_at) + ")";
  } else {
    out += "none";
  }
  if (sum.root_cause) {
    const auto* r = sum.root_cause;
    out += "\nroot cause:   " + safe(r->root_cause) + " (node " + safe(r->root_cause_node) +
           ", round " + std::to_string(r->root_cause_round) + ", " +
           (valid_time(r->root_cause_at) ? ago(r->root_cause_at) : "time unknown") +
           "; the earliest failure across nodes)";
  }
  if (const std::string g = goodput_line(js); !g.empty()) out += "\ngoodput:      " + g;
  out += "\n\n";
  std::vector<std::vector<std::string>> rows = {{"NODE", "ADDRESS", "RANK", "WORKERS", "STATE",
                                                 "AGENT", "RESTARTS", "SLOWEST", "GOODPUT",
                                                 "UPDATED"}};
  const Scored scored = score_ranks(js);
  for (const auto& n : js.nodes) {
    std::vector<std::string> row = {safe(n.node_id), n.addr.empty() ? "-" : safe(n.addr),
                                    n.group_rank >= 0 ? std::to_string(n.group_rank) : "-"};
    if (n.record) {
      row.push_back(std::to_string(n.record->local_world_size));
      row.push_back(n.state);
      row.push_back(safe(n.record->state));
      row.push_back(std::to_string(n.record->restarts) + "/" +
                    std::to_string(n.record->max_restarts));
      row.push_back(slowest_cell(scored, n.node_id));
      row.push_back(goodput_cell(*n.record));
      row.push_back(ago(n.record->updated_at));
    } else {
      row.insert(row.end(), {"-", n.state, "-", "-", "-", "-", "-"});
    }
    rows.push_back(std::move(row));
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    out += line + "\n";
  }
  for (const auto& n : js.nodes) {  // the health gate's reasons (docs/health.md)
    if (n.record && n.record->state == "unhealthy" && !n.record->unhealthy.empty()) {
      out += "unhealthy: " + safe(n.node_id) + ": " + safe(n.record->unhealthy) + "\n";
    }
    if (n.record && n.record->state == "excluded" && valid_time(n.record->excluded_until)) {
      char left[48];
      std::snprintf(left, sizeof left, " (%.0f s more)",
                    std::max(0.0, n.record->excluded_until - unix_now()));
      out += "excluded: " + safe(n.node_id) + ": " + safe(n.record->excluded) + left + "\n";
    }
  }
  return out;
}

}  // namespace trun::launcher::status
