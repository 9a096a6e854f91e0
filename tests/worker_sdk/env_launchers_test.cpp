// WorkerEnv under srun, mpirun and the init methods (tcp://, file://, TRUN_INIT_METHOD): pure
// parsing, no processes (launchers_test.cpp runs the real worlds).

#include <catch2/catch.hpp>
#include <map>
#include <string>

#include <trun/worker.h>

#include "base/slurm.h"

using namespace trun::worker;

namespace {

using Vars = std::map<std::string, std::string>;

WorkerEnv parse_vars(const Vars& vars, const InitOptions& options = {}) {
  return WorkerEnv::parse(
      [&](const char* name) -> const char* {
        auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
      },
      options);
}

std::string error_of(const Vars& vars, const InitOptions& options = {}) {
  try {
    parse_vars(vars, options);
  } catch (const EnvError& e) {
    return e.what();
  }
  return "(no EnvError)";
}

// What srun sets for task `rank` of a step with `per_node` tasks on each node ("2(x2)").
Vars srun(int rank, const std::vector<int>& per_node, const std::string& tasks_per_node) {
  int world = 0, node = 0, before = 0;
  for (int n : per_node) world += n;
  while (rank >= before + per_node[node]) before += per_node[node++];
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_STEP_ID", "3"},
          {"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", std::to_string(world)},
          {"SLURM_STEP_NUM_TASKS", std::to_string(world)},
          {"SLURM_LOCALID", std::to_string(rank - before)},
          {"SLURM_NODEID", std::to_string(node)},
          {"SLURM_STEP_TASKS_PER_NODE", tasks_per_node},
          {"SLURM_STEP_NODELIST", "gpu[07-08]"}};
}

Vars ompi(int rank, int size, int local_size) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank % local_size)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local_size)},
          {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(rank % local_size)},
          {"OMPI_MCA_ess_base_jobid", "3049586689"}};
}

#define REQUIRE_ERROR_NAMING(vars, needle)                  \
  do {                                                      \
    std::string err_ = error_of(vars);                      \
    INFO(err_);                                             \
    CHECK(err_.find(needle) != std::string::npos);          \
    CHECK(err_.find("(no EnvError)") == std::string::npos); \
  } while (0)

}  // namespace

TEST_CASE("srun's environment gives one rank per task, the store on the first node",
          "[worker_sdk][env][slurm]") {
  WorkerEnv e = parse_vars(srun(3, {2, 2}, "2(x2)"));
  CHECK(e.launcher == "slurm");
  CHECK_FALSE(e.standalone);
  CHECK(e.rank == 3);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);
  CHECK(e.group_rank == 1);
  CHECK(e.group_world_size == 2);
  CHECK(e.master_addr == "gpu07");
  CHECK(e.master_port == trun::base::slurm_port(4242, 3));
  CHECK(e.run_id == "slurm-4242.3");
  CHECK_FALSE(e.use_agent_store);
  CHECK(e.store_origin.find("SLURM_STEP_NODELIST") != std::string::npos);

  // Uneven nodes: this node's entry of SLURM_STEP_TASKS_PER_NODE.
  WorkerEnv u = parse_vars(srun(4, {3, 2}, "3,2"));
  CHECK(u.group_rank == 1);
  CHECK(u.local_rank == 1);
  CHECK(u.local_world_size == 2);

  // MASTER_ADDR and MASTER_PORT choose the store instead.
  Vars v = srun(0, {2}, "2");
  v["MASTER_ADDR"] = "10.1.2.3";
  v["MASTER_PORT"] = "23456";
  WorkerEnv m = parse_vars(v);
  CHECK(m.master_addr == "10.1.2.3");
  CHECK(m.master_port == 23456);
  CHECK(m.store_origin.rfind("MASTER_ADDR/MASTER_PORT;", 0) == 0);
}

TEST_CASE("the batch script's and the extern step's special step ids are not an srun step",
          "[worker_sdk][env][slurm]") {
  // A program run by the batch script itself sees the job's task count, not a step of its own:
  // it is a world of one, not rank 0 of SLURM_NTASKS waiting for the others.
  for (const char* special : {"4294967294", "4294967295", "4294967290"}) {
    INFO(special);
    Vars v = srun(0, {2, 2}, "2(x2)");
    v["SLURM_STEP_ID"] = special;
    WorkerEnv e = parse_vars(v);
    CHECK(e.standalone);
    CHECK(e.world_size == 1);
  }
}

TEST_CASE("torch's variables win over srun's (srun trun ...)", "[worker_sdk][env][slurm]") {
  Vars v = srun(1, {2}, "2");
  v.insert({{"RANK", "5"},
            {"WORLD_SIZE", "8"},
            {"MASTER_ADDR", "127.0.0.1"},
            {"MASTER_PORT", "29500"},
            {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  WorkerEnv e = parse_vars(v);
  CHECK(e.launcher == "torch");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.use_agent_store);
  CHECK(e.run_id == "none");
}

TEST_CASE("mpirun inside an allocation: MPI's world, not the daemons' srun step",
          "[worker_sdk][env][slurm][mpi]") {
  // Open MPI's daemons run as a step of one task per node; ranks inherit its SLURM_*.
  Vars v = srun(1, {1, 1}, "1(x2)");
  for (auto& [k, val] : ompi(3, 4, 2)) v[k] = val;
  v["MASTER_ADDR"] = "gpu07";
  WorkerEnv e = parse_vars(v);
  CHECK(e.launcher == "mpi");
  CHECK(e.rank == 3);
  CHECK(e.world_size == 4);
  // srun --mpi=pmi2: PMI_SIZE agrees with the step, SLURM's variables win.
  Vars p = srun(3, {2, 2}, "2(x2)");
  p["PMI_RANK"] = "3";
  p["PMI_SIZE"] = "4";
  WorkerEnv s = parse_vars(p);
  CHECK(s.launcher == "slurm");
  CHECK(s.group_rank == 1);
}

TEST_CASE("a partial or contradictory srun environment fails naming the variable",
          "[worker_sdk][env][slurm]") {
  for (const char* missing : {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                              "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_ID"}) {
    Vars v = srun(1, {2}, "2");
    v.erase(missing);
    REQUIRE_ERROR_NAMING(v, std::string(missing) + " is not set, but SLURM_STEP_ID is");
  }
  Vars v = srun(1, {2}, "2");
  v.erase("SLURM_NTASKS");
  v.erase("SLURM_STEP_NUM_TASKS");
  REQUIRE_ERROR_NAMING(v, "SLURM_NTASKS is not set");

  v = srun(1, {2}, "3");  // 3 tasks on the node, 2 in the step
  REQUIRE_ERROR_NAMING(v, "SLURM_STEP_TASKS_PER_NODE='3' adds up to 3 tasks");
  v = srun(1, {2}, "2");
  v["SLURM_LOCALID"] = "2";
  REQUIRE_ERROR_NAMING(v, "SLURM_LOCALID=2 is outside [0, 1]");
  v = srun(1, {2}, "2");
  v["SLURM_STEP_TASKS_PER_NODE"] = "2(x";
  REQUIRE_ERROR_NAMING(v, "SLURM_STEP_TASKS_PER_NODE");
  v = srun(1, {2}, "2");
  v.erase("SLURM_STEP_NODELIST");
  REQUIRE_ERROR_NAMING(v, "neither MASTER_ADDR nor SLURM_STEP_NODELIST is set");
  v["MASTER_ADDR"] = "127.0.0.1";  // ... which MASTER_ADDR replaces
  CHECK(parse_vars(v).master_addr == "127.0.0.1");
}

TEST_CASE("Open MPI's environment: every rank local means 127.0.0.1 and a port from the job id",
          "[worker_sdk][env][mpi]") {
  WorkerEnv e = parse_vars(ompi(2, 4, 4));
  CHECK(e.launcher == "mpi");
  CHECK(e.rank == 2);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 2);
  CHECK(e.local_world_size == 4);
  CHECK(e.group_rank == 0);
  CHECK(e.group_world_size == 1);
  CHECK(e.master_addr == "127.0.0.1");
  CHECK(e.master_port >= 10000);
  CHECK(e.master_port <= 31999);
  CHECK(e.run_id == "mpi-3049586689");
  CHECK(e.store_origin.find("OMPI_MCA_ess_base_jobid") != std::string::npos);
  // The same job id gives every rank the same port; another job another (here) one.
  CHECK(parse_vars(ompi(0, 4, 4)).master_port == e.master_port);
  Vars other = ompi(0, 4, 4);
  other["OMPI_MCA_ess_base_jobid"] = "3049586690";
  CHECK(parse_vars(other).master_port != e.master_port);
  // Open MPI 5: PMIX_NAMESPACE.
  Vars v5 = ompi(1, 2, 2);
  v5.erase("OMPI_MCA_ess_base_jobid");
  v5["PMIX_NAMESPACE"] = "prterun-host-1234@1";
  CHECK(parse_vars(v5).run_id == "mpi-prterun-host-1234@1");
}

TEST_CASE("mpirun across nodes needs MASTER_ADDR, and a port from somewhere",
          "[worker_sdk][env][mpi]") {
  Vars v = ompi(3, 4, 2);
  REQUIRE_ERROR_NAMING(v, "MASTER_ADDR is not set, and the ranks are on several nodes");
  v["MASTER_ADDR"] = "node1";
  WorkerEnv e = parse_vars(v);
  CHECK(e.master_addr == "node1");
  CHECK(e.group_rank == -1);  // MPI has no node index
  CHECK(e.local_rank == 1);
  v.erase("OMPI_MCA_ess_base_jobid");
  REQUIRE_ERROR_NAMING(v, "MASTER_PORT is not set, and no MPI job id");
  v["MASTER_PORT"] = "29999";
  CHECK(parse_vars(v).master_port == 29999);
  CHECK(parse_vars(v).run_id == "none");

  Vars partial = ompi(0, 2, 2);
  partial.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
  REQUIRE_ERROR_NAMING(partial, "OMPI_COMM_WORLD_LOCAL_SIZE is not set");
  Vars bad = ompi(0, 2, 2);
  bad["OMPI_COMM_WORLD_RANK"] = "2";
  REQUIRE_ERROR_NAMING(bad, "OMPI_COMM_WORLD_RANK=2 is outside [0, 1]");
}

TEST_CASE("MPICH's PMI_RANK and PMI_SIZE", "[worker_sdk][env][mpi]") {
  Vars v = {{"PMI_RANK", "1"},
            {"PMI_SIZE", "2"},
            {"MPI_LOCALRANKID", "1"},
            {"MPI_LOCALNRANKS", "2"},
            {"MASTER_PORT", "29400"}};
  WorkerEnv e = parse_vars(v);
  CHECK(e.launcher == "mpi");
  CHECK(e.rank == 1);
  CHECK(e.world_size == 2);
  CHECK(e.local_rank == 1);
  CHECK(e.master_addr == "127.0.0.1");
  CHECK(e.master_port == 29400);
  v.erase("MPI_LOCALNRANKS");
  REQUIRE_ERROR_NAMING(v, "MPI_LOCALNRANKS is not set, but MPI_LOCALRANKID is");
  v.erase("MPI_LOCALRANKID");
  REQUIRE_ERROR_NAMING(v, "MPI_LOCALNRANKS is not set");  // placement unknown: MASTER_ADDR
  v.erase("PMI_SIZE");
  REQUIRE_ERROR_NAMING(v, "PMI_SIZE is not set, but PMI_RANK is");
}

TEST_CASE("tcp:// and file:// take rank and world size from options, query or environment",
          "[worker_sdk][env][init_method]") {
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:23456?rank=1&world_size=3";
  WorkerEnv e = parse_vars({}, o);
  CHECK(e.launcher == "tcp");
  CHECK(e.init_method == "tcp://127.0.0.1:23456");
  CHECK(e.rank == 1);
  CHECK(e.world_size == 3);
  CHECK(e.master_addr == "127.0.0.1");
  CHECK(e.master_port == 23456);
  CHECK_FALSE(e.use_agent_store);
  CHECK_FALSE(e.standalone);

  o.init_method = "tcp://[::1]:23456";
  o.rank = 0;
  o.world_size = 2;
  e = parse_vars({}, o);
  CHECK(e.master_addr == "::1");
  CHECK(e.rank == 0);

  o.init_method = "file:///tmp/x/store";
  e = parse_vars({}, o);
  CHECK(e.launcher == "file");
  CHECK(e.store_path == "/tmp/x/store");

  // From RANK and WORLD_SIZE (no MASTER_* needed), or from srun.
  InitOptions f;
  f.init_method = "file:///shared/store";
  e = parse_vars({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, f);
  CHECK(e.launcher == "torch");
  CHECK(e.rank == 1);
  e = parse_vars(srun(3, {2, 2}, "2(x2)"), f);
  CHECK(e.launcher == "slurm");
  CHECK(e.local_rank == 1);
  CHECK(e.store_path == "/shared/store");
}

TEST_CASE("TRUN_INIT_METHOD replaces the default env://", "[worker_sdk][env][init_method]") {
  Vars v = {{"TRUN_INIT_METHOD", "tcp://10.0.0.9:4000?rank=0&world_size=2"}};
  WorkerEnv e = parse_vars(v);
  CHECK(e.init_method == "tcp://10.0.0.9:4000");
  CHECK(e.store_origin == "TRUN_INIT_METHOD=tcp://10.0.0.9:4000; rank 0 hosts it");
  InitOptions o;
  o.init_method = "file:///tmp/mine?rank=0&world_size=2";  // the program's own wins
  CHECK(parse_vars(v, o).store_path == "/tmp/mine");
}

TEST_CASE("bad init methods fail naming where they came from", "[worker_sdk][env][init_method]") {
  auto err = [](const std::string& url, int rank = -1, int world = -1) {
    InitOptions o;
    o.init_method = url;
    o.rank = rank;
    o.world_size = world;
    return error_of({}, o);
  };
  CHECK_THAT(err("udp://h:1?rank=0&world_size=1"), Catch::Contains("unknown scheme 'udp'"));
  CHECK_THAT(err("tcp://h?rank=0&world_size=1"), Catch::Contains("the port is missing"));
  CHECK_THAT(err("tcp://h:1"), Catch::Contains("needs a rank and a world size"));
  CHECK_THAT(err("tcp://h:1?rank=0&world_size=1", 0, 1), Catch::Contains("give them one way"));
  CHECK_THAT(err("tcp://h:1?rank=2&world_size=2"), Catch::Contains("rank 2 is not below"));
  CHECK_THAT(err("tcp://h:1?rank=0"), Catch::Contains("rank and world_size go together"));
  CHECK_THAT(err("tcp://h:1?rank=0&world_size=1&x=1"),
             Catch::Contains("unknown query parameter 'x'"));
  CHECK_THAT(err("file://relative?rank=0&world_size=1"),
             Catch::Contains("expected file:///absolute/path"));
  CHECK_THAT(err("file:///a"), Catch::Contains("InitOptions::init_method='file:///a' needs"));
  CHECK_THAT(error_of({{"TRUN_INIT_METHOD", "nonsense"}}),
             Catch::Contains("TRUN_INIT_METHOD='nonsense'"));
  // env:// with rank and world size from the options still needs MASTER_ADDR/MASTER_PORT.
  CHECK_THAT(err("env://", 0, 2), Catch::Contains("env:// needs the store's address"));
}
