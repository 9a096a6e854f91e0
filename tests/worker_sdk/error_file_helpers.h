#pragma once
// Helpers shared by the error-file tests: a temporary path and a pg_worker run with
// TORCHELASTIC_ERROR_FILE set.

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace trun::worker::test {

struct Tmp {
  std::string path;
  Tmp() {
    char tmpl[] = "/tmp/trun-errfile-XXXXXX";
    int fd = ::mkstemp(tmpl);
    REQUIRE(fd >= 0);
    ::close(fd);
    ::unlink(tmpl);  // the worker creates it
    path = tmpl;
  }
  ~Tmp() { ::unlink(path.c_str()); }
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs pg_worker <scenario> with TORCHELASTIC_ERROR_FILE set; returns the wait status.
inline int run_worker(const std::string& scenario, const std::string& error_file) {
  std::string bin = std::string(TRUN_BINARY_DIR) + "/tests/worker_sdk/pg_worker";
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::setenv("TORCHELASTIC_ERROR_FILE", error_file.c_str(), 1);
    int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 2);
    ::execl(bin.c_str(), bin.c_str(), scenario.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace trun::worker::test
