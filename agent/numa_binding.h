#pragma once
// NUMA binding of workers (torchrun's --numa-binding): the CPUs each local rank may run on and
// the memory node it allocates from first, decided once per node from what the kernel reports in
// sysfs, and applied in each worker process before it execs (sched_setaffinity and a preferred
// memory policy, so the worker's threads and its first-touch allocations stay near its device).
//
// The device of local rank r: GPU r of the visible NVIDIA GPUs (as torchrun: the GPU whose local
// index equals the local rank), in PCI bus order and narrowed by CUDA_VISIBLE_DEVICES. Without
// a GPU (CPU training, a trun extension: torchrun needs CUDA here), the local ranks are spread
// over the NUMA nodes that have usable CPUs in contiguous blocks: rank r gets node
// nodes[r * nodes / nproc].
//
// Modes (the same as torchrun's AffinityMode):
//   node          every usable CPU of the device's NUMA node;
//   socket        every usable CPU of the NUMA nodes in the device's socket (physical package);
//   exclusive     an exclusive share of the device's node's physical cores: the node's cores, in
//                 order, divided evenly among the devices on that node (the lowest-indexed
//                 devices get one extra core when they do not divide evenly); all hardware
//                 threads of a core go together;
//   core-complex  one group of cores sharing the largest cache (an L3 "core complex") of the
//                 device's node: the groups ordered by size (largest first), then by lowest CPU,
//                 and the device's index among the node's devices picks one (modulo the count).
// "Usable" CPUs are those in trun's own affinity mask (a cgroup or taskset narrows them). Memory:
// the device's NUMA node is the preferred node (MPOL_PREFERRED: allocations fall back to other
// nodes when it is full, never fail because of the binding).
//
// Errors: std::invalid_argument with a message naming the mode, the local rank and what is
// missing (a local rank without a GPU, a node without usable CPUs, fewer physical cores than
// devices on a node for exclusive). Thread safety: pure functions, except read_cpu_topology,
// which reads files.

#include <map>
#include <set>
#include <string>
#include <vector>

namespace trun::agent {

enum class NumaMode { kNone, kNode, kSocket, kExclusive, kCoreComplex };

// "none", "node", "socket", "exclusive", "core-complex"; std::invalid_argument otherwise.
NumaMode parse_numa_mode(const std::string& name);
const char* numa_mode_name(NumaMode mode);

// What binding needs to know about the machine.
struct CpuTopology {
  std::map<int, std::set<int>> node_cpus;  // NUMA node -> its CPUs (nodes without CPUs absent)
  std::map<int, int> cpu_package;          // CPU -> physical package (socket)
  std::map<int, int> cpu_core;             // CPU -> lowest CPU of its physical core
  std::map<int, int> cpu_cache_group;      // CPU -> lowest CPU sharing its largest cache
  std::set<int> usable;                    // CPUs the workers may use (trun's affinity)
  // The visible GPUs, in device order: PCI address and NUMA node (-1 in sysfs reads as 0, as a
  // machine with one node reports).
  std::vector<std::string> gpu_pci;
  std::vector<int> gpu_node;
};

// The visible NVIDIA GPUs' PCI addresses in device order: one directory per GPU under
// `proc_root`/driver/nvidia/gpus, sorted by address, narrowed by `cuda_visible_devices` (nullptr:
// unset) as CUDA does with a list of indices (it stops at the first index that is not valid).
std::vector<std::string> visible_nvidia_gpus(const std::string& proc_root,
                                             const char* cuda_visible_devices);

// Reads the topology under `sysfs_root` ("/sys", or a copy for tests): nodes from
// devices/system/node/node*/cpulist, cores, packages and caches from devices/system/cpu/cpu*/,
// and each GPU's node from bus/pci/devices/<address>/numa_node. std::runtime_error when the node
// list cannot be read.
CpuTopology read_cpu_topology(const std::string& sysfs_root, std::vector<std::string> gpu_pci,
                              std::set<int> usable);

// The CPUs this process may run on (sched_getaffinity).
std::set<int> current_cpu_affinity();

struct NumaBinding {
  std::vector<int> cpus;  // ascending, never empty
  int memory_node = 0;    // preferred memory node
  std::string device;     // e.g. "GPU 1 (0000:3b:00.0) on node 0", "node 1 (no GPU)"
};

// One binding per local rank (0..nproc-1); empty for NumaMode::kNone.
std::vector<NumaBinding> plan_numa_bindings(const CpuTopology& topology, NumaMode mode, int nproc);

// "0-3,8,10-11" (sysfs's list format) and back; parse_cpu_list throws std::invalid_argument on
// anything else.
std::string format_cpu_list(const std::vector<int>& cpus);
std::set<int> parse_cpu_list(const std::string& text);

}  // namespace trun::agent
