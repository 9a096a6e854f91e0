#include "tests/worker_sdk/job.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace trun::worker::test {

Job::Job(uint16_t port) {
  if (port == 0) {
    store::StoreServerOptions o;
    o.host = "127.0.0.1";
    server_ = store::StoreServer::start(o);
    port_ = server_->port();
  } else {
    port_ = port;
  }
  char tmpl[] = "/tmp/trun-sdk-test-XXXXXX";
  if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  dir_ = tmpl;
}

Job::~Job() {
  for (size_t r = 0; r < pids_.size(); ++r) {
    if (!reaped_[r]) {
      ::kill(pids_[r], SIGKILL);
      ::waitpid(pids_[r], nullptr, 0);
    }
  }
  for (size_t r = 0; r < pids_.size(); ++r) ::unlink((dir_ + "/rank" + std::to_string(r)).c_str());
  ::rmdir(dir_.c_str());
  if (server_) server_->stop();
}

void Job::start(const JobSpec& spec) {
  int world = 0;
  for (int n : spec.nodes) world += n;
  int rank = 0;
  for (size_t node = 0; node < spec.nodes.size(); ++node) {
    const int local_size = spec.nodes[node];
    for (int l = 0; l < local_size; ++l, ++rank) {
      std::map<std::string, std::string> env;
      for (char** e = environ; *e; ++e) {
        std::string kv = *e;
        auto eq = kv.find('=');
        if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
      }
      for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                            "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRUN_INIT_METHOD",
                            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"})
        env.erase(k);
      for (auto it = env.begin(); it != env.end();) {
        const std::string& k = it->first;
        bool launcher = false;
        for (const char* p : {"SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL"})
          launcher = launcher || k.rfind(p, 0) == 0;
        it = launcher ? env.erase(it) : std::next(it);
      }
      if (!spec.torch_env) {
        for (auto& [k, v] : spec.env) env[k] = v;
        if (static_cast<size_t>(rank) < spec.rank_env.size())
          for (auto& [k, v] : spec.rank_env[rank]) env[k] = v;
        spawn(spec, env);
        continue;
      }
      env["RANK"] = std::to_string(rank);
      env["WORLD_SIZE"] = std::to_string(world);
      if (!spec.no_placement) {
        env["LOCAL_RANK"] = std::to_string(spec.reverse_local ? local_size - 1 - l : l);
        env["LOCAL_WORLD_SIZE"] = std::to_string(local_size);
        env["GROUP_RANK"] = std::to_string(node);
        env["GROUP_WORLD_SIZE"] = std::to_string(spec.nodes.size());
      }
      env["ROLE_RANK"] = std::to_string(rank);
      env["ROLE_NAME"] = "default";
      env["MASTER_ADDR"] = "127.0.0.1";
      env["MASTER_PORT"] = std::to_string(port_);
      env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(spec.restart_count);
      env["TORCHELASTIC_RUN_ID"] = spec.run_id;
      env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
      for (auto& [k, v] : spec.env) env[k] = v;
      if (static_cast<size_t>(rank) < spec.rank_env.size())
        for (auto& [k, v] : spec.rank_env[rank]) env[k] = v;
      spawn(spec, env);
    }
  }
}

void Job::spawn(const JobSpec& spec, const std::map<std::string, std::string>& env) {
  std::vector<std::string> env_strs;
  for (auto& [k, v] : env) env_strs.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strs) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::string out_path = dir_ + "/rank" + std::to_string(pids_.size());
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    ::execve(argv[0], argv.data(), envp.data());
    std::fprintf(stderr, "execve %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  pids_.push_back(pid);
  reaped_.push_back(false);
}

std::string Job::output(int r) const {
  std::ifstream in(dir_ + "/rank" + std::to_string(r));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Job::wait_for_output(int r, const std::string& text, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (output(r).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

void Job::kill_rank(int r, int sig) { ::kill(pids_.at(r), sig); }

std::vector<RankResult> Job::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<RankResult> results(pids_.size());
  size_t left = 0;
  for (size_t r = 0; r < pids_.size(); ++r) {
    results[r].rank = static_cast<int>(r);
    results[r].pid = pids_[r];
    if (!reaped_[r]) ++left;
  }
  while (left > 0) {
    bool progress = false;
    for (size_t r = 0; r < pids_.size(); ++r) {
      if (reaped_[r]) continue;
      int status = 0;
      pid_t p = ::waitpid(pids_[r], &status, WNOHANG);
      if (p == pids_[r]) {
        reaped_[r] = true;
        --left;
        progress = true;
        if (WIFEXITED(status)) {
          results[r].exited = true;
          results[r].exit_code = WEXITSTATUS(status);
        } else if (WIFSIGNALED(status)) {
          results[r].signal = WTERMSIG(status);
        }
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (size_t r = 0; r < pids_.size(); ++r) {
        if (reaped_[r]) continue;
        ::kill(pids_[r], SIGKILL);
        int status = 0;
        ::waitpid(pids_[r], &status, 0);
        reaped_[r] = true;
        results[r].signal = SIGKILL;
        results[r].output = "(killed by the test harness: still running at the deadline)\n";
      }
      break;
    }
    if (!progress) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (size_t r = 0; r < pids_.size(); ++r) results[r].output += output(static_cast<int>(r));
  return results;
}

std::string Job::describe(const std::vector<RankResult>& results) const {
  std::ostringstream os;
  for (auto& r : results) {
    os << "--- rank " << r.rank << " (pid " << r.pid << "): ";
    if (r.exited)
      os << "exit " << r.exit_code;
    else
      os << "signal " << r.signal;
    os << "\n" << r.output;
  }
  return os.str();
}

std::vector<std::string> shm_segments(const std::string& run_id) {
  std::vector<std::string> out;
  std::string prefix = "trun-" + run_id;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

std::string unique_run_id(const std::string& base) {
  static std::atomic<int> counter{0};
  return base + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

std::string build_file(const std::string& path) {
  // Test binaries sit two levels down (tests/<dir>/): in the build tree and in a gpu-check bundle,
  // which keeps that layout but not the build tree's absolute path.
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = 0;
    std::string root = std::string(exe).substr(0, std::string(exe).rfind('/')) + "/../../";
    if (::access((root + path).c_str(), X_OK) == 0) return root + path;
  }
  return std::string(TRUN_BINARY_DIR) + "/" + path;
}

std::string worker_binary() { return build_file("tests/worker_sdk/pg_worker"); }

}  // namespace trun::worker::test
