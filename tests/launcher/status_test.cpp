// `trun status`, black-box: two real agents on 127.0.0.1 for each backend (c10d, static, etcd
// with the etcd the etcd tests start). Its table and --json show both nodes, the round and the
// restarts; a worker crash changes them; a dozen status calls change nothing in the job; an unknown
// run id, nothing listening and bad options give one clear line and a documented exit code.
#include <catch2/catch.hpp>
#include <chrono>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/rendezvous/etcd_server.h"
#include "tests/rendezvous/test_options.h"

using namespace trun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

RunResult status(const std::vector<std::string>& args) {
  std::vector<std::string> a{"status"};
  a.insert(a.end(), args.begin(), args.end());
  return run_trun(a, {}, 30s);
}

// One --json status, or a null json when it failed or printed no JSON.
json status_json(const std::vector<std::string>& args) {
  std::vector<std::string> a = args;
  a.push_back("--json");
  RunResult r = status(a);
  if (r.exit_code != 0) return json();
  return json::parse(r.out, nullptr, false);
}

struct Job {
  std::vector<std::string> a_args, b_args;  // rendezvous options of agents a and b
  std::vector<std::string> status_args;     // and what trun status needs to find the job
};

std::vector<std::string> agent_argv(const std::vector<std::string>& rdzv, const std::string& nproc,
                                    const std::vector<std::string>& actions) {
  std::vector<std::string> argv{trun_binary(), "--nnodes=2", "--nproc-per-node=" + nproc,
                                "--max-restarts=2"};
  argv.insert(argv.end(), rdzv.begin(), rdzv.end());
  argv.push_back(test_worker());
  argv.insert(argv.end(), actions.begin(), actions.end());
  return argv;
}

// Both nodes of `js` in round `round` with records: a's 2 workers, b's 1.
bool shows_round(const json& js, int64_t round, int restarts) {
  if (!js.is_object() || js["round"] != round || js["round_state"] != "running") return false;
  if (js["restarts"] != restarts || js["nodes"].size() != 2) return false;
  for (const auto& n : js["nodes"]) {
    if (n["state"] != "alive" || n["agent_state"] != "running" || n["restarts"] != restarts ||
        n["record_round"] != round) {
      return false;
    }
  }
  return true;
}

// Agent a (2 workers) and b (1 worker, which crashes once on request) form a job; trun status
// follows it through round 0 and the restart.
void check_status_of_a_job(const Job& job) {
  TempDir d;
  const std::string crash = d / "crash";
  Child a(agent_argv(job.a_args, "2", {"pidfile", d / "a", "sleep", "60"}), {},
          {"TORCHELASTIC_ERROR_FILE"});
  Child b(agent_argv(job.b_args, "1",
                     {"pidfile", d / "b", "on-attempt", "0", "wait-file", crash, "on-attempt", "0",
                      "exit", "5", "sleep", "60"}),
          {}, {"TORCHELASTIC_ERROR_FILE"});
  std::filesystem::create_directories(d / "a");
  std::filesystem::create_directories(d / "b");
  const bool started = wait_until(
      [&] {
        return file_exists(d / "a/pid_0_0") && file_exists(d / "a/pid_0_1") &&
               file_exists(d / "b/pid_0_0");
      },
      60s);
  INFO("agent a:\n" << a.err() << "\nagent b:\n" << b.err());
  REQUIRE(started);

  json js;
  REQUIRE(wait_until([&] { return shows_round(js = status_json(job.status_args), 0, 0); }, 20s));
  INFO(js.dump(2));
  CHECK(js["closed"] == false);
  CHECK(js["max_restarts"] == 2);
  CHECK(js["waiting"] == 0);
  CHECK(js["last_failure"].is_null());
  std::set<int> ranks, workers;
  std::set<std::string> ids;
  for (const auto& n : js["nodes"]) {
    ranks.insert(n["group_rank"].get<int>());
    workers.insert(n["local_world_size"].get<int>());
    ids.insert(n["node_id"].get<std::string>());
    CHECK(n["addr"].get<std::string>().size() > 0);
    CHECK(n["pid"].get<int64_t>() > 0);
    CHECK(n["max_restarts"] == 2);
  }
  CHECK(ranks == std::set<int>{0, 1});
  CHECK(workers == std::set<int>{1, 2});
  CHECK(ids.size() == 2);

  RunResult table = status(job.status_args);
  INFO(table.out << table.err);
  CHECK(table.exit_code == 0);
  CHECK(table.out.find("round:        0 (running)") != std::string::npos);
  CHECK(table.out.find("2 in the round, 0 waiting") != std::string::npos);
  CHECK(table.out.find("restarts:     0 of 2 (2 left)") != std::string::npos);
  CHECK(table.out.find("last failure: none") != std::string::npos);
  for (const auto& id : ids) CHECK(table.out.find(id) != std::string::npos);

  // Read-only: more status calls leave the job in round 0, attempt 0, with no round ended.
  for (int i = 0; i < 10; ++i) REQUIRE(status(job.status_args).exit_code == 0);
  CHECK(shows_round(status_json(job.status_args), 0, 0));
  CHECK_FALSE(file_exists(d / "a/pid_1_0"));
  CHECK(a.err().find(" over") == std::string::npos);
  CHECK(b.err().find(" over") == std::string::npos);
  CHECK(a.running());
  CHECK(b.running());

  // b's worker exits 5: both nodes restart in round 1.
  { std::ofstream(crash.c_str()) << "1"; }
  REQUIRE(wait_until([&] { return file_exists(d / "a/pid_1_1") && file_exists(d / "b/pid_1_0"); },
                     60s));
  REQUIRE(wait_until([&] { return shows_round(js = status_json(job.status_args), 1, 1); }, 20s));
  INFO(js.dump(2));
  REQUIRE(js["last_failure"].is_object());
  CHECK(js["last_failure"]["message"].get<std::string>().find("exited with 5") !=
        std::string::npos);
  // The failure is b's: the node with one worker.
  std::string b_id;
  for (const auto& n : js["nodes"]) {
    if (n["local_world_size"] == 1) b_id = n["node_id"];
  }
  CHECK(js["last_failure"]["node_id"] == b_id);
  table = status(job.status_args);
  CHECK(table.out.find("round:        1 (running)") != std::string::npos);
  CHECK(table.out.find("restarts:     1 of 2 (1 left)") != std::string::npos);
  CHECK(table.out.find("exited with 5") != std::string::npos);

  a.signal(SIGTERM);
  b.signal(SIGTERM);
  CHECK(a.wait(30s));
  CHECK(b.wait(30s));
}

std::string one_line(const std::string& err) {
  std::string e = err;
  while (!e.empty() && e.back() == '\n') e.pop_back();
  return e.find('\n') == std::string::npos ? e : "";
}

}  // namespace

TEST_CASE("trun status shows both nodes, the round and restarts of a c10d job", "[status]") {
  const std::string ep = "--rdzv-endpoint=127.0.0.1:" + std::to_string(free_port());
  const std::string id = "--rdzv-id=" + unique_run_id("status-c10d");
  Job job;
  job.a_args = {"--rdzv-backend=c10d", ep, id, "--rdzv-conf=is_host=true"};
  job.b_args = {"--rdzv-backend=c10d", ep, id, "--rdzv-conf=is_host=false"};
  job.status_args = {"--rdzv-backend=c10d", ep, id};
  check_status_of_a_job(job);
}

TEST_CASE("trun status shows both nodes, the round and restarts of a static job", "[status]") {
  const std::string port = std::to_string(free_port());
  const std::string id = "--rdzv-id=" + unique_run_id("status-static");
  Job job;
  const std::vector<std::string> common{"--rdzv-backend=static", id, "--master-addr=127.0.0.1",
                                        "--master-port=" + port};
  job.a_args = common;
  job.a_args.push_back("--node-rank=0");
  job.b_args = common;
  job.b_args.push_back("--node-rank=1");
  // torchrun's spellings work too.
  job.status_args = {"--rdzv_backend", "static",        id,  "--master_addr",
                     "127.0.0.1",      "--master_port", port};
  check_status_of_a_job(job);
}

TEST_CASE("trun status shows both nodes, the round and restarts of an etcd job", "[status][etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  const std::string ep = "--rdzv-endpoint=" + etcd.endpoint();
  const std::string id = "--rdzv-id=" + unique_run_id("status-etcd");
  Job job;
  job.a_args = {"--rdzv-backend=etcd", ep, id};
  job.b_args = job.a_args;
  job.status_args = {"--rdzv-backend=etcd-v2", ep, id};
  check_status_of_a_job(job);
  // Nothing listens where etcd should be.
  RunResult none =
      status({"--rdzv-backend=etcd", "--rdzv-endpoint=127.0.0.1:" + std::to_string(free_port()),
              "--rdzv-id=job", "--timeout=2"});
  CHECK(none.exit_code == 3);
  CHECK(one_line(none.err).find("trun status: error: cannot reach the etcd cluster") !=
        std::string::npos);
  // A run id etcd has never seen.
  RunResult r = status({"--rdzv-backend=etcd", ep, "--rdzv-id=never-started"});
  CHECK(r.exit_code == 1);
  CHECK(one_line(r.err).find("no job with --rdzv-id=never-started") != std::string::npos);
}

TEST_CASE("trun status says in one line that nothing listens or the run id is unknown",
          "[status]") {
  const std::string port = std::to_string(free_port());
  SECTION("nothing listens at the endpoint: exit 3") {
    for (const char* backend : {"c10d", "static"}) {
      RunResult r = status({std::string("--rdzv-backend=") + backend,
                            "--rdzv-endpoint=127.0.0.1:" + port, "--rdzv-id=job", "--timeout=2"});
      INFO(r.err);
      CHECK(r.exit_code == 3);
      CHECK(one_line(r.err).find("trun status: error: cannot reach the job's store at 127.0.0.1:" +
                                 port) != std::string::npos);
      CHECK(r.out.empty());
    }
  }
  SECTION("a store without that run id: exit 1") {
    Child store({trun_binary(), "store", "--port", "0"});
    REQUIRE(wait_until([&] { return store.out().find("listening on") != std::string::npos; }));
    const std::string out = store.out();
    const std::string p = out.substr(out.rfind(':') + 1, out.find('\n') - out.rfind(':') - 1);
    for (const char* backend : {"c10d", "static"}) {
      RunResult r = status({std::string("--rdzv-backend=") + backend,
                            "--rdzv-endpoint=127.0.0.1:" + p, "--rdzv-id=no-such-job"});
      INFO(r.err);
      CHECK(r.exit_code == 1);
      CHECK(one_line(r.err).find("no job with --rdzv-id=no-such-job at 127.0.0.1:" + p) !=
            std::string::npos);
    }
    store.signal(SIGTERM);
    CHECK(store.wait(10s));
  }
  SECTION("bad options: exit 2") {
    for (const auto& args : std::vector<std::vector<std::string>>{
             {"--rdzv-backend=zookeeper", "--rdzv-id=j"},
             {"--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:99999", "--rdzv-id=j"},
             {"--rdzv-backend=c10d", "--rdzv-id=j"},
             {"--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1"},
             {"--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=a/b"}}) {
      RunResult r = status(args);
      INFO(args[0] << " " << r.err);
      CHECK(r.exit_code == 2);
      CHECK(one_line(r.err).rfind("trun status: error: ", 0) == 0);
    }
  }
}
