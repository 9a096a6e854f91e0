// Stop-signal handling (trun/stop.h). The handler records the first signal in an atomic and
// writes one byte to a self-pipe; the "stop watcher" thread reads it and runs the callbacks, so
// nothing but async-signal-safe work happens in the handler (as tini does it).

#include "trun/stop.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

#include "worker_sdk/src/progress/progress.h"
#include "worker_sdk/src/stop_scope.h"

namespace trun::worker {
namespace {

constexpr std::pair<const char*, int> kSignals[] = {
    {"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},    {"SIGQUIT", SIGQUIT},
    {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGALRM", SIGALRM},  {"SIGXCPU", SIGXCPU},
    {"SIGPWR", SIGPWR},   {"SIGCONT", SIGCONT}, {"SIGWINCH", SIGWINCH}};

// Read by the handler: plain atomics and an array written before the handler that reads an
// entry is installed.
std::atomic<int> g_signal{0};
std::atomic<int> g_wake_fd{-1};
std::atomic<int> g_die_on_stop{0};  // live detail::DieOnStopScope objects
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");
struct sigaction g_previous[NSIG];

// Never destroyed: the watcher thread may still run while static destructors do.
struct State {
  std::mutex mu;
  bool installed = false;
  std::vector<int> watched;
  int read_fd = -1;
  std::vector<std::function<void(int)>> pending;  // callbacks not run yet
};
State& state() {
  static State* s = new State;
  return *s;
}

void wake() {
  const int fd = g_wake_fd.load();
  if (fd < 0) return;
  const char byte = 1;
  // Non-blocking: when the pipe is full the watcher has wake-ups pending already.
  ssize_t n;
  do {
    n = ::write(fd, &byte, 1);
  } while (n < 0 && errno == EINTR);
}

// Async-signal-safe: atomics and write(2) only.
void record(int sig) {
  int expected = 0;
  if (g_signal.compare_exchange_strong(expected, sig)) wake();
}

void on_signal(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  record(sig);
  const struct sigaction& prev = g_previous[sig];
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction) prev.sa_sigaction(sig, info, context);
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
  }
  if (g_die_on_stop.load() > 0) {
    // detail::DieOnStopScope: the default action, once this handler returns and the signal is
    // unblocked (sigaction and raise are async-signal-safe).
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(sig, &dfl, nullptr);
    ::raise(sig);
  }
  errno = saved_errno;
}

void run_pending() {
  const int sig = g_signal.load();
  if (sig == 0) return;
  std::vector<std::function<void(int)>> run;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    run.swap(state().pending);
  }
  for (auto& cb : run) {
    try {
      cb(sig);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "trun worker: an on_stop_requested callback threw: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "trun worker: an on_stop_requested callback threw\n");
    }
  }
}

void watcher(int fd) {
  char buf[64];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    run_pending();
  }
}

std::string trim_upper(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  std::string out = s.substr(b, e - b);
  for (auto& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

// Installs the handlers once; returns the signals watched.
std::vector<int> ensure_installed() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.installed) return st.watched;

  std::vector<int> signals;
  const char* text = std::getenv("TORCHELASTIC_SIGNALS_TO_HANDLE");
  if (text && *text) {
    std::vector<std::string> unknown;
    signals = parse_stop_signals(text, &unknown);
    for (const auto& u : unknown)
      std::fprintf(stderr,
                   "trun worker: TORCHELASTIC_SIGNALS_TO_HANDLE=%s names an unknown signal '%s': "
                   "not watched\n",
                   text, u.c_str());
  } else {
    const char* slurm = std::getenv("SLURM_JOB_ID");
    signals = default_stop_signals(slurm && *slurm);
  }

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw std::system_error(errno, std::generic_category(), "trun worker: stop signals: pipe2");
  // The write end never blocks: a full pipe already holds a wake-up.
  ::fcntl(fds[1], F_SETFL, ::fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  st.read_fd = fds[0];
  g_wake_fd.store(fds[1]);
  std::thread(watcher, fds[0]).detach();

  for (int sig : signals) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0) continue;
    // Ignored on purpose (nohup's SIGHUP): leave it so.
    if (!(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_IGN) continue;
    g_previous[sig] = old;
    struct sigaction sa {};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(sig, &sa, nullptr) == 0) st.watched.push_back(sig);
  }
  st.installed = true;
  return st.watched;
}

}  // namespace

std::vector<int> parse_stop_signals(const std::string& text, std::vector<std::string>* unknown) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string name = trim_upper(text.substr(start, comma - start));
    start = comma + 1;
    if (name.empty()) continue;
    const std::string full = name.rfind("SIG", 0) == 0 ? name : "SIG" + name;
    int sig = 0;
    for (const auto& [n, v] : kSignals)
      if (full == n) sig = v;
    if (sig == 0) {
      if (unknown) unknown->push_back(name);
      continue;
    }
    bool seen = false;
    for (int s : out) seen = seen || s == sig;
    if (!seen) out.push_back(sig);
  }
  return out;
}

std::vector<int> default_stop_signals(bool slurm_job) {
  std::vector<int> out = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  if (slurm_job) out.push_back(SIGUSR1);
  return out;
}

std::string stop_signal_name(int signal) {
  for (const auto& [n, v] : kSignals)
    if (v == signal) return n;
  return "signal " + std::to_string(signal);
}

std::vector<int> watch_stop_signals() { return ensure_installed(); }

bool stop_requested() { return stop_signal() != 0; }

int stop_signal() {
  // After the first call only the atomic is read.
  static const bool installed = (ensure_installed(), true);
  (void)installed;
  return g_signal.load();
}

void on_stop_requested(std::function<void(int signal)> callback) {
  ensure_installed();
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().pending.push_back(std::move(callback));
  }
  // Pushed before this check: either the watcher's next swap takes it, or we wake it here.
  if (g_signal.load() != 0) wake();
}

void exit_by_stop_signal() {
  const int sig = g_signal.load();
  if (sig == 0) ::_exit(1);
  std::fflush(nullptr);
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  ::sigaction(sig, &sa, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  ::_exit(128 + sig);
}

namespace detail {

DieOnStopScope::DieOnStopScope() {
  ++g_die_on_stop;  // before the check: a signal from here on ends the process in the handler
  if (g_signal.load() != 0) exit_by_stop_signal();
}

DieOnStopScope::~DieOnStopScope() { --g_die_on_stop; }

}  // namespace detail

void request_stop_for_testing(int signal) {
  ensure_installed();
  record(signal);
}

StopAgreement::StopAgreement(ProcessGroup& group, uint64_t check_every)
    : group_(&group), check_every_(check_every) {
  if (check_every == 0) throw std::invalid_argument("StopAgreement: check_every must be >= 1");
  if (group.backend() == Backend::kNccl)
    throw std::invalid_argument(
        "StopAgreement: needs a CPU group (its flag is host memory); pass "
        "worker.new_group(Backend::kCpu)");
  ensure_installed();
}

namespace {
// The agreement's flag: the stop signal, plus kJobStop when it is not only this node's leave.
constexpr int32_t kJobStop = 1 << 16;
constexpr int32_t kSignalMask = kJobStop - 1;
}  // namespace

bool StopAgreement::should_stop(uint64_t step) {
  if (stopped_) return true;
  if (step % check_every_ != 0) return false;
  int32_t flag = stop_signal();
  if (flag != 0 && !detail::progress::node_leaving()) flag |= kJobStop;
  {
    detail::progress::PhaseScope phase(base::progress::Phase::kStopCheck);
    group_->allreduce(&flag, 1, DataType::kInt32, ReduceOp::kMax);
  }
  if (flag == 0) return false;
  stopped_ = true;
  job_stop_ = (flag & kJobStop) != 0;
  agreed_signal_ = flag & kSignalMask;
  agreed_step_ = step;
  return true;
}

bool StopAgreement::stops_here() const {
  if (job_stop_ || stop_requested() || detail::progress::node_leaving()) return true;
  return !(detail::progress::resilient_declared() && detail::progress::board_generation());
}

void StopAgreement::rejoin() {
  const std::string what = "ranks whose node leaves stopped on request (" +
                           stop_signal_name(agreed_signal_) + ") at step " +
                           std::to_string(agreed_step_) + "; this rank goes on without them";
  stopped_ = false;
  job_stop_ = false;
  agreed_signal_ = 0;
  agreed_step_ = 0;
  throw RanksStoppedError(what);
}

}  // namespace trun::worker
