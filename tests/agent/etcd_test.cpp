// The etcd rendezvous end to end: several trun agents on this machine (the real binary, real
// workers from tests/bin) with --rdzv-backend=etcd against a real etcd
// (tests/rendezvous/etcd_server.h; where /usr/bin/etcd is missing a listed skip, or a failure in
// strict mode: tests/skip.h). They must behave as with c10d: one job across agents, restarts on
// worker failure everywhere, scale-down when an agent dies, clear errors for an unreachable or TLS
// endpoint. Every process is ended by its pid (Child); every wait is bounded, generously: these are
// behaviour checks.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include <set>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/rendezvous/etcd_server.h"
#include "tests/rendezvous/test_options.h"

using namespace trun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

constexpr auto kJobBound = std::chrono::seconds(120);

std::string unique_run_id() { return trun::testing::unique_run_id("e2e"); }

// One agent's command line: `nnodes` nodes of 2 workers each, the test worker running `actions`.
std::vector<std::string> agent(const std::string& endpoint, const std::string& run_id,
                               const std::string& nnodes, const std::vector<std::string>& extra,
                               const std::vector<std::string>& actions) {
  std::vector<std::string> argv{
      trun_binary(),         "--rdzv-backend=etcd", "--rdzv-endpoint=" + endpoint,
      "--rdzv-id=" + run_id, "--nnodes=" + nnodes,  "--nproc-per-node=2"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(test_worker());
  argv.insert(argv.end(), actions.begin(), actions.end());
  return argv;
}

std::string node_dir(const TempDir& d, int node) {
  std::string dir = d / ("n" + std::to_string(node));
  std::filesystem::create_directories(dir);
  return dir;
}

json env_of(const std::string& dir, int attempt, int local_rank) {
  return json::parse(read_file(dir + "/env_" + std::to_string(attempt) + "_" +
                               std::to_string(local_rank) + ".json"));
}

bool has_env(const std::string& dir, int attempt, int local_rank) {
  return file_exists(dir + "/env_" + std::to_string(attempt) + "_" + std::to_string(local_rank) +
                     ".json");
}

// Both nodes' workers of `attempt` form one world of 4: ranks 0..3, one group rank per node,
// RANK = GROUP_RANK x 2 + LOCAL_RANK, one MASTER_ADDR/PORT.
void check_one_world(const std::vector<std::string>& dirs, int attempt, const std::string& run_id) {
  std::set<std::string> ranks, group_ranks, masters;
  for (const auto& dir : dirs) {
    std::string group_rank;
    for (int lr = 0; lr < 2; ++lr) {
      INFO(dir << " attempt " << attempt << " local rank " << lr);
      REQUIRE(has_env(dir, attempt, lr));
      json e = env_of(dir, attempt, lr);
      CHECK(e["WORLD_SIZE"] == "4");
      CHECK(e["GROUP_WORLD_SIZE"] == "2");
      CHECK(e["LOCAL_WORLD_SIZE"] == "2");
      CHECK(e["LOCAL_RANK"] == std::to_string(lr));
      CHECK(e["TORCHELASTIC_RUN_ID"] == run_id);
      CHECK(e["TORCHELASTIC_RESTART_COUNT"] == std::to_string(attempt));
      CHECK(e["TORCHELASTIC_USE_AGENT_STORE"] == "False");  // as c10d: rank 0 hosts it
      if (lr == 0) group_rank = e["GROUP_RANK"].get<std::string>();
      CHECK(e["GROUP_RANK"] == group_rank);
      CHECK(e["RANK"] == std::to_string(std::stoi(group_rank) * 2 + lr));
      ranks.insert(e["RANK"].get<std::string>());
      masters.insert(e["MASTER_ADDR"].get<std::string>() + ":" +
                     e["MASTER_PORT"].get<std::string>());
    }
    group_ranks.insert(group_rank);
  }
  CHECK(ranks == std::set<std::string>{"0", "1", "2", "3"});
  CHECK(group_ranks == std::set<std::string>{"0", "1"});
  CHECK(masters.size() == 1);
}

}  // namespace

TEST_CASE("etcd: two agents form one job of 4 workers and both exit 0", "[agent][etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  TempDir d;
  const std::string run = unique_run_id();
  const std::string d0 = node_dir(d, 0), d1 = node_dir(d, 1);
  Child a(agent(etcd.endpoint(), run, "2", {}, {"env", d0}));
  Child b(agent(etcd.endpoint(), run, "2", {}, {"env", d1}));
  REQUIRE(a.wait(kJobBound));
  REQUIRE(b.wait(kJobBound));
  INFO("agent a:\n" << a.err() << "\nagent b:\n" << b.err());
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
  check_one_world({d0, d1}, 0, run);
}

TEST_CASE("etcd: a worker that fails once restarts the groups of both agents", "[agent][etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  TempDir d;
  const std::string run = unique_run_id();
  const std::string d0 = node_dir(d, 0), d1 = node_dir(d, 1);
  // Node 0's first workers would run for minutes: only a restart pushed from node 1 ends them.
  Child a(agent(etcd.endpoint(), run, "2", {"--max-restarts=1"},
                {"env", d0, "on-attempt", "0", "sleep", "300"}));
  Child b(agent(etcd.endpoint(), run, "2", {"--max-restarts=1"},
                {"env", d1, "on-attempt", "0", "exit", "3"}));
  bool a_done = a.wait(kJobBound), b_done = b.wait(kJobBound);
  INFO("agent a:\n" << a.err() << "\nagent b:\n" << b.err());
  REQUIRE(a_done);
  REQUIRE(b_done);
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
  // Attempt 0's workers may be stopped before they write their environment (the failure on the
  // other agent can come first): only attempt 1 (TORCHELASTIC_RESTART_COUNT=1) is checked, one
  // world on both agents. Agent a finishing at all shows its sleeping workers were ended.
  check_one_world({d0, d1}, 1, run);
  CHECK_FALSE(has_env(d0, 2, 0));
}

TEST_CASE("etcd: when one of two agents is SIGKILLed the other continues alone to exit 0",
          "[agent][etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  TempDir d;
  const std::string run = unique_run_id();
  const std::string prefix = "/trun-test/" + run + "/";
  const std::string da = node_dir(d, 0), db = node_dir(d, 1);
  const std::string release = d / "release";
  // Workers run until `release` exists (6 x 20 s at most), so the first group is still running
  // when an agent dies. A dead agent is noticed when its etcd lease lapses: keep_alive_interval=1
  // makes that 3 s instead of 15 s.
  // Each agent logs into the test's directory: a SIGKILLed trun cannot remove a temporary one.
  auto node = [&](const std::string& dir) {
    std::vector<std::string> actions{"pidfile", dir, "env", dir};
    for (int i = 0; i < 6; ++i) actions.insert(actions.end(), {"wait-file", release});
    return agent(etcd.endpoint(), run, "1:2",
                 {"--rdzv-conf", "keep_alive_interval=1,etcd_prefix=" + prefix,
                  "--log-dir=" + dir + "/logs"},
                 actions);
  };
  Child a(node(da));
  Child b(node(db));
  auto both_running = [&] {
    return has_env(da, 0, 0) && has_env(da, 0, 1) && has_env(db, 0, 0) && has_env(db, 0, 1);
  };
  bool started = wait_until(both_running, kJobBound);
  INFO("agent a:\n" << a.err() << "\nagent b:\n" << b.err());
  REQUIRE(started);
  check_one_world({da, db}, 0, run);

  // The job's keys are under its etcd_prefix, none elsewhere.
  size_t under_prefix = 0;
  for (const auto& k : etcd.keys()) {
    if (k.find(run) == std::string::npos) continue;
    INFO("key " << k);
    CHECK(k.rfind(prefix, 0) == 0);
    ++under_prefix;
  }
  CHECK(under_prefix > 0);

  const pid_t b_workers[] = {read_pid(db + "/pid_0_0"), read_pid(db + "/pid_0_1")};
  b.signal(SIGKILL);
  REQUIRE(b.wait(30s));
  for (pid_t w : b_workers) {
    INFO("agent b's worker " << w);
    CHECK(wait_until([&] { return !pid_alive(w); }, 30s));
  }

  // Agent a re-forms the group alone: its workers now see a world of 2.
  auto alone = [&] {
    if (!has_env(da, 0, 0) || !has_env(da, 0, 1)) return false;
    try {
      return env_of(da, 0, 0)["WORLD_SIZE"] == "2" && env_of(da, 0, 1)["WORLD_SIZE"] == "2";
    } catch (const std::exception&) {
      return false;  // a file being replaced
    }
  };
  bool reformed = wait_until(alone, kJobBound);
  INFO("agent a:\n" << a.err());
  REQUIRE(reformed);
  for (int lr = 0; lr < 2; ++lr) {
    json e = env_of(da, 0, lr);
    CHECK(e["GROUP_WORLD_SIZE"] == "1");
    CHECK(e["GROUP_RANK"] == "0");
    CHECK(e["RANK"] == std::to_string(lr));
  }
  { std::ofstream(release.c_str()) << "go"; }
  REQUIRE(a.wait(kJobBound));
  CHECK(a.exit_code() == 0);
}

TEST_CASE("etcd: an endpoint where nothing listens fails the agent with exit 3 naming it",
          "[agent][etcd]") {
  SKIP_WITHOUT_ETCD();
  // A port nobody listens on (free a moment ago), so connections to it are refused.
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  auto r = run_trun(
      {"--rdzv-backend=etcd", "--rdzv-endpoint=" + endpoint, "--rdzv-id=" + unique_run_id(),
       "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-conf", "read_timeout=2", test_worker()},
      {}, kJobBound);
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 3);  // docs/exit-codes.md: rendezvous failed
  CHECK(r.err.find(endpoint) != std::string::npos);
  CHECK(r.out.empty());  // no worker ran
}

TEST_CASE("etcd: an https:// endpoint is a usage error naming TLS", "[agent][etcd]") {
  auto r = run_trun({"--rdzv-backend=etcd", "--rdzv-endpoint=https://127.0.0.1:1",
                     "--rdzv-id=" + unique_run_id(), "--nnodes=1:2", test_worker()});
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 2);
  auto lines = lines_of(r.err);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].rfind("trun: error: ", 0) == 0);
  CHECK(lines[0].find("TLS") != std::string::npos);
  CHECK(r.out.empty());
}
