// trun under SLURM, black-box: the real binary with SLURM_* variables as an srun step sets them
// (no SLURM cluster), mostly through --dry-run; a one-node step on 127.0.0.1 for real; and two
// static agents given the same --node-rank.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/launcher/slurm_step_env.h"
#include "tests/skip.h"

using namespace trun::testing;
using namespace std::chrono_literals;
using nlohmann::json;
using Env = std::map<std::string, std::string>;

namespace {

// Everything trun reads about SLURM, and the PET_* variables a case may set: removed from what
// the test itself runs in (it may run inside a SLURM job), so that each case sets its own.
const std::vector<std::string> kUnset{"SLURM_JOB_ID",
                                      "SLURM_STEP_ID",
                                      "SLURM_STEP_NODELIST",
                                      "SLURM_JOB_NODELIST",
                                      "SLURM_NODELIST",
                                      "SLURM_STEP_NUM_NODES",
                                      "SLURM_JOB_NUM_NODES",
                                      "SLURM_NNODES",
                                      "SLURM_NODEID",
                                      "SLURM_PROCID",
                                      "SLURM_LOCALID",
                                      "SLURM_NTASKS",
                                      "SLURM_STEP_TASKS_PER_NODE",
                                      "SLURM_TASKS_PER_NODE",
                                      "TRUN_SLURM",
                                      "PET_RDZV_ID",
                                      "PET_RDZV_BACKEND",
                                      "PET_NNODES",
                                      "PET_SIGNALS_TO_HANDLE",
                                      "PET_RDZV_ENDPOINT",
                                      "TRUN_STORE_TOKEN"};

// As srun -N2 -n2 sets them for job 12, step 0, on node `node_id`.
Env step_env(int node_id = 0) { return trun::testing::slurm_step_env(node_id); }

Env with(Env env, const Env& more) {
  for (const auto& [k, v] : more) env[k] = v;
  return env;
}

RunResult dry_run_with(std::vector<std::string> args, const Env& env,
                       const std::vector<std::string>& also_unset = {}) {
  args.insert(args.begin(), "--dry-run");
  std::vector<std::string> unset = kUnset;
  unset.insert(unset.end(), also_unset.begin(), also_unset.end());
  return run_trun(args, env, 60s, unset);
}

// The dry run's JSON; the case fails when it is not one JSON document with exit 0.
json config_of(const RunResult& r) {
  INFO("stderr: " << r.err);
  REQUIRE(r.finished);
  REQUIRE(r.exit_code == 0);
  return json::parse(r.out);
}

std::vector<std::string> log_lines(const RunResult& r) { return lines_of(r.err); }

void expect_error(const std::vector<std::string>& args, const Env& env, const std::string& line) {
  INFO("env SLURM_STEP_NODELIST=" << (env.count("SLURM_STEP_NODELIST")
                                          ? env.at("SLURM_STEP_NODELIST")
                                          : std::string("(unset)")));
  auto r = dry_run_with(args, env);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 2);
  auto lines = lines_of(r.err);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0] == "trun: error: " + line);
  CHECK(r.out.empty());
}

// A port of the SLURM formula that is free on 127.0.0.1 now, and the job id that gives it
// (step 0). Bounded: tries 2750 job ids at most.
std::pair<unsigned, int> free_slurm_job() {
  for (unsigned job = 1000 + static_cast<unsigned>(getpid() % 1000), n = 0; n < 2750; ++job, ++n) {
    const int port = 10000 + static_cast<int>(job % 2750) * 8;
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (free) return {job, port};
  }
  FAIL("no free port in the SLURM range");
  return {0, 0};
}

}  // namespace

TEST_CASE("trun --dry-run prints the resolved configuration and starts nothing", "[slurm_cli]") {
  TempDir d;
  auto r = dry_run_with({"--nproc-per-node=2", "--max-restarts=3", "--tee=3", "--log-dir",
                         d / "logs", test_worker(), "pidfile", d.path(), "exit", "0"},
                        {{"PET_MONITOR_INTERVAL", "2.5"}});
  json j = config_of(r);
  CHECK(j["nnodes"] == json({{"min", 1}, {"max", 1}}));
  CHECK(j["nproc_per_node"] == 2);
  CHECK(j["max_restarts"] == 3);
  CHECK(j["role"] == "default");
  CHECK(j["rendezvous"]["backend"] == "static");
  CHECK(j["rendezvous"]["run_id"] == "none");
  CHECK(j["rendezvous"]["node_rank"] == 0);
  CHECK(j["rendezvous"]["master_port"] == 0);  // PET_MASTER_PORT=0, as every test sets it
  CHECK(j["logs"]["log_dir"] == d / "logs");
  CHECK(j["logs"]["tee"] == 3);
  CHECK(j["logs"]["redirects"] == 0);
  CHECK(j["logs"]["local_ranks_filter"].is_null());
  CHECK(j["supervision"]["monitor_interval_s"] == 2.5);
  CHECK(j["supervision"]["shutdown_timeout_s"] == 30.0);
  CHECK(j["supervision"]["exit_barrier_timeout_s"] == 300.0);
  CHECK(j["supervision"]["signals_to_handle"] == json({"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}));
  CHECK(j["entrypoint"] == json({test_worker(), "pidfile", d.path(), "exit", "0"}));
  CHECK(j["slurm"]["context"] == "none");
  CHECK(j["derived"] == json::array());
  CHECK(j["environment"]["PET_MONITOR_INTERVAL"] == "2.5");
  CHECK(r.err.empty());
  // Nothing ran: no worker wrote its pid, no log directory was made.
  CHECK_FALSE(file_exists(d / "pid_0_0"));
  CHECK_FALSE(file_exists(d / "logs"));
}

TEST_CASE("in an srun step the rendezvous options come from SLURM, with one line saying so",
          "[slurm_cli]") {
  auto r = dry_run_with({test_worker()}, step_env(1));
  json j = config_of(r);
  CHECK(j["rendezvous"]["backend"] == "c10d");
  CHECK(j["rendezvous"]["run_id"] == "12.0");
  CHECK(j["rendezvous"]["endpoint"] == "n1:10096");
  CHECK(j["nnodes"] == json({{"min", 2}, {"max", 2}}));
  CHECK(j["supervision"]["signals_to_handle"] ==
        json({"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1"}));
  CHECK(j["supervision"]["signals_to_handle_text"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1");
  CHECK(j["slurm"] == json({{"context", "step"}, {"job_id", "12"}, {"step_id", "0"}}));
  CHECK(j["derived"] == json::parse(R"([
          {"option": "--rdzv-backend", "value": "c10d", "from": ["SLURM_STEP_ID"]},
          {"option": "--rdzv-id", "value": "12.0", "from": ["SLURM_JOB_ID", "SLURM_STEP_ID"]},
          {"option": "--nnodes", "value": "2", "from": ["SLURM_STEP_NUM_NODES"]},
          {"option": "--rdzv-endpoint", "value": "n1:10096", "from": ["SLURM_STEP_NODELIST"]},
          {"option": "--signals-to-handle", "value": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           "from": ["SLURM_STEP_ID"]}])"));
  auto lines = log_lines(r);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0],
             Catch::EndsWith(
                 "trun warning: from SLURM: --rdzv-backend=c10d (SLURM_STEP_ID set), "
                 "--rdzv-id=12.0 (SLURM_JOB_ID, SLURM_STEP_ID), --nnodes=2 (SLURM_STEP_NUM_NODES), "
                 "--rdzv-endpoint=n1:10096 (SLURM_STEP_NODELIST; port 10000+(12 mod 2750)*8+0), "
                 "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 (SLURM_STEP_ID set; "
                 "SIGUSR1 added: scancel --signal=USR1 reaches the workers)"));
}

TEST_CASE("under SLURM the command line wins over PET_ variables, which win over SLURM",
          "[slurm_cli]") {
  // PET_ over SLURM.
  json j = config_of(dry_run_with(
      {test_worker()}, with(step_env(), {{"PET_RDZV_ID", "pet-id"}, {"PET_NNODES", "1:2"}})));
  CHECK(j["rendezvous"]["run_id"] == "pet-id");
  CHECK(j["nnodes"] == json({{"min", 1}, {"max", 2}}));
  CHECK(j["rendezvous"]["endpoint"] == "n1:10096");  // still from SLURM
  for (const auto& d : j["derived"]) {
    CHECK(d["option"] != "--rdzv-id");
    CHECK(d["option"] != "--nnodes");
  }
  // The command line over both.
  j = config_of(dry_run_with({"--rdzv-id=argv-id", "--rdzv-endpoint=127.0.0.1:29400",
                              "--signals-to-handle=SIGTERM", test_worker()},
                             with(step_env(), {{"PET_RDZV_ID", "pet-id"}})));
  CHECK(j["rendezvous"]["run_id"] == "argv-id");
  CHECK(j["rendezvous"]["endpoint"] == "127.0.0.1:29400");
  CHECK(j["supervision"]["signals_to_handle"] == json({"SIGTERM"}));
  CHECK(j["derived"].size() == 2);  // --rdzv-backend and --nnodes only
  // PET_SIGNALS_TO_HANDLE also keeps SIGUSR1 out.
  j = config_of(
      dry_run_with({test_worker()}, with(step_env(), {{"PET_SIGNALS_TO_HANDLE", "SIGINT"}})));
  CHECK(j["supervision"]["signals_to_handle"] == json({"SIGINT"}));
}

TEST_CASE("under SLURM with the static backend the node rank and node 0 come from SLURM",
          "[slurm_cli]") {
  // Without PET_MASTER_PORT (which names node 0's port itself).
  json j = config_of(
      dry_run_with({"--rdzv-backend=static", test_worker()}, step_env(1), {"PET_MASTER_PORT"}));
  CHECK(j["rendezvous"]["backend"] == "static");
  CHECK(j["rendezvous"]["node_rank"] == 1);
  CHECK(j["rendezvous"]["master_addr"] == "n1");
  CHECK(j["rendezvous"]["master_port"] == 10096);
  expect_error({"--rdzv-backend=static", "--node-rank=0", test_worker()}, step_env(1),
               "--node-rank=0 contradicts SLURM_NODEID=1 (the static backend needs this node's "
               "rank in the step; leave --node-rank out)");
}

TEST_CASE("in a batch script outside srun nothing is derived, and one line says so",
          "[slurm_cli]") {
  for (const Env& env : {Env{{"SLURM_JOB_ID", "12"}, {"SLURM_JOB_NODELIST", "n[1-2]"}},
                         Env{{"SLURM_JOB_ID", "12"}, {"SLURM_STEP_ID", "4294967294"}}}) {
    auto r = dry_run_with({test_worker()}, env);
    json j = config_of(r);
    CHECK(j["rendezvous"]["backend"] == "static");
    CHECK(j["derived"] == json::array());
    CHECK(j["slurm"]["context"] == "outside_step");
    auto lines = log_lines(r);
    REQUIRE(lines.size() == 1);
    CHECK_THAT(lines[0], Catch::Contains("trun warning: in SLURM job 12 but not in an srun step"));
    CHECK_THAT(lines[0], Catch::Contains("start trun with srun, one per node"));
  }
}

TEST_CASE("TRUN_SLURM=0 ignores SLURM's environment", "[slurm_cli]") {
  auto r = dry_run_with({test_worker()}, with(step_env(), {{"TRUN_SLURM", "0"}}));
  json j = config_of(r);
  CHECK(j["rendezvous"]["backend"] == "static");
  CHECK(j["nnodes"]["max"] == 1);
  CHECK(j["derived"] == json::array());
  CHECK(j["slurm"]["context"] == "disabled");
  CHECK(j["supervision"]["signals_to_handle"].size() == 4);
  CHECK(r.err.empty());
}

TEST_CASE("bad SLURM input exits 2 with one line naming the variable or the option",
          "[slurm_cli]") {
  const std::string w = test_worker();
  expect_error({w}, with(step_env(), {{"SLURM_STEP_NODELIST", "n[1-"}}),
               "SLURM_STEP_NODELIST=n[1-: hostlist 'n[1-': '[' without ']'");
  expect_error({w}, with(step_env(), {{"SLURM_STEP_NUM_NODES", "two"}}),
               "SLURM_STEP_NUM_NODES=two: expected the step's node count (a positive number)");
  expect_error({w}, with(step_env(), {{"SLURM_NODEID", "x"}}),
               "SLURM_NODEID=x: expected this node's index in the step (0, 1, ...)");
  expect_error({w}, with(step_env(), {{"SLURM_STEP_TASKS_PER_NODE", "1(x2"}}),
               "SLURM_STEP_TASKS_PER_NODE=1(x2: tasks per node '1(x2': '1(x2' is not N or "
               "N(xM)");
  expect_error({w}, with(step_env(), {{"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}}),
               "srun started 2 trun processes on this node (SLURM_STEP_TASKS_PER_NODE=2(x2)): use "
               "--ntasks-per-node=1 (one trun per node; it starts --nproc-per-node workers "
               "itself), or set TRUN_SLURM=0 to run several on purpose");
  expect_error({"--nnodes=4", w}, step_env(),
               "--nnodes=4 contradicts SLURM_STEP_NUM_NODES=2: this srun step has 2 nodes (leave "
               "--nnodes out, or give a count or range that includes 2)");
  expect_error({"--nnodes=3:8", w}, step_env(),
               "--nnodes=3:8 contradicts SLURM_STEP_NUM_NODES=2: this srun step has 2 nodes "
               "(leave --nnodes out, or give a count or range that includes 2)");
  expect_error({"--standalone", w}, step_env(),
               "--standalone runs on one node, but this srun step has 2 nodes "
               "(SLURM_STEP_NUM_NODES=2): leave --standalone out and trun meets the other nodes "
               "at the step's first node");
  expect_error({w}, with(step_env(), {{"TRUN_SLURM", "no"}}),
               "TRUN_SLURM=no: expected 0 (ignore SLURM's environment) or 1");
}

TEST_CASE("a first host that does not resolve fails at once with one error line", "[slurm_cli]") {
  const std::string host = "no-such-host.invalid";
  TRUN_SKIP_UNLESS_NONAME(host);
  Env env = with(step_env(), {{"SLURM_STEP_NODELIST", host},
                              {"SLURM_STEP_NUM_NODES", "1"},
                              {"SLURM_STEP_TASKS_PER_NODE", "1"}});
  env["TRUN_SLURM"] = "1";
  auto r = run_trun({"--rdzv-conf", "join_timeout=5", test_worker()}, env, 30s, kUnset);
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 3);
  auto lines = lines_of(r.err);
  REQUIRE(lines.size() == 2);
  CHECK_THAT(lines[0], Catch::Contains("--rdzv-endpoint=" + host + ":10096 (SLURM_STEP_NODELIST"));
  CHECK_THAT(lines[1], Catch::Contains(host + ":10096"));
  CHECK_THAT(lines[1], Catch::Contains("cannot resolve host"));
}

TEST_CASE("a one-node srun step runs on the derived store, and SIGUSR1 reaches the workers",
          "[slurm_cli]") {
  TempDir d;
  const auto [job, port] = free_slurm_job();
  const Env env = {{"SLURM_JOB_ID", std::to_string(job)},
                   {"SLURM_STEP_ID", "0"},
                   {"SLURM_STEP_NODELIST", "127.0.0.1"},
                   {"SLURM_STEP_NUM_NODES", "1"},
                   {"SLURM_NODEID", "0"},
                   {"SLURM_STEP_TASKS_PER_NODE", "1"}};
  Env child_env = env;
  std::vector<std::string> argv{trun_binary(), test_worker(), "env",    d.path(), "pidfile",
                                d.path(),      "trap",        d.path(), "sleep",  "60"};
  std::vector<std::string> unset = kUnset;
  unset.push_back("LOGLEVEL");
  Child trun(argv, child_env, unset);
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0"); }, 30s));
  const json worker_env = json::parse(read_file(d / "env_0_0.json"));
  CHECK(worker_env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1");
  CHECK(worker_env["TORCHELASTIC_RUN_ID"] == std::to_string(job) + ".0");
  CHECK(worker_env["WORLD_SIZE"] == "1");
  // scancel --signal=USR1: trun forwards it and exits 128+10 instead of dying of it.
  trun.signal(SIGUSR1);
  REQUIRE(trun.wait(30s));
  INFO(trun.err());
  CHECK(trun.exit_code() == 128 + SIGUSR1);
  CHECK_FALSE(trun.signaled());
  CHECK(read_file(d / "sig_0") == std::to_string(SIGUSR1));
  CHECK_THAT(trun.err(), Catch::Contains("--rdzv-endpoint=127.0.0.1:" + std::to_string(port)));
}

TEST_CASE("a worker that exits as trun gets a handled signal does not cause a restart",
          "[slurm_cli]") {
  // As scancel does: the signal reaches trun while its worker exits non-zero on its own.
  auto r = run_trun({"--standalone", "--max-restarts=3", "--signals-to-handle=SIGTERM,SIGUSR1",
                     test_worker(), "signal-parent", std::to_string(SIGUSR1), "exit", "1"},
                    {}, 60s, kUnset);
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 128 + SIGUSR1);
  CHECK_THAT(r.err, !Catch::Contains("restarting the worker group"));
}

TEST_CASE("two static agents given the same node rank are told so, naming both", "[slurm_cli]") {
  const std::string port = std::to_string(free_port());
  auto agent = [&](int rank) {
    return std::vector<std::string>{trun_binary(),
                                    "--nnodes=3",
                                    "--node-rank=" + std::to_string(rank),
                                    "--rdzv-id=dup-rank",
                                    "--master-addr=127.0.0.1",
                                    "--master-port=" + port,
                                    "--rdzv-conf",
                                    "timeout=60",
                                    test_worker(),
                                    "sleep",
                                    "60"};
  };
  SECTION("node rank 1 twice: the round ends for all three") {
    Child node0(agent(0), {}, kUnset);
    Child first(agent(1), {}, kUnset);
    Child second(agent(1), {}, kUnset);
    REQUIRE(node0.wait(30s));
    REQUIRE(first.wait(30s));
    REQUIRE(second.wait(30s));
    for (Child* c : {&node0, &first, &second}) {
      INFO(c->err());
      CHECK(c->exit_code() == 3);
      CHECK_THAT(c->err(), Catch::Contains("--node-rank=1 was given to two nodes: "));
      CHECK_THAT(c->err(), Catch::Contains("give every node its own --node-rank"));
    }
    // The message names both agents by pid.
    const std::string later =
        first.err().find("round 0 aborted") == std::string::npos ? first.err() : second.err();
    CHECK_THAT(later, Catch::Contains("trun pid " + std::to_string(first.pid()) + " at "));
    CHECK_THAT(later, Catch::Contains("trun pid " + std::to_string(second.pid()) + " at "));
  }
  SECTION("node rank 0 twice: the second cannot host the store and names the first") {
    Child first(agent(0), {}, kUnset);
    // Once the first listens.
    REQUIRE(wait_until(
        [&] {
          int fd = ::socket(AF_INET, SOCK_STREAM, 0);
          sockaddr_in addr{};
          addr.sin_family = AF_INET;
          addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          addr.sin_port = htons(static_cast<uint16_t>(std::stoi(port)));
          const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
          ::close(fd);
          return ok;
        },
        30s));
    Child second(agent(0), {}, kUnset);
    REQUIRE(second.wait(30s));
    REQUIRE(first.wait(30s));
    INFO(first.err() << "\n---\n" << second.err());
    CHECK(second.exit_code() == 3);
    CHECK_THAT(second.err(), Catch::Contains("--node-rank=0 was given to two nodes: "));
    CHECK_THAT(second.err(), Catch::Contains("trun pid " + std::to_string(first.pid()) + " at "));
    CHECK_THAT(second.err(), Catch::Contains("the first hosts the store at 127.0.0.1:" + port));
    CHECK(first.exit_code() == 3);
    CHECK_THAT(first.err(), Catch::Contains("round 0 aborted: --node-rank=0 was given to two"));
  }
}
