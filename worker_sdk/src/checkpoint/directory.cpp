#include "worker_sdk/src/checkpoint/directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "base/decimal.h"
#include "trun/checkpoint.h"
#include "worker_sdk/src/checkpoint/format.h"

namespace trun::worker::detail {

using json = nlohmann::json;

namespace {

struct Owner {
  std::string job, host;
  long pid = 0;
  int64_t since_ms = 0;
};

Owner read_owner(int fd) {
  Owner o;
  char buf[4096];
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return o;
  try {
    json j = json::parse(std::string(buf, static_cast<size_t>(n)));
    o.job = j.value("job", "");
    o.host = j.value("host", "");
    o.pid = j.value("pid", 0L);
    o.since_ms = j.value("since_unix_ms", int64_t{0});
  } catch (const json::exception&) {
    // Written by hand or half-written: described as unknown.
  }
  return o;
}

std::string describe(const Owner& o) {
  if (o.job.empty() && o.pid == 0) return "an unknown process (no owner recorded)";
  std::string s = "job '" + o.job + "' (host " + o.host + ", pid " + std::to_string(o.pid);
  if (o.since_ms > 0) {
    const std::time_t t = static_cast<std::time_t>(o.since_ms / 1000);
    char when[32] = {};
    std::tm tm{};
    if (::gmtime_r(&t, &tm)) std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    s += std::string(", since ") + when;
  }
  return s + ")";
}

// Process-wide registry, so that Checkpointers of one process share a directory's lock (flock is
// per open file: a second open in the same process would conflict with the first).
std::mutex g_mu;
std::map<std::pair<dev_t, ino_t>, std::weak_ptr<DirLock>> g_locks;

bool process_alive(long pid) {
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

}  // namespace

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "?";
  return buf;
}

std::string temp_suffix() { return "-" + std::to_string(::getpid()) + "@" + host_name(); }

std::shared_ptr<DirLock> DirLock::acquire(const std::string& dir, const std::string& job_id,
                                          std::chrono::milliseconds wait) {
  ckpt::Fd dfd;
  try {
    dfd.fd = ckpt::open_directory(dir);
  } catch (const CheckpointError& e) {
    throw CheckpointError("checkpoint: cannot use " + dir + ": " + std::strerror(e.error_number()),
                          e.error_number());
  }
  struct stat st {};
  if (::fstat(dfd.fd, &st) != 0)
    throw CheckpointError("checkpoint: cannot use " + dir + ": " + std::strerror(errno), errno);
  std::lock_guard<std::mutex> guard(g_mu);
  const auto key = std::make_pair(st.st_dev, st.st_ino);
  if (auto held = g_locks[key].lock()) return held;

  const std::string path = dir + "/.lock";
  int fd = -1;
  try {
    fd = ckpt::open_regular_at(dfd.fd, ".lock", path, O_RDWR | O_CREAT);
  } catch (const CheckpointError& e) {
    const int err = e.error_number();
    if (err == EACCES || err == EROFS || err == EPERM)
      throw CheckpointError("checkpoint: " + dir + " is not writable (" + std::strerror(err) +
                                "): the writer (rank 0) needs to create files there",
                            err);
    throw;  // a symbolic link or another non-regular file: named by the message
  }
  std::shared_ptr<DirLock> lock(new DirLock(fd));  // closes fd on every path out
  // A second hard link would let the truncation below overwrite another file.
  struct stat lst {};
  if (::fstat(fd, &lst) != 0)
    throw CheckpointError("checkpoint: cannot stat " + path + ": " + std::strerror(errno), errno);
  if (lst.st_nlink > 1)
    throw CheckpointError("checkpoint: " + path + " has " + std::to_string(lst.st_nlink) +
                          " hard links, so it is also another file; trun does not write into "
                          "it. Remove it (the lock file is a regular file of its own)");
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (int attempt = 0;; ++attempt) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK)
      throw CheckpointError("checkpoint: cannot lock " + path + ": " + std::strerror(err), err);
    const Owner o = read_owner(fd);
    if (o.job != job_id)
      throw CheckpointOwnerError("checkpoint: " + dir + " belongs to another job: " + describe(o) +
                                 " holds its lock, and this is job '" + job_id +
                                 "'. A checkpoint directory belongs to one job at a time: use "
                                 "another directory, or stop that job first");
    if (std::chrono::steady_clock::now() >= deadline)
      throw CheckpointOwnerError("checkpoint: " + dir + " is still locked by " + describe(o) +
                                 " of this job after " + std::to_string(wait.count() / 1000) +
                                 " s; is an earlier incarnation of rank 0 still running?");
    if (attempt == 0)
      std::fprintf(stderr,
                   "[trun.checkpoint] %s is locked by %s of this job; waiting up to %lld s for "
                   "it to exit\n",
                   dir.c_str(), describe(o).c_str(), static_cast<long long>(wait.count() / 1000));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // Ours: record who we are, and check that DIR takes new entries (a read-only mount fails the
  // open above only when .lock does not exist yet).
  const std::string text = json{{"job", job_id},
                                {"host", host_name()},
                                {"pid", static_cast<long>(::getpid())},
                                {"since_unix_ms", ckpt::unix_ms()}}
                               .dump(-1, ' ', false, json::error_handler_t::replace) +
                           "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) < 0) {
    const int err = errno;
    if (err != ENOSPC)  // a full disk is not fatal here: retention may make room
      throw CheckpointError("checkpoint: " + dir + " is not writable (" + std::strerror(err) + ")",
                            err);
  }
  const std::string probe = ".probe" + temp_suffix();
  if (::mkdirat(dfd.fd, probe.c_str(), 0755) != 0 && errno != EEXIST && errno != ENOSPC) {
    const int err = errno;
    throw CheckpointError("checkpoint: " + dir + " is not writable (" + std::strerror(err) +
                              "): the writer (rank 0) needs to create files there",
                          err);
  }
  ckpt::remove_tree_at(dfd.fd, probe);
  g_locks[key] = lock;
  return lock;
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

void remove_stale_temporaries(int dirfd, const std::string& dir, bool include_own) {
  const std::string me_host = host_name();
  const long me_pid = static_cast<long>(::getpid());
  std::vector<std::string> names;
  {
    const int d2 = ::openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR* d = d2 >= 0 ? ::fdopendir(d2) : nullptr;
    if (!d) {
      if (d2 >= 0) ::close(d2);
      return;
    }
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind(".tmp-", 0) == 0 || name.rfind(".latest.tmp-", 0) == 0 ||
          name.rfind(".resume.tmp-", 0) == 0 || name.rfind(".probe-", 0) == 0)
        names.push_back(name);
    }
    ::closedir(d);
  }
  for (const auto& name : names) {
    // "<...>-<pid>@<host>"; names of trun before the host was added end in "-<pid>".
    std::string host = me_host;
    std::string rest = name;
    if (const size_t at = name.rfind('@'); at != std::string::npos) {
      host = name.substr(at + 1);
      rest = name.substr(0, at);
    }
    long pid = 0;  // not a number after the dash: no writer to wait for
    if (const size_t dash = rest.rfind('-'); dash != std::string::npos)
      base::parse_decimal(std::string_view(rest).substr(dash + 1), &pid);
    bool gone = host != me_host || (pid != me_pid && !process_alive(pid));
    if (host == me_host && pid == me_pid) gone = include_own;
    if (!gone) {
      if (pid != me_pid)
        std::fprintf(stderr,
                     "[trun.checkpoint] keeping %s/%s: its writer (pid %ld on this host) is "
                     "still alive\n",
                     dir.c_str(), name.c_str(), pid);
      continue;
    }
    ckpt::remove_tree_at(dirfd, name);
  }
}

std::string quarantine(int dirfd, const std::string& dir, const std::string& name,
                       const std::string& reason, const std::string& suffix) {
  const std::string to = name + "." + suffix + "-" + std::to_string(ckpt::unix_ms());
  if (::renameat(dirfd, name.c_str(), dirfd, to.c_str()) != 0) {
    std::fprintf(stderr, "[trun.checkpoint] cannot quarantine %s/%s: %s\n", dir.c_str(),
                 name.c_str(), std::strerror(errno));
    return "";
  }
  // REASON: a new regular file in the quarantined directory itself (a step that is a symbolic
  // link gets none), after removing whatever had that name.
  std::string note;
  ckpt::Fd q(::openat(dirfd, to.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (q.fd < 0) {
    note = std::string(" (no REASON file: ") + std::strerror(errno) + ")";
  } else {
    try {
      ::unlinkat(q.fd, "REASON", 0);
      const std::string shown = dir + "/" + to + "/REASON";
      ckpt::Fd f(ckpt::create_exclusive_at(q.fd, "REASON", shown, false));
      const std::string text = reason + "\n";
      ckpt::write_all(f.fd, text.data(), text.size(), 0, shown);
    } catch (const CheckpointError& e) {
      note = std::string(" (no REASON file: ") + e.what() + ")";
    }
  }
  std::fprintf(stderr,
               "[trun.checkpoint] %s %s/%s as %s (kept, never removed by retention): %s%s\n",
               suffix == "damaged" ? "quarantined" : "set aside", dir.c_str(), name.c_str(),
               to.c_str(), reason.c_str(), note.c_str());
  return to;
}

}  // namespace trun::worker::detail
