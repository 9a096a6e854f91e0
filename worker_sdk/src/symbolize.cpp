#include "worker_sdk/src/symbolize.h"

#include <dlfcn.h>
#include <elf.h>
#include <execinfo.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

extern char** environ;

namespace trun::worker::detail {
namespace {

using Clock = std::chrono::steady_clock;

// One source location of a frame: the innermost call first, then the calls it was inlined into.
struct Location {
  std::string function;
  std::string file_line;
};

// Whether `path` is a position-independent ELF file (a PIE executable or a shared library), whose
// addresses addr2line takes relative to the load base; a fixed-address executable (ET_EXEC, as
// the -no-pie sanitizer builds are) takes absolute ones.
bool position_independent(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;
  Elf64_Ehdr header{};
  ssize_t n = read(fd, &header, sizeof header);
  close(fd);
  return n != static_cast<ssize_t>(sizeof header) || header.e_type != ET_EXEC;
}

// Runs `addr2line -a -f -i -C -e module addresses...` and returns its output, or "" when it
// cannot be started or does not finish by `deadline` (it is killed then).
std::string run_addr2line(const std::string& module, const std::vector<std::string>& addresses,
                          Clock::time_point deadline) {
  std::vector<std::string> args = {"addr2line", "-a", "-f", "-i", "-C", "-e", module};
  args.insert(args.end(), addresses.begin(), addresses.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return "";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  // The default signal mask and dispositions: the program may block or ignore signals.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  int rc = posix_spawnp(&pid, "addr2line", &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(out[1]);
  if (rc != 0) {
    close(out[0]);
    return "";
  }
  std::string text;
  bool complete = false;
  char buf[4096];
  while (!complete) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    pollfd p{out[0], POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    ssize_t n = read(out[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      complete = n == 0;
      break;
    }
    text.append(buf, static_cast<size_t>(n));
  }
  close(out[0]);
  if (!complete) kill(pid, SIGKILL);
  while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  return complete ? text : "";
}

// addr2line -a prints each address ("0x...") and then one function line and one file:line line
// per location, innermost first.
std::map<std::string, std::vector<Location>> parse(const std::string& text) {
  std::map<std::string, std::vector<Location>> out;
  std::istringstream in(text);
  std::string line, current;
  while (std::getline(in, line)) {
    if (line.rfind("0x", 0) == 0) {
      // addr2line pads the address to 16 digits; the queries were written without padding.
      size_t first = line.find_first_not_of('0', 2);
      current = "0x" + (first == std::string::npos ? "0" : line.substr(first));
      continue;
    }
    std::string where;
    if (current.empty() || !std::getline(in, where)) break;
    out[current].push_back({line, where});
  }
  return out;
}

bool resolved(const Location& l) { return l.function != "??" && l.file_line.rfind("??", 0) != 0; }

std::string hex(uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%lx", static_cast<unsigned long>(v));
  return buf;
}

}  // namespace

std::string symbolize(const std::vector<void*>& frames, std::chrono::milliseconds budget) {
  const auto deadline = Clock::now() + budget;
  std::unique_ptr<char*, void (*)(void*)> syms(
      backtrace_symbols(frames.data(), static_cast<int>(frames.size())), std::free);

  // Each frame's query: its module and the address addr2line takes for it. Every frame is a
  // return address, which points after its call: the call's line is looked up one byte earlier.
  std::vector<std::pair<std::string, std::string>> query(frames.size());
  std::map<std::string, std::vector<std::string>> by_module;
  std::map<std::string, bool> pic;
  for (size_t i = 0; i < frames.size(); ++i) {
    Dl_info info{};
    if (dladdr(frames[i], &info) == 0 || info.dli_fname == nullptr || info.dli_fname[0] == '\0')
      continue;
    std::string module = info.dli_fname;
    // The main program is named as it was started (argv[0]), which may be a bare name found on
    // PATH; the kernel knows its file.
    if (module.find('/') == std::string::npos) {
      if (module != program_invocation_name) continue;
      module = "/proc/self/exe";
    }
    auto known = pic.find(module);
    if (known == pic.end()) known = pic.emplace(module, position_independent(module)).first;
    uintptr_t address = reinterpret_cast<uintptr_t>(frames[i]);
    if (address > 0) --address;
    if (known->second) address -= reinterpret_cast<uintptr_t>(info.dli_fbase);
    query[i] = {module, hex(address)};
    by_module[module].push_back(query[i].second);
  }
  std::map<std::string, std::map<std::string, std::vector<Location>>> found;
  for (auto& [module, addresses] : by_module) {
    if (Clock::now() >= deadline) break;
    found[module] = parse(run_addr2line(module, addresses, deadline));
  }

  std::string out;
  for (size_t i = 0; i < frames.size(); ++i) {
    out += "#" + std::to_string(i) + " ";
    const std::vector<Location>* locations = nullptr;
    if (!query[i].first.empty()) {
      auto m = found.find(query[i].first);
      if (m != found.end()) {
        auto a = m->second.find(query[i].second);
        if (a != m->second.end() && !a->second.empty() && resolved(a->second.front()))
          locations = &a->second;
      }
    }
    if (locations == nullptr) {
      out += syms ? syms.get()[i] : hex(reinterpret_cast<uintptr_t>(frames[i]));
      out += "\n";
      continue;
    }
    for (size_t k = 0; k < locations->size(); ++k) {
      const Location& l = (*locations)[k];
      if (k > 0) out += "    inlined into ";
      out += l.function + " at " + l.file_line + "\n";
    }
  }
  return out;
}

}  // namespace trun::worker::detail
