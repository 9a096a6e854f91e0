#include "agent/console.h"

#include <signal.h>
#include <spdlog/sinks/base_sink.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <system_error>

#include "base/write_all.h"

namespace trun::agent {
namespace {

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Writes everything; gives up on an error other than EINTR (EPIPE: the reader went away, and
// there is nobody to tell). The counters move once the piece is written (or fails part way):
// run()'s pieces are at most kPiece (PIPE_BUF) bytes, one write(2) on a pipe.
void write_fully(int fd, const char* data, size_t size, std::atomic<uint64_t>* written = nullptr,
                 std::atomic<int64_t>* progress_ns = nullptr) {
  size_t n = 0;
  (void)base::write_all(fd, data, size, &n);
  if (n == 0) return;
  if (written) *written += static_cast<uint64_t>(n);
  if (progress_ns) *progress_ns = steady_ns();
}

uint64_t count_lines(std::string_view s) {
  if (s.empty()) return 0;
  auto n = static_cast<uint64_t>(std::count(s.begin(), s.end(), '\n'));
  return s.back() == '\n' ? n : n + 1;
}

// One write(2) at most: a blocking write returns only when all of it is taken, so this is also
// how often stalled() and flush() can see progress. PIPE_BUF: atomic on a pipe shared with others.
constexpr size_t kPiece = PIPE_BUF;

std::atomic<ConsoleWriter*> g_writers[2] = {nullptr, nullptr};

}  // namespace

struct ConsoleWriter::State {
  State(int fd, size_t capacity) : fd(fd), capacity(capacity) {}
  // Queues the "dropped" note for lines lost since the last one.
  void queue_drop_note_locked() {
    if (unreported == 0) return;
    buf += "trun: dropped " + std::to_string(unreported) +
           " console lines here: the console did not keep up (the log files under --log-dir "
           "keep all worker output)\n";
    unreported = 0;
  }

  const int fd;
  const size_t capacity;
  std::mutex mu;
  std::condition_variable wake;     // the writer thread: data or stop
  std::condition_variable drained;  // flush(): the buffer went empty
  std::string buf;                  // queued, not yet taken by the writer thread
  size_t in_flight = 0;             // bytes the writer thread is writing now
  uint64_t dropped = 0;
  uint64_t unreported = 0;  // dropped since the last note
  bool stop = false;
  std::atomic<uint64_t> written{0};  // bytes the fd took: flush() sees progress by it
  // When the fd last took bytes, or the buffer last went from empty to not (steady clock, ns).
  std::atomic<int64_t> progress_ns{0};
};

ConsoleWriter::ConsoleWriter(int fd, size_t capacity) : s_(std::make_shared<State>(fd, capacity)) {
  struct stat st;
  // A regular file never blocks; an fd that is not open fails at once. Both are written by the
  // caller, in order, with the description's offset and flags untouched.
  if (fstat(fd, &st) != 0 || S_ISREG(st.st_mode)) return;
  // The thread must never take a signal the agent waits for on its signalfd (or die of one).
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  try {
    thread_ = std::thread([s = s_] { run(s); });
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

ConsoleWriter::~ConsoleWriter() {
  if (!thread_.joinable()) return;
  const bool drained = flush(std::chrono::milliseconds(500));
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
  }
  s_->wake.notify_all();
  if (drained) {
    thread_.join();
  } else {
    thread_.detach();  // stuck in write(2); it owns a reference to the state
  }
}

void ConsoleWriter::write(std::string_view data) {
  if (data.empty()) return;
  State& s = *s_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!thread_.joinable()) {
    // Regular file: written here, under the lock, so concurrent callers never interleave.
    write_fully(s.fd, data.data(), data.size());
    return;
  }
  const size_t used = s.buf.size() + s.in_flight;
  const size_t room = used < s.capacity ? s.capacity - used : 0;
  size_t take = data.size();
  if (take > room) {
    // The longest run of whole lines that fits; the rest is dropped.
    size_t nl = room == 0 ? std::string_view::npos : data.rfind('\n', room - 1);
    take = nl == std::string_view::npos ? 0 : nl + 1;
    const uint64_t lost = count_lines(data.substr(take));
    s.dropped += lost;
    s.unreported += lost;
  }
  if (take == 0) return;
  if (used == 0) s.progress_ns = steady_ns();  // stalled() counts from here
  // The note goes where the gap is; it may exceed the capacity by its own few bytes.
  s.queue_drop_note_locked();
  s.buf.append(data.data(), take);
  lock.unlock();
  s.wake.notify_one();
}

bool ConsoleWriter::flush(std::chrono::milliseconds bound) {
  State& s = *s_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!thread_.joinable()) return true;
  s.queue_drop_note_locked();
  s.wake.notify_one();
  const auto deadline = std::chrono::steady_clock::now() + bound;
  auto done = [&s] { return s.buf.empty() && s.in_flight == 0; };
  // A console that takes nothing for kNoProgress is stalled: waiting out the bound would only
  // delay trun's exit.
  constexpr auto kNoProgress = std::chrono::milliseconds(100);
  for (int round = 0; round < 100000; ++round) {
    const auto now = std::chrono::steady_clock::now();
    if (done()) return true;
    if (now >= deadline) return false;
    const uint64_t before = s.written.load();
    if (s.drained.wait_until(lock, std::min(deadline, now + kNoProgress), done)) return true;
    if (s.written.load() == before) return false;
  }
  return done();
}

bool ConsoleWriter::has_room(size_t bytes) const {
  if (!thread_.joinable()) return true;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->buf.size() + s_->in_flight + bytes <= s_->capacity;
}

bool ConsoleWriter::stalled(std::chrono::milliseconds after) const {
  if (!thread_.joinable()) return false;
  std::lock_guard<std::mutex> lock(s_->mu);
  if (s_->buf.empty() && s_->in_flight == 0) return false;
  return steady_ns() - s_->progress_ns.load() >
         std::chrono::duration_cast<std::chrono::nanoseconds>(after).count();
}

uint64_t ConsoleWriter::dropped_lines() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->dropped;
}

void ConsoleWriter::run(const std::shared_ptr<State>& state) {
  State& s = *state;
  std::unique_lock<std::mutex> lock(s.mu);
  std::string chunk;
  for (;;) {
    s.wake.wait(lock, [&s] { return s.stop || !s.buf.empty(); });
    if (s.buf.empty()) return;  // stop, and nothing left
    chunk.clear();
    chunk.swap(s.buf);
    s.in_flight = chunk.size();
    lock.unlock();
    // The only place that may block. Pieces of at most kPiece bytes, cut after a newline where
    // possible, so flush() sees a slow reader's progress.
    for (size_t at = 0; at < chunk.size();) {
      size_t n = std::min(kPiece, chunk.size() - at);
      if (at + n < chunk.size()) {
        size_t nl = chunk.rfind('\n', at + n - 1);
        if (nl != std::string::npos && nl >= at) n = nl + 1 - at;
      }
      write_fully(s.fd, chunk.data() + at, n, &s.written, &s.progress_ns);
      at += n;
    }
    lock.lock();
    s.in_flight = 0;
    if (s.buf.empty()) s.drained.notify_all();
  }
}

ConsoleWriter& console(int fd) {
  // Never destroyed: a writer thread may still be blocked in write(2) when the process exits.
  static ConsoleWriter* out = [] {
    auto* w = new ConsoleWriter(STDOUT_FILENO, kConsoleBufferBytes);
    g_writers[0] = w;
    return w;
  }();
  static ConsoleWriter* err = [] {
    auto* w = new ConsoleWriter(STDERR_FILENO, kConsoleBufferBytes);
    g_writers[1] = w;
    return w;
  }();
  return fd == STDERR_FILENO ? *err : *out;
}

void install_console() {
  console(STDOUT_FILENO);
  console(STDERR_FILENO);
  cookie_io_functions_t io{};
  io.write = [](void*, const char* buf, size_t size) -> ssize_t {
    console(STDERR_FILENO).write(std::string_view(buf, size));
    return static_cast<ssize_t>(size);
  };
  FILE* f = fopencookie(nullptr, "w", io);
  if (f == nullptr) return;  // keep the plain stderr
  setvbuf(f, nullptr, _IOLBF, BUFSIZ);
  // glibc documents stdin/stdout/stderr as ordinary variables that a program may assign.
  stderr = f;
}

bool flush_console(std::chrono::milliseconds bound) {
  std::fflush(stderr);
  const auto deadline = std::chrono::steady_clock::now() + bound;
  bool all = true;
  for (auto& slot : g_writers) {
    ConsoleWriter* w = slot.load();
    if (w == nullptr) continue;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    all = w->flush(std::max(left, std::chrono::milliseconds(0))) && all;
  }
  return all;
}

uint64_t console_dropped_lines() {
  uint64_t n = 0;
  for (auto& slot : g_writers) {
    if (ConsoleWriter* w = slot.load()) n += w->dropped_lines();
  }
  return n;
}

namespace {

class ConsoleSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit ConsoleSink(int fd) : fd_(fd) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    console(fd_).write(std::string_view(formatted.data(), formatted.size()));
  }
  void flush_() override {}  // never waits: flush_console() does that, bounded, at exit

 private:
  int fd_;
};

}  // namespace

std::shared_ptr<spdlog::sinks::sink> console_sink(int fd) {
  return std::make_shared<ConsoleSink>(fd);
}

}  // namespace trun::agent
