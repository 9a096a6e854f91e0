// examples/train_mlp stopped on request under the real trun (trun/stop.h): a stop signal to trun
// or to one worker makes every rank stop at one step, save it and exit 75; the next run resumes
// from exactly that step and ends with the parameters of an uninterrupted run. Also: the default
// checkpoint directory of runs without a run id.

#include <catch2/catch.hpp>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "tests/launcher/process_util.h"
#include "tests/worker_sdk/job.h"
#include "tests/worker_sdk/signal_pending.h"

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using trun::testing::Child;
using trun::testing::TempDir;
using trun::testing::wait_until;

namespace {

std::string train_mlp() { return std::string(TRUN_BINARY_DIR) + "/examples/train_mlp"; }

// 1200 samples, 2 ranks of 5: 120 steps.
const std::vector<std::string> kTraining = {"--dataset-size", "1200", "--batch-size", "5",
                                            "--epochs",       "1",    "--seed",       "3"};

// trun as a preemptible job runs it; LOGLEVEL=DEBUG makes it log each worker's exit status.
std::unique_ptr<Child> start_trun(const std::vector<std::string>& mlp_args) {
  std::vector<std::string> argv = {
      trun::testing::trun_binary(),          "--standalone",     "--nproc-per-node=2",
      "--signals-to-handle=SIGTERM,SIGUSR1", "--max-restarts=0", train_mlp()};
  argv.insert(argv.end(), kTraining.begin(), kTraining.end());
  argv.insert(argv.end(), mlp_args.begin(), mlp_args.end());
  return std::make_unique<Child>(
      argv,
      std::map<std::string, std::string>{{"TRUN_JOB_ID", "mlp-stop-test"}, {"LOGLEVEL", "DEBUG"}},
      std::vector<std::string>{"TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "SLURM_JOB_ID"});
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct RankLog {
  int rank = -1;
  uint64_t last_step = 0;
};

// pid -> the rank and last step of each sample log PREFIX.<pid> in `dir`.
std::map<std::string, RankLog> rank_logs(const std::string& dir, const std::string& prefix) {
  std::map<std::string, RankLog> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix + ".", 0) != 0) continue;
    std::ifstream in(e.path());
    RankLog log;
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (std::regex_search(line, m, std::regex(R"(step (\d+) world \d+ rank (\d+))"))) {
        log.last_step = std::stoull(m[1]);
        log.rank = std::stoi(m[2]);
      }
    }
    out[name.substr(prefix.size() + 1)] = log;
  }
  return out;
}

pid_t pid_of_rank(const std::string& dir, const std::string& prefix, int rank) {
  for (const auto& [pid, log] : rank_logs(dir, prefix))
    if (log.rank == rank) return static_cast<pid_t>(std::stol(pid));
  return 0;
}

// The step of the one "stopped on request (SIG) at step S: checkpoint step_S saved" line.
uint64_t stopped_step(const std::string& out, const std::string& sig) {
  const std::regex line("stopped on request \\(" + sig +
                        "\\) at step (\\d+): checkpoint step_(\\d+) saved");
  std::smatch m;
  REQUIRE(std::regex_search(out, m, line));
  REQUIRE(m[1] == m[2]);
  CHECK(std::distance(std::sregex_iterator(out.begin(), out.end(), line), std::sregex_iterator()) ==
        1);
  return std::stoull(m[1]);
}

size_t count_of(const std::string& text, const std::regex& re) {
  return static_cast<size_t>(
      std::distance(std::sregex_iterator(text.begin(), text.end(), re), std::sregex_iterator()));
}

// Every rank stopped at `step` (its sample log ends there), step_<step> is the latest checkpoint
// and the only one besides the periodic ones (every `every` steps), and both workers exited 75.
void check_stopped_together(const TempDir& d, const std::string& log, uint64_t step, uint64_t every,
                            const std::string& trun_err) {
  const auto logs = rank_logs(d.path(), log);
  REQUIRE(logs.size() == 2);
  for (const auto& [pid, l] : logs) {
    INFO("rank " << l.rank << " (pid " << pid << ")");
    CHECK(l.last_step == step);
  }
  CHECK(fs::exists(d / ("ck/step_" + std::to_string(step)) + "/manifest.json"));
  CHECK(trun::testing::read_file(d / "ck/latest") == "step_" + std::to_string(step) + "\n");
  CHECK(count_of(trun_err, std::regex(R"(worker local_rank=\d pid=\d+ exited with 75)")) == 2);
  for (const auto& e : fs::directory_iterator(d / "ck")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0) continue;
    INFO(name);
    const uint64_t n = std::stoull(name.substr(5));
    CHECK(n <= step);
    CHECK((n % every == 0 || n == step));
  }
}

// Resumes the training in d/ck (and runs it uninterrupted in d/ck2): same final parameters.
void check_resume_is_exact(const TempDir& d, uint64_t step) {
  auto resumed = start_trun({"--ckpt-dir", d / "ck", "--final-params", d / "resumed.bin"});
  REQUIRE(resumed->wait(120s));
  INFO(resumed->out() << resumed->err());
  REQUIRE(resumed->exit_code() == 0);
  CHECK_THAT(resumed->out(), Catch::Contains("step_" + std::to_string(step) + " (step " +
                                             std::to_string(step) + ", "));
  auto full = start_trun({"--ckpt-dir", d / "ck2", "--final-params", d / "full.bin"});
  REQUIRE(full->wait(120s));
  REQUIRE(full->exit_code() == 0);
  const std::string a = bytes_of(d / "resumed.bin"), b = bytes_of(d / "full.bin");
  // 10 -> 10 -> 5: 165 parameters and 165 momentum values, float32.
  REQUIRE(b.size() == 2 * 165 * sizeof(float));
  CHECK(a == b);
}

// Until every rank trained past `step` (a checkpoint exists, and a stop lands between two of
// them, so that the final save is one of its own).
void wait_for_training(Child& trun, const TempDir& d, uint64_t step) {
  auto past = [&] {
    const auto logs = rank_logs(d.path(), "log");
    if (logs.size() != 2 || !fs::exists(d / "ck/latest")) return false;
    for (const auto& [pid, l] : logs)
      if (l.last_step <= step) return false;
    return true;
  };
  REQUIRE(wait_until([&] { return past() || !trun.running(); }, 60s));
  REQUIRE(trun.running());
}

}  // namespace

TEST_CASE(
    "train_mlp under trun stops on SIGUSR1 at one step on every rank, exits 75 and resumes to "
    "the parameters of an uninterrupted run",
    "[train_mlp][stop]") {
  TempDir d;
  auto job = start_trun({"--ckpt-dir", d / "ck", "--ckpt-every", "7", "--step-sleep-ms", "30",
                         "--sample-log", d / "log"});
  wait_for_training(*job, d, 8);
  job->signal(SIGUSR1);
  REQUIRE(job->wait(60s));
  INFO(job->out() << job->err());
  CHECK(job->exit_code() == 128 + SIGUSR1);
  const uint64_t step = stopped_step(job->out(), "SIGUSR1");
  CHECK(step < 120);
  check_stopped_together(d, "log", step, 7, job->err());
  check_resume_is_exact(d, step);
}

TEST_CASE("train_mlp: a SIGUSR1 that reaches one worker only still stops every rank at one step",
          "[train_mlp][stop]") {
  TempDir d;
  auto job = start_trun({"--ckpt-dir", d / "ck", "--ckpt-every", "7", "--step-sleep-ms", "30",
                         "--sample-log", d / "log"});
  wait_for_training(*job, d, 8);
  const pid_t rank1 = pid_of_rank(d.path(), "log", 1);
  REQUIRE(rank1 > 0);
  REQUIRE(::kill(rank1, SIGUSR1) == 0);
  REQUIRE(job->wait(60s));
  INFO(job->out() << job->err());
  // trun was not signalled: it sees workers that exited 75, a failure (no restarts left).
  CHECK(job->exit_code() == 1);
  CHECK_THAT(job->err(), Catch::Contains("exitcode  : 75"));
  const uint64_t step = stopped_step(job->out(), "SIGUSR1");
  check_stopped_together(d, "log", step, 7, job->err());
  check_resume_is_exact(d, step);
}

TEST_CASE(
    "train_mlp: SIGTERM delivered twice (to a worker directly and through trun) saves one final "
    "checkpoint",
    "[train_mlp][stop]") {
  TempDir d;
  auto job = start_trun({"--ckpt-dir", d / "ck", "--ckpt-every", "3", "--step-sleep-ms", "200",
                         "--sample-log", d / "log", "--async-ckpt"});
  wait_for_training(*job, d, 3);
  const pid_t rank0 = pid_of_rank(d.path(), "log", 0);
  REQUIRE(rank0 > 0);
  // As SLURM does (every task), then as trun does (it forwards the one it receives).
  REQUIRE(::kill(rank0, SIGTERM) == 0);
  REQUIRE(wait_until([&] { return !trun::worker::test::signal_pending(rank0, SIGTERM); }, 30s));
  job->signal(SIGTERM);
  REQUIRE(job->wait(60s));
  INFO(job->out() << job->err());
  CHECK(job->exit_code() == 128 + SIGTERM);
  const uint64_t step = stopped_step(job->out(), "SIGTERM");
  check_stopped_together(d, "log", step, 3, job->err());
  check_resume_is_exact(d, step);
}

TEST_CASE("train_mlp: the default checkpoint directories of two unrelated standalone runs differ",
          "[train_mlp][stop]") {
  TempDir d;
  const std::vector<std::string> unset = {
      "RANK",        "WORLD_SIZE",          "MASTER_ADDR",
      "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"};
  std::vector<std::string> dirs;
  for (int i = 0; i < 2; ++i) {
    Child c({train_mlp(), "--dataset-size", "40", "--batch-size", "5", "--epochs", "1"},
            {{"TMPDIR", d.path()}}, unset);
    REQUIRE(c.wait(60s));
    INFO(c.out() << c.err());
    REQUIRE(c.exit_code() == 0);
    std::smatch m;
    const std::string out = c.out();
    REQUIRE(std::regex_search(out, m, std::regex(R"(checkpoints in (\S+) \(no run id)")));
    dirs.push_back(m[1]);
    CHECK(dirs.back().rfind(d / "train_mlp-", 0) == 0);
    CHECK_FALSE(fs::exists(dirs.back()));  // a run's own directory is removed once it is done
  }
  CHECK(dirs[0] != dirs[1]);

  // Two ranks without a run id agree on rank 0's directory (through the store); under a launcher
  // (any run id) the directory is $TMPDIR/train_mlp-ckpt, so that running the job again resumes.
  for (const std::string& run_id :
       {std::string("none"), trun::worker::test::unique_run_id("mlp-dir")}) {
    trun::worker::test::Job job;
    trun::worker::test::JobSpec spec;
    spec.argv = {train_mlp(), "--dataset-size", "40", "--batch-size", "5", "--epochs", "1"};
    spec.nodes = {2};
    spec.run_id = run_id;
    spec.env["TMPDIR"] = d.path();
    job.start(spec);
    auto results = job.wait(120s);
    INFO(job.describe(results));
    for (const auto& r : results) REQUIRE(r.exit_code == 0);
    if (run_id == "none") {
      CHECK_THAT(results[0].output, Catch::Contains("checkpoints in " + d / "train_mlp-"));
    } else {
      CHECK_THAT(results[0].output, Catch::Contains("no checkpoint in " + d / "train_mlp-ckpt"));
      CHECK(fs::exists(d / "train_mlp-ckpt/latest"));
    }
  }
}

TEST_CASE(
    "train_mlp: a standalone job run again resumes from the default directory, and a live owner "
    "is refused",
    "[train_mlp][stop]") {
  TempDir d;
  // Each trun --standalone has a run id of its own (the job id then): nothing ties the second
  // run to the first but the directory.
  auto run = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {trun::testing::trun_binary(),
                                     "--standalone",
                                     "--nproc-per-node=2",
                                     train_mlp(),
                                     "--ckpt-every",
                                     "5"};
    argv.insert(argv.end(), kTraining.begin(), kTraining.end());
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Child>(
        argv, std::map<std::string, std::string>{{"TMPDIR", d.path()}},
        std::vector<std::string>{"TRUN_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_ERROR_FILE"});
  };
  const std::string dir = d / "train_mlp-ckpt";
  auto first = run({"--stop-after-steps", "10"});
  REQUIRE(first->wait(120s));
  INFO(first->out() << first->err());
  REQUIRE(first->exit_code() == 0);
  REQUIRE(fs::exists(dir + "/step_10"));

  // Run again: it continues the first job (whose processes are gone) at step 10, in one line.
  // Its 5 steps take 5 s, the window in which the third run must find it alive (with 100 ms
  // steps a loaded machine let the third run arrive after it had finished).
  auto again = run({"--stop-after-steps", "5", "--step-sleep-ms", "1000"});
  // Meanwhile a third run on the same directory is refused at once, naming the live owner.
  REQUIRE(wait_until([&] { return again->out().find("resumed from") != std::string::npos; }, 60s));
  auto third = run({});
  REQUIRE(third->wait(120s));
  INFO(third->out() << third->err());
  CHECK(third->exit_code() != 0);
  CHECK_THAT(third->out() + third->err(), Catch::Contains("belongs to another job"));
  REQUIRE(again->wait(120s));
  INFO(again->out() << again->err());
  CHECK(again->exit_code() == 0);
  CHECK_THAT(again->out(), Catch::Contains("resumed from " + dir + "/step_10 (step 10"));
  CHECK_THAT(again->err(), Catch::Contains("continuing job '"));
  CHECK_THAT(again->err(), Catch::Contains("from " + dir + "/step_10 (its owner is gone)"));
  CHECK(fs::exists(dir + "/step_15"));
}
