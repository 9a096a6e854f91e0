#pragma once
// Visible skips: the one way a test case skips (tests/CMakeLists.txt, "Skips").
//
//   TRUN_SKIP(reason, kind);       reports the skip and returns from the test case (void)
//   TRUN_SKIP_REPORT(reason, kind); reports it only, for helpers that return a value (a bool, a
//                                  reason string) and for cases that go on with what remains
//
// `reason` is a stream expression (`"no " << what`); `kind` is one of
//   kSetup        something scripts/setup.sh installs or the test machine provides by contract:
//                 etcd, /usr/bin/python3 with torch, torchrun, libtorch-dev, unshare, root for
//                 mounts and namespaces, a resolver that answers NXDOMAIN for .invalid;
//   kEnvironment  legitimately machine-dependent: no GPU (or the GPU simulator not loaded), a
//                 machine that has a GPU so a no-GPU case does not apply, libtrun_worker
//                 configured without CUDA, no IPv6 loopback, a well-known port taken by someone
//                 else.
//
// Strict mode (CI=true, or TRUN_STRICT_SKIPS=1 as scripts/test.sh sets by default): a kSetup skip
// FAILs the test case with its reason. Otherwise, and for kEnvironment always, the skip is a Catch2
// warning starting "skipped: " (scripts/gpu-check.sh reads that prefix) and, when TRUN_SKIP_LOG
// names a file, one line "<test case> (<executable>): <reason> [<kind>]" appended to it: ctest
// runs every test case in a process of its own, so scripts/test.sh collects them in that file and
// lists them after each ctest run.

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

namespace trun::testing {

enum class SkipKind { kSetup, kEnvironment };

inline const char* skip_kind_name(SkipKind kind) {
  return kind == SkipKind::kSetup ? "setup" : "environment";
}

// CI=true or TRUN_STRICT_SKIPS=1.
inline bool strict_skips() {
  auto is = [](const char* name, const char* value) {
    const char* v = std::getenv(name);
    return v != nullptr && std::strcmp(v, value) == 0;
  };
  return is("CI", "true") || is("TRUN_STRICT_SKIPS", "1");
}

// True when a skip of `kind` must fail the test case instead.
inline bool skip_fails(SkipKind kind) { return kind == SkipKind::kSetup && strict_skips(); }

// Appends this skip's line to $TRUN_SKIP_LOG (when set): one write(2) on an O_APPEND descriptor,
// so lines from test processes running side by side do not interleave. Errors are ignored (the
// Catch2 warning still shows the skip).
inline void log_skip(const std::string& reason, SkipKind kind) {
  const char* path = std::getenv("TRUN_SKIP_LOG");
  if (path == nullptr || *path == '\0') return;
  std::string line = Catch::getResultCapture().getCurrentTestName() + " (" +
                     program_invocation_short_name + "): " + reason + " [" + skip_kind_name(kind) +
                     "]";
  for (auto& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  line += '\n';
  int fd = ::open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t n;
  do {
    n = ::write(fd, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
  ::close(fd);
}

}  // namespace trun::testing

#define TRUN_SKIP_REPORT(reason, kind)                                                    \
  do {                                                                                    \
    std::ostringstream trun_skip_reason_;                                                 \
    trun_skip_reason_ << reason;                                                          \
    constexpr auto trun_skip_kind_ = ::trun::testing::SkipKind::kind;                     \
    if (::trun::testing::skip_fails(trun_skip_kind_)) {                                   \
      FAIL(                                                                               \
          "this test machine should provide it (scripts/setup.sh), so no skip in strict " \
          "mode (CI=true or TRUN_STRICT_SKIPS=1): "                                       \
          << trun_skip_reason_.str());                                                    \
    }                                                                                     \
    ::trun::testing::log_skip(trun_skip_reason_.str(), trun_skip_kind_);                  \
    WARN("skipped: " << trun_skip_reason_.str());                                         \
  } while (0)

#define TRUN_SKIP(reason, kind)     \
  do {                              \
    TRUN_SKIP_REPORT(reason, kind); \
    return;                         \
  } while (0)

namespace trun::testing {
// Whether looking `host` up fails with EAI_NONAME here, as a name under .invalid must (RFC 6761)
// wherever a resolver answers.
inline bool fails_with_noname(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "29500", &hints, &res);
  if (res) ::freeaddrinfo(res);
  return rc == EAI_NONAME;
}
}  // namespace trun::testing

// Tests of "a name that does not resolve fails at once" need a resolver that says so.
#define TRUN_SKIP_UNLESS_NONAME(host)                                                    \
  do {                                                                                   \
    if (!::trun::testing::fails_with_noname(host)) {                                     \
      TRUN_SKIP((host) << " does not fail with EAI_NONAME here (no resolver?)", kSetup); \
    }                                                                                    \
  } while (0)
