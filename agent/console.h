#pragma once
// Console: trun's own path to its stdout and stderr, which never blocks the caller.
//
// trun's console is whatever its parent gave it: a terminal, a pipe into `tee` or a log shipper, a
// file. A reader that stops reading (a stalled ssh session, a paused pager, a full pipe nobody
// drains) must not stall the agent's event loop: signals, worker exits and the shutdown deadline
// are handled on that loop. So everything trun itself writes to fd 1 or 2 while it runs - tee'd
// worker lines (LogMux), its log lines (spdlog, through console_sink()), and whatever is printed
// with stdio's `stderr` (after install_console()) - goes through one ConsoleWriter per fd:
//
//   - a regular file (or an fd that is not open) is written at once by the caller: it never
//     blocks, and it keeps its offset and O_APPEND as the parent set them;
//   - anything else (tty, pipe, FIFO, socket, character device) is written by a writer thread
//     that owns the blocking write(2) calls, from a bounded in-memory buffer. The file
//     description is left as the parent made it (no O_NONBLOCK on a terminal shared with a
//     shell). When the buffer is full, the caller's newest lines are dropped and counted, never
//     waited for; the next lines that fit are preceded by one line saying how many were dropped.
//     Callers that can hold back instead (LogMux) check has_room() and stalled() first.
//
// The worker log files under --log-dir do not go through here: they are regular files written by
// LogMux itself and keep every byte.
//
// Thread safety: every member function may be called from any thread.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

namespace spdlog::sinks {
class sink;
}

namespace trun::agent {

class ConsoleWriter {
 public:
  // Writes to `fd` (not owned). `capacity`: the most bytes held (queued plus being written)
  // while the fd does not take them. Starts the writer thread, with every signal blocked in it,
  // unless `fd` is a regular file. Throws std::system_error when the thread cannot start.
  ConsoleWriter(int fd, size_t capacity);
  // Waits up to 500 ms for the queued bytes, then stops the thread; a thread stuck in write(2)
  // is left behind (detached, owning what it uses), so this never blocks for longer.
  ~ConsoleWriter();
  ConsoleWriter(const ConsoleWriter&) = delete;
  ConsoleWriter& operator=(const ConsoleWriter&) = delete;

  // Queues `data` (normally whole lines) and returns without waiting for the fd. Of what does
  // not fit, whole lines are dropped and counted (a trailing partial line counts as one).
  void write(std::string_view data);
  // Waits at most `bound` until everything queued (and a pending "dropped" note) is written;
  // gives up sooner when the fd takes nothing for 100 ms. Returns true when nothing is left.
  bool flush(std::chrono::milliseconds bound);
  // Whether `bytes` more would be queued now without dropping (always true for a regular file).
  // Producers that can wait (LogMux, which then stops reading a worker's pipe for a while) ask
  // this first, so a console that is slow but moving loses nothing.
  bool has_room(size_t bytes) const;
  // Whether bytes are waiting and the fd has taken none of them for `after`: nobody reads.
  bool stalled(std::chrono::milliseconds after) const;
  // Lines dropped so far (since construction).
  uint64_t dropped_lines() const;
  bool threaded() const { return thread_.joinable(); }

 private:
  struct State;  // shared with the writer thread, which may outlive the writer (detached)
  static void run(const std::shared_ptr<State>& s);

  std::shared_ptr<State> s_;
  std::thread thread_;
};

// The process-wide writers for fd 1 and 2 (`fd` must be 1 or 2), created on first use with
// kConsoleBufferBytes each and never destroyed (a writer thread may be stuck in write(2) at exit).
inline constexpr size_t kConsoleBufferBytes = 4 << 20;
ConsoleWriter& console(int fd);

// Creates both writers and points stdio's `stderr` at console(2) (a line-buffered stream made
// with fopencookie), so fprintf(stderr, ...) anywhere in trun cannot block either. Call once,
// early in main, before other threads start. std::cerr is not redirected.
void install_console();
// At exit: flushes stdio's stderr, then waits at most `bound` in all for both writers. Returns
// true when everything was written.
bool flush_console(std::chrono::milliseconds bound);
// Lines dropped so far on fd 1 and 2 together (0 when install_console() was not called).
uint64_t console_dropped_lines();

// An spdlog sink (thread-safe) that formats each message and writes it to console(fd).
std::shared_ptr<spdlog::sinks::sink> console_sink(int fd);

}  // namespace trun::agent
