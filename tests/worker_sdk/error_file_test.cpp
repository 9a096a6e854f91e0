// The error file: written by real worker processes that die of an uncaught exception or a
// fatal signal, in the JSON PyTorch's @record writes (and torchrun reads).

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "trun/error_file.h"

namespace {

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

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs pg_worker <scenario> with TORCHELASTIC_ERROR_FILE set; returns the wait status.
int run_worker(const std::string& scenario, const std::string& error_file) {
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

void check_shape(const nlohmann::json& j) {
  REQUIRE(j.contains("message"));
  REQUIRE(j["message"].is_object());
  REQUIRE(j["message"]["message"].is_string());
  REQUIRE(j["message"]["extraInfo"]["py_callstack"].is_string());
  REQUIRE(j["message"]["extraInfo"]["timestamp"].is_string());
  long long ts = std::stoll(j["message"]["extraInfo"]["timestamp"].get<std::string>());
  CHECK(std::llabs(ts - static_cast<long long>(std::time(nullptr))) < 600);
}

}  // namespace

TEST_CASE("an uncaught exception writes its type, message and stack to the error file",
          "[worker_sdk][error_file]") {
  Tmp f;
  int status = run_worker("throw", f.path);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  auto j = nlohmann::json::parse(slurp(f.path));
  check_shape(j);
  CHECK(j["message"]["message"] == "std::runtime_error: model diverged at step 42");
  CHECK(j["message"]["extraInfo"]["py_callstack"].get<std::string>().find("main") !=
        std::string::npos);
}

TEST_CASE("a fatal signal writes the signal and a stack, and the worker still dies of it",
          "[worker_sdk][error_file]") {
  Tmp f;
  int status = run_worker("segv", f.path);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
  auto j = nlohmann::json::parse(slurp(f.path));
  check_shape(j);
  CHECK(j["message"]["message"].get<std::string>().find("Fatal signal SIGSEGV (11)") == 0);
  CHECK(j["message"]["extraInfo"]["py_callstack"].get<std::string>().find("#0 0x") == 0);
}

TEST_CASE("write_error_file escapes JSON and record() rethrows", "[worker_sdk][error_file]") {
  Tmp f;
  REQUIRE(trun::worker::write_error_file(f.path, "quote \" backslash \\ newline \n tab \t \x01",
                                         "frame 1\nframe 2"));
  auto j = nlohmann::json::parse(slurp(f.path));
  check_shape(j);
  CHECK(j["message"]["message"] == "quote \" backslash \\ newline \n tab \t \x01");
  CHECK(j["message"]["extraInfo"]["py_callstack"] == "frame 1\nframe 2");
  CHECK_FALSE(trun::worker::write_error_file("/nonexistent-dir/x.json", "m", "s"));
  CHECK_FALSE(trun::worker::write_error_file("", "m", "s"));
}

TEST_CASE("PyTorch's own error-file reader accepts the file", "[worker_sdk][error_file][torch]") {
  // Runs /usr/bin/python3 with torch: labelled no_sanitize in CMake.
  if (::access("/usr/bin/python3", X_OK) != 0) {
    WARN("skipped: /usr/bin/python3 not found");
    return;
  }
  Tmp f;
  run_worker("throw", f.path);
  std::string cmd =
      "/usr/bin/python3 -c \"import sys\n"
      "try:\n"
      "    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure\n"
      "except Exception as e:\n"
      "    print('NO_TORCH', e); sys.exit(3)\n"
      "pf = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file='" +
      f.path +
      "')\n"
      "print(pf.message); print(pf.timestamp)\" 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  int rc = ::pclose(p);
  if (WIFEXITED(rc) && WEXITSTATUS(rc) == 3) {
    WARN("skipped: torch is not importable by /usr/bin/python3: " << out);
    return;
  }
  INFO(out);
  REQUIRE(WIFEXITED(rc));
  REQUIRE(WEXITSTATUS(rc) == 0);
  CHECK(out.find("std::runtime_error: model diverged at step 42") != std::string::npos);
}
