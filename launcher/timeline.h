#pragma once
// The timeline of a run: `trun timeline EVENTLOG... -o run.html` (launcher/timeline_command.h).
//
// Input: the --event-log lines of any number of agents (agent/event_log.h; the names and fields
// are listed in docs/observability.md). Output: one self-contained HTML page with an inline SVG
// picture (no external resources, no script): a lane per node (agent) and per worker (node,
// local rank), bars for worker lifetimes coloured by outcome, the root cause of each failed round
// outlined and labelled (the earliest failure across nodes), rounds and restarts as vertical
// lines, a time axis, a legend and <title> tooltips with the details.
//
// Pure: no I/O. Clocks: the events' timestamps are used as they are (ms since the epoch on each
// node's clock); nodes whose clocks differ are drawn shifted by that difference.

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace trun::launcher {

// Bounds on what `trun timeline` reads and writes (docs/observability.md, "Limits"). The lines
// trun writes are a few hundred bytes, two levels deep, with timestamps of this millennium.
inline constexpr uint64_t kDefaultMaxInputBytes = uint64_t{64} << 20;  // all the files together
inline constexpr uint64_t kMinMaxPageBytes = uint64_t{128} << 20;      // and 2x --max-input-size
inline constexpr size_t kMaxEventLineBytes = size_t{1} << 20;
inline constexpr int kMaxEventNesting = 16;                  // arrays and objects inside a line
inline constexpr int64_t kMaxTimestampMs = 253402300799999;  // 9999-12-31 23:59:59.999 UTC
inline constexpr size_t kMaxLabelBytes = 256;  // a run id, host name or node id on the page
inline constexpr size_t kMaxTextBytes = 4096;  // any other text of an event on the page

// One event line, parsed; `file` (the index of the input) and `line` (from 1) are for messages.
struct TimelineEvent {
  uint32_t file = 0;
  uint64_t line = 0;
  std::string name;
  int64_t timestamp_ms = 0;  // 0..kMaxTimestampMs
  nlohmann::json metadata;   // an object
};

// Parses one line of an event log. Returns nullopt and sets *error (one phrase, e.g. "not
// JSON: ..." or "no integer \"timestamp\"") when the line is not an event: not JSON, longer than
// kMaxEventLineBytes, nested deeper than kMaxEventNesting, no string "name", no integer
// "timestamp" in 0..kMaxTimestampMs (a negative or absurd one is refused here, so no duration
// computed from two of them can overflow), no object "metadata".
std::optional<TimelineEvent> parse_timeline_event(const std::string& line, std::string* error);

// Splits the bytes of one event log into lines as they come (feed() any chunks, then finish())
// and parses each: events are appended to *events, lines that are not events are reported to
// `on_skip` with their number and the reason. Memory: at most one line (kMaxEventLineBytes) is
// buffered; the rest of a longer line is dropped as it comes and the line is skipped. Blank
// lines are ignored; a trailing "\r" is removed.
class EventLogParser {
 public:
  using OnSkip = std::function<void(uint64_t line, const std::string& reason)>;
  EventLogParser(uint32_t file, std::vector<TimelineEvent>* events, OnSkip on_skip);
  void feed(const char* data, size_t size);
  // The last line, when the file does not end with a newline (a writer killed mid-line).
  void finish();
  uint64_t events_found() const { return found_; }

 private:
  void end_line();

  uint32_t file_;
  std::vector<TimelineEvent>* events_;
  OnSkip on_skip_;
  std::string line_;
  bool overlong_ = false;
  uint64_t line_no_ = 0;
  uint64_t found_ = 0;
};

// Thrown by render_timeline_html when the page would be larger than its bound.
struct TimelinePageTooLarge : std::length_error {
  using std::length_error::length_error;
};

// The page for `events` (any order; at least one, else std::invalid_argument). `title` heads
// the page. Every text from the events is cut (kMaxLabelBytes, kMaxTextBytes), made printable
// and HTML-escaped. Throws TimelinePageTooLarge when the page would exceed `max_page_bytes`
// (many elements with long labels can make it much larger than the input).
std::string render_timeline_html(const std::vector<TimelineEvent>& events, const std::string& title,
                                 uint64_t max_page_bytes = kMinMaxPageBytes);

// Text that came from a file or a store, made safe to show on a terminal or in a page: control
// characters (C0 but for the newline and tab when `keep_newlines`, DEL, C1 such as the 8-bit
// CSI U+009B) become \xNN or \u00NN escapes, the bidirectional-override characters
// (U+202A..U+202E, U+2066..U+2069) \uNNNN, bytes that are not UTF-8 \xNN; a backslash stays
// as it is. Everything else, including valid UTF-8, is kept. Used by `trun status` too.
std::string printable(std::string_view text, bool keep_newlines = false);

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
// The outline of the root cause (its bar also has data-root-cause="true" and a "root cause"
// label): per round (and restart count), the worker that failed first across every node (exited
// with a code or by a signal, not stopped by trun), by exit time.
inline constexpr const char* kRootCause = "#000000";
}  // namespace timeline_colors

}  // namespace trun::launcher
