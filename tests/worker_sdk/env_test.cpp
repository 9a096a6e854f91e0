// WorkerEnv parsing and init() outside a launcher.

#include <catch2/catch.hpp>
#include <map>
#include <string>

#include <trun/worker.h>

#include "store/server.h"

using namespace trun::worker;

namespace {

WorkerEnv parse(const std::map<std::string, std::string>& vars) {
  return WorkerEnv::parse([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::map<std::string, std::string> full() {
  return {{"RANK", "5"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"GROUP_RANK", "1"},
          {"GROUP_WORLD_SIZE", "2"},
          {"ROLE_RANK", "5"},
          {"ROLE_NAME", "trainer"},
          {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29500"},
          {"TORCHELASTIC_RESTART_COUNT", "3"},
          {"TORCHELASTIC_RUN_ID", "job7"},
          {"TORCHELASTIC_ERROR_FILE", "/tmp/err.json"},
          {"TRUN_STORE_TOKEN", "s3cret"}};
}

void require_error_naming(const std::map<std::string, std::string>& vars,
                          const std::string& needle) {
  try {
    parse(vars);
    FAIL("expected EnvError mentioning " << needle);
  } catch (const EnvError& e) {
    INFO(e.what());
    REQUIRE(std::string(e.what()).find(needle) != std::string::npos);
  }
}

// init() reads the process environment: no launcher variables the test itself runs under.
void unset_launcher_env() {
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "TRUN_INIT_METHOD"})
    ::unsetenv(v);
}

}  // namespace

TEST_CASE("the agent's full environment is parsed field by field", "[worker_sdk][env]") {
  WorkerEnv env = parse(full());
  CHECK_FALSE(env.standalone);
  CHECK(env.rank == 5);
  CHECK(env.world_size == 8);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 4);
  CHECK(env.group_rank == 1);
  CHECK(env.group_world_size == 2);
  CHECK(env.role_rank == 5);
  CHECK(env.role_name == "trainer");
  CHECK(env.master_addr == "10.0.0.1");
  CHECK(env.master_port == 29500);
  CHECK(env.restart_count == 3);
  CHECK(env.run_id == "job7");
  CHECK(env.error_file == "/tmp/err.json");
  CHECK(env.store_token == "s3cret");
}

TEST_CASE("no launcher environment means a standalone world of size 1", "[worker_sdk][env]") {
  WorkerEnv env = parse({});
  CHECK(env.standalone);
  CHECK(env.rank == 0);
  CHECK(env.world_size == 1);
}

TEST_CASE("a partial environment fails naming the missing variable", "[worker_sdk][env]") {
  for (const char* missing : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                              "LOCAL_WORLD_SIZE", "GROUP_RANK"}) {
    auto vars = full();
    vars.erase(missing);
    require_error_naming(vars, std::string(missing) + " is not set");
  }
  require_error_naming({{"LOCAL_RANK", "0"}}, "RANK is not set");
}

TEST_CASE("malformed values fail naming the variable and the value", "[worker_sdk][env]") {
  struct Case {
    const char* var;
    const char* value;
    const char* needle;
  };
  for (const Case& c :
       {Case{"RANK", "abc", "RANK='abc' is not an integer"},
        Case{"RANK", "8", "RANK=8 is outside [0, 7]"}, Case{"RANK", "-1", "RANK=-1 is outside"},
        Case{"WORLD_SIZE", "0", "WORLD_SIZE=0 is outside"},
        Case{"WORLD_SIZE", "4x", "WORLD_SIZE='4x' is not an integer"},
        Case{"MASTER_PORT", "70000", "MASTER_PORT=70000 is outside"},
        Case{"MASTER_PORT", "", "MASTER_PORT is set but empty"},
        Case{"MASTER_ADDR", "", "MASTER_ADDR is set but empty"},
        Case{"LOCAL_RANK", "4", "LOCAL_RANK=4 is outside [0, 3]"},
        Case{"GROUP_RANK", "2", "GROUP_RANK=2 is not below GROUP_WORLD_SIZE=2"},
        Case{"TORCHELASTIC_RESTART_COUNT", "x",
             "TORCHELASTIC_RESTART_COUNT='x' is not an integer"}}) {
    auto vars = full();
    vars[c.var] = c.value;
    require_error_naming(vars, c.needle);
  }
}

TEST_CASE("without placement variables every rank is a node of its own", "[worker_sdk][env]") {
  WorkerEnv env =
      parse({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 1);
  CHECK(env.group_rank == 2);
  CHECK(env.group_world_size == 3);
}

TEST_CASE("init() outside a launcher gives a working world of size 1", "[worker_sdk][env]") {
  unset_launcher_env();
  Worker w = init();
  CHECK(w.env().standalone);
  CHECK(w.world_size() == 1);
  CHECK(w.store() == nullptr);
  ProcessGroup& pg = w.process_group();
  CHECK(pg.size() == 1);
  std::vector<float> x = {1.5f, -2.0f, 3.0f};
  pg.allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kAvg);
  CHECK(x == std::vector<float>{1.5f, -2.0f, 3.0f});
  std::vector<int64_t> in = {7, 8}, out(2);
  pg.allgather(in.data(), out.data(), 2, DataType::kInt64);
  CHECK(out == in);
  pg.reduce_scatter(in.data(), out.data(), 2, DataType::kInt64, ReduceOp::kMax);
  CHECK(out == in);
  pg.broadcast(x.data(), 3, DataType::kFloat32, 0);
  pg.barrier();
  auto work = pg.allreduce_async(x.data(), 3, DataType::kFloat32);
  work.wait();
  CHECK(work.is_completed());
  CHECK(work.error() == nullptr);
}

TEST_CASE("invalid collective arguments are rejected on the caller's thread", "[worker_sdk][env]") {
  unset_launcher_env();
  Worker w = init();
  ProcessGroup& pg = w.process_group();
  std::vector<float> x(4);
  CHECK_THROWS_AS(pg.allreduce(nullptr, 4, DataType::kFloat32), std::invalid_argument);
  CHECK_THROWS_AS(pg.broadcast(x.data(), 4, DataType::kFloat32, 1), std::invalid_argument);
  CHECK_THROWS_AS(pg.allgather(x.data(), x.data() + 1, 2, DataType::kFloat32),
                  std::invalid_argument);
  CHECK_THROWS_AS(parse_backend("mpi"), std::invalid_argument);
  CHECK(parse_backend("NCCL") == Backend::kNccl);
  pg.abort("test");
  CHECK(pg.broken());
  CHECK_THROWS_AS(pg.barrier(), CollectiveError);
}

TEST_CASE("init() connects to an authenticating store with TRUN_STORE_TOKEN", "[worker_sdk][env]") {
  trun::store::StoreServerOptions so;
  so.host = "127.0.0.1";
  so.token = "s3cret";
  auto server = trun::store::StoreServer::start(so);
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(server->port()).c_str(), 1);
  ::setenv("TORCHELASTIC_RUN_ID", "tokentest", 1);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);  // the server above is the "agent's"
  InitOptions io;
  io.timeout = std::chrono::seconds(5);
  SECTION("right token") {
    ::setenv("TRUN_STORE_TOKEN", "s3cret", 1);
    Worker w = init(io);
    REQUIRE(w.store() != nullptr);
    w.store()->set("k", "v");
    CHECK(w.store()->get("k") == "v");
    CHECK_FALSE(w.env().standalone);
  }
  SECTION("wrong token") {
    ::setenv("TRUN_STORE_TOKEN", "wrong", 1);
    CHECK_THROWS_AS(init(io), trun::store::StoreError);
  }
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                        "TRUN_STORE_TOKEN", "TORCHELASTIC_USE_AGENT_STORE"})
    ::unsetenv(v);
  server->stop();
}

TEST_CASE("TORCHELASTIC_USE_AGENT_STORE says whether rank 0 hosts the job's store",
          "[worker_sdk][env]") {
  auto vars = full();
  // Unset: rank 0 hosts it, as PyTorch's env:// does (only True means the agent's store).
  CHECK_FALSE(parse(vars).use_agent_store);
  CHECK(parse(vars).store_origin ==
        "MASTER_ADDR/MASTER_PORT; rank 0 hosts it: TORCHELASTIC_USE_AGENT_STORE is not True");
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  CHECK(parse(vars).use_agent_store);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  CHECK_FALSE(parse(vars).use_agent_store);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "maybe";
  require_error_naming(vars, "TORCHELASTIC_USE_AGENT_STORE");
}

TEST_CASE("TRUN_STORE_DIALECT names the store's protocol, unset means probe", "[worker_sdk][env]") {
  using trun::store::StoreDialect;
  auto vars = full();
  CHECK(parse(vars).store_dialect == StoreDialect::kAuto);
  vars["TRUN_STORE_DIALECT"] = "torch1.13";
  CHECK(parse(vars).store_dialect == StoreDialect::kTorch1_13);
  vars["TRUN_STORE_DIALECT"] = "trun";
  CHECK(parse(vars).store_dialect == StoreDialect::kTrun);
  vars["TRUN_STORE_DIALECT"] = "torch1.12";
  require_error_naming(vars, "TRUN_STORE_DIALECT");
}

TEST_CASE("TRUN_LOCAL_RANK (trun --virtual-local-rank) gives the real local rank",
          "[worker_sdk][env]") {
  auto vars = full();
  vars["LOCAL_RANK"] = "0";  // what every worker sees under --virtual-local-rank
  vars["TRUN_LOCAL_RANK"] = "3";
  CHECK(parse(vars).local_rank == 3);
  vars["TRUN_LOCAL_RANK"] = "4";  // LOCAL_WORLD_SIZE is 4
  require_error_naming(vars, "TRUN_LOCAL_RANK");
}
