// Hang detection in the trun binary (issue 36, docs/hangs.md), with real workers
// (progress_worker, linking libtrun_worker): a rank that stops itself with SIGSTOP or spins in
// user code is found by its agent with short timeouts (--hang-timeout-floor=1), named in one line
// (the log, the failure summary, the event log), dumped (its progress, its collectives, the
// native stacks of every thread of every local worker, under --log-dir), and the group restarts
// as after a failure. Also: the options, and the board's variable in the workers' environment.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"

using trun::testing::run_trun;
using trun::testing::TempDir;

namespace {

namespace fs = std::filesystem;

std::string worker() { return std::string(TRUN_BINARY_DIR) + "/tests/hang/progress_worker"; }

// Unlinks the progress boards an agent killed with SIGKILL left in /dev/shm.
void remove_boards_of(pid_t agent) {
  const std::string prefix = "trun-progress-" + std::to_string(agent) + "-";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(e.path(), ec);
  }
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// DIR/<run id>/attempt_<n>/<local rank>/hang_dump.txt: the one run under `log_dir`.
fs::path dump_path(const std::string& log_dir, int attempt, int local_rank) {
  for (const auto& run : fs::directory_iterator(log_dir)) {
    return run.path() / ("attempt_" + std::to_string(attempt)) / std::to_string(local_rank) /
           "hang_dump.txt";
  }
  return {};
}

// The trun.hang events of an event log.
std::vector<nlohmann::json> hang_events(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("name", "") == "trun.hang") out.push_back(j);
  }
  return out;
}

const std::vector<std::string> kShortTimeouts{"--hang-timeout-floor=1", "--hang-warmup=3"};

}  // namespace

TEST_CASE("a rank stopped with SIGSTOP is named, dumped, and the group restarts", "[hang]") {
  TempDir dir;
  const std::string logs = dir / "logs";
  const std::string events = dir / "events.jsonl";
  std::vector<std::string> args{
      "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--log-dir", logs, "--event-log",
      events};
  args.insert(args.end(), kShortTimeouts.begin(), kShortTimeouts.end());
  args.insert(args.end(), {worker(), "stop"});
  auto r = run_trun(args, {}, std::chrono::seconds(120));
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("attempt 1 done rank=0"));
  CHECK_THAT(r.out, Catch::Contains("attempt 1 done rank=1"));
  // Rank 1 stopped before its 21st allreduce, which rank 0 waits in.
  CHECK_THAT(r.err, Catch::Contains("hang detected: rank 1 (node "));
  CHECK_THAT(r.err, Catch::Contains("it never issued allreduce #61 of group 0, which rank 0 "
                                    "waits in; it is stopped (SIGSTOP or a debugger)"));

  const std::string culprit = slurp(dump_path(logs, 0, 1));
  CHECK_THAT(culprit, Catch::Contains("verdict: rank 1 (node "));
  CHECK_THAT(culprit, Catch::Contains("stopped (SIGSTOP or a debugger)"));
  CHECK_THAT(culprit, Catch::Contains("issued #60, finished #60"));
  CHECK_THAT(culprit, Catch::Contains("native stacks:"));
  CHECK_THAT(culprit, Catch::Contains("main"));
  const std::string waiter = slurp(dump_path(logs, 0, 0));
  CHECK_THAT(waiter, Catch::Contains("#61 allreduce float32 x 16: started"));
  CHECK_THAT(waiter, Catch::Contains("native stacks:"));
  CHECK_FALSE(fs::exists(dump_path(logs, 1, 0)));  // the second attempt ran clean

  const auto hangs = hang_events(events);
  REQUIRE(hangs.size() == 1);
  CHECK(hangs[0]["metadata"]["rank"] == 1);
  CHECK(hangs[0]["metadata"]["culprits"] == "1");
  CHECK(hangs[0]["metadata"]["seq"] == 61);
}

TEST_CASE("a rank spinning in user code is hung outside any collective, and the summary names it",
          "[hang]") {
  TempDir dir;
  const std::string logs = dir / "logs";
  std::vector<std::string> args{"--standalone", "--nproc-per-node=2", "--max-restarts=0",
                                "--log-dir", logs};
  args.insert(args.end(), kShortTimeouts.begin(), kShortTimeouts.end());
  args.insert(args.end(), {worker(), "spin"});
  auto r = run_trun(args, {}, std::chrono::seconds(120));
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 1);
  // The failure summary: the verdict as rank 1's error, then its stack.
  CHECK_THAT(r.err, Catch::Contains("it never issued allreduce #61 of group 0, which rank 0 "
                                    "waits in"));
  CHECK_THAT(r.err, Catch::Contains("progress_worker_spin_forever"));
  CHECK_THAT(r.err, Catch::Contains("rank      : 1"));
  CHECK_THAT(slurp(dump_path(logs, 0, 1)), Catch::Contains("progress_worker_spin_forever"));
}

TEST_CASE("a slow start and a slow first step are no hang", "[hang]") {
  // A floor of 1 s: the 3 s before the first collective count as start-up (30 min) and the 2 s
  // step as warm-up (30 min), so neither is judged against the learned timeout.
  std::vector<std::string> args{"--standalone", "--nproc-per-node=2", "--max-restarts=0"};
  args.insert(args.end(), kShortTimeouts.begin(), kShortTimeouts.end());
  args.insert(args.end(), {worker(), "slow"});
  auto r = run_trun(args, {}, std::chrono::seconds(120));
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, !Catch::Contains("hang detected"));
  CHECK_THAT(r.out, Catch::Contains("attempt 0 done rank=1"));
}

TEST_CASE("two nodes agree on their learned timeouts through the store before the next group",
          "[hang][agree]") {
  // Rank 1 alone spends its steps in Section("eval"), so only its node learns that section's
  // intervals; it then fails, and before the restarted group the other node adopts them: its
  // "eval" timeout leaves the 30-minute warm-up for the 10 s floor.
  const std::string endpoint = "127.0.0.1:" + std::to_string(trun::testing::free_port());
  auto node = [&](const std::string& is_host) {
    return std::vector<std::string>{trun::testing::trun_binary(),
                                    "--nnodes=2",
                                    "--nproc-per-node=1",
                                    "--max-restarts=1",
                                    "--rdzv-backend=c10d",
                                    "--rdzv-id=hang-agree",
                                    "--rdzv-endpoint=" + endpoint,
                                    "--rdzv-conf",
                                    "join_timeout=60,is_host=" + is_host,
                                    worker(),
                                    "agree"};
  };
  // At LOGLEVEL=INFO: the agreement is an info line.
  trun::testing::Child host(node("true"), {{"LOGLEVEL", "INFO"}}, {"TORCHELASTIC_ERROR_FILE"});
  trun::testing::Child other(node("false"), {{"LOGLEVEL", "INFO"}}, {"TORCHELASTIC_ERROR_FILE"});
  REQUIRE(host.wait(std::chrono::seconds(120)));
  REQUIRE(other.wait(std::chrono::seconds(60)));
  const std::string err = host.err() + other.err();
  const std::string out = host.out() + other.out();
  INFO(err);
  CHECK(host.exit_code() == 0);
  CHECK(other.exit_code() == 0);
  CHECK_THAT(out, Catch::Contains("rank 1 fails on purpose"));
  CHECK_THAT(out, Catch::Contains("attempt 1 done rank=0"));
  CHECK_THAT(out, Catch::Contains("attempt 1 done rank=1"));
  CHECK_THAT(err, Catch::Contains("hang detection: timeout agreed with the other nodes: section "
                                  "eval 10.0 s (was 1800.0 s)"));
}

TEST_CASE(
    "a group whose ranks wait on a frozen node is killed once it makes no progress, not "
    "after --shutdown-timeout",
    "[hang][stop]") {
  // Two nodes of one rank; the test freezes node b (its agent and its worker, as a partition
  // would: no connection closes). Node a's worker waits for b's in an allreduce and ignores
  // SIGTERM (the first process only: PROGRESS_WORKER_IGNORE_TERM names a marker file). With
  // --shutdown-timeout 300, a's group could only stop that soon through the stall watch.
  TempDir d;
  const std::string endpoint = "127.0.0.1:" + std::to_string(trun::testing::free_port());
  auto node = [&](const std::string& is_host) {
    return std::vector<std::string>{
        trun::testing::trun_binary(),
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--shutdown-timeout=300",
        "--rdzv-backend=c10d",
        "--rdzv-id=hang-stall",
        "--rdzv-endpoint=" + endpoint,
        "--rdzv-conf",
        "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3,"
        "is_host=" +
            is_host,
        worker()};
  };
  trun::testing::Child a(node("1"), {{"PROGRESS_WORKER_IGNORE_TERM", d / "ignored"}},
                         {"TORCHELASTIC_ERROR_FILE"});
  REQUIRE(trun::testing::wait_until([&] { return a.out().find("ready") != std::string::npos; },
                                    std::chrono::seconds(30)));
  trun::testing::Child b(node("0"), {}, {"TORCHELASTIC_ERROR_FILE"});
  REQUIRE(trun::testing::wait_until(
      [&] { return b.out().find("ready rank=1") != std::string::npos; }, std::chrono::seconds(60)));
  std::this_thread::sleep_for(std::chrono::seconds(2));  // allreduces under way
  std::vector<pid_t> frozen{b.pid()};
  for (pid_t p : trun::testing::children_of(b.pid())) frozen.push_back(p);
  for (pid_t p : frozen) kill(p, SIGSTOP);
  const bool stalled = trun::testing::wait_until(
      [&] { return a.err().find("the workers made no progress in ") != std::string::npos; },
      std::chrono::seconds(60));
  // b's agent dies frozen (its worker follows through its parent-death signal), then a stops.
  kill(b.pid(), SIGKILL);
  for (pid_t p : frozen) kill(p, SIGCONT);
  REQUIRE(b.wait(std::chrono::seconds(30)));
  a.signal(SIGTERM);
  REQUIRE(a.wait(std::chrono::seconds(60)));
  remove_boards_of(b.pid());  // the progress board b's agent could not unlink
  INFO(a.err());
  CHECK(stalled);
  CHECK_THAT(a.err(), !Catch::Contains("workers still running"));
}

TEST_CASE("the workers get the progress board's name unless --hang-detection=off", "[hang]") {
  const std::vector<std::string> show{"/bin/sh", "-c", "echo \"board=${TRUN_PROGRESS_SHM-unset}\""};
  std::vector<std::string> on{"--standalone", "--nproc-per-node=1"};
  on.insert(on.end(), show.begin(), show.end());
  auto r = run_trun(on, {{"TRUN_PROGRESS_SHM", "/outer-board"}});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("board=/trun-progress-"));

  std::vector<std::string> off{"--standalone", "--nproc-per-node=1", "--hang-detection=off"};
  off.insert(off.end(), show.begin(), show.end());
  r = run_trun(off, {{"TRUN_PROGRESS_SHM", "/outer-board"}});
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("board=unset"));
}

TEST_CASE("the --hang-* options are read, shown by --dry-run, and bad values refused", "[hang]") {
  auto r = run_trun({"--dry-run", "--hang-timeout=30", "--hang-timeout-floor=2",
                     "--hang-checkpoint-timeout=off", "--hang-section-timeout=eval=600,load=off",
                     "/bin/true"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out)["hang_detection"];
  CHECK(j["enabled"] == true);
  CHECK(j["step"]["fixed_s"] == 30.0);
  CHECK(j["step"]["floor_s"] == 2.0);
  CHECK(j["checkpoint"]["enabled"] == false);
  CHECK(j["sections"]["eval"]["fixed_s"] == 600.0);
  CHECK(j["sections"]["load"]["enabled"] == false);
  CHECK(j["startup"]["fixed_s"] == 1800.0);

  const std::vector<std::pair<std::string, std::string>> bad{
      {"--hang-detection=maybe", "--hang-detection=maybe: expected on or off"},
      {"--hang-timeout=-1", "--hang-timeout=-1: expected auto, off or a positive number"},
      {"--hang-timeout-factor=0", "--hang-timeout-factor=0: expected a positive number"},
      {"--hang-warmup=x", "--hang-warmup=x"},
      {"--hang-section-timeout=eval", "'eval': expected NAME=SECONDS or NAME=off"},
  };
  for (const auto& [arg, message] : bad) {
    auto b = run_trun({"--standalone", arg, "/bin/true"});
    INFO(arg << ": " << b.err);
    CHECK(b.exit_code == 2);
    CHECK_THAT(b.err, Catch::Contains(message));
  }
}

TEST_CASE(
    "a node whose rank a hang verdict blames is excluded at once, and a spare takes its place",
    "[hang][exclusion]") {
  // B's local rank 1 stops itself (SIGSTOP) in the first attempt while its local rank 0 waits
  // for it; B finds it within seconds (a 1 s floor) while A and the spare would wait 60 s, so the
  // verdict is B's, naming its own rank.
  const std::string endpoint = "127.0.0.1:" + std::to_string(trun::testing::free_port());
  const std::string run = "hang-exclude-" + std::to_string(::getpid());
  auto node = [&](bool host, const char* floor) {
    return std::vector<std::string>{
        trun::testing::trun_binary(),
        "--nnodes=2:2",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        "--rdzv-id=" + run,
        "--rdzv-endpoint=" + endpoint,
        "--rdzv-conf",
        std::string("last_call_timeout=1,join_timeout=60,is_host=") + (host ? "1" : "0"),
        std::string("--hang-timeout-floor=") + floor,
        "--hang-warmup=3",
        "--exclude-cooldown=60",
        worker(),
        "stop-here"};
  };
  trun::testing::Child a(node(true, "60"), {}, {"TORCHELASTIC_ERROR_FILE"});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the store host first
  trun::testing::Child b(node(false, "1"), {{"PROGRESS_WORKER_STOP_HERE", "1"}},
                         {"TORCHELASTIC_ERROR_FILE"});
  REQUIRE(trun::testing::wait_until(
      [&] { return b.out().find("ready rank=") != std::string::npos; }, std::chrono::seconds(60)));
  trun::testing::Child spare(node(false, "60"), {}, {"TORCHELASTIC_ERROR_FILE"});
  REQUIRE(a.wait(std::chrono::seconds(120)));
  REQUIRE(spare.wait(std::chrono::seconds(60)));
  const std::string berr = b.err();
  b.signal(SIGTERM);  // it sits out its exclusion
  REQUIRE(b.wait(std::chrono::seconds(30)));
  INFO("a:\n" << a.err() << "\nb:\n" << berr << "\nspare:\n" << spare.err());
  CHECK(a.exit_code() == 0);
  CHECK(spare.exit_code() == 0);
  CHECK_THAT(berr, Catch::Contains("hang detected: rank "));
  CHECK_THAT(berr, Catch::Contains("is excluded for 60 s (exclusion 1): a hang verdict blamed its "
                                   "rank "));
  CHECK_THAT(a.out(), Catch::Contains("attempt 1 done rank="));
  CHECK_THAT(spare.out(), Catch::Contains("attempt 0 done rank="));
}
