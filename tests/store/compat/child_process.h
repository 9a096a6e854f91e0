#pragma once
// A child process for the compatibility tests: started with fork/exec, stdin and stdout on pipes,
// stderr inherited (so Python tracebacks reach the test log). Every read is bounded by a deadline.
// The destructor ends the child by its pid (SIGTERM, then SIGKILL after a grace period) and reaps
// it, so no test leaves a process behind.
//
// Not thread-safe; one owner.

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

namespace trun::test {

class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;

  explicit ChildProcess(const std::vector<std::string>& argv) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
      throw std::runtime_error("pipe failed");
    }
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      execv(args[0], args.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    stdout_ = out[0];
  }

  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  ~ChildProcess() {
    close_stdin();
    if (stdout_ >= 0) close(stdout_);
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGTERM);
      if (!wait_exit(std::chrono::seconds(5))) {
        kill(pid_, SIGKILL);
        int status = 0;
        waitpid(pid_, &status, 0);
      }
    }
  }

  pid_t pid() const { return pid_; }
  void close_stdin() {
    if (stdin_ >= 0) close(stdin_);
    stdin_ = -1;
  }

  // One line of stdout without its newline; false at EOF or when the deadline passes.
  bool read_line(std::string* line, Clock::duration timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
      auto nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        *line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return true;
      }
      if (!fill(deadline)) return false;
    }
  }

  // Everything up to EOF; false if the deadline passed first.
  bool read_all(std::string* all, Clock::duration timeout) {
    auto deadline = Clock::now() + timeout;
    while (fill(deadline)) {
    }
    *all = std::move(buffer_);
    buffer_.clear();
    return eof_;
  }

  // Waits for the child to exit on its own; false if it is still running at the deadline.
  bool wait_exit(Clock::duration timeout) {
    auto deadline = Clock::now() + timeout;
    while (!reaped_) {
      int status = 0;
      pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        status_ = status;
        break;
      }
      if (r < 0 && errno != EINTR) return false;
      if (Clock::now() >= deadline) return false;
      usleep(10 * 1000);
    }
    return true;
  }

  // The exit code after wait_exit, or 128+signal.
  int exit_code() const {
    if (WIFEXITED(status_)) return WEXITSTATUS(status_);
    if (WIFSIGNALED(status_)) return 128 + WTERMSIG(status_);
    return -1;
  }

 private:
  bool fill(Clock::time_point deadline) {
    if (eof_) return false;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{stdout_, POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) return true;
    if (r <= 0) return false;
    char buf[4096];
    ssize_t n = read(stdout_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) return true;
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buffer_.append(buf, static_cast<size_t>(n));
    return true;
  }

  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  std::string buffer_;
  bool eof_ = false;
  bool reaped_ = false;
  int status_ = 0;
};

}  // namespace trun::test
