#include "agent/failure_report.h"

#include <limits.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace trun::agent {
namespace {

using nlohmann::json;

constexpr const char* kNotAvailable = "<N/A>";
constexpr const char* kNoTraceback =
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html";

std::string iso_time(int64_t ts) {
  std::time_t t = static_cast<std::time_t>(ts);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

// Accepts a JSON number or a decimal string (PyTorch writes the timestamp as a string).
bool json_int(const json& v, int64_t& out) {
  try {
    if (v.is_number_integer()) {
      out = v.get<int64_t>();
      return true;
    }
    if (v.is_number()) {
      out = static_cast<int64_t>(v.get<double>());
      return true;
    }
    if (v.is_string()) {
      out = std::stoll(v.get<std::string>());
      return true;
    }
  } catch (const std::exception&) {
  }
  return false;
}

std::string indent(const std::string& s) {
  std::string out;
  for (char c : s) {
    out.push_back(c);
    if (c == '\n') out += "  ";
  }
  return out;
}

// An error file is the worker's to write, and a worker is any program: what the agent reads of
// one is bounded (a @record file is a few KiB; a traceback of 1 MiB is already unreadable).
constexpr size_t kMaxErrorFileBytes = 1 << 20;

std::string read_bounded(const std::string& path, size_t limit) {
  std::ifstream in(path, std::ios::binary);
  std::string text(limit, '\0');
  in.read(text.data(), static_cast<std::streamsize>(limit));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

// What the summary shows as the traceback: the stack trace when it names the error already (a
// Python traceback ends with "ValueError: ..."; libtrun_worker's starts with its exception),
// otherwise the error first and then the trace (a C++ frame list says nothing by itself).
std::string lead_with_message(const std::string& what, const std::string& trace) {
  if (trace.empty()) return what;
  if (what.empty() || trace.find(what) != std::string::npos) return trace;
  return what + "\n" + trace;
}

}  // namespace

std::string signal_name(int sig) {
  static const std::pair<int, const char*> kNames[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"},  {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},    {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"},  {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"},  {SIGCHLD, "SIGCHLD"},
      {SIGCONT, "SIGCONT"}, {SIGSTOP, "SIGSTOP"}, {SIGTSTP, "SIGTSTP"},  {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"},   {SIGWINCH, "SIGWINCH"}};
  for (const auto& [n, name] : kNames) {
    if (n == sig) return name;
  }
  return "SIG" + std::to_string(sig);
}

WorkerFailure read_failure(int local_rank, int rank, pid_t pid, int exitcode,
                           const std::string& error_file_path, uint64_t sequence) {
  WorkerFailure f;
  f.local_rank = local_rank;
  f.rank = rank;
  f.pid = pid;
  f.exitcode = exitcode;
  f.sequence = sequence;
  f.timestamp = static_cast<int64_t>(std::time(nullptr));
  f.error_file = kNotAvailable;

  struct stat st;
  if (!error_file_path.empty() && stat(error_file_path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    f.error_file = error_file_path;
    std::string text = read_bounded(error_file_path, kMaxErrorFileBytes);
    json data = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (static_cast<uint64_t>(st.st_size) > kMaxErrorFileBytes) {
      f.message = "error file " + error_file_path + " is " + std::to_string(st.st_size) +
                  " bytes, over the " + std::to_string(kMaxErrorFileBytes) +
                  " that trun reads of one; it starts: " + text.substr(0, 500);
    } else if (data.is_discarded() || !data.is_object() || !data.contains("message")) {
      f.message = "error file " + error_file_path +
                  " is not in @record's JSON format: " + text.substr(0, 500);
    } else {
      f.error_json = text;
      const json& m = data["message"];
      int64_t ts = 0;
      if (m.is_string()) {
        f.message = m.get<std::string>();
        if (data.contains("timestamp") && json_int(data["timestamp"], ts)) f.timestamp = ts;
      } else if (m.is_object()) {
        const json* extra = m.contains("extraInfo") ? &m["extraInfo"] : nullptr;
        std::string what, trace;
        if (m.contains("message") && m["message"].is_string()) what = m["message"];
        if (extra && extra->is_object() && extra->contains("py_callstack") &&
            (*extra)["py_callstack"].is_string()) {
          trace = (*extra)["py_callstack"];
        }
        f.message = lead_with_message(what, trace);
        if (f.message.empty()) f.message = kNotAvailable;
        if (extra && extra->is_object() && extra->contains("timestamp") &&
            json_int((*extra)["timestamp"], ts)) {
          f.timestamp = ts;
        }
      }
    }
  }
  if (f.message.empty()) {
    if (exitcode < 0) {
      f.message = "Signal " + std::to_string(-exitcode) + " (" + signal_name(-exitcode) +
                  ") received by PID " + std::to_string(pid);
    } else {
      f.message = kNoTraceback;
    }
  }
  return f;
}

std::string python_start_hint(const std::string& interpreter, const std::string& path,
                              double seconds_alive, int exitcode, const std::string& message) {
  if (exitcode <= 0 || seconds_alive >= 1.0 || interpreter.empty()) return "";
  std::string resolved = interpreter;
  if (interpreter.find('/') == std::string::npos) {
    resolved.clear();
    size_t start = 0;
    for (size_t i = 0; i < 4096 && start <= path.size(); ++i) {
      size_t end = path.find(':', start);
      if (end == std::string::npos) end = path.size();
      std::string dir = path.substr(start, end - start);
      std::string candidate = (dir.empty() ? "." : dir) + "/" + interpreter;
      if (access(candidate.c_str(), X_OK) == 0) {
        resolved = candidate;
        break;
      }
      start = end + 1;
    }
  }
  char real[PATH_MAX];
  if (!resolved.empty() && realpath(resolved.c_str(), real) != nullptr && resolved != real) {
    resolved += " -> " + std::string(real);
  }
  const bool import = message.find("ModuleNotFoundError") != std::string::npos ||
                      message.find("ImportError") != std::string::npos;
  char alive[32];
  std::snprintf(alive, sizeof alive, "%.2f", seconds_alive);
  std::string hint =
      std::string(import ? "the worker failed to import a module"
                         : "the worker exited with " + std::to_string(exitcode) + " " + alive +
                               " s after it started, as a failed "
                               "import does") +
      "; it ran the Python interpreter '" + interpreter + "'";
  if (interpreter.find('/') == std::string::npos) {
    hint += resolved.empty() ? " (not found on PATH)" : " (" + resolved + " on PATH)";
  } else if (resolved != interpreter) {
    hint += " (" + resolved + ")";
  }
  hint +=
      ". If that interpreter lacks your packages, set PYTHON_EXEC to one that has them "
      "(e.g. PYTHON_EXEC=/usr/bin/python3).";
  return hint;
}

size_t root_cause_index(const std::vector<WorkerFailure>& failures) {
  size_t best = 0;
  for (size_t i = 1; i < failures.size(); ++i) {
    const auto& a = failures[i];
    const auto& b = failures[best];
    if (a.timestamp < b.timestamp || (a.timestamp == b.timestamp && a.sequence < b.sequence)) {
      best = i;
    }
  }
  return best;
}

std::string ms_time(int64_t ms) {
  if (ms < 0) return "an unknown time";
  char frac[8];
  std::snprintf(frac, sizeof frac, ".%03d", static_cast<int>(ms % 1000));
  std::string t = iso_time(ms / 1000);
  std::replace(t.begin(), t.end(), '_', ' ');
  return t + frac;
}

std::string root_cause_line(const RootCause& root) {
  return "root cause: " + root.detail + " (node " + root.node_id + ", at " +
         ms_time(root.failed_at_ms) + ")";
}

std::string format_summary(const std::string& name, const std::vector<WorkerFailure>& failures,
                           const std::string& hostname, const RootCause* across) {
  const std::string title = name + " FAILED";
  const bool remote = across && !across->local;
  // A remote root cause: no local failure is it (SIZE_MAX matches none).
  size_t root = remote || failures.empty() ? SIZE_MAX : root_cause_index(failures);
  // Failures are listed by global rank, as torchrun's dict is.
  std::vector<size_t> order(failures.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return failures[a].rank < failures[b].rank; });
  std::string root_fmt;
  std::vector<std::string> others;
  size_t width = title.size();
  for (size_t idx = 0; idx < order.size(); ++idx) {
    const auto& f = failures[order[idx]];
    std::string exit_desc = std::to_string(f.exitcode);
    if (f.exitcode < 0) exit_desc += " (" + signal_name(-f.exitcode) + ")";
    std::string fmt =
        "[" + std::to_string(idx) + "]:\n" + "  time      : " + iso_time(f.timestamp) + "\n" +
        "  host      : " + hostname + "\n" + "  rank      : " + std::to_string(f.rank) +
        " (local_rank: " + std::to_string(f.local_rank) + ")\n" + "  exitcode  : " + exit_desc +
        " (pid: " + std::to_string(f.pid) + ")\n" + "  error_file: " + f.error_file + "\n" +
        "  traceback : " + indent(f.message);
    if (!f.hint.empty()) fmt += "\n  hint      : " + indent(f.hint);
    std::istringstream lines(fmt);
    for (std::string line; std::getline(lines, line);) width = std::max(width, line.size());
    if (order[idx] == root) {
      root_fmt = fmt;
    } else {
      others.push_back(fmt);
    }
  }
  if (remote) {
    root_fmt = "[0]:\n  time      : " + ms_time(across->failed_at_ms) +
               "\n  node      : " + across->node_id + "\n  failure   : " + across->detail;
  }
  width = std::min<size_t>(width, 60);
  std::string border(width, '='), section(width, '-');
  std::string out = border + "\n" + title + "\n" + section + "\nFailures:\n";
  if (others.empty()) {
    out += "  <NO_OTHER_FAILURES>\n";
  } else {
    for (const auto& o : others) out += o + "\n";
  }
  out += section +
         (across ? "\nRoot Cause (earliest failure across nodes):\n"
                 : "\nRoot Cause (first observed failure):\n") +
         root_fmt + "\n" + border + "\n";
  return out;
}

bool write_root_cause(const std::string& path, const WorkerFailure& f) {
  json data;
  if (!f.error_json.empty()) {
    data = json::parse(f.error_json, nullptr, false);
    if (data.is_object() && data.contains("message") && data["message"].is_object()) {
      data["message"]["errorCode"] = f.exitcode;
    }
  } else {
    data = {{"message",
             {{"message", f.message},
              {"errorCode", f.exitcode},
              {"extraInfo", {{"py_callstack", ""}, {"timestamp", std::to_string(f.timestamp)}}}}}};
  }
  std::ofstream out(path, std::ios::trunc);
  if (!out) return false;
  out << data.dump();
  return static_cast<bool>(out);
}

std::string failure_line(const std::vector<WorkerFailure>& failures, const std::string& hostname) {
  if (failures.empty()) return "worker failure on " + hostname;
  const auto& f = failures[root_cause_index(failures)];
  std::string d = "rank " + std::to_string(f.rank) + " (local_rank " +
                  std::to_string(f.local_rank) + ") on " + hostname + " exited with " +
                  (f.exitcode < 0 ? signal_name(-f.exitcode) : std::to_string(f.exitcode));
  if (!f.message.empty()) {
    std::string m = f.message.substr(0, 200);
    for (auto& c : m) c = c == '\n' ? ' ' : c;
    d += ": " + m;
  }
  return d;
}

}  // namespace trun::agent
