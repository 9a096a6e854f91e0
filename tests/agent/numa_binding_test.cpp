// agent/numa_binding.h: the binding of each local rank, planned from a fake sysfs tree that has
// the shape of a two-socket GPU server (and from a tree missing parts of it).
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "agent/numa_binding.h"
#include "tests/launcher/process_util.h"

using namespace trun::agent;
namespace fs = std::filesystem;

namespace {

// A sysfs (or procfs) tree in a temporary directory.
class FakeRoot {
 public:
  const std::string& path() const { return dir_.path(); }
  void write(const std::string& rel, const std::string& text) const {
    const fs::path p = fs::path(path()) / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  void mkdir(const std::string& rel) const { fs::create_directories(fs::path(path()) / rel); }

 private:
  trun::testing::TempDir dir_;
};

// Two sockets of two NUMA nodes each; node n has two physical cores, CPUs 4n+k and their SMT
// siblings 4n+k+16 (k = 0, 1); each core has an L3 of its own (two core complexes per node).
// GPUs: 0000:1a:00.0 on node 1, 0000:3b:00.0 on node 0, 0000:88:00.0 and 0000:af:00.0 on node 3.
const std::vector<std::string> kGpus = {"0000:1a:00.0", "0000:3b:00.0", "0000:88:00.0",
                                        "0000:af:00.0"};

void write_server(const FakeRoot& sys) {
  for (int n = 0; n < 4; ++n) {
    const int a = 4 * n, b = 4 * n + 1;
    sys.write("devices/system/node/node" + std::to_string(n) + "/cpulist",
              std::to_string(a) + "-" + std::to_string(b) + "," + std::to_string(a + 16) + "-" +
                  std::to_string(b + 16));
    for (int core : {a, b}) {
      for (int cpu : {core, core + 16}) {
        const std::string dir = "devices/system/cpu/cpu" + std::to_string(cpu);
        sys.write(dir + "/topology/physical_package_id", std::to_string(n / 2));
        sys.write(dir + "/topology/thread_siblings_list",
                  std::to_string(core) + "," + std::to_string(core + 16));
        sys.write(dir + "/cache/index0/level", "1");
        sys.write(dir + "/cache/index0/type", "Data");
        sys.write(dir + "/cache/index0/shared_cpu_list", std::to_string(cpu));
        sys.write(dir + "/cache/index1/level", "1");
        sys.write(dir + "/cache/index1/type", "Instruction");
        sys.write(dir + "/cache/index1/shared_cpu_list", "0-31");  // never the grouping
        sys.write(dir + "/cache/index3/level", "3");
        sys.write(dir + "/cache/index3/type", "Unified");
        sys.write(dir + "/cache/index3/shared_cpu_list",
                  std::to_string(core) + "," + std::to_string(core + 16));
      }
    }
  }
  const int gpu_node[] = {1, 0, 3, 3};
  for (size_t g = 0; g < kGpus.size(); ++g) {
    sys.write("bus/pci/devices/" + kGpus[g] + "/numa_node", std::to_string(gpu_node[g]));
  }
}

std::set<int> all_cpus() {
  std::set<int> s;
  for (int c = 0; c < 32; ++c) s.insert(c);
  return s;
}

std::string cpus_of(const std::vector<NumaBinding>& b, size_t r) {
  REQUIRE(r < b.size());
  return format_cpu_list(b[r].cpus);
}

}  // namespace

TEST_CASE("cpu lists parse and print in sysfs's format, garbage is refused", "[numa]") {
  CHECK(parse_cpu_list("0-2,4,6-7\n") == std::set<int>{0, 1, 2, 4, 6, 7});
  CHECK(parse_cpu_list("").empty());
  CHECK(format_cpu_list({0, 1, 2, 4, 6, 7}) == "0-2,4,6-7");
  CHECK(format_cpu_list({5}) == "5");
  for (const char* bad : {"a", "3-1", "1-", "-2", "1,,x", "0-99999999"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_cpu_list(bad), std::invalid_argument);
  }
}

TEST_CASE("numa modes are torchrun's names, and another value is refused naming the choices",
          "[numa]") {
  CHECK(parse_numa_mode("") == NumaMode::kNone);
  CHECK(parse_numa_mode("core-complex") == NumaMode::kCoreComplex);
  CHECK(std::string(numa_mode_name(parse_numa_mode("exclusive"))) == "exclusive");
  CHECK_THROWS_WITH(parse_numa_mode("nodes"),
                    "--numa-binding=nodes: expected node, socket, exclusive or core-complex "
                    "(or none)");
}

TEST_CASE("visible GPUs are the driver's, in PCI order, narrowed by CUDA_VISIBLE_DEVICES",
          "[numa]") {
  FakeRoot proc;
  for (auto it = kGpus.rbegin(); it != kGpus.rend(); ++it) proc.mkdir("driver/nvidia/gpus/" + *it);
  CHECK(visible_nvidia_gpus(proc.path(), nullptr) == kGpus);
  CHECK(visible_nvidia_gpus(proc.path(), "3, 1") ==
        std::vector<std::string>{"0000:af:00.0", "0000:3b:00.0"});
  // CUDA stops at the first invalid entry.
  CHECK(visible_nvidia_gpus(proc.path(), "2,9,1") == std::vector<std::string>{"0000:88:00.0"});
  CHECK(visible_nvidia_gpus(proc.path(), "").empty());
  FakeRoot none;
  CHECK(visible_nvidia_gpus(none.path(), nullptr).empty());
}

TEST_CASE("each mode binds local rank r near GPU r as torchrun's modes do", "[numa]") {
  FakeRoot sys;
  write_server(sys);
  const CpuTopology t = read_cpu_topology(sys.path(), kGpus, all_cpus());

  auto node = plan_numa_bindings(t, NumaMode::kNode, 4);
  CHECK(cpus_of(node, 0) == "4-5,20-21");  // GPU 0 is on node 1
  CHECK(cpus_of(node, 1) == "0-1,16-17");
  CHECK(cpus_of(node, 2) == "12-13,28-29");
  CHECK(cpus_of(node, 3) == "12-13,28-29");
  CHECK(node[0].memory_node == 1);
  CHECK(node[2].memory_node == 3);
  CHECK(node[0].device == "GPU 0 (0000:1a:00.0) on node 1");

  auto socket = plan_numa_bindings(t, NumaMode::kSocket, 4);
  CHECK(cpus_of(socket, 0) == "0-1,4-5,16-17,20-21");  // nodes 0 and 1
  CHECK(cpus_of(socket, 3) == "8-9,12-13,24-25,28-29");
  CHECK(socket[3].memory_node == 3);

  // Node 3 holds GPUs 2 and 3: one physical core (both threads) each; GPU 0 is alone on node 1.
  auto exclusive = plan_numa_bindings(t, NumaMode::kExclusive, 4);
  CHECK(cpus_of(exclusive, 0) == "4-5,20-21");
  CHECK(cpus_of(exclusive, 2) == "12,28");
  CHECK(cpus_of(exclusive, 3) == "13,29");

  auto complex = plan_numa_bindings(t, NumaMode::kCoreComplex, 4);
  CHECK(cpus_of(complex, 0) == "4,20");
  CHECK(cpus_of(complex, 2) == "12,28");
  CHECK(cpus_of(complex, 3) == "13,29");

  CHECK(plan_numa_bindings(t, NumaMode::kNone, 4).empty());
}

TEST_CASE("binding honours trun's own affinity and says what is missing", "[numa]") {
  FakeRoot sys;
  write_server(sys);
  std::set<int> usable = all_cpus();
  usable.erase(13);
  usable.erase(29);  // node 3 keeps one core
  const CpuTopology t = read_cpu_topology(sys.path(), kGpus, usable);
  CHECK(cpus_of(plan_numa_bindings(t, NumaMode::kNode, 4), 3) == "12,28");
  CHECK_THROWS_WITH(plan_numa_bindings(t, NumaMode::kExclusive, 4),
                    Catch::Contains("local rank 2") &&
                        Catch::Contains("NUMA node 3 has 1 usable physical core(s) for 2 devices"));
  CHECK_THROWS_WITH(plan_numa_bindings(t, NumaMode::kNode, 5),
                    Catch::Contains("--numa-binding=node: local rank 4: no GPU of its own (4 "
                                    "visible)"));
  const CpuTopology none_usable = read_cpu_topology(sys.path(), kGpus, {30, 31});
  CHECK_THROWS_WITH(plan_numa_bindings(none_usable, NumaMode::kNode, 1),
                    Catch::Contains("NUMA node 1 of its device has no CPU trun may use"));
}

TEST_CASE("without GPUs, local ranks are spread over the nodes in blocks", "[numa]") {
  FakeRoot sys;
  write_server(sys);
  const CpuTopology t = read_cpu_topology(sys.path(), {}, all_cpus());
  auto two = plan_numa_bindings(t, NumaMode::kNode, 2);
  CHECK(two[0].memory_node == 0);
  CHECK(two[1].memory_node == 2);
  CHECK(two[1].device == "node 2 (no GPU)");
  // Eight ranks: two per node, a core each in exclusive mode.
  auto eight = plan_numa_bindings(t, NumaMode::kExclusive, 8);
  CHECK(cpus_of(eight, 0) == "0,16");
  CHECK(cpus_of(eight, 1) == "1,17");
  CHECK(cpus_of(eight, 7) == "13,29");
  CHECK(eight[7].memory_node == 3);
}

TEST_CASE(
    "exclusive gives the lowest ranks the extra core, and missing topology files are "
    "single-thread cores",
    "[numa]") {
  FakeRoot sys;
  sys.write("devices/system/node/node0/cpulist", "0-2");
  sys.write("devices/system/node/node1/cpulist", "");  // a memory-only node
  const CpuTopology t = read_cpu_topology(sys.path(), {}, {0, 1, 2});
  auto b = plan_numa_bindings(t, NumaMode::kExclusive, 2);
  CHECK(cpus_of(b, 0) == "0-1");
  CHECK(cpus_of(b, 1) == "2");
  CHECK(cpus_of(plan_numa_bindings(t, NumaMode::kCoreComplex, 2), 1) == "0-2");
  CHECK(cpus_of(plan_numa_bindings(t, NumaMode::kSocket, 1), 0) == "0-2");
}

TEST_CASE("a tree without NUMA nodes is an error naming where trun looked", "[numa]") {
  FakeRoot sys;
  CHECK_THROWS_WITH(read_cpu_topology(sys.path(), {}, {0}),
                    Catch::Contains("cannot read the NUMA nodes' CPUs under " + sys.path() +
                                    "/devices/system/node"));
}
