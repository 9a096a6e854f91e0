// libtrun_worker without trun: real pg_worker processes in the environments that a hand-set
// env://, tcp://, file://, `srun -n N` and `mpirun -np N` give them (set by hand, everything on
// 127.0.0.1), and the waiting messages of a rank whose peers never come.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <trun/worker.h>

#include "base/slurm.h"
#include "tests/launcher/free_port.h"
#include "tests/skip.h"
#include "tests/worker_sdk/job.h"

using namespace trun::worker;
using namespace trun::worker::test;
using namespace std::chrono_literals;

namespace {

using Vars = std::map<std::string, std::string>;

// Whether a TCP port can be bound on all addresses now (rank 0 binds 0.0.0.0).
bool port_free(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// Runs pg_worker `args` with rank_env[r] for rank r (nothing of trun's), requires every rank to
// pass, and returns each rank's "env ..." line.
std::vector<std::string> run_world(const std::vector<Vars>& rank_env,
                                   const std::vector<std::string>& args = {"matrix", "0", "1",
                                                                           "1000"}) {
  JobSpec spec;
  spec.argv = {worker_binary()};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.torch_env = false;
  spec.nodes = {static_cast<int>(rank_env.size())};
  spec.rank_env = rank_env;
  spec.env["PG_WORKER_BACKEND"] = "cpu";
  Job job;
  job.start(spec);
  auto results = job.wait(120s);
  INFO(job.describe(results));
  std::vector<std::string> lines;
  for (const auto& r : results) {
    REQUIRE(r.exited);
    REQUIRE(r.exit_code == 0);
    auto at = r.output.find("env launcher=");
    REQUIRE(at != std::string::npos);
    lines.push_back(r.output.substr(at, r.output.find('\n', at) - at));
  }
  return lines;
}

std::string env_line(const std::string& launcher, const std::string& init, int rank, int world,
                     int local_rank, int local_world, int group_rank, int group_world,
                     const std::string& run_id) {
  return "env launcher=" + launcher + " init=" + init + " rank=" + std::to_string(rank) +
         " world=" + std::to_string(world) + " local_rank=" + std::to_string(local_rank) +
         " local_world=" + std::to_string(local_world) +
         " group_rank=" + std::to_string(group_rank) +
         " group_world=" + std::to_string(group_world) + " run_id=" + run_id;
}

// A temporary directory, removed (with the one file a test may leave) at the end.
struct TmpDir {
  std::string path;
  TmpDir() {
    char tmpl[] = "/tmp/trun-launchers-XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TmpDir() {
    ::unlink((path + "/store").c_str());
    ::rmdir(path.c_str());
  }
};

}  // namespace

TEST_CASE("a hand-set env:// world without TORCHELASTIC_USE_AGENT_STORE: rank 0 hosts the store",
          "[worker_sdk][launchers]") {
  const std::string port = std::to_string(trun::testing::free_port());
  std::vector<Vars> env;
  for (int r = 0; r < 2; ++r)
    env.push_back({{"RANK", std::to_string(r)},
                   {"WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", port}});
  auto lines = run_world(env);
  CHECK(lines[1] == env_line("torch", "env://", 1, 2, 0, 1, 1, 2, "none"));
}

TEST_CASE("tcp:// and file:// worlds from TRUN_INIT_METHOD", "[worker_sdk][launchers]") {
  SECTION("tcp://, rank and world size in the query") {
    const std::string url = "tcp://127.0.0.1:" + std::to_string(trun::testing::free_port());
    std::vector<Vars> env;
    for (int r = 0; r < 2; ++r)
      env.push_back({{"TRUN_INIT_METHOD", url + "?rank=" + std::to_string(r) + "&world_size=2"}});
    auto lines = run_world(env);
    CHECK(lines[0] == env_line("tcp", url, 0, 2, 0, 1, 0, 2, "none"));
  }
  SECTION("file://, rank and world size from RANK and WORLD_SIZE; the last rank removes it") {
    TmpDir dir;
    const std::string url = "file://" + dir.path + "/store";
    std::vector<Vars> env;
    for (int r = 0; r < 2; ++r)
      env.push_back({{"TRUN_INIT_METHOD", url}, {"RANK", std::to_string(r)}, {"WORLD_SIZE", "2"}});
    auto lines = run_world(env);
    CHECK(lines[1] == env_line("torch", url, 1, 2, 0, 1, 1, 2, "none"));
    CHECK(::access((dir.path + "/store").c_str(), F_OK) != 0);
  }
}

TEST_CASE("srun-style worlds of 2 and 4 ranks", "[worker_sdk][launchers][slurm]") {
  // A job id whose step port is free here (another process may hold one by chance).
  unsigned long long job = 1000 + static_cast<unsigned long long>(::getpid()) % 5000;
  for (int tries = 0; tries < 50 && !port_free(trun::base::slurm_port(job, 0)); ++tries) ++job;
  if (!port_free(trun::base::slurm_port(job, 0)))
    TRUN_SKIP("no free SLURM step port found in 50 tries", kEnvironment);
  auto world = [&](const std::vector<int>& per_node, const std::string& tasks_per_node,
                   const std::string& nodelist) {
    std::vector<Vars> env;
    int world = 0;
    for (int n : per_node) world += n;
    int rank = 0;
    for (size_t node = 0; node < per_node.size(); ++node)
      for (int l = 0; l < per_node[node]; ++l, ++rank)
        env.push_back({{"SLURM_JOB_ID", std::to_string(job)},
                       {"SLURM_STEP_ID", "0"},
                       {"SLURM_PROCID", std::to_string(rank)},
                       {"SLURM_NTASKS", std::to_string(world)},
                       {"SLURM_STEP_NUM_TASKS", std::to_string(world)},
                       {"SLURM_LOCALID", std::to_string(l)},
                       {"SLURM_NODEID", std::to_string(node)},
                       {"SLURM_STEP_TASKS_PER_NODE", tasks_per_node},
                       {"SLURM_STEP_NODELIST", nodelist}});
    return run_world(env);
  };
  const std::string run_id = "slurm-" + std::to_string(job) + ".0";
  SECTION("2 tasks on one node") {
    auto lines = world({2}, "2", "127.0.0.1");
    CHECK(lines[0] == env_line("slurm", "env://", 0, 2, 0, 2, 0, 1, run_id));
    CHECK(lines[1] == env_line("slurm", "env://", 1, 2, 1, 2, 0, 1, run_id));
  }
  SECTION("4 tasks on two \"nodes\" (both 127.0.0.1)") {
    auto lines = world({2, 2}, "2(x2)", "127.0.0.1,127.0.0.1");
    for (int r = 0; r < 4; ++r)
      CHECK(lines[r] == env_line("slurm", "env://", r, 4, r % 2, 2, r / 2, 2, run_id));
  }
}

TEST_CASE("mpirun-style worlds of 2 and 4 ranks", "[worker_sdk][launchers][mpi]") {
  SECTION("Open MPI, 4 ranks, the port derived from the job id") {
    // A job id whose derived port is free here.
    std::string job;
    WorkerEnv probe;
    for (int i = 0; i < 50; ++i) {
      job = std::to_string(3000000000ull + static_cast<unsigned>(::getpid()) * 64ull + i);
      Vars v = {{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                {"OMPI_MCA_ess_base_jobid", job}};
      probe = WorkerEnv::parse([&](const char* n) -> const char* {
        auto it = v.find(n);
        return it == v.end() ? nullptr : it->second.c_str();
      });
      if (port_free(probe.master_port)) break;
    }
    if (!port_free(probe.master_port))
      TRUN_SKIP("no free derived MPI port found in 50 tries", kEnvironment);
    std::vector<Vars> env;
    for (int r = 0; r < 4; ++r)
      env.push_back({{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                     {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(r)},
                     {"OMPI_MCA_ess_base_jobid", job}});
    auto lines = run_world(env);
    for (int r = 0; r < 4; ++r)
      CHECK(lines[r] == env_line("mpi", "env://", r, 4, r, 4, 0, 1, "mpi-" + job));
  }
  SECTION("MPICH, 2 ranks, MASTER_PORT") {
    const std::string port = std::to_string(trun::testing::free_port());
    std::vector<Vars> env;
    for (int r = 0; r < 2; ++r)
      env.push_back({{"PMI_RANK", std::to_string(r)},
                     {"PMI_SIZE", "2"},
                     {"MPI_LOCALRANKID", std::to_string(r)},
                     {"MPI_LOCALNRANKS", "2"},
                     {"MASTER_PORT", port}});
    auto lines = run_world(env);
    CHECK(lines[1] == env_line("mpi", "env://", 1, 2, 1, 2, 0, 1, "none"));
  }
}

TEST_CASE("a bad launcher environment fails init() with EnvError naming the variable",
          "[worker_sdk][launchers]") {
  // In a real process, through pg_worker (exit 3, the error on stderr).
  JobSpec spec;
  spec.argv = {worker_binary(), "matrix", "0"};
  spec.torch_env = false;
  spec.nodes = {1};
  spec.rank_env = {{{"OMPI_COMM_WORLD_RANK", "0"},
                    {"OMPI_COMM_WORLD_SIZE", "2"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}};
  Job job;
  job.start(spec);
  auto results = job.wait(60s);
  INFO(job.describe(results));
  REQUIRE(results[0].exited);
  CHECK(results[0].exit_code == 3);
  CHECK_THAT(results[0].output,
             Catch::Contains("OMPI_COMM_WORLD_LOCAL_SIZE is not set, but OMPI_COMM_WORLD_RANK is"));
}

TEST_CASE("a rank whose peers never come says what it waits for, then fails",
          "[worker_sdk][launchers][waiting]") {
  // 7 s: past the first message (5 s), well before the default timeout. Not a timed assertion:
  // only the messages and the failure are checked.
  const std::string port = std::to_string(trun::testing::free_port());
  auto run_alone = [&](int rank) {
    JobSpec spec;
    spec.argv = {worker_binary(), "matrix", "0"};
    spec.torch_env = false;
    spec.nodes = {1};
    spec.env = {{"PG_WORKER_TIMEOUT_MS", "7000"}, {"PG_WORKER_BACKEND", "cpu"}};
    spec.rank_env = {{{"RANK", std::to_string(rank)},
                      {"WORLD_SIZE", "2"},
                      {"MASTER_ADDR", "127.0.0.1"},
                      {"MASTER_PORT", port}}};
    Job job;
    job.start(spec);
    auto results = job.wait(120s);
    INFO(job.describe(results));
    REQUIRE(results[0].exited);
    CHECK(results[0].exit_code == 3);
    return results[0].output;
  };
  const std::string where = "the store at 127.0.0.1:" + port +
                            " (MASTER_ADDR/MASTER_PORT; rank 0 hosts it: "
                            "TORCHELASTIC_USE_AGENT_STORE is not True)";
  SECTION("rank 1 without rank 0: the store never answers") {
    std::string out = run_alone(1);
    INFO(out);
    // "waiting 5 s so far", "gave up after 7 s": the seconds are not checked (a loaded machine
    // may round them up).
    CHECK_THAT(out, Catch::Contains("[trun.worker] rank 1/2: waiting "));
    CHECK_THAT(out, Catch::Contains(" s so far for " + where + "; waiting up to 7 s\n"));
    CHECK_THAT(out, Catch::Contains("rank 1/2: gave up after "));
    CHECK_THAT(out, Catch::Contains(" s waiting for " + where + ": "));
  }
  SECTION("rank 0 without rank 1: the group never forms") {
    std::string out = run_alone(0);
    INFO(out);
    CHECK_THAT(out, Catch::Contains("[trun.worker] rank 0/2: waiting "));
    CHECK_THAT(out, Catch::Contains(" s so far for the other ranks to build process group 0 (key"));
    CHECK_THAT(out, Catch::Contains(") in " + where + "; waiting up to 7 s\n"));
    CHECK_THAT(out, Catch::Contains("rank 0/2: gave up after "));
    CHECK_THAT(out, Catch::Contains(" s waiting for the other ranks to build process group 0"));
  }
}
