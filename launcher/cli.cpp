#include "launcher/cli.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "agent/job_local.h"
#include "rendezvous/handler.h"

extern char** environ;

namespace trun::launcher {
namespace {

// Thrown by the validators below; becomes "trun: error: <message>" and exit code 2.
class InvalidInput : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(cur);
  return out;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

// Strict decimal integer: the whole string, no sign unless allowed.
bool parse_int(const std::string& s, long long& out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0') return false;
  out = v;
  return true;
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end == s.c_str() || *end != '\0' || !std::isfinite(v)) return false;
  out = v;
  return true;
}

// An integer option's value, argparse's type=int with a range: "--flag=VALUE: expected ...".
long long whole_number(const char* flag, const std::string& value, long long lo, long long hi,
                       const char* expected) {
  long long v;
  if (!parse_int(value, v) || v < lo || v > hi) {
    throw InvalidInput(std::string(flag) + "=" + value + ": expected " + expected);
  }
  return v;
}

void parse_nnodes(const std::string& value, int& min_nodes, int& max_nodes) {
  auto parts = split(value, ':');
  long long lo = 0, hi = 0;
  bool ok = false;
  if (parts.size() == 1) {
    ok = parse_int(parts[0], lo);
    hi = lo;
  } else if (parts.size() == 2) {
    ok = parse_int(parts[0], lo) && parse_int(parts[1], hi);
  }
  if (!ok || lo < 1 || hi < lo || hi > 1000000) {
    throw InvalidInput("--nnodes=" + value +
                       ": expected a node count N or a range MIN:MAX with 1 <= MIN <= MAX");
  }
  min_nodes = static_cast<int>(lo);
  max_nodes = static_cast<int>(hi);
}

int count_cpus() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// CUDA devices this process may use, without loading CUDA: the NVIDIA driver lists one directory
// per GPU under /proc/driver/nvidia/gpus, and CUDA_VISIBLE_DEVICES narrows the set as it does
// for torch.cuda.device_count().
int count_gpus() {
  return static_cast<int>(
      agent::visible_nvidia_gpus("/proc", std::getenv("CUDA_VISIBLE_DEVICES")).size());
}

// Intel GPUs this process may use, without loading Level Zero: one DRM render node per device
// whose PCI vendor is Intel (0x8086) and whose kernel driver is i915 or xe, the drivers
// torch.xpu runs on. ZE_AFFINITY_MASK narrows the set as it does for torch.xpu.device_count():
// its comma-separated entries name root devices (an entry "1.0" names a sub-device of device 1,
// counted once per root device).
int count_xpus() {
  int physical = 0;
  if (DIR* d = opendir("/sys/class/drm")) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("renderD", 0) != 0) continue;
      const std::string dev = "/sys/class/drm/" + name + "/device";
      std::string vendor;
      if (FILE* f = std::fopen((dev + "/vendor").c_str(), "r")) {
        char buf[32] = {};
        if (std::fgets(buf, sizeof buf, f)) vendor = trim(buf);
        std::fclose(f);
      }
      char link[256] = {};
      ssize_t n = readlink((dev + "/driver").c_str(), link, sizeof link - 1);
      std::string driver = n > 0 ? std::string(link, static_cast<size_t>(n)) : "";
      driver = driver.substr(driver.rfind('/') + 1);
      if (trim(vendor) == "0x8086" && (driver == "i915" || driver == "xe")) ++physical;
    }
    closedir(d);
  }
  const char* mask = std::getenv("ZE_AFFINITY_MASK");
  if (physical == 0 || mask == nullptr || trim(mask).empty()) return physical;
  std::set<long long> roots;
  for (const auto& item : split(mask, ',')) {
    long long idx;
    if (parse_int(trim(item).substr(0, trim(item).find('.')), idx) && idx >= 0 && idx < physical) {
      roots.insert(idx);
    }
  }
  return static_cast<int>(roots.size());
}

// The highest local rank a per-rank setting may name (--nproc-per-node is at most 4096).
constexpr long long kMaxLocalRank = 4095;

int parse_nproc_per_node(const std::string& value) {
  long long n;
  if (parse_int(value, n)) {
    if (n < 1 || n > 4096) {
      throw InvalidInput("--nproc-per-node=" + value +
                         ": expected a positive worker count (1..4096), cpu, gpu, xpu or auto");
    }
    return static_cast<int>(n);
  }
  if (value == "cpu") return count_cpus();
  if (value == "gpu") {
    int g = count_gpus();
    if (g == 0) {
      throw InvalidInput(
          "--nproc-per-node=gpu: no CUDA device is visible on this host (checked "
          "/proc/driver/nvidia/gpus and CUDA_VISIBLE_DEVICES); use a number or cpu");
    }
    return g;
  }
  if (value == "auto") {
    int g = count_gpus();
    return g > 0 ? g : count_cpus();
  }
  if (value == "xpu") {
    int x = count_xpus();
    if (x == 0) {
      throw InvalidInput(
          "--nproc-per-node=xpu: no Intel XPU device is visible on this host (checked "
          "/sys/class/drm/renderD* for Intel devices on the i915 or xe driver, and "
          "ZE_AFFINITY_MASK); use a number or cpu");
    }
    return x;
  }
  throw InvalidInput("--nproc-per-node=" + value +
                     ": expected a positive worker count, cpu, gpu, xpu or auto");
}

// torchrun's comma-separated filter list: ",," stands for a comma inside a filter.
std::vector<std::string> parse_filters(const std::string& value) {
  std::vector<std::string> out;
  if (value.empty()) return out;
  std::string cur;
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] != ',') {
      cur.push_back(value[i]);
    } else if (i + 1 < value.size() && value[i + 1] == ',') {
      cur.push_back(',');
      ++i;
    } else {
      out.push_back(cur);
      cur.clear();
    }
  }
  out.push_back(cur);
  return out;
}

agent::StdSpec parse_std(const char* flag, const std::string& value) {
  auto bad = [&]() {
    return InvalidInput(std::string(flag) + "=" + value +
                        ": expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or a per-rank map "
                        "like 0:1,1:3");
  };
  agent::StdSpec spec;
  long long v;
  if (parse_int(value, v)) {
    if (v < 0 || v > 3) throw bad();
    spec.all = static_cast<int>(v);
    return spec;
  }
  spec.is_map = true;
  for (const auto& item : split(value, ',')) {
    auto parts = split(item, ':');
    long long rank, mode;
    if (parts.size() != 2 || !parse_int(parts[0], rank) || !parse_int(parts[1], mode) || rank < 0 ||
        rank > kMaxLocalRank || mode < 0 || mode > 3) {
      throw bad();
    }
    spec.per_rank[static_cast<int>(rank)] = static_cast<int>(mode);
  }
  return spec;
}

std::set<int> parse_ranks_filter(const std::string& value) {
  std::set<int> out;
  for (const auto& item : split(value, ',')) {
    long long r;
    if (!parse_int(trim(item), r) || r < 0 || r > kMaxLocalRank) {
      throw InvalidInput("--local-ranks-filter=" + value +
                         ": expected a comma-separated list of local ranks like 0,1,2");
    }
    out.insert(static_cast<int>(r));
  }
  return out;
}

std::chrono::milliseconds parse_seconds(const char* flag, const std::string& value,
                                        bool allow_zero) {
  double s;
  if (!parse_double(value, s) || s < 0 || (!allow_zero && s == 0) || s > 1e7) {
    throw InvalidInput(std::string(flag) + "=" + value + ": expected a " +
                       (allow_zero ? "non-negative" : "positive") + " number of seconds");
  }
  return std::chrono::milliseconds(static_cast<long long>(std::llround(s * 1000.0)));
}

int signal_number(const std::string& name_in) {
  std::string name = trim(name_in);
  for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (name.rfind("SIG", 0) != 0) name = "SIG" + name;
  static const std::pair<const char*, int> kSignals[] = {
      {"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},    {"SIGHUP", SIGHUP},   {"SIGQUIT", SIGQUIT},
      {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2},  {"SIGALRM", SIGALRM}, {"SIGXCPU", SIGXCPU},
      {"SIGCONT", SIGCONT}, {"SIGWINCH", SIGWINCH}};
  for (const auto& [n, v] : kSignals) {
    if (name == n) return v;
  }
  return -1;
}

std::vector<int> parse_signals(const std::string& value) {
  std::vector<int> out;
  for (const auto& item : split(value, ',')) {
    int sig = signal_number(item);
    if (sig < 0) {
      throw InvalidInput("--signals-to-handle=" + value + ": unknown signal '" + trim(item) +
                         "'; expected names like SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2");
    }
    if (std::find(out.begin(), out.end(), sig) == out.end()) out.push_back(sig);
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// An executable found the way execvp would: a path with '/' as is, else through $PATH.
bool find_executable(const std::string& program) {
  if (program.find('/') != std::string::npos) return access(program.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  for (const auto& dir : split(path ? path : "/usr/local/bin:/usr/bin:/bin", ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    struct stat st;
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        access(candidate.c_str(), X_OK) == 0) {
      return true;
    }
  }
  return false;
}

constexpr const char* kDescription =
    "trun: an elastic launcher for distributed training, compatible with torchrun.\n"
    "Starts --nproc-per-node copies of TRAINING_SCRIPT on this node with the environment\n"
    "torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), supervises\n"
    "them, restarts the whole group when one fails (up to --max-restarts) and reports failures.\n"
    "Every option can also be set through PET_<OPTION> (e.g. PET_NPROC_PER_NODE=4); the\n"
    "command line wins. Both spellings work: --nproc-per-node and --nproc_per_node, and so\n"
    "does any unique prefix, as in torchrun (--nproc_per=2).\n"
    "Inside an srun step, options given neither way come from SLURM_* (the c10d store on the\n"
    "step's first node; TRUN_SLURM=0 turns this off); --dry-run shows the result.";

constexpr const char* kFooter =
    "Examples:\n"
    "  trun --standalone --nproc-per-node=4 train.py --epochs 3\n"
    "  trun --nproc-per-node=2 --max-restarts=3 --no-python ./train_binary\n"
    "Exit codes: 0 all workers succeeded; 1 workers failed (restarts exhausted; see the\n"
    "summary); 2 invalid command line; 3 trun itself failed (rendezvous, store, log dir);\n"
    "128+N trun received signal N and stopped the workers. Details: docs/exit-codes.md";

// What argparse takes for an option's value rather than for another option: anything not
// starting with '-', "-" alone, a negative number ("-1", "-.5"; trun has no option that looks
// like one) and anything with a space in it. `--log-dir -x` is therefore a missing value, as in
// torchrun, and `--log-dir=-x` the way to give it.
bool argparse_value(const std::string& s) {
  if (s.size() < 2 || s[0] != '-') return true;
  if (s.find(' ') != std::string::npos) return true;
  size_t i = 1, digits = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++digits;
  if (i == s.size()) return digits > 0;  // -1
  if (s[i] != '.') return false;
  ++i;
  size_t fraction = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++fraction;
  return i == s.size() && fraction > 0;  // -.5, -1.5
}

// Rewrites `args` (argv without the program name), up to the training script, into the form
// CLI11 2.1 reads the way argparse (torchrun) would:
// - allow_abbrev: a long option may be shortened to any prefix that names one option
//   (--nproc_per=2, --nnode=1); a prefix of several options is an error naming every candidate;
// - an empty value (`--log-dir=`, `-r=`) is kept as the empty string: CLI11 would otherwise take
//   the next argument (`--nproc-per-node=2`) as the value;
// - `--opt VALUE` needs a VALUE that argparse would take (argparse_value): `--log-dir --tee 3`
//   is a missing value, not a directory named --tee;
// - a flag given a value must not give an empty one (`--standalone=`); argparse refuses any.
// The script's own arguments are never touched. An unknown option is left to CLI11 (which names
// it). Returns the error line, if any.
std::optional<std::string> normalize_arguments(const CLI::App& app,
                                               std::vector<std::string>& args) {
  std::vector<std::pair<std::string, const CLI::Option*>> longs;  // name without "--"
  std::vector<std::pair<char, const CLI::Option*>> shorts;
  for (const CLI::Option* o : app.get_options()) {
    for (const auto& n : o->get_lnames()) longs.emplace_back(n, o);
    for (const auto& n : o->get_snames()) shorts.emplace_back(n.empty() ? '\0' : n[0], o);
  }
  auto takes_value = [](const CLI::Option* o) { return o->get_expected_max() > 0; };
  std::vector<std::string> out;
  // `option` (as written) takes the argument after it, args[i + 1], as its value.
  auto value_after = [&](size_t& i, const std::string& option) -> std::optional<std::string> {
    if (i + 1 >= args.size()) return option + ": expected a value";
    if (!argparse_value(args[i + 1])) {
      return option + ": expected a value, got the option '" + args[i + 1] + "' (write " + option +
             "=" + args[i + 1] + " for a value that starts with '-')";
    }
    out.push_back(args[i]);
    out.push_back(args[++i]);
    return std::nullopt;
  };
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--" || arg.size() < 2 || arg[0] != '-') break;  // the training script
    if (arg[1] != '-') {                                        // -m, -r 3, -t3, -r=3
      auto it = std::find_if(shorts.begin(), shorts.end(),
                             [&](const auto& s) { return s.first == arg[1]; });
      if (it == shorts.end()) break;  // unknown: CLI11 leaves it with the script, which names it
      const std::string name = arg.substr(0, 2);
      if (!takes_value(it->second)) {
        if (arg.size() > 2) break;  // -mx: not an option trun knows
        out.push_back(arg);
      } else if (arg.size() == 2) {
        if (auto error = value_after(i, name)) return error;
      } else {
        // argparse reads -r=3 as 3 and -r= as empty; CLI11 would read "=3".
        const size_t from = arg[2] == '=' ? 3 : 2;
        out.push_back(name);
        out.push_back(arg.substr(from));
      }
      continue;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (name.empty()) break;
    const CLI::Option* match = nullptr;
    std::string full = "--" + name;
    for (const auto& [n, o] : longs) {
      if (n == name) match = o;
    }
    if (match == nullptr) {
      std::vector<std::string> candidates;
      std::set<const CLI::Option*> options;
      for (const auto& [n, o] : longs) {
        if (n.compare(0, name.size(), name) == 0) {
          candidates.push_back("--" + n);
          options.insert(o);
          match = o;
        }
      }
      if (options.size() > 1) {
        std::string list;
        for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
        return "ambiguous option: --" + name + " could match " + list;
      }
      if (match == nullptr) break;  // unknown: CLI11 leaves it with the script, which names it
      // Both spellings of one option may match (--nproc matches --nproc-per-node and
      // --nproc_per_node): the one whose separators agree with the prefix's.
      full.clear();
      for (const auto& c : candidates) {
        if (full.empty() ||
            (name.find('_') != std::string::npos) == (c.find('_') != std::string::npos)) {
          full = c;
        }
      }
    }
    if (!takes_value(match)) {
      if (eq != std::string::npos && eq + 1 == arg.size()) {
        return full + "=: an empty value; " + full + " is a flag (give it alone)";
      }
      out.push_back(full + (eq == std::string::npos ? "" : arg.substr(eq)));
    } else if (eq == std::string::npos) {
      args[i] = full;
      if (auto error = value_after(i, full)) return error;
    } else {
      // Two arguments: CLI11 takes the one after an option as its value whatever it is, ""
      // included.
      out.push_back(full);
      out.push_back(arg.substr(eq + 1));
    }
  }
  out.insert(out.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  args = std::move(out);
  return std::nullopt;
}

// CLI11 2.1 cannot name the positional part of the usage line itself.
class Formatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: trun [OPTIONS] TRAINING_SCRIPT [SCRIPT ARGS...]\n"
           "       trun store [--host H] [--port P] [--store-token T] [limits]   (the store alone;\n"
           "                  limits per request and per client: trun store --help)\n"
           "       trun status --rdzv-id ID ...   trun timeline EVENTLOG... -o PAGE\n";
  }
};

}  // namespace

CliResult parse_command_line(int argc, char** argv) {
  CliResult result;
  CLI::App app{kDescription, "trun"};
  app.footer(kFooter);
  app.prefix_command();  // everything from TRAINING_SCRIPT on belongs to the worker
  app.set_version_flag("--version", "trun 0.1.0 (torchrun-compatible)");
  auto formatter = std::make_shared<Formatter>();
  formatter->column_width(44);
  app.formatter(formatter);

  std::string nnodes = "1:1", nproc = "1", backend = "static", endpoint, rdzv_id = "none",
              rdzv_conf, monitor = "5", start_method = "spawn", role = "default", log_dir,
              redirects = "0", tee = "0", ranks_filter, master_addr = "127.0.0.1", local_addr,
              shutdown = "30", signals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT", barrier = "300",
              prefix_template, event_log_handler = "null", logs_specs, numa_binding, dup_stdout,
              dup_stderr, event_log, metrics_port, max_restarts = "0", node_rank = "0",
              master_port = "29500";
  bool standalone = false, module = false, no_python = false, run_path = false,
       virtual_local_rank = false, dry_run = false, use_env = false;
  std::string legacy_launch;  // empty, underscore or dash

  // Both spellings of an option's name (--a-b and --a_b) and its PET_A_B variable.
  auto spellings = [](const std::string& dash_name, const std::string& short_name) {
    std::string under = dash_name;
    for (auto& c : under) c = c == '-' ? '_' : c;
    std::string names = (short_name.empty() ? "" : short_name + ",") + "--" + dash_name;
    if (under != dash_name) names += ",--" + under;
    std::string env = "PET_" + under;
    for (auto& c : env) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return std::make_pair(names, env);
  };
  auto opt = [&](const std::string& dash_name, auto& var, const std::string& help,
                 const std::string& group, const std::string& short_name = "") {
    auto [names, env] = spellings(dash_name, short_name);
    // As argparse: the last of a repeated option wins (CLI11 would refuse the second).
    return app.add_option(names, var, help)
        ->envname(env)
        ->group(group)
        ->capture_default_str()
        ->take_last();
  };
  auto flag = [&](const std::string& dash_name, bool& var, const std::string& help,
                  const std::string& group, const std::string& short_name = "") {
    auto [names, env] = spellings(dash_name, short_name);
    return app.add_flag(names, var, help)->envname(env)->group(group);
  };

  const std::string kGroup = "Worker group", kRdzv = "Rendezvous", kRun = "What to run",
                    kLogs = "Logs", kSup = "Supervision", kLegacy = "Node and master (static)";
  auto* nnodes_opt = opt("nnodes", nnodes, "Number of nodes N, or a range MIN:MAX", kGroup);
  opt("nproc-per-node", nproc,
      "Workers on this node: a number, cpu (one per CPU), gpu (one per visible CUDA device), xpu "
      "(one per visible Intel GPU) or auto (gpu if any, else cpu)",
      kGroup);
  opt("role", role, "Name of the workers' role (ROLE_NAME, and the log line prefix)", kGroup);
  flag("virtual-local-rank", virtual_local_rank,
       "Each worker sees only its own GPU: LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to the "
       "local rank's entry of this process's CUDA_VISIBLE_DEVICES (or the local rank)",
       kGroup);
  opt("max-restarts", max_restarts,
      "Restarts of the whole worker group allowed after a failure before the job fails", kGroup);

  auto* standalone_opt =
      flag("standalone", standalone,
           "Single node: host the rendezvous store inside trun on a free port with a generated run "
           "id (overrides --rdzv-backend/--rdzv-endpoint/--rdzv-id)",
           kRdzv);
  auto* backend_opt =
      opt("rdzv-backend", backend,
          "Rendezvous backend: static, c10d (a store hosted by one agent) or etcd (alias etcd-v2: "
          "an etcd cluster's v3 API over plain HTTP)",
          kRdzv);
  auto* endpoint_opt = opt(
      "rdzv-endpoint", endpoint,
      "Rendezvous endpoint HOST:PORT (c10d: the store; etcd: a client URL, port 2379 by default, "
      "or several members separated by commas; static: defaults to MASTER_ADDR:MASTER_PORT)",
      kRdzv);
  auto* rdzv_id_opt =
      opt("rdzv-id", rdzv_id, "Job id shared by all nodes (TORCHELASTIC_RUN_ID)", kRdzv);
  opt("rdzv-conf", rdzv_conf, "Extra rendezvous settings: key1=value1,key2=value2", kRdzv);

  flag("module", module, "Run TRAINING_SCRIPT as a Python module (python -m)", kRun, "-m");
  flag("dry-run", dry_run,
       "Print the resolved launch configuration as JSON on stdout and start nothing (a trun "
       "extension)",
       kRun);
  flag("no-python", no_python, "Execute TRAINING_SCRIPT directly, even if it ends in .py", kRun);
  flag("run-path", run_path,
       "Run TRAINING_SCRIPT with the Python interpreter (torchrun runs it in-process; trun has "
       "no interpreter, so this equals the default for .py files)",
       kRun);
  app.add_flag("--legacy-launch,--legacy_launch", legacy_launch,
               "As python -m torch.distributed.launch: each worker also gets --local_rank=N "
               "before the script's arguments (=dash: --local-rank=N, torch 2.x's spelling); "
               "LOCAL_RANK is set either way")
      ->envname("PET_LEGACY_LAUNCH")
      ->group(kRun);
  flag("use-env", use_env,
       "torch.distributed.launch's --use_env: with --legacy-launch, pass the local rank only "
       "in LOCAL_RANK (torchrun's default)",
       kRun);

  opt("log-dir", log_dir,
      "Directory for logs: DIR/<run id>/attempt_<n>/<local_rank>/{stdout,stderr}.log and "
      "error.json",
      kLogs);
  opt("event-log", event_log,
      "Append one JSON line per rendezvous and agent event to FILE (torchelastic's event "
      "fields: name, source, timestamp, metadata; a trun extension)",
      kLogs);
  auto* metrics_port_opt =
      opt("metrics-port", metrics_port,
          "Serve /metrics (Prometheus) and /healthz over HTTP on this port, 0 for a free one "
          "(printed); default: TORCHELASTIC_HEALTH_CHECK_PORT, else none (a trun extension)",
          kLogs);
  opt("redirects", redirects,
      "Send workers' streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per "
      "local rank like 0:1,1:3",
      kLogs, "-r");
  opt("tee", tee, "Like --redirects, but also copy to the console with a [<role><rank>]: prefix",
      kLogs, "-t");
  opt("local-ranks-filter", ranks_filter,
      "Show only these local ranks' output on the console, e.g. 0 or 0,1 (log files keep all)",
      kLogs);
  opt("duplicate-stdout-filters", dup_stdout,
      "Also append tee'd stdout lines containing any of these comma-separated strings (,, for a "
      "comma) to LOG_DIR/<run id>/attempt_<n>/filtered_stdout.log",
      kLogs);
  opt("duplicate-stderr-filters", dup_stderr, "The same for stderr, into filtered_stderr.log",
      kLogs);
  opt("logs-specs", logs_specs,
      "Refused: a Python entry point in torchrun; trun's log layout is torchrun's default", kLogs);
  opt("log-line-prefix-template", prefix_template,
      "Console prefix template for tee'd lines, with ${role_name}, ${rank}, ${local_rank} "
      "(default: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE or ${role_name}${local_rank})",
      kLogs);

  opt("monitor-interval", monitor,
      "Accepted for compatibility; trun notices worker exits as they happen", kSup);
  opt("start-method", start_method,
      "Accepted for compatibility (spawn, fork, forkserver); workers are always exec'd", kSup);
  opt("event-log-handler", event_log_handler,
      "Only null (the default): torchrun's event handlers are Python plug-ins; trun logs its "
      "own events",
      kSup);
  auto* numa_opt = opt(
      "numa-binding", numa_binding,
      "Bind each worker's CPUs and preferred memory node near its device: none (the default), "
      "node, socket, exclusive or core-complex (docs/launcher.md, NUMA binding; --dry-run shows "
      "the plan)",
      kSup);
  auto* shutdown_opt = opt("shutdown-timeout", shutdown,
                           "Seconds between SIGTERM and SIGKILL when stopping workers (default: "
                           "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
                           kSup);
  auto* signals_opt =
      opt("signals-to-handle", signals,
          "Signals trun forwards to the workers before stopping them and exiting 128+N (in an "
          "srun step SIGUSR1 is added to the default)",
          kSup);
  opt("exit-barrier-timeout", barrier,
      "Seconds to wait for other nodes to finish after this node's workers succeeded", kSup);

  auto* node_rank_opt =
      opt("node-rank", node_rank, "This node's rank (GROUP_RANK) for the static backend", kLegacy);
  auto* master_addr_opt = opt(
      "master-addr", master_addr,
      "Address of node 0, where the store runs (static backend); MASTER_ADDR for workers", kLegacy);
  auto* master_port_opt =
      opt("master-port", master_port,
          "Port of the store on node 0 (static backend); MASTER_PORT for workers. 0 picks a free "
          "port (single node)",
          kLegacy);
  opt("local-addr", local_addr, "This node's address as other nodes should reach it", kLegacy);

  std::vector<std::string> args(argv + 1, argv + argc);
  if (auto error = normalize_arguments(app, args)) {
    result.exit_code = 2;
    result.error = *error + " (see trun --help)";
    return result;
  }
  std::vector<char*> expanded{argv[0]};
  for (auto& a : args) expanded.push_back(a.data());
  try {
    app.parse(static_cast<int>(expanded.size()), expanded.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      result.exit_code = app.exit(e);
      return result;
    }
    std::string what = e.what();
    result.exit_code = 2;
    result.error = what + " (see trun --help)";
    return result;
  }

  // SLURM's environment fills what neither the command line nor PET_* gave (CLI11 counts an
  // option read from its PET_* variable as given).
  try {
    auto value_if = [](CLI::Option* o, const std::string& v) {
      return o->count() > 0 ? std::optional<std::string>(v) : std::nullopt;
    };
    GivenOptions given;
    given.standalone = standalone_opt->count() > 0 && standalone;
    given.nnodes = value_if(nnodes_opt, nnodes);
    given.rdzv_backend = value_if(backend_opt, backend);
    given.rdzv_endpoint = value_if(endpoint_opt, endpoint);
    given.rdzv_id = value_if(rdzv_id_opt, rdzv_id);
    given.node_rank = value_if(node_rank_opt, node_rank);
    given.master_addr = value_if(master_addr_opt, master_addr);
    given.master_port = value_if(master_port_opt, master_port);
    given.signals_to_handle = value_if(signals_opt, signals);
    result.slurm = derive_slurm_options(
        [](const std::string& name) -> std::optional<std::string> {
          const char* v = std::getenv(name.c_str());
          return v ? std::optional<std::string>(v) : std::nullopt;
        },
        given);
  } catch (const SlurmOptionError& e) {
    result.exit_code = e.exit_code();
    result.error = e.what();
    return result;
  }
  for (const auto& d : result.slurm.derived) {
    if (d.option == "--rdzv-backend") backend = d.value;
    if (d.option == "--rdzv-id") rdzv_id = d.value;
    if (d.option == "--nnodes") nnodes = d.value;
    if (d.option == "--node-rank") node_rank = d.value;
    if (d.option == "--rdzv-endpoint") endpoint = d.value;
    if (d.option == "--signals-to-handle") signals = d.value;
  }
  result.dry_run = dry_run;
  for (const char* name :
       {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
        "CUDA_VISIBLE_DEVICES", "PYTHON_EXEC", "TRUN_SLURM"}) {
    if (const char* v = std::getenv(name)) result.environment[name] = v;
  }
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    if (kv.rfind("PET_", 0) == 0 && kv.find('=') != std::string::npos) {
      result.environment[kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
    }
  }

  try {
    agent::LaunchConfig c;
    std::vector<std::string> rest = app.remaining();
    if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
    if (rest.empty()) {
      throw InvalidInput(
          "missing TRAINING_SCRIPT: usage: trun [options] TRAINING_SCRIPT [args...]");
    }
    if (!rest.front().empty() && rest.front()[0] == '-' && rest.front() != "-") {
      throw InvalidInput("unknown option " + rest.front() + " (see trun --help)");
    }

    parse_nnodes(nnodes, c.min_nodes, c.max_nodes);
    c.nproc_per_node = parse_nproc_per_node(nproc);
    c.virtual_local_rank = virtual_local_rank;
    if (const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES"); virtual_local_rank && cvd) {
      for (const auto& d : split(cvd, ',')) c.visible_devices.push_back(trim(d));
      if (static_cast<size_t>(c.nproc_per_node) > c.visible_devices.size()) {
        throw InvalidInput("--virtual-local-rank: " + std::to_string(c.nproc_per_node) +
                           " workers per node, but CUDA_VISIBLE_DEVICES=" + cvd + " lists " +
                           std::to_string(c.visible_devices.size()) +
                           " device(s), one per worker is needed");
      }
    }
    c.max_restarts = static_cast<int>(
        whole_number("--max-restarts", max_restarts, 0, 1000000, "a number >= 0 (up to 1000000)"));
    if (role.empty()) throw InvalidInput("--role=: expected a non-empty name");
    c.role = role;

    static const char* kKnownBackends[] = {"static", "c10d", "etcd", "etcd-v2"};
    bool known = false;
    for (const char* b : kKnownBackends) known = known || backend == b;
    if (!known) {
      throw InvalidInput("--rdzv-backend=" + backend +
                         ": unknown backend; expected one of static, c10d, etcd, etcd-v2");
    }
    // Checked here for every backend, with the backend's own options (etcd's endpoint list), so
    // that a bad entry is a usage error before anything runs. --standalone means static.
    try {
      c.rdzv_conf = rendezvous::parse_rdzv_conf(rdzv_conf);
      // As torchrun, which hands the whole map to the backend and lets it read what it knows
      // (a Kubeflow elasticPolicy passes keys of its own): unknown keys are dropped, with one
      // warning naming them, so that a typo does not go unnoticed.
      std::string unknown;
      for (auto it = c.rdzv_conf.begin(); it != c.rdzv_conf.end();) {
        if (rendezvous::is_rdzv_conf_key(it->first)) {
          ++it;
          continue;
        }
        unknown += (unknown.empty() ? "'" : ", '") + it->first + "'";
        it = c.rdzv_conf.erase(it);
      }
      if (!unknown.empty()) {
        result.notes.push_back(
            "--rdzv-conf: ignoring unknown key(s) " + unknown +
            " (trun reads join_timeout, timeout, last_call_timeout, close_timeout, "
            "keep_alive_interval, keep_alive_max_attempt, read_timeout, is_host, failover, "
            "store_type, "
            "use_libuv, etcd_prefix, protocol)");
      }
      rendezvous::RendezvousOptions checked;
      rendezvous::apply_rdzv_conf(c.rdzv_conf, &checked);
      checked.endpoint = endpoint;
      rendezvous::check_backend_options(standalone ? "static" : backend, checked);
    } catch (const rendezvous::RendezvousOptionError& e) {
      throw InvalidInput(e.what());
    }
    c.master_port = static_cast<int>(
        whole_number("--master-port", master_port, 0, 65535, "a port number 0..65535"));
    if (master_addr.empty()) throw InvalidInput("--master-addr=: expected a host name or address");
    c.master_addr = master_addr;
    c.local_addr = local_addr;
    c.node_rank =
        static_cast<int>(whole_number("--node-rank", node_rank, 0, 1000000, "a node rank >= 0"));
    c.standalone = standalone;
    if (standalone) {
      // As torchrun: --standalone overrides the rendezvous settings.
      if (c.max_nodes != 1) {
        throw InvalidInput("--standalone runs on one node; got --nnodes=" + nnodes);
      }
      c.rdzv_backend = "static";
      c.node_rank = 0;
      c.run_id.clear();  // generated by the agent
    } else {
      c.rdzv_backend = backend;
      c.rdzv_endpoint = endpoint;
      c.run_id = rdzv_id;
      const bool dynamic = backend != "static";  // c10d, etcd, etcd-v2
      if (backend == "etcd-v2") c.rdzv_backend = "etcd";
      if (dynamic) {
        if (endpoint.empty()) {
          throw InvalidInput(backend == "c10d"
                                 ? "--rdzv-backend=c10d needs --rdzv-endpoint=HOST[:PORT] (the "
                                   "store is hosted by the node whose address matches it)"
                                 : "--rdzv-backend=" + backend +
                                       " needs --rdzv-endpoint=HOST[:PORT] (etcd's client URL)");
        }
        if (c.max_nodes > 1 && c.run_id == "none") {
          throw InvalidInput(
              "--rdzv-id is required for a multi-node " + backend + " job (--nnodes=" + nnodes +
              "): give every node the same job id, e.g. --rdzv-id=myjob-1; the default 'none' "
              "lets two jobs on the same store collide");
        }
      }
      if (dynamic) {
        // Validated by the rendezvous module when the agent creates the handler.
      } else if (c.min_nodes != c.max_nodes) {
        throw InvalidInput("--nnodes=" + nnodes +
                           ": the static backend needs a fixed node count, not a range");
      }
      if (c.node_rank >= c.max_nodes) {
        throw InvalidInput("--node-rank=" + node_rank + ": expected 0.." +
                           std::to_string(c.max_nodes - 1) + " for --nnodes=" + nnodes);
      }
      if (!endpoint.empty() && backend == "static") {
        auto colon = endpoint.rfind(':');
        long long port;
        if (colon == std::string::npos || colon == 0 ||
            !parse_int(endpoint.substr(colon + 1), port) || port < 0 || port > 65535) {
          throw InvalidInput("--rdzv-endpoint=" + endpoint + ": expected HOST:PORT");
        }
        std::string host = endpoint.substr(0, colon);
        if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
          host = host.substr(1, host.size() - 2);
        }
        c.master_addr = host;
        c.master_port = static_cast<int>(port);
      }
      if (backend == "static" && c.master_port == 0 && c.max_nodes > 1) {
        throw InvalidInput("--master-port=0 picks a free port and only works with --nnodes=1");
      }
    }
    if (!standalone) {
      if (c.run_id.empty()) {
        throw InvalidInput(
            "--rdzv-id=: an empty job id (torchrun would make up a random one, which other nodes "
            "cannot know); give every node the same id of letters, digits, '.', '_' and '-'");
      }
      if (c.run_id.size() > agent::kMaxRunIdBytes) {
        // Not echoed: it may be 100 KiB.
        throw InvalidInput("--rdzv-id: " + std::to_string(c.run_id.size()) +
                           " bytes; a job id has at most " + std::to_string(agent::kMaxRunIdBytes) +
                           " (it names the log directory DIR/<run id> and is part of every "
                           "rendezvous store key)");
      }
      bool ok = true;
      for (char ch : c.run_id) {
        ok = ok &&
             (std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-');
      }
      if (!ok) {
        throw InvalidInput("--rdzv-id=" + c.run_id +
                           ": expected a non-empty id of letters, digits, '.', '_' and '-'");
      }
    }

    double mi;
    if (!parse_double(monitor, mi) || mi <= 0 || mi > 1e7) {
      throw InvalidInput("--monitor-interval=" + monitor +
                         ": expected a positive number of seconds (at most 1e7)");
    }
    c.monitor_interval = std::chrono::milliseconds(static_cast<long long>(mi * 1000));
    if (start_method != "spawn" && start_method != "fork" && start_method != "forkserver") {
      throw InvalidInput("--start-method=" + start_method + ": expected spawn, fork or forkserver");
    }
    if (start_method != "spawn") {
      result.notes.push_back("--start-method=" + start_method +
                             " is ignored: trun always starts workers as new programs (exec)");
    }
    if (event_log_handler != "null") {
      throw InvalidInput("--event-log-handler=" + event_log_handler +
                         ": torchrun's event handlers are Python plug-ins, which trun cannot "
                         "load; leave it out (trun logs its events on stderr, and --event-log FILE "
                         "writes them as torchelastic Event JSON lines)");
    }
    if (!logs_specs.empty()) {
      throw InvalidInput("--logs-specs=" + logs_specs +
                         ": torchrun's logs specs are Python entry points, which trun cannot "
                         "load; leave it out and use --log-dir, --redirects, --tee and "
                         "--local-ranks-filter (torchrun's default layout)");
    }
    if (numa_opt->count() > 0 && numa_binding.empty()) {
      throw InvalidInput("--numa-binding=: expected none, node, socket, exclusive or core-complex");
    }
    try {
      c.numa_binding = agent::parse_numa_mode(numa_binding);
      if (c.numa_binding != agent::NumaMode::kNone) {
        const agent::CpuTopology topology = agent::read_cpu_topology(
            "/sys", agent::visible_nvidia_gpus("/proc", std::getenv("CUDA_VISIBLE_DEVICES")),
            agent::current_cpu_affinity());
        c.numa_bindings = agent::plan_numa_bindings(topology, c.numa_binding, c.nproc_per_node);
      }
    } catch (const std::exception& e) {
      throw InvalidInput(e.what());
    }
    c.duplicate_stdout_filters = parse_filters(dup_stdout);
    c.duplicate_stderr_filters = parse_filters(dup_stderr);
    // As torchrun 2.x: without the option (or PET_SHUTDOWN_TIMEOUT), its own variable applies.
    const char* shutdown_env = std::getenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
    if (shutdown_opt->count() == 0 && shutdown_env) {
      c.shutdown_timeout =
          parse_seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", trim(shutdown_env), true);
    } else {
      c.shutdown_timeout = parse_seconds("--shutdown-timeout", shutdown, true);
    }
    c.exit_barrier_timeout = parse_seconds("--exit-barrier-timeout", barrier, true);
    c.signals_to_handle = parse_signals(signals);
    c.signals_to_handle_text = signals;

    c.log_dir = log_dir;
    c.event_log = event_log;
    {
      // As torchrun's health-check server: its variable when the option is not given.
      std::string text = metrics_port, source = "--metrics-port";
      const char* env = std::getenv("TORCHELASTIC_HEALTH_CHECK_PORT");
      if (metrics_port_opt->count() == 0 && env != nullptr && *env != '\0') {
        text = trim(env);
        source = "TORCHELASTIC_HEALTH_CHECK_PORT";
      }
      if (!text.empty()) {
        char* end = nullptr;
        errno = 0;
        long v = std::strtol(text.c_str(), &end, 10);
        if (end != text.c_str() + text.size() || errno != 0 || v < 0 || v > 65535) {
          throw InvalidInput(source + "=" + text +
                             ": expected a port number 0..65535 (0: a free port)");
        }
        c.metrics_port = static_cast<int>(v);
      }
    }
    c.redirects = parse_std("--redirects", redirects);
    c.tee = parse_std("--tee", tee);
    for (const auto& [name, filters, stream] :
         {std::tuple<const char*, const std::vector<std::string>&, int>{
              "--duplicate-stdout-filters", c.duplicate_stdout_filters, agent::kStdOut},
          {"--duplicate-stderr-filters", c.duplicate_stderr_filters, agent::kStdErr}}) {
      if (filters.empty()) continue;
      bool teed = (c.tee.all & stream) != 0;
      for (const auto& [rank, mode] : c.tee.per_rank) teed = teed || (mode & stream) != 0;
      if (!teed) {
        result.notes.push_back(std::string(name) +
                               " has no effect: it copies lines of tee'd streams, and --tee "
                               "does not cover this one");
      } else if (log_dir.empty()) {
        result.notes.push_back(std::string(name) +
                               ": without --log-dir the filtered file is in a temporary "
                               "directory removed when trun exits");
      }
    }
    if (!trim(ranks_filter).empty()) c.local_ranks_filter = parse_ranks_filter(ranks_filter);
    c.log_line_prefix_template = prefix_template;
    if (c.log_line_prefix_template.empty()) {
      if (const char* t = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")) {
        c.log_line_prefix_template = t;
      }
    }

    // What to run.
    const std::string script = rest.front();
    std::vector<std::string> script_args(rest.begin() + 1, rest.end());
    if (module && no_python) {
      throw InvalidInput("--module and --no-python cannot be combined");
    }
    bool use_python = module || run_path || (!no_python && ends_with(script, ".py"));
    if (!module) {
      struct stat st;
      if (use_python || script.find('/') != std::string::npos) {
        if (stat(script.c_str(), &st) != 0) {
          throw InvalidInput("training script " + script + " not found: " + std::strerror(errno));
        }
        if (S_ISDIR(st.st_mode)) {
          throw InvalidInput("training script " + script + " is a directory");
        }
        if (!use_python && access(script.c_str(), X_OK) != 0) {
          throw InvalidInput("training script " + script +
                             " is not executable (chmod +x it, or run a .py file)");
        }
      } else if (!find_executable(script)) {
        throw InvalidInput("training program " + script + " not found in PATH");
      }
    }
    if (use_python) {
      const char* py = std::getenv("PYTHON_EXEC");
      c.entrypoint.push_back(py && *py ? py : "python3");
      c.python_interpreter = c.entrypoint.back();
      c.entrypoint.push_back("-u");
      if (module) c.entrypoint.push_back("-m");
    }
    c.entrypoint.push_back(script);
    // The bare flag reads as "true" (CLI11), PET_LEGACY_LAUNCH=1 as "1".
    if (legacy_launch == "true" || legacy_launch == "1") legacy_launch = "underscore";
    if (legacy_launch == "false" || legacy_launch == "0") legacy_launch.clear();
    if (!legacy_launch.empty() && legacy_launch != "underscore" && legacy_launch != "dash") {
      throw InvalidInput("--legacy-launch=" + legacy_launch +
                         ": expected underscore (--local_rank=N, the default) or dash "
                         "(--local-rank=N)");
    }
    if (!legacy_launch.empty() && !use_env) {
      // Where torch.distributed.launch puts it: before the script's own arguments, as a macro
      // the agent replaces per worker (agent/worker_env.h).
      c.entrypoint.push_back(
          std::string(legacy_launch == "dash" ? "--local-rank" : "--local_rank") +
          "=${local_rank}");
    }
    c.entrypoint.insert(c.entrypoint.end(), script_args.begin(), script_args.end());
    c.entrypoint_name = script;  // as torchrun titles its summary

    result.config = std::move(c);
  } catch (const InvalidInput& e) {
    result.exit_code = 2;
    result.error = e.what();
  }
  return result;
}

}  // namespace trun::launcher
