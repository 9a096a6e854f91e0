#include "launcher/cli_values.h"

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "base/decimal.h"
#include "launcher/cli_resolve.h"

namespace trun::launcher {

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

bool parse_int(const std::string& s, long long& out) {
  return static_cast<bool>(
      base::parse_decimal(s, &out, base::DecimalSyntax{/*plus=*/true, /*leading_space=*/true}));
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

long long whole_number(const std::string& flag, const std::string& value, long long lo,
                       long long hi, const char* expected) {
  long long v;
  if (!parse_int(value, v) || v < lo || v > hi) {
    throw CliError(flag + "=" + value + ": expected " + expected);
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
    throw CliError("--nnodes=" + value +
                   ": expected a node count N or a range MIN:MAX with 1 <= MIN <= MAX");
  }
  min_nodes = static_cast<int>(lo);
  max_nodes = static_cast<int>(hi);
}

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

agent::StdSpec parse_std(const std::string& flag, const std::string& value) {
  auto bad = [&]() {
    return CliError(flag + "=" + value +
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
      throw CliError("--local-ranks-filter=" + value +
                     ": expected a comma-separated list of local ranks like 0,1,2");
    }
    out.insert(static_cast<int>(r));
  }
  return out;
}

std::chrono::milliseconds parse_seconds(const std::string& flag, const std::string& value,
                                        bool allow_zero) {
  double s;
  if (!parse_double(value, s) || s < 0 || (!allow_zero && s == 0) || s > 1e7) {
    throw CliError(flag + "=" + value + ": expected a " +
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
      throw CliError("--signals-to-handle=" + value + ": unknown signal '" + trim(item) +
                     "'; expected names like SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2");
    }
    if (std::find(out.begin(), out.end(), sig) == out.end()) out.push_back(sig);
  }
  return out;
}

}  // namespace trun::launcher
