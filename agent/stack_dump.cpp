#include "agent/stack_dump.h"

#include <cxxabi.h>
#include <dirent.h>
#include <errno.h>
#include <libunwind-ptrace.h>
#include <signal.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>

#include "agent/elf_symbols.h"

namespace trun::agent {
namespace {

using SteadyClock = std::chrono::steady_clock;

struct Mapping {
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t file_offset = 0;
  std::string path;
};

std::string errno_text(int e) { return std::generic_category().message(e); }

std::string proc_path(int pid, int tid, const char* leaf) {
  return "/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/" + leaf;
}

// The state letter of a /proc/.../stat file (after the last ')': comm may hold anything), '?'
// when it cannot be read (no such process or thread).
char read_state(const std::string& stat_path) {
  std::ifstream in(stat_path);
  std::string text;
  if (!in || !std::getline(in, text)) return '?';
  size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return '?';
  return text[close + 2];
}

int read_ppid(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return -1;
  size_t close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(text.substr(close + 2));
  char state = 0;
  int ppid = -1;
  rest >> state >> ppid;
  return ppid;
}

std::string read_comm(int pid, int tid) {
  std::ifstream in(proc_path(pid, tid, "comm"));
  std::string name;
  if (in) std::getline(in, name);
  return name;
}

// The file-backed mappings of /proc/<pid>/maps, sorted by address (as the kernel lists them).
std::vector<Mapping> read_maps(int pid) {
  std::vector<Mapping> maps;
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long start = 0, end = 0, offset = 0;
    int path_at = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx %*s %llx %*s %*s %n", &start, &end, &offset,
                    &path_at) < 3 ||
        path_at <= 0 || static_cast<size_t>(path_at) >= line.size() || line[path_at] != '/') {
      continue;
    }
    maps.push_back(Mapping{start, end, offset, line.substr(path_at)});
  }
  return maps;
}

const Mapping* find_mapping(const std::vector<Mapping>& maps, uint64_t addr) {
  auto it = std::upper_bound(maps.begin(), maps.end(), addr,
                             [](uint64_t a, const Mapping& m) { return a < m.start; });
  if (it == maps.begin()) return nullptr;
  --it;
  return addr < it->end ? &*it : nullptr;
}

// The thread ids of /proc/<pid>/task, the main thread first; empty with `err` set on failure.
std::vector<int> list_threads(int pid, int& err) {
  std::vector<int> tids;
  DIR* dir = ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
  if (dir == nullptr) {
    err = errno;
    return tids;
  }
  while (dirent* e = ::readdir(dir)) {
    char* end = nullptr;
    long tid = std::strtol(e->d_name, &end, 10);
    if (end != e->d_name && *end == '\0' && tid > 0) tids.push_back(static_cast<int>(tid));
  }
  ::closedir(dir);
  std::sort(tids.begin(), tids.end(), [pid](int a, int b) {
    if ((a == pid) != (b == pid)) return a == pid;
    return a < b;
  });
  return tids;
}

std::string demangle(const char* name) {
  int status = 0;
  char* out = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || out == nullptr) return name;
  std::string result(out);
  std::free(out);
  return result;
}

void sleep_us(long us) {
  timespec ts{0, us * 1000};
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

bool thread_gone(int pid, int tid) {
  char s = read_state(proc_path(pid, tid, "stat"));
  return s == '?' || s == 'Z' || s == 'X';
}

// The signal a ptrace stop reported by waitid carries, to hand back on PTRACE_DETACH: a
// signal-delivery-stop (si_status = the signal) holds a signal the thread would otherwise lose;
// PTRACE_EVENT_STOP (si_status = signal | PTRACE_EVENT_STOP << 8: our interrupt, or a group
// stop) holds none.
int signal_to_deliver(const siginfo_t& info) {
  if (info.si_code != CLD_TRAPPED || (info.si_status >> 8) != 0) return 0;
  return info.si_status & 0x7f;
}

// One try at letting go of thread `tid` of `pid`, traced by this thread. True when it is no
// longer traced: detached (it was in a ptrace stop), or dead and released. False while it runs
// (a stop is pending that it has not reached yet, e.g. uninterruptible sleep) or is dying.
bool try_release(int pid, int tid) {
  siginfo_t info;
  std::memset(&info, 0, sizeof info);
  int sig = 0;
  if (::waitid(P_PID, tid, &info, WSTOPPED | __WALL | WNOHANG) == 0 && info.si_pid == tid) {
    sig = signal_to_deliver(info);
  }
  if (::ptrace(PTRACE_DETACH, tid, nullptr, reinterpret_cast<void*>(static_cast<intptr_t>(sig))) ==
      0) {
    return true;
  }
  if (!thread_gone(pid, tid)) return false;
  // The main thread's real parent (the agent) reaps it as usual, traced or not: never wait for
  // it here. A traced non-leader thread that died stays a zombie until its tracer waits for it,
  // and holds back the process's exit report meanwhile; this wait matches that thread only (as
  // it does the main thread of a process whose parent is someone else: the kernel then reports
  // the exit to that parent).
  if (tid == pid && read_ppid(pid) == ::getpid()) return true;
  std::memset(&info, 0, sizeof info);
  if (::waitid(P_PID, tid, &info, WEXITED | __WALL | WNOHANG) != 0) return errno == ECHILD;
  return info.si_pid == tid;
}

// try_release until it succeeds or `grace` has passed.
bool release(int pid, int tid, std::chrono::milliseconds grace) {
  const SteadyClock::time_point until = SteadyClock::now() + grace;
  long pause_us = 20;
  while (!try_release(pid, tid)) {
    if (SteadyClock::now() >= until) return false;
    sleep_us(pause_us);
    pause_us = std::min(pause_us * 2, 1000L);
  }
  return true;
}

// A thread that was asked to stop gets this long after its timeout to do so, so that it can be
// detached: one that is runnable stops within a scheduler tick or two.
constexpr std::chrono::milliseconds kReleaseGrace{20};

// Lets go of `tid`, or, when it still has not stopped, notes it in `left_traced`: the kernel
// detaches it when the tracer thread exits.
void release_or_leave(int pid, int tid, std::vector<int>& left_traced) {
  if (!release(pid, tid, kReleaseGrace)) left_traced.push_back(tid);
}

// The TracerPid of /proc/<pid>/task/<tid>/status; 0 when untraced or gone.
int tracer_of(int pid, int tid) {
  std::ifstream in(proc_path(pid, tid, "status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("TracerPid:", 0) == 0) return std::atoi(line.c_str() + 10);
  }
  return 0;
}

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

void unwind(unw_addr_space_t as, int tid, const std::vector<Mapping>& maps,
            const StackDumpOptions& options, SteadyClock::time_point deadline, ThreadStack& t) {
  void* upt = _UPT_create(tid);
  if (upt == nullptr) {
    t.error = "_UPT_create failed";
    return;
  }
  unw_cursor_t cursor;
  int rc = unw_init_remote(&cursor, as, upt);
  if (rc < 0) {
    t.error = std::string("unw_init_remote: ") + unw_strerror(rc);
    _UPT_destroy(upt);
    return;
  }
  for (;;) {
    if (static_cast<int>(t.frames.size()) >= options.max_frames) {
      t.truncated = unw_step(&cursor) > 0;
      break;
    }
    StackFrame frame;
    unw_word_t ip = 0;
    if (unw_get_reg(&cursor, UNW_REG_IP, &ip) < 0) break;
    frame.pc = ip;
    char name[1024];
    unw_word_t offset = 0;
    rc = unw_get_proc_name(&cursor, name, sizeof name, &offset);
    if (rc == 0 || rc == -UNW_ENOMEM) {  // ENOMEM: the name was cut to fit
      name[sizeof name - 1] = '\0';
      frame.function = demangle(name);
      frame.offset = offset;
    }
    // A return address may be just past the end of its call's mapping: look up the call.
    const Mapping* m = find_mapping(maps, t.frames.empty() || ip == 0 ? ip : ip - 1);
    if (m != nullptr) {
      frame.module = m->path;
      if (frame.function.empty()) frame.offset = ip - m->start + m->file_offset;
    }
    t.frames.push_back(std::move(frame));
    if (SteadyClock::now() >= deadline) {
      t.truncated = true;
      t.error = "time budget ran out during the unwind";
      break;
    }
    if (unw_step(&cursor) <= 0) break;  // 0: the outermost frame; < 0: no unwind info further
  }
  _UPT_destroy(upt);
}

ThreadStack dump_thread(int pid, int tid, unw_addr_space_t as, const std::vector<Mapping>& maps,
                        const StackDumpOptions& options, SteadyClock::time_point deadline,
                        std::vector<int>& left_traced) {
  ThreadStack t;
  t.tid = tid;
  t.name = read_comm(pid, tid);
  t.state = read_state(proc_path(pid, tid, "stat"));
  if (SteadyClock::now() >= deadline) {
    t.error = "not dumped: time budget";
    return t;
  }
  if (t.state == '?' || t.state == 'Z' || t.state == 'X') {
    t.error = "exited before it could be attached";
    return t;
  }
  if (::ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0) {
    int e = errno;
    t.error = e == ESRCH ? "exited before it could be attached" : "PTRACE_SEIZE: " + errno_text(e);
    return t;
  }
  if (::ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) != 0) {
    t.error = "PTRACE_INTERRUPT: " + errno_text(errno);
    release_or_leave(pid, tid, left_traced);
    return t;
  }
  // A thread in a system call stops at once (the call is restarted after the detach), one in
  // user code at its next kernel entry; one in uninterruptible sleep only when that ends.
  const SteadyClock::time_point seized = SteadyClock::now();
  const SteadyClock::time_point stop_deadline =
      std::min(deadline, seized + options.thread_stop_timeout);
  bool stopped = false;
  int sig = 0;
  long pause_us = 20;
  for (;;) {
    siginfo_t info;
    std::memset(&info, 0, sizeof info);
    if (::waitid(P_PID, tid, &info, WSTOPPED | __WALL | WNOHANG) == 0) {
      if (info.si_pid == tid) {
        stopped = true;
        sig = signal_to_deliver(info);
        break;
      }
    } else if (errno != EINTR) {
      t.error = "waitid: " + errno_text(errno);  // ECHILD: the thread is gone
      break;
    }
    if (thread_gone(pid, tid)) {
      t.error = "exited during the dump";
      break;
    }
    if (SteadyClock::now() >= stop_deadline) {
      t.error =
          "did not stop within " + ms_text(std::chrono::duration_cast<std::chrono::milliseconds>(
                                       SteadyClock::now() - seized));
      break;
    }
    sleep_us(pause_us);
    pause_us = std::min(pause_us * 2, 1000L);
  }
  if (!stopped) {
    release_or_leave(pid, tid, left_traced);
    return t;
  }
  unwind(as, tid, maps, options, deadline, t);
  if (::ptrace(PTRACE_DETACH, tid, nullptr, reinterpret_cast<void*>(static_cast<intptr_t>(sig))) !=
      0) {
    if (t.error.empty()) t.error = "exited during the dump";
    release_or_leave(pid, tid, left_traced);
  }
  return t;
}

// The dump itself, on the tracer thread.
// The modules of one process's dump, each read once (agent/elf_symbols.h).
class Modules {
 public:
  ElfSymbols& get(const std::string& path) {
    auto& m = modules_[path];
    if (!m) m = std::make_unique<ElfSymbols>(path);
    return *m;
  }
  bool has(const std::string& path) const { return modules_.count(path) != 0; }

 private:
  std::map<std::string, std::unique_ptr<ElfSymbols>> modules_;
};

// What find_proc_info needs besides libunwind's argument: set by dump_process on the tracer
// thread, for its dump.
struct UnwindContext {
  const std::vector<Mapping>* maps = nullptr;
  Modules* modules = nullptr;
};
thread_local UnwindContext t_unwind;

#if defined(__x86_64__)
// libunwind's own table search (exported by libunwind-x86_64, not declared in its headers):
// what _UPT_find_proc_info calls once it has found a module's .eh_frame_hdr.
extern "C" int _Ux86_64_dwarf_search_unwind_table(unw_addr_space_t as, unw_word_t ip,
                                                  unw_dyn_info_t* di, unw_proc_info_t* pi,
                                                  int need_unwind_info, void* arg);
#endif

// _UPT_find_proc_info, except where libunwind 1.6 gets the module's load address wrong: it takes
// the first loadable segment whose file offset equals the mapping's, which in a file laid out by
// lld (a code segment whose file offset is not its address, within a page shared with the
// read-only one) is the read-only segment, a page off. The table it then searches gives no
// entry for the frame, and the stack ends there. For such a module the load address comes from
// the segment that really holds the frame's file offset, and libunwind searches the right table.
int find_proc_info(unw_addr_space_t as, unw_word_t ip, unw_proc_info_t* pi, int need_unwind_info,
                   void* arg) {
#if defined(__x86_64__)
  const Mapping* m = t_unwind.maps ? find_mapping(*t_unwind.maps, ip) : nullptr;
  if (m != nullptr && t_unwind.modules != nullptr) {
    ElfSymbols& elf = t_unwind.modules->get(m->path);
    const uint64_t file_offset = ip - m->start + m->file_offset;
    const ElfSymbols::Segment* seg = elf.segment_of(file_offset);
    if (seg != nullptr && elf.eh_frame_hdr()) {
      const uint64_t bias = ip - (file_offset - seg->offset + seg->vaddr);
      const ElfSymbols::Segment* theirs = nullptr;
      for (const ElfSymbols::Segment& s : elf.segments()) {
        if (s.offset == m->file_offset) {
          theirs = &s;
          break;
        }
      }
      if (theirs == nullptr || m->start - theirs->vaddr != bias) {
        uint64_t lo = UINT64_MAX, hi = 0;
        for (const ElfSymbols::Segment& s : elf.segments()) {
          lo = std::min(lo, s.vaddr);
          hi = std::max(hi, s.vaddr + s.memsz);
        }
        const ElfSymbols::EhFrameHdr& hdr = *elf.eh_frame_hdr();
        unw_dyn_info_t di;
        std::memset(&di, 0, sizeof di);
        di.format = UNW_INFO_FORMAT_REMOTE_TABLE;
        di.start_ip = bias + lo;
        di.end_ip = bias + hi;
        di.u.rti.segbase = bias + hdr.vaddr;  // the table's entries are relative to the header
        di.u.rti.table_data = bias + hdr.table_vaddr;
        di.u.rti.table_len = uint64_t{hdr.fde_count} * 8 / sizeof(unw_word_t);
        return _Ux86_64_dwarf_search_unwind_table(as, ip, &di, pi, need_unwind_info, arg);
      }
    }
  }
#endif
  return _UPT_find_proc_info(as, ip, pi, need_unwind_info, arg);
}

// Names the frames that libunwind could not (agent/elf_symbols.h) from their modules' symbol
// tables, after every thread was released. Such a frame's offset is then the virtual address
// that addr2line takes, not the file offset, where the two differ.
void name_from_symbol_tables(std::vector<ThreadStack>& threads, Modules& tables,
                             SteadyClock::time_point deadline) {
  for (ThreadStack& t : threads) {
    for (size_t i = 0; i < t.frames.size(); ++i) {
      StackFrame& f = t.frames[i];
      if (!f.function.empty() || f.module.empty()) continue;
      if (!tables.has(f.module) && SteadyClock::now() >= deadline) continue;
      ElfSymbols& table = tables.get(f.module);
      const std::optional<uint64_t> address = table.address_of(f.offset);
      if (!address) continue;
      f.offset = *address;
      // A return address (every frame but the innermost) may be just past its call's function.
      const ElfSymbols::Symbol* sym = table.function_at(i == 0 ? *address : *address - 1);
      if (sym == nullptr) continue;
      f.function = demangle(sym->name.c_str());
      f.offset = *address - sym->start;
    }
  }
}

void dump_process(int pid, const StackDumpOptions& options, SteadyClock::time_point deadline,
                  ProcessStacks& out, std::vector<int>& left_traced) {
  if (pid <= 0) {
    out.error = "invalid pid " + std::to_string(pid);
    return;
  }
  const char state = read_state("/proc/" + std::to_string(pid) + "/stat");
  if (state == '?') {
    out.error = "no such process";
    return;
  }
  if (state == 'Z' || state == 'X') {
    out.error = "the process has exited (zombie)";
    return;
  }
  out.was_stopped = state == 'T';
  int err = 0;
  std::vector<int> tids = list_threads(pid, err);
  if (tids.empty()) {
    out.error = err != 0 ? "/proc/" + std::to_string(pid) + "/task: " + errno_text(err)
                         : "no threads (the process has exited)";
    return;
  }
  const size_t max_threads = static_cast<size_t>(std::max(options.max_threads, 1));
  if (tids.size() > max_threads) {
    out.threads_omitted = static_cast<int>(tids.size() - max_threads);
    tids.resize(max_threads);
  }
  const std::vector<Mapping> maps = read_maps(pid);
  // One address space per process: its caches (unwind tables found per module) serve every
  // thread of it.
  unw_accessors_t accessors = _UPT_accessors;
  accessors.find_proc_info = find_proc_info;
  unw_addr_space_t as = unw_create_addr_space(&accessors, 0);
  if (as == nullptr) {
    out.error = "unw_create_addr_space failed";
    return;
  }
  unw_set_caching_policy(as, UNW_CACHE_GLOBAL);
  Modules modules;
  t_unwind = UnwindContext{&maps, &modules};
  for (int tid : tids) {
    out.threads.push_back(dump_thread(pid, tid, as, maps, options, deadline, left_traced));
  }
  t_unwind = UnwindContext{};
  unw_destroy_addr_space(as);
  name_from_symbol_tables(out.threads, modules, deadline);
}

}  // namespace

ProcessStacks dump_native_stacks(int pid, const StackDumpOptions& options) {
  const SteadyClock::time_point start = SteadyClock::now();
  ProcessStacks out;
  out.pid = pid;
  std::vector<int> left_traced;
  // ptrace's tracer is a thread: when this one exits, the kernel detaches every thread it still
  // traces (one that never stopped) and releases those that died traced, so nothing stays
  // attached after the call, whatever happened.
  try {
    std::thread tracer([&] {
      try {
        dump_process(pid, options, start + options.budget, out, left_traced);
      } catch (const std::exception& e) {
        out.error = std::string("stack dump failed: ") + e.what();
      }
    });
    tracer.join();
  } catch (const std::system_error& e) {
    out.error = std::string("could not start the tracer thread: ") + e.what();
  }
  // join() returns once the thread's tid is cleared, a moment before the kernel detaches its
  // tracees: wait for that (bounded), so the caller's next wait cannot see their ptrace stops.
  const SteadyClock::time_point until = SteadyClock::now() + std::chrono::milliseconds(100);
  for (int tid : left_traced) {
    while (tracer_of(pid, tid) != 0 && SteadyClock::now() < until) sleep_us(200);
  }
  out.elapsed_ms = std::chrono::duration<double, std::milli>(SteadyClock::now() - start).count();
  return out;
}

std::string format_stacks(const ProcessStacks& stacks) {
  std::string s;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", stacks.elapsed_ms);
  s += "process " + std::to_string(stacks.pid);
  if (!stacks.error.empty()) return s + ": error: " + stacks.error + "\n";
  s += ": " + std::to_string(stacks.threads.size()) + " threads";
  if (stacks.threads_omitted > 0) s += " (+" + std::to_string(stacks.threads_omitted) + " omitted)";
  if (stacks.was_stopped) s += " (stopped)";
  s += " in " + std::string(buf) + " ms\n";
  for (const ThreadStack& t : stacks.threads) {
    s += "thread " + std::to_string(t.tid) + " (" + t.name + ") state " + t.state + ":";
    if (!t.error.empty()) s += " error: " + t.error;
    s += "\n";
    for (size_t i = 0; i < t.frames.size(); ++i) {
      const StackFrame& f = t.frames[i];
      std::snprintf(buf, sizeof buf, "  #%zu 0x%016" PRIx64 " ", i, f.pc);
      s += buf;
      if (f.function.empty()) {
        s += "??";
      } else {
        std::snprintf(buf, sizeof buf, "+0x%" PRIx64, f.offset);
        s += f.function + buf;
      }
      if (!f.module.empty()) {
        s += " (" + f.module;
        if (f.function.empty()) {
          std::snprintf(buf, sizeof buf, "+0x%" PRIx64, f.offset);
          s += buf;
        }
        s += ")";
      }
      s += "\n";
    }
    if (t.truncated) s += "  ... (truncated)\n";
  }
  return s;
}

}  // namespace trun::agent
