// launch_bench: trun vs torchrun 1.13 on one node, in the same run.
//   launch   trun start -> all N workers running (N = 1, 2, 4, 8)
//   restart  a worker's death -> all N replacement workers running (N = 4)
//   idle     the agent's RSS and CPU over 10 s while 4 workers sleep
// Workers are bench/launch_probe (a C++ binary, --no-python for both launchers), which stamps
// CLOCK_MONOTONIC when it starts, so the figures measure the launchers, not Python imports.
// Usage: launch_bench --trun PATH --probe PATH [--torchrun PATH] [--reps N] [--quick]
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/launcher/free_port.h"

namespace fs = std::filesystem;
using trun::testing::free_port;

namespace {

long long now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

std::optional<long long> read_stamp(const std::string& path) {
  std::ifstream in(path);
  long long v;
  if (in >> v) return v;
  return std::nullopt;
}

struct Launcher {
  std::string label;
  bool torchrun = false;
  std::string path;
  std::string monitor_interval;  // torchrun only

  std::vector<std::string> command(int n, bool restart, const std::string& probe,
                                   const std::vector<std::string>& probe_args) const {
    std::vector<std::string> c;
    if (torchrun) {
      // torchrun 1.13: underscore flags; --redirects/--tee 9:1 avoid its crash on Python 3.11
      // while keeping the plain console. Its --standalone is c10d on localhost:29400 with a
      // uuid run id; spelled out here with a free port so that other torchruns on the host
      // cannot collide with it.
      static int run = 0;
      c = {path,
           "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:" + std::to_string(free_port()),
           "--rdzv_id=bench" + std::to_string(getpid()) + "_" + std::to_string(run++),
           "--nproc_per_node=" + std::to_string(n),
           "--monitor_interval=" + monitor_interval,
           "--redirects",
           "9:1",
           "--tee",
           "9:1",
           "--no_python"};
      if (restart) c.push_back("--max_restarts=1");
    } else {
      c = {path, "--standalone", "--nproc-per-node=" + std::to_string(n), "--no-python"};
      if (restart) c.push_back("--max-restarts=1");
    }
    c.push_back(probe);
    c.insert(c.end(), probe_args.begin(), probe_args.end());
    return c;
  }
};

pid_t spawn(const std::vector<std::string>& argv, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

// Waits for `pid` up to `timeout_s`; then SIGTERM, then SIGKILL. Returns the wait status.
int finish(pid_t pid, double timeout_s, bool terminate_first) {
  if (terminate_first) kill(pid, SIGTERM);
  int status = 0;
  auto end = now_ns() + static_cast<long long>(timeout_s * 1e9);
  while (now_ns() < end) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  kill(pid, SIGTERM);
  for (int i = 0; i < 5000; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return status;
}

// Polls for files; returns false after timeout.
bool wait_for(const std::vector<std::string>& paths, double timeout_s) {
  auto end = now_ns() + static_cast<long long>(timeout_s * 1e9);
  for (;;) {
    bool all = true;
    struct stat st;
    for (const auto& p : paths) all = all && stat(p.c_str(), &st) == 0;
    if (all) return true;
    if (now_ns() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

class Scratch {
 public:
  Scratch() {
    char t[] = "/tmp/trun-launch-bench-XXXXXX";
    path_ = mkdtemp(t);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string fresh(const std::string& name) {
    std::string p = path_ + "/" + name + "_" + std::to_string(counter_++);
    fs::create_directories(p);
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int counter_ = 0;
};

std::vector<std::string> starts(const std::string& dir, int attempt, int n) {
  std::vector<std::string> v;
  for (int r = 0; r < n; ++r) {
    v.push_back(dir + "/start_" + std::to_string(attempt) + "_" + std::to_string(r));
  }
  return v;
}

long long max_stamp(const std::vector<std::string>& files) {
  long long m = 0;
  for (const auto& f : files) m = std::max(m, read_stamp(f).value_or(0));
  return m;
}

// One launch; milliseconds from exec to the last worker running, or -1.
double measure_launch(const Launcher& l, int n, const std::string& probe, Scratch& s) {
  std::string dir = s.fresh("launch");
  auto cmd = l.command(n, false, probe, {dir, "launch"});
  long long t0 = now_ns();
  pid_t pid = spawn(cmd, dir + "/launcher.log");
  auto files = starts(dir, 0, n);
  bool ok = wait_for(files, 120);
  double ms = ok ? (max_stamp(files) - t0) / 1e6 : -1;
  // trun ends by itself once the workers exit; torchrun would sit out its monitor interval.
  finish(pid, l.torchrun ? 0.0 : 30.0, l.torchrun);
  if (!ok)
    std::fprintf(stderr, "launch failed (%s):\n%s\n", l.label.c_str(),
                 [&] {
                   std::ifstream in(dir + "/launcher.log");
                   std::stringstream ss;
                   ss << in.rdbuf();
                   return ss.str();
                 }()
                     .c_str());
  return ms;
}

// One restart; milliseconds from the failing worker's exit to all replacements running.
double measure_restart(const Launcher& l, int n, const std::string& probe, Scratch& s) {
  std::string dir = s.fresh("restart");
  auto cmd = l.command(n, true, probe, {dir, "restart", std::to_string(n)});
  pid_t pid = spawn(cmd, dir + "/launcher.log");
  auto files = starts(dir, 1, n);
  files.push_back(dir + "/death");
  bool ok = wait_for(files, 120);
  files.pop_back();
  double ms = ok ? (max_stamp(files) - *read_stamp(dir + "/death")) / 1e6 : -1;
  finish(pid, l.torchrun ? 0.0 : 30.0, l.torchrun);
  return ms;
}

struct ProcSample {
  long long cpu_ticks = 0;
  long rss_kb = 0;
};

ProcSample sample(pid_t pid) {
  ProcSample s;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  auto p = line.rfind(')');
  if (p != std::string::npos) {
    std::istringstream rest(line.substr(p + 2));
    std::string field;
    std::vector<std::string> f;
    while (rest >> field) f.push_back(field);
    // fields after ')' start at state (3rd); utime is 14th, stime 15th overall.
    if (f.size() > 12) s.cpu_ticks = std::stoll(f[11]) + std::stoll(f[12]);
  }
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::atol(line.c_str() + 6);
  }
  return s;
}

pid_t guardian_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  pid_t c;
  while (in >> c) {
    std::ifstream comm("/proc/" + std::to_string(c) + "/comm");
    std::string name;
    std::getline(comm, name);
    if (name == "trun-guardian") return c;
  }
  return -1;
}

struct Footprint {
  double rss_mb = -1;
  double cpu_pct = -1;
  double guardian_rss_mb = -1;
};

Footprint measure_idle(const Launcher& l, int n, double seconds, const std::string& probe,
                       Scratch& s) {
  std::string dir = s.fresh("idle");
  auto cmd = l.command(n, false, probe, {dir, "idle", std::to_string(seconds + 4)});
  pid_t pid = spawn(cmd, dir + "/launcher.log");
  Footprint fp;
  if (wait_for(starts(dir, 0, n), 120)) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    ProcSample a = sample(pid);
    long long t0 = now_ns();
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    ProcSample b = sample(pid);
    double wall = (now_ns() - t0) / 1e9;
    fp.rss_mb = b.rss_kb / 1024.0;
    fp.cpu_pct = 100.0 * (b.cpu_ticks - a.cpu_ticks) / sysconf(_SC_CLK_TCK) / wall;
    if (!l.torchrun) {
      pid_t g = guardian_of(pid);
      if (g > 0) fp.guardian_rss_mb = sample(g).rss_kb / 1024.0;
    }
  }
  finish(pid, 0.0, true);
  return fp;
}

struct Stats {
  double median = -1, min = -1, max = -1;
  int failures = 0;
};

Stats stats_of(std::vector<double> v) {
  Stats s;
  std::vector<double> ok;
  for (double x : v) {
    if (x >= 0) {
      ok.push_back(x);
    } else {
      ++s.failures;
    }
  }
  if (ok.empty()) return s;
  std::sort(ok.begin(), ok.end());
  s.min = ok.front();
  s.max = ok.back();
  s.median = ok.size() % 2 ? ok[ok.size() / 2] : (ok[ok.size() / 2 - 1] + ok[ok.size() / 2]) / 2;
  return s;
}

std::string cell(const Stats& s) {
  if (s.median < 0) return "failed";
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1f (%.1f-%.1f)", s.median, s.min, s.max);
  return buf;
}

void result(const char* name, double value, const char* unit, double peer, bool smaller_better) {
  char peer_s[32] = "none", ratio_s[32] = "none";
  if (peer >= 0 && value >= 0) {
    std::snprintf(peer_s, sizeof peer_s, "%.3f", peer);
    // Both at (rounded) zero, e.g. idle CPU over 10 s: equal, not infinitely better.
    double v = std::max(value, 1e-3), p = std::max(peer, 1e-3);
    std::snprintf(ratio_s, sizeof ratio_s, "%.2f", smaller_better ? p / v : v / p);
  }
  std::printf("RESULT name=%s value=%.3f unit=%s peer=%s ratio=%s\n", name, value, unit, peer_s,
              ratio_s);
}

}  // namespace

int main(int argc, char** argv) {
  std::string trun, probe, torchrun = "/usr/bin/torchrun";
  int reps = 20, peer_reps = 3;
  double idle_s = 10;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--trun")
      trun = next();
    else if (a == "--probe")
      probe = next();
    else if (a == "--torchrun")
      torchrun = next();
    else if (a == "--reps")
      reps = std::atoi(next().c_str());
    else if (a == "--quick") {
      reps = 5;
      peer_reps = 1;
      idle_s = 3;
    } else {
      std::fprintf(stderr,
                   "usage: launch_bench --trun PATH --probe PATH [--torchrun PATH] "
                   "[--reps N] [--quick]\n");
      return 2;
    }
  }
  if (trun.empty() || probe.empty()) {
    std::fprintf(stderr, "launch_bench: --trun and --probe are required\n");
    return 2;
  }
  const bool have_torchrun = access(torchrun.c_str(), X_OK) == 0;
  std::vector<Launcher> launchers{{"trun", false, trun, ""}};
  if (have_torchrun) {
    launchers.push_back({"torchrun mi=5 (default)", true, torchrun, "5"});
    launchers.push_back({"torchrun mi=0.1", true, torchrun, "0.1"});
  } else {
    std::printf("note: %s not found; torchrun columns are empty\n", torchrun.c_str());
  }
  Scratch scratch;
  std::printf(
      "trun launch benchmark: %ld CPUs; trun %d reps, torchrun %d reps per figure; "
      "median (min-max)\n\n",
      sysconf(_SC_NPROCESSORS_ONLN), reps, peer_reps);

  // Launch.
  const int ns[] = {1, 2, 4, 8};
  std::vector<std::vector<Stats>> launch(launchers.size());
  std::printf("Launch: trun/torchrun start -> all N workers running [ms]\n");
  std::printf("%3s | %-24s | %-24s | %-24s\n", "N", "trun", "torchrun mi=5", "torchrun mi=0.1");
  for (int n : ns) {
    std::printf("%3d", n);
    for (size_t li = 0; li < launchers.size(); ++li) {
      std::vector<double> v;
      int k = launchers[li].torchrun ? peer_reps : reps;
      for (int r = 0; r < k; ++r) v.push_back(measure_launch(launchers[li], n, probe, scratch));
      launch[li].push_back(stats_of(v));
      std::printf(" | %-24s", cell(launch[li].back()).c_str());
      std::fflush(stdout);
    }
    std::printf("\n");
  }

  // Restart.
  const int restart_n = 4;
  std::vector<Stats> restart;
  std::printf("\nRestart (N=%d): failing worker's exit -> all replacements running [ms]\n",
              restart_n);
  for (const auto& l : launchers) {
    std::vector<double> v;
    int k =
        l.torchrun ? (l.monitor_interval == "5" ? std::max(1, peer_reps - 1) : peer_reps) : reps;
    for (int r = 0; r < k; ++r) v.push_back(measure_restart(l, restart_n, probe, scratch));
    restart.push_back(stats_of(v));
    std::printf("  %-24s %s\n", l.label.c_str(), cell(restart.back()).c_str());
    std::fflush(stdout);
  }

  // Footprint.
  std::vector<Footprint> idle;
  std::printf("\nAgent footprint, 4 workers idle, over %.0f s\n", idle_s);
  for (const auto& l : launchers) {
    idle.push_back(measure_idle(l, 4, idle_s, probe, scratch));
    std::printf("  %-24s RSS %.1f MB, CPU %.3f %%", l.label.c_str(), idle.back().rss_mb,
                idle.back().cpu_pct);
    if (idle.back().guardian_rss_mb >= 0) {
      std::printf(" (plus its guardian process: RSS %.1f MB, mostly shared pages)",
                  idle.back().guardian_rss_mb);
    }
    std::printf("\n");
    std::fflush(stdout);
  }

  std::printf(
      "\nPeers in RESULT lines: torchrun with its default --monitor_interval (5 s) for "
      "launch and footprint; torchrun with 0.1 for restart (its best case).\n");
  auto peer_launch = [&](size_t i) { return have_torchrun ? launch[1][i].median : -1.0; };
  const char* names[] = {"launch_n1_ms", "launch_n2_ms", "launch_n4_ms", "launch_n8_ms"};
  for (size_t i = 0; i < 4; ++i) result(names[i], launch[0][i].median, "ms", peer_launch(i), true);
  result("restart_n4_ms", restart[0].median, "ms", have_torchrun ? restart[2].median : -1, true);
  result("agent_idle_rss_mb", idle[0].rss_mb, "MB", have_torchrun ? idle[1].rss_mb : -1, true);
  result("agent_idle_cpu_pct", idle[0].cpu_pct, "percent", have_torchrun ? idle[1].cpu_pct : -1,
         true);
  return 0;
}
