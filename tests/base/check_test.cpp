// TRUN_CHECK (base/check.h): a failed invariant aborts the process with file:line, the
// condition, the values and the message on stderr; a passing one evaluates nothing extra.
#include "base/check.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <functional>
#include <string>

using Catch::Contains;

namespace {

struct Death {
  bool signaled = false;
  int signal = 0;
  int exit_code = -1;
  std::string stderr_text;
};

// Runs `fn` in a forked child with stderr captured; reports how the child ended.
Death run_in_child(const std::function<void()>& fn) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[1]);
    ::signal(SIGABRT, SIG_DFL);  // not Catch's fatal-signal reporter
    struct rlimit no_core = {0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    fn();
    ::_exit(0);
  }
  ::close(fds[1]);
  Death d;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) d.stderr_text.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  d.signaled = WIFSIGNALED(status);
  if (d.signaled) d.signal = WTERMSIG(status);
  if (WIFEXITED(status)) d.exit_code = WEXITSTATUS(status);
  return d;
}

// The failing checks, and the lines they are on.
constexpr int kPlainLine = __LINE__ + 3;
void fail_plain() {
  int waiting = 0;
  TRUN_CHECK(waiting > 0, "wait id " << 7 << " of peer 10.0.0.1:5");
}

constexpr int kCompareLine = __LINE__ + 3;
void fail_compare() {
  size_t next = 5, n = 5;
  TRUN_CHECK_LT(next, n, "placing rank " << next);
}

}  // namespace

TEST_CASE("a failed TRUN_CHECK aborts naming file:line, the condition and the message", "[check]") {
  Death d = run_in_child(fail_plain);
  INFO(d.stderr_text);
  CHECK(d.signaled);
  CHECK(d.signal == SIGABRT);
  CHECK_THAT(d.stderr_text, Contains("trun: check failed at "));
  CHECK_THAT(d.stderr_text, Contains("check_test.cpp:" + std::to_string(kPlainLine) +
                                     ": waiting > 0: wait id 7 of peer 10.0.0.1:5\n"));
}

TEST_CASE("a failed comparison check prints both values", "[check]") {
  Death d = run_in_child(fail_compare);
  INFO(d.stderr_text);
  CHECK(d.signaled);
  CHECK(d.signal == SIGABRT);
  CHECK_THAT(d.stderr_text, Contains("check_test.cpp:" + std::to_string(kCompareLine) +
                                     ": next < n (5 vs 5): placing rank 5\n"));
}

TEST_CASE("a passing check evaluates its condition once and its message never", "[check]") {
  Death d = run_in_child([] {
    int evaluated = 0, messages = 0;
    auto count = [&] { return ++messages; };
    TRUN_CHECK(++evaluated == 1, "never printed " << count());
    TRUN_CHECK_EQ(++evaluated, 2, "never printed " << count());
    TRUN_CHECK_GE(evaluated, 2, "");
    TRUN_CHECK_NE(evaluated, 3, "");
    TRUN_CHECK_LE(evaluated, 2, "");
    TRUN_CHECK_GT(evaluated, 1, "");
    ::_exit(evaluated == 2 && messages == 0 ? 0 : 1);
  });
  INFO(d.stderr_text);
  CHECK_FALSE(d.signaled);
  CHECK(d.exit_code == 0);
  CHECK(d.stderr_text.empty());
}
