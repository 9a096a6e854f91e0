#pragma once
// Helpers for black-box tests of the trun binary: temporary directories, child processes with
// captured output and bounded waits, pid liveness. Every process started here is ended by pid.

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace trun::testing {

// Tests run in parallel (and next to other suites): trun's static default port 29500 would clash,
// so every trun these tests start picks a free store port unless a test passes --master-port.
// Set once, before any child is forked.
inline const bool kFreeStorePortByDefault = (setenv("PET_MASTER_PORT", "0", 0), true);
// The same for SLURM: a test run inside a SLURM job (srun ctest) must not have every trun derive
// its rendezvous from the job's SLURM_* variables. Tests of that behaviour unset TRUN_SLURM.
inline const bool kNoSlurmByDefault = (setenv("TRUN_SLURM", "0", 0), true);

inline std::string trun_binary() { return std::string(TRUN_BINARY_DIR) + "/launcher/trun"; }
inline std::string test_worker() {
  return std::string(TRUN_BINARY_DIR) + "/tests/bin/trun_test_worker";
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline bool file_exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// Polls `pred` every 2 ms until it holds or `timeout` passes. Returns the last result.
inline bool wait_until(const std::function<bool()>& pred,
                       std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

// Alive = exists and is not a zombie.
// The children of `parent` (of every one of its threads), from /proc, sorted.
inline std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  const std::string task = "/proc/" + std::to_string(parent) + "/task";
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(task, ec)) {
    std::ifstream in(t.path() / "children");
    for (pid_t p; in >> p;) out.push_back(p);
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline bool pid_alive(pid_t pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  auto p = line.rfind(')');
  return !(p != std::string::npos && p + 2 < line.size() && line[p + 2] == 'Z');
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/trun-test-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  // A trun that a test SIGKILLed has a guardian that removes its temporary folder (in here) at
  // the same moment, and remove_all gives up at the first entry that vanishes under it: retry,
  // bounded (20 tries, 50 ms apart).
  ~TempDir() {
    for (int i = 0; i < 20; ++i) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
      if (!ec || !std::filesystem::exists(path_, ec)) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A child process whose stdout/stderr go to files in its own temporary directory. Unless the
// test gives TMPDIR, the child's TMPDIR is a folder in that directory too: a trun that a test
// SIGKILLs cannot remove its own temporary log folder (/tmp/trun-XXXXXX), and this way it goes
// with the Child (the failover tests left 13 such folders in /tmp per run).
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
        const std::vector<std::string>& unset_env = {}) {
    out_path_ = dir_ / "stdout";
    err_path_ = dir_ / "stderr";
    const std::string tmp = dir_ / "tmp";
    ::mkdir(tmp.c_str(), 0700);
    pid_ = fork();
    if (pid_ == 0) {
      int out = open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int err = open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(out, 1);
      dup2(err, 2);
      setenv("TMPDIR", tmp.c_str(), 1);
      for (const auto& k : unset_env) unsetenv(k.c_str());
      for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  ~Child() {
    if (running()) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status_, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  bool running() {
    if (done_) return false;
    pid_t r = waitpid(pid_, &status_, WNOHANG);
    if (r == pid_) done_ = true;
    return !done_;
  }
  // Waits up to `timeout`; false if still running.
  bool wait(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    return wait_until([&] { return !running(); }, timeout);
  }
  void signal(int sig) { kill(pid_, sig); }

  // Exit code, or 128+signal when it died by a signal (as a shell reports it).
  int exit_code() const {
    if (WIFEXITED(status_)) return WEXITSTATUS(status_);
    if (WIFSIGNALED(status_)) return 128 + WTERMSIG(status_);
    return -1;
  }
  bool signaled() const { return WIFSIGNALED(status_); }
  std::string out() const { return read_file(out_path_); }
  std::string err() const { return read_file(err_path_); }

 private:
  TempDir dir_;
  std::string out_path_, err_path_;
  pid_t pid_ = -1;
  int status_ = 0;
  bool done_ = false;
};

struct RunResult {
  int exit_code = -1;
  bool finished = false;
  std::string out;
  std::string err;
};

// Runs trun with `args` to completion (bounded by `timeout`; killed after that), with `env` added
// to this process's environment and the `unset` variables removed.
inline RunResult run_trun(const std::vector<std::string>& args,
                          const std::map<std::string, std::string>& env = {},
                          std::chrono::milliseconds timeout = std::chrono::seconds(60),
                          const std::vector<std::string>& unset = {}) {
  std::vector<std::string> argv{trun_binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> removed{"TORCHELASTIC_ERROR_FILE", "LOGLEVEL", "OMP_NUM_THREADS"};
  removed.insert(removed.end(), unset.begin(), unset.end());
  Child c(argv, env, removed);
  RunResult r;
  r.finished = c.wait(timeout);
  if (!r.finished) {
    c.signal(SIGKILL);
    c.wait(std::chrono::seconds(10));
  }
  r.exit_code = c.exit_code();
  r.out = c.out();
  r.err = c.err();
  return r;
}

// Runs trun with `args` (e.g. a `trun status` command) until its stdout holds `needle`, at most
// 20 times, 0.5 s apart: for what an agent publishes right after the line a test waited for.
// Returns the last run.
inline RunResult run_trun_until(const std::vector<std::string>& args, const std::string& needle) {
  RunResult r;
  for (int i = 0; i < 20; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    r = run_trun(args);
    if (r.out.find(needle) != std::string::npos) break;
  }
  return r;
}

inline pid_t read_pid(const std::string& path) {
  return static_cast<pid_t>(std::atol(read_file(path).c_str()));
}

}  // namespace trun::testing
