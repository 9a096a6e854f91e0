#pragma once
// The timeline of a run: `trun timeline EVENTLOG... -o run.html` (launcher/timeline_command.h).
//
// Input: the --event-log lines of any number of agents (agent/event_log.h; the names and fields
// are listed in docs/observability.md). Output: one self-contained HTML page with an inline SVG
// picture (no external resources, no script): a lane per node (agent) and per worker (node,
// local rank), bars for worker lifetimes coloured by outcome, rounds and restarts as vertical
// lines, a time axis, a legend and <title> tooltips with the details.
//
// Pure: no I/O. Clocks: the events' timestamps are used as they are (ms since the epoch on each
// node's clock); nodes whose clocks differ are drawn shifted by that difference.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace trun::launcher {

// One event line, parsed; `where` is "FILE:LINE" for messages.
struct TimelineEvent {
  std::string where;
  std::string name;
  int64_t timestamp_ms = 0;
  nlohmann::json metadata;  // an object
};

// Parses one line of an event log. Returns nullopt and sets *error (one phrase, e.g. "not
// JSON: ..." or "no integer \"timestamp\"") when the line is not an event.
std::optional<TimelineEvent> parse_timeline_event(const std::string& line, std::string* error);

// The page for `events` (any order; at least one). `title` heads the page.
std::string render_timeline_html(const std::vector<TimelineEvent>& events,
                                 const std::string& title);

// The colours the page uses, for tests that look at its pixels (tests/observability).
namespace timeline_colors {
inline constexpr const char* kNodeMarker = "#0b3d91";    // left of every node lane
inline constexpr const char* kWorkerMarker = "#5fa8d3";  // left of every worker lane
inline constexpr const char* kSucceeded = "#2ca02c";
inline constexpr const char* kFailed = "#d62728";    // exited with a code other than 0
inline constexpr const char* kSignaled = "#9467bd";  // killed by a signal
inline constexpr const char* kStopped = "#8c8c8c";   // stopped by trun
inline constexpr const char* kUnknown = "#e3c800";   // the log ends while it runs
inline constexpr const char* kRestart = "#ff7f0e";   // a restart after a failure (counted)
inline constexpr const char* kReform = "#17becf";    // a membership change re-formed the group
inline constexpr const char* kRound = "#1f4fd1";     // a round formed
}  // namespace timeline_colors

}  // namespace trun::launcher
