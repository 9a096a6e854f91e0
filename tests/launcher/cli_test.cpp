// The command line, black-box: invalid input, help, PET_* variables, both spellings.
#include <algorithm>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/skip.h"

using namespace trun::testing;

namespace {

void expect_usage_error(const std::vector<std::string>& args, const std::string& mentions) {
  INFO("args: " << [&] {
    std::string s;
    for (const auto& a : args) s += a + " ";
    return s;
  }());
  auto r = run_trun(args);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 2);
  auto lines = lines_of(r.err);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].rfind("trun: error: ", 0) == 0);
  CHECK(lines[0].find(mentions) != std::string::npos);
  CHECK(r.out.empty());
}

}  // namespace

TEST_CASE("invalid input exits 2 with one line naming the problem", "[cli]") {
  const std::string w = test_worker();
  expect_usage_error({"--nnodes", "3:1", w}, "--nnodes=3:1");
  expect_usage_error({"--nnodes", "0", w}, "--nnodes=0");
  expect_usage_error({"--nnodes", "a:b", w}, "MIN:MAX");
  expect_usage_error({"--nproc-per-node", "-2", w}, "--nproc-per-node=-2");
  expect_usage_error({"--nproc_per_node=zero", w}, "positive worker count");
  expect_usage_error({"--rdzv-conf", "timeout=10,oops", w}, "malformed entry 'oops'");
  // --rdzv-conf values are checked for every backend, before anything starts.
  expect_usage_error({"--standalone", "--rdzv-conf", "join_timeout=abc", w}, "join_timeout=abc");
  expect_usage_error({"--rdzv-conf", "timeout=5,timeout=6", w}, "'timeout' given twice");
  expect_usage_error({"--rdzv-conf", "use_libuv=maybe", w}, "use_libuv=maybe");
  expect_usage_error({"--rdzv-conf", "store_type=file", w}, "TCP only");
  expect_usage_error({"--numa-binding", "everywhere", w}, "--numa-binding=everywhere");
  expect_usage_error({"--legacy-launch=sideways", w}, "--legacy-launch=sideways");
  expect_usage_error({"--rdzv-backend", "zookeeper", w}, "unknown backend");
  expect_usage_error({"--rdzv-backend=etcd", w}, "needs --rdzv-endpoint");
  expect_usage_error({"--rdzv-backend=etcd-v2", "--rdzv-endpoint=h:2379", "--nnodes=2", w},
                     "--rdzv-id is required");
  expect_usage_error({"--rdzv-conf", "etcd_prefix=/jobs/", w}, "only for --rdzv-backend=etcd");
  expect_usage_error(
      {"--rdzv-backend=etcd", "--rdzv-endpoint=h:2379", "--rdzv-conf", "protocol=https", w},
      "plain HTTP only");
  expect_usage_error({"--max-restarts", "-1", w}, ">= 0");
  expect_usage_error({"--redirects", "4", w}, "--redirects=4");
  expect_usage_error({"--tee", "0:9", w}, "--tee=0:9");
  expect_usage_error({"--local-ranks-filter", "0,x", w}, "--local-ranks-filter");
  expect_usage_error({"--signals-to-handle", "SIGFOO", w}, "SIGFOO");
  expect_usage_error({"--shutdown-timeout", "soon", w}, "--shutdown-timeout=soon");
  expect_usage_error({"--master-port", "70000", w}, "0..65535");
  expect_usage_error({"--nnodes", "2", "--node-rank", "2", w}, "--node-rank=2");
  expect_usage_error({"--nnodes", "1:2", w}, "fixed node count");
  expect_usage_error({"--standalone", "--nnodes", "2", w}, "one node");
  expect_usage_error({"--module", "--no-python", "x"}, "cannot be combined");
  expect_usage_error({"/nonexistent/train.py"}, "not found");
  expect_usage_error({"no_such_program_anywhere_xyz"}, "not found in PATH");
  expect_usage_error({"--nproc-per-node", "2"}, "missing TRAINING_SCRIPT");
  expect_usage_error({"--definitely-not-an-option", w}, "--definitely-not-an-option");
  expect_usage_error({"--rdzv-endpoint", "nohost", w}, "HOST:PORT");
  expect_usage_error({"--rdzv-id", "a b/c", w}, "--rdzv-id=a b/c");
}

TEST_CASE("a malformed c10d endpoint exits 2 naming it, before anything starts", "[cli]") {
  const std::string w = test_worker();
  auto c10d = [&](const std::string& endpoint, const std::string& mentions) {
    expect_usage_error({"--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint, w},
                       "--rdzv-endpoint=" + endpoint + ": " + mentions);
  };
  c10d("127.0.0.1:99999", "port '99999' is not a number in 0..65535");
  c10d("127.0.0.1:-1", "port '-1'");
  c10d("127.0.0.1:+80", "port '+80'");
  c10d("127.0.0.1:29x", "port '29x'");
  c10d("127.0.0.1:", "empty port");
  c10d(":29400", "empty host");
  c10d("[::1", "unterminated [IPv6]");
  c10d("[]:29400", "empty host");
  c10d("[::1]29400", "expected [ADDRESS]:PORT");
  c10d("[localhost]:29400", "'localhost' in brackets is not an IPv6 address");
  c10d("::1]:29400", "']' without '['");
  c10d("a:b:29400", "not HOST:PORT");
  c10d("[::1]:70000", "port '70000'");
}

TEST_CASE("nproc-per-node=gpu is a clear error on a host without CUDA devices", "[cli]") {
  if (file_exists("/proc/driver/nvidia/gpus") &&
      !std::filesystem::is_empty("/proc/driver/nvidia/gpus")) {
    TRUN_SKIP("this host has NVIDIA GPUs, so gpu is valid here", kEnvironment);
  }
  expect_usage_error({"--nproc-per-node", "gpu", test_worker()}, "no CUDA device");
}

TEST_CASE("help groups the options and exits 0", "[cli]") {
  auto r = run_trun({"--help"});
  CHECK(r.exit_code == 0);
  for (const char* s :
       {"Usage: trun [OPTIONS] TRAINING_SCRIPT", "Worker group:", "Rendezvous:", "Logs:",
        "Supervision:", "--nproc-per-node,--nproc_per_node", "PET_NPROC_PER_NODE", "Exit codes"}) {
    CHECK(r.out.find(s) != std::string::npos);
  }
}

TEST_CASE("options come from PET_ variables, and the command line wins", "[cli]") {
  TempDir d;
  const std::string w = test_worker();
  auto r = run_trun({"--no-python", w, "env", d.path()}, {{"PET_NPROC_PER_NODE", "3"}});
  REQUIRE(r.exit_code == 0);
  CHECK(file_exists(d / "env_0_2.json"));
  CHECK_FALSE(file_exists(d / "env_0_3.json"));

  TempDir d2;
  r = run_trun({"--nproc_per_node=2", "--no_python", w, "env", d2.path()},
               {{"PET_NPROC_PER_NODE", "3"}, {"PET_MAX_RESTARTS", "4"}});
  REQUIRE(r.exit_code == 0);
  CHECK(file_exists(d2 / "env_0_1.json"));
  CHECK_FALSE(file_exists(d2 / "env_0_2.json"));
  CHECK(read_file(d2 / "env_0_0.json").find("\"TORCHELASTIC_MAX_RESTARTS\":\"4\"") !=
        std::string::npos);
}

TEST_CASE("a static node's --rdzv-conf timeout bounds its wait for node 0, fractions included",
          "[cli]") {
  // A port nobody listens on (free a moment ago), so connections to it are refused.
  const std::string port = std::to_string(free_port());
  auto start = std::chrono::steady_clock::now();
  auto r =
      run_trun({"--nnodes=2", "--node-rank=1", "--master-addr=127.0.0.1", "--master-port=" + port,
                "--rdzv-conf", "timeout=1.5,use_libuv=true", test_worker()});
  auto waited = std::chrono::steady_clock::now() - start;
  REQUIRE(r.finished);
  CHECK(waited >= std::chrono::milliseconds(1450));  // it kept trying until the deadline
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("cannot reach node 0's store") != std::string::npos);
  CHECK(r.err.find("within 1500 ms") != std::string::npos);  // not 1 s: the fraction counts
}

TEST_CASE("trun store still runs the store alone", "[cli]") {
  Child c({trun_binary(), "store", "--host", "127.0.0.1", "--port", "0"});
  REQUIRE(wait_until([&] { return c.out().find("listening on 127.0.0.1:") != std::string::npos; }));
  c.signal(SIGTERM);
  REQUIRE(c.wait(std::chrono::seconds(10)));
  CHECK(c.exit_code() == 0);
}

// The port a `trun store` child printed on its "... 127.0.0.1:<port>" line (0 while not yet).
static std::string printed_port(const std::string& out, const std::string& marker) {
  auto at = out.find(marker);
  if (at == std::string::npos) return "";
  auto colon = out.find(':', at + marker.size());
  auto end = out.find_first_not_of("0123456789", colon + 1);
  if (colon == std::string::npos || end == std::string::npos) return "";
  return out.substr(colon + 1, end - colon - 1);
}

TEST_CASE("two agents rendezvous through trun store --relay-to", "[cli]") {
  Child store({trun_binary(), "store", "--host", "127.0.0.1", "--port", "0"});
  REQUIRE(wait_until([&] { return !printed_port(store.out(), "listening on").empty(); }));
  const std::string store_port = printed_port(store.out(), "listening on");
  Child relay({trun_binary(), "store", "--host", "127.0.0.1", "--port", "0", "--relay-to",
               "127.0.0.1:" + store_port});
  REQUIRE(wait_until([&] { return !printed_port(relay.out(), "relaying").empty(); }));
  const std::string relay_port = printed_port(relay.out(), "relaying");
  CHECK(relay.out().find("to 127.0.0.1:" + store_port) != std::string::npos);

  TempDir da, db;  // each node's workers write env_<attempt>_<local rank>.json
  const std::string w = test_worker();
  auto agent = [&](const TempDir& d) {
    return std::vector<std::string>{trun_binary(),
                                    "--nnodes=2",
                                    "--nproc-per-node=1",
                                    "--rdzv-backend=c10d",
                                    "--rdzv-endpoint=127.0.0.1:" + relay_port,
                                    "--rdzv-id=relayed",
                                    "--rdzv-conf",
                                    "is_host=false",
                                    "--no-python",
                                    w,
                                    "env",
                                    d.path()};
  };
  Child a(agent(da)), b(agent(db));
  REQUIRE(a.wait(std::chrono::seconds(60)));
  REQUIRE(b.wait(std::chrono::seconds(60)));
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
  INFO(a.err() << b.err());
  const std::string ea = read_file(da / "env_0_0.json"), eb = read_file(db / "env_0_0.json");
  CHECK(ea.find("\"WORLD_SIZE\":\"2\"") != std::string::npos);
  CHECK(eb.find("\"WORLD_SIZE\":\"2\"") != std::string::npos);
  const bool a_first = ea.find("\"RANK\":\"0\"") != std::string::npos;
  CHECK(eb.find(a_first ? "\"RANK\":\"1\"" : "\"RANK\":\"0\"") != std::string::npos);

  // A relay takes no token, and needs one HOST:PORT.
  auto bad = run_trun({"store", "--relay-to", "a:1,b:2"});
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.find("give one HOST:PORT") != std::string::npos);
  auto token = run_trun({"store", "--relay-to", "127.0.0.1:1"}, {{"TRUN_STORE_TOKEN", "s"}});
  CHECK(token.exit_code == 2);
  CHECK(token.err.find("does not authenticate") != std::string::npos);
  relay.signal(SIGTERM);
  store.signal(SIGTERM);
  REQUIRE(relay.wait(std::chrono::seconds(10)));
  REQUIRE(store.wait(std::chrono::seconds(10)));
  CHECK(relay.exit_code() == 0);
}

TEST_CASE("accepted-but-ignored options work and say so", "[cli]") {
  auto r = run_trun({"--start_method=fork", "--monitor-interval=0.1", test_worker()});
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--start-method=fork is ignored") != std::string::npos);
  auto bad = run_trun({"--start-method=thread", test_worker()});
  CHECK(bad.exit_code == 2);
  // Their defaults (and --numa-binding=none) run as without them.
  auto defaults = run_trun({"--event-log-handler=null", "--numa-binding=none", test_worker()});
  CHECK(defaults.exit_code == 0);
}

TEST_CASE("torchrun 2.x plug-in options trun cannot load are refused, saying what to use instead",
          "[cli]") {
  const std::string w = test_worker();
  expect_usage_error({"--event-log-handler=console", w},
                     "--event-log-handler=console: torchrun's event handlers are Python");
  expect_usage_error({"--logs-specs=my_specs", w}, "use --log-dir, --redirects, --tee");
}

TEST_CASE("nproc-per-node=xpu is a clear error on a host without Intel GPUs", "[cli]") {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/sys/class/drm", ec)) {
    if (e.path().filename().string().rfind("renderD", 0) == 0 &&
        read_file(e.path() / "device" / "vendor").rfind("0x8086", 0) == 0) {
      TRUN_SKIP("this host has an Intel GPU, so xpu may be valid here", kEnvironment);
    }
  }
  expect_usage_error({"--nproc-per-node", "xpu", test_worker()}, "no Intel XPU device");
}

namespace {

std::string legacy_script() {
  return std::string(TRUN_SOURCE_DIR) + "/tests/launcher/py/legacy_local_rank.py";
}

// The lines the legacy script printed, sorted (the workers print concurrently).
std::vector<std::string> sorted_lines(const std::string& out) {
  auto lines = lines_of(out);
  std::sort(lines.begin(), lines.end());
  return lines;
}

nlohmann::json dry_run(const std::vector<std::string>& args) {
  std::vector<std::string> a{"--dry-run"};
  a.insert(a.end(), args.begin(), args.end());
  auto r = run_trun(a);
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  return nlohmann::json::parse(r.out);
}

}  // namespace

TEST_CASE(
    "legacy launch passes --local_rank=N before the script's arguments, as "
    "torch.distributed.launch does",
    "[cli]") {
  auto r = run_trun({"--nproc-per-node=2", "--legacy-launch", legacy_script(), "a", "b"});
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(sorted_lines(r.out) ==
        std::vector<std::string>{"local_rank=0 LOCAL_RANK=0 rest=['a', 'b']",
                                 "local_rank=1 LOCAL_RANK=1 rest=['a', 'b']"});
  auto j = dry_run({"--legacy-launch", "--no-python", test_worker(), "x"});
  CHECK(j["entrypoint"] ==
        nlohmann::json::array({test_worker(), "--local_rank=${local_rank}", "x"}));
}

TEST_CASE("legacy launch with =dash passes torch 2.x's --local-rank=N", "[cli]") {
  auto r = run_trun({"--nproc_per_node=2", "--legacy_launch=dash", legacy_script()});
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(sorted_lines(r.out) == std::vector<std::string>{"local_rank=0 LOCAL_RANK=0 rest=[]",
                                                        "local_rank=1 LOCAL_RANK=1 rest=[]"});
  auto j = dry_run({"--legacy-launch=dash", "--no-python", test_worker()});
  CHECK(j["entrypoint"] == nlohmann::json::array({test_worker(), "--local-rank=${local_rank}"}));
}

TEST_CASE("use-env turns the legacy launch argument off, leaving LOCAL_RANK", "[cli]") {
  for (const char* use_env : {"--use-env", "--use_env"}) {
    auto r = run_trun({"--nproc-per-node=2", "--legacy-launch", use_env, legacy_script()});
    INFO(use_env << " stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(sorted_lines(r.out) == std::vector<std::string>{"local_rank=0 LOCAL_RANK=0 rest=[]",
                                                          "local_rank=0 LOCAL_RANK=1 rest=[]"});
  }
}

TEST_CASE(
    "the local_rank macro in the script's arguments becomes each worker's local rank, and a "
    "doubled dollar sign a single one",
    "[cli]") {
  auto r = run_trun(
      {"--nproc-per-node=2", legacy_script(), "out_${local_rank}", "$local_rank", "$$", "${x}"});
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(sorted_lines(r.out) ==
        std::vector<std::string>{"local_rank=0 LOCAL_RANK=0 rest=['out_0', '0', '$', '${x}']",
                                 "local_rank=0 LOCAL_RANK=1 rest=['out_1', '1', '$', '${x}']"});
}

TEST_CASE("trun's long options may be abbreviated to a unique prefix, as argparse allows",
          "[cli]") {
  auto r = run_trun({"--nproc_per=2", "--nnode=1", "--max_re", "0", legacy_script()});
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(lines_of(r.out).size() == 2);
  // The script's own arguments are never expanded.
  auto j = dry_run({"--nnode=1", "--no-py", test_worker(), "--nproc_per=3", "--nnode"});
  CHECK(j["nproc_per_node"] == 1);
  CHECK(j["entrypoint"] == nlohmann::json::array({test_worker(), "--nproc_per=3", "--nnode"}));
  // A prefix naming several options is an error naming them all.
  expect_usage_error({"--master=1", test_worker()},
                     "ambiguous option: --master could match --master-addr, --master_addr, "
                     "--master-port, --master_port");
  expect_usage_error({"--r", "x", test_worker()}, "ambiguous option: --r could match");
}

TEST_CASE(
    "unknown --rdzv-conf keys are ignored with one warning naming them, as torchrun "
    "ignores them",
    "[cli]") {
  // A Kubeflow elasticPolicy's rdzvConf passes keys of its own.
  auto r = run_trun(
      {"--dry-run", "--rdzv-conf", "join_timeout=5,maxRestarts=3,join_timout=9", test_worker()});
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("--rdzv-conf: ignoring unknown key(s) 'join_timout', 'maxRestarts'") !=
        std::string::npos);
  CHECK(lines_of(r.err).size() == 1);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["rendezvous"]["conf"] == nlohmann::json({{"join_timeout", "5"}}));
  // Known keys with malformed values are still refused.
  expect_usage_error({"--rdzv-conf", "maxRestarts=3,read_timeout=soon", test_worker()},
                     "read_timeout=soon");
}

TEST_CASE("with --virtual-local-rank, CUDA_VISIBLE_DEVICES must list a device per worker",
          "[cli]") {
  auto r = run_trun({"--nproc-per-node=3", "--virtual-local-rank", test_worker()},
                    {{"CUDA_VISIBLE_DEVICES", "0,1"}});
  REQUIRE(r.finished);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("CUDA_VISIBLE_DEVICES=0,1 lists 2 device(s)") != std::string::npos);
}

namespace {

// Each worker of a 2-worker job with `mode` prints "<LOCAL_RANK> <Cpus_allowed_list>
// <policy of its first mapping>"; returns the lines by local rank.
std::vector<std::string> numa_report(const std::string& mode) {
  std::vector<std::string> args{"--standalone", "--nproc-per-node=2"};
  if (!mode.empty()) args.push_back("--numa-binding=" + mode);
  args.insert(args.end(), {"--no-python", "/bin/sh", "-c",
                           "echo $LOCAL_RANK $(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "
                           "/proc/self/status) $(head -1 /proc/self/numa_maps | cut -d' ' -f2)"});
  auto r = run_trun(args);
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  return sorted_lines(r.out);
}

}  // namespace

TEST_CASE(
    "numa binding (--numa-binding) binds each worker's CPUs and preferred memory node to its plan, "
    "and without it "
    "workers keep trun's affinity and the default policy",
    "[cli]") {
  const auto unbound = numa_report("");
  REQUIRE(unbound.size() == 2);
  const std::string all_cpus = unbound[0].substr(2, unbound[0].rfind(' ') - 2);
  CHECK(unbound[0] == "0 " + all_cpus + " default");
  CHECK(unbound[1] == "1 " + all_cpus + " default");
  std::vector<std::string> modes{"node", "socket", "core-complex"};
  if (sysconf(_SC_NPROCESSORS_ONLN) >= 2) modes.push_back("exclusive");
  for (const auto& mode : modes) {
    INFO("mode " << mode);
    auto plan = dry_run({"--nproc-per-node=2", "--numa-binding=" + mode, "true"});
    REQUIRE(plan["numa_binding"]["mode"] == mode);
    REQUIRE(plan["numa_binding"]["workers"].size() == 2);
    std::vector<std::string> expected;
    for (const auto& w : plan["numa_binding"]["workers"]) {
      expected.push_back(std::to_string(w["local_rank"].get<int>()) + " " +
                         w["cpus"].get<std::string>() +
                         " prefer:" + std::to_string(w["memory_node"].get<int>()));
    }
    CHECK(numa_report(mode) == expected);
    if (mode == "exclusive") {
      CHECK(plan["numa_binding"]["workers"][0]["cpus"] !=
            plan["numa_binding"]["workers"][1]["cpus"]);
    }
  }
}

TEST_CASE("a --numa-binding that the machine cannot honour exits 2 before anything starts",
          "[cli]") {
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  expect_usage_error(
      {"--nproc-per-node=" + std::to_string(cpus + 1), "--numa-binding=exclusive", test_worker()},
      "usable physical core(s) for " + std::to_string(cpus + 1) + " devices");
  expect_usage_error({"--numa-binding=nodes", test_worker()},
                     "--numa-binding=nodes: expected node, socket, exclusive or core-complex");
}
