#include "launcher/timeline_command.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/decimal.h"
#include "launcher/timeline.h"

namespace trun::launcher {

namespace {

constexpr const char* kUsage =
    "usage: trun timeline EVENTLOG... -o OUTPUT.html [--title TEXT] [--max-input-size SIZE]\n"
    "\n"
    "Draws one self-contained HTML page (inline SVG) for a run from the --event-log files of\n"
    "its nodes: a lane per node and per worker, worker lifetimes coloured by outcome, rounds\n"
    "and restarts as vertical lines. Hover an element for its details.\n"
    "\n"
    "  -o, --output FILE      the page to write (required; a new or a regular file, not an\n"
    "                         input)\n"
    "  --title TEXT           the page's title (default: \"trun timeline\" and the run ids)\n"
    "  --max-input-size SIZE  the most bytes read from all the event logs together (default\n"
    "                         64M; suffixes K, M, G: powers of 1024)\n"
    "  -h, --help             this text\n"
    "\n"
    "Only regular files are read. Lines that are not events are skipped with a warning; an\n"
    "unreadable file or too much input is an error.\n"
    "Exit status: 0 written, 1 an input or output error, 2 a command-line error.\n";

// At most this many warnings about skipped lines per file; then one line with the count.
constexpr int kMaxLineWarnings = 5;
// At most this many run ids are named in the default title (then "...").
constexpr size_t kMaxTitleRunIds = 4;

int usage_error(const std::string& what) {
  std::fprintf(stderr, "trun timeline: error: %s\n(see trun timeline --help)\n",
               printable(what).c_str());
  return 2;
}

// A command line that asks for something refused (exit 2), said in one line.
int refuse(const std::string& what) {
  std::fprintf(stderr, "trun timeline: error: %s\n", printable(what).c_str());
  return 2;
}

int input_error(const std::string& what) {
  std::fprintf(stderr, "trun timeline: error: %s\n", printable(what).c_str());
  return 1;
}

// "12.3 MiB (12897484 bytes)".
std::string size_text(uint64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB (%llu bytes)", static_cast<double>(bytes) / 1048576.0,
                static_cast<unsigned long long>(bytes));
  return buf;
}

// "a directory", "a FIFO (named pipe)", ...: what a file that is not a regular file is.
std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// SIZE: a positive number of bytes with an optional K, M or G (powers of 1024). False when it is
// not one or does not fit.
bool parse_size(const std::string& text, uint64_t* out) {
  size_t digits = text.find_first_not_of("0123456789");
  if (digits == std::string::npos) digits = text.size();
  if (digits > 15) return false;
  uint64_t v = 0;
  if (!base::parse_decimal(std::string_view(text).substr(0, digits), &v)) return false;
  const std::string suffix = text.substr(digits);
  int shift = 0;
  if (suffix == "K" || suffix == "k") {
    shift = 10;
  } else if (suffix == "M" || suffix == "m") {
    shift = 20;
  } else if (suffix == "G" || suffix == "g") {
    shift = 30;
  } else if (!suffix.empty()) {
    return false;
  }
  // 15 digits with a G do not fit in 64 bits: refused, not wrapped.
  if (v == 0 || v > (UINT64_MAX >> shift)) return false;
  *out = v << shift;
  return true;
}

struct Input {
  std::string path;
  struct stat st {};
};

// Opens a regular file without blocking and checks that it is the one stat() saw: a FIFO or a
// device put in its place meanwhile is refused, never read (a FIFO with no writer would block
// open() and read() forever, /dev/zero never ends). -1 and *error on failure.
int open_regular(const Input& in, std::string* error) {
  int fd = ::open(in.path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    *error = std::strerror(errno);
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *error = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  if (!S_ISREG(st.st_mode) || st.st_dev != in.st.st_dev || st.st_ino != in.st.st_ino) {
    *error = S_ISREG(st.st_mode) ? "replaced while being opened" : "is " + kind_of(st.st_mode);
    ::close(fd);
    return -1;
  }
  return fd;
}

// The page goes to a new temporary file next to the output (created exclusively, so no link
// planted there is followed), then renamed over it: a reader never sees half a page and an
// output that exists is replaced, never written through.
bool write_file(const std::string& path, const std::string& data, std::string* error) {
  std::string tmp = path + ".tmp.XXXXXX";
  int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) {
    *error = std::strerror(errno);
    return false;
  }
  const mode_t mask = ::umask(0);
  ::umask(mask);
  (void)::fchmod(fd, 0644 & ~mask);  // mkostemp creates 0600; a page is for sharing
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

struct Options {
  std::vector<Input> inputs;
  std::string output, title;
  uint64_t max_input = kDefaultMaxInputBytes;
};

// The command line into *o. Returns the exit code when the command ends here (--help, a
// command-line error), nullopt to go on.
std::optional<int> parse_args(int argc, char** argv, Options* o) {
  bool only_files = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (only_files) {
      o->inputs.push_back({a});
    } else if (a == "--") {
      only_files = true;
    } else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "-o" || a == "--output") {
      const char* v = value();
      if (v == nullptr) return usage_error(a + " needs a file name");
      o->output = v;
    } else if (a.rfind("--output=", 0) == 0) {
      o->output = a.substr(9);
    } else if (a == "--title") {
      const char* v = value();
      if (v == nullptr) return usage_error("--title needs a text");
      o->title = v;
    } else if (a.rfind("--title=", 0) == 0) {
      o->title = a.substr(8);
    } else if (a == "--max-input-size" || a.rfind("--max-input-size=", 0) == 0) {
      const char* v = a.size() > 16 ? a.c_str() + 17 : value();
      if (v == nullptr) return usage_error("--max-input-size needs a size");
      if (!parse_size(v, &o->max_input)) {
        return usage_error("--max-input-size=" + std::string(v) +
                           ": expected a positive number of bytes, with K, M or G");
      }
    } else if (a.size() > 1 && a[0] == '-') {
      return usage_error("unknown option " + a);
    } else {
      o->inputs.push_back({a});
    }
  }
  if (o->inputs.empty()) {
    return usage_error("no event log given (trun timeline EVENTLOG... -o FILE)");
  }
  if (o->output.empty()) return usage_error("no output file given (-o FILE)");
  return std::nullopt;
}

// The output: new, or a regular file that is none of the inputs (`-o run.jsonl` by mistake
// must not replace the log with HTML). A symbolic link, a device, a FIFO are refused: the
// rename would replace the link or the device node itself. Every input is looked at before any
// is read: only regular files, their sizes together within --max-input-size, none of them the
// output. Fills in the inputs' stat. Returns the exit code when one is refused.
std::optional<int> check_files(Options* o) {
  struct stat out_st {};
  const bool out_exists = ::lstat(o->output.c_str(), &out_st) == 0;
  if (out_exists && !S_ISREG(out_st.st_mode)) {
    return refuse("-o " + o->output + " is " + kind_of(out_st.st_mode) +
                  ": the page is written only to a new or a regular file");
  }
  uint64_t total = 0;
  for (Input& in : o->inputs) {
    if (::stat(in.path.c_str(), &in.st) != 0) {
      return input_error("cannot read the event log " + in.path + ": " + std::strerror(errno));
    }
    if (!S_ISREG(in.st.st_mode)) {
      return input_error("cannot read the event log " + in.path + ": is " + kind_of(in.st.st_mode) +
                         ", not a regular file");
    }
    if (out_exists && in.st.st_dev == out_st.st_dev && in.st.st_ino == out_st.st_ino) {
      return refuse("-o " + o->output + " is the event log " + in.path +
                    " (the same file): refusing to overwrite an input");
    }
    const uint64_t size = static_cast<uint64_t>(in.st.st_size);
    total += size;
    if (total > o->max_input) {
      return input_error(
          "the event log " + in.path + " is " + size_text(size) +
          (o->inputs.size() > 1 ? ", " + size_text(total) + " with the files before it" : "") +
          ": over --max-input-size " + size_text(o->max_input) + " (raise it to draw larger logs)");
    }
  }
  return std::nullopt;
}

// What has been read of all the inputs so far: the events, and the counts that an
// out-of-memory message reports.
struct Reading {
  std::vector<TimelineEvent> events;
  std::vector<std::string> run_ids;  // the first few, for the default title
  bool more_run_ids = false;
  uint64_t* bytes_read;
  size_t* events_read;
};

// The run ids of events[first...], added to those the default title names.
void note_run_ids(Reading* r, size_t first) {
  for (size_t i = first; i < r->events.size(); ++i) {
    auto it = r->events[i].metadata.find("run_id");
    if (it == r->events[i].metadata.end() || !it->is_string()) continue;
    const std::string& id = it->get_ref<const std::string&>();
    if (std::find(r->run_ids.begin(), r->run_ids.end(), id) != r->run_ids.end()) continue;
    if (r->run_ids.size() < kMaxTitleRunIds) {
      r->run_ids.push_back(id);
    } else {
      r->more_run_ids = true;
    }
  }
}

// Reads the input `f` into r->events, warning about the lines that are not events. Returns the
// exit code when it cannot be read or the input grows past --max-input-size.
std::optional<int> read_input(const Options& o, size_t f, std::vector<char>& buf, Reading* r) {
  const Input& in = o.inputs[f];
  std::string error;
  const int fd = open_regular(in, &error);
  if (fd < 0) return input_error("cannot read the event log " + in.path + ": " + error);
  int skipped = 0;
  const size_t first_event = r->events.size();
  EventLogParser parser(
      static_cast<uint32_t>(f), &r->events, [&](uint64_t line, const std::string& reason) {
        if (++skipped <= kMaxLineWarnings) {
          std::fprintf(stderr,
                       "trun timeline: warning: %s:%llu: not an event (%s); "
                       "skipped\n",
                       printable(in.path).c_str(), static_cast<unsigned long long>(line),
                       printable(reason).c_str());
        }
      });
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n > 0) {
      *r->bytes_read += static_cast<uint64_t>(n);
      if (*r->bytes_read > o.max_input) {  // it grows while read (a running agent's log)
        ::close(fd);
        return input_error("the event log " + in.path + " grew while read: over " +
                           "--max-input-size " + size_text(o.max_input) + " in all");
      }
      parser.feed(buf.data(), static_cast<size_t>(n));
      *r->events_read = r->events.size();
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      error = std::strerror(errno);
      ::close(fd);
      return input_error("cannot read the event log " + in.path + ": " + error);
    }
  }
  ::close(fd);
  parser.finish();
  *r->events_read = r->events.size();
  note_run_ids(r, first_event);
  if (skipped > kMaxLineWarnings) {
    std::fprintf(stderr, "trun timeline: warning: %s: %d more line(s) skipped\n",
                 printable(in.path).c_str(), skipped - kMaxLineWarnings);
  }
  if (parser.events_found() == 0 && o.inputs.size() > 1) {
    std::fprintf(stderr, "trun timeline: warning: %s holds no event\n", printable(in.path).c_str());
  }
  return std::nullopt;
}

// "trun timeline" and the first run ids.
std::string default_title(const Reading& r) {
  std::string title = "trun timeline";
  for (size_t i = 0; i < r.run_ids.size(); ++i) title += (i == 0 ? ": " : ", ") + r.run_ids[i];
  if (r.more_run_ids) title += ", ...";
  return title;
}

int run(int argc, char** argv, uint64_t* bytes_read, size_t* events_read) {
  Options o;
  if (auto code = parse_args(argc, argv, &o)) return *code;
  if (auto code = check_files(&o)) return *code;
  Reading r;
  r.bytes_read = bytes_read;
  r.events_read = events_read;
  std::vector<char> buf(1 << 16);
  for (size_t f = 0; f < o.inputs.size(); ++f) {
    if (auto code = read_input(o, f, buf, &r)) return *code;
  }
  if (r.events.empty()) {
    return input_error("no event in " +
                       (o.inputs.size() == 1 ? o.inputs[0].path : "any of the files given"));
  }
  const std::string title = o.title.empty() ? default_title(r) : o.title;
  std::string html;
  try {
    html = render_timeline_html(r.events, title, std::max(kMinMaxPageBytes, 2 * o.max_input));
  } catch (const TimelinePageTooLarge& e) {
    return input_error(std::string("cannot draw ") + std::to_string(r.events.size()) +
                       " events: " + e.what() + "; nothing written");
  }
  r.events.clear();
  r.events.shrink_to_fit();
  std::string error;
  if (!write_file(o.output, html, &error)) {
    return input_error("cannot write " + o.output + ": " + error);
  }
  return 0;
}

}  // namespace

int run_timeline_command(int argc, char** argv) {
  uint64_t bytes_read = 0;
  size_t events_read = 0;
  try {
    return run(argc, argv, &bytes_read, &events_read);
  } catch (const std::bad_alloc&) {
    // Under a memory limit (ulimit -v, a cgroup): one line, not an abort.
    std::fprintf(stderr,
                 "trun timeline: error: out of memory after reading %llu bytes (%zu events) of "
                 "event logs; nothing written (a smaller --max-input-size refuses such input "
                 "up front)\n",
                 static_cast<unsigned long long>(bytes_read), events_read);
    return 1;
  } catch (const std::length_error& e) {
    std::fprintf(stderr, "trun timeline: error: out of memory: %s; nothing written\n", e.what());
    return 1;
  }
}

}  // namespace trun::launcher
