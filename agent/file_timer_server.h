#pragma once
// FileTimerServer: PyTorch's file-based watchdog for the workers of this node, as torchrun's
// LocalElasticAgent serves it when its environment has TORCHELASTIC_ENABLE_FILE_TIMER=1
// (torch.distributed.elastic.timer.FileTimerServer; docs/launcher.md, "Watchdog timers").
//
// The protocol: the server owns a named pipe (a FIFO) whose path every worker gets as
// TORCHELASTIC_TIMER_FILE. A worker's FileTimerClient opens it for writing, writes one JSON
// object and a newline, and closes it:
//   {"version": 1, "pid": <its pid>, "scope_id": "<name>", "expiration_time": <unix seconds>,
//    "signal": <signal number>}
// An expiration_time >= 0 arms (or re-arms) the timer (pid, scope_id); a negative one releases
// it. When a timer's expiration time passes, the server sends its signal to its pid, which fails
// that worker (and so the group, as any worker failure does), and forgets every timer of that pid.
// Of several expired timers of one pid, the earliest one with a signal > 0 gives the signal; a
// signal <= 0 arms a timer that kills nothing (torchrun's rule).
//
// Where trun is stricter than torchrun 1.13 (which signals any pid a request names):
//   - a request is honoured only when its pid is one of the current workers (set_workers), and
//     a signal is sent only through a pidfd opened while that worker was still the agent's
//     unreaped child, so a pid reused by another process is never signalled;
//   - the signal must be one of kAllowedSignals (SIGHUP, SIGINT, SIGQUIT, SIGABRT, SIGKILL,
//     SIGUSR1, SIGUSR2, SIGTERM), or <= 0;
//   - a record is at most max_record_bytes (the client sends at most PIPE_BUF), a scope_id at most
//     kMaxScopeBytes, a worker has at most max_timers_per_worker timers, and "version" must be 1.
// Writes of up to PIPE_BUF bytes reach the pipe whole (FileTimerClient's do); a longer one may be
// split by another writer's, and both records are then refused, as with torchrun.
// A request that breaks a rule is ignored, counted (refused()) and reported on `warn` the first
// time its kind of refusal happens. Nothing a worker writes makes the server block, crash or keep
// more than those bounds in memory.
//
// Timing: the server's thread sleeps in poll() until the earliest expiration time (at most 1 s
// at a time, so that a change of the wall clock is seen), and signals within milliseconds of it.
// Expiration times are wall-clock (CLOCK_REALTIME) seconds, as the client's time.time().
//
// Threads: one thread of its own reads the FIFO and fires timers; the agent's event loop never
// waits for it long: set_workers() takes a mutex that the server's thread holds only to apply one
// parsed request or to fire timers (no I/O but the signal itself), and clear_workers() also waits
// for a read pass under way (at most 256 KiB read and parsed).
// The thread should be started after the agent blocked its signals (it inherits the mask).
//
// Errors: the constructor throws FileTimerError (the path and the reason) when the FIFO cannot be
// made safely. Later errors (a failed signal, a read error) are reported on `warn`.

#include <signal.h>
#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace trun::agent {

// torchrun's variables, read from the agent's environment.
inline constexpr const char* kEnableFileTimerVar = "TORCHELASTIC_ENABLE_FILE_TIMER";
inline constexpr const char* kTimerFileVar = "TORCHELASTIC_TIMER_FILE";

struct FileTimerSetting {
  bool enabled = false;  // TORCHELASTIC_ENABLE_FILE_TIMER is exactly "1", as torchrun requires
  std::string path;      // TORCHELASTIC_TIMER_FILE; empty: a generated one
};
// Pure: what `env` (the agent's environment) asks for.
FileTimerSetting file_timer_setting(const std::map<std::string, std::string>& env);

// A fresh path for the FIFO: $TMPDIR (when absolute, else /tmp) + "/watchdog_timer_<uuid4>", as
// torchrun's "/tmp/watchdog_timer_" + uuid4().
std::string generated_timer_path();

class FileTimerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The kinds of refused requests, each reported once.
enum class TimerRefusal : int {
  kOversized,       // a record over max_record_bytes, or a scope_id over kMaxScopeBytes
  kNotJson,         // not one JSON object
  kWrongType,       // a field missing or of the wrong type, or a pid out of range
  kUnknownVersion,  // "version" is not 1
  kForeignPid,      // the pid is not one of the current workers
  kBadSignal,       // a signal > 0 outside kAllowedSignals
  kTooManyTimers,   // the worker already has max_timers_per_worker timers
  kCount
};
const char* refusal_name(TimerRefusal kind);

inline constexpr std::array<int, 8> kAllowedSignals = {SIGHUP,  SIGINT,  SIGQUIT, SIGABRT,
                                                       SIGKILL, SIGUSR1, SIGUSR2, SIGTERM};
inline constexpr size_t kMaxScopeBytes = 4096;

struct FileTimerOptions {
  std::string path;                     // where the FIFO is made; required
  size_t max_record_bytes = 64 * 1024;  // longer lines are dropped up to their newline
  size_t max_timers_per_worker = 1024;
  // Where the server reports, one line per call, from its own thread (and from the constructor
  // and destructor). Unset: spdlog's warn and info.
  std::function<void(const std::string&)> warn;  // signals sent, refusals (first of a kind), errors
  std::function<void(const std::string&)> info;  // expiries that signal nothing
  // For a timer whose signal is SIGKILL: this signal first (0: none), and SIGKILL `dump_wait`
  // later if the worker still lives. The agent sets SIGABRT for Python workers with
  // PYTHONFAULTHANDLER on: faulthandler writes every thread's Python stack to the worker's stderr
  // and re-raises it, so the worker dies at its expiration time with its stacks in its log
  // (docs/hangs.md, "Python workers"). A timer with a catchable signal (SIGTERM, ...) gets its own
  // signal alone, as the client asked: its handler may clean up.
  int dump_signal = 0;
  std::chrono::milliseconds dump_wait{500};
};

class FileTimerServer {
 public:
  // Makes the FIFO at options.path with mode 0600 and starts the thread. The path must not exist,
  // or be a FIFO of this user that no server reads (one left by an earlier run: replaced, as
  // torchrun does). A symbolic link (followed never), anything that is not a FIFO, another user's
  // FIFO or one that a live server reads is refused with FileTimerError.
  explicit FileTimerServer(FileTimerOptions options);
  // Stops the thread, closes the FIFO and removes it if the path still names the FIFO this server
  // made (never anything else).
  ~FileTimerServer();
  FileTimerServer(const FileTimerServer&) = delete;
  FileTimerServer& operator=(const FileTimerServer&) = delete;

  const std::string& path() const { return options_.path; }

  // Before a new group is started: forgets the workers and every timer, and stops reading the
  // FIFO until set_workers(), so that a new worker's first request waits in the pipe instead of
  // being refused as foreign before its pid is known.
  void clear_workers();
  // The pids of the group just started (the agent's unreaped children: call it from the thread
  // that reaps them, before it reaps any). Forgets every timer and resumes reading.
  void set_workers(const std::vector<pid_t>& pids);
  // One worker replaced alone (a resilient loop's failed worker; docs/launcher.md): forgets
  // `old_pid` (its timers, a pending follow-up) and takes `fresh` (the agent's unreaped child, as
  // for set_workers) among the workers. The other workers' timers stay.
  void replace_worker(pid_t old_pid, pid_t fresh);

  // Counters, for tests and logs.
  uint64_t refused(TimerRefusal kind) const;
  uint64_t accepted() const { return accepted_.load(); }  // arms and releases applied
  uint64_t signals_sent() const { return signals_sent_.load(); }
  size_t active_timers() const;

 private:
  struct Timer {
    double expires = 0;  // unix seconds
    int signal = 0;
  };
  // dump_signal sent; SIGKILL follows at `at` (unix seconds) unless the worker is gone.
  struct FollowUp {
    double at = 0;
    std::string what;  // "watchdog timer '...' of worker pid N"
  };
  struct Request {
    pid_t pid = 0;
    std::string scope;
    double expires = 0;
    int signal = 0;
  };

  void make_fifo();
  void close_and_remove();
  void run();
  void read_available(std::string* line, bool* overflow);
  void handle_line(const std::string& line);
  void apply(Request r);
  void fire_expired();
  // Under mu_: sends SIGKILL to the workers whose follow-up is due.
  void fire_follow_ups(double now, std::vector<std::pair<bool, std::string>>* lines);
  // Under mu_: `sig` to `pid` through its pidfd; 0, or the errno (ESRCH: not a worker, or one
  // that has exited, reaped or not).
  int send(pid_t pid, int sig);
  int wait_ms();
  void refuse(TimerRefusal kind, const std::string& detail);
  void report(bool warning, const std::string& line) const;

  FileTimerOptions options_;
  int read_fd_ = -1;
  int write_fd_ = -1;  // keeps a writer open, so that poll() never sees a hang-up
  int wake_fd_ = -1;   // eventfd: stop, or reading resumed
  bool made_ = false;  // the FIFO this server made, while it has not removed it
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  std::mutex read_mu_;  // held by the thread for one read pass; before mu_
  mutable std::mutex mu_;
  std::map<pid_t, int> workers_;  // pid -> pidfd (-1 where pidfd_open is unavailable)
  std::map<std::pair<pid_t, std::string>, Timer> timers_;
  std::map<pid_t, FollowUp> follow_ups_;
  bool reading_ = true;
  uint64_t generation_ = 0;  // bumped by clear_workers and set_workers

  std::array<std::atomic<uint64_t>, static_cast<size_t>(TimerRefusal::kCount)> refused_{};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> signals_sent_{0};
};

}  // namespace trun::agent
