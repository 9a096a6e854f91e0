#pragma once
// LogMux: where the workers' stdout and stderr go during one attempt.
//
// Per local rank and stream, one of:
//   inherit  - the worker writes straight to trun's own stdout/stderr (torchrun's default; no
//              prefix, no copy, no cost);
//   file     - the stream goes straight to DIR/.../<local_rank>/{stdout,stderr}.log (--redirects,
//              or a tee'd rank hidden by --local-ranks-filter);
//   tee      - a pipe to trun, which appends every byte to the log file and copies whole lines to
//              its console with a "[<role><local_rank>]:" prefix (--tee);
//   discard  - /dev/null (a rank hidden by --local-ranks-filter and not redirected).
// Console lines are handed whole, one batch of complete lines at a time, to the console writer
// (agent/console.h), so lines of different workers never interleave mid-line. That never blocks
// the event loop. When the console writer's buffer is nearly full, LogMux stops reading that
// worker's pipe (the worker waits in write(2), as it would on a slow terminal of its own) and
// checks again every 10 ms; once the console has taken nothing for kConsoleStallAfter it reads
// again and the console copy of what does not fit is dropped (and counted), while the log files
// still get every byte. A partial last line is completed with a newline when the worker's end of
// the pipe closes.
// With duplicate filters for a console stream (torchrun's --duplicate-stdout-filters), every tee'd
// line of that stream containing any filter string is also appended, with its prefix, to one file
// shared by all ranks (filtered_stdout.log / filtered_stderr.log).
//
// Thread safety: none; runs on the agent's event loop thread.

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "agent/event_loop.h"

namespace trun::agent {

enum class StreamMode { kInherit, kFile, kTee, kDiscard };

// How long a console may take nothing before worker output stops waiting for it.
inline constexpr std::chrono::milliseconds kConsoleStallAfter{1000};
// drain() waits at most this long in all for a slow console.
inline constexpr std::chrono::milliseconds kDrainBound{10000};

class LogMux {
 public:
  explicit LogMux(EventLoop& loop);
  ~LogMux();  // closes everything without reading further
  LogMux(const LogMux&) = delete;
  LogMux& operator=(const LogMux&) = delete;

  // Prepares one stream of one worker; `console_fd` is 1 or 2. Returns the fd to give the worker
  // as that stream (-1 for inherit). Throws std::system_error when a file or pipe cannot be made.
  // `owner` (the local rank) names the worker's streams for set_prefix().
  int prepare(StreamMode mode, int console_fd, const std::string& file_path,
              const std::string& prefix, int owner = -1);
  // The prefix of `owner`'s tee'd streams from their next line on: kept workers of resilient
  // loops that a new round placed at other ranks (--log-line-prefix-template with ${rank}).
  void set_prefix(int owner, const std::string& prefix);
  // Before prepare(): tee'd lines of `console_fd` (1 or 2) that contain any of `filters` also go
  // to `file_path` (created now, even if nothing matches). Throws std::system_error.
  void duplicate(int console_fd, const std::string& file_path, std::vector<std::string> filters);
  // After the workers were spawned: closes trun's copies of their ends.
  void close_child_ends();
  // After the workers (and their groups) are gone: reads what is left in every pipe, writes the
  // last partial lines, and closes all files. Blocks while a tee'd console is slow but moving
  // (as the workers would have), at most kDrainBound in all; a stalled console's copy is dropped.
  void drain();

 private:
  struct Tee;
  struct Duplicate {
    int fd = -1;
    std::vector<std::string> filters;
  };
  void on_readable(Tee& t);
  // Whether t's console takes a batch now (or is stalled, and then drops it).
  bool console_accepts(const Tee& t) const;
  // Stops watching t's pipe until console_accepts(t); on_timer() checks every 10 ms.
  void pause(Tee& t);
  void on_timer();
  void watch(Tee& t);
  // Appends `line` (prefixed, newline-terminated) to t's duplicate file's batch if it matches.
  void collect_duplicate(Tee& t, std::string_view prefixed_line);
  void write_duplicates(Tee& t);
  Duplicate& dup_for(int console_fd) { return dup_[console_fd == 2 ? 1 : 0]; }
  // Returns true while more may be readable right now.
  bool read_some(Tee& t, int max_reads);
  void finish(Tee& t);

  EventLoop& loop_;
  std::vector<std::unique_ptr<Tee>> tees_;
  std::vector<int> child_fds_;  // fds handed to workers (files, pipe ends), closed after spawn
  Duplicate dup_[2];            // stdout, stderr (dup_for); fd -1 when not duplicating
  int timer_fd_ = -1;           // timerfd, armed while any tee is paused
  int paused_ = 0;
};

// "[" + template with ${role_name}, ${rank}, ${local_rank} substituted + "]:".
std::string line_prefix(const std::string& tmpl, const std::string& role, int rank, int local_rank);

}  // namespace trun::agent
