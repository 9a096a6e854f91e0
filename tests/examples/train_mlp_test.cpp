// examples/train_mlp end to end: ranks launched with the launcher's environment, checkpoints on
// disk, and resumes at other world sizes. The sample logs (--sample-log) say which samples each
// rank trained on at each step.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/worker_sdk/checkpoint/ckpt_test_util.h"
#include "tests/worker_sdk/run_job.h"

using namespace trun::worker;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::string train_mlp() { return std::string(TRUN_BINARY_DIR) + "/examples/train_mlp"; }

using trun::test::TempDir;

// Samples of epoch 0 seen in the logs starting with `prefix`, at steps <= max_step.
void collect(const std::string& dir, const std::string& prefix, uint64_t max_step,
             std::map<uint64_t, int>& seen, int* world_seen) {
  for (auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix + ".", 0) != 0) continue;
    std::ifstream in(e.path());
    std::string line;
    while (std::getline(in, line)) {
      // "start group G ..." opens each process's log; each step's line is
      // "epoch E step S world W rank R group G time T idx I...".
      if (line.rfind("start ", 0) == 0) continue;
      std::istringstream ls(line);
      std::string w_epoch, w_step, w_world, w_rank, w_group, group, w_time, w_idx;
      uint64_t epoch, step;
      int world, rank;
      double time;
      ls >> w_epoch >> epoch >> w_step >> step >> w_world >> world >> w_rank >> rank >> w_group >>
          group >> w_time >> time >> w_idx;
      REQUIRE(w_epoch == "epoch");
      REQUIRE(w_group == "group");
      REQUIRE(w_idx == "idx");
      if (epoch != 0 || step > max_step) continue;
      *world_seen = world;
      uint64_t i;
      while (ls >> i) ++seen[i];
    }
  }
}

std::vector<test::RankResult> run_job(int world, std::vector<std::string> argv,
                                      std::chrono::milliseconds timeout = 120s) {
  test::JobSpec spec;
  spec.argv = std::move(argv);
  spec.nodes = {world};
  spec.run_id = test::unique_run_id("mlp");
  // Each launch has a run id of its own; the checkpoints belong to the one training they continue.
  spec.env["TRUN_JOB_ID"] = "train-mlp-test";
  return test::run_job_ok(spec, timeout);
}

uint64_t resumed_step(const std::string& out) {
  std::smatch m;
  REQUIRE(std::regex_search(out, m, std::regex(R"(resumed from \S+ \(step (\d+))")));
  return std::stoull(m[1]);
}

}  // namespace

TEST_CASE("train_mlp: saved at world size 4, resumed at 2 and at 3, sees every sample once",
          "[train_mlp]") {
  TempDir d;
  // 620 samples: after 10 steps of 5 x 4, the 420 left divide evenly among 2, 3 and 4 ranks.
  const std::vector<std::string> common = {"--dataset-size", "620", "--batch-size", "5",
                                           "--epochs",       "1",   "--ckpt-every", "5"};
  auto args = [&](const std::string& ckpt, const std::string& log, std::vector<std::string> extra) {
    std::vector<std::string> a = {train_mlp(), "--ckpt-dir", d.path + "/" + ckpt, "--sample-log",
                                  d.path + "/" + log};
    a.insert(a.end(), common.begin(), common.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto first = run_job(4, args("ck4", "log4", {"--stop-after-steps", "10"}));
  REQUIRE(first[0].output.find("stopping after 10 steps") != std::string::npos);

  for (int world : {2, 3}) {
    INFO("resumed at world size " << world);
    const std::string ck = "ck" + std::to_string(world);
    fs::copy(d.path + "/ck4", d.path + "/" + ck, fs::copy_options::recursive);
    auto results = run_job(world, args(ck, "log" + std::to_string(world), {}));
    REQUIRE(resumed_step(results[0].output) == 10);
    REQUIRE(results[0].output.find("saved at world size 4, now " + std::to_string(world)) !=
            std::string::npos);
    for (int r = 0; r < world; ++r)
      REQUIRE(std::regex_search(results[r].output,
                                std::regex("\\[\\d+\\] epoch 0 \\(rank " + std::to_string(r) +
                                           ", local_rank " + std::to_string(r) + "\\) loss ")));
    std::map<uint64_t, int> seen;
    int w = 0;
    collect(d.path, "log4", 10, seen, &w);
    REQUIRE(w == 4);
    size_t before = 0;
    for (auto& [i, c] : seen) before += c;
    REQUIRE(before == 200);
    collect(d.path, "log" + std::to_string(world), UINT64_MAX, seen, &w);
    REQUIRE(w == world);
    REQUIRE(seen.size() == 620);
    for (auto& [i, c] : seen) {
      INFO("sample " << i);
      REQUIRE(c == 1);
    }
  }
}

TEST_CASE("train_mlp: a job killed mid-training resumes from its checkpoint at another size",
          "[train_mlp]") {
  TempDir d;
  const std::vector<std::string> common = {train_mlp(),
                                           "--ckpt-dir",
                                           d.path + "/ck",
                                           "--dataset-size",
                                           "1200",
                                           "--batch-size",
                                           "5",
                                           "--epochs",
                                           "1",
                                           "--ckpt-every",
                                           "3",
                                           "--async-ckpt",
                                           "--step-sleep-ms",
                                           "30"};
  {
    test::Job job;
    test::JobSpec spec;
    spec.argv = common;
    spec.argv.insert(spec.argv.end(), {"--sample-log", d.path + "/logA"});
    spec.nodes = {4};
    spec.run_id = test::unique_run_id("mlp-kill");
    spec.env["TRUN_JOB_ID"] = "train-mlp-test";
    job.start(spec);
    // Let it train a while (several checkpoints), then take the whole group down at once, as an
    // agent does when one worker dies.
    // (1200 samples / 20 a step = 60 steps of >= 30 ms: at least 1.8 s of training.)
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (!fs::exists(d.path + "/ck/latest") && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(10ms);
    REQUIRE(fs::exists(d.path + "/ck/latest"));
    std::this_thread::sleep_for(400ms);
    for (int r = 0; r < 4; ++r) job.kill_rank(r, SIGKILL);
    auto results = job.wait(30s);
    for (auto& r : results) REQUIRE(r.signal == SIGKILL);
    REQUIRE(test::shm_segments(spec.run_id).empty());
  }
  auto results = run_job(3, [&] {
    auto a = common;
    a.insert(a.end(), {"--sample-log", d.path + "/logB"});
    return a;
  }());
  const uint64_t step = resumed_step(results[0].output);
  INFO("resumed from step " << step);
  REQUIRE(step > 0);
  REQUIRE(step % 3 == 0);
  std::map<uint64_t, int> seen;
  int w = 0;
  collect(d.path, "logA", step, seen, &w);
  collect(d.path, "logB", UINT64_MAX, seen, &w);
  REQUIRE(w == 3);
  // 1200 - 20 * step samples were left, divisible by 3 only sometimes: padding may repeat up to
  // two samples at the very end.
  REQUIRE(seen.size() == 1200);
  size_t twice = 0;
  for (auto& [i, c] : seen) {
    REQUIRE(c <= 2);
    twice += c == 2;
  }
  REQUIRE(twice == (3 - (1200 - 20 * step) % 3) % 3);
}

TEST_CASE(
    "train_mlp: two ranks on checkpoints whose manifests hold bytes that are not UTF-8 "
    "refuse with the list, keeping them",
    "[train_mlp][damage]") {
  TempDir d;
  const std::vector<std::string> args = {train_mlp(),
                                         "--ckpt-dir",
                                         d.path + "/ck",
                                         "--dataset-size",
                                         "200",
                                         "--batch-size",
                                         "5",
                                         "--epochs",
                                         "1",
                                         "--ckpt-every",
                                         "5"};
  run_job(2, args);
  // A 0xFF inside the first key of every manifest: the parser quotes it in its error message.
  int damaged = 0;
  for (const auto& e : fs::directory_iterator(d.path + "/ck")) {
    const std::string m = e.path().string() + "/manifest.json";
    if (!fs::exists(m)) continue;
    std::fstream f(m, std::ios::in | std::ios::out | std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const auto quote = text.find('"');
    REQUIRE(quote != std::string::npos);
    f.seekp(static_cast<std::streamoff>(quote + 1));
    f.put('\xff');
    ++damaged;
  }
  REQUIRE(damaged > 0);
  test::Job job;
  test::JobSpec spec;
  spec.argv = args;
  spec.nodes = {2};
  spec.run_id = test::unique_run_id("mlp-utf8");
  spec.env["TRUN_JOB_ID"] = "train-mlp-test";
  job.start(spec);
  auto results = job.wait(60s);
  INFO(job.describe(results));
  REQUIRE(results[0].exited);
  REQUIRE(results[0].exit_code != 0);
  CHECK_THAT(results[0].output, Catch::Contains("none is readable"));
  CHECK_THAT(results[0].output, !Catch::Contains("type_error"));
  int left = 0;
  for (const auto& e : fs::directory_iterator(d.path + "/ck")) {
    left += e.path().filename().string().rfind("step_", 0) == 0 ? 1 : 0;
  }
  CHECK(left == damaged);  // nothing removed, nothing renamed without --fresh-start
}
