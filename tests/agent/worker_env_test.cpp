// agent/worker_env.h: torchrun's variables for each worker, over what trun inherited.
#include <catch2/catch.hpp>
#include <map>

#include "agent/worker_env.h"

using namespace trun::agent;

namespace {
EnvMap as_map(const std::vector<std::string>& env) {
  EnvMap out;
  for (const auto& kv : env) {
    const auto eq = kv.find('=');
    REQUIRE(eq != std::string::npos);
    CHECK(out.count(kv.substr(0, eq)) == 0);  // each key once
    out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

AttemptEnv attempt() {
  AttemptEnv a;
  a.run_id = "job7";
  a.restart_count = 2;
  a.group_rank = 1;
  a.group_world_size = 3;
  a.world_size = 12;
  a.role_world_size = 8;
  a.master_addr = "10.1.2.3";
  a.master_port = 29511;
  a.use_agent_store = true;
  return a;
}
}  // namespace

TEST_CASE("env_map reads KEY=VALUE strings, the last repeat wins, entries without = are skipped",
          "[worker_env]") {
  const char* env[] = {"A=1", "B=x=y", "junk", "A=2", "EMPTY=", nullptr};
  const EnvMap m = env_map(env);
  CHECK(m == EnvMap{{"A", "2"}, {"B", "x=y"}, {"EMPTY", ""}});
  CHECK(env_map(nullptr).empty());
}

TEST_CASE("the base environment adds torchrun's defaults only where the parent lacks them",
          "[worker_env]") {
  bool omp = true;
  EnvMap one = base_worker_env({{"PATH", "/bin"}}, 1, &omp);
  CHECK_FALSE(omp);  // one worker: OMP_NUM_THREADS stays unset
  CHECK(one.count("OMP_NUM_THREADS") == 0);
  CHECK(one.at("NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK(one.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK(one.at("PATH") == "/bin");

  EnvMap four = base_worker_env({}, 4, &omp);
  CHECK(omp);
  CHECK(four.at("OMP_NUM_THREADS") == "1");

  EnvMap own =
      base_worker_env({{"OMP_NUM_THREADS", "6"}, {"NCCL_ASYNC_ERROR_HANDLING", "0"}}, 4, &omp);
  CHECK_FALSE(omp);
  CHECK(own.at("OMP_NUM_THREADS") == "6");
  CHECK(own.at("NCCL_ASYNC_ERROR_HANDLING") == "0");
}

TEST_CASE("a worker gets every rank variable torchrun sets, sorted, over the base",
          "[worker_env]") {
  LaunchConfig c;
  c.nproc_per_node = 4;
  c.role = "trainer";
  c.max_restarts = 5;
  c.signals_to_handle_text = "SIGTERM,SIGINT";
  EnvMap base = {{"HOME", "/root"}, {"RANK", "stale"}, {"TRUN_LOCAL_RANK", "9"}};
  const auto env = worker_env(base, c, attempt(), WorkerIdentity{3, 7, 6, "/logs/3/error.json"});
  CHECK(std::is_sorted(env.begin(), env.end()));
  const EnvMap m = as_map(env);
  CHECK(m.at("HOME") == "/root");
  CHECK(m.at("LOCAL_RANK") == "3");
  CHECK(m.at("RANK") == "7");
  CHECK(m.at("ROLE_RANK") == "6");
  CHECK(m.at("GROUP_RANK") == "1");
  CHECK(m.at("ROLE_NAME") == "trainer");
  CHECK(m.at("LOCAL_WORLD_SIZE") == "4");
  CHECK(m.at("WORLD_SIZE") == "12");
  CHECK(m.at("GROUP_WORLD_SIZE") == "3");
  CHECK(m.at("ROLE_WORLD_SIZE") == "8");
  CHECK(m.at("MASTER_ADDR") == "10.1.2.3");
  CHECK(m.at("MASTER_PORT") == "29511");
  CHECK(m.at("TORCHELASTIC_RESTART_COUNT") == "2");
  CHECK(m.at("TORCHELASTIC_MAX_RESTARTS") == "5");
  CHECK(m.at("TORCHELASTIC_RUN_ID") == "job7");
  CHECK(m.at("TORCHELASTIC_USE_AGENT_STORE") == "True");
  CHECK(m.at("TORCHELASTIC_ERROR_FILE") == "/logs/3/error.json");
  CHECK(m.at("TORCHELASTIC_SIGNALS_TO_HANDLE") == "SIGTERM,SIGINT");
  // A TRUN_LOCAL_RANK inherited from an outer trun is not passed on.
  CHECK(m.count("TRUN_LOCAL_RANK") == 0);
  CHECK(m.count("CUDA_VISIBLE_DEVICES") == 0);

  AttemptEnv own_store = attempt();
  own_store.use_agent_store = false;
  CHECK(as_map(worker_env({}, c, own_store, WorkerIdentity{})).at("TORCHELASTIC_USE_AGENT_STORE") ==
        "False");
}

TEST_CASE("with virtual local ranks each worker sees only its own device, as device 0",
          "[worker_env]") {
  LaunchConfig c;
  c.nproc_per_node = 2;
  c.virtual_local_rank = true;
  EnvMap by_rank = as_map(worker_env({}, c, attempt(), WorkerIdentity{1, 5, 5, "e"}));
  CHECK(by_rank.at("LOCAL_RANK") == "0");
  CHECK(by_rank.at("TRUN_LOCAL_RANK") == "1");
  CHECK(by_rank.at("CUDA_VISIBLE_DEVICES") == "1");

  c.visible_devices = {"GPU-aaa", "GPU-bbb"};
  EnvMap listed = as_map(worker_env({{"CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb"}}, c, attempt(),
                                    WorkerIdentity{1, 5, 5, "e"}));
  CHECK(listed.at("CUDA_VISIBLE_DEVICES") == "GPU-bbb");
  CHECK(listed.at("LOCAL_RANK") == "0");
}

TEST_CASE("worker_argv substitutes the local rank macro as torchrun's Template does", "[env]") {
  const std::vector<std::string> entry{"/bin/$local_rank",
                                       "-u",
                                       "train.py",
                                       "--local_rank=${local_rank}",
                                       "out_$local_rank.txt",
                                       "$$local_rank",
                                       "${LOCAL_RANK}",
                                       "$local_rankx",
                                       "${local_rank",
                                       "cost$",
                                       "$5",
                                       "${x}"};
  const auto argv = worker_argv(entry, 3);
  const std::vector<std::string> expected{"/bin/$local_rank",
                                          "-u",
                                          "train.py",
                                          "--local_rank=3",
                                          "out_3.txt",
                                          "$local_rank",
                                          "${LOCAL_RANK}",
                                          "$local_rankx",
                                          "${local_rank",
                                          "cost$",
                                          "$5",
                                          "${x}"};
  CHECK(argv == expected);
  CHECK(worker_argv({}, 0).empty());
}
