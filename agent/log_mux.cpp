#include "agent/log_mux.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <system_error>
#include <thread>

#include "agent/console.h"
#include "base/write_all.h"

namespace trun::agent {
namespace {

constexpr size_t kReadChunk = 64 * 1024;
// A "line" this long without a newline is written out anyway, so memory stays bounded.
constexpr size_t kMaxPendingLine = 1 << 20;
// Room a batch of on_readable() needs in the console buffer: 4 reads and their prefixes, or one
// overlong line. A rare larger batch has its tail dropped.
constexpr size_t kBatchRoom = 2 << 20;
constexpr long kPausePollNs = 10 * 1000 * 1000;

int open_log_file(const std::string& path) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "open " + path);
  return fd;
}

}  // namespace

struct LogMux::Tee {
  int read_fd = -1;
  bool paused = false;  // read_fd is not watched: the console is full and still moving
  int file_fd = -1;
  int console_fd = 1;
  std::string prefix;
  int owner = -1;
  std::string pending;  // bytes after the last newline
  std::string out;      // scratch for the prefixed batch
  std::string dup_out;  // scratch for the batch's lines that match a duplicate filter
};

std::string line_prefix(const std::string& tmpl_in, const std::string& role, int rank,
                        int local_rank) {
  std::string tmpl = tmpl_in.empty() ? "${role_name}${local_rank}" : tmpl_in;
  std::string out;
  for (size_t i = 0; i < tmpl.size();) {
    auto sub = [&](const char* name, const std::string& value) {
      std::string key = std::string("${") + name + "}";
      if (tmpl.compare(i, key.size(), key) != 0) return false;
      out += value;
      i += key.size();
      return true;
    };
    if (sub("role_name", role) || sub("rank", std::to_string(rank)) ||
        sub("local_rank", std::to_string(local_rank))) {
      continue;
    }
    out.push_back(tmpl[i++]);
  }
  return "[" + out + "]:";
}

LogMux::LogMux(EventLoop& loop) : loop_(loop) {}

LogMux::~LogMux() {
  for (auto& t : tees_) {
    if (t->read_fd >= 0) {
      loop_.remove(t->read_fd);
      close(t->read_fd);
    }
    if (t->file_fd >= 0) close(t->file_fd);
  }
  for (auto& d : dup_) {
    if (d.fd >= 0) close(d.fd);
  }
  if (timer_fd_ >= 0) {
    loop_.remove(timer_fd_);
    close(timer_fd_);
  }
  close_child_ends();
}

void LogMux::duplicate(int console_fd, const std::string& file_path,
                       std::vector<std::string> filters) {
  Duplicate& d = dup_for(console_fd);
  if (d.fd >= 0) close(d.fd);
  d.fd = open_log_file(file_path);
  d.filters = std::move(filters);
}

void LogMux::collect_duplicate(Tee& t, std::string_view prefixed_line) {
  const Duplicate& d = dup_for(t.console_fd);
  if (d.fd < 0) return;
  for (const auto& f : d.filters) {
    if (prefixed_line.find(f, t.prefix.size()) != std::string_view::npos) {
      t.dup_out += prefixed_line;
      return;
    }
  }
}

void LogMux::set_prefix(int owner, const std::string& prefix) {
  for (auto& t : tees_) {
    if (t->owner == owner) t->prefix = prefix;
  }
}

int LogMux::prepare(StreamMode mode, int console_fd, const std::string& file_path,
                    const std::string& prefix, int owner) {
  switch (mode) {
    case StreamMode::kInherit:
      return -1;
    case StreamMode::kDiscard: {
      int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
      if (fd < 0) throw std::system_error(errno, std::generic_category(), "open /dev/null");
      child_fds_.push_back(fd);
      return fd;
    }
    case StreamMode::kFile: {
      int fd = open_log_file(file_path);
      child_fds_.push_back(fd);
      return fd;
    }
    case StreamMode::kTee:
      break;
  }
  auto t = std::make_unique<Tee>();
  t->file_fd = open_log_file(file_path);
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    close(t->file_fd);
    throw std::system_error(errno, std::generic_category(), "pipe2");
  }
  fcntl(p[0], F_SETPIPE_SZ, 1 << 20);  // fewer wake-ups for chatty workers; best effort
  fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
  t->read_fd = p[0];
  t->console_fd = console_fd;
  t->prefix = prefix;
  t->owner = owner;
  child_fds_.push_back(p[1]);
  Tee* raw = t.get();
  tees_.push_back(std::move(t));
  watch(*raw);
  return p[1];
}

void LogMux::watch(Tee& t) {
  Tee* raw = &t;
  loop_.add(t.read_fd, EPOLLIN, [this, raw](uint32_t) { on_readable(*raw); });
}

bool LogMux::console_accepts(const Tee& t) const {
  const ConsoleWriter& c = console(t.console_fd);
  return c.has_room(kBatchRoom) || c.stalled(kConsoleStallAfter);
}

void LogMux::pause(Tee& t) {
  if (timer_fd_ < 0) {
    timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (timer_fd_ < 0) return;  // cannot wait: keep reading, and drop what does not fit
    loop_.add(timer_fd_, EPOLLIN, [this](uint32_t) { on_timer(); });
  }
  loop_.remove(t.read_fd);
  t.paused = true;
  if (paused_++ == 0) {
    itimerspec every{};
    every.it_interval.tv_nsec = kPausePollNs;
    every.it_value.tv_nsec = kPausePollNs;
    timerfd_settime(timer_fd_, 0, &every, nullptr);
  }
}

void LogMux::on_timer() {
  uint64_t expirations;
  while (read(timer_fd_, &expirations, sizeof expirations) > 0) {
  }
  for (auto& t : tees_) {
    if (!t->paused || t->read_fd < 0 || !console_accepts(*t)) continue;
    t->paused = false;
    --paused_;
    watch(*t);
  }
  if (paused_ == 0) {
    itimerspec off{};
    timerfd_settime(timer_fd_, 0, &off, nullptr);
  }
}

void LogMux::close_child_ends() {
  for (int fd : child_fds_) close(fd);
  child_fds_.clear();
}

void LogMux::on_readable(Tee& t) {
  if (!console_accepts(t)) {
    pause(t);
    if (t.paused) return;  // else no timer: read, and drop what does not fit
  }
  read_some(t, 4);
}

void LogMux::write_duplicates(Tee& t) {
  const Duplicate& d = dup_for(t.console_fd);
  // Log files are regular files: a write never blocks. A failed one (a full disk) loses that piece
  // of the log and nothing else: there is nobody to tell.
  if (d.fd >= 0 && !t.dup_out.empty()) {
    (void)base::write_all(d.fd, t.dup_out.data(), t.dup_out.size());
  }
}

bool LogMux::read_some(Tee& t, int max_reads) {
  char buf[kReadChunk];
  for (int i = 0; i < max_reads && t.read_fd >= 0; ++i) {
    ssize_t n = read(t.read_fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return false;
    if (n <= 0) {  // EOF or error: the writers are gone
      finish(t);
      return false;
    }
    (void)base::write_all(t.file_fd, buf, static_cast<size_t>(n));
    t.pending.append(buf, static_cast<size_t>(n));
    size_t last_nl = t.pending.rfind('\n');
    if (last_nl == std::string::npos && t.pending.size() < kMaxPendingLine) continue;
    size_t end = last_nl == std::string::npos ? t.pending.size() : last_nl + 1;
    t.out.clear();
    t.dup_out.clear();
    size_t start = 0;
    while (start < end) {
      size_t nl = t.pending.find('\n', start);
      size_t stop = (nl == std::string::npos || nl >= end) ? end : nl + 1;
      const size_t line_start = t.out.size();
      t.out += t.prefix;
      t.out.append(t.pending, start, stop - start);
      if (t.out.back() != '\n') t.out.push_back('\n');
      collect_duplicate(t, std::string_view(t.out).substr(line_start));
      start = stop;
    }
    console(t.console_fd).write(t.out);
    write_duplicates(t);
    t.pending.erase(0, end);
  }
  return t.read_fd >= 0;
}

void LogMux::finish(Tee& t) {
  if (!t.pending.empty()) {
    t.out = t.prefix + t.pending + "\n";
    console(t.console_fd).write(t.out);
    t.dup_out.clear();
    collect_duplicate(t, t.out);
    write_duplicates(t);
    t.pending.clear();
  }
  if (t.read_fd >= 0) {
    loop_.remove(t.read_fd);
    close(t.read_fd);
    t.read_fd = -1;
  }
  if (t.paused) {
    t.paused = false;
    --paused_;
  }
  if (t.file_fd >= 0) {
    close(t.file_fd);
    t.file_fd = -1;
  }
}

void LogMux::drain() {
  // The rule of on_readable() holds here too: a console that is slow but moving gets every line
  // (wait for room), one that takes nothing for kConsoleStallAfter gets the rest dropped. The whole
  // drain waits at most kDrainBound, so a console that trickles cannot hold trun's exit for long.
  const auto deadline = std::chrono::steady_clock::now() + kDrainBound;
  for (auto& t : tees_) {
    // Writers are gone: read until EOF (bounded by what the pipe can hold).
    for (int i = 0; i < 1024; ++i) {
      while (!console_accepts(*t) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (!read_some(*t, 1)) break;
    }
    finish(*t);
  }
}

}  // namespace trun::agent
