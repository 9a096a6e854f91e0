#include "launcher/timeline_command.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "launcher/timeline.h"

namespace trun::launcher {

namespace {

constexpr const char* kUsage =
    "usage: trun timeline EVENTLOG... -o OUTPUT.html [--title TEXT]\n"
    "\n"
    "Draws one self-contained HTML page (inline SVG) for a run from the --event-log files of\n"
    "its nodes: a lane per node and per worker, worker lifetimes coloured by outcome, rounds\n"
    "and restarts as vertical lines. Hover an element for its details.\n"
    "\n"
    "  -o, --output FILE  the page to write (required)\n"
    "  --title TEXT       the page's title (default: \"trun timeline\" and the run ids)\n"
    "  -h, --help         this text\n"
    "\n"
    "Lines that are not events are skipped with a warning; an unreadable file is an error.\n"
    "Exit status: 0 written, 1 an input or output error, 2 a command-line error.\n";

// At most this many warnings about skipped lines per file; then one line with the count.
constexpr int kMaxLineWarnings = 5;
// A line longer than this is not an event trun wrote (they are a few hundred bytes).
constexpr size_t kMaxLineBytes = 1 << 20;

int usage_error(const std::string& what) {
  std::fprintf(stderr, "trun timeline: error: %s\n(see trun timeline --help)\n", what.c_str());
  return 2;
}

// Reads the whole file; false and *error on failure.
bool read_file(const std::string& path, std::string* out, std::string* error) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *error = std::strerror(errno);
    return false;
  }
  struct stat st {};
  if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    *error = "is a directory";
    return false;
  }
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out->append(buf, static_cast<size_t>(n));
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      *error = std::strerror(errno);
      ::close(fd);
      return false;
    }
  }
  ::close(fd);
  return true;
}

bool write_file(const std::string& path, const std::string& data, std::string* error) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    *error = std::strerror(errno);
    return false;
  }
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      *error = std::strerror(n < 0 ? errno : ENOSPC);
      ::close(fd);
      ::unlink(tmp.c_str());
      return false;
    }
  }
  if (::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    *error = std::strerror(errno);
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace

int run_timeline_command(int argc, char** argv) {
  std::vector<std::string> inputs;
  std::string output, title;
  bool only_files = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (only_files) {
      inputs.push_back(a);
    } else if (a == "--") {
      only_files = true;
    } else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "-o" || a == "--output") {
      const char* v = value();
      if (v == nullptr) return usage_error(a + " needs a file name");
      output = v;
    } else if (a.rfind("--output=", 0) == 0) {
      output = a.substr(9);
    } else if (a == "--title") {
      const char* v = value();
      if (v == nullptr) return usage_error("--title needs a text");
      title = v;
    } else if (a.rfind("--title=", 0) == 0) {
      title = a.substr(8);
    } else if (a.size() > 1 && a[0] == '-') {
      return usage_error("unknown option " + a);
    } else {
      inputs.push_back(a);
    }
  }
  if (inputs.empty()) return usage_error("no event log given (trun timeline EVENTLOG... -o FILE)");
  if (output.empty()) return usage_error("no output file given (-o FILE)");

  std::vector<TimelineEvent> events;
  std::vector<std::string> run_ids;
  for (const std::string& path : inputs) {
    std::string text, error;
    if (!read_file(path, &text, &error)) {
      std::fprintf(stderr, "trun timeline: error: cannot read the event log %s: %s\n", path.c_str(),
                   error.c_str());
      return 1;
    }
    size_t pos = 0, line_no = 0, found = 0;
    int skipped = 0;
    while (pos < text.size()) {
      size_t nl = text.find('\n', pos);
      if (nl == std::string::npos) nl = text.size();
      std::string line = text.substr(pos, nl - pos);
      pos = nl + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      std::optional<TimelineEvent> e;
      if (line.size() > kMaxLineBytes) {
        error = "longer than 1 MiB";
      } else {
        e = parse_timeline_event(line, &error);
      }
      if (!e) {
        if (++skipped <= kMaxLineWarnings) {
          std::fprintf(stderr, "trun timeline: warning: %s:%zu: not an event (%s); skipped\n",
                       path.c_str(), line_no, error.c_str());
        }
        continue;
      }
      e->where = path + ":" + std::to_string(line_no);
      if (auto it = e->metadata.find("run_id"); it != e->metadata.end() && it->is_string()) {
        const std::string id = it->get<std::string>();
        if (std::find(run_ids.begin(), run_ids.end(), id) == run_ids.end()) run_ids.push_back(id);
      }
      events.push_back(std::move(*e));
      ++found;
    }
    if (skipped > kMaxLineWarnings) {
      std::fprintf(stderr, "trun timeline: warning: %s: %d more line(s) skipped\n", path.c_str(),
                   skipped - kMaxLineWarnings);
    }
    if (found == 0 && inputs.size() > 1) {
      std::fprintf(stderr, "trun timeline: warning: %s holds no event\n", path.c_str());
    }
  }
  if (events.empty()) {
    std::fprintf(stderr, "trun timeline: error: no event in %s\n",
                 inputs.size() == 1 ? inputs[0].c_str() : "any of the files given");
    return 1;
  }
  if (title.empty()) {
    title = "trun timeline";
    for (size_t i = 0; i < run_ids.size() && i < 4; ++i)
      title += (i == 0 ? ": " : ", ") + run_ids[i];
    if (run_ids.size() > 4) title += ", ...";
  }
  const std::string html = render_timeline_html(events, title);
  std::string error;
  if (!write_file(output, html, &error)) {
    std::fprintf(stderr, "trun timeline: error: cannot write %s: %s\n", output.c_str(),
                 error.c_str());
    return 1;
  }
  return 0;
}

}  // namespace trun::launcher
