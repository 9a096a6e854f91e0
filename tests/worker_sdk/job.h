#pragma once
// Test harness: runs N copies of a worker program as the ranks of one job, with the environment
// a trun agent would give them, against a StoreServer hosted in the test process.

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/server.h"

namespace trun::worker::test {

struct JobSpec {
  std::vector<std::string> argv;  // program and arguments (program: absolute path)
  // Ranks per node, in node order; ranks are numbered node by node, as torchrun does.
  std::vector<int> nodes = {2};
  // When true, local ranks run in reverse order of global ranks within each node.
  bool reverse_local = false;
  // When true, no LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK: each rank is its own node.
  bool no_placement = false;
  std::string run_id = "test";
  int restart_count = 0;
  std::map<std::string, std::string> env;  // extra variables for every rank
  // False: none of the variables above (RANK ... TORCHELASTIC_*); only `env` and `rank_env`, as
  // under srun, mpirun or a hand-set environment. `nodes` then only counts the ranks.
  bool torch_env = true;
  std::vector<std::map<std::string, std::string>> rank_env;  // rank_env[r]: rank r's extras
};

struct RankResult {
  int rank = 0;
  pid_t pid = 0;
  bool exited = false;  // normal exit
  int exit_code = -1;
  int signal = 0;
  std::string output;  // stdout+stderr
};

class Job {
 public:
  // Starts a store server on 127.0.0.1 (unless `port` is given: an existing one).
  explicit Job(uint16_t port = 0);
  ~Job();  // SIGKILLs and reaps whatever still runs; removes its temp dir

  uint16_t port() const { return port_; }
  // Spawns every rank; returns at once. Launcher variables the test itself inherited (SLURM_*,
  // OMPI_*, PMI_*, PMIX_*, MPI_LOCAL*, TRUN_INIT_METHOD) are not passed on.
  void start(const JobSpec& spec);
  // Waits for every rank, SIGKILLing all that remain after `timeout`.
  std::vector<RankResult> wait(std::chrono::milliseconds timeout);
  // Waits until rank `r`'s output contains `text`; false after `timeout`.
  bool wait_for_output(int r, const std::string& text, std::chrono::milliseconds timeout);
  void kill_rank(int r, int sig);
  pid_t pid(int r) const { return pids_.at(r); }
  std::string output(int r) const;
  // All outputs, for failure messages.
  std::string describe(const std::vector<RankResult>& results) const;

 private:
  void spawn(const JobSpec& spec, const std::map<std::string, std::string>& env);

  std::unique_ptr<store::StoreServer> server_;
  uint16_t port_ = 0;
  std::string dir_;
  std::vector<pid_t> pids_;
  std::vector<bool> reaped_;
};

// Names under /dev/shm that start with "trun-<run_id>".
std::vector<std::string> shm_segments(const std::string& run_id);

// A run id unique to this test process and call.
std::string unique_run_id(const std::string& base);

// The path of `path` (relative to the build dir, e.g. "launcher/trun") for this test binary.
std::string build_file(const std::string& path);
std::string worker_binary();  // path of tests/worker_sdk/pg_worker

}  // namespace trun::worker::test
