// clang-format off
// fuzz-sources: launcher/timeline.cpp launcher/timeline_event.cpp launcher/timeline_model.cpp rendezvous/handler.cpp
// clang-format on
// libFuzzer target for the event-log reader of `trun timeline` (launcher/timeline.h), built and
// run by scripts/fuzz.sh. The input is the bytes of one event-log file: it goes through the
// EventLogParser that `trun timeline` reads files with, fed in chunks whose size the first input
// byte picks (as read() may return any amount), and the events found are drawn by
// render_timeline_html with a small page bound.
//
// Besides the sanitizers, it checks: the events and skipped lines do not depend on how the bytes
// were chunked; every event has a timestamp in 0..kMaxTimestampMs, a metadata object and a line
// number within the input's lines, in increasing order; the page has no control character and
// no markup from the input (every '<' opens one of the page's own tags), and is bounded;
// printable() leaves no control character, no invalid UTF-8 and is idempotent.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "launcher/timeline.h"

namespace tl = trun::launcher;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

struct Parsed {
  std::vector<tl::TimelineEvent> events;
  std::vector<uint64_t> skipped;
};

Parsed parse(std::string_view data, size_t chunk) {
  Parsed p;
  tl::EventLogParser parser(0, &p.events, [&](uint64_t line, const std::string& reason) {
    check(!reason.empty());
    p.skipped.push_back(line);
  });
  for (size_t at = 0; at < data.size(); at += chunk) {
    parser.feed(data.data() + at, std::min(chunk, data.size() - at));
  }
  parser.finish();
  check(parser.events_found() == p.events.size());
  return p;
}

// No C0 control (but newline and tab when allowed), no DEL, no C1 (as UTF-8), valid UTF-8.
bool clean(std::string_view s, bool newlines) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const unsigned c = p[i];
    if (c < 0x80) {
      if ((c < 0x20 && !(newlines && (c == '\n' || c == '\t'))) || c == 0x7F) return false;
      ++i;
      continue;
    }
    size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
    }
    if (c == 0xC2 && p[i + 1] <= 0x9F) return false;  // U+0080..U+009F
    i += len;
  }
  return true;
}

// Every '<' of the page opens (or closes) one of the tags the renderer writes.
bool only_own_markup(const std::string& html) {
  static const char* const kTags[] = {
      "!DOCTYPE html>", "html", "head", "meta", "title", "style", "body", "h1", "p ", "p>", "svg",
      "rect",           "g ",   "g>",   "text", "path",  "table", "tr",   "td", "th"};
  for (size_t at = html.find('<'); at != std::string::npos; at = html.find('<', at + 1)) {
    size_t from = at + 1;
    if (from < html.size() && html[from] == '/') ++from;
    bool known = false;
    for (const char* tag : kTags) {
      if (html.compare(from, std::strlen(tag), tag) == 0) known = true;
    }
    if (!known) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t chunk = 1 + data[0] % 97;
  const std::string_view log(reinterpret_cast<const char*>(data) + 1, size - 1);

  Parsed whole = parse(log, log.size() + 1);
  Parsed chunked = parse(log, chunk);
  check(whole.skipped == chunked.skipped);
  check(whole.events.size() == chunked.events.size());
  uint64_t lines = 1;
  for (char c : log) lines += c == '\n' ? 1 : 0;
  uint64_t prev = 0;
  for (size_t i = 0; i < whole.events.size(); ++i) {
    const auto& a = whole.events[i];
    const auto& b = chunked.events[i];
    check(a.name == b.name && a.timestamp_ms == b.timestamp_ms && a.line == b.line &&
          a.metadata == b.metadata);
    check(a.timestamp_ms >= 0 && a.timestamp_ms <= tl::kMaxTimestampMs);
    check(a.metadata.is_object());
    check(a.line > prev && a.line <= lines);
    prev = a.line;
  }

  if (!whole.events.empty()) {
    constexpr uint64_t kPage = 4 << 20;
    try {
      const std::string html =
          tl::render_timeline_html(whole.events, std::string(log.substr(0, 64)), kPage);
      check(html.size() <= kPage + (1 << 20));  // the bound, plus the last element and the head
      check(clean(html, /*newlines=*/true));
      check(only_own_markup(html));
    } catch (const tl::TimelinePageTooLarge&) {
    }
  }

  const std::string shown = tl::printable(log);
  check(clean(shown, /*newlines=*/false));
  check(tl::printable(shown) == shown);
  check(clean(tl::printable(log, /*keep_newlines=*/true), /*newlines=*/true));
  return 0;
}
