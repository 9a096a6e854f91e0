// PyTorch's own FileTimerClient (torch.distributed.elastic.timer, /usr/bin/python3) under the
// trun binary with TORCHELASTIC_ENABLE_FILE_TIMER=1, as under torchrun: a worker whose timer
// expires is killed within 1 s of its expiration time, that fails the group, and the group
// restarts (counted against --max-restarts); a timer released in time kills nothing. Beyond
// torchrun: the expired worker's Python stacks are in the log (PYTHONFAULTHANDLER=1, SIGABRT
// before SIGKILL), unless PYTHONFAULTHANDLER is set empty.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "tests/launcher/process_util.h"
#include "tests/skip.h"
#include "tests/torchrun_tools.h"

using trun::testing::Child;
using trun::testing::kPython;
using trun::testing::pid_alive;
using trun::testing::read_file;
using trun::testing::TempDir;
using trun::testing::trun_binary;
using trun::testing::wait_until;

namespace {

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Each rank first writes its pid and TORCHELASTIC_TIMER_FILE to <dir>/a<attempt>.r<rank> (before
// it imports torch, which takes seconds). Attempt 0: rank 0 writes <dir>/stuck (its pid and the
// time just before it arms the timer), then arms a 1 s timer around a 60 s sleep
// (FileTimerClient's default signal is SIGKILL); rank 1 sleeps until the agent stops it.
// Attempt 1: both arm a timer around a short sleep, release it, and succeed.
constexpr const char* kScript = R"PY(
import json, os, sys, time

out = os.environ["TIMER_TEST_DIR"]
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
path = os.environ["TORCHELASTIC_TIMER_FILE"]

def note(name, **fields):
    with open("%s/.%s" % (out, name), "w") as f:
        json.dump(fields, f)
    os.rename("%s/.%s" % (out, name), "%s/%s" % (out, name))

note("a%d.r%d" % (attempt, rank), pid=os.getpid(), timer_file=path)
from torch.distributed.elastic.timer import FileTimerClient, configure, expires
configure(FileTimerClient(path))
if attempt == 0 and rank == 0:
    note("stuck", pid=os.getpid(), t0=time.time())
    with expires(after=1, scope="stuck"):
        time.sleep(60)
    sys.exit(3)
if attempt == 0:
    time.sleep(60)
    sys.exit(4)
with expires(after=30, scope="quick"):
    time.sleep(0.2)
time.sleep(1.5)
print("rank %d done" % rank, flush=True)
)PY";

std::string torch_timer_missing() {
  Child c({kPython, "-c", "from torch.distributed.elastic.timer import FileTimerClient"});
  if (!c.wait(std::chrono::seconds(120)) || c.exit_code() != 0) {
    return std::string(kPython) +
           " cannot import torch.distributed.elastic.timer's FileTimerClient: " + c.err();
  }
  return "";
}

struct Seen {
  pid_t pid = 0;
  std::string timer_file;
};

Seen read_seen(const std::string& path) {
  const auto j = nlohmann::json::parse(read_file(path));
  return Seen{j.at("pid").get<pid_t>(), j.at("timer_file").get<std::string>()};
}

struct Outcome {
  int exit_code = -1;
  std::string err;
  double late = -1;  // seconds from the stuck rank's expiration time to its death
  pid_t stuck_pid = 0;
  std::map<std::string, Seen> seen;  // by file: a0.r0, a0.r1, a1.r0, a1.r1 (those that exist)
};

// trun's command line for the job, two workers on this node.
std::vector<std::string> trun_job(int max_restarts) {
  return {trun_binary(), "--standalone", "--nproc-per-node=2",
          "--max-restarts=" + std::to_string(max_restarts), "--monitor-interval=0.1"};
}

// torchrun 1.13's for the same job. Its --standalone is c10d at localhost:29400, which collides
// with any other torchrun on the host: a free port instead. Underscore flags only (1.13); on
// Python 3.11 it crashes when redirects/tee are 0, and a map naming a rank that does not exist
// keeps its plain console behaviour (as tests/launcher/torch_compat_test.cpp runs it).
std::vector<std::string> torchrun_job(int max_restarts) {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(s);
  return {trun::testing::kTorchrun,
          "--rdzv_backend=c10d",
          "--rdzv_endpoint=localhost:" + std::to_string(ntohs(a.sin_port)),
          "--rdzv_id=timer-" + std::to_string(::getpid()),
          "--nproc_per_node=2",
          "--max_restarts=" + std::to_string(max_restarts),
          "--monitor_interval=0.1",
          "--redirects",
          "9:1",
          "--tee",
          "9:1"};
}

// Runs the script after `command` (a launcher and its options) with the watchdog on.
Outcome run_stuck_job(const std::vector<std::string>& command, const TempDir& dir,
                      const std::map<std::string, std::string>& extra_env) {
  const std::string script = dir / "stuck.py";
  std::ofstream(script) << kScript;
  std::vector<std::string> argv = command;
  argv.push_back(script);
  std::map<std::string, std::string> env = extra_env;
  env["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1";
  env["TIMER_TEST_DIR"] = dir.path();
  env["PYTHON_EXEC"] = kPython;
  // PET_MASTER_PORT=0 (process_util.h) is for trun's static runs; these need none.
  std::vector<std::string> unset{"TORCHELASTIC_ERROR_FILE", "LOGLEVEL", "OMP_NUM_THREADS",
                                 "PET_MASTER_PORT"};
  if (!env.count("TORCHELASTIC_TIMER_FILE")) unset.push_back("TORCHELASTIC_TIMER_FILE");
  Child job(argv, env, unset);
  Outcome o;
  const std::string stuck = dir / "stuck";
  if (wait_until([&] { return trun::testing::file_exists(stuck) || !job.running(); },
                 std::chrono::seconds(120)) &&
      trun::testing::file_exists(stuck)) {
    const auto j = nlohmann::json::parse(read_file(stuck));
    o.stuck_pid = j.at("pid").get<pid_t>();
    const double t0 = j.at("t0").get<double>();
    // Watched from before its expiration time (t0 + 1 s, at least) until it is gone.
    if (wait_until([&] { return !pid_alive(o.stuck_pid); }, std::chrono::seconds(30))) {
      o.late = unix_now() - (t0 + 1.0);
    }
  }
  if (!job.wait(std::chrono::seconds(180))) job.signal(SIGKILL);
  job.wait(std::chrono::seconds(10));
  o.exit_code = job.exit_code();
  o.err = job.err();
  for (const char* name : {"a0.r0", "a0.r1", "a1.r0", "a1.r1"}) {
    if (trun::testing::file_exists(dir / name)) o.seen[name] = read_seen(dir / name);
  }
  return o;
}

void check_restarted_after_kill(const Outcome& o) {
  INFO(o.err);
  CHECK(o.exit_code == 0);
  // Rank 1 of attempt 0 may have been stopped before it wrote (rank 0 fails first).
  REQUIRE(o.seen.count("a0.r0"));
  REQUIRE(o.seen.count("a1.r0"));
  REQUIRE(o.seen.count("a1.r1"));
  CHECK(o.seen.at("a0.r0").pid == o.stuck_pid);
  WARN("the stuck rank died " << o.late << " s after its expiration time");
  CHECK(o.late >= 0);
  CHECK(o.late < 1.0);
  const std::string fifo = o.seen.at("a0.r0").timer_file;
  for (const auto& [name, s] : o.seen) CHECK(s.timer_file == fifo);
  CHECK_THAT(o.err, Catch::Contains("watchdog timer 'stuck' of worker pid " +
                                    std::to_string(o.stuck_pid)));
  // Before the kill, its Python stacks: trun gave it PYTHONFAULTHANDLER=1 and sent SIGABRT first.
  CHECK_THAT(o.err, Catch::Contains("sending SIGABRT (its Python stacks follow on its stderr)"));
  // In one piece: trun writes its line before it sends the signal, so that the line does not
  // land between faulthandler's writes (it did, when it was written after: "Fatal Python error:
  // [trun warning ...] Aborted", "line 20 in [trun warning ...] <module>").
  CHECK_THAT(o.err, Catch::Contains("Fatal Python error: Aborted"));
  CHECK_THAT(o.err, Catch::Contains("stuck.py\", line 20 in <module>"));
  CHECK_FALSE(std::filesystem::exists(std::filesystem::symlink_status(fifo)));
}

}  // namespace

TEST_CASE("PyTorch's FileTimerClient under trun: the expired rank is killed and the group restarts",
          "[file_timer][torch]") {
  if (const std::string why = torch_timer_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  SECTION("at the path TORCHELASTIC_TIMER_FILE names") {
    TempDir dir;
    const std::string fifo = dir / "watchdog.fifo";
    const Outcome o = run_stuck_job(trun_job(1), dir, {{"TORCHELASTIC_TIMER_FILE", fifo}});
    check_restarted_after_kill(o);
    if (o.seen.count("a0.r0")) CHECK(o.seen.at("a0.r0").timer_file == fifo);
  }
  SECTION("at a generated path when TORCHELASTIC_TIMER_FILE is unset") {
    TempDir dir;
    const Outcome o = run_stuck_job(trun_job(1), dir, {});
    check_restarted_after_kill(o);
    if (o.seen.count("a0.r0")) {
      CHECK(std::regex_match(o.seen.at("a0.r0").timer_file,
                             std::regex("/.*/watchdog_timer_[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-"
                                        "[89ab][0-9a-f]{3}-[0-9a-f]{12}")));
    }
  }
}

TEST_CASE("PyTorch's FileTimerClient under trun: the kill counts against --max-restarts",
          "[file_timer][torch]") {
  if (const std::string why = torch_timer_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TempDir dir;
  const Outcome o = run_stuck_job(trun_job(0), dir, {});
  INFO(o.err);
  CHECK(o.exit_code == 1);
  CHECK(o.seen.count("a0.r0") == 1);
  CHECK(o.seen.count("a1.r0") == 0);  // no second attempt
  CHECK(o.late >= 0);
  CHECK(o.late < 1.0);
  // The summary names the killed rank and its signal: SIGABRT, the one that dumped its stacks.
  CHECK_THAT(o.err, Catch::Contains("Signal 6 (SIGABRT)"));
}

TEST_CASE(
    "PyTorch's FileTimerClient under trun with PYTHONFAULTHANDLER empty: SIGKILL alone, as "
    "under torchrun",
    "[file_timer][torch]") {
  if (const std::string why = torch_timer_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TempDir dir;
  const Outcome o = run_stuck_job(trun_job(0), dir, {{"PYTHONFAULTHANDLER", ""}});
  INFO(o.err);
  CHECK(o.exit_code == 1);
  CHECK(o.late >= 0);
  CHECK(o.late < 1.0);
  CHECK_THAT(o.err, Catch::Contains("sent SIGKILL"));
  CHECK_THAT(o.err, Catch::Contains("Signal 9 (SIGKILL)"));
  CHECK_THAT(o.err, !Catch::Contains("Fatal Python error"));
}

// The reference: the same job under /usr/bin/torchrun 1.13 (its FileTimerServer scans every
// 0.1 s), so that a change in PyTorch's protocol shows here first.
TEST_CASE("PyTorch's FileTimerClient under torchrun 1.13 behaves as under trun",
          "[file_timer][torch]") {
  if (const std::string why = trun::testing::torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  if (const std::string why = torch_timer_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TempDir dir;
  const std::string fifo = dir / "watchdog.fifo";
  const Outcome o = run_stuck_job(torchrun_job(1), dir, {{"TORCHELASTIC_TIMER_FILE", fifo}});
  INFO(o.err);
  CHECK(o.exit_code == 0);
  REQUIRE(o.seen.count("a0.r0"));
  REQUIRE(o.seen.count("a1.r0"));
  REQUIRE(o.seen.count("a1.r1"));
  WARN("under torchrun, the stuck rank died " << o.late << " s after its expiration time");
  CHECK(o.late >= 0);
  CHECK(o.late < 1.0);
  for (const auto& [name, s] : o.seen) CHECK(s.timer_file == fifo);
  CHECK_FALSE(std::filesystem::exists(std::filesystem::symlink_status(fifo)));
}
