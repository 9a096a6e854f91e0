// agent/file_timer_server.h: PyTorch's watchdog protocol over a real FIFO, with real child
// processes as the workers. Every child is ended by its pid; every FIFO is in a temporary
// directory removed at the end.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "agent/file_timer_server.h"
#include "agent/worker_env.h"

using namespace trun::agent;

namespace {

namespace fs = std::filesystem;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Polls `pred` every 2 ms until it holds or `timeout` passes.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

struct ScratchDir {
  ScratchDir() {
    char tmpl[] = "/tmp/trun-timer-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

// A worker stand-in: /bin/sleep 60, its own child, reaped and (if still alive) killed by pid.
struct Sleeper {
  // Returns once the child has exec'd (its end of a close-on-exec pipe closes): a signal sent
  // before would reach a copy of this test, with Catch's handlers. `ignored`: a signal the sleep
  // ignores (the disposition survives the exec), 0 for none.
  explicit Sleeper(int ignored = 0) {
    int p[2];
    REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
    pid = ::fork();
    if (pid == 0) {
      if (ignored > 0) ::signal(ignored, SIG_IGN);
      ::close(p[0]);
      ::execl("/bin/sleep", "sleep", "60", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(p[1]);
    char c;
    while (::read(p[0], &c, 1) < 0 && errno == EINTR) {
    }
    ::close(p[0]);
    REQUIRE(pid > 0);
  }
  ~Sleeper() {
    if (!reaped) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
  }
  // Reaps it if it has exited; true once it has. Records the moment it was seen dead.
  bool exited() {
    if (!reaped && ::waitpid(pid, &status, WNOHANG) == pid) {
      reaped = true;
      died_at = unix_now();
    }
    return reaped;
  }
  int term_signal() const { return reaped && WIFSIGNALED(status) ? WTERMSIG(status) : 0; }
  // True once it has exited, without reaping it: it stays a zombie.
  bool dead_unreaped() const {
    siginfo_t info{};
    return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
           info.si_pid == pid;
  }

  pid_t pid = -1;
  int status = 0;
  bool reaped = false;
  double died_at = 0;
};

// What the server reported, by kind.
struct Reports {
  std::mutex mu;
  std::vector<std::string> warnings;
  std::vector<std::string> infos;
  size_t count_warnings(const std::string& needle) {
    std::lock_guard<std::mutex> lock(mu);
    size_t n = 0;
    for (const auto& w : warnings) n += w.find(needle) != std::string::npos;
    return n;
  }
  std::string all_infos() {
    std::lock_guard<std::mutex> lock(mu);
    std::string out;
    for (const auto& i : infos) out += i + "\n";
    return out;
  }
};

FileTimerOptions options(const std::string& path, Reports& r) {
  FileTimerOptions o;
  o.path = path;
  o.warn = [&r](const std::string& s) {
    std::lock_guard<std::mutex> lock(r.mu);
    r.warnings.push_back(s);
  };
  o.info = [&r](const std::string& s) {
    std::lock_guard<std::mutex> lock(r.mu);
    r.infos.push_back(s);
  };
  return o;
}

// One write of `text` to the FIFO, as FileTimerClient does (non-blocking open, then a write).
void send(const std::string& fifo, const std::string& text) {
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(fd >= 0);
  // Blocking writes from here: a record longer than the pipe waits for the server to read.
  ::fcntl(fd, F_SETFL, 0);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    REQUIRE(n > 0);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

std::string request(pid_t pid, const std::string& scope, double expires, int sig) {
  char num[64];
  std::snprintf(num, sizeof num, "%.6f", expires);
  return "{\"version\": 1, \"pid\": " + std::to_string(pid) + ", \"scope_id\": \"" + scope +
         "\", \"expiration_time\": " + num + ", \"signal\": " + std::to_string(sig) + "}\n";
}

// `key`'s value in a worker's environment built from `base`, or "(unset)".
std::string env_value(const EnvMap& base, const LaunchConfig& config, const AttemptEnv& attempt,
                      const std::string& key) {
  for (const auto& kv : worker_env(base, config, attempt, WorkerIdentity{})) {
    if (kv.rfind(key + "=", 0) == 0) return kv.substr(key.size() + 1);
  }
  return "(unset)";
}

// The common set-up: a server on a FIFO in a fresh directory, serving one sleeping worker.
struct Served {
  Served() : fifo(dir / "timer"), server(options(fifo, reports)) {
    server.set_workers({worker.pid});
  }
  ScratchDir dir;
  Reports reports;
  const std::string fifo;
  FileTimerServer server;
  Sleeper worker;
};

}  // namespace

TEST_CASE("file_timer_setting: enabled only by exactly 1, the path as given", "[file_timer]") {
  CHECK_FALSE(file_timer_setting({}).enabled);
  CHECK_FALSE(file_timer_setting({{"TORCHELASTIC_ENABLE_FILE_TIMER", "true"}}).enabled);
  CHECK_FALSE(file_timer_setting({{"TORCHELASTIC_ENABLE_FILE_TIMER", "0"}}).enabled);
  const auto s = file_timer_setting(
      {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", "/x/y"}});
  CHECK(s.enabled);
  CHECK(s.path == "/x/y");
  CHECK(file_timer_setting({{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}}).path.empty());
}

TEST_CASE("workers get TORCHELASTIC_TIMER_FILE when trun serves one, else as trun inherited it",
          "[file_timer][worker_env]") {
  LaunchConfig config;
  AttemptEnv attempt;
  auto timer_file = [&](const EnvMap& base) {
    return env_value(base, config, attempt, "TORCHELASTIC_TIMER_FILE");
  };
  CHECK(timer_file({}) == "(unset)");
  CHECK(timer_file({{"TORCHELASTIC_TIMER_FILE", "/inherited"}}) == "/inherited");
  attempt.timer_file = "/tmp/watchdog_timer_x";
  CHECK(timer_file({}) == "/tmp/watchdog_timer_x");
  CHECK(timer_file({{"TORCHELASTIC_TIMER_FILE", "/inherited"}}) == "/tmp/watchdog_timer_x");
}

TEST_CASE("a generated timer path is a fresh watchdog_timer_<uuid4> under TMPDIR or /tmp",
          "[file_timer]") {
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  ::setenv("TMPDIR", "/var/tmp/", 1);
  const std::string a = generated_timer_path();
  ::setenv("TMPDIR", "relative", 1);
  const std::string b = generated_timer_path();
  if (old) {
    ::setenv("TMPDIR", saved.c_str(), 1);
  } else {
    ::unsetenv("TMPDIR");
  }
  CHECK(a.rfind("/var/tmp/watchdog_timer_", 0) == 0);
  CHECK(b.rfind("/tmp/watchdog_timer_", 0) == 0);
  const std::string uuid = a.substr(a.rfind('_') + 1);
  REQUIRE(uuid.size() == 36);
  CHECK(uuid[8] == '-');
  CHECK(uuid[14] == '4');
  CHECK(a.substr(a.rfind('_')) != b.substr(b.rfind('_')));
}

TEST_CASE_METHOD(Served, "a worker whose timer expires is killed within 1 s of the expiration time",
                 "[file_timer]") {
  const double deadline = unix_now() + 0.5;
  send(fifo, request(worker.pid, "train.py#12", deadline, SIGKILL));
  REQUIRE(eventually([&] { return worker.exited(); }));
  CHECK(worker.term_signal() == SIGKILL);
  const double late = worker.died_at - deadline;
  WARN("killed " << late << " s after the expiration time");
  CHECK(late >= 0);
  CHECK(late < 1.0);
  // Counted and forgotten just after the signal went out: the death may be seen first.
  CHECK(eventually([&] { return server.signals_sent() == 1; }));
  CHECK(eventually([&] { return server.active_timers() == 0; }));
  // Reported after the server lets go of its lock: it may come a moment after the death.
  CHECK(eventually([&] { return reports.count_warnings("sent SIGKILL") == 1; }));
  CHECK(reports.count_warnings("watchdog timer 'train.py#12' of worker pid " +
                               std::to_string(worker.pid)) == 1);
  CHECK(reports.warnings.size() == 1);
}

TEST_CASE(
    "with a dump signal, an expired SIGKILL timer sends it first and SIGKILL only to a worker "
    "that outlives it",
    "[file_timer][dump]") {
  ScratchDir dir;
  Reports reports;
  FileTimerOptions o = options(dir / "timer", reports);
  o.dump_signal = SIGABRT;
  o.dump_wait = std::chrono::milliseconds(300);
  FileTimerServer server(o);
  SECTION("a worker that dies of the dump signal (as Python's faulthandler makes it)") {
    Sleeper worker;
    server.set_workers({worker.pid});
    const double deadline = unix_now() + 0.3;
    send(dir / "timer", request(worker.pid, "loader", deadline, SIGKILL));
    // Left a zombie until past the follow-up (an agent busy elsewhere reaps it late): a signal to
    // it would still be "sent", and must not be.
    REQUIRE(eventually([&] { return worker.dead_unreaped(); }));
    const double dead_at = unix_now();
    CHECK(dead_at - deadline >= 0);
    CHECK(dead_at - deadline < 1.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(600));  // past the follow-up
    REQUIRE(worker.exited());
    CHECK(worker.term_signal() == SIGABRT);
    CHECK(reports.count_warnings(
              "sending SIGABRT (its Python stacks follow on its stderr), and SIGKILL "
              "in 0.3 s unless it has exited") == 1);
    CHECK(reports.count_warnings("sent SIGKILL") == 0);
    CHECK(server.signals_sent() == 1);
  }
  SECTION("a worker that ignores it is SIGKILLed after the wait") {
    Sleeper worker(SIGABRT);
    server.set_workers({worker.pid});
    const double deadline = unix_now() + 0.3;
    send(dir / "timer", request(worker.pid, "loader", deadline, SIGKILL));
    REQUIRE(eventually([&] { return worker.exited(); }));
    CHECK(worker.term_signal() == SIGKILL);
    const double late = worker.died_at - deadline;
    WARN("killed " << late << " s after the expiration time (0.3 s of them the dump's wait)");
    CHECK(late >= 0.3);
    CHECK(late < 1.3);
    CHECK(eventually([&] {
      return reports.count_warnings("sent SIGKILL (after its stacks were asked for)") == 1;
    }));
    CHECK(server.signals_sent() == 2);
  }
  SECTION("a timer with a catchable signal gets that signal alone") {
    Sleeper worker;
    server.set_workers({worker.pid});
    send(dir / "timer", request(worker.pid, "eval", unix_now() + 0.2, SIGTERM));
    REQUIRE(eventually([&] { return worker.exited(); }));
    CHECK(worker.term_signal() == SIGTERM);
    CHECK(eventually([&] { return reports.count_warnings("sent SIGTERM") == 1; }));
    CHECK(reports.count_warnings("SIGABRT") == 0);
  }
  SECTION("a new group forgets a pending follow-up") {
    Sleeper worker(SIGABRT);
    server.set_workers({worker.pid});
    send(dir / "timer", request(worker.pid, "loader", unix_now() + 0.1, SIGKILL));
    REQUIRE(eventually([&] { return reports.count_warnings("sending SIGABRT") == 1; }));
    server.clear_workers();
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    CHECK_FALSE(worker.exited());
    CHECK(reports.count_warnings("sent SIGKILL") == 0);
  }
}

TEST_CASE("Python workers under the watchdog get PYTHONFAULTHANDLER=1 unless it is set",
          "[file_timer][worker_env]") {
  LaunchConfig config;
  AttemptEnv attempt;
  auto handler = [&](const EnvMap& base) {
    return env_value(base, config, attempt, "PYTHONFAULTHANDLER");
  };
  CHECK(handler({}) == "(unset)");
  attempt.python_fault_handler = true;
  CHECK(handler({}) == "1");
  CHECK(handler({{"PYTHONFAULTHANDLER", ""}}) == "");  // off, as the user asked
  CHECK(handler({{"PYTHONFAULTHANDLER", "yes"}}) == "yes");
}

TEST_CASE_METHOD(Served, "a worker flooding the FIFO delays neither an expiry nor other requests",
                 "[file_timer]") {
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> written{0};
  // Junk lines as fast as the server reads them, for as long as the case runs (bounded: 20 s),
  // in writes of whole lines up to PIPE_BUF, which the pipe keeps whole: a longer write may be
  // split by another writer's, which then joins a junk line (so it is with torchrun too).
  std::thread flood([&] {
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    const std::string junk = std::string(1000, 'x') + "\n";
    std::string chunk;
    for (int i = 0; i < 4; ++i) chunk += junk;  // 4004 bytes
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!stop.load() && std::chrono::steady_clock::now() < end) {
      const ssize_t n = ::write(fd, chunk.data(), chunk.size());
      if (n > 0) written += static_cast<uint64_t>(n);
    }
    ::close(fd);
  });
  REQUIRE(eventually([&] { return written.load() > 1000000; }));
  const double deadline = unix_now() + 0.5;
  send(fifo, request(worker.pid, "under-flood", deadline, SIGKILL));
  const bool died = eventually([&] { return worker.exited(); });
  stop = true;
  flood.join();
  REQUIRE(died);
  CHECK(worker.term_signal() == SIGKILL);
  const double late = worker.died_at - deadline;
  WARN("killed " << late << " s after the expiration time, " << written.load() / 1000000
                 << " MB of junk written");
  CHECK(late >= 0);
  CHECK(late < 1.0);
  CHECK(server.refused(TimerRefusal::kNotJson) > 1000);
  CHECK(eventually([&] { return reports.count_warnings("(not a JSON object)") == 1; }));
}

TEST_CASE_METHOD(Served, "a timer released before it expires kills nothing", "[file_timer]") {
  send(fifo, request(worker.pid, "step", unix_now() + 0.4, SIGKILL));
  send(fifo, request(worker.pid, "step", -1, 0));  // FileTimerClient.release
  REQUIRE(eventually([&] { return server.accepted() == 2; }));
  CHECK(server.active_timers() == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(900));
  CHECK_FALSE(worker.exited());
  CHECK(server.signals_sent() == 0);
}

TEST_CASE_METHOD(Served,
                 "of a worker's expired timers, the earliest with a signal gives the signal",
                 "[file_timer]") {
  // Three timers, all expired, in one write: read in one pass, then fired together.
  const double now = unix_now();
  send(fifo, request(worker.pid, "no-signal", now - 0.3, 0) +
                 request(worker.pid, "term", now - 0.2, SIGTERM) +
                 request(worker.pid, "kill", now - 0.1, SIGKILL));
  REQUIRE(eventually([&] { return worker.exited(); }));
  CHECK(worker.term_signal() == SIGTERM);
  CHECK(eventually([&] { return server.active_timers() == 0; }));
}

TEST_CASE_METHOD(Served,
                 "an expired timer without a signal kills nothing and clears the worker's timers",
                 "[file_timer]") {
  // torchrun's rule: every timer of a pid with an expired timer is forgotten, signal or not.
  const double now = unix_now();
  send(fifo, request(worker.pid, "no-signal", now + 0.2, 0));
  send(fifo, request(worker.pid, "kill", now + 0.6, SIGKILL));
  REQUIRE(eventually([&] { return server.accepted() == 2; }));
  REQUIRE(eventually([&] { return server.active_timers() == 0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  CHECK_FALSE(worker.exited());
  CHECK(server.signals_sent() == 0);
  CHECK(reports.all_infos().find("names no signal") != std::string::npos);
}

TEST_CASE("bad requests are refused and reported once per kind, and the server goes on",
          "[file_timer]") {
  ScratchDir dir;
  Reports reports;
  const std::string fifo = dir / "timer";
  FileTimerOptions o = options(fifo, reports);
  o.max_timers_per_worker = 2;
  FileTimerServer server(o);
  Sleeper worker;
  server.set_workers({worker.pid});
  const std::string pid = std::to_string(worker.pid);
  const double later = unix_now() + 3600;
  const std::vector<std::pair<TimerRefusal, std::string>> bad = {
      {TimerRefusal::kNotJson, "hello\n"},
      {TimerRefusal::kNotJson, "[1, 2, 3]\n"},
      {TimerRefusal::kNotJson, "{\"version\": 1, \"pid\": \xff}\n"},
      {TimerRefusal::kNotJson, std::string(30000, '[') + std::string(30000, ']') + "\n"},
      {TimerRefusal::kOversized, std::string(70000, ' ') + "{}\n"},
      {TimerRefusal::kOversized, request(worker.pid, std::string(5000, 's'), later, 9)},
      {TimerRefusal::kWrongType, "{\"version\": 1, \"pid\": \"" + pid +
                                     "\", \"scope_id\": \"x\", \"expiration_time\": 1, "
                                     "\"signal\": 9}\n"},
      {TimerRefusal::kWrongType, "{\"version\": 1, \"pid\": " + pid + ", \"scope_id\": \"x\"}\n"},
      {TimerRefusal::kWrongType, request(-1, "x", later, 9)},
      {TimerRefusal::kWrongType, request(0, "x", later, 9)},
      {TimerRefusal::kUnknownVersion,
       "{\"version\": 2, \"pid\": " + pid +
           ", \"scope_id\": \"x\", \"expiration_time\": 1, \"signal\": 9}\n"},
      {TimerRefusal::kForeignPid, request(::getpid(), "x", unix_now(), 9)},
      {TimerRefusal::kForeignPid, request(1, "x", unix_now(), 9)},
      {TimerRefusal::kBadSignal, request(worker.pid, "x", unix_now(), SIGSTOP)},
      {TimerRefusal::kBadSignal, request(worker.pid, "x", unix_now(), 4096)},
  };
  for (const auto& [kind, text] : bad) {
    INFO(refusal_name(kind) << ": " << text.substr(0, 120));
    const uint64_t before = server.refused(kind);
    send(fifo, text);
    CHECK(eventually([&] { return server.refused(kind) == before + 1; }));
  }
  // Two timers are the limit here: a third scope is refused, re-arming one is not.
  send(fifo, request(worker.pid, "a", later, 9));
  send(fifo, request(worker.pid, "b", later, 9));
  send(fifo, request(worker.pid, "c", later, 9));
  send(fifo, request(worker.pid, "a", later + 1, 9));
  CHECK(eventually([&] { return server.refused(TimerRefusal::kTooManyTimers) == 1; }));
  CHECK(eventually([&] { return server.accepted() == 3; }));
  CHECK(server.active_timers() == 2);
  // A record cut short by no newline joins the next one, which is then refused; the one after
  // it is read as it should.
  send(fifo, "{\"version\": 1");
  send(fifo, "\n");
  CHECK(eventually([&] { return server.refused(TimerRefusal::kNotJson) == 5; }));

  // One report per kind, however many requests of it were refused.
  for (int k = 0; k < static_cast<int>(TimerRefusal::kCount); ++k) {
    const std::string name = refusal_name(static_cast<TimerRefusal>(k));
    INFO(name);
    CHECK(eventually([&] { return reports.count_warnings("(" + name + ")") == 1; }));
  }
  CHECK_FALSE(worker.exited());
  CHECK(server.signals_sent() == 0);

  // Still serving.
  send(fifo, request(worker.pid, "a", unix_now() + 0.1, SIGKILL));
  REQUIRE(eventually([&] { return worker.exited(); }));
  CHECK(worker.term_signal() == SIGKILL);
}

TEST_CASE("a request is refused while its pid is not a worker and honoured once it is",
          "[file_timer]") {
  ScratchDir dir;
  Reports reports;
  const std::string fifo = dir / "timer";
  FileTimerServer server(options(fifo, reports));
  Sleeper old_worker;
  server.set_workers({old_worker.pid});
  send(fifo, request(old_worker.pid, "x", unix_now() + 0.3, SIGKILL));
  REQUIRE(eventually([&] { return server.active_timers() == 1; }));
  // The group restarts: the old timer is gone with its group.
  server.clear_workers();
  CHECK(server.active_timers() == 0);
  Sleeper new_worker;
  // The new worker writes before the agent knows its pid: the request waits in the pipe.
  send(fifo, request(new_worker.pid, "y", unix_now() + 0.3, SIGKILL));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK_FALSE(old_worker.exited());
  CHECK(server.refused(TimerRefusal::kForeignPid) == 0);
  server.set_workers({new_worker.pid});
  REQUIRE(eventually([&] { return new_worker.exited(); }));
  CHECK(new_worker.term_signal() == SIGKILL);
  CHECK_FALSE(old_worker.exited());
  // The old worker is foreign now.
  send(fifo, request(old_worker.pid, "x", unix_now(), SIGKILL));
  REQUIRE(eventually([&] { return server.refused(TimerRefusal::kForeignPid) == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_FALSE(old_worker.exited());
}

TEST_CASE("a worker replaced alone takes its predecessor's place, the others keep their timers",
          "[file_timer][resilient]") {
  ScratchDir dir;
  Reports reports;
  const std::string fifo = dir / "timer";
  FileTimerServer server(options(fifo, reports));
  Sleeper failed, survivor;
  server.set_workers({failed.pid, survivor.pid});
  send(fifo, request(failed.pid, "x", unix_now() + 60, SIGKILL));
  send(fifo, request(survivor.pid, "y", unix_now() + 60, SIGKILL));
  REQUIRE(eventually([&] { return server.active_timers() == 2; }));
  ::kill(failed.pid, SIGKILL);
  REQUIRE(eventually([&] { return failed.exited(); }));
  Sleeper replacement;
  server.replace_worker(failed.pid, replacement.pid);
  CHECK(server.active_timers() == 1);  // the survivor's
  send(fifo, request(replacement.pid, "z", unix_now() + 0.3, SIGKILL));
  REQUIRE(eventually([&] { return replacement.exited(); }));
  CHECK(replacement.term_signal() == SIGKILL);
  CHECK_FALSE(survivor.exited());
  CHECK(eventually([&] { return server.active_timers() == 1; }));  // forgotten after the kill
  CHECK(server.refused(TimerRefusal::kForeignPid) == 0);
}

TEST_CASE_METHOD(Served, "a worker that has exited is not signalled, even when its timer expires",
                 "[file_timer]") {
  send(fifo, request(worker.pid, "x", unix_now() + 0.3, SIGKILL));
  REQUIRE(eventually([&] { return server.active_timers() == 1; }));
  ::kill(worker.pid, SIGTERM);
  REQUIRE(eventually([&] { return worker.exited(); }));  // reaped: its pid may be reused
  REQUIRE(eventually([&] { return server.active_timers() == 0; }));
  // The server reports after it lets go of its lock, so the line may come a moment after the
  // timer is gone (checking it at once failed a CI run).
  CHECK(eventually(
      [&] { return reports.all_infos().find("has already exited") != std::string::npos; }));
  CHECK(server.signals_sent() == 0);
}

TEST_CASE("the FIFO is made with mode 0600 and removed at the end", "[file_timer]") {
  ScratchDir dir;
  Reports reports;
  const std::string fifo = dir / "timer";
  const mode_t old_mask = ::umask(0277);  // would leave the owner no write bit
  {
    FileTimerServer server(options(fifo, reports));
    ::umask(old_mask);
    struct stat st;
    REQUIRE(::lstat(fifo.c_str(), &st) == 0);
    CHECK(S_ISFIFO(st.st_mode));
    CHECK((st.st_mode & 07777) == 0600);
    CHECK(server.path() == fifo);
  }
  ::umask(old_mask);
  CHECK_FALSE(fs::exists(fs::symlink_status(fifo)));
}

TEST_CASE("what replaced the FIFO is not removed at the end", "[file_timer]") {
  ScratchDir dir;
  Reports reports;
  const std::string fifo = dir / "timer";
  {
    FileTimerServer server(options(fifo, reports));
    REQUIRE(::unlink(fifo.c_str()) == 0);
    std::ofstream(fifo) << "someone else's\n";
  }
  std::ifstream in(fifo);
  std::string line;
  CHECK((std::getline(in, line) && line == "someone else's"));
}

TEST_CASE("a symbolic link, a file that is not a FIFO and a FIFO in use are refused",
          "[file_timer]") {
  ScratchDir dir;
  Reports reports;
  const std::string target = dir / "target";
  std::ofstream(target) << "keep\n";
  const std::string link = dir / "link";
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  CHECK_THROWS_WITH(FileTimerServer(options(link, reports)), Catch::Contains("is a symbolic link"));
  const std::string dangling = dir / "dangling";
  REQUIRE(::symlink((dir / "nowhere").c_str(), dangling.c_str()) == 0);
  CHECK_THROWS_WITH(FileTimerServer(options(dangling, reports)),
                    Catch::Contains("is a symbolic link"));
  CHECK_FALSE(fs::exists(dir / "nowhere"));
  CHECK(fs::is_symlink(link));
  CHECK(fs::is_regular_file(fs::symlink_status(target)));

  CHECK_THROWS_WITH(FileTimerServer(options(target, reports)),
                    Catch::Contains("exists and is not a FIFO"));
  CHECK(fs::is_regular_file(fs::symlink_status(target)));
  CHECK_THROWS_WITH(FileTimerServer(options(dir.path, reports)),
                    Catch::Contains("exists and is not a FIFO"));

  const std::string fifo = dir / "timer";
  FileTimerServer live(options(fifo, reports));
  CHECK_THROWS_WITH(FileTimerServer(options(fifo, reports)), Catch::Contains("is in use"));
  CHECK(fs::is_fifo(fs::symlink_status(fifo)));  // the live server's FIFO is untouched
}

TEST_CASE("a FIFO left behind by an earlier run is replaced", "[file_timer]") {
  ScratchDir dir;
  Reports reports;
  const std::string fifo = dir / "timer";
  const mode_t old_mask = ::umask(0);
  const int made = ::mkfifo(fifo.c_str(), 0644);
  ::umask(old_mask);
  REQUIRE(made == 0);
  FileTimerServer server(options(fifo, reports));
  struct stat now;
  REQUIRE(::lstat(fifo.c_str(), &now) == 0);
  CHECK(S_ISFIFO(now.st_mode));
  CHECK((now.st_mode & 07777) == 0600);  // made anew (the old one was 0644)
}
