// The resilient loop end to end (issue 38, docs/worker_sdk.md "Resilient loop"): train_mlp under
// the real trun, a worker SIGKILLed mid-training. trun replaces that worker alone, the others
// keep their processes, and the final parameters equal those of an uninterrupted run with the
// same seed, bit for bit; a sender lost during the state transfer falls back to the next holder,
// or to the checkpoint when no rank holds the state any more.

#include <catch2/catch.hpp>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "tests/launcher/process_util.h"

using namespace std::chrono_literals;
using trun::testing::Child;
using trun::testing::TempDir;
using trun::testing::wait_until;

namespace {

std::string train_mlp() { return std::string(TRUN_BINARY_DIR) + "/examples/train_mlp"; }

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// "hangbench start rank=R local_rank=L attempt=A pid=P": (attempt, local rank) -> pid.
std::map<std::pair<int, int>, int> starts(const std::string& out) {
  std::map<std::pair<int, int>, int> m;
  const std::regex re(R"(hangbench start rank=\d+ local_rank=(\d+) attempt=(\d+) pid=(\d+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    m[{std::stoi((*it)[2]), std::stoi((*it)[1])}] = std::stoi((*it)[3]);
  return m;
}

// Rank 0's "hangbench step=N rank=0 attempt=A" lines, in order: (attempt, step).
std::vector<std::pair<int, int>> steps(const std::string& out) {
  std::vector<std::pair<int, int>> v;
  const std::regex re(R"(hangbench step=(\d+) rank=0 attempt=(\d+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v.emplace_back(std::stoi((*it)[2]), std::stoi((*it)[1]));
  return v;
}

struct Job {
  std::unique_ptr<Child> child;
  std::string params;  // --final-params
};

// A 4- or 2-rank train_mlp job on one node with the loop, 10 ms steps, printing its steps.
Job start_job(const TempDir& d, const std::string& name, int nproc, int ckpt_every,
              const std::map<std::string, std::string>& env = {}, int max_restarts = 3) {
  Job j;
  j.params = d / (name + ".params");
  std::vector<std::string> argv = {trun::testing::trun_binary(),
                                   "--standalone",
                                   "--nproc-per-node=" + std::to_string(nproc),
                                   "--max-restarts=" + std::to_string(max_restarts),
                                   train_mlp(),
                                   "--epochs",
                                   "2",
                                   "--dataset-size",
                                   "1024",
                                   "--batch-size",
                                   "16",
                                   "--step-sleep-ms",
                                   "10",
                                   "--ckpt-every",
                                   std::to_string(ckpt_every),
                                   "--ckpt-dir",
                                   d / (name + "-ckpt"),
                                   "--final-params",
                                   j.params,
                                   "--print-steps"};
  j.child = std::make_unique<Child>(argv, env, std::vector<std::string>{"TRUN_JOB_ID"});
  return j;
}

// Waits for rank 0's step `step` at attempt 0 and SIGKILLs local rank `local_rank`'s worker.
// Returns its pid.
int kill_worker_at(Job& j, int step, int local_rank) {
  REQUIRE(wait_until(
      [&] {
        for (auto [a, s] : steps(j.child->out()))
          if (a == 0 && s >= step) return true;
        return false;
      },
      60s));
  const auto st = starts(j.child->out());
  REQUIRE(st.count({0, local_rank}));
  const int pid = st.at({0, local_rank});
  REQUIRE(::kill(pid, SIGKILL) == 0);
  return pid;
}

std::string reference_params(const TempDir& d, int nproc) {
  Job ref = start_job(d, "reference-" + std::to_string(nproc), nproc, 1000);
  REQUIRE(ref.child->wait(120s));
  INFO(ref.child->out() << ref.child->err());
  REQUIRE(ref.child->exit_code() == 0);
  return file_bytes(ref.params);
}

}  // namespace

TEST_CASE(
    "train_mlp with the resilient loop: a killed worker is replaced alone, the others keep "
    "training, and the final parameters equal an uninterrupted run's bit for bit",
    "[resilient][train_mlp]") {
  TempDir d;
  const std::string reference = reference_params(d, 4);
  REQUIRE(reference.size() > 0);

  // No checkpoint before the end (every 1000 steps): the state can only come from live peers.
  Job j = start_job(d, "killed", 4, 1000);
  const int killed = kill_worker_at(j, 20, 2);
  REQUIRE(j.child->wait(120s));
  const std::string out = j.child->out(), err = j.child->err();
  INFO(out << err);
  CHECK(j.child->exit_code() == 0);
  CHECK(file_bytes(j.params) == reference);

  // One new process, for local rank 2; the other three rebuilt their groups at generation 1 in
  // their own processes.
  const auto st = starts(out);
  for (int local = 0; local < 4; ++local) {
    REQUIRE(st.count({1, local}));
    if (local == 2)
      CHECK(st.at({1, local}) != killed);
    else
      CHECK(st.at({1, local}) == st.at({0, local}));
  }
  CHECK_FALSE(st.count({2, 0}));  // one recovery, no classic restart after it
  CHECK(err.find("re-formed at generation 1") != std::string::npos);
  CHECK(err.find("restarting the worker group") == std::string::npos);

  // Steps redone: rank 0's first step after the kill follows its last one before, at most one
  // step earlier (the step in flight).
  int last0 = -1, first1 = -1;
  for (auto [a, s] : steps(out)) {
    if (a == 0) last0 = s;
    if (a == 1 && first1 < 0) first1 = s;
  }
  REQUIRE(first1 > 0);
  CHECK(first1 >= last0);
  CHECK(first1 <= last0 + 1);
}

TEST_CASE(
    "resilient loop: when the sender dies during the transfer, the next holder sends the "
    "state, and the result is still bit for bit",
    "[resilient][train_mlp]") {
  TempDir d;
  const std::string reference = reference_params(d, 4);
  // Generation 1's sender (rank 0, the lowest holder) dies after the transfer's header; ranks 1
  // and 3 still hold the state of the same step, so generation 2 takes it from rank 1.
  Job j = start_job(d, "sender-lost", 4, 1000, {{"TRUN_TEST_DIE_SENDING_STATE", "1"}});
  kill_worker_at(j, 20, 2);
  REQUIRE(j.child->wait(120s));
  const std::string out = j.child->out(), err = j.child->err();
  INFO(out << err);
  CHECK(j.child->exit_code() == 0);
  CHECK(err.find("dying while it sends the state") != std::string::npos);
  CHECK(std::regex_search(err, std::regex(R"(re-formed at generation 2 .* from rank 1 )")));
  CHECK(file_bytes(j.params) == reference);
}

TEST_CASE(
    "resilient loop: a second failure while the groups re-form moves every rank to the next "
    "generation at once, still bit for bit",
    "[resilient][train_mlp]") {
  TempDir d;
  const std::string reference = reference_params(d, 4);
  // Local rank 2 is killed; as generation 1 forms, rank 1 dies too (after leaving its groups).
  // The others, building generation 1's groups, stop waiting when trun moves to generation 2
  // (instead of waiting for the group build's timeout), and every rank re-forms there.
  Job j = start_job(d, "second-failure", 4, 1000, {{"TRUN_TEST_DIE_REFORMING", "1:1"}});
  kill_worker_at(j, 20, 2);
  REQUIRE(j.child->wait(120s));
  const std::string out = j.child->out(), err = j.child->err();
  INFO(out << err);
  CHECK(j.child->exit_code() == 0);
  CHECK(err.find("dying as it re-forms") != std::string::npos);
  CHECK(err.find("the agent moved on to generation 2") != std::string::npos);
  CHECK(std::regex_search(err, std::regex(R"(rank 0/4: re-formed at generation 2 )")));
  CHECK(err.find("did not re-form") == std::string::npos);
  CHECK(err.find("restarting the worker group") == std::string::npos);
  CHECK(file_bytes(j.params) == reference);
}

TEST_CASE(
    "resilient loop: when no live rank holds the state any more, the group resumes from the "
    "checkpoint",
    "[resilient][train_mlp]") {
  TempDir d;
  const std::string reference = reference_params(d, 2);
  // Two ranks: rank 1 is killed; at generation 1 rank 0 sends and dies, and rank 1's replacement
  // received only part of it: nobody holds a state at generation 2, so the checkpoint (every 5
  // steps) is loaded.
  Job j = start_job(d, "all-lost", 2, 5, {{"TRUN_TEST_DIE_SENDING_STATE", "1"}});
  kill_worker_at(j, 12, 1);
  REQUIRE(j.child->wait(120s));
  const std::string out = j.child->out(), err = j.child->err();
  INFO(out << err);
  CHECK(j.child->exit_code() == 0);
  CHECK(err.find("no rank held a state: restored") != std::string::npos);
  CHECK(out.find("resumed from") != std::string::npos);
  CHECK(file_bytes(j.params) == reference);
}

TEST_CASE(
    "resilient loop: stopped while it waits to re-form (the restarts are spent), rank 0 saves "
    "the step it holds, and the next start resumes it bit for bit",
    "[resilient][train_mlp]") {
  TempDir d;
  const std::string reference = reference_params(d, 2);
  // No periodic checkpoint before the end; --max-restarts=0: trun stops the survivor, which
  // waits for a generation that will not come.
  Job j = start_job(d, "spent", 2, 1000, {}, 0);
  kill_worker_at(j, 12, 1);
  REQUIRE(j.child->wait(120s));
  {
    const std::string out = j.child->out(), err = j.child->err();
    INFO(out << err);
    CHECK(j.child->exit_code() != 0);
    std::smatch m;
    REQUIRE(std::regex_search(
        err, m,
        std::regex(
            R"(rank 0/2: stopped while the group re-formed: saved the state of step (\d+) )")));
    int last0 = -1;
    for (auto [a, step] : steps(out))
      if (a == 0) last0 = step;
    CHECK(std::stoi(m[1]) == last0);  // its last completed step
    CHECK(file_bytes(d / "spent-ckpt/latest") == "step_" + std::string(m[1]) + "\n");
  }
  Job again = start_job(d, "spent", 2, 1000);  // the same checkpoint directory
  REQUIRE(again.child->wait(120s));
  const std::string out = again.child->out(), err = again.child->err();
  INFO(out << err);
  CHECK(again.child->exit_code() == 0);
  CHECK(std::regex_search(out, std::regex(R"(resumed from \S*spent-ckpt/step_[1-9])")));
  CHECK(file_bytes(again.params) == reference);
}

TEST_CASE(
    "train_mlp --classic: a killed worker restarts the whole group, which resumes from the "
    "checkpoint",
    "[resilient][train_mlp]") {
  TempDir d;
  std::vector<std::string> argv = {trun::testing::trun_binary(),
                                   "--standalone",
                                   "--nproc-per-node=2",
                                   "--max-restarts=1",
                                   train_mlp(),
                                   "--classic",
                                   "--epochs",
                                   "1",
                                   "--dataset-size",
                                   "512",
                                   "--batch-size",
                                   "16",
                                   "--step-sleep-ms",
                                   "10",
                                   "--ckpt-every",
                                   "5",
                                   "--ckpt-dir",
                                   d / "ckpt",
                                   "--print-steps"};
  Job j{std::make_unique<Child>(argv, std::map<std::string, std::string>{},
                                std::vector<std::string>{"TRUN_JOB_ID"}),
        ""};
  const int killed = kill_worker_at(j, 8, 1);
  REQUIRE(j.child->wait(120s));
  const std::string out = j.child->out(), err = j.child->err();
  INFO(out << err);
  CHECK(j.child->exit_code() == 0);
  const auto st = starts(out);
  REQUIRE(st.count({1, 0}));
  REQUIRE(st.count({1, 1}));
  CHECK(st.at({1, 0}) != st.at({0, 0}));  // every worker is new
  CHECK(st.at({1, 1}) != killed);
  CHECK(err.find("restarting the worker group") != std::string::npos);
  CHECK(out.find("resumed from") != std::string::npos);
}
