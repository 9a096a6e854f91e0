#pragma once
// The error file: how a worker tells its agent why it failed, in the JSON that PyTorch's
// @record writes, so trun's (and torchrun's) failure summary shows a C++ worker's error too:
//
//   {"message": {"message": "<type>: <what>",
//                "extraInfo": {"py_callstack": "<stack trace>", "timestamp": "<unix seconds>"}}}
//
// The path comes from TORCHELASTIC_ERROR_FILE. An existing file is replaced.

#include <string>

#include <trun/export.h>

namespace trun::worker {

// Writes the error file at `path` (no-op when empty). Returns false (and logs on stderr) when it
// cannot be written. Not async-signal-safe.
TRUN_API bool write_error_file(const std::string& path, const std::string& message,
                               const std::string& stack_trace);

// The calling thread's stack, one frame a line: "function at file:line" where addr2line (binutils)
// finds the module's line tables, else backtrace(3)'s symbol text. Starts addr2line and waits for
// it (2 s at most): not for a signal handler.
TRUN_API std::string current_stack_trace(int skip_frames = 0);

// Installs, for `error_file_path` (default: $TORCHELASTIC_ERROR_FILE; nothing when unset):
// - a std::terminate handler: an uncaught exception's type and what() plus the stack is
//   written (the stack trace starts with the same "<type>: <what>" line, as a Python traceback
//   ends with it), then the process aborts as it would have;
// - handlers for SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT that write the signal and the stack
//   with async-signal-safe calls only, then re-raise the signal with its default action, so the
//   exit status still says which signal killed the worker.
// Idempotent; the latest path wins. Returns false when no path was given or set.
TRUN_API bool install_error_handler(const std::string& error_file_path = "");

// Runs `fn`; on an exception writes the error file (like @record) and rethrows.
template <typename Fn>
auto record(Fn&& fn) -> decltype(fn());

namespace detail {
TRUN_API void record_current_exception();
}

template <typename Fn>
auto record(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (...) {
    detail::record_current_exception();
    throw;
  }
}

}  // namespace trun::worker
