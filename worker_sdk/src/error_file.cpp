#include "trun/error_file.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include "worker_sdk/src/symbolize.h"

namespace trun::worker {
namespace {

// ---- JSON ----

void append_escaped(std::string& out, const std::string& s) {
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
}

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                           std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

// ---- state shared with the signal handler (fixed storage: no allocation there) ----

char g_path[4096];
std::atomic<bool> g_installed{false};
std::atomic<bool> g_written{false};  // first report wins (terminate, then its SIGABRT)
std::terminate_handler g_previous_terminate = nullptr;
constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
char g_altstack[64 * 1024];

// Async-signal-safe buffer writer.
struct SafeBuf {
  char data[32 * 1024];
  size_t len = 0;
  void put(char c) {
    if (len + 1 < sizeof data) data[len++] = c;
  }
  void raw(const char* s) {
    while (s && *s) put(*s++);
  }
  void esc(const char* s) {
    for (; s && *s; ++s) {
      unsigned char c = static_cast<unsigned char>(*s);
      if (c == '"' || c == '\\') {
        put('\\');
        put(static_cast<char>(c));
      } else if (c == '\n') {
        raw("\\n");
      } else if (c < 0x20) {
        put(' ');
      } else {
        put(static_cast<char>(c));
      }
    }
  }
  void num(unsigned long long v) {
    char tmp[24];
    int n = 0;
    do {
      tmp[n++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v);
    while (n) put(tmp[--n]);
  }
  void hex(uintptr_t v) {
    raw("0x");
    char tmp[20];
    int n = 0;
    do {
      tmp[n++] = "0123456789abcdef"[v & 15];
      v >>= 4;
    } while (v);
    while (n) put(tmp[--n]);
  }
};

SafeBuf g_buf;

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
  }
  return "signal";
}

void on_fatal_signal(int sig) {
  if (!g_written.exchange(true) && g_path[0]) {
    void* frames[64];
    int n = backtrace(frames, 64);
    SafeBuf& b = g_buf;
    b.len = 0;
    b.raw("{\"message\": {\"message\": \"");
    b.raw("Fatal signal ");
    b.raw(signal_name(sig));
    b.raw(" (");
    b.num(static_cast<unsigned>(sig));
    b.raw(") in pid ");
    b.num(static_cast<unsigned long long>(getpid()));
    b.raw("\", \"extraInfo\": {\"py_callstack\": \"");
    for (int i = 0; i < n; ++i) {
      b.raw("#");
      b.num(static_cast<unsigned>(i));
      b.raw(" ");
      b.hex(reinterpret_cast<uintptr_t>(frames[i]));
      Dl_info info;  // dladdr does not allocate in glibc; good enough for a dying process
      if (dladdr(frames[i], &info)) {
        b.raw(" in ");
        b.esc(info.dli_sname ? info.dli_sname : "??");
        b.raw(" from ");
        b.esc(info.dli_fname ? info.dli_fname : "??");
      }
      b.raw("\\n");
    }
    b.raw("\", \"timestamp\": \"");
    b.num(static_cast<unsigned long long>(time(nullptr)));
    b.raw("\"}}}\n");
    int fd = open(g_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      size_t off = 0;
      while (off < b.len) {
        ssize_t w = write(fd, b.data + off, b.len - off);
        if (w <= 0) break;
        off += static_cast<size_t>(w);
      }
      close(fd);
    }
  }
  // Die of the same signal, so the exit status still tells the agent what happened.
  signal(sig, SIG_DFL);
  raise(sig);
}

std::string describe_current_exception() {
  std::exception_ptr e = std::current_exception();
  if (!e) return "std::terminate called without an active exception";
  std::type_info* t = abi::__cxa_current_exception_type();
  std::string type = t ? demangle(t->name()) : "unknown exception";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return type + ": " + ex.what();
  } catch (...) {
    return type;
  }
}

// The stack trace of an error file written for an exception: the exception first, as the last
// line of a Python traceback names it, so that a summary showing only the trace (torchrun's)
// still says what failed. Not inlined, so that the frames it skips are always itself and its
// caller (the handler).
__attribute__((noinline)) std::string exception_trace(const std::string& what) {
  return what + "\n" + current_stack_trace(2);
}

void on_terminate() {
  if (!g_written.exchange(true) && g_path[0]) {
    std::string what = describe_current_exception();
    write_error_file(g_path, what, exception_trace(what));
  }
  if (g_previous_terminate) g_previous_terminate();
  std::abort();
}

}  // namespace

bool write_error_file(const std::string& path, const std::string& message,
                      const std::string& stack_trace) {
  if (path.empty()) return false;
  std::string json = "{\"message\": {\"message\": \"";
  append_escaped(json, message);
  json += "\", \"extraInfo\": {\"py_callstack\": \"";
  append_escaped(json, stack_trace);
  json += "\", \"timestamp\": \"" + std::to_string(static_cast<long long>(std::time(nullptr))) +
          "\"}}}\n";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "[trun.worker] cannot write error file %s: %s\n", path.c_str(),
                 std::strerror(errno));
    return false;
  }
  bool ok = std::fwrite(json.data(), 1, json.size(), f) == json.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) std::fprintf(stderr, "[trun.worker] short write to error file %s\n", path.c_str());
  return ok;
}

__attribute__((noinline)) std::string current_stack_trace(int skip_frames) {
  void* frames[128];
  int n = backtrace(frames, 128);
  int first = std::min(n, 1 + std::max(skip_frames, 0));  // this function's own frame too
  return detail::symbolize(std::vector<void*>(frames + first, frames + n));
}

bool install_error_handler(const std::string& error_file_path) {
  std::string path = error_file_path;
  if (path.empty()) {
    const char* v = std::getenv("TORCHELASTIC_ERROR_FILE");
    if (v) path = v;
  }
  if (path.empty() || path.size() >= sizeof g_path) return false;
  std::memcpy(g_path, path.c_str(), path.size() + 1);
  if (g_installed.exchange(true)) return true;

  void* warm[2];
  backtrace(warm, 2);  // loads libgcc now: backtrace() may allocate the first time only
  stack_t ss{};
  ss.ss_sp = g_altstack;
  ss.ss_size = sizeof g_altstack;
  sigaltstack(&ss, nullptr);  // lets a stack overflow still be reported
  struct sigaction sa {};
  sa.sa_handler = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_ONSTACK | SA_RESETHAND;
  for (int sig : kSignals) sigaction(sig, &sa, nullptr);
  g_previous_terminate = std::set_terminate(on_terminate);
  return true;
}

namespace detail {
void record_current_exception() {
  std::string path = g_path[0] ? std::string(g_path) : "";
  if (path.empty()) {
    const char* v = std::getenv("TORCHELASTIC_ERROR_FILE");
    if (v) path = v;
  }
  if (path.empty()) return;
  if (!g_written.exchange(true)) {
    std::string what = describe_current_exception();
    write_error_file(path, what, exception_trace(what));
  }
}
}  // namespace detail

}  // namespace trun::worker
