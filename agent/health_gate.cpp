#include "agent/health_gate.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

extern char** environ;

namespace trun::agent {
namespace {

using SteadyClock = std::chrono::steady_clock;

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

// "" when `dir` has `needed` bytes free for an unprivileged writer, else why not.
std::string check_shm(const std::string& dir, uint64_t needed) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return dir + ": " + std::string(std::strerror(errno));
  const uint64_t free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  if (free_bytes >= needed) return "";
  return dir + " has " + mib(free_bytes) + " free, " + mib(needed) +
         " needed for this node's segments (full: remove what fills it, or give the container a "
         "larger --shm-size)";
}

// "" when a new file can be made (and removed) in `dir`, else why not.
std::string check_writable(const std::string& dir) {
  std::string path = dir + "/.trun-health-XXXXXX";
  const int fd = ::mkstemp(path.data());
  if (fd < 0) return dir + " is not writable: " + std::string(std::strerror(errno));
  const char byte = 0;
  const bool wrote = ::write(fd, &byte, 1) == 1;
  const int write_errno = errno;
  ::close(fd);
  ::unlink(path.c_str());
  if (!wrote) return dir + " is not writable: " + std::string(std::strerror(write_errno));
  return "";
}

// The NVML calls the GPU check needs, loaded at run time (no link dependency on the driver).
struct Nvml {
  void* handle = nullptr;
  int (*init)() = nullptr;
  int (*count)(unsigned*) = nullptr;
  int (*shutdown)() = nullptr;
};

// "" when `needed` GPUs are visible; a note goes to `notes` when the check cannot run.
std::string check_gpus(int needed, std::vector<std::string>& notes) {
  Nvml n;
  n.handle = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!n.handle) {
    notes.push_back("GPU check skipped: NVML (libnvidia-ml.so.1) is not on this node");
    return "";
  }
  n.init = reinterpret_cast<int (*)()>(::dlsym(n.handle, "nvmlInit_v2"));
  n.count = reinterpret_cast<int (*)(unsigned*)>(::dlsym(n.handle, "nvmlDeviceGetCount_v2"));
  n.shutdown = reinterpret_cast<int (*)()>(::dlsym(n.handle, "nvmlShutdown"));
  std::string reason;
  if (!n.init || !n.count || !n.shutdown) {
    notes.push_back("GPU check skipped: this NVML lacks nvmlInit_v2 or nvmlDeviceGetCount_v2");
  } else if (const int rc = n.init(); rc != 0) {
    reason = "NVML cannot be initialised (nvmlInit_v2 returned " + std::to_string(rc) +
             "): the GPU driver is not usable";
  } else {
    unsigned count = 0;
    const int rc2 = n.count(&count);
    if (rc2 != 0) {
      reason =
          "NVML cannot count the GPUs (nvmlDeviceGetCount_v2 returned " + std::to_string(rc2) + ")";
    } else if (static_cast<int>(count) < needed) {
      reason = std::to_string(count) + " GPU(s) visible, " + std::to_string(needed) +
               " needed (one per worker): a GPU is gone";
    }
    n.shutdown();
  }
  ::dlclose(n.handle);
  return reason;
}

// Runs `command` under /bin/sh; "" when it exits 0, else why not. Its output goes to `output`.
std::string run_command(const std::string& command, std::chrono::milliseconds timeout,
                        std::string& output) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0)
    return "cannot run the health check: pipe: " + std::string(std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // Its own process group (killed whole on timeout), no signal blocked (the agent blocks its
  // handled signals for its signalfd), and every signal at its default action.
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t pid = -1;
  const int err =
      ::posix_spawn(&pid, "/bin/sh", &actions, &attr, const_cast<char**>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(pipe_fds[1]);
  if (err != 0) {
    ::close(pipe_fds[0]);
    return "cannot run the health check: /bin/sh: " + std::string(std::strerror(err));
  }
  // Reads its output until the shell has exited (a child it left in the background may keep the
  // pipe open: what is readable then is taken, and the rest is not waited for) or the deadline.
  ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  const auto deadline = SteadyClock::now() + timeout;
  bool timed_out = false;
  bool exited = false;
  int status = 0;
  char buf[4096];
  auto drain = [&] {
    for (int i = 0; i < 64; ++i) {  // at most 256 KiB per call; the last kOutputKeep are kept
      const ssize_t got = ::read(pipe_fds[0], buf, sizeof buf);
      if (got <= 0) return got == 0;  // EOF, or nothing more now
      output.append(buf, static_cast<size_t>(got));
      if (output.size() > 2 * kOutputKeep) output.erase(0, output.size() - kOutputKeep);
    }
    return false;
  };
  bool eof = false;
  while (!exited) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now())
            .count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    if (!eof) {
      pollfd p{pipe_fds[0], POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 100)));
      eof = drain();
    } else {
      ::usleep(static_cast<useconds_t>(std::min<long long>(left, 20)) * 1000);
    }
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    exited = w == pid || (w < 0 && errno == ECHILD);
  }
  if (exited) drain();
  ::close(pipe_fds[0]);
  if (output.size() > kOutputKeep) output.erase(0, output.size() - kOutputKeep);
  // On a timeout the shell's whole group goes (what it started); after an exit, anything it left
  // running in its group (ESRCH when none).
  ::kill(-pid, SIGKILL);
  if (!exited) ::waitpid(pid, &status, 0);
  if (timed_out) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", static_cast<double>(timeout.count()) / 1000.0);
    return std::string("--health-check ran past its timeout (") + secs + " s): killed";
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  if (WIFSIGNALED(status)) {
    return "--health-check was killed by signal " + std::to_string(WTERMSIG(status));
  }
  std::string last_line = output;
  while (!last_line.empty() && (last_line.back() == '\n' || last_line.back() == '\r'))
    last_line.pop_back();
  if (const size_t nl = last_line.rfind('\n'); nl != std::string::npos) last_line.erase(0, nl + 1);
  if (last_line.size() > 200) last_line.resize(200);
  return "--health-check exited with " + std::to_string(WEXITSTATUS(status)) +
         (last_line.empty() ? std::string() : ": " + last_line);
}

}  // namespace

uint64_t shm_bytes_for(int nproc) {
  const uint64_t mib_bytes = 1024 * 1024;
  return std::max<uint64_t>(8 * mib_bytes,
                            static_cast<uint64_t>(std::max(nproc, 0)) * 4 * mib_bytes);
}

HealthReport check_node_health(const HealthOptions& options) {
  const auto start = SteadyClock::now();
  HealthReport r;
  auto fail = [&r](std::string why) {
    if (why.empty() || !r.healthy) return;
    r.healthy = false;
    r.reason = std::move(why);
  };
  if (options.builtin) {
    if (options.shm_bytes_needed > 0) fail(check_shm(options.shm_dir, options.shm_bytes_needed));
    for (const auto& dir : options.writable_dirs) {
      if (!dir.empty()) fail(check_writable(dir));
    }
    if (options.gpus_needed > 0) fail(check_gpus(options.gpus_needed, r.notes));
  }
  if (r.healthy && !options.command.empty())
    fail(run_command(options.command, options.timeout, r.output));
  r.seconds = std::chrono::duration<double>(SteadyClock::now() - start).count();
  return r;
}

std::chrono::milliseconds health_retry_delay(int failures, std::chrono::milliseconds cap) {
  std::chrono::milliseconds d(1000);
  for (int i = 1; i < failures && d < cap; ++i) d *= 2;
  return std::min(d, cap);
}

}  // namespace trun::agent
