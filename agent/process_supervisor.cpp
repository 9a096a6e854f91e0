// Boost.Process stays in this translation unit (it costs seconds to compile).
#include "agent/process_supervisor.h"

#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sched.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

// vfork: the child runs at once on the parent's memory and the parent resumes at exec, which
// halves the per-worker cost under load. WorkerSetup only makes system calls in the child, as
// vfork requires. glibc's feature macros hide vfork from Boost's detection, hence the define.
#define BOOST_POSIX_HAS_VFORK 1
#include <algorithm>
#include <boost/process/args.hpp>
#include <boost/process/child.hpp>
#include <boost/process/exe.hpp>
#include <boost/process/extend.hpp>
#include <boost/process/posix.hpp>
#include <boost/process/search_path.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

namespace bp = boost::process;

namespace trun::agent {

namespace {

// Runs in the forked child before execve: only async-signal-safe calls.
struct WorkerSetup : bp::extend::handler {
  pid_t parent;
  int guardian_fd;
  int out_fd;
  int err_fd;
  char** envp;
  // NUMA binding: CPU mask (nullptr: none) and preferred-node mask (nullptr: none), built in the
  // parent because the child may not allocate.
  const cpu_set_t* cpus = nullptr;
  size_t cpus_size = 0;
  const unsigned long* nodes = nullptr;
  unsigned long nodes_bits = 0;

  template <class Executor>
  void on_setup(Executor& e) const {
    e.env = envp;
  }

  template <class Executor>
  void on_exec_setup(Executor&) const {
    setpgid(0, 0);
    // Register the new group with the guardian before any of the worker's own code runs, so a
    // SIGKILL of trun at any later moment takes the group (and its grandchildren) along. A
    // 4-byte write to a pipe is atomic.
    if (guardian_fd >= 0) {
      int32_t rec = static_cast<int32_t>(getpid());
      ssize_t ignored = write(guardian_fd, &rec, sizeof rec);
      (void)ignored;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    // trun died between fork and prctl: the death signal would never come.
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    if (out_fd >= 0) dup2(out_fd, STDOUT_FILENO);
    if (err_fd >= 0) dup2(err_fd, STDERR_FILENO);
    // The CPUs were checked against trun's own affinity when the bindings were planned; a
    // failure here (a cgroup change since) ends the worker with a line saying why.
    if (cpus != nullptr && sched_setaffinity(0, cpus_size, cpus) != 0) {
      static const char kMsg[] = "trun: --numa-binding: sched_setaffinity failed\n";
      ssize_t ignored = write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
      (void)ignored;
      _exit(126);
    }
    if (nodes != nullptr) {
      // Preferred, not bound: allocations go elsewhere when the node is full. The kernel reads
      // maxnode - 1 bits.
      syscall(SYS_set_mempolicy, MPOL_PREFERRED, nodes, nodes_bits + 1);
    }
    // Boost's exec-error pipe is already close-on-exec; everything else trun holds (store
    // sockets, log pipes) must not leak into workers.
    close_range(3U, ~0U, CLOSE_RANGE_CLOEXEC);
  }

  // execve failed (the child exits right after): take the group back from the guardian, whose
  // group id could otherwise be reused by an unrelated process before trun exits.
  template <class Executor>
  void on_exec_error(Executor&, const std::error_code&) const {
    if (guardian_fd >= 0) {
      int32_t rec = -static_cast<int32_t>(getpid());
      ssize_t ignored = write(guardian_fd, &rec, sizeof rec);
      (void)ignored;
    }
  }
};

// The guardian's pipe protocol, one int32 per record: a worker's process group (> 0, written by
// the worker itself before it execs), the negated group when it is gone (< 0), and kRelease when
// trun ends in order, having removed its temporary directory itself.
constexpr int32_t kRelease = 0;

// The agent's temporary directory as the guardian holds it, all prepared before the fork (the
// guardian, a fork of a multi-threaded process, must not allocate): the directory it lives in,
// open, the directory's name there, and its identity, so that the guardian removes that
// directory and nothing else (not a link, not another directory renamed into its place).
struct GuardedDir {
  int parent_fd = -1;
  const char* name = nullptr;
  dev_t dev = 0;
  ino_t ino = 0;
};

// Deeper directories than this (a worker's own nesting) are left in place, and so is their
// parent chain.
constexpr int kMaxRemoveDepth = 32;

// Removes what is inside the directory open at `dir`, with raw system calls only (no malloc:
// it runs in the guardian) and never following a symbolic link: a link is unlinked itself,
// and a subdirectory is opened with O_NOFOLLOW relative to its parent. Returns whether the
// directory was seen empty at the end.
bool remove_contents(int dir, int depth) {
  struct Dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[1];
  };
  alignas(8) char buf[2048];
  // Several passes: unlinking while reading may make getdents skip entries, and a worker that
  // was still being killed may have added one.
  for (int pass = 0; pass < 16; ++pass) {
    if (lseek(dir, 0, SEEK_SET) < 0) return false;
    bool any = false;
    for (int batch = 0; batch < 1 << 20; ++batch) {
      const long n = syscall(SYS_getdents64, dir, buf, sizeof buf);
      if (n <= 0) break;
      for (long off = 0; off < n;) {
        const auto* d = reinterpret_cast<const Dirent64*>(buf + off);
        off += d->d_reclen;
        const char* name = d->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'))) continue;
        any = true;
        if (unlinkat(dir, name, 0) == 0 || errno != EISDIR) continue;  // files, links, gone
        if (depth >= kMaxRemoveDepth) continue;
        const int sub = openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sub < 0) continue;
        remove_contents(sub, depth + 1);
        close(sub);
        unlinkat(dir, name, AT_REMOVEDIR);
      }
    }
    if (!any) return true;
  }
  return false;
}

// Removes the guarded directory: its contents, then itself, if it still is the directory trun
// made.
void remove_guarded_dir(const GuardedDir& g) {
  const int dir = openat(g.parent_fd, g.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir < 0) return;  // gone already, or replaced by something that is not a directory
  struct stat st;
  if (fstat(dir, &st) == 0 && st.st_dev == g.dev && st.st_ino == g.ino) {
    remove_contents(dir, 0);
    struct stat now;
    if (fstatat(g.parent_fd, g.name, &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == g.dev &&
        now.st_ino == g.ino) {
      unlinkat(g.parent_fd, g.name, AT_REMOVEDIR);
    }
  }
  close(dir);
}

// After the SIGKILLs: waits (at most ~5 s) until no process is left in the groups, so that no
// worker still writes its logs into the directory being removed. A group counts as gone when
// kill(-group, 0) finds no process; zombies still count, so with an init that reaps slowly this
// waits out the bound and removes anyway (a zombie writes nothing). It waits 250 ms at least:
// whoever started trun may clean up after it at once (a batch system's epilogue removing the
// job's $TMPDIR, a test harness), and two removers at the same moment make a recursive removal
// that gives up on the first entry vanishing under it (std::filesystem::remove_all) stop
// halfway; a moment later the directory is simply gone, and the guardian finds nothing to do.
void wait_for_groups(const int32_t* groups, size_t n) {
  constexpr int kMinRounds = 25, kMaxRounds = 500;  // of 10 ms
  for (int round = 0; round < kMaxRounds; ++round) {
    bool alive = false;
    for (size_t i = 0; i < n && !alive; ++i) alive = kill(-groups[i], 0) == 0 || errno == EPERM;
    if (!alive && round >= kMinRounds) return;
    timespec ten_ms{0, 10 * 1000 * 1000};
    nanosleep(&ten_ms, nullptr);
  }
}

// The guardian's whole life: collect groups from the pipe; at EOF kill them all and, unless trun
// released it, remove its temporary directory once they are dead.
[[noreturn]] void guardian_main(int fd, int32_t* groups, size_t capacity, const GuardedDir& dir) {
  sigset_t all;
  sigfillset(&all);
  sigprocmask(SIG_SETMASK, &all, nullptr);
  prctl(PR_SET_NAME, "trun-guardian");
  size_t n = 0;
  int32_t rec;
  bool released = false;
  for (;;) {
    ssize_t r = read(fd, &rec, sizeof rec);
    if (r == static_cast<ssize_t>(sizeof rec)) {
      if (rec == kRelease) {
        released = true;
      } else if (rec > 0 && n < capacity) {
        groups[n++] = rec;
      } else if (rec < 0) {
        for (size_t i = 0; i < n; ++i) {
          if (groups[i] == -rec) {
            groups[i] = groups[--n];
            break;
          }
        }
      }
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    break;  // EOF (trun is gone or done) or an error
  }
  for (size_t i = 0; i < n; ++i) kill(-groups[i], SIGKILL);
  if (!released && dir.parent_fd >= 0) {
    wait_for_groups(groups, n);
    remove_guarded_dir(dir);
  }
  _exit(0);
}

}  // namespace

// One long-lived thread that performs every fork, so the workers' parent-death signal only fires
// when trun exits.
class ProcessSupervisor::SpawnThread {
 public:
  explicit SpawnThread(int guardian_fd) : guardian_fd_(guardian_fd), thread_([this] { loop(); }) {}
  ~SpawnThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  std::vector<SpawnResult> run(const std::vector<SpawnRequest>& requests) {
    Job job{&requests, {}, false};
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(&job);
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return job.done; });
    return std::move(job.results);
  }

 private:
  struct Job {
    const std::vector<SpawnRequest>* requests;
    std::vector<SpawnResult> results;
    bool done;
  };

  void loop() {
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = queue_.front();
        queue_.pop_front();
      }
      std::vector<SpawnResult> results;
      results.reserve(job->requests->size());
      for (const auto& req : *job->requests) results.push_back(spawn_one(req));
      {
        std::lock_guard<std::mutex> lock(mu_);
        job->results = std::move(results);
        job->done = true;
      }
      done_cv_.notify_all();
    }
  }

  SpawnResult spawn_one(const SpawnRequest& req) {
    SpawnResult result;
    if (req.argv.empty()) {
      result.error = EINVAL;
      result.error_message = "empty command line";
      return result;
    }
    boost::filesystem::path exe = req.argv[0];
    if (req.argv[0].find('/') == std::string::npos) {
      exe = bp::search_path(req.argv[0]);
      if (exe.empty()) {
        result.error = ENOENT;
        result.error_message = req.argv[0] + ": not found in PATH";
        return result;
      }
    }
    std::vector<char*> envp;
    envp.reserve(req.env.size() + 1);
    for (const auto& kv : req.env) envp.push_back(const_cast<char*>(kv.c_str()));
    envp.push_back(nullptr);
    std::vector<std::string> args(req.argv.begin() + 1, req.argv.end());
    WorkerSetup setup;
    setup.parent = getpid();
    setup.guardian_fd = guardian_fd_;
    setup.out_fd = req.stdout_fd;
    setup.err_fd = req.stderr_fd;
    setup.envp = envp.data();
    std::unique_ptr<cpu_set_t, void (*)(cpu_set_t*)> cpus(nullptr,
                                                          [](cpu_set_t* c) { CPU_FREE(c); });
    std::vector<unsigned long> nodes;
    if (!req.cpus.empty()) {
      const auto count =
          static_cast<size_t>(*std::max_element(req.cpus.begin(), req.cpus.end())) + 1;
      cpus.reset(CPU_ALLOC(count));
      setup.cpus_size = CPU_ALLOC_SIZE(count);
      CPU_ZERO_S(setup.cpus_size, cpus.get());
      for (int c : req.cpus) CPU_SET_S(static_cast<size_t>(c), setup.cpus_size, cpus.get());
      setup.cpus = cpus.get();
    }
    if (req.memory_node >= 0) {
      constexpr size_t kBits = 8 * sizeof(unsigned long);
      const auto node = static_cast<size_t>(req.memory_node);
      nodes.assign(node / kBits + 1, 0UL);
      nodes[node / kBits] |= 1UL << (node % kBits);
      setup.nodes = nodes.data();
      setup.nodes_bits = nodes.size() * kBits;
    }
    try {
      bp::child child(bp::exe = exe, bp::args = args, setup, bp::posix::use_vfork);
      result.pid = child.id();
      // trun reaps by pid itself (ProcessSupervisor::reap); Boost must not wait or kill.
      child.detach();
    } catch (const std::system_error& e) {
      result.error = e.code().value();
      result.error_message = exe.string() + ": " + e.code().message();
    }
    return result;
  }

  const int guardian_fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<Job*> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

ProcessSupervisor::ProcessSupervisor(const std::string& temporary_dir) {
  // Everything the guardian needs about the directory, prepared here: it must not allocate.
  GuardedDir guarded;
  if (!temporary_dir.empty()) {
    const size_t slash = temporary_dir.find_last_of('/');
    const std::string parent = slash == std::string::npos ? "."
                               : slash == 0               ? "/"
                                                          : temporary_dir.substr(0, slash);
    guarded_name_ = slash == std::string::npos ? temporary_dir : temporary_dir.substr(slash + 1);
    struct stat st;
    guarded.parent_fd = open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (guarded.parent_fd < 0 ||
        fstatat(guarded.parent_fd, guarded_name_.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISDIR(st.st_mode)) {
      const int err = errno;
      if (guarded.parent_fd >= 0) close(guarded.parent_fd);
      throw std::system_error(err, std::generic_category(),
                              "the temporary directory " + temporary_dir);
    }
    guarded.name = guarded_name_.c_str();
    guarded.dev = st.st_dev;
    guarded.ino = st.st_ino;
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    const int err = errno;
    if (guarded.parent_fd >= 0) close(guarded.parent_fd);
    throw std::system_error(err, std::generic_category(), "pipe2 for the guardian");
  }
  // Allocated before fork: the guardian must not call malloc.
  constexpr size_t kCapacity = 1 << 16;
  std::unique_ptr<int32_t[]> groups(new int32_t[kCapacity]);
  pid_t pid = fork();
  if (pid < 0) {
    int err = errno;
    close(fds[0]);
    close(fds[1]);
    if (guarded.parent_fd >= 0) close(guarded.parent_fd);
    throw std::system_error(err, std::generic_category(), "fork for the guardian");
  }
  if (pid == 0) {
    // Keep only the read end, on fd 3, and the temporary directory's parent, on fd 4, so the
    // guardian holds no other resource of trun's. Both move above 4 first, so that neither
    // lands on the other.
    const int pipe_fd = fcntl(fds[0], F_DUPFD, 5);
    const int parent_fd = guarded.parent_fd >= 0 ? fcntl(guarded.parent_fd, F_DUPFD, 5) : -1;
    dup2(pipe_fd, 3);
    if (parent_fd >= 0) {
      dup2(parent_fd, 4);
      guarded.parent_fd = 4;
    } else {
      guarded.parent_fd = -1;  // none, or it could not be kept: the directory stays
    }
    close_range(guarded.parent_fd >= 0 ? 5U : 4U, ~0U, 0);
    guardian_main(3, groups.get(), kCapacity, guarded);
  }
  if (guarded.parent_fd >= 0) close(guarded.parent_fd);
  close(fds[0]);
  guardian_pid_ = pid;
  guardian_fd_ = fds[1];
  spawner_ = std::make_unique<SpawnThread>(guardian_fd_);
}

ProcessSupervisor::~ProcessSupervisor() {
  spawner_.reset();
  if (guardian_fd_ >= 0) {
    // An orderly end: the agent removed its temporary directory itself (it is destroyed before
    // the supervisor), so the guardian must leave the name alone.
    const int32_t rec = kRelease;
    if (write(guardian_fd_, &rec, sizeof rec) != sizeof rec) {
      spdlog::debug("guardian write failed: {}", std::strerror(errno));
    }
    close(guardian_fd_);
  }
  if (guardian_pid_ > 0) {
    // The guardian exits as soon as it reads EOF.
    while (waitpid(guardian_pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

std::vector<SpawnResult> ProcessSupervisor::spawn(const std::vector<SpawnRequest>& requests) {
  // Each worker registered its group with the guardian itself, before exec.
  return spawner_->run(requests);
}

bool ProcessSupervisor::signal_group(pid_t pgid, int sig) {
  if (pgid <= 0) return false;
  return kill(-pgid, sig) == 0;
}

bool ProcessSupervisor::group_alive(pid_t pgid) {
  return pgid > 0 && (kill(-pgid, 0) == 0 || errno == EPERM);
}

void ProcessSupervisor::forget_group(pid_t pgid) {
  if (guardian_fd_ < 0 || pgid <= 0) return;
  int32_t rec = -pgid;
  if (write(guardian_fd_, &rec, sizeof rec) != sizeof rec) {
    spdlog::debug("guardian write failed: {}", std::strerror(errno));
  }
}

std::vector<ExitStatus> ProcessSupervisor::reap(const std::function<bool(pid_t)>& is_worker) {
  std::vector<ExitStatus> out;
  // Bounded: each round reaps one child; there cannot be more zombies than processes.
  for (int i = 0; i < 1 << 20; ++i) {
    siginfo_t info;
    std::memset(&info, 0, sizeof info);
    if (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
      if (errno == EINTR) continue;
      break;  // ECHILD: no children at all
    }
    pid_t pid = info.si_pid;
    if (pid == 0) break;  // children exist, none has exited
    int status = 0;
    pid_t r;
    do {
      r = waitpid(pid, &status, WNOHANG);
    } while (r < 0 && errno == EINTR);
    if (r != pid) break;  // should not happen: we just saw it exit
    if (pid == guardian_pid_) {
      spdlog::warn("trun's guardian process {} exited unexpectedly (status {})", pid, status);
      guardian_pid_ = -1;
      // guardian_fd_ stays open (the spawn thread hands it to workers); writes now fail with
      // EPIPE, which is harmless.
    } else if (is_worker(pid)) {
      out.push_back(ExitStatus{pid, status});
    } else {
      spdlog::debug("reaped orphaned process {} (status {})", pid, status);
    }
  }
  return out;
}

bool ProcessSupervisor::become_subreaper() { return prctl(PR_SET_CHILD_SUBREAPER, 1) == 0; }

}  // namespace trun::agent
