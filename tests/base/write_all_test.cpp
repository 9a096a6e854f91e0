// base/write_all.h: the one write loop, on real pipes, sockets and files.
#include "base/write_all.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

using trun::base::pwrite_all;
using trun::base::write_all;
using trun::base::WriteCall;

namespace {

struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() { REQUIRE(::pipe2(fd, O_CLOEXEC) == 0); }
  ~Pipe() {
    for (int f : fd) {
      if (f >= 0) ::close(f);
    }
  }
};

std::string pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + i * 7 % 26);
  return s;
}

// Reads until EOF (bounded by `limit` bytes).
std::string drain(int fd, size_t limit) {
  std::string out;
  char buf[65536];
  while (out.size() <= limit) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

void on_usr1(int) {}

}  // namespace

TEST_CASE("write_all: more than a pipe holds arrives whole, through partial writes and signals",
          "[write_all]") {
  // A handler without SA_RESTART: a signal while write() blocks makes it return early (a partial
  // write, or EINTR), which the loop must resume.
  struct sigaction sa {};
  sa.sa_handler = on_usr1;
  struct sigaction old {};
  REQUIRE(sigaction(SIGUSR1, &sa, &old) == 0);
  Pipe p;
  const std::string data = pattern(4 << 20);  // 64 pipe buffers
  bool ok = false;
  size_t written = 0;
  std::thread writer([&] {
    ok = write_all(p.fd[1], data.data(), data.size(), &written);
    ::close(p.fd[1]);
    p.fd[1] = -1;
  });
  const pthread_t tid = writer.native_handle();
  std::string got;
  char buf[4096];
  for (int i = 0; i < 100000 && got.size() < data.size(); ++i) {
    if (i % 16 == 0) pthread_kill(tid, SIGUSR1);
    ssize_t n = ::read(p.fd[0], buf, sizeof buf);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  writer.join();
  got += drain(p.fd[0], data.size());
  REQUIRE(sigaction(SIGUSR1, &old, nullptr) == 0);
  CHECK(ok);
  CHECK(written == data.size());
  CHECK(got.size() == data.size());
  CHECK(got == data);
}

TEST_CASE("write_all: a full non-blocking pipe fails with EAGAIN and says how far it got",
          "[write_all]") {
  Pipe p;
  REQUIRE(::fcntl(p.fd[1], F_SETFL, O_NONBLOCK) == 0);
  const int capacity = ::fcntl(p.fd[1], F_GETPIPE_SZ);
  REQUIRE(capacity > 0);
  const std::string data = pattern(static_cast<size_t>(capacity) * 2);
  size_t written = 0;
  errno = 0;
  CHECK_FALSE(write_all(p.fd[1], data.data(), data.size(), &written));
  CHECK(errno == EAGAIN);
  CHECK(written == static_cast<size_t>(capacity));
  // The caller makes room and resumes at `written`: the reader sees the data once, in order.
  std::string got(written, '\0');
  size_t at = 0;
  for (int i = 0; i < 100000 && at < written; ++i) {
    ssize_t n = ::read(p.fd[0], &got[at], written - at);
    REQUIRE(n > 0);
    at += static_cast<size_t>(n);
  }
  size_t rest = 0;
  CHECK(write_all(p.fd[1], data.data() + written, data.size() - written, &rest));
  CHECK(rest == data.size() - written);
  ::close(p.fd[1]);
  p.fd[1] = -1;
  got += drain(p.fd[0], data.size());
  CHECK(got == data);
}

TEST_CASE("write_all: sending to a socket whose peer left fails with EPIPE, not SIGPIPE",
          "[write_all]") {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  ::close(sv[1]);
  // SIGPIPE keeps its default action here: were it raised, this process would die.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  struct sigaction old {};
  REQUIRE(sigaction(SIGPIPE, &dfl, &old) == 0);
  size_t written = 99;
  errno = 0;
  const bool ok = write_all(sv[0], "hello", 5, &written, WriteCall::kSendNoSignal);
  const int err = errno;
  REQUIRE(sigaction(SIGPIPE, &old, nullptr) == 0);
  ::close(sv[0]);
  CHECK_FALSE(ok);
  CHECK(err == EPIPE);
  CHECK(written == 0);
}

TEST_CASE("pwrite_all: writes at the offset in pieces and leaves the file offset alone",
          "[write_all]") {
  const int fd = ::memfd_create("trun-pwrite-all-test", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  const std::string data = pattern(1000);
  CHECK(pwrite_all(fd, data.data(), data.size(), 24, 7));  // 143 pieces
  CHECK(::lseek(fd, 0, SEEK_CUR) == 0);
  std::string got(1024, 'x');
  CHECK(::pread(fd, &got[0], got.size(), 0) == 1024);
  CHECK(got.substr(0, 24) == std::string(24, '\0'));  // the hole before the offset
  CHECK(got.substr(24) == data);
  // The same file opened for reading only: the error comes back as errno.
  const int ro = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
  ::close(fd);
  REQUIRE(ro >= 0);
  errno = 0;
  CHECK_FALSE(pwrite_all(ro, "x", 1, 0));
  CHECK(errno == EBADF);
  ::close(ro);
  Pipe p;
  errno = 0;
  CHECK_FALSE(write_all(p.fd[0], "x", 1));
  CHECK(errno == EBADF);
}
