#include "launcher/argparse_compat.h"

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <set>
#include <utility>

namespace trun::launcher {

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

std::optional<std::string> normalize_arguments(const std::vector<ArgOption>& options,
                                               std::vector<std::string>& args) {
  // Every spelling with the index of its option in `options`, which is the option's identity.
  std::vector<std::pair<std::string, size_t>> longs;  // name without "--"
  std::vector<std::pair<char, size_t>> shorts;
  for (size_t k = 0; k < options.size(); ++k) {
    for (const auto& n : options[k].long_names) longs.emplace_back(n, k);
    if (options[k].short_name != '\0') shorts.emplace_back(options[k].short_name, k);
  }
  auto takes_value = [&](size_t k) { return options[k].takes_value; };
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
    std::optional<size_t> match;
    std::string full = "--" + name;
    for (const auto& [n, k] : longs) {
      if (n == name) match = k;
    }
    if (!match) {
      std::vector<std::string> candidates;
      std::set<size_t> matched;
      for (const auto& [n, k] : longs) {
        if (n.compare(0, name.size(), name) == 0) {
          candidates.push_back("--" + n);
          matched.insert(k);
          match = k;
        }
      }
      if (matched.size() > 1) {
        std::string list;
        for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
        return "ambiguous option: --" + name + " could match " + list;
      }
      if (!match) break;  // unknown: CLI11 leaves it with the script, which names it
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
    if (!takes_value(*match)) {
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

}  // namespace trun::launcher
