// Groups `trun timeline`'s events into nodes, bars and rounds (launcher/timeline_model.h).

#include "launcher/timeline_model.h"

#include <algorithm>
#include <string>
#include <vector>

#include "base/decimal.h"
#include "rendezvous/handler.h"

namespace trun::launcher::timeline_model {

std::string clip(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  size_t cut = n - 3;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

namespace {

// A string of the metadata, cut to `limit` bytes: what the page shows of an event is bounded
// whatever the log holds (a label is repeated in every bar of its node).
std::optional<std::string> get_str(const nlohmann::json& md, const char* key,
                                   size_t limit = kMaxTextBytes) {
  auto it = md.find(key);
  if (it == md.end() || !it->is_string()) return std::nullopt;
  return clip(it->get_ref<const std::string&>(), limit);
}

std::optional<int64_t> get_int(const nlohmann::json& md, const char* key) {
  auto it = md.find(key);
  if (it == md.end() || !it->is_number_integer()) return std::nullopt;
  // An unsigned number above INT64_MAX would wrap: not a value trun writes.
  if (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t{INT64_MAX}) return std::nullopt;
  return it->get<int64_t>();
}

std::optional<bool> get_bool(const nlohmann::json& md, const char* key) {
  auto it = md.find(key);
  if (it == md.end() || !it->is_boolean()) return std::nullopt;
  return it->get<bool>();
}

void on_agent_start(Node& n, const nlohmann::json& md, int64_t ts) {
  n.start = ts;
  n.nproc = get_int(md, "nproc_per_node");
  n.max_restarts = get_int(md, "max_restarts");
  n.entrypoint = get_str(md, "entrypoint").value_or("");
}

void on_agent_stop(Node& n, const nlohmann::json& md, int64_t ts) {
  n.stop = ts;
  n.exit_code = get_int(md, "exit_code");
  n.stop_state = get_str(md, "state", kMaxLabelBytes).value_or("");
}

void on_join(Node& n, const nlohmann::json& md, int64_t ts) {
  if (auto id = get_str(md, "node_id", kMaxLabelBytes)) n.node_id = *id;
  Wait w;
  w.start = w.end = ts;
  n.waits.push_back(w);
}

// Another trun.rdzv.* event: a round ended (its reason is the rest of the name).
void on_round_ended(Node& n, const TimelineEvent& e, int64_t ts) {
  const auto& md = e.metadata;
  const std::string reason = clip(e.name.substr(10), kMaxLabelBytes);
  std::string text =
      "round " + (get_int(md, "round") ? std::to_string(*get_int(md, "round")) : std::string("?")) +
      " ended: " + reason;
  if (auto who = get_str(md, "node_id", kMaxLabelBytes); who && !who->empty()) {
    text += " (node " + *who + ")";
  }
  if (auto msg = get_str(md, "message"); msg && !msg->empty()) text += ": " + *msg;
  n.round_ends.push_back({ts, text});
}

void on_restart(Node& n, const nlohmann::json& md, int64_t ts) {
  Restart r;
  r.ts = ts;
  r.counted = get_bool(md, "counted").value_or(true);
  r.text = std::string(r.counted ? "restart after a failure" : "group re-formed") + ": " +
           get_str(md, "reason").value_or("?");
  if (auto used = get_int(md, "agent_restarts")) {
    r.text += ", restarts used " + std::to_string(*used);
    if (auto mx = get_int(md, "max_restarts")) r.text += " of " + std::to_string(*mx);
  }
  n.restarts.push_back(r);
}

Outcome outcome_of(const std::string& state, const WorkerBar& b) {
  if (state == "SUCCEEDED") return Outcome::kSucceeded;
  if (state == "STOPPED") return Outcome::kStopped;
  if (!b.signal.empty() || (b.exitcode && *b.exitcode < 0)) return Outcome::kSignaled;
  return Outcome::kFailed;
}

}  // namespace

void TimelineModel::add(const TimelineEvent& e) {
  const auto& md = e.metadata;
  // parse_timeline_event refuses other timestamps; an event made otherwise is clamped, so no
  // difference of two can overflow.
  const int64_t ts = std::clamp<int64_t>(e.timestamp_ms, 0, kMaxTimestampMs);
  Node& n = node_of(md, ts);
  const std::string& name = e.name;
  if (name == "trun.agent.start") {
    on_agent_start(n, md, ts);
  } else if (name == "trun.agent.stop") {
    on_agent_stop(n, md, ts);
  } else if (name == "trun.rdzv.join") {
    on_join(n, md, ts);
  } else if (name == "trun.rdzv.round_formed" || name == "trun.rdzv.failed") {
    on_rendezvous_end(n, e, ts);
  } else if (name.rfind("trun.rdzv.", 0) == 0) {
    on_round_ended(n, e, ts);
  } else if (name == "trun.agent.restart") {
    on_restart(n, md, ts);
  } else if (name == "trun.agent.worker_started") {
    on_worker_started(n, md, ts);
  } else if (name == "trun.agent.worker_exited") {
    on_worker_exited(n, md, ts);
  } else if (name == "trun.agent.straggler") {
    n.slow_ranks.push_back(
        {ts, "slow rank: " + get_str(md, "summary", kMaxTextBytes).value_or("")});
  } else if (name == "trun.agent.badput") {
    const auto begin = get_int(md, "begin_ms"), end = get_int(md, "end_ms");
    if (begin && end && *end >= *begin && n.badput.size() < kMaxBadputPerNode) {
      n.badput.push_back({std::clamp<int64_t>(*begin, 0, kMaxTimestampMs),
                          std::clamp<int64_t>(*end, 0, kMaxTimestampMs),
                          get_str(md, "cause", 32).value_or("other")});
    }
  } else if (name == "trun.hang") {
    n.hangs.push_back({ts, "hang: " + get_str(md, "summary", kMaxTextBytes).value_or("")});
  }
  // Other events (trun.agent.failure, names a newer trun adds) only widen the node's span.
}

// The node (agent) of an event, by run id, host name and agent pid; its span widened to `ts`.
Node& TimelineModel::node_of(const nlohmann::json& md, int64_t ts) {
  const std::string run_id = get_str(md, "run_id", kMaxLabelBytes).value_or("");
  const std::string host = get_str(md, "hostname", kMaxLabelBytes).value_or("?");
  const int64_t pid = get_int(md, "pid").value_or(0);
  auto key = std::make_tuple(run_id, host, pid);
  auto [it, inserted] = index_.emplace(key, nodes_.size());
  if (inserted) {
    nodes_.emplace_back();
    Node& n = nodes_.back();
    n.run_id = run_id;
    n.hostname = host;
    n.pid = pid;
    n.first = n.last = ts;
  }
  Node& n = nodes_[it->second];
  n.first = std::min(n.first, ts);
  n.last = std::max(n.last, ts);
  return n;
}

// trun.rdzv.round_formed or trun.rdzv.failed: the node's wait ends (one of no length when no
// join opened it).
void TimelineModel::on_rendezvous_end(Node& n, const TimelineEvent& e, int64_t ts) {
  const auto& md = e.metadata;
  if (auto id = get_str(md, "node_id", kMaxLabelBytes); id && n.node_id.empty()) {
    n.node_id = *id;
  }
  if (n.waits.empty() || !n.waits.back().open) {
    Wait w;
    w.start = ts;
    n.waits.push_back(w);
  }
  Wait& w = n.waits.back();
  w.open = false;
  w.end = ts;
  if (e.name == "trun.rdzv.failed") {
    w.text = "rendezvous failed: " + get_str(md, "error_trace").value_or("?");
    return;
  }
  n.round = get_int(md, "round");
  n.group_rank = get_int(md, "group_rank");
  w.text = "rendezvous for round " + (n.round ? std::to_string(*n.round) : "?");
  on_round_formed(n, md, ts);
}

// The round across nodes (by run id and number): its earliest time, sizes and members.
void TimelineModel::on_round_formed(Node& n, const nlohmann::json& md, int64_t ts) {
  const int64_t number = n.round.value_or(-1);
  auto [rit, fresh] = round_index_.emplace(std::make_pair(n.run_id, number), rounds_.size());
  if (fresh) {
    rounds_.emplace_back();
    rounds_.back().ts = ts;
    rounds_.back().run_id = n.run_id;
    rounds_.back().number = number;
  }
  Round& r = rounds_[rit->second];
  r.ts = std::min(r.ts, ts);
  if (!r.group_world_size) r.group_world_size = get_int(md, "group_world_size");
  if (!r.world_size) r.world_size = get_int(md, "world_size");
  r.members.push_back({n.label(), n.group_rank});
}

void TimelineModel::on_worker_started(Node& n, const nlohmann::json& md, int64_t ts) {
  const int64_t lr = get_int(md, "local_rank").value_or(-1);
  WorkerBar b;
  b.start = b.end = ts;
  b.global_rank = get_int(md, "global_rank");
  b.role_rank = get_int(md, "role_rank");
  b.pid = get_int(md, "worker_pid");
  b.attempt = get_int(md, "agent_restarts");
  b.round = n.round;
  auto& lane = n.workers[lr];
  lane.push_back(b);
  if (b.pid) {
    n.open_bars[*b.pid] = lane.size() - 1;
    n.open_rank[*b.pid] = lr;
  }
}

// Ends the worker's open bar (found by pid and local rank), or adds one of no length for a
// worker that could not start.
void TimelineModel::on_worker_exited(Node& n, const nlohmann::json& md, int64_t ts) {
  const int64_t lr = get_int(md, "local_rank").value_or(-1);
  const auto pid = get_int(md, "worker_pid");
  WorkerBar* b = nullptr;
  if (pid && n.open_bars.count(*pid) && n.open_rank[*pid] == lr) {
    b = &n.workers[lr][n.open_bars[*pid]];
    n.open_bars.erase(*pid);
    n.open_rank.erase(*pid);
  } else {
    auto& lane = n.workers[lr];
    lane.emplace_back();
    b = &lane.back();
    b->start = ts;
    b->pid = pid;
    b->global_rank = get_int(md, "global_rank");
    b->attempt = get_int(md, "agent_restarts");
    b->round = n.round;
  }
  b->end = ts;
  b->ended = true;
  b->exitcode = get_int(md, "exitcode");
  b->signal = get_str(md, "signal", kMaxLabelBytes).value_or("");
  b->raw_error = get_str(md, "raw_error").value_or("");
  b->outcome = outcome_of(get_str(md, "state").value_or(""), *b);
}

void TimelineModel::finish() {
  for (Node& n : nodes_) {
    const int64_t end = n.stop.value_or(n.last);
    for (auto& [lr, lane] : n.workers) {
      for (auto& b : lane) {
        if (!b.ended) b.end = std::max(b.start, end);
      }
    }
    for (auto& w : n.waits) {
      if (w.open) {
        w.end = std::max(w.start, end);
        w.text = "rendezvous still waiting when the log ends";
      }
    }
  }
  std::stable_sort(nodes_.begin(), nodes_.end(), [](const Node& a, const Node& b) {
    return std::tie(a.first, a.run_id, a.hostname, a.pid) <
           std::tie(b.first, b.run_id, b.hostname, b.pid);
  });
  mark_root_causes();
  std::stable_sort(rounds_.begin(), rounds_.end(),
                   [](const Round& a, const Round& b) { return a.ts < b.ts; });
}

// The root cause of each failed round: of the workers that failed in it (exited with a code or
// by a signal; not those trun stopped) on every node, the one that exited first (ties: the
// node drawn first), chosen by the agent's own rule, rendezvous::root_cause, so that the page
// marks the worker the agents' logs and `trun status` name. Each failed bar is one report, its
// exit time the failure time (never unknown here: timestamps are clamped to >= 0), listed in
// drawing order, so root_cause's "earliest, ties to the first listed" is the same choice. A peer
// that failed because of it (a connection closed by the dead rank) stays an ordinary failure.
// Rounds are told apart by run id, round and restart count.
void TimelineModel::mark_root_causes() {
  using RoundKey = std::tuple<std::string, int64_t, int64_t>;
  std::map<RoundKey, std::vector<WorkerBar*>> failed;
  for (Node& n : nodes_) {
    for (auto& [lr, lane] : n.workers) {
      for (auto& b : lane) {
        if (!b.ended || (b.outcome != Outcome::kFailed && b.outcome != Outcome::kSignaled)) {
          continue;
        }
        failed[std::make_tuple(n.run_id, b.round.value_or(-1), b.attempt.value_or(-1))].push_back(
            &b);
      }
    }
  }
  for (auto& [key, bars] : failed) {
    std::vector<rendezvous::FailureReport> reports;
    reports.reserve(bars.size());
    // The report's detail is the bar's index in `bars`: root_cause returns a copy.
    for (size_t i = 0; i < bars.size(); ++i)
      reports.push_back({std::string(), std::to_string(i), bars[i]->end});
    const auto root = rendezvous::root_cause(reports);
    size_t i = 0;
    if (root && base::parse_decimal(root->detail, &i) && i < bars.size())
      bars[i]->root_cause = true;
  }
}

}  // namespace trun::launcher::timeline_model
