// Reading event logs for `trun timeline` (launcher/timeline.h): one line parsed into a
// TimelineEvent, the lines of a log split and parsed as they come (EventLogParser), and
// printable(), which makes any text from a log safe to show.

#include "launcher/timeline.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace trun::launcher {

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

}  // namespace trun::launcher
