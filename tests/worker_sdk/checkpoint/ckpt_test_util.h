#pragma once
// Helpers of the checkpoint tests: a temporary directory, byte flips, and running the
// crash-consistency writer (ckpt_writer) as a real process that may be SIGKILLed.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace trun::test {

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/trun-ckpt-test-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

inline void flip_byte(const std::string& file, uint64_t offset, unsigned char mask = 0x10) {
  int fd = ::open(file.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  unsigned char c = 0;
  REQUIRE(::pread(fd, &c, 1, static_cast<off_t>(offset)) == 1);
  c ^= mask;
  REQUIRE(::pwrite(fd, &c, 1, static_cast<off_t>(offset)) == 1);
  ::close(fd);
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string writer_binary() {
  return std::string(TRUN_BINARY_DIR) + "/tests/worker_sdk/ckpt_writer";
}

using Env = std::vector<std::pair<std::string, std::string>>;

// A ckpt_writer process: `ckpt_writer DIR MAX_SAVES [PHASE]` with `env` added, its output in a
// file of its own under /tmp (DIR may be read-only).
struct WriterProcess {
  pid_t pid = -1;
  std::string out;
  WriterProcess(const std::string& dir, int max_saves, const std::string& phase, const Env& env) {
    char tmpl[] = "/tmp/trun-ckpt-writer-XXXXXX";
    const int ofd = ::mkstemp(tmpl);
    REQUIRE(ofd >= 0);
    ::close(ofd);
    out = tmpl;
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::string bin = writer_binary(), n = std::to_string(max_saves);
      if (phase.empty())
        ::execl(bin.c_str(), bin.c_str(), dir.c_str(), n.c_str(), (char*)nullptr);
      else
        ::execl(bin.c_str(), bin.c_str(), dir.c_str(), n.c_str(), phase.c_str(), (char*)nullptr);
      ::_exit(127);
    }
  }
  // Waits for the exit; SIGKILL after `kill_after`. Returns the wait status.
  int wait(std::chrono::microseconds kill_after) {
    const auto deadline = std::chrono::steady_clock::now() + kill_after;
    int st = 0;
    for (;;) {
      pid_t r = ::waitpid(pid, &st, WNOHANG);
      if (r == pid) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    pid = -1;
    return st;
  }
  // Waits (bounded) until the output contains `text`.
  bool wait_for_output(const std::string& text, std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      if (read_file(out).find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  std::string output() const { return read_file(out); }
  ~WriterProcess() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    ::unlink(out.c_str());
  }
};

// Runs ckpt_writer; kills it with SIGKILL after `kill_after` (if it still runs). Returns its
// output; `status` gets the wait status.
inline std::string run_writer(const std::string& dir, int max_saves, const std::string& phase,
                              std::chrono::microseconds kill_after, int* status,
                              const Env& env = {}) {
  WriterProcess w(dir, max_saves, phase, env);
  *status = w.wait(kill_after);
  return w.output();
}

}  // namespace trun::test
