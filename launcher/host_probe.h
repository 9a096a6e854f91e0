#pragma once
// What the launcher's configuration needs to know about this host (devices, CPU topology, files),
// behind an interface, so that the command line's validation (launcher/cli_config.h) stays a pure
// function and its tests can fake the host.
//
// system_host() reads /proc, /sys and the file system on each call; it keeps no state and is
// thread-safe. Errors: cpu_topology throws std::runtime_error (agent/numa_binding.h).

#include <optional>
#include <string>

#include "agent/numa_binding.h"

namespace trun::launcher {

// What stat(2) and access(2) say about a path.
struct FileFacts {
  int error = 0;  // stat's errno, 0 when the path exists
  bool directory = false;
  bool regular = false;
  bool executable = false;  // access(X_OK)
};

class HostProbe {
 public:
  virtual ~HostProbe() = default;
  // Online CPUs (at least 1).
  virtual int cpus() const = 0;
  // CUDA devices this process may use, without loading CUDA, narrowed by CUDA_VISIBLE_DEVICES
  // (nullopt: unset) as torch.cuda.device_count() is.
  virtual int cuda_devices(const std::optional<std::string>& cuda_visible_devices) const = 0;
  // Intel GPUs (torch.xpu) this process may use, narrowed by ZE_AFFINITY_MASK (nullopt: unset).
  virtual int xpu_devices(const std::optional<std::string>& ze_affinity_mask) const = 0;
  // The CPU topology near the visible CUDA devices, for --numa-binding.
  virtual agent::CpuTopology cpu_topology(
      const std::optional<std::string>& cuda_visible_devices) const = 0;
  virtual FileFacts file(const std::string& path) const = 0;
};

// This host.
const HostProbe& system_host();

}  // namespace trun::launcher
