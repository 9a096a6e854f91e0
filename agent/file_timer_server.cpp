#include "agent/file_timer_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>

#include "agent/failure_report.h"  // signal_name

namespace trun::agent {

namespace {

// The longest sleep between two looks at the timers: a change of the wall clock is seen at most
// this late.
constexpr int kMaxWaitMs = 1000;
// How much one pass reads before it looks at the timers again, so that a writer that floods the
// FIFO cannot delay an expiry.
constexpr size_t kReadBudget = 256 * 1024;

std::string errno_text(int err) { return std::strerror(err); }

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int pidfd_open(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

int pidfd_send_signal(int pidfd, int sig) {
#ifdef SYS_pidfd_send_signal
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
#else
  (void)pidfd;
  (void)sig;
  errno = ENOSYS;
  return -1;
#endif
}

// True when the process behind `pidfd` has exited, a zombie not yet reaped included (its pidfd
// polls readable then), where a signal would still be "sent".
bool pidfd_exited(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

// A worker's text in trun's log: printable ASCII only, at most 200 characters.
std::string printable(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (out.size() >= 200) {
      out += "...";
      break;
    }
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return out;
}

bool allowed_signal(int64_t sig) {
  return std::find(kAllowedSignals.begin(), kAllowedSignals.end(), sig) != kAllowedSignals.end();
}

}  // namespace

FileTimerSetting file_timer_setting(const std::map<std::string, std::string>& env) {
  FileTimerSetting s;
  auto enabled = env.find(kEnableFileTimerVar);
  s.enabled = enabled != env.end() && enabled->second == "1";
  auto path = env.find(kTimerFileVar);
  if (path != env.end()) s.path = path->second;
  return s;
}

std::string generated_timer_path() {
  unsigned char b[16];
  size_t got = 0;
  while (got < sizeof b) {
    const ssize_t n = ::getrandom(b + got, sizeof b - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw FileTimerError("cannot read random bytes: " + errno_text(errno));
    got += static_cast<size_t>(n);
  }
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);  // uuid version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);  // RFC 4122 variant
  char uuid[37];
  std::snprintf(uuid, sizeof uuid,
                "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                b[15]);
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = (tmp != nullptr && tmp[0] == '/') ? tmp : "/tmp";
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir + "/watchdog_timer_" + uuid;
}

const char* refusal_name(TimerRefusal kind) {
  switch (kind) {
    case TimerRefusal::kOversized:
      return "oversized";
    case TimerRefusal::kNotJson:
      return "not a JSON object";
    case TimerRefusal::kWrongType:
      return "a field missing or of the wrong type";
    case TimerRefusal::kUnknownVersion:
      return "unknown version";
    case TimerRefusal::kForeignPid:
      return "not a worker's pid";
    case TimerRefusal::kBadSignal:
      return "a signal that is not allowed";
    case TimerRefusal::kTooManyTimers:
      return "too many timers";
    case TimerRefusal::kCount:
      break;
  }
  return "?";
}

FileTimerServer::FileTimerServer(FileTimerOptions options) : options_(std::move(options)) {
  if (options_.path.empty()) throw FileTimerError("the timer file's path is empty");
  make_fifo();
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    const int err = errno;
    close_and_remove();
    throw FileTimerError("eventfd: " + errno_text(err));
  }
  thread_ = std::thread([this] { run(); });
}

FileTimerServer::~FileTimerServer() {
  stop_.store(true);
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
    thread_.join();
  }
  close_and_remove();
  for (auto& [pid, fd] : workers_) {
    if (fd >= 0) ::close(fd);
  }
  workers_.clear();
}

// Closes the descriptors and removes the path while it still names the FIFO this server made.
void FileTimerServer::close_and_remove() {
  if (made_) {
    made_ = false;
    // Remove the path only while it still names our FIFO.
    struct stat st;
    if (::lstat(options_.path.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) {
      ::unlink(options_.path.c_str());
    }
  }
  for (int fd : {read_fd_, write_fd_, wake_fd_}) {
    if (fd >= 0) ::close(fd);
  }
  read_fd_ = write_fd_ = wake_fd_ = -1;
}

void FileTimerServer::make_fifo() {
  const char* path = options_.path.c_str();
  const std::string where = "the timer file " + options_.path;
  struct stat st;
  if (::lstat(path, &st) == 0) {
    if (S_ISLNK(st.st_mode)) throw FileTimerError(where + " is a symbolic link (not followed)");
    if (!S_ISFIFO(st.st_mode)) throw FileTimerError(where + " exists and is not a FIFO");
    if (st.st_uid != ::geteuid()) throw FileTimerError(where + " is another user's FIFO");
    // Opening for writing succeeds only while someone reads it: a live server.
    const int probe = ::open(path, O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (probe >= 0) {
      ::close(probe);
      throw FileTimerError(where + " is in use (another process reads it)");
    }
    // A FIFO left by an earlier run: replaced, as torchrun does.
    if (::unlink(path) != 0 && errno != ENOENT) {
      throw FileTimerError("cannot remove the old " + where + ": " + errno_text(errno));
    }
  } else if (errno != ENOENT) {
    throw FileTimerError("cannot use " + where + ": " + errno_text(errno));
  }
  if (::mkfifo(path, 0600) != 0) {
    throw FileTimerError("cannot create " + where + ": " + errno_text(errno));
  }
  struct stat made;
  if (::lstat(path, &made) != 0 || !S_ISFIFO(made.st_mode)) {
    throw FileTimerError(where + " was replaced while it was being made");
  }
  made_ = true;
  dev_ = made.st_dev;
  ino_ = made.st_ino;
  // Non-blocking: without a writer, open(O_RDONLY) would wait for one. A second writer of our
  // own keeps poll() from seeing a hang-up whenever the last client closes.
  read_fd_ = ::open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (read_fd_ >= 0) write_fd_ = ::open(path, O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  const int err = errno;
  struct stat r, w;
  if (read_fd_ < 0 || write_fd_ < 0 || ::fstat(read_fd_, &r) != 0 || ::fstat(write_fd_, &w) != 0 ||
      r.st_dev != dev_ || r.st_ino != ino_ || w.st_dev != dev_ || w.st_ino != ino_) {
    close_and_remove();
    throw FileTimerError("cannot open " + where + ": " +
                         (read_fd_ < 0 || write_fd_ < 0 ? errno_text(err) : "it was replaced"));
  }
  ::fchmod(read_fd_, 0600);  // the umask may have taken the owner's write bit
}

void FileTimerServer::clear_workers() {
  std::lock_guard<std::mutex> pass(read_mu_);  // no read pass is under way when this returns
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [pid, fd] : workers_) {
    if (fd >= 0) ::close(fd);
  }
  workers_.clear();
  timers_.clear();
  follow_ups_.clear();
  reading_ = false;
  ++generation_;
}

void FileTimerServer::set_workers(const std::vector<pid_t>& pids) {
  std::map<pid_t, int> fresh;
  for (pid_t pid : pids) {
    if (pid > 0 && !fresh.count(pid)) fresh[pid] = pidfd_open(pid);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [pid, fd] : workers_) {
      if (fd >= 0) ::close(fd);
    }
    workers_ = std::move(fresh);
    timers_.clear();
    follow_ups_.clear();
    reading_ = true;
    ++generation_;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
}

void FileTimerServer::replace_worker(pid_t old_pid, pid_t fresh) {
  const int fd = fresh > 0 ? pidfd_open(fresh) : -1;
  std::lock_guard<std::mutex> lock(mu_);
  for (pid_t pid : {old_pid, fresh}) {
    auto it = workers_.find(pid);
    if (it == workers_.end()) continue;
    if (it->second >= 0) ::close(it->second);
    workers_.erase(it);
  }
  for (auto it = timers_.begin(); it != timers_.end();) {
    it = it->first.first == old_pid ? timers_.erase(it) : std::next(it);
  }
  follow_ups_.erase(old_pid);
  if (fresh > 0) workers_[fresh] = fd;
}

uint64_t FileTimerServer::refused(TimerRefusal kind) const {
  return refused_[static_cast<size_t>(kind)].load();
}

size_t FileTimerServer::active_timers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timers_.size();
}

void FileTimerServer::report(bool warning, const std::string& line) const {
  const auto& sink = warning ? options_.warn : options_.info;
  if (sink) {
    sink(line);
  } else if (warning) {
    spdlog::warn("{}", line);
  } else {
    spdlog::info("{}", line);
  }
}

void FileTimerServer::refuse(TimerRefusal kind, const std::string& detail) {
  if (refused_[static_cast<size_t>(kind)].fetch_add(1) == 0) {
    report(true, "watchdog timer file " + options_.path + ": ignored a request (" +
                     refusal_name(kind) + "): " + detail +
                     " (further requests refused for this reason are not reported)");
  }
}

void FileTimerServer::run() {
  std::string line;
  bool overflow = false;  // dropping a record that is too long, up to its newline
  uint64_t seen_generation = 0;
  while (!stop_.load()) {
    bool reading;
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading = reading_;
      generation = generation_;
    }
    if (generation != seen_generation) {  // a new group: no half record of the old one survives
      line.clear();
      overflow = false;
      seen_generation = generation;
    }
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {read_fd_, POLLIN, 0}};
    const int n = ::poll(fds, reading ? 2 : 1, wait_ms());
    if (n < 0 && errno != EINTR) {
      report(true, "watchdog timer file " + options_.path + ": poll: " + errno_text(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // bounded retry
    }
    if (n > 0 && (fds[0].revents & POLLIN) != 0) {
      uint64_t count;
      (void)!::read(wake_fd_, &count, sizeof count);
    }
    if (n > 0 && reading && (fds[1].revents & (POLLIN | POLLERR | POLLHUP)) != 0) {
      // clear_workers() may have come since: it waits for a pass in progress, and a pass that
      // starts after it reads nothing.
      std::lock_guard<std::mutex> pass(read_mu_);
      bool still_reading;
      {
        std::lock_guard<std::mutex> lock(mu_);
        still_reading = reading_ && generation_ == seen_generation;
      }
      if (still_reading) read_available(&line, &overflow);
    }
    fire_expired();
  }
}

// Reads what the FIFO holds now (up to kReadBudget) and handles each complete line. A line over
// max_record_bytes is dropped, and everything after it up to the next newline.
void FileTimerServer::read_available(std::string* line, bool* overflow) {
  char buf[16384];
  size_t budget = kReadBudget;
  while (budget > 0 && !stop_.load()) {
    const ssize_t n = ::read(read_fd_, buf, std::min(sizeof buf, budget));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {
      if (n < 0)
        report(true, "watchdog timer file " + options_.path + ": read: " + errno_text(errno));
      return;  // 0 cannot happen while write_fd_ is open
    }
    budget -= static_cast<size_t>(n);
    const char* p = buf;
    const char* end = buf + n;
    while (p < end) {
      const char* nl = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
      const char* stop = nl ? nl : end;
      const size_t len = static_cast<size_t>(stop - p);
      if (!*overflow && line->size() + len > options_.max_record_bytes) {
        *overflow = true;
        line->clear();
        line->shrink_to_fit();
      }
      if (!*overflow) line->append(p, len);
      if (nl == nullptr) break;
      if (*overflow) {
        refuse(TimerRefusal::kOversized,
               "a record longer than " + std::to_string(options_.max_record_bytes) + " bytes");
        *overflow = false;
      } else {
        handle_line(*line);
      }
      line->clear();
      p = nl + 1;
    }
  }
}

void FileTimerServer::handle_line(const std::string& text) {
  using nlohmann::json;
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    refuse(TimerRefusal::kNotJson, "'" + printable(text) + "'");
    return;
  }
  auto field = [&](const char* name) -> const json* {
    auto it = j.find(name);
    return it == j.end() ? nullptr : &*it;
  };
  const json* version = field("version");
  const json* pid = field("pid");
  const json* scope = field("scope_id");
  const json* expires = field("expiration_time");
  const json* sig = field("signal");
  if (!version || !version->is_number_integer() || !pid || !pid->is_number_integer() || !scope ||
      !scope->is_string() || !expires || !expires->is_number() || !sig ||
      !sig->is_number_integer()) {
    refuse(TimerRefusal::kWrongType, "'" + printable(text) + "'");
    return;
  }
  if (version->get<int64_t>() != 1) {
    refuse(TimerRefusal::kUnknownVersion, "version " + printable(version->dump()));
    return;
  }
  // An unsigned above int64's range reads as a negative int64: out of range either way.
  const int64_t pid_value = pid->get<int64_t>();
  if (pid_value <= 0 || pid_value > std::numeric_limits<pid_t>::max()) {
    refuse(TimerRefusal::kWrongType, "pid " + printable(pid->dump()));
    return;
  }
  const std::string& scope_text = scope->get_ref<const std::string&>();
  if (scope_text.size() > kMaxScopeBytes) {
    refuse(TimerRefusal::kOversized, "a scope_id of " + std::to_string(scope_text.size()) +
                                         " bytes (at most " + std::to_string(kMaxScopeBytes) + ")");
    return;
  }
  // An unsigned above int64's range would read as a negative int64 (a valid "no signal").
  const bool sig_unsigned_huge =
      sig->is_number_unsigned() && sig->get<uint64_t>() > static_cast<uint64_t>(INT32_MAX);
  const int64_t sig_value = sig->get<int64_t>();
  if (sig_unsigned_huge || (sig_value > 0 && !allowed_signal(sig_value))) {
    refuse(TimerRefusal::kBadSignal, "signal " + printable(sig->dump()));
    return;
  }
  Request r;
  r.pid = static_cast<pid_t>(pid_value);
  r.scope = scope_text;
  r.expires = expires->get<double>();
  r.signal = sig_value > 0 ? static_cast<int>(sig_value) : 0;
  apply(std::move(r));
}

void FileTimerServer::apply(Request r) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!workers_.count(r.pid)) {
    lock.unlock();
    refuse(TimerRefusal::kForeignPid, "pid " + std::to_string(r.pid));
    return;
  }
  auto key = std::make_pair(r.pid, std::move(r.scope));
  if (r.expires < 0) {  // a release (torchrun's FileTimerClient sends -1)
    timers_.erase(key);
    accepted_.fetch_add(1);
    return;
  }
  auto it = timers_.find(key);
  if (it == timers_.end()) {
    size_t mine = 0;
    for (auto t = timers_.lower_bound({r.pid, std::string()});
         t != timers_.end() && t->first.first == r.pid; ++t) {
      ++mine;
    }
    if (mine >= options_.max_timers_per_worker) {
      lock.unlock();
      refuse(TimerRefusal::kTooManyTimers,
             "pid " + std::to_string(r.pid) + " has " + std::to_string(mine) + " timers");
      return;
    }
    it = timers_.emplace(std::move(key), Timer{}).first;
  }
  it->second = Timer{r.expires, r.signal};
  accepted_.fetch_add(1);
}

// Milliseconds until the earliest expiration time, rounded up; at most kMaxWaitMs.
int FileTimerServer::wait_ms() {
  double earliest = std::numeric_limits<double>::infinity();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, t] : timers_) earliest = std::min(earliest, t.expires);
    for (const auto& [pid, f] : follow_ups_) earliest = std::min(earliest, f.at);
  }
  const double left_ms = (earliest - unix_now()) * 1000.0;
  if (!(left_ms < kMaxWaitMs)) return kMaxWaitMs;
  return left_ms <= 0 ? 0 : static_cast<int>(std::ceil(left_ms));
}

void FileTimerServer::fire_expired() {
  std::vector<std::pair<bool, std::string>> lines;  // reported after the lock
  // A dump signal is sent after its line is written: the worker writes its stacks to the console
  // that trun writes to, and a line of trun's arriving while they come would split them.
  struct Dump {
    pid_t pid;
    int sig;
    std::string what;
  };
  std::vector<Dump> dumps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (timers_.empty() && follow_ups_.empty()) return;
    const double now = unix_now();
    fire_follow_ups(now, &lines);
    // pid -> its expired timers: the earliest one with a signal gives the signal.
    std::map<pid_t, std::pair<const std::string*, Timer>> chosen;
    std::map<pid_t, const std::string*> any;
    for (const auto& [key, t] : timers_) {
      if (t.expires > now) continue;
      any.emplace(key.first, &key.second);
      if (t.signal <= 0) continue;
      auto c = chosen.find(key.first);
      if (c == chosen.end() || t.expires < c->second.second.expires) {
        chosen[key.first] = {&key.second, t};
      }
    }
    for (const auto& [pid, scope] : any) {
      auto c = chosen.find(pid);
      if (c == chosen.end()) {
        lines.emplace_back(false, "watchdog timer '" + printable(*scope) + "' of worker pid " +
                                      std::to_string(pid) + " expired; it names no signal");
      } else {
        const Timer& t = c->second.second;
        const bool dump = options_.dump_signal > 0 && t.signal == SIGKILL;
        const int sig = dump ? options_.dump_signal : t.signal;
        char late[32];
        std::snprintf(late, sizeof late, "%.3f", now - t.expires);
        const std::string who = "watchdog timer '" + printable(*c->second.first) +
                                "' of worker pid " + std::to_string(pid);
        const std::string what = who + " expired " + late + " s ago";
        const int err = dump && workers_.count(pid) ? 0 : send(pid, sig);
        if (err == 0 && dump) {
          char wait[32];
          std::snprintf(wait, sizeof wait, "%.1f", options_.dump_wait.count() / 1000.0);
          lines.emplace_back(true, what + ": sending " + signal_name(sig) +
                                       " (its Python stacks follow on its stderr), and SIGKILL " +
                                       "in " + wait + " s unless it has exited");
          follow_ups_[pid] = FollowUp{now + options_.dump_wait.count() / 1000.0, who};
          dumps.push_back({pid, sig, what});
        } else if (err == 0) {
          signals_sent_.fetch_add(1);
          // A warning: the failure summary will show the signal, this line says why.
          lines.emplace_back(true, what + ": sent " + signal_name(t.signal));
        } else if (err == ESRCH) {
          lines.emplace_back(false, what + ": the worker has already exited");
        } else {
          lines.emplace_back(true,
                             what + ": cannot send " + signal_name(sig) + ": " + errno_text(err));
        }
      }
      for (auto t = timers_.lower_bound({pid, std::string()});
           t != timers_.end() && t->first.first == pid;) {
        t = timers_.erase(t);
      }
    }
  }
  for (const auto& [warning, text] : lines) report(warning, text);
  if (dumps.empty()) return;
  lines.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Dump& d : dumps) {
      const int err = send(d.pid, d.sig);
      if (err == 0) {
        signals_sent_.fetch_add(1);
        continue;
      }
      follow_ups_.erase(d.pid);
      if (err == ESRCH)
        lines.emplace_back(false, d.what + ": the worker has already exited");
      else
        lines.emplace_back(true,
                           d.what + ": cannot send " + signal_name(d.sig) + ": " + errno_text(err));
    }
  }
  for (const auto& [warning, text] : lines) report(warning, text);
}

int FileTimerServer::send(pid_t pid, int sig) {
  auto w = workers_.find(pid);
  if (w == workers_.end()) return ESRCH;
  // A worker that has exited and is not reaped yet would still take a signal: it is gone too.
  if (w->second >= 0 && pidfd_exited(w->second)) return ESRCH;
  const int rc = w->second >= 0 ? pidfd_send_signal(w->second, sig) : ::kill(pid, sig);
  return rc == 0 ? 0 : errno;
}

void FileTimerServer::fire_follow_ups(double now,
                                      std::vector<std::pair<bool, std::string>>* lines) {
  for (auto f = follow_ups_.begin(); f != follow_ups_.end();) {
    if (f->second.at > now) {
      ++f;
      continue;
    }
    // A worker that died of the dump signal is gone, or a zombie (ESRCH either way): nothing to
    // say, and no signal counted.
    const int err = send(f->first, SIGKILL);
    if (err == 0) {
      signals_sent_.fetch_add(1);
      lines->emplace_back(true,
                          f->second.what + ": sent SIGKILL (after its stacks were asked for)");
    } else if (err != ESRCH) {
      lines->emplace_back(true, f->second.what + ": cannot send SIGKILL: " + errno_text(err));
    }
    f = follow_ups_.erase(f);
  }
}

}  // namespace trun::agent
