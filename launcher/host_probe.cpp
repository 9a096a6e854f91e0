#include "launcher/host_probe.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <set>

#include "launcher/cli_values.h"

namespace trun::launcher {
namespace {

const char* or_null(const std::optional<std::string>& s) { return s ? s->c_str() : nullptr; }

class SystemHost : public HostProbe {
 public:
  int cpus() const override {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : 1;
  }

  // The NVIDIA driver lists one directory per GPU under /proc/driver/nvidia/gpus.
  int cuda_devices(const std::optional<std::string>& cuda_visible_devices) const override {
    return static_cast<int>(
        agent::visible_nvidia_gpus("/proc", or_null(cuda_visible_devices)).size());
  }

  // One DRM render node per device whose PCI vendor is Intel (0x8086) and whose kernel driver
  // is i915 or xe, the drivers torch.xpu runs on. ZE_AFFINITY_MASK's comma-separated entries name
  // root devices (an entry "1.0" names a sub-device of device 1, counted once per root device).
  int xpu_devices(const std::optional<std::string>& mask) const override {
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
    if (physical == 0 || !mask || trim(*mask).empty()) return physical;
    std::set<long long> roots;
    for (const auto& item : split(*mask, ',')) {
      long long idx;
      if (parse_int(trim(item).substr(0, trim(item).find('.')), idx) && idx >= 0 &&
          idx < physical) {
        roots.insert(idx);
      }
    }
    return static_cast<int>(roots.size());
  }

  agent::CpuTopology cpu_topology(
      const std::optional<std::string>& cuda_visible_devices) const override {
    return agent::read_cpu_topology(
        "/sys", agent::visible_nvidia_gpus("/proc", or_null(cuda_visible_devices)),
        agent::current_cpu_affinity());
  }

  FileFacts file(const std::string& path) const override {
    FileFacts f;
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      f.error = errno;
      return f;
    }
    f.directory = S_ISDIR(st.st_mode);
    f.regular = S_ISREG(st.st_mode);
    f.executable = access(path.c_str(), X_OK) == 0;
    return f;
  }
};

}  // namespace

const HostProbe& system_host() {
  static const SystemHost kHost;
  return kHost;
}

}  // namespace trun::launcher
