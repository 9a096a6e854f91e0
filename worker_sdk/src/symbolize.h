#pragma once
// Stack frames as "function at file:line", for the error file's stack trace.
//
// backtrace_symbols(3) names only exported symbols: a frame in an executable reads
// "train_mlp(+0x4bcc) [0x55...]", which tells a user nothing. symbolize() asks binutils'
// addr2line, once per module, for the function and source line of each frame (with the chain of
// inlined calls), which works wherever the module carries line tables (-g, -g1). A frame that
// cannot be resolved (no addr2line on PATH, no debug information, a time-out) keeps
// backtrace_symbols' text, so the result is never worse than before.
//
// Not async-signal-safe (it starts a process and allocates): for exceptions and std::terminate,
// never inside a signal handler. Blocks for at most `budget` in all (addr2line is killed then).
// Thread-safe; it waits only for the processes it started itself (by pid).

#include <chrono>
#include <string>
#include <vector>

namespace trun::worker::detail {

// One line per frame, "#K ...", each ending in '\n'. Inlined calls add indented lines
// "    inlined into F at FILE:LINE" after their frame.
std::string symbolize(const std::vector<void*>& frames,
                      std::chrono::milliseconds budget = std::chrono::milliseconds(2000));

}  // namespace trun::worker::detail
