#include "launcher/timeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace trun::launcher {

namespace {

namespace col = timeline_colors;

// Geometry of the picture (pixels).
constexpr int kWidth = 1280;
constexpr int kLabelWidth = 300;  // the lane labels; the chart starts here
constexpr int kRightPad = 24;
constexpr int kLegendY = 8;
constexpr int kAxisY = 62;        // the axis line; tick labels above it
constexpr int kRoundLabelY = 76;  // round numbers
constexpr int kLanesTop = 84;
constexpr int kNodeLaneHeight = 32;
constexpr int kWorkerLaneHeight = 24;
constexpr int kNodeGap = 8;
constexpr const char* kAgentBar = "#b8c4d6";  // the agent runs its group
constexpr const char* kRdzvBar = "#e4e9f2";   // the agent waits in a rendezvous

// `s` cut to at most `n` bytes (then ending in "..."), not inside a UTF-8 sequence.
std::string clip(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  size_t cut = n - 3;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

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

// Printable (no control character reaches the page: they are not even allowed in XML) and
// HTML-escaped.
std::string esc(const std::string& text) {
  const std::string s = printable(text, /*keep_newlines=*/true);
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// A duration in seconds with millisecond precision: "1.234 s".
std::string secs(int64_t ms) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f s", static_cast<double>(ms) / 1000.0);
  return buf;
}

std::string utc(int64_t ms) {
  std::time_t t = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  char out[96];
  std::snprintf(out, sizeof out, "%s.%03d UTC", buf, static_cast<int>(((ms % 1000) + 1000) % 1000));
  return out;
}

enum class Outcome { kSucceeded, kFailed, kSignaled, kStopped, kUnknown };

const char* outcome_class(Outcome o) {
  switch (o) {
    case Outcome::kSucceeded:
      return "succeeded";
    case Outcome::kFailed:
      return "failed";
    case Outcome::kSignaled:
      return "signaled";
    case Outcome::kStopped:
      return "stopped";
    case Outcome::kUnknown:
      return "unknown";
  }
  return "unknown";
}

const char* outcome_color(Outcome o) {
  switch (o) {
    case Outcome::kSucceeded:
      return col::kSucceeded;
    case Outcome::kFailed:
      return col::kFailed;
    case Outcome::kSignaled:
      return col::kSignaled;
    case Outcome::kStopped:
      return col::kStopped;
    case Outcome::kUnknown:
      return col::kUnknown;
  }
  return col::kUnknown;
}

struct WorkerBar {
  int64_t start = 0, end = 0;
  bool ended = false;
  bool root_cause = false;  // the earliest failure of its round across nodes (mark_root_causes)
  Outcome outcome = Outcome::kUnknown;
  std::optional<int64_t> global_rank, role_rank, pid, exitcode, round, attempt;
  std::string signal, raw_error;
};

struct Mark {
  int64_t ts = 0;
  std::string text;  // the tooltip
};

struct Restart {
  int64_t ts = 0;
  bool counted = true;
  std::string text;
};

struct Wait {
  int64_t start = 0, end = 0;
  bool open = true;
  std::string text;
};

struct Node {
  std::string run_id, hostname, node_id;
  int64_t pid = 0;
  int64_t first = 0, last = 0;
  std::optional<int64_t> start, stop, exit_code, nproc, max_restarts, round, group_rank;
  std::string stop_state, entrypoint;
  std::vector<Wait> waits;
  std::vector<Restart> restarts;
  std::vector<Mark> round_ends;
  std::map<int64_t, std::vector<WorkerBar>> workers;  // by local rank
  std::map<int64_t, size_t> open_bars;                // worker pid -> index in workers[lr]
  std::map<int64_t, int64_t> open_rank;               // worker pid -> local rank

  std::string label() const {
    if (!node_id.empty()) return node_id;
    return hostname + ":" + std::to_string(pid);
  }
};

struct RoundMember {
  std::string node;
  std::optional<int64_t> group_rank;
};

struct Round {
  int64_t ts = 0;  // the earliest node's round_formed
  std::string run_id;
  int64_t number = 0;
  std::optional<int64_t> group_world_size, world_size;
  std::vector<RoundMember> members;
};

std::string describe_outcome(const WorkerBar& b) {
  switch (b.outcome) {
    case Outcome::kSucceeded:
      return "succeeded (exit code 0)";
    case Outcome::kFailed:
      return "failed: exit code " + (b.exitcode ? std::to_string(*b.exitcode) : std::string("?"));
    case Outcome::kSignaled:
      return "killed by " + (b.signal.empty() ? std::string("a signal") : b.signal) +
             (b.exitcode ? " (exit code " + std::to_string(*b.exitcode) + ")" : "");
    case Outcome::kStopped:
      return "stopped by trun";
    case Outcome::kUnknown:
      return "still running when the log ends";
  }
  return "";
}

class Builder {
 public:
  explicit Builder(uint64_t max_page_bytes) : max_page_bytes_(max_page_bytes) {}

  void add(const TimelineEvent& e) {
    const auto& md = e.metadata;
    // parse_timeline_event refuses other timestamps; an event made otherwise is clamped, so no
    // difference of two can overflow.
    const int64_t ts = std::clamp<int64_t>(e.timestamp_ms, 0, kMaxTimestampMs);
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
    const std::string& name = e.name;
    if (name == "trun.agent.start") {
      n.start = ts;
      n.nproc = get_int(md, "nproc_per_node");
      n.max_restarts = get_int(md, "max_restarts");
      n.entrypoint = get_str(md, "entrypoint").value_or("");
    } else if (name == "trun.agent.stop") {
      n.stop = ts;
      n.exit_code = get_int(md, "exit_code");
      n.stop_state = get_str(md, "state", kMaxLabelBytes).value_or("");
    } else if (name == "trun.rdzv.join") {
      if (auto id = get_str(md, "node_id", kMaxLabelBytes)) n.node_id = *id;
      Wait w;
      w.start = w.end = ts;
      n.waits.push_back(w);
    } else if (name == "trun.rdzv.round_formed" || name == "trun.rdzv.failed") {
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
      if (name == "trun.rdzv.failed") {
        w.text = "rendezvous failed: " + get_str(md, "error_trace").value_or("?");
      } else {
        n.round = get_int(md, "round");
        n.group_rank = get_int(md, "group_rank");
        w.text = "rendezvous for round " + (n.round ? std::to_string(*n.round) : "?");
        const int64_t number = n.round.value_or(-1);
        auto [rit, fresh] = round_index_.emplace(std::make_pair(run_id, number), rounds_.size());
        if (fresh) {
          rounds_.emplace_back();
          rounds_.back().ts = ts;
          rounds_.back().run_id = run_id;
          rounds_.back().number = number;
        }
        Round& r = rounds_[rit->second];
        r.ts = std::min(r.ts, ts);
        if (!r.group_world_size) r.group_world_size = get_int(md, "group_world_size");
        if (!r.world_size) r.world_size = get_int(md, "world_size");
        r.members.push_back({n.label(), n.group_rank});
      }
    } else if (name.rfind("trun.rdzv.", 0) == 0) {
      const std::string reason = clip(name.substr(10), kMaxLabelBytes);
      std::string text =
          "round " +
          (get_int(md, "round") ? std::to_string(*get_int(md, "round")) : std::string("?")) +
          " ended: " + reason;
      if (auto who = get_str(md, "node_id", kMaxLabelBytes); who && !who->empty()) {
        text += " (node " + *who + ")";
      }
      if (auto msg = get_str(md, "message"); msg && !msg->empty()) text += ": " + *msg;
      n.round_ends.push_back({ts, text});
    } else if (name == "trun.agent.restart") {
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
    } else if (name == "trun.agent.worker_started") {
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
    } else if (name == "trun.agent.worker_exited") {
      const int64_t lr = get_int(md, "local_rank").value_or(-1);
      const auto pid = get_int(md, "worker_pid");
      WorkerBar* b = nullptr;
      if (pid && n.open_bars.count(*pid) && n.open_rank[*pid] == lr) {
        b = &n.workers[lr][n.open_bars[*pid]];
        n.open_bars.erase(*pid);
        n.open_rank.erase(*pid);
      } else {  // a worker that could not start: a bar of no length
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
      const std::string state = get_str(md, "state").value_or("");
      if (state == "SUCCEEDED") {
        b->outcome = Outcome::kSucceeded;
      } else if (state == "STOPPED") {
        b->outcome = Outcome::kStopped;
      } else if (!b->signal.empty() || (b->exitcode && *b->exitcode < 0)) {
        b->outcome = Outcome::kSignaled;
      } else {
        b->outcome = Outcome::kFailed;
      }
    }
    // Other events (trun.agent.failure, names a newer trun adds) only widen the node's span.
  }

  std::string render(const std::string& title) {
    if (nodes_.empty()) throw std::invalid_argument("a timeline needs at least one event");
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

    t0_ = nodes_.front().first;
    int64_t t1 = nodes_.front().last;
    for (const Node& n : nodes_) {
      t0_ = std::min(t0_, n.first);
      t1 = std::max(t1, n.last);
    }
    span_ = std::max<int64_t>(t1 - t0_, 1);

    int height = kLanesTop;
    for (const Node& n : nodes_) {
      height += kNodeLaneHeight + kWorkerLaneHeight * static_cast<int>(n.workers.size()) + kNodeGap;
    }
    const int lanes_bottom = height - kNodeGap;
    height += 16;

    std::ostringstream& svg = svg_;
    svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"timeline\" width=\"" << kWidth
        << "\" height=\"" << height << "\" viewBox=\"0 0 " << kWidth << ' ' << height
        << "\" shape-rendering=\"crispEdges\" font-family=\"DejaVu Sans, Arial, sans-serif\">\n";
    svg << "<rect x=\"0\" y=\"0\" width=\"" << kWidth << "\" height=\"" << height
        << "\" fill=\"#ffffff\"/>\n";
    legend(svg);

    // Lane backgrounds first, then round lines, then bars, then restart lines on top.
    std::ostringstream &lanes = lanes_, &bars = bars_, &restarts = marks_;
    int y = kLanesTop;
    size_t index = 0;
    for (const Node& n : nodes_) {
      const int group_top = y;
      const int group_height =
          kNodeLaneHeight + kWorkerLaneHeight * static_cast<int>(n.workers.size());
      lanes << "<rect class=\"group-bg\" x=\"0\" y=\"" << group_top << "\" width=\"" << kWidth
            << "\" height=\"" << group_height << "\" fill=\""
            << (index % 2 == 0 ? "#f5f7fb" : "#fdfdfd") << "\"/>\n";
      node_lane(lanes, bars, n, y);
      y += kNodeLaneHeight;
      for (const auto& [lr, lane] : n.workers) {
        worker_lane(lanes, bars, n, lr, lane, y);
        y += kWorkerLaneHeight;
      }
      for (const Restart& r : n.restarts) {
        const int x = xpos(r.ts);
        restarts << "<g class=\"marker " << (r.counted ? "restart" : "reform") << "\" data-node=\""
                 << esc(n.label()) << "\"><title>" << esc(n.label()) << " at " << esc(rel(r.ts))
                 << ": " << esc(r.text) << "</title><rect x=\"" << x - 1 << "\" y=\"" << group_top
                 << "\" width=\"2\" height=\"" << group_height << "\" fill=\""
                 << (r.counted ? col::kRestart : col::kReform) << "\"/><rect x=\"" << x - 4
                 << "\" y=\"" << group_top << "\" width=\"8\" height=\"" << group_height
                 << "\" fill=\"transparent\"/></g>\n";
        check_size();
      }
      y += kNodeGap;
      ++index;
    }
    svg << lanes.str();
    lanes.str(std::string());
    axis(svg, lanes_bottom);  // its grid lines over the lane backgrounds, under the bars
    for (const Round& r : rounds_) {
      const int x = xpos(r.ts);
      std::string members;
      for (const auto& m : r.members) {
        if (!members.empty()) members += ", ";
        members += m.node;
        if (m.group_rank) members += " (group rank " + std::to_string(*m.group_rank) + ")";
      }
      svg << "<g class=\"marker round\" data-round=\"" << r.number << "\"><title>round " << r.number
          << (r.run_id.empty() ? "" : " of run " + esc(r.run_id)) << " formed at "
          << esc(rel(r.ts));
      if (r.group_world_size) svg << ": " << *r.group_world_size << " node(s)";
      if (r.world_size) svg << ", " << *r.world_size << " worker(s)";
      svg << "; members: " << esc(members) << "</title><rect x=\"" << x - 1 << "\" y=\"" << kAxisY
          << "\" width=\"2\" height=\"" << lanes_bottom - kAxisY << "\" fill=\"" << col::kRound
          << "\"/><rect x=\"" << x - 4 << "\" y=\"" << kAxisY << "\" width=\"8\" height=\""
          << lanes_bottom - kAxisY << "\" fill=\"transparent\"/><text x=\"" << x + 3 << "\" y=\""
          << kRoundLabelY << "\" font-size=\"10\" fill=\"" << col::kRound << "\">r" << r.number;
      if (r.group_world_size) svg << " \xC2\xB7 " << *r.group_world_size << "n";
      svg << "</text></g>\n";
      check_size();
    }
    svg << bars.str();
    bars.str(std::string());
    svg << restarts.str() << "</svg>\n";
    restarts.str(std::string());
    const std::string table = summary();

    std::ostringstream html;
    html << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>"
         << esc(title) << "</title>\n<style>\n"
         << "body{margin:12px;font-family:'DejaVu Sans',Arial,sans-serif;color:#222;"
            "background:#fff}\n"
         << "h1{font-size:18px;margin:0 0 4px 0}\n"
         << "p.sub{font-size:12px;margin:0 0 8px 0;color:#555}\n"
         << "#timeline .bar:hover,#timeline .marker:hover{stroke:#000;stroke-width:1}\n"
         << "table{border-collapse:collapse;font-size:12px;margin-top:12px}\n"
         << "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}\n"
         << "</style>\n</head>\n<body>\n<h1>" << esc(title) << "</h1>\n<p class=\"sub\">"
         << nodes_.size() << " node(s), " << rounds_.size() << " round(s); time 0 is "
         << esc(utc(t0_)) << ", spanning " << esc(secs(span_))
         << ". Each node's events carry its own clock. Hover for details.</p>\n"
         << svg.str();
    svg.str(std::string());
    html << table << "</body>\n</html>\n";
    return html.str();
  }

 private:
  int xpos(int64_t ts) const {
    const double f = static_cast<double>(ts - t0_) / static_cast<double>(span_);
    return kLabelWidth + static_cast<int>(std::lround(f * (kWidth - kLabelWidth - kRightPad)));
  }
  std::string rel(int64_t ts) const { return "+" + secs(ts - t0_); }

  // The root cause of each failed round: of the workers that failed in it (exited with a code or
  // by a signal; not those trun stopped) on every node, the one that exited first (ties: the
  // node drawn first). A peer that failed because of it (a connection closed by the dead rank)
  // stays an ordinary failure. Rounds are told apart by run id, round and restart count.
  void mark_root_causes() {
    std::map<std::tuple<std::string, int64_t, int64_t>, WorkerBar*> first;
    for (Node& n : nodes_) {
      for (auto& [lr, lane] : n.workers) {
        for (auto& b : lane) {
          if (!b.ended || (b.outcome != Outcome::kFailed && b.outcome != Outcome::kSignaled)) {
            continue;
          }
          auto key = std::make_tuple(n.run_id, b.round.value_or(-1), b.attempt.value_or(-1));
          auto [it, fresh] = first.emplace(key, &b);
          if (!fresh && b.end < it->second->end) it->second = &b;
        }
      }
    }
    for (auto& [key, b] : first) b->root_cause = true;
  }

  void legend(std::ostringstream& svg) const {
    struct Item {
      const char* color;
      const char* text;
      bool line;
    };
    const Item items[] = {
        {col::kSucceeded, "succeeded", false},
        {col::kFailed, "failed (exit code)", false},
        {col::kSignaled, "killed by a signal", false},
        {col::kStopped, "stopped by trun", false},
        {col::kUnknown, "running at the log's end", false},
        {kRdzvBar, "rendezvous", false},
        {kAgentBar, "agent", false},
        {col::kRound, "round formed", true},
        {col::kRestart, "restart (failure)", true},
        {col::kReform, "re-formed (membership)", true},
        {nullptr, "root cause (first failure across nodes)", false},
    };
    svg << "<g class=\"legend\" font-size=\"11\">\n";
    int x = 8, y = kLegendY;
    for (const Item& it : items) {
      const int w = 16 + static_cast<int>(std::string(it.text).size()) * 6 + 14;
      if (x + w > kWidth - 8) {
        x = 8;
        y += 18;
      }
      if (!it.color) {  // the root cause's outline
        svg << "<rect class=\"root-cause-key\" x=\"" << x + 1 << "\" y=\"" << y + 1
            << "\" width=\"10\" height=\"10\" fill=\"" << col::kFailed << "\" stroke=\""
            << col::kRootCause << "\" stroke-width=\"2\"/>";
      } else if (it.line) {
        svg << "<rect x=\"" << x + 5 << "\" y=\"" << y << "\" width=\"2\" height=\"12\" fill=\""
            << it.color << "\"/>";
      } else {
        svg << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"12\" height=\"12\" fill=\""
            << it.color << "\" stroke=\"#999\" stroke-width=\"0.5\"/>";
      }
      svg << "<text x=\"" << x + 16 << "\" y=\"" << y + 10 << "\">" << esc(it.text) << "</text>\n";
      x += w;
    }
    svg << "</g>\n";
  }

  void axis(std::ostringstream& svg, int lanes_bottom) const {
    // A tick step of 1, 2 or 5 times a power of ten giving at most 12 ticks.
    double step = 1.0;
    const double want = static_cast<double>(span_) / 10.0;
    const double p = std::pow(10.0, std::floor(std::log10(std::max(want, 1.0))));
    for (double m : {1.0, 2.0, 5.0, 10.0}) {
      step = m * p;
      if (step >= want) break;
    }
    const int64_t istep = std::max<int64_t>(1, static_cast<int64_t>(step));
    svg << "<g class=\"axis\" font-size=\"10\" fill=\"#444\">\n";
    svg << "<rect x=\"" << kLabelWidth << "\" y=\"" << kAxisY << "\" width=\""
        << kWidth - kLabelWidth - kRightPad << "\" height=\"1\" fill=\"#444\"/>\n";
    for (int64_t t = 0, i = 0; t <= span_ && i < 64; t += istep, ++i) {
      const int x = xpos(t0_ + t);
      svg << "<rect x=\"" << x << "\" y=\"" << kAxisY - 4 << "\" width=\"1\" height=\""
          << lanes_bottom - kAxisY + 4 << "\" fill=\"#e2e2e2\"/>";
      char buf[32];
      if (istep >= 1000) {
        std::snprintf(buf, sizeof buf, "%g s", static_cast<double>(t) / 1000.0);
      } else {
        std::snprintf(buf, sizeof buf, "%.3g s", static_cast<double>(t) / 1000.0);
      }
      svg << "<text x=\"" << x << "\" y=\"" << kAxisY - 7 << "\" text-anchor=\"middle\">" << buf
          << "</text>\n";
    }
    svg << "</g>\n";
  }

  void node_lane(std::ostringstream& lanes, std::ostringstream& bars, const Node& n, int y) const {
    const int h = kNodeLaneHeight;
    std::string detail = n.hostname + " pid " + std::to_string(n.pid);
    if (n.exit_code) detail += " \xC2\xB7 exit " + std::to_string(*n.exit_code);
    if (!n.restarts.empty()) {
      int counted = 0;
      for (const auto& r : n.restarts) counted += r.counted ? 1 : 0;
      detail += " \xC2\xB7 " + std::to_string(counted) + " restart(s)";
    }
    lanes << "<g class=\"lane node\" data-node=\"" << esc(n.label()) << "\"><rect x=\"4\" y=\""
          << y + 4 << "\" width=\"10\" height=\"" << h - 8 << "\" fill=\"" << col::kNodeMarker
          << "\"/><text x=\"20\" y=\"" << y + 14 << "\" font-size=\"12\" font-weight=\"bold\">"
          << esc(clip("node " + n.label(), 38)) << "</text><text x=\"20\" y=\"" << y + 27
          << "\" font-size=\"10\" fill=\"#555\">" << esc(clip(detail, 48)) << "</text></g>\n";
    const int64_t begin = n.start.value_or(n.first);
    const int64_t end = n.stop.value_or(n.last);
    std::string tip = "node " + n.label() + " (" + n.hostname + ", agent pid " +
                      std::to_string(n.pid) + (n.run_id.empty() ? "" : ", run " + n.run_id) +
                      ")\nfrom " + rel(begin) + " to " + rel(end);
    if (n.nproc) tip += "\nnproc_per_node " + std::to_string(*n.nproc);
    if (n.max_restarts) tip += ", max_restarts " + std::to_string(*n.max_restarts);
    if (!n.entrypoint.empty()) tip += "\nentrypoint " + n.entrypoint;
    if (n.stop) {
      tip += "\nstopped: " + (n.stop_state.empty() ? std::string("?") : n.stop_state) +
             ", exit code " + (n.exit_code ? std::to_string(*n.exit_code) : std::string("?"));
    } else {
      tip += "\nno stop event: the agent was killed or still runs";
    }
    const int x0 = xpos(begin);
    const int x1 = std::max(xpos(end), x0 + 2);
    bars << "<g class=\"agent\"><title>" << esc(tip) << "</title><rect x=\"" << x0 << "\" y=\""
         << y + 8 << "\" width=\"" << x1 - x0 << "\" height=\"" << h - 16 << "\" fill=\""
         << kAgentBar << "\"/></g>\n";
    for (const Wait& w : n.waits) {
      const int wx0 = xpos(w.start);
      const int wx1 = std::max(xpos(w.end), wx0 + 2);
      bars << "<g class=\"rdzv\"><title>" << esc(w.text) << "\nfrom " << esc(rel(w.start)) << " to "
           << esc(rel(w.end)) << " (" << esc(secs(w.end - w.start)) << ")</title><rect x=\"" << wx0
           << "\" y=\"" << y + 8 << "\" width=\"" << wx1 - wx0 << "\" height=\"" << h - 16
           << "\" fill=\"" << kRdzvBar << "\" stroke=\"#8899b3\" stroke-width=\"0.5\"/></g>\n";
      check_size();
    }
    for (const Mark& m : n.round_ends) {
      const int x = xpos(m.ts);
      bars << "<g class=\"round-end\"><title>" << esc(rel(m.ts)) << ": " << esc(m.text)
           << "</title><path d=\"M" << x - 5 << ' ' << y + 2 << " L" << x + 5 << ' ' << y + 2
           << " L" << x << ' ' << y + 9 << " Z\" fill=\"#333333\"/></g>\n";
      check_size();
    }
  }

  void worker_lane(std::ostringstream& lanes, std::ostringstream& bars, const Node& n, int64_t lr,
                   const std::vector<WorkerBar>& lane, int y) const {
    const int h = kWorkerLaneHeight;
    std::string ranks;
    std::optional<int64_t> prev;
    for (const auto& b : lane) {
      if (!b.global_rank || b.global_rank == prev) continue;
      if (!ranks.empty()) ranks += "\xE2\x86\x92";  // an arrow
      ranks += std::to_string(*b.global_rank);
      prev = b.global_rank;
    }
    std::string label = "local rank " + std::to_string(lr);
    if (!ranks.empty()) label += " \xC2\xB7 rank " + ranks;
    lanes << "<g class=\"lane worker\" data-node=\"" << esc(n.label()) << "\" data-local-rank=\""
          << lr << "\"><rect x=\"4\" y=\"" << y + 4 << "\" width=\"10\" height=\"" << h - 8
          << "\" fill=\"" << col::kWorkerMarker << "\"/><text x=\"32\" y=\"" << y + 16
          << "\" font-size=\"11\">" << esc(clip(label, 40)) << "</text></g>\n";
    for (const WorkerBar& b : lane) {
      const int x0 = xpos(b.start);
      const int x1 = std::max(xpos(b.end), x0 + 3);
      std::string tip = "node " + n.label() + ", local rank " + std::to_string(lr);
      if (b.global_rank) tip += ", rank " + std::to_string(*b.global_rank);
      if (b.role_rank) tip += " (role rank " + std::to_string(*b.role_rank) + ")";
      tip += "\n" + describe_outcome(b);
      if (b.pid) tip += "\npid " + std::to_string(*b.pid);
      if (b.round) tip += ", round " + std::to_string(*b.round);
      if (b.attempt) tip += ", restarts used " + std::to_string(*b.attempt);
      tip += "\nstarted " + rel(b.start) + ", " + (b.ended ? "ended " : "log ends ") + rel(b.end) +
             " (" + secs(b.end - b.start) + ")";
      if (!b.raw_error.empty()) tip += "\n" + b.raw_error;
      if (b.root_cause) tip = "ROOT CAUSE (the first failure of its round across nodes)\n" + tip;
      // The class stays the outcome's (tests and styles select bars by it); the mark is an
      // attribute, an outline and a label.
      bars << "<g class=\"bar " << outcome_class(b.outcome) << "\""
           << (b.root_cause ? " data-root-cause=\"true\"" : "") << " data-node=\"" << esc(n.label())
           << "\" data-local-rank=\"" << lr << "\"><title>" << esc(tip) << "</title><rect x=\""
           << x0 << "\" y=\"" << y + 4 << "\" width=\"" << x1 - x0 << "\" height=\"" << h - 8
           << "\" fill=\"" << outcome_color(b.outcome) << "\"";
      if (b.root_cause) bars << " stroke=\"" << col::kRootCause << "\" stroke-width=\"2\"";
      bars << "/>";
      std::string text;
      if (b.global_rank) text = "rank " + std::to_string(*b.global_rank);
      if (b.outcome == Outcome::kFailed && b.exitcode)
        text += " exit " + std::to_string(*b.exitcode);
      if (b.outcome == Outcome::kSignaled && !b.signal.empty()) text += " " + b.signal;
      if (b.root_cause) {
        // The label right of the bar's end (the bar itself may be too short for text).
        bars << "<text class=\"root-cause-label\" x=\"" << std::min(x1 + 3, kWidth - 70)
             << "\" y=\"" << y + 15 << "\" font-size=\"10\" font-weight=\"bold\" fill=\""
             << col::kRootCause << "\">root cause</text>";
      }
      if (!text.empty() && static_cast<int>(text.size()) * 6 + 6 < x1 - x0) {
        bars << "<text x=\"" << x0 + 4 << "\" y=\"" << y + 15
             << "\" font-size=\"10\" fill=\"#ffffff\">" << esc(text) << "</text>";
      }
      bars << "</g>\n";
      check_size();
    }
  }

  std::string summary() {
    std::ostringstream& t = table_;
    t << "<table class=\"nodes\">\n<tr><th>node</th><th>host</th><th>agent pid</th><th>run</th>"
         "<th>workers</th><th>restarts (failure / re-form)</th><th>end</th></tr>\n";
    for (const Node& n : nodes_) {
      int counted = 0, reform = 0;
      for (const auto& r : n.restarts) (r.counted ? counted : reform)++;
      size_t bars = 0;
      for (const auto& [lr, lane] : n.workers) bars += lane.size();
      t << "<tr><td>" << esc(n.label()) << "</td><td>" << esc(n.hostname) << "</td><td>" << n.pid
        << "</td><td>" << esc(n.run_id) << "</td><td>" << n.workers.size() << " lane(s), " << bars
        << " process(es)</td><td>" << counted << " / " << reform << "</td><td>";
      if (n.stop) {
        t << esc(n.stop_state) << ", exit " << (n.exit_code ? std::to_string(*n.exit_code) : "?");
      } else {
        t << "no stop event";
      }
      t << "</td></tr>\n";
      check_size();
    }
    t << "</table>\n";
    return t.str();
  }

  // Throws when what the page holds so far is over its bound: checked after every element, so
  // the page never grows past the bound by more than one element (itself bounded: every text
  // in it is cut).
  void check_size() const {
    uint64_t total = 0;
    for (std::ostringstream* s : {&svg_, &lanes_, &bars_, &marks_, &table_}) {
      const std::streamoff n = s->tellp();
      if (n > 0) total += static_cast<uint64_t>(n);
    }
    if (total > max_page_bytes_) {
      throw TimelinePageTooLarge("the page would be over " + std::to_string(max_page_bytes_ >> 20) +
                                 " MiB (too many elements or labels)");
    }
  }

  uint64_t max_page_bytes_;
  // The parts of the page (mutable: check_size() reads their sizes from const members).
  mutable std::ostringstream svg_, lanes_, bars_, marks_, table_;
  std::vector<Node> nodes_;
  std::map<std::tuple<std::string, std::string, int64_t>, size_t> index_;
  std::vector<Round> rounds_;
  std::map<std::pair<std::string, int64_t>, size_t> round_index_;
  int64_t t0_ = 0;
  int64_t span_ = 1;
};

}  // namespace

namespace {

// Whether arrays and objects nest deeper than `limit` in `line` (brackets inside strings do not
// count). Checked before parsing: a line of a million "[" is refused in one pass, without
// building a million nested values.
bool nested_deeper_than(const std::string& line, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : line) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

}  // namespace

std::optional<TimelineEvent> parse_timeline_event(const std::string& line, std::string* error) {
  if (line.size() > kMaxEventLineBytes) {
    *error = "longer than " + std::to_string(kMaxEventLineBytes >> 20) + " MiB";
    return std::nullopt;
  }
  if (nested_deeper_than(line, kMaxEventNesting)) {
    *error = "nested deeper than " + std::to_string(kMaxEventNesting) + " levels";
    return std::nullopt;
  }
  nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    *error = "not a JSON value";
    return std::nullopt;
  }
  if (!j.is_object()) {
    *error = "not a JSON object";
    return std::nullopt;
  }
  TimelineEvent e;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string()) {
    *error = "no string \"name\"";
    return std::nullopt;
  }
  e.name = name->get<std::string>();
  auto ts = j.find("timestamp");
  if (ts == j.end() || !ts->is_number_integer()) {
    *error = "no integer \"timestamp\"";
    return std::nullopt;
  }
  // Milliseconds since the epoch, up to the year 9999: anything else (negative, -2^63, a
  // number that does not fit int64_t) is not a time trun wrote, and would make the spans
  // computed from it overflow.
  const bool in_range = ts->is_number_unsigned()
                            ? ts->get<uint64_t>() <= static_cast<uint64_t>(kMaxTimestampMs)
                            : ts->get<int64_t>() >= 0 && ts->get<int64_t>() <= kMaxTimestampMs;
  if (!in_range) {
    *error = "\"timestamp\" " + ts->dump() + " out of range (0.." +
             std::to_string(kMaxTimestampMs) + " ms since the epoch)";
    return std::nullopt;
  }
  e.timestamp_ms = ts->get<int64_t>();
  auto md = j.find("metadata");
  if (md == j.end() || !md->is_object()) {
    *error = "no object \"metadata\"";
    return std::nullopt;
  }
  e.metadata = std::move(*md);
  return e;
}

EventLogParser::EventLogParser(uint32_t file, std::vector<TimelineEvent>* events, OnSkip on_skip)
    : file_(file), events_(events), on_skip_(std::move(on_skip)) {}

void EventLogParser::feed(const char* data, size_t size) {
  const char* end = data + size;
  while (data < end) {
    const char* nl = static_cast<const char*>(std::memchr(data, '\n', end - data));
    const char* stop = nl != nullptr ? nl : end;
    const size_t n = static_cast<size_t>(stop - data);
    if (!overlong_) {
      if (line_.size() + n > kMaxEventLineBytes) {
        overlong_ = true;  // the rest of this line is dropped as it comes
        line_.clear();
        line_.shrink_to_fit();
      } else {
        line_.append(data, n);
      }
    }
    data = stop;
    if (nl != nullptr) {
      ++data;
      end_line();
    }
  }
}

void EventLogParser::finish() {
  if (overlong_ || !line_.empty()) end_line();
}

void EventLogParser::end_line() {
  ++line_no_;
  const bool overlong = overlong_;
  overlong_ = false;
  std::string line;
  line.swap(line_);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  std::string error;
  std::optional<TimelineEvent> e;
  if (overlong) {
    error = "longer than " + std::to_string(kMaxEventLineBytes >> 20) + " MiB";
  } else if (line.find_first_not_of(" \t") == std::string::npos) {
    return;
  } else {
    e = parse_timeline_event(line, &error);
  }
  if (!e) {
    if (on_skip_) on_skip_(line_no_, error);
    return;
  }
  e->file = file_;
  e->line = line_no_;
  events_->push_back(std::move(*e));
  ++found_;
}

std::string printable(std::string_view text, bool keep_newlines) {
  // Most text is plain ASCII: kept as it is.
  if (std::all_of(text.begin(), text.end(), [](char c) { return c >= 0x20 && c < 0x7F; })) {
    return std::string(text);
  }
  std::string out;
  out.reserve(text.size());
  auto hex = [&](const char* prefix, unsigned v, int digits) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%s%0*X", prefix, digits, v);
    out += buf;
  };
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      if ((c >= 0x20 && c != 0x7F) || (keep_newlines && (c == '\n' || c == '\t'))) {
        out += static_cast<char>(c);
      } else {
        hex("\\x", c, 2);
      }
      ++i;
      continue;
    }
    // A UTF-8 sequence: its length, the smallest code point of that length (shorter encodings
    // are invalid), and its continuation bytes.
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    }
    bool ok = len != 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) {
        ok = false;
      } else {
        cp = (cp << 6) | (p[i + k] & 0x3F);
      }
    }
    ok = ok && cp >= min && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (!ok) {
      hex("\\x", c, 2);  // this byte only; the next one starts afresh
      ++i;
      continue;
    }
    const bool c1 = cp >= 0x80 && cp <= 0x9F;
    const bool bidi = (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
    if (c1 || bidi) {
      hex("\\u", cp, 4);
    } else {
      out.append(text.data() + i, len);
    }
    i += len;
  }
  return out;
}

std::string render_timeline_html(const std::vector<TimelineEvent>& events, const std::string& title,
                                 uint64_t max_page_bytes) {
  std::vector<const TimelineEvent*> sorted;
  sorted.reserve(events.size());
  for (const auto& e : events) sorted.push_back(&e);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto* a, const auto* b) { return a->timestamp_ms < b->timestamp_ms; });
  Builder b(max_page_bytes);
  for (const auto* e : sorted) b.add(*e);
  return b.render(title);
}

}  // namespace trun::launcher
