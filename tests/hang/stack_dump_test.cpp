// agent/stack_dump.h against real processes: tests/hang/stack_target.cpp (a main thread blocked
// in read, a "spinner" thread in user code, a "sleeper" thread in nanosleep) running, stopped
// with SIGSTOP, exited but not reaped, with a budget too small for any thread, and with a thread
// in uninterruptible sleep (a vfork parent) that ptrace cannot stop. This test is the target's
// parent, as the agent is its workers'. Every target (and its child) is ended by its pid
// (SIGKILL, waitpid); no timing is asserted, every wait is generous. Not a TSan test (no tsan
// label): the dumper is one thread, and under TSan the target has another thread and vfork is
// a fork.

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/stack_dump.h"

using namespace trun::agent;
using namespace std::chrono_literals;

namespace {

char state_of(const std::string& stat_path) {
  FILE* f = std::fopen(stat_path.c_str(), "r");
  if (f == nullptr) return '?';
  char buf[512] = {};
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const char* close = std::strrchr(buf, ')');
  return n > 0 && close != nullptr && close[1] == ' ' ? close[2] : '?';
}

bool thread_reaches(pid_t pid, int tid, char want, std::chrono::milliseconds timeout) {
  const std::string path =
      "/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat";
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (state_of(path) != want) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// /proc/<pid>/task: the main thread first, then by tid (as the dump lists them).
std::vector<int> thread_ids(pid_t pid) {
  std::vector<int> tids;
  DIR* dir = ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
  if (dir == nullptr) return tids;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') tids.push_back(std::atoi(e->d_name));
  }
  ::closedir(dir);
  std::sort(tids.begin(), tids.end());
  auto main_thread = std::find(tids.begin(), tids.end(), pid);
  if (main_thread != tids.end()) std::rotate(tids.begin(), main_thread, main_thread + 1);
  return tids;
}

// A running stack_target, with its stdin and stdout as pipes.
class Target {
 public:
  // `mode`: "" or "vfork" (stack_target.cpp).
  explicit Target(const std::string& mode = "") {
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    const std::string program = std::string(TRUN_BINARY_DIR) + "/tests/hang/stack_target";
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::execl(program.c_str(), program.c_str(), mode.empty() ? nullptr : mode.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    // "ready", and back in read() after printing it. A failure ends it here (the destructor of
    // an object whose constructor throws does not run).
    if (read_line(10s) != "ready" || !thread_reaches(pid_, pid_, 'S', 10s)) {
      end();
      FAIL("stack_target did not get ready");
    }
  }
  ~Target() { end(); }
  Target(const Target&) = delete;
  Target& operator=(const Target&) = delete;

  pid_t pid() const { return pid_; }

  // One line of its output, without the newline; "" on timeout or end of file.
  std::string read_line(std::chrono::milliseconds timeout) {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char c;
      if (::read(from_, &c, 1) != 1) return "";
      if (c == '\n') return line;
      line += c;
    }
  }

  // Sends "ping": the main thread answers "pong <spins>" with the spinner's count.
  unsigned long ping() {
    REQUIRE(::write(to_, "ping\n", 5) == 5);
    const std::string answer = read_line(10s);
    REQUIRE(answer.rfind("pong ", 0) == 0);
    return std::stoul(answer.substr(5));
  }

  // The spinner still spins: its count grows (polled, generously).
  bool spinning() {
    const unsigned long first = ping();
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
      if (ping() > first) return true;
    }
    return false;
  }

  // Closes its stdin: the main thread's read returns 0 and the process exits 0.
  void close_stdin() {
    ::close(to_);
    to_ = -1;
  }

  // The test reaps it itself.
  // Its exit status when it has exited (and is reaped now), else -1.
  int reap_if_exited() {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return -1;
    pid_ = -1;
    return status;
  }

  int wait_exit() {
    int status = -1;
    REQUIRE(::waitpid(pid_, &status, 0) == pid_);
    pid_ = -1;
    return status;
  }

 private:
  void end() {
    if (pid_ > 0) {
      // Its own children first (the "vfork" mode's child), which would outlive it.
      for (int tid : thread_ids(pid_)) {
        std::ifstream in("/proc/" + std::to_string(pid_) + "/task/" + std::to_string(tid) +
                         "/children");
        pid_t child = 0;
        while (in >> child) ::kill(child, SIGKILL);
      }
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
    to_ = from_ = -1;
  }

  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
};

char process_state(pid_t pid) { return state_of("/proc/" + std::to_string(pid) + "/stat"); }

// Every thread of `pid` in state `want` (e.g. 'T'), polled for up to `timeout`.
bool all_threads_reach(pid_t pid, char want, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool all = true;
    for (int tid : thread_ids(pid)) {
      const std::string path =
          "/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat";
      if (state_of(path) != want) all = false;
    }
    if (all) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
}

// The tid of the thread of `pid` named `name`, 0 if none.
int tid_named(pid_t pid, const std::string& name) {
  for (int tid : thread_ids(pid)) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/comm");
    std::string comm;
    if (std::getline(in, comm) && comm == name) return tid;
  }
  return 0;
}

// No thread of `pid` is traced (TracerPid 0 in each /proc/<pid>/task/<tid>/status).
bool no_thread_traced(pid_t pid) {
  for (int tid : thread_ids(pid)) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("TracerPid:", 0) == 0 && std::atoi(line.c_str() + 10) != 0) return false;
    }
  }
  return true;
}

const ThreadStack* thread_named(const ProcessStacks& s, const std::string& name) {
  for (const ThreadStack& t : s.threads) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

bool has_function(const ThreadStack& t, const std::string& function) {
  for (const StackFrame& f : t.frames) {
    if (f.function.find(function) != std::string::npos) return true;
  }
  return false;
}

// The three threads' stacks, each with its own function and not another's.
void check_target_stacks(const ProcessStacks& s, pid_t pid) {
  INFO(format_stacks(s));
  REQUIRE(s.error.empty());
  CHECK(s.pid == pid);
  REQUIRE(s.threads.size() == 3);
  CHECK(s.threads[0].tid == pid);
  std::vector<int> dumped;
  for (const ThreadStack& t : s.threads) {
    CHECK(t.error.empty());
    REQUIRE_FALSE(t.frames.empty());
    dumped.push_back(t.tid);
  }
  CHECK(dumped == thread_ids(pid));

  const ThreadStack& main_thread = s.threads[0];
  CHECK(has_function(main_thread, "stack_target_read_here"));
  CHECK(has_function(main_thread, "main"));
  CHECK_FALSE(has_function(main_thread, "stack_target_spin_here"));

  const ThreadStack* spinner = thread_named(s, "spinner");
  REQUIRE(spinner != nullptr);
  CHECK(has_function(*spinner, "stack_target_spin_here"));
  CHECK_FALSE(has_function(*spinner, "stack_target_sleep_here"));

  // Blocked in nanosleep: frame 0 is libc's system call wrapper, the caller shows above it.
  const ThreadStack* sleeper = thread_named(s, "sleeper");
  REQUIRE(sleeper != nullptr);
  CHECK(has_function(*sleeper, "stack_target_sleep_here"));
  CHECK_FALSE(has_function(*sleeper, "stack_target_spin_here"));
  REQUIRE_FALSE(sleeper->frames.empty());
  CHECK(sleeper->frames[0].module.find("libc") != std::string::npos);

  // Modules come from /proc/<pid>/maps; frames of the target itself name its executable.
  bool target_module = false;
  for (const StackFrame& f : spinner->frames) {
    if (f.function.find("stack_target_spin_here") != std::string::npos) {
      target_module = f.module.find("stack_target") != std::string::npos;
    }
  }
  CHECK(target_module);
}

}  // namespace

TEST_CASE("stack dump: a running process's every thread, and it keeps running", "[stack_dump]") {
  Target target;
  const unsigned long before = target.ping();
  // Back in read(): it was printing its answer a moment ago.
  REQUIRE(thread_reaches(target.pid(), target.pid(), 'S', 10s));
  const ProcessStacks s = dump_native_stacks(target.pid());
  check_target_stacks(s, target.pid());
  CHECK_FALSE(s.was_stopped);
  for (const ThreadStack& t : s.threads) CHECK(t.state != 'T');

  const std::string text = format_stacks(s);
  CHECK(text.find("thread " + std::to_string(target.pid()) + " (stack_target) state S:") !=
        std::string::npos);
  CHECK(text.find("  #0 0x") != std::string::npos);
  CHECK(s.threads[0].frames[0].function.find("read") != std::string::npos);
  CHECK(text.find("stack_target_spin_here+0x") != std::string::npos);

  // Still running: it answers, and the spinner spins on.
  const char after = process_state(target.pid());
  CHECK(after != 'T');
  CHECK(after != 't');
  CHECK(target.ping() >= before);
  CHECK(target.spinning());

  // A second dump of the same process works as well.
  check_target_stacks(dump_native_stacks(target.pid()), target.pid());
  CHECK(no_thread_traced(target.pid()));
}

TEST_CASE("stack dump: a process stopped with SIGSTOP is dumped and stays stopped",
          "[stack_dump]") {
  Target target;
  REQUIRE(::kill(target.pid(), SIGSTOP) == 0);
  REQUIRE(all_threads_reach(target.pid(), 'T', 10s));

  const ProcessStacks s = dump_native_stacks(target.pid());
  check_target_stacks(s, target.pid());
  CHECK(s.was_stopped);
  for (const ThreadStack& t : s.threads) CHECK(t.state == 'T');
  CHECK(format_stacks(s).find("(stopped)") != std::string::npos);

  // Still stopped, and stays so (each thread re-enters the group stop when detached).
  CHECK(all_threads_reach(target.pid(), 'T', 10s));
  std::this_thread::sleep_for(100ms);
  CHECK(all_threads_reach(target.pid(), 'T', 0ms));

  REQUIRE(::kill(target.pid(), SIGCONT) == 0);
  CHECK(target.spinning());
  CHECK(no_thread_traced(target.pid()));
}

TEST_CASE(
    "stack dump: an exited process that is not reaped gives an error, and its parent "
    "still reaps it",
    "[stack_dump]") {
  Target target;
  const pid_t pid = target.pid();
  target.close_stdin();
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (process_state(pid) != 'Z' && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  REQUIRE(process_state(pid) == 'Z');

  ProcessStacks s;
  REQUIRE_NOTHROW(s = dump_native_stacks(pid));
  CHECK_FALSE(s.error.empty());
  CHECK(s.threads.empty());
  CHECK(format_stacks(s).find("error: ") != std::string::npos);

  // The dumper took nothing: the exit status is still there for the parent.
  const int status = target.wait_exit();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);

  // Gone altogether, and pids that cannot be.
  s = dump_native_stacks(pid);
  CHECK(s.error == "no such process");
  CHECK_FALSE(dump_native_stacks(0).error.empty());
  CHECK_FALSE(dump_native_stacks(-1).error.empty());
}

TEST_CASE("stack dump: the time budget and the frame limit bound the dump", "[stack_dump]") {
  Target target;
  {
    StackDumpOptions none;
    none.budget = 0ms;
    const ProcessStacks s = dump_native_stacks(target.pid(), none);
    INFO(format_stacks(s));
    CHECK(s.error.empty());
    REQUIRE(s.threads.size() == 3);
    for (const ThreadStack& t : s.threads) {
      CHECK(t.error == "not dumped: time budget");
      CHECK(t.frames.empty());
    }
  }
  {
    // 1 ms: some threads, or none, or part of one; each is either dumped or says why not.
    StackDumpOptions tiny;
    tiny.budget = 1ms;
    const ProcessStacks s = dump_native_stacks(target.pid(), tiny);
    INFO(format_stacks(s));
    REQUIRE(s.threads.size() == 3);
    for (const ThreadStack& t : s.threads) CHECK((!t.frames.empty() || !t.error.empty()));
    CHECK(s.elapsed_ms < 5000);  // generous: one unwind step past the budget
  }
  {
    StackDumpOptions short_stacks;
    short_stacks.max_frames = 2;
    const ProcessStacks s = dump_native_stacks(target.pid(), short_stacks);
    INFO(format_stacks(s));
    REQUIRE(s.threads.size() == 3);
    for (const ThreadStack& t : s.threads) {
      CHECK(t.error.empty());
      CHECK(t.frames.size() <= 2);
    }
    CHECK(s.threads[0].truncated);  // read, stack_target_read_here, main, ...
  }
  {
    StackDumpOptions one_thread;
    one_thread.max_threads = 1;
    const ProcessStacks s = dump_native_stacks(target.pid(), one_thread);
    INFO(format_stacks(s));
    REQUIRE(s.threads.size() == 1);
    CHECK(s.threads[0].tid == target.pid());
    CHECK(s.threads_omitted == 2);
  }

  // After all of that, it still runs.
  CHECK(target.spinning());
  CHECK(no_thread_traced(target.pid()));
}

namespace {

// A stack_target "vfork" whose "vforker" thread waits for its vfork child in uninterruptible
// sleep (state D), dumped with a 100 ms stop timeout: that thread is reported and left held.
struct HeldVforker {
  Target target{"vfork"};
  int vforker = 0;
  pid_t vfork_child = 0;
  ProcessStacks stacks;

  HeldVforker() {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while ((vforker = tid_named(target.pid(), "vforker")) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
    REQUIRE(vforker != 0);
    REQUIRE(thread_reaches(target.pid(), vforker, 'D', 10s));
    std::ifstream in("/proc/" + std::to_string(target.pid()) + "/task/" + std::to_string(vforker) +
                     "/children");
    in >> vfork_child;
    REQUIRE(vfork_child > 0);
    StackDumpOptions options;
    options.thread_stop_timeout = 100ms;
    stacks = dump_native_stacks(target.pid(), options);
  }
  ~HeldVforker() {
    if (vfork_child > 0) ::kill(vfork_child, SIGKILL);  // the target reaps it (or init does)
  }
};

}  // namespace

TEST_CASE(
    "stack dump: a thread in uninterruptible sleep is reported, the others are dumped, "
    "and it is not left attached",
    "[stack_dump]") {
  HeldVforker h;
  {
    INFO(format_stacks(h.stacks));
    REQUIRE(h.stacks.threads.size() == 4);
    for (const ThreadStack& t : h.stacks.threads) {
      if (t.tid == h.vforker) {
        CHECK(t.state == 'D');
        CHECK(t.error.rfind("did not stop within", 0) == 0);
        CHECK(t.frames.empty());
      } else {
        CHECK(t.error.empty());
        CHECK_FALSE(t.frames.empty());
      }
    }
    REQUIRE(thread_named(h.stacks, "spinner") != nullptr);
    CHECK(has_function(*thread_named(h.stacks, "spinner"), "stack_target_spin_here"));
    CHECK(has_function(h.stacks.threads[0], "stack_target_read_here"));
  }
  CHECK(no_thread_traced(h.target.pid()));

  // The vfork child dies: the vforker wakes and goes on to its nanosleep (not to a ptrace stop),
  // and a dump now gets it too.
  REQUIRE(::kill(h.vfork_child, SIGKILL) == 0);
  h.vfork_child = 0;
  REQUIRE(thread_reaches(h.target.pid(), h.vforker, 'S', 10s));
  CHECK(h.target.spinning());
  const ProcessStacks s = dump_native_stacks(h.target.pid());
  INFO(format_stacks(s));
  for (const ThreadStack& t : s.threads) CHECK(t.error.empty());
  REQUIRE(thread_named(s, "vforker") != nullptr);
  CHECK(has_function(*thread_named(s, "vforker"), "stack_target_vfork_here"));
  CHECK(no_thread_traced(h.target.pid()));
}

TEST_CASE(
    "stack dump: a process killed after a dump that could not stop one of its threads "
    "still reports its exit to its parent",
    "[stack_dump]") {
  HeldVforker h;
  REQUIRE(h.stacks.error.empty());
  REQUIRE(thread_named(h.stacks, "vforker") != nullptr);
  REQUIRE_FALSE(thread_named(h.stacks, "vforker")->error.empty());
  // Had the thread stayed traced, it would die into a traced zombie that holds back the
  // process's exit report until its tracer waits for it.
  REQUIRE(::kill(h.target.pid(), SIGKILL) == 0);
  int status = -1;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((status = h.target.reap_if_exited()) == -1 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  REQUIRE(status != -1);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
}
