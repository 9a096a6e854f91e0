#pragma once
// Stopping on request (preemption): a worker asked to stop by a signal finishes its current step,
// agrees with the other ranks on one step to stop at, saves a checkpoint of it and exits, instead
// of dying mid-step.
//
//   trun::worker::watch_stop_signals();            // first thing in main(), before init()
//   auto worker = trun::worker::init();
//   trun::worker::StopAgreement stop(worker.process_group());
//   for (;;) {
//     train_one_step(); ++step;
//     if (stop.should_stop(step)) {                // true on every rank at the same step
//       save_checkpoint(step); ckpt.wait();
//       if (!stop.stops_here()) stop.rejoin();     // a resilient loop: only another node leaves
//       return 75;                                 // EX_TEMPFAIL: stopped on request, resume me
//     }
//   }
//
// Which signals. The names in TORCHELASTIC_SIGNALS_TO_HANDLE (set by trun and torchrun from
// --signals-to-handle; comma-separated, case-insensitive, "SIG" optional: "SIGTERM,SIGUSR1").
// When it is unset or empty: SIGTERM, SIGINT, SIGHUP, SIGQUIT, plus SIGUSR1 when SLURM_JOB_ID is
// set (SLURM's usual preemption notice, `--signal=USR1@90`). Known names: SIGTERM SIGINT SIGHUP
// SIGQUIT SIGUSR1 SIGUSR2 SIGALRM SIGXCPU SIGPWR SIGCONT SIGWINCH; an unknown name is reported
// once on stderr and skipped. A signal that is ignored (SIG_IGN, e.g. SIGHUP under nohup) when
// the handlers are installed stays ignored; one that already has a handler of the program's own
// keeps it: that handler is called after the stop request is recorded.
//
// When the handlers are installed. Not by init() or by linking the library: a program that never
// asks keeps the default behaviour (SIGTERM kills it). They are installed, once for the process,
// by the first call of watch_stop_signals(), stop_requested(), stop_signal(), on_stop_requested()
// or the StopAgreement constructor. Before that a stop signal has its default action (the process
// dies, and is restarted from its last periodic checkpoint): call watch_stop_signals() first in
// main() to close that window, which otherwise spans whatever runs before the first call
// (loading the checkpoint). During init() a stop signal still ends the process by its default
// action (a worker that waits for the store or its peers has nothing to save and could not reach
// stop_requested() before its timeout), and one received before init() ends it as init() starts.
//
// Idempotent. Only the first stop signal counts: stop_signal() keeps it, the callbacks run once,
// and the same or another stop signal arriving again (SLURM signals every task, and trun forwards
// the one it receives to every worker too) changes nothing; the process is not killed by it.
//
// Async-signal-safety: the handler only stores the signal number in an atomic and writes one
// byte to a pipe; a thread of the SDK ("stop watcher", started with the handlers) reads the pipe
// and runs the callbacks. Thread safety: every function may be called from any thread.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <trun/export.h>
#include <trun/process_group.h>

namespace trun::worker {

// Installs the stop-signal handlers (see the header comment) unless installed already. Returns
// the signals watched. Never throws for a bad TORCHELASTIC_SIGNALS_TO_HANDLE (unknown names are
// reported on stderr and skipped); throws std::system_error when a pipe or thread cannot be made.
TRUN_API std::vector<int> watch_stop_signals();

// True once a stop signal arrived (installs the handlers on first use). Lock-free, cheap.
TRUN_API bool stop_requested();
// The first stop signal received (e.g. SIGTERM), 0 if none (installs the handlers on first use).
TRUN_API int stop_signal();
// Runs `callback(signal)` once, on the SDK's stop-watcher thread (never inside the signal
// handler), when the first stop signal arrives; at once (on that thread) when it already
// arrived. Several callbacks may be registered; each runs once, in registration order. The
// callback must not block for long (it delays the others) and must not throw (an exception is
// reported on stderr and dropped). Installs the handlers on first use.
TRUN_API void on_stop_requested(std::function<void(int signal)> callback);

// The signals named by `text` (TORCHELASTIC_SIGNALS_TO_HANDLE's syntax), in order, without
// duplicates; names that are not known are appended to `unknown` when it is given.
TRUN_API std::vector<int> parse_stop_signals(const std::string& text,
                                             std::vector<std::string>* unknown = nullptr);
// The signals watched when TORCHELASTIC_SIGNALS_TO_HANDLE is unset or empty.
TRUN_API std::vector<int> default_stop_signals(bool slurm_job);
// "SIGTERM" for SIGTERM; "signal N" for a number not in the table above.
TRUN_API std::string stop_signal_name(int signal);

// Ends the process by its stop signal with that signal's default action, as if no handler had
// been installed (trun then counts the worker as stopped, not failed, and it writes no error
// file): for a worker that was asked to stop but cannot honour it, e.g. its group broke because
// a peer was stopped first. Falls back to _exit(128 + signal) when the default action does not
// end the process (SIGCONT, SIGWINCH), and to _exit(1) when no stop signal arrived.
[[noreturn]] TRUN_API void exit_by_stop_signal();

// Test seam: records `signal` as if its handler had run (same path, same idempotence).
TRUN_API void request_stop_for_testing(int signal);

// StopAgreement::rejoin()'s exception: ranks of the group stopped on request while this one goes
// on (a CollectiveError: the group is unusable without them).
class TRUN_API RanksStoppedError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

// Lets every rank of a group agree on the same step to stop at, even when the stop signal
// reached only some ranks (or reached them at different steps).
//
// should_stop(step) is collective: every rank of the group calls it with the same sequence of
// steps (once per step is the intended use). When step % check_every == 0 it runs one allreduce
// (max) of one int32, this rank's stop_signal(), on the group; it returns true on every rank at
// the first such step at which any rank had received a stop signal, and true (without
// communicating) on every later call. At other steps it returns false without communicating
// (unless it already returned true). A stop signal is thus acted on at most check_every steps
// after the agreement step at which it is first seen.
//
// Cost: one allreduce of 4 bytes per check, a latency-bound collective (docs/checkpoints.md has
// measured numbers); raise check_every for very short steps.
//
// The group must be a CPU group (the flag is host memory): with NCCL, pass a group made with
// worker.new_group(Backend::kCpu). The group must outlive the StopAgreement. Throws
// std::invalid_argument (an NCCL group, check_every 0); should_stop throws CollectiveError as the
// group does. Not thread-safe: one thread (the training loop) uses it.
class TRUN_API StopAgreement {
 public:
  explicit StopAgreement(ProcessGroup& group, uint64_t check_every = 1);
  bool should_stop(uint64_t step);
  // After should_stop returned true: the largest signal number any rank had received (the same
  // on every rank); this rank may not have received it. 0 before.
  int agreed_signal() const { return agreed_signal_; }
  // The step at which should_stop first returned true (0 before).
  uint64_t agreed_step() const { return agreed_step_; }

  // After should_stop returned true and the agreed step's checkpoint is saved: whether this rank
  // stops too. Under trun, an agent that stops because its node leaves the job (it was given
  // SIGTERM, or its node was excluded as a straggler) says so to its workers before it signals
  // them, and their agreement carries it: when every stop signal of the agreement came that way,
  // the ranks of the other nodes that run a resilient loop (trun/resilient.h) do not stop; they
  // call rejoin() and go on without the leaving node. In every other case every rank stops: a
  // stop signal sent to a worker directly (SLURM's, a user's), a rank outside a resilient loop,
  // no trun progress board (torchrun, srun). A whole job's stop reaches every node's agent, so
  // every rank stops then too; a rank whose own signal came after the agreement waits for the
  // next generation, and that signal ends the wait and the process (exit_by_stop_signal), the
  // agreed step's checkpoint saved.
  bool stops_here() const;
  // Throws RanksStoppedError, which a resilient loop takes as a failed step that changed nothing
  // (the agreed step is complete): it waits for the agent's next generation and re-forms
  // without the ranks that stopped. This agreement can be used again afterwards, although the
  // next formation normally builds its own.
  [[noreturn]] void rejoin();

 private:
  ProcessGroup* group_;
  uint64_t check_every_;
  int agreed_signal_ = 0;
  uint64_t agreed_step_ = 0;
  bool stopped_ = false;
  bool job_stop_ = false;
};

}  // namespace trun::worker
