#pragma once
// FailureReport: worker failures as data, the torchrun-style summary, and the root cause.
//
// A failure is read from the worker's error file when it exists: the JSON that PyTorch's
// @record (torch.distributed.elastic.multiprocessing.errors) writes,
//   {"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "..."}}}
// or the older {"message": "...", "timestamp": N}. Otherwise its message says how the worker
// ended. The root cause is the failure with the earliest timestamp (ties: the first observed).
//
// Pure functions apart from reading/writing the named files; no thread requirements.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace trun::agent {

struct WorkerFailure {
  int local_rank = 0;
  int rank = 0;  // global rank
  pid_t pid = -1;
  int exitcode = 0;        // exit code, or -signal
  std::string error_file;  // path, or "<N/A>" when the worker wrote none
  std::string error_json;  // the file's content when it was valid JSON, else empty
  std::string message;     // the traceback (py_callstack) or message
  int64_t timestamp = 0;   // seconds since the epoch
  // When trun saw the worker exit (or fail to start): wall-clock ms since the epoch. What the
  // nodes compare to find the root cause across nodes (RootCause).
  int64_t exited_at_ms = 0;
  uint64_t sequence = 0;  // order in which trun observed the failure
  std::string hint;       // trun's guess at the cause, shown after the traceback; may be empty
};

// Builds a failure, reading `error_file_path` if it exists (unreadable or malformed files are
// reported in the message rather than thrown).
WorkerFailure read_failure(int local_rank, int rank, pid_t pid, int exitcode,
                           const std::string& error_file_path, uint64_t sequence);

// The hint for a Python worker that failed within its first second, which is how an import
// fails (the interpreter lacks a package): it names the interpreter that ran (`interpreter` as
// given, and the file it resolved to on `path`, the PATH value) and how to choose another
// (PYTHON_EXEC). Empty when the worker ran longer or exited 0 or by a signal.
std::string python_start_hint(const std::string& interpreter, const std::string& path,
                              double seconds_alive, int exitcode, const std::string& message);

// Index into `failures` of the root cause; failures must not be empty.
size_t root_cause_index(const std::vector<WorkerFailure>& failures);

// The root cause of the whole job's failure in a round, across nodes: of every node's report
// (its own root cause and when that worker exited), the earliest (rendezvous::root_cause).
struct RootCause {
  std::string node_id;        // the node whose worker failed first
  std::string detail;         // that node's failure_line
  int64_t failed_at_ms = -1;  // when that worker exited (wall clock); -1: unknown
  bool local = false;         // on this node: failures[root_cause_index(failures)]
};
// "root cause: rank 1 (local_rank 0) on HOST exited with SIGKILL: ... (node NODE, at
// 2026-12-06 07:50:01.123)": the line trun prints after the summary of a multi-node job.
std::string root_cause_line(const RootCause& root);

// The multi-line summary torchrun prints ("<name> FAILED", Failures, Root Cause). With `across`
// (a multi-node job), the Root Cause section is the earliest failure across nodes: this node's
// root cause as before ("Root Cause (earliest failure across nodes):") when `across->local`,
// else the other node's report, and every failure of this node is then listed under Failures.
std::string format_summary(const std::string& name, const std::vector<WorkerFailure>& failures,
                           const std::string& hostname, const RootCause* across = nullptr);

// One line for the other nodes (the rendezvous' worker-failure report): "rank R (local_rank L) on
// HOST exited with CODE: <the first 200 characters of the message, newlines as spaces>", or
// "worker failure on HOST" when `failures` is empty.
std::string failure_line(const std::vector<WorkerFailure>& failures, const std::string& hostname);

// Writes the root cause to `path` (trun's own TORCHELASTIC_ERROR_FILE) in @record's format with
// errorCode set to the worker's exit code, as torchrun does. Returns false when it cannot write.
bool write_root_cause(const std::string& path, const WorkerFailure& failure);

// "SIGSEGV" for 11, "SIG<N>" when unknown.
std::string signal_name(int sig);

}  // namespace trun::agent
