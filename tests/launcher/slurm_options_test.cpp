// The options an srun step implies (launcher/slurm_options.h), as a pure function of a fake
// environment and of what the user gave.
#include "launcher/slurm_options.h"

#include <catch2/catch.hpp>
#include <map>
#include <set>

#include "tests/launcher/slurm_step_env.h"

using namespace trun::launcher;

namespace {

using Env = std::map<std::string, std::string>;

// As srun -N2 -n2 sets them for job 12, step 0, on node 1.
Env step_env() { return trun::testing::slurm_step_env(1); }

SlurmOptions derive(const Env& env, const GivenOptions& given = {}) {
  return derive_slurm_options(
      [&](const std::string& name) -> std::optional<std::string> {
        auto it = env.find(name);
        return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
      },
      given);
}

std::map<std::string, std::string> options_of(const SlurmOptions& s) {
  std::map<std::string, std::string> out;
  for (const auto& d : s.derived) out[d.option] = d.value;
  return out;
}

// The one-line message of the SlurmOptionError that `env` and `given` lead to.
std::string error_of(const Env& env, const GivenOptions& given = {}) {
  try {
    derive(env, given);
  } catch (const SlurmOptionError& e) {
    CHECK(e.exit_code() == 2);
    return e.what();
  }
  FAIL("no error");
  return "";
}

}  // namespace

TEST_CASE("outside SLURM nothing is derived and nothing is logged", "[slurm_options]") {
  const SlurmOptions s = derive({{"PATH", "/bin"}});
  CHECK(s.context == SlurmContext::kNone);
  CHECK(s.derived.empty());
  CHECK(s.log_line.empty());
}

TEST_CASE("each derived option carries its identity and the launcher's name for it",
          "[slurm_options]") {
  std::set<Opt> ids;
  for (const SlurmDerived& d : derive(step_env()).derived) {
    ids.insert(d.id);
    CHECK(d.option == flag_name(d.id));
  }
  CHECK(ids == std::set<Opt>{Opt::kRdzvBackend, Opt::kRdzvId, Opt::kNnodes, Opt::kRdzvEndpoint,
                             Opt::kSignalsToHandle});
}

TEST_CASE("an srun step implies the c10d backend, its id, node count, endpoint and SIGUSR1",
          "[slurm_options]") {
  const SlurmOptions s = derive(step_env());
  CHECK(s.context == SlurmContext::kStep);
  CHECK(s.job_id == "12");
  CHECK(s.step_id == "0");
  CHECK(options_of(s) == std::map<std::string, std::string>{
                             {"--rdzv-backend", "c10d"},
                             {"--rdzv-id", "12.0"},
                             {"--nnodes", "2"},
                             {"--rdzv-endpoint", "n1:10096"},
                             {"--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}});
  CHECK(s.log_line ==
        "from SLURM: --rdzv-backend=c10d (SLURM_STEP_ID set), --rdzv-id=12.0 (SLURM_JOB_ID, "
        "SLURM_STEP_ID), --nnodes=2 (SLURM_STEP_NUM_NODES), --rdzv-endpoint=n1:10096 "
        "(SLURM_STEP_NODELIST; port 10000+(12 mod 2750)*8+0), "
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 (SLURM_STEP_ID set; SIGUSR1 "
        "added: scancel --signal=USR1 reaches the workers)");
}

TEST_CASE("the endpoint's port follows the documented formula for any job and step",
          "[slurm_options]") {
  Env env = step_env();
  env["SLURM_JOB_ID"] = "2751";
  env["SLURM_STEP_ID"] = "9";
  const SlurmOptions s = derive(env);
  CHECK(options_of(s)["--rdzv-endpoint"] == "n1:10009");  // 10000 + 1*8 + 1
  CHECK(options_of(s)["--rdzv-id"] == "2751.9");
  CHECK(s.log_line.find("port 10000+(2751 mod 2750)*8+(9 mod 8)") != std::string::npos);
}

TEST_CASE("without SLURM_STEP_NODELIST the job's node list and SLURM_NNODES serve",
          "[slurm_options]") {
  Env env = step_env();
  env.erase("SLURM_STEP_NODELIST");
  env.erase("SLURM_STEP_NUM_NODES");
  env["SLURM_JOB_NODELIST"] = "gpu-[07-09]";
  env["SLURM_NNODES"] = "2";
  const SlurmOptions s = derive(env);
  CHECK(options_of(s)["--rdzv-endpoint"] == "gpu-07:10096");
  CHECK(options_of(s)["--nnodes"] == "2");
  CHECK(s.log_line.find("--nnodes=2 (SLURM_NNODES)") != std::string::npos);
  CHECK(s.log_line.find("(SLURM_JOB_NODELIST; port") != std::string::npos);
}

TEST_CASE("options the user gave are never derived", "[slurm_options]") {
  GivenOptions g;
  g.rdzv_backend = "c10d";
  g.rdzv_id = "mine";
  g.nnodes = "1:2";
  g.rdzv_endpoint = "head:29400";
  g.signals_to_handle = "SIGTERM";
  const SlurmOptions s = derive(step_env(), g);
  CHECK(s.context == SlurmContext::kStep);
  CHECK(s.derived.empty());
  CHECK(s.log_line == "in SLURM step 12.0: every option SLURM implies was given; derived none");
}

TEST_CASE("with the static backend the node rank comes from SLURM_NODEID", "[slurm_options]") {
  GivenOptions g;
  g.rdzv_backend = "static";
  SlurmOptions s = derive(step_env(), g);
  auto o = options_of(s);
  CHECK(o["--node-rank"] == "1");
  CHECK(o["--rdzv-endpoint"] == "n1:10096");
  CHECK(o.count("--rdzv-backend") == 0);
  CHECK(s.log_line.find("--node-rank=1 (SLURM_NODEID)") != std::string::npos);

  g.node_rank = "1";  // agrees
  CHECK(options_of(derive(step_env(), g)).count("--node-rank") == 0);
  g.node_rank = "0";
  CHECK(error_of(step_env(), g) ==
        "--node-rank=0 contradicts SLURM_NODEID=1 (the static backend needs this node's rank in "
        "the step; leave --node-rank out)");

  // --master-addr or --master-port name node 0 themselves: no endpoint is derived.
  g.node_rank.reset();
  g.master_port = "29500";
  CHECK(options_of(derive(step_env(), g)).count("--rdzv-endpoint") == 0);
}

TEST_CASE("c10d and etcd derive no node rank, and etcd no endpoint", "[slurm_options]") {
  CHECK(options_of(derive(step_env())).count("--node-rank") == 0);
  GivenOptions g;
  g.rdzv_backend = "etcd";
  auto o = options_of(derive(step_env(), g));
  CHECK(o.count("--rdzv-endpoint") == 0);
  CHECK(o["--rdzv-id"] == "12.0");
}

TEST_CASE("a given --standalone derives no rendezvous option, and is refused on several nodes",
          "[slurm_options]") {
  GivenOptions g;
  g.standalone = true;
  Env one = step_env();
  one["SLURM_STEP_NODELIST"] = "n1";
  one["SLURM_STEP_NUM_NODES"] = "1";
  one["SLURM_NODEID"] = "0";
  one["SLURM_STEP_TASKS_PER_NODE"] = "1";
  CHECK(options_of(derive(one, g)) ==
        std::map<std::string, std::string>{
            {"--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}});
  CHECK(error_of(step_env(), g) ==
        "--standalone runs on one node, but this srun step has 2 nodes (SLURM_STEP_NUM_NODES=2): "
        "leave --standalone out and trun meets the other nodes at the step's first node");
}

TEST_CASE("a given --nnodes that excludes the step's node count is refused", "[slurm_options]") {
  GivenOptions g;
  g.nnodes = "4";
  CHECK(error_of(step_env(), g) ==
        "--nnodes=4 contradicts SLURM_STEP_NUM_NODES=2: this srun step has 2 nodes (leave "
        "--nnodes out, or give a count or range that includes 2)");
  g.nnodes = "3:4";
  CHECK(error_of(step_env(), g).rfind("--nnodes=3:4 contradicts SLURM_STEP_NUM_NODES=2", 0) == 0);
  g.nnodes = "2";
  CHECK_NOTHROW(derive(step_env(), g));
  g.nnodes = "1:4";
  CHECK_NOTHROW(derive(step_env(), g));
}

TEST_CASE("outside an srun step nothing is derived, and the line says so", "[slurm_options]") {
  Env batch = {{"SLURM_JOB_ID", "12"}, {"SLURM_JOB_NODELIST", "n[1-2]"}};
  SlurmOptions s = derive(batch);
  CHECK(s.context == SlurmContext::kOutsideStep);
  CHECK(s.derived.empty());
  CHECK(s.log_line ==
        "in SLURM job 12 but not in an srun step (SLURM_STEP_ID is unset): deriving no options "
        "from SLURM; start trun with srun, one per node (docs/slurm.md)");
  for (const char* special : {"4294967294", "4294967295", "4294967291", "4294967292"}) {
    batch["SLURM_STEP_ID"] = special;
    s = derive(batch);
    CHECK(s.context == SlurmContext::kOutsideStep);
    CHECK(s.derived.empty());
    CHECK(s.log_line.find(std::string("SLURM_STEP_ID=") + special +
                          " is the batch or extern step") != std::string::npos);
  }
}

TEST_CASE("TRUN_SLURM=0 turns it off, and another value is an error", "[slurm_options]") {
  Env env = step_env();
  env["TRUN_SLURM"] = "0";
  const SlurmOptions s = derive(env);
  CHECK(s.context == SlurmContext::kDisabled);
  CHECK(s.derived.empty());
  CHECK(s.log_line.empty());
  env["TRUN_SLURM"] = "1";
  CHECK(derive(env).context == SlurmContext::kStep);
  env["TRUN_SLURM"] = "off";
  CHECK(error_of(env) == "TRUN_SLURM=off: expected 0 (ignore SLURM's environment) or 1");
}

TEST_CASE("malformed SLURM variables are errors naming the variable and its value",
          "[slurm_options]") {
  auto with = [](const std::string& k, const std::string& v) {
    Env env = step_env();
    env[k] = v;
    return env;
  };
  CHECK(error_of(with("SLURM_JOB_ID", "12a")) == "SLURM_JOB_ID=12a: expected a numeric job id");
  CHECK(error_of(with("SLURM_STEP_ID", "x")) == "SLURM_STEP_ID=x: expected a numeric step id");
  CHECK(error_of(with("SLURM_STEP_NUM_NODES", "two")) ==
        "SLURM_STEP_NUM_NODES=two: expected the step's node count (a positive number)");
  CHECK(error_of(with("SLURM_STEP_NUM_NODES", "0")).rfind("SLURM_STEP_NUM_NODES=0: ", 0) == 0);
  CHECK(error_of(with("SLURM_NODEID", "-1")) ==
        "SLURM_NODEID=-1: expected this node's index in the step (0, 1, ...)");
  CHECK(error_of(with("SLURM_NODEID", "2")) ==
        "SLURM_NODEID=2 is not a node of the step (SLURM_STEP_NUM_NODES=2)");
  CHECK(error_of(with("SLURM_STEP_NODELIST", "n[1-"))
            .rfind("SLURM_STEP_NODELIST=n[1-: hostlist 'n[1-': ", 0) == 0);
  CHECK(error_of(with("SLURM_STEP_NODELIST", "n[1-3]")) ==
        "SLURM_STEP_NODELIST=n[1-3] lists 3 hosts, but SLURM_STEP_NUM_NODES=2");
  CHECK(error_of(with("SLURM_STEP_TASKS_PER_NODE", "1(x"))
            .rfind("SLURM_STEP_TASKS_PER_NODE=1(x: tasks per node '1(x': ", 0) == 0);
}

TEST_CASE("without SLURM_STEP_NUM_NODES the node list gives the count in messages too",
          "[slurm_options]") {
  Env env = step_env();
  env.erase("SLURM_STEP_NUM_NODES");
  env.erase("SLURM_NNODES");
  env["SLURM_NODEID"] = "5";
  CHECK(error_of(env) == "SLURM_NODEID=5 is not a node of the step (SLURM_STEP_NODELIST=n[1-2])");
  env["SLURM_NODEID"] = "0";
  GivenOptions g;
  g.nnodes = "3";
  CHECK(error_of(env, g).rfind("--nnodes=3 contradicts SLURM_STEP_NODELIST=n[1-2]: ", 0) == 0);
  CHECK(options_of(derive(env))["--nnodes"] == "2");
}

TEST_CASE("several trun processes on one node are refused", "[slurm_options]") {
  Env env = step_env();
  env["SLURM_STEP_TASKS_PER_NODE"] = "1,2";  // this node (SLURM_NODEID=1) runs two
  CHECK(error_of(env) ==
        "srun started 2 trun processes on this node (SLURM_STEP_TASKS_PER_NODE=1,2): use "
        "--ntasks-per-node=1 (one trun per node; it starts --nproc-per-node workers itself), or "
        "set TRUN_SLURM=0 to run several on purpose");
  env["SLURM_STEP_TASKS_PER_NODE"] = "2,1";  // another node's problem, not this one's
  CHECK_NOTHROW(derive(env));
  env["TRUN_SLURM"] = "0";
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x2)";
  CHECK_NOTHROW(derive(env));
}

TEST_CASE("an empty SLURM_STEP_NODELIST is reported where the endpoint would come from it",
          "[slurm_options]") {
  Env env = step_env();
  env["SLURM_STEP_NODELIST"] = "";
  env["SLURM_JOB_NODELIST"] = "other[1-4]";  // the job's list is not the step's: not used
  CHECK(error_of(env).rfind("SLURM_STEP_NODELIST is set but empty, so the step's first host "
                            "(where the c10d store runs) is unknown and --rdzv-endpoint cannot "
                            "be derived: give --rdzv-endpoint=HOST:PORT",
                            0) == 0);
  GivenOptions static_backend;
  static_backend.rdzv_backend = "static";
  CHECK(error_of(env, static_backend).find("static backend's node 0") != std::string::npos);
  // Nothing needs it when the endpoint is given, or when static has --master-addr.
  GivenOptions endpoint;
  endpoint.rdzv_endpoint = "n1:29400";
  CHECK(options_of(derive(env, endpoint)).count("--rdzv-endpoint") == 0);
  static_backend.master_addr = "n1";
  CHECK(options_of(derive(env, static_backend))["--rdzv-backend"].empty());
  // Unset (not empty), the job's list still serves.
  env.erase("SLURM_STEP_NODELIST");
  env["SLURM_JOB_NODELIST"] = "n[1-2]";
  CHECK(options_of(derive(env))["--rdzv-endpoint"].rfind("n1:", 0) == 0);
}
