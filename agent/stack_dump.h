#pragma once
// Native stacks of every thread of a worker process, taken from the agent (hang detection,
// issue 36, docs/hangs.md): before a hung rank is killed, the agent dumps what each thread of
// each local worker is doing, whether the worker spins in user code, sleeps in a system call or
// was stopped with SIGSTOP.
//
// How: on a short-lived tracer thread of its own, each thread in turn is attached with
// PTRACE_SEIZE, stopped with PTRACE_INTERRUPT, unwound with libunwind's remote API over ptrace
// (libunwind-ptrace: _UPT_accessors, unw_init_remote, unw_step; function names from the ELF
// symbol tables, demangled with abi::__cxa_demangle; modules from /proc/<pid>/maps) and
// detached again before the next thread is attached, so one thread at a time is held, for a few
// milliseconds. Function names come from .symtab, or from .dynsym alone in a stripped library,
// where a local function shows as the nearest exported symbol before it with a large offset.
//
// Why libunwind-ptrace and not gdb or eu-stack: it runs inside the agent, which is the workers'
// parent, so it works under Yama's ptrace_scope=1 (only ancestors may attach), where a tool the
// agent starts would be the workers' sibling and be refused; it needs no extra process and no
// debugger on the machine, and unwinds with .eh_frame in milliseconds.
//
// Guarantees:
// - The process is left as it was found: a running process keeps running (a signal that
//   arrived while a thread was held is delivered when it is detached); a stopped one (SIGSTOP,
//   /proc state 'T') is still stopped afterwards.
// - No exit status is ever reaped: ptrace stops are waited for only with
//   waitid(P_PID, tid, WSTOPPED | __WALL | WNOHANG), polled with short sleeps, so the agent's
//   reaper (process_supervisor.cpp) still sees every worker exit. The one exception is not an
//   exit status: a non-leader thread that died while held (the whole process was SIGKILLed in
//   those milliseconds) stays a traced zombie until its tracer waits for it, and the kernel
//   holds back the process's own exit report until then, so such a thread is released with
//   waitid(P_PID, tid, WEXITED | __WALL | WNOHANG), which can match that thread only.
// - Nothing stays attached: a thread that never stopped (uninterruptible sleep, state 'D') is
//   still seized when the tracer thread exits, and the kernel then detaches it (or releases it,
//   had it died traced); the call returns once /proc says it is no longer traced (at most
//   100 ms more). It then goes on untraced, and the process's exit is reported as usual.
// - Bounded: the whole call returns within about `budget` (plus one unwind step, and up to
//   20 ms for a thread that was asked to stop to do so); threads not reached say "not dumped:
//   time budget"; a thread that does not stop within `thread_stop_timeout` gets an error and the
//   others are still dumped; at most `max_frames` frames per thread and `max_threads` threads.
// - Errors are data: no such process, a zombie, EPERM (another tracer, no permission), threads
//   that exit or appear during the dump give ProcessStacks::error or ThreadStack::error; this
//   never throws and never kills or stops the target.
//
// Threading: call it on the thread that reaps the workers (the agent's main thread), never
// beside a waitpid/waitid of another thread of the agent: the kernel reports a ptrace stop of a
// traced child to any wait of the tracer's thread group, whatever its flags, so a concurrent
// reaper could take the stop this waits for (and see a "stopped" status). The call blocks: while
// it runs (up to `budget`) the caller's event loop waits. Concurrent calls (for different
// processes) are not needed by the agent and not tested.
//
// Linking (agent/CMakeLists.txt): libunwind-ptrace.so and libunwind-x86_64.so (libunwind-generic)
// only, never plain libunwind.so, which defines _Unwind_RaiseException and the rest of the C++
// exception ABI. libunwind-x86_64.so.8 still needs libunwind.so.8, so it is loaded, but trun
// neither defines nor exports any _Unwind_* symbol (nm -D) and libstdc++ binds them to
// libgcc_s.so.1, which comes first in the search order (checked with LD_DEBUG=bindings: GCC_3.0
// versioned references; libunwind.so.8's definitions are unversioned).

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace trun::agent {

struct StackFrame {
  uint64_t pc = 0;       // frame 0: where the thread is; others: return addresses
  std::string function;  // demangled; "" when no symbol covers pc
  // pc - the function's start when `function` is known, else pc's offset in `module`'s file
  // (what addr2line -e module takes for a shared library or PIE), else 0.
  uint64_t offset = 0;
  std::string module;  // the mapped file's path from /proc/<pid>/maps; "" if none ([anon], JIT)
};

struct ThreadStack {
  int tid = 0;
  std::string name;  // /proc/<pid>/task/<tid>/comm
  char state = '?';  // /proc/<pid>/task/<tid>/stat before the dump: R, S, D, T, t, Z, ...
  std::vector<StackFrame> frames;  // innermost first; may be partial when `error` is set
  std::string error;               // "" when the stack is complete (or truncated)
  bool truncated = false;          // max_frames reached or the budget ran out mid-stack
};

struct ProcessStacks {
  int pid = 0;
  bool was_stopped = false;          // the process was stopped ('T') before the dump (and still is)
  std::vector<ThreadStack> threads;  // the main thread first, then by tid
  int threads_omitted = 0;           // threads beyond max_threads, not listed
  std::string error;                 // the process could not be dumped at all; threads is empty
  double elapsed_ms = 0;
};

struct StackDumpOptions {
  std::chrono::milliseconds budget{2000};              // for the whole process
  std::chrono::milliseconds thread_stop_timeout{250};  // per thread, within the budget
  int max_frames = 64;
  int max_threads = 256;
};

// Dumps the native stack of every thread of process `pid` (a child of the caller, or a process
// the caller may ptrace). Blocks for at most about `options.budget`. See above for threading.
ProcessStacks dump_native_stacks(int pid, const StackDumpOptions& options = {});

// Readable text, one block per thread:
//   process 4711: 3 threads (stopped) in 4.2 ms
//   thread 4711 (train_mlp) state S:
//     #0 0x00007f3a1c2e4a1d __GI___clock_nanosleep+0x5d (/usr/lib/x86_64-linux-gnu/libc.so.6)
//     #1 0x000055d0c0a01234 stack_target_sleep_here()+0x24 (/path/stack_target)
//   thread 4712 (worker) state R: error: did not stop within 250 ms
std::string format_stacks(const ProcessStacks& stacks);

}  // namespace trun::agent
