#include "agent/numa_binding.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "base/decimal.h"

namespace trun::agent {

namespace {

// The file's first line without surrounding blanks; empty when it cannot be read.
std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  const auto first = line.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return line.substr(first, line.find_last_not_of(" \t\r\n") - first + 1);
}

bool parse_nonnegative(const std::string& text, int& out) {
  return base::parse_decimal(text, &out) && out >= 0;
}

// Entries of `dir` whose name is `prefix` followed by a decimal number, as those numbers.
std::vector<int> numbered_entries(const std::string& dir, const std::string& prefix) {
  std::vector<int> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      int n;
      if (name.rfind(prefix, 0) == 0 && parse_nonnegative(name.substr(prefix.size()), n)) {
        out.push_back(n);
      }
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The lowest CPU of the list in `path`, or `fallback` when it cannot be read.
int lowest_listed(const std::string& path, int fallback) {
  try {
    std::set<int> cpus = parse_cpu_list(read_line(path));
    return cpus.empty() ? fallback : *cpus.begin();
  } catch (const std::invalid_argument&) {
    return fallback;
  }
}

// The lowest CPU sharing `cpu`'s largest data or unified cache, or `fallback` without cache
// information.
int largest_cache_group(const std::string& cpu_dir, int fallback) {
  int best_level = -1;
  int group = fallback;
  for (int index : numbered_entries(cpu_dir + "/cache", "index")) {
    const std::string dir = cpu_dir + "/cache/index" + std::to_string(index);
    const std::string type = read_line(dir + "/type");
    int level;
    if ((type != "Unified" && type != "Data") ||
        !parse_nonnegative(read_line(dir + "/level"), level) || level <= best_level) {
      continue;
    }
    best_level = level;
    group = lowest_listed(dir + "/shared_cpu_list", fallback);
  }
  return group;
}

std::string mode_error(NumaMode mode, int local_rank, const std::string& what) {
  return std::string("--numa-binding=") + numa_mode_name(mode) + ": local rank " +
         std::to_string(local_rank) + ": " + what;
}

// The usable CPUs of `node`.
std::vector<int> usable_cpus(const CpuTopology& t, int node) {
  std::vector<int> out;
  auto it = t.node_cpus.find(node);
  if (it == t.node_cpus.end()) return out;
  for (int cpu : it->second) {
    if (t.usable.count(cpu)) out.push_back(cpu);
  }
  return out;
}

int key_or_self(const std::map<int, int>& m, int cpu) {
  auto it = m.find(cpu);
  return it == m.end() ? cpu : it->second;
}

// The CPUs of `cpus` grouped by key (a physical core, a cache group), groups by key order.
std::vector<std::vector<int>> group_by(const std::vector<int>& cpus,
                                       const std::map<int, int>& key) {
  std::map<int, std::vector<int>> groups;
  for (int cpu : cpus) groups[key_or_self(key, cpu)].push_back(cpu);
  std::vector<std::vector<int>> out;
  for (auto& [k, g] : groups) out.push_back(std::move(g));
  return out;
}

}  // namespace

NumaMode parse_numa_mode(const std::string& name) {
  if (name.empty() || name == "none") return NumaMode::kNone;
  if (name == "node") return NumaMode::kNode;
  if (name == "socket") return NumaMode::kSocket;
  if (name == "exclusive") return NumaMode::kExclusive;
  if (name == "core-complex") return NumaMode::kCoreComplex;
  throw std::invalid_argument("--numa-binding=" + name +
                              ": expected node, socket, exclusive or core-complex (or none)");
}

const char* numa_mode_name(NumaMode mode) {
  switch (mode) {
    case NumaMode::kNone:
      return "none";
    case NumaMode::kNode:
      return "node";
    case NumaMode::kSocket:
      return "socket";
    case NumaMode::kExclusive:
      return "exclusive";
    case NumaMode::kCoreComplex:
      return "core-complex";
  }
  return "?";
}

std::set<int> parse_cpu_list(const std::string& text) {
  std::set<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto first = item.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) continue;
    item = item.substr(first, item.find_last_not_of(" \t\r\n") - first + 1);
    const auto dash = item.find('-');
    int lo, hi;
    bool ok = dash == std::string::npos
                  ? parse_nonnegative(item, lo) && (hi = lo, true)
                  : parse_nonnegative(item.substr(0, dash), lo) &&
                        parse_nonnegative(item.substr(dash + 1), hi) && lo <= hi;
    if (!ok || hi - lo > 65535) throw std::invalid_argument("not a CPU list: '" + text + "'");
    for (int c = lo; c <= hi; ++c) out.insert(c);
  }
  return out;
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<std::string> visible_nvidia_gpus(const std::string& proc_root,
                                             const char* cuda_visible_devices) {
  std::vector<std::string> all;
  if (DIR* d = opendir((proc_root + "/driver/nvidia/gpus").c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') all.push_back(e->d_name);
    }
    closedir(d);
  }
  std::sort(all.begin(), all.end());
  if (all.empty() || cuda_visible_devices == nullptr) return all;
  std::vector<std::string> visible;
  std::stringstream in(cuda_visible_devices);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto first = item.find_first_not_of(' ');
    item = first == std::string::npos ? ""
                                      : item.substr(first, item.find_last_not_of(' ') - first + 1);
    int idx;
    // CUDA stops at the first entry that is not a valid index (e.g. -1).
    if (!parse_nonnegative(item, idx) || idx >= static_cast<int>(all.size())) break;
    visible.push_back(all[static_cast<size_t>(idx)]);
  }
  return visible;
}

CpuTopology read_cpu_topology(const std::string& sysfs_root, std::vector<std::string> gpu_pci,
                              std::set<int> usable) {
  CpuTopology t;
  const std::string node_dir = sysfs_root + "/devices/system/node";
  for (int node : numbered_entries(node_dir, "node")) {
    std::set<int> cpus;
    try {
      cpus = parse_cpu_list(read_line(node_dir + "/node" + std::to_string(node) + "/cpulist"));
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error("--numa-binding: " + node_dir + "/node" + std::to_string(node) +
                               "/cpulist: " + e.what());
    }
    if (!cpus.empty()) t.node_cpus[node] = std::move(cpus);
  }
  if (t.node_cpus.empty()) {
    throw std::runtime_error("--numa-binding: cannot read the NUMA nodes' CPUs under " + node_dir +
                             " (no node*/cpulist)");
  }
  const std::string cpu_root = sysfs_root + "/devices/system/cpu/cpu";
  for (const auto& [node, cpus] : t.node_cpus) {
    for (int cpu : cpus) {
      const std::string dir = cpu_root + std::to_string(cpu);
      int package;
      t.cpu_package[cpu] =
          parse_nonnegative(read_line(dir + "/topology/physical_package_id"), package) ? package
                                                                                       : 0;
      t.cpu_core[cpu] = lowest_listed(dir + "/topology/thread_siblings_list", cpu);
      t.cpu_cache_group[cpu] = largest_cache_group(dir, *cpus.begin());
    }
  }
  t.usable = std::move(usable);
  for (const std::string& pci : gpu_pci) {
    int node = 0;
    const std::string text = read_line(sysfs_root + "/bus/pci/devices/" + pci + "/numa_node");
    if (!parse_nonnegative(text, node)) node = 0;  // -1 (one node) or unreadable
    t.gpu_node.push_back(node);
  }
  t.gpu_pci = std::move(gpu_pci);
  return t;
}

std::set<int> current_cpu_affinity() {
  std::set<int> out;
  for (int ncpu = 1024; ncpu <= (1 << 20); ncpu *= 2) {
    cpu_set_t* set = CPU_ALLOC(static_cast<size_t>(ncpu));
    const size_t size = CPU_ALLOC_SIZE(static_cast<size_t>(ncpu));
    CPU_ZERO_S(size, set);
    if (sched_getaffinity(0, size, set) == 0) {
      for (int c = 0; c < ncpu; ++c) {
        if (CPU_ISSET_S(static_cast<size_t>(c), size, set)) out.insert(c);
      }
      CPU_FREE(set);
      return out;
    }
    CPU_FREE(set);
    if (errno != EINVAL) break;
  }
  return out;
}

std::vector<NumaBinding> plan_numa_bindings(const CpuTopology& t, NumaMode mode, int nproc) {
  std::vector<NumaBinding> out;
  if (mode == NumaMode::kNone) return out;
  // Each local rank's device: its NUMA node, its index among the devices on that node, and how
  // many devices that node has.
  std::vector<int> device_node(static_cast<size_t>(nproc));
  std::vector<std::string> device_name(static_cast<size_t>(nproc));
  std::map<int, std::vector<int>> devices_on_node;  // node -> device indices, ascending
  if (!t.gpu_node.empty()) {
    for (size_t g = 0; g < t.gpu_node.size(); ++g) {
      devices_on_node[t.gpu_node[g]].push_back(static_cast<int>(g));
    }
    for (int r = 0; r < nproc; ++r) {
      if (r >= static_cast<int>(t.gpu_node.size())) {
        throw std::invalid_argument(mode_error(
            mode, r,
            "no GPU of its own (" + std::to_string(t.gpu_node.size()) +
                " visible): as in torchrun, local rank r is bound near GPU r; use at most one "
                "worker per GPU, or leave --numa-binding out"));
      }
      const auto g = static_cast<size_t>(r);
      device_node[g] = t.gpu_node[g];
      device_name[g] = "GPU " + std::to_string(r) + " (" + t.gpu_pci[g] + ") on node " +
                       std::to_string(t.gpu_node[g]);
    }
  } else {
    std::vector<int> nodes;
    for (const auto& [node, cpus] : t.node_cpus) {
      if (!usable_cpus(t, node).empty()) nodes.push_back(node);
    }
    if (nodes.empty()) {
      throw std::invalid_argument(mode_error(mode, 0, "no NUMA node has a CPU trun may use"));
    }
    for (int r = 0; r < nproc; ++r) {
      const int node = nodes[static_cast<size_t>(r) * nodes.size() / static_cast<size_t>(nproc)];
      device_node[static_cast<size_t>(r)] = node;
      devices_on_node[node].push_back(r);
      device_name[static_cast<size_t>(r)] = "node " + std::to_string(node) + " (no GPU)";
    }
  }
  for (int r = 0; r < nproc; ++r) {
    const int node = device_node[static_cast<size_t>(r)];
    const std::vector<int> node_cpus = usable_cpus(t, node);
    if (node_cpus.empty()) {
      throw std::invalid_argument(mode_error(
          mode, r, "NUMA node " + std::to_string(node) + " of its device has no CPU trun may use"));
    }
    const std::vector<int>& peers = devices_on_node[node];
    // The device index is the local rank (GPU r, or the r-th share of the nodes).
    const auto index =
        static_cast<size_t>(std::find(peers.begin(), peers.end(), r) - peers.begin());
    std::vector<int> cpus;
    switch (mode) {
      case NumaMode::kNone:
        break;
      case NumaMode::kNode:
        cpus = node_cpus;
        break;
      case NumaMode::kSocket: {
        const int package = key_or_self(t.cpu_package, node_cpus.front());
        for (const auto& [other, unused] : t.node_cpus) {
          const std::vector<int> other_cpus = usable_cpus(t, other);
          if (!other_cpus.empty() && key_or_self(t.cpu_package, other_cpus.front()) == package) {
            cpus.insert(cpus.end(), other_cpus.begin(), other_cpus.end());
          }
        }
        break;
      }
      case NumaMode::kExclusive: {
        const auto cores = group_by(node_cpus, t.cpu_core);
        const size_t n = peers.size();
        if (cores.size() < n) {
          throw std::invalid_argument(mode_error(
              mode, r,
              "NUMA node " + std::to_string(node) + " has " + std::to_string(cores.size()) +
                  " usable physical core(s) for " + std::to_string(n) +
                  " devices: exclusive needs one core per device at least"));
        }
        const size_t per = cores.size() / n, extra = cores.size() % n;
        const size_t begin = index * per + std::min(index, extra);
        const size_t end = begin + per + (index < extra ? 1 : 0);
        for (size_t c = begin; c < end; ++c)
          cpus.insert(cpus.end(), cores[c].begin(), cores[c].end());
        break;
      }
      case NumaMode::kCoreComplex: {
        auto groups = group_by(node_cpus, t.cpu_cache_group);
        std::stable_sort(groups.begin(), groups.end(),
                         [](const auto& a, const auto& b) { return a.size() > b.size(); });
        cpus = groups[index % groups.size()];
        break;
      }
    }
    std::sort(cpus.begin(), cpus.end());
    out.push_back(NumaBinding{std::move(cpus), node, device_name[static_cast<size_t>(r)]});
  }
  return out;
}

}  // namespace trun::agent
