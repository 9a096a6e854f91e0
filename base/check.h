#pragma once
// Invariant checks (docs/errors.md, "Bugs"): a condition that only a bug in trun can make false.
//
//   TRUN_CHECK(wait_remaining_ > 0, "wait id " << wait_id << " of " << peer_);
//   TRUN_CHECK_LT(next, n, "ranks placed: " << placed);
//
// On failure it prints one line to stderr and calls std::abort() (SIGABRT: a core dump where
// they are enabled, and the error-file handler's report in a worker):
//
//   trun: check failed at FILE:LINE: COND: message
//
// where COND is the condition's text; the comparison forms add both values, e.g.
// "next < n (5 vs 5)". The message is a stream expression (anything `std::ostream <<` takes) and
// is evaluated only on failure; the condition and the operands are evaluated exactly once. A
// check never throws: the state is not trustworthy any more, so nothing may go on using it.
// Checks are always on (no NDEBUG switch): keep them off hot inner loops.
//
// Not for errors the world causes (bad input, a dead peer, a failed system call): those are
// typed exceptions (docs/errors.md). Header-only, standard library only; usable by every module
// (base/ is the ground floor: every module may include it).

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

namespace trun::base::detail {

// The failing check's report, filled by the macro and then fail()ed. Out of line and cold, so a
// check costs the caller a compare and a branch.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition)
      : file_(file), line_(line), condition_(condition) {}
  std::ostream& values() { return values_; }
  std::ostream& message() { return message_; }

  [[noreturn]] __attribute__((noinline, cold)) void fail() {
    std::string values = values_.str();
    std::string message = message_.str();
    std::fprintf(stderr, "trun: check failed at %s:%d: %s%s%s: %s\n", file_, line_, condition_,
                 values.empty() ? "" : " ", values.c_str(), message.c_str());
    std::fflush(stderr);
    std::abort();
  }

 private:
  const char* file_;
  int line_;
  const char* condition_;
  std::ostringstream values_;
  std::ostringstream message_;
};

}  // namespace trun::base::detail

#define TRUN_CHECK(cond, msg)                                                            \
  do {                                                                                   \
    if (__builtin_expect(!(cond), 0)) {                                                  \
      ::trun::base::detail::CheckFailure trun_check_failure_(__FILE__, __LINE__, #cond); \
      trun_check_failure_.message() << msg;                                              \
      trun_check_failure_.fail();                                                        \
    }                                                                                    \
  } while (0)

// `a op b`, printing both values on failure. The operands are bound to references once.
#define TRUN_CHECK_OP_(op, a, b, msg)                                                         \
  do {                                                                                        \
    const auto& trun_check_a_ = (a);                                                          \
    const auto& trun_check_b_ = (b);                                                          \
    if (__builtin_expect(!(trun_check_a_ op trun_check_b_), 0)) {                             \
      ::trun::base::detail::CheckFailure trun_check_failure_(__FILE__, __LINE__,              \
                                                             #a " " #op " " #b);              \
      trun_check_failure_.values() << "(" << trun_check_a_ << " vs " << trun_check_b_ << ")"; \
      trun_check_failure_.message() << msg;                                                   \
      trun_check_failure_.fail();                                                             \
    }                                                                                         \
  } while (0)

#define TRUN_CHECK_EQ(a, b, msg) TRUN_CHECK_OP_(==, a, b, msg)
#define TRUN_CHECK_NE(a, b, msg) TRUN_CHECK_OP_(!=, a, b, msg)
#define TRUN_CHECK_LT(a, b, msg) TRUN_CHECK_OP_(<, a, b, msg)
#define TRUN_CHECK_LE(a, b, msg) TRUN_CHECK_OP_(<=, a, b, msg)
#define TRUN_CHECK_GT(a, b, msg) TRUN_CHECK_OP_(>, a, b, msg)
#define TRUN_CHECK_GE(a, b, msg) TRUN_CHECK_OP_(>=, a, b, msg)
