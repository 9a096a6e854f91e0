// trun_test_worker: the worker program the launcher tests start. It runs a script of actions
// given on its command line, left to right:
//
//   pidfile DIR        write DIR/pid_<restart>_<local_rank> holding this process's pid
//   grandchild DIR     fork a child (same process group) that writes DIR/gc_<restart>_<rank>
//                      with its pid and sleeps (at most 300 s)
//   orphan-check       fork a child that forks a grandchild and exits at once; the grandchild
//                      exits after 50 ms; then wait (<= 5 s) until the grandchild is reaped by
//                      trun (subreaper) and exit 0, or exit 1 if it stays a zombie
//   exit N             exit with status N
//   signal N           die by signal N (default action restored first)
//   signal-parent N    send signal N to the parent (trun), as scancel signals a whole step
//   ignore-term        ignore SIGTERM from now on
//   trap DIR           on SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 write the signal number
//                      to DIR/sig_<local_rank> and exit 0; taken while a later `sleep` waits
//                      (blocked until then, accepted with sigtimedwait)
//   trap-time DIR      on SIGTERM/SIGINT write CLOCK_REALTIME in nanoseconds at the moment the
//                      signal arrived to DIR/sigtime_<local_rank> and exit 0
//   sleep SECONDS      sleep (fractions allowed)
//   wait-file PATH     wait until PATH exists (at most 20 s)
//   error-file MSG [TS]  write a @record-style JSON error file to $TORCHELASTIC_ERROR_FILE
//   flood N            print N numbered lines to stdout, as fast as possible
//   print TEXT / eprint TEXT / partial TEXT   a line to stdout / stderr / no newline
//   env DIR            write the whole environment as JSON to DIR/env_<restart>_<local_rank>.json
//   envlog FILE        append one line to FILE: this process's pid, RANK, WORLD_SIZE, GROUP_RANK,
//                      GROUP_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, MASTER_ADDR:MASTER_PORT
//                      (space-separated key=value), so that successive rounds of one attempt
//                      stay apart
//   store-check        connect to $MASTER_ADDR:$MASTER_PORT with a TcpStore, set and read back a
//                      key under /worker/attempt_<restart>/ (as PyTorch workers do); exit 4 if
//                      that fails
//   on-rank R ACTION...     run the next action only on local rank R
//   on-attempt N ACTION...  run the next action only when TORCHELASTIC_RESTART_COUNT is N
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/write_all.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"

extern char** environ;

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// The local rank; under --virtual-local-rank LOCAL_RANK is 0 everywhere, TRUN_LOCAL_RANK is not.
std::string rank() { return env_or("TRUN_LOCAL_RANK", env_or("LOCAL_RANK", "0").c_str()); }
std::string attempt() { return env_or("TORCHELASTIC_RESTART_COUNT", "0"); }

void write_file(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << content;
  }
  std::rename(tmp.c_str(), path.c_str());  // readers never see a partial file
}

// Invalid UTF-8 (an environment value, a message) is replaced, not an exception.
std::string to_json(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// on_trapped (called from `sleep`) and the trap-time signal handler: only async-signal-safe
// calls (open, write, rename, clock_gettime, _exit), on paths made before the trap is set
// (ThreadSanitizer reports an allocation inside a handler, and one could deadlock on malloc's
// lock).
std::string g_trap_path;       // <dir>/sig_<rank>
std::string g_trap_time_path;  // <dir>/sigtime_<rank>
std::string g_trap_time_tmp;   // the same + ".tmp"

// Decimal text of v (>= 0) into buf (at least 21 bytes); returns its length.
int decimal(long long v, char* buf) {
  char rev[21];
  int n = 0;
  do {
    rev[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0 && n < 20);
  for (int i = 0; i < n; ++i) buf[i] = rev[n - 1 - i];
  return n;
}

// Async-signal-safe: called from the trap handlers.
void write_file(const char* path, const char* text, int len) {
  int fd = ::open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  (void)trun::base::write_all(fd, text, static_cast<size_t>(len));
  ::close(fd);
}

void on_trapped(int sig) {
  char text[21];
  write_file(g_trap_path.c_str(), text, decimal(sig, text));
  _exit(0);
}

// "trap": its signals are blocked and `sleep` accepts them (on_trapped) instead of a handler
// running. Under ThreadSanitizer a handler now and then never ran: a SIGTERM sent as soon as the
// pidfile was there (the signal tests do) left the worker asleep for its whole 60 s (about 1 in
// 100 runs with the machine loaded; the flaky TSan signal tests), though a second SIGTERM a
// second later was handled at once. A signal accepted synchronously leaves the sanitizer nothing
// to defer.
sigset_t g_trapped;
bool g_trapping = false;

void sleep_seconds(double s) {
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(static_cast<long long>(s * 1e6));
  for (int i = 0; i < 1000000; ++i) {  // bounded: each turn ends at `until` or on a signal
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    timespec ts{static_cast<time_t>(left.count() / 1000000000),
                static_cast<long>(left.count() % 1000000000)};
    if (!g_trapping) {
      nanosleep(&ts, nullptr);
      continue;
    }
    const int sig = sigtimedwait(&g_trapped, nullptr, &ts);
    if (sig > 0) on_trapped(sig);
  }
}

void on_trapped_time(int) {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  char text[21];
  int len = decimal(static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec, text);
  write_file(g_trap_time_tmp.c_str(), text, len);
  std::rename(g_trap_time_tmp.c_str(), g_trap_time_path.c_str());  // no partial file is seen
  _exit(0);
}

int orphan_check() {
  int p[2];
  if (pipe(p) != 0) return 2;
  pid_t child = fork();
  if (child == 0) {
    pid_t gc = fork();
    if (gc == 0) {
      close(p[0]);
      close(p[1]);
      usleep(50000);
      _exit(0);
    }
    if (write(p[1], &gc, sizeof gc) != sizeof gc) _exit(3);
    _exit(0);
  }
  close(p[1]);
  pid_t gc = -1;
  if (read(p[0], &gc, sizeof gc) != sizeof gc) return 2;
  close(p[0]);
  waitpid(child, nullptr, 0);
  // The grandchild now belongs to trun (the nearest subreaper). Once it exits, trun must reap it.
  std::string stat_path = "/proc/" + std::to_string(gc) + "/stat";
  for (int i = 0; i < 500; ++i) {
    std::ifstream in(stat_path);
    if (!in) return 0;  // gone: reaped
    std::string line;
    std::getline(in, line);
    auto close_paren = line.rfind(')');
    char state = close_paren != std::string::npos && close_paren + 2 < line.size()
                     ? line[close_paren + 2]
                     : '?';
    (void)state;
    usleep(10000);
  }
  std::fprintf(stderr, "orphan %d was not reaped\n", gc);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  size_t i = 0;
  auto need = [&](size_t n) {
    if (i + n > a.size()) {
      std::fprintf(stderr, "trun_test_worker: %s needs %zu argument(s)\n", a[i - 1].c_str(), n);
      std::exit(99);
    }
  };
  // Skips the next action (with its arguments) when a condition does not hold.
  auto skip_next = [&]() {
    static const std::pair<const char*, int> kArity[] = {
        {"pidfile", 1},    {"grandchild", 1},  {"orphan-check", 0}, {"exit", 1},
        {"signal", 1},     {"ignore-term", 0}, {"trap", 1},         {"sleep", 1},
        {"error-file", 2}, {"flood", 1},       {"print", 1},        {"eprint", 1},
        {"partial", 1},    {"env", 1},         {"store-check", 0},  {"on-rank", 1},
        {"on-attempt", 1}, {"wait-file", 1},   {"trap-time", 1},    {"signal-parent", 1}};
    if (i >= a.size()) return;
    std::string action = a[i++];
    for (const auto& [name, n] : kArity) {
      if (action == name) {
        i += static_cast<size_t>(n);
        if (action == "on-rank" || action == "on-attempt") {
          // skip the guarded action too
          if (i < a.size()) {
            std::string inner = a[i];
            for (const auto& [n2, k2] : kArity) {
              if (inner == n2) i += 1 + static_cast<size_t>(k2);
            }
          }
        }
        return;
      }
    }
  };

  while (i < a.size()) {
    const std::string act = a[i++];
    if (act == "pidfile") {
      need(1);
      write_file(a[i++] + "/pid_" + attempt() + "_" + rank(), std::to_string(getpid()));
    } else if (act == "grandchild") {
      need(1);
      std::string dir = a[i++];
      pid_t pid = fork();
      if (pid == 0) {
        write_file(dir + "/gc_" + attempt() + "_" + rank(), std::to_string(getpid()));
        for (int k = 0; k < 3000; ++k) usleep(100000);
        _exit(0);
      }
    } else if (act == "wait-file") {
      need(1);
      std::string path = a[i++];
      struct stat st;
      for (int k = 0; k < 20000 && stat(path.c_str(), &st) != 0; ++k) usleep(1000);
    } else if (act == "orphan-check") {
      int rc = orphan_check();
      if (rc != 0) return rc;
    } else if (act == "exit") {
      need(1);
      std::fflush(stdout);
      return std::atoi(a[i++].c_str());
    } else if (act == "signal") {
      need(1);
      int sig = std::atoi(a[i++].c_str());
      std::fflush(stdout);
      signal(sig, SIG_DFL);
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, sig);
      sigprocmask(SIG_UNBLOCK, &set, nullptr);
      raise(sig);
      return 98;  // not reached for fatal signals
    } else if (act == "signal-parent") {
      // As scancel does to a whole step: the agent gets a signal while its worker exits.
      need(1);
      kill(getppid(), std::atoi(a[i++].c_str()));
    } else if (act == "ignore-term") {
      signal(SIGTERM, SIG_IGN);
    } else if (act == "trap") {
      need(1);
      g_trap_path = a[i++] + "/sig_" + rank();
      sigemptyset(&g_trapped);
      for (int s : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) sigaddset(&g_trapped, s);
      sigprocmask(SIG_BLOCK, &g_trapped, nullptr);
      g_trapping = true;
    } else if (act == "trap-time") {
      need(1);
      g_trap_time_path = a[i++] + "/sigtime_" + rank();
      g_trap_time_tmp = g_trap_time_path + ".tmp";
      for (int s : {SIGTERM, SIGINT}) signal(s, on_trapped_time);
    } else if (act == "sleep") {
      need(1);
      sleep_seconds(std::atof(a[i++].c_str()));
    } else if (act == "error-file") {
      need(2);
      std::string msg = a[i++];
      std::string ts = a[i++];
      if (ts == "now") ts = std::to_string(std::time(nullptr));
      std::string file = env_or("TORCHELASTIC_ERROR_FILE", "");
      if (!file.empty()) {
        nlohmann::json record = {{"message",
                                  {{"message", msg},
                                   {"extraInfo",
                                    {{"py_callstack",
                                      "Traceback (most recent call last):\n  File \"worker.py\", "
                                      "line 1\n" +
                                          msg + "\n"},
                                     {"timestamp", ts}}}}}};
        write_file(file, to_json(record));
      }
    } else if (act == "flood") {
      need(1);
      long n = std::atol(a[i++].c_str());
      std::string r = rank();
      for (long k = 0; k < n; ++k) {
        std::printf("rank %s line %ld abcdefghijklmnopqrstuvwxyz0123456789\n", r.c_str(), k);
      }
      std::fflush(stdout);
    } else if (act == "print") {
      need(1);
      std::printf("%s\n", a[i++].c_str());
      std::fflush(stdout);
    } else if (act == "eprint") {
      need(1);
      std::fprintf(stderr, "%s\n", a[i++].c_str());
    } else if (act == "partial") {
      need(1);
      std::printf("%s", a[i++].c_str());
      std::fflush(stdout);
    } else if (act == "env") {
      need(1);
      nlohmann::json vars = nlohmann::json::object();
      for (char** e = environ; *e; ++e) {
        const char* eq = std::strchr(*e, '=');
        if (!eq) continue;
        vars[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
      }
      write_file(a[i++] + "/env_" + attempt() + "_" + rank() + ".json", to_json(vars));
    } else if (act == "envlog") {
      need(1);
      std::string line = "pid=" + std::to_string(::getpid());
      for (const char* k :
           {"RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"}) {
        line += std::string(" ") + k + "=" + env_or(k, "");
      }
      line += " MASTER=" + env_or("MASTER_ADDR", "") + ":" + env_or("MASTER_PORT", "") + "\n";
      if (std::FILE* f = std::fopen(a[i++].c_str(), "a")) {
        std::fputs(line.c_str(), f);
        std::fclose(f);
      }
    } else if (act == "store-check") {
      try {
        trun::store::TcpStoreOptions o;
        o.host = env_or("MASTER_ADDR", "127.0.0.1");
        o.port = static_cast<uint16_t>(std::atoi(env_or("MASTER_PORT", "0").c_str()));
        o.timeout = std::chrono::seconds(20);
        o.connect_timeout = std::chrono::seconds(20);
        auto tcp = std::make_shared<trun::store::TcpStore>(o);
        trun::store::PrefixStore store("/worker/attempt_" + attempt(), tcp);
        const std::string global_rank = env_or("RANK", "0");
        store.set("hello_" + global_rank, "from " + global_rank);
        int64_t arrived = store.add("arrived", 1);
        (void)arrived;
        int world = std::atoi(env_or("WORLD_SIZE", "1").c_str());
        std::vector<std::string> keys;
        for (int r = 0; r < world; ++r) keys.push_back("hello_" + std::to_string(r));
        store.wait(keys);
        auto values = store.multi_get(keys);
        for (int r = 0; r < world; ++r) {
          if (values[r] != "from " + std::to_string(r)) return 4;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "store-check failed: %s\n", e.what());
        return 4;
      }
    } else if (act == "on-rank") {
      need(1);
      if (a[i++] != rank()) skip_next();
    } else if (act == "on-attempt") {
      need(1);
      if (a[i++] != attempt()) skip_next();
    } else {
      std::fprintf(stderr, "trun_test_worker: unknown action %s\n", act.c_str());
      return 99;
    }
  }
  return 0;
}
