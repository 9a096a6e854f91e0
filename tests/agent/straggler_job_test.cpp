// Slow ranks, black-box (docs/health.md): a 4-rank train_mlp job on one node in which the test
// slows rank 2 with a SIGSTOP/SIGCONT duty cycle (stopped 30 % of each second). trun must name
// rank 2, and no other, on the console and in the event log, within 60 s of the slowdown.
#include <dirent.h>
#include <signal.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"

using namespace trun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

std::string train_mlp() { return std::string(TRUN_BINARY_DIR) + "/examples/train_mlp"; }

// The pid of the child of `parent` whose environment has LOCAL_RANK=<local_rank>; 0 when none.
pid_t worker_pid(pid_t parent, int local_rank) {
  DIR* d = opendir("/proc");
  if (!d) return 0;
  pid_t found = 0;
  for (dirent* e = readdir(d); e && !found; e = readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atol(e->d_name));
    if (pid <= 0) continue;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    char state = 0;
    if (std::sscanf(line.c_str() + close + 2, "%c %d", &state, &ppid) != 2 || ppid != parent) {
      continue;
    }
    std::ifstream env("/proc/" + std::to_string(pid) + "/environ");
    std::string var;
    while (std::getline(env, var, '\0')) {
      if (var == "LOCAL_RANK=" + std::to_string(local_rank)) found = pid;
    }
  }
  closedir(d);
  return found;
}

// Stops `pid` for 30 % of each second while `stop` is false and `pid` is still a child of
// `parent` (at most two minutes); leaves it running.
void duty_cycle(pid_t pid, pid_t parent, const std::atomic<bool>& stop) {
  for (int i = 0; i < 120 && !stop.load() && worker_pid(parent, 0) == pid; ++i) {
    kill(pid, SIGSTOP);
    std::this_thread::sleep_for(300ms);
    kill(pid, SIGCONT);
    std::this_thread::sleep_for(700ms);
  }
  if (worker_pid(parent, 0) == pid) kill(pid, SIGCONT);
}

}  // namespace

TEST_CASE("a rank slowed by a 30% SIGSTOP duty cycle is named within 60 s, and no other",
          "[agent][health][straggler]") {
  TempDir d;
  Child trun({trun_binary(), "--standalone", "--nproc-per-node=4", "--straggler-window=5",
              "--event-log", d / "events.jsonl", train_mlp(), "--no-ckpt", "--dataset-size",
              "1000000", "--epochs", "1000", "--step-sleep-ms", "20"},
             {{"OMP_NUM_THREADS", "1"}});
  pid_t victim = 0;
  REQUIRE(wait_until([&] { return (victim = worker_pid(trun.pid(), 2)) > 0; }, 30s));
  std::this_thread::sleep_for(3s);  // training under way
  std::atomic<bool> stop{false};
  std::thread duty([&] {
    for (int i = 0; i < 120 && !stop.load(); ++i) {  // at most 2 minutes
      kill(victim, SIGSTOP);
      std::this_thread::sleep_for(300ms);
      kill(victim, SIGCONT);
      std::this_thread::sleep_for(700ms);
    }
    kill(victim, SIGCONT);
  });
  const auto slowed_at = std::chrono::steady_clock::now();
  const bool flagged =
      wait_until([&] { return trun.err().find("trun: slow rank: ") != std::string::npos; }, 90s);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - slowed_at).count();
  stop = true;
  duty.join();
  trun.signal(SIGTERM);
  REQUIRE(trun.wait(60s));
  const std::string err = trun.err();
  INFO(err);
  REQUIRE(flagged);
  CHECK(took < 60);
  CHECK(err.find("trun: slow rank: rank 2 (local_rank 2) on ") != std::string::npos);
  int flags = 0;
  for (const auto& line : lines_of(read_file(d / "events.jsonl"))) {
    const json j = json::parse(line, nullptr, false);
    if (!j.is_object() || j.value("name", "") != "trun.agent.straggler") continue;
    ++flags;
    CHECK(j["metadata"]["rank"] == 2);
    CHECK(j["metadata"]["slower"].get<double>() > 0.2);
    CHECK(j["metadata"]["ranks_scored"] == 4);
  }
  CHECK(flags == 1);
  CHECK(trun.exit_code() == 143);
}

TEST_CASE(
    "with --straggler-action=exclude the slow rank's node leaves the round for a waiting spare, "
    "without spending a restart",
    "[agent][health][straggler][exclusion]") {
  TempDir d;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "slowexclude-" + std::to_string(::getpid());
  auto agent = [&](const std::string& name, bool host) {
    return std::make_unique<Child>(
        std::vector<std::string>{trun_binary(),
                                 "--nnodes=2:2",
                                 "--nproc-per-node=1",
                                 "--max-restarts=0",
                                 "--rdzv-backend=c10d",
                                 "--rdzv-endpoint=" + ep,
                                 "--rdzv-id=" + run,
                                 "--straggler-window=5",
                                 "--straggler-action=exclude",
                                 "--exclude-cooldown=60",
                                 "--event-log",
                                 d / (name + ".jsonl"),
                                 std::string("--rdzv-conf=last_call_timeout=1,join_timeout=60") +
                                     (host ? ",is_host=1" : ",is_host=0"),
                                 train_mlp(),
                                 "--no-ckpt",
                                 "--dataset-size",
                                 "1000000",
                                 "--epochs",
                                 "1000",
                                 "--step-sleep-ms",
                                 "20"},
        std::map<std::string, std::string>{{"OMP_NUM_THREADS", "1"}});
  };
  auto a = agent("a", true);
  std::this_thread::sleep_for(500ms);  // the store host first
  auto b = agent("b", false);
  pid_t victim = 0, kept = 0;
  REQUIRE(wait_until([&] { return (victim = worker_pid(b->pid(), 0)) > 0; }, 60s));
  REQUIRE(wait_until([&] { return (kept = worker_pid(a->pid(), 0)) > 0; }, 60s));
  auto spare = agent("spare", false);  // the round is full (MAX 2): it waits
  std::this_thread::sleep_for(3s);     // training under way
  std::atomic<bool> stop{false};
  std::thread duty([&] { duty_cycle(victim, b->pid(), stop); });
  const bool excluded = wait_until(
      [&] { return b->err().find("is excluded for 60 s (exclusion 1)") != std::string::npos; },
      90s);
  stop = true;
  duty.join();
  // The spare takes B's place: its worker trains with A's.
  const bool replaced =
      excluded && wait_until([&] { return worker_pid(spare->pid(), 0) > 0; }, 60s);
  const pid_t a_worker_after = worker_pid(a->pid(), 0);
  RunResult st = run_trun_until(
      {"status", "--rdzv-backend=c10d", "--rdzv-endpoint=" + ep, "--rdzv-id=" + run}, "excluded: ");
  for (auto* c : {a.get(), spare.get(), b.get()}) c->signal(SIGTERM);
  for (auto* c : {a.get(), spare.get(), b.get()}) REQUIRE(c->wait(60s));
  INFO("a:\n"
       << a->err() << "\nb:\n"
       << b->err() << "\nspare:\n"
       << spare->err() << "\nstatus:\n"
       << st.out << st.err);
  REQUIRE(excluded);
  CHECK(replaced);
  CHECK(b->err().find("slower than the others for 5 s; it sits out the next rounds") !=
        std::string::npos);
  // The others re-formed for a planned leave, around A's running worker (train_mlp's resilient
  // loop: B's stop agreement stopped only B's rank): no restart counted, none failed.
  CHECK(a->err().find("the workers keep running (resilient loops)") != std::string::npos);
  CHECK(a->err().find("running workers re-form in it at generation") != std::string::npos);
  CHECK(a_worker_after == kept);
  CHECK(a->err().find("no restarts are left") == std::string::npos);
  CHECK(st.out.find("excluded: ") != std::string::npos);
  CHECK(st.out.find("1 outside (unhealthy or excluded)") != std::string::npos);
  // The judging node (either member) named B's rank and blamed its node.
  const std::string judge_err = a->err() + b->err();
  CHECK(judge_err.find("trun: slow rank: ") != std::string::npos);
  CHECK(judge_err.find("blamed node ") != std::string::npos);
}
