// Draws `trun timeline`'s page (launcher/timeline.h): the model (launcher/timeline_model.h)
// as an inline SVG picture (legend, time axis, a lane group per node, round and restart lines)
// and a table of the nodes, in one HTML page whose size is checked as it grows.

#include "launcher/timeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <sstream>
#include <stdexcept>

#include "launcher/timeline_model.h"

namespace trun::launcher {

namespace {

namespace col = timeline_colors;
using timeline_model::Badput;
using timeline_model::clip;
using timeline_model::Mark;
using timeline_model::Node;
using timeline_model::Outcome;
using timeline_model::Restart;
using timeline_model::Round;
using timeline_model::TimelineModel;
using timeline_model::Wait;
using timeline_model::WorkerBar;

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

// The strip under a node's bar for each badput interval (trun.agent.badput), by cause.
struct BadputColor {
  const char* cause;
  const char* color;
};
constexpr BadputColor kBadputColors[] = {
    {"startup", "#9467bd"},    {"detection", "#d62728"}, {"stopping", "#8c564b"},
    {"rendezvous", "#1f77b4"}, {"restart", "#ff7f0e"},   {"checkpoint_load", "#bcbd22"},
    {"redone", "#e377c2"},     {"slow", "#7f7f7f"},      {"other", "#c7c7c7"},
};
const char* badput_color(const std::string& cause) {
  for (const auto& c : kBadputColors) {
    if (cause == c.cause) return c.color;
  }
  return "#c7c7c7";
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

// Writes the page of a finished model. One use: render() once.
class Page {
 public:
  Page(const TimelineModel& model, uint64_t max_page_bytes)
      : max_page_bytes_(max_page_bytes), nodes_(model.nodes()), rounds_(model.rounds()) {}

  // The model holds at least one node.
  std::string render(const std::string& title) {
    set_time_span();
    int height = kLanesTop;
    for (const Node& n : nodes_) height += group_height(n) + kNodeGap;
    const int lanes_bottom = height - kNodeGap;
    height += 16;

    svg_ << "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"timeline\" width=\"" << kWidth
         << "\" height=\"" << height << "\" viewBox=\"0 0 " << kWidth << ' ' << height
         << "\" shape-rendering=\"crispEdges\" font-family=\"DejaVu Sans, Arial, sans-serif\">\n";
    svg_ << "<rect x=\"0\" y=\"0\" width=\"" << kWidth << "\" height=\"" << height
         << "\" fill=\"#ffffff\"/>\n";
    legend(svg_);

    // Lane backgrounds first, then round lines, then bars, then restart lines on top.
    node_groups();
    svg_ << lanes_.str();
    lanes_.str(std::string());
    axis(svg_, lanes_bottom);  // its grid lines over the lane backgrounds, under the bars
    for (const Round& r : rounds_) round_marker(r, lanes_bottom);
    svg_ << bars_.str();
    bars_.str(std::string());
    svg_ << marks_.str() << "</svg>\n";
    marks_.str(std::string());
    const std::string table = summary();
    return html_page(title, table);
  }

 private:
  static int group_height(const Node& n) {
    return kNodeLaneHeight + kWorkerLaneHeight * static_cast<int>(n.workers.size());
  }

  void set_time_span() {
    t0_ = nodes_.front().first;
    int64_t t1 = nodes_.front().last;
    for (const Node& n : nodes_) {
      t0_ = std::min(t0_, n.first);
      t1 = std::max(t1, n.last);
    }
    span_ = std::max<int64_t>(t1 - t0_, 1);
  }

  int xpos(int64_t ts) const {
    const double f = static_cast<double>(ts - t0_) / static_cast<double>(span_);
    return kLabelWidth + static_cast<int>(std::lround(f * (kWidth - kLabelWidth - kRightPad)));
  }
  std::string rel(int64_t ts) const { return "+" + secs(ts - t0_); }

  // Per node: its group's background, its lane, its workers' lanes and its restart lines.
  void node_groups() {
    int y = kLanesTop;
    size_t index = 0;
    for (const Node& n : nodes_) {
      const int group_top = y;
      lanes_ << "<rect class=\"group-bg\" x=\"0\" y=\"" << group_top << "\" width=\"" << kWidth
             << "\" height=\"" << group_height(n) << "\" fill=\""
             << (index % 2 == 0 ? "#f5f7fb" : "#fdfdfd") << "\"/>\n";
      node_lane(lanes_, bars_, n, y);
      y += kNodeLaneHeight;
      for (const auto& [lr, lane] : n.workers) {
        worker_lane(lanes_, bars_, n, lr, lane, y);
        y += kWorkerLaneHeight;
      }
      for (const Restart& r : n.restarts) restart_marker(n, r, group_top);
      y += kNodeGap;
      ++index;
    }
  }

  void restart_marker(const Node& n, const Restart& r, int group_top) {
    const int x = xpos(r.ts);
    const int height = group_height(n);
    marks_ << "<g class=\"marker " << (r.counted ? "restart" : "reform") << "\" data-node=\""
           << esc(n.label()) << "\"><title>" << esc(n.label()) << " at " << esc(rel(r.ts)) << ": "
           << esc(r.text) << "</title><rect x=\"" << x - 1 << "\" y=\"" << group_top
           << "\" width=\"2\" height=\"" << height << "\" fill=\""
           << (r.counted ? col::kRestart : col::kReform) << "\"/><rect x=\"" << x - 4 << "\" y=\""
           << group_top << "\" width=\"8\" height=\"" << height
           << "\" fill=\"transparent\"/></g>\n";
    check_size();
  }

  void round_marker(const Round& r, int lanes_bottom) {
    const int x = xpos(r.ts);
    std::string members;
    for (const auto& m : r.members) {
      if (!members.empty()) members += ", ";
      members += m.node;
      if (m.group_rank) members += " (group rank " + std::to_string(*m.group_rank) + ")";
    }
    std::ostringstream& svg = svg_;
    svg << "<g class=\"marker round\" data-round=\"" << r.number << "\"><title>round " << r.number
        << (r.run_id.empty() ? "" : " of run " + esc(r.run_id)) << " formed at " << esc(rel(r.ts));
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

  std::string html_page(const std::string& title, const std::string& table) {
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
         << badput_key() << svg_.str();
    svg_.str(std::string());
    html << table << "</body>\n</html>\n";
    return html.str();
  }

  // The colours of the badput strips present (docs/goodput.md), as one line above the picture;
  // empty when no node recorded any.
  std::string badput_key() const {
    std::ostringstream key;
    for (const auto& c : kBadputColors) {
      bool present = false;
      for (const Node& n : nodes_) {
        for (const Badput& b : n.badput) present = present || b.cause == c.cause;
      }
      if (!present) continue;
      key << "<span class=\"badput-key\" style=\"margin-right:10px\"><span style=\"display:inline-"
             "block;width:12px;height:4px;vertical-align:middle;background:"
          << c.color << "\"></span> " << c.cause << "</span>";
    }
    if (key.str().empty()) return {};
    return "<p class=\"sub\">badput under each node's bar: " + key.str() + "</p>\n";
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
    for (const Badput& b : n.badput) {  // a strip along the bar's lower edge, by cause
      const int bx0 = xpos(b.start);
      const int bx1 = std::max(xpos(b.end), bx0 + 1);
      bars << "<g class=\"badput\" data-cause=\"" << esc(b.cause)
           << "\"><title>badput: " << esc(b.cause) << "\nfrom " << esc(rel(b.start)) << " to "
           << esc(rel(b.end)) << " (" << esc(secs(b.end - b.start)) << ")</title><rect x=\"" << bx0
           << "\" y=\"" << y + h - 12 << "\" width=\"" << bx1 - bx0 << "\" height=\"4\" fill=\""
           << badput_color(b.cause) << "\"/></g>\n";
      check_size();
    }
    for (const Mark& m : n.hangs) {
      const int x = xpos(m.ts);
      bars << "<g class=\"hang\"><title>" << esc(rel(m.ts)) << ": " << esc(m.text)
           << "</title><path d=\"M" << x - 6 << ' ' << y + h - 2 << " L" << x + 6 << ' '
           << y + h - 2 << " L" << x << ' ' << y + h - 12 << " Z\" fill=\"#d62728\"/></g>\n";
      check_size();
    }
    for (const Mark& m : n.slow_ranks) {  // an orange diamond on the bar's lower edge
      const int x = xpos(m.ts);
      bars << "<g class=\"slow-rank\"><title>" << esc(rel(m.ts)) << ": " << esc(m.text)
           << "</title><path d=\"M" << x << ' ' << y + h - 14 << " L" << x + 6 << ' ' << y + h - 8
           << " L" << x << ' ' << y + h - 2 << " L" << x - 6 << ' ' << y + h - 8
           << " Z\" fill=\"#ff7f0e\"/></g>\n";
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

  const uint64_t max_page_bytes_;
  const std::vector<Node>& nodes_;
  const std::vector<Round>& rounds_;
  // The parts of the page (mutable: check_size() reads their sizes from const members).
  mutable std::ostringstream svg_, lanes_, bars_, marks_, table_;
  int64_t t0_ = 0;
  int64_t span_ = 1;
};

}  // namespace

std::string render_timeline_html(const std::vector<TimelineEvent>& events, const std::string& title,
                                 uint64_t max_page_bytes) {
  std::vector<const TimelineEvent*> sorted;
  sorted.reserve(events.size());
  for (const auto& e : events) sorted.push_back(&e);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto* a, const auto* b) { return a->timestamp_ms < b->timestamp_ms; });
  TimelineModel model;
  for (const auto* e : sorted) model.add(*e);
  if (model.nodes().empty()) throw std::invalid_argument("a timeline needs at least one event");
  model.finish();
  return Page(model, max_page_bytes).render(title);
}

}  // namespace trun::launcher
