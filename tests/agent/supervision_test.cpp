// The agent, black-box through the trun binary and real worker processes (tests/bin): worker
// environment, exit codes and signals, restarts, failure reports, signal forwarding, SIGKILL of
// the agent, the agent as PID 1.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <catch2/catch.hpp>

#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/launcher/process_util.h"
#include "tests/sanitizer.h"
#include "tests/skip.h"

using namespace trun::testing;
using nlohmann::json;

namespace {

std::vector<std::string> job(int nproc, std::vector<std::string> extra,
                             std::vector<std::string> actions) {
  std::vector<std::string> args{"--standalone", "--nproc-per-node", std::to_string(nproc)};
  args.insert(args.end(), extra.begin(), extra.end());
  args.push_back(test_worker());
  args.insert(args.end(), actions.begin(), actions.end());
  return args;
}

json env_of(const TempDir& d, int attempt, int local_rank) {
  return json::parse(read_file(
      d / ("env_" + std::to_string(attempt) + "_" + std::to_string(local_rank) + ".json")));
}

}  // namespace

TEST_CASE("workers get torchrun's environment", "[agent][env]") {
  TempDir d;
  auto r = run_trun(job(3, {"--max-restarts", "2", "--role", "trainer"}, {"env", d.path()}),
                    {{"MY_OWN_VAR", "kept"}, {"TRUN_LOCAL_RANK", "7"}});
  REQUIRE(r.exit_code == 0);
  std::string run_id, port;
  for (int lr = 0; lr < 3; ++lr) {
    json e = env_of(d, 0, lr);
    CHECK(e["LOCAL_RANK"] == std::to_string(lr));
    CHECK(e["RANK"] == std::to_string(lr));
    CHECK(e["GROUP_RANK"] == "0");
    CHECK(e["ROLE_RANK"] == std::to_string(lr));
    CHECK(e["ROLE_NAME"] == "trainer");
    CHECK(e["LOCAL_WORLD_SIZE"] == "3");
    CHECK(e["WORLD_SIZE"] == "3");
    CHECK(e["GROUP_WORLD_SIZE"] == "1");
    CHECK(e["ROLE_WORLD_SIZE"] == "3");
    CHECK(e["MASTER_ADDR"] == "127.0.0.1");
    CHECK(e["TORCHELASTIC_RESTART_COUNT"] == "0");
    CHECK(e["TORCHELASTIC_MAX_RESTARTS"] == "2");
    CHECK(e["TORCHELASTIC_USE_AGENT_STORE"] == "True");
    CHECK(e["NCCL_ASYNC_ERROR_HANDLING"] == "1");
    CHECK(e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1");
    CHECK(e["OMP_NUM_THREADS"] == "1");
    CHECK(e["MY_OWN_VAR"] == "kept");
    CHECK(e["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
    CHECK_FALSE(e.contains("TRUN_LOCAL_RANK"));  // only with --virtual-local-rank, never inherited
    std::string ef = e["TORCHELASTIC_ERROR_FILE"];
    CHECK(ef.find("/attempt_0/" + std::to_string(lr) + "/error.json") != std::string::npos);
    if (lr == 0) {
      run_id = e["TORCHELASTIC_RUN_ID"];
      port = e["MASTER_PORT"];
    }
    CHECK(e["TORCHELASTIC_RUN_ID"] == run_id);
    CHECK(e["MASTER_PORT"] == port);
  }
  CHECK(run_id.size() == 36);  // a generated UUID
  CHECK(std::stoi(port) > 0);
  CHECK(r.err.find("OMP_NUM_THREADS=1") != std::string::npos);
}

TEST_CASE("with --virtual-local-rank each worker sees one device as its device 0", "[agent][env]") {
  TempDir d;
  auto r = run_trun(job(3, {"--virtual-local-rank"}, {"env", d.path()}),
                    {{"CUDA_VISIBLE_DEVICES", "4, 6,1"}});
  REQUIRE(r.exit_code == 0);
  const char* const kDevice[] = {"4", "6", "1"};  // the local rank's entry, trimmed
  for (int lr = 0; lr < 3; ++lr) {
    json e = env_of(d, 0, lr);
    CHECK(e["LOCAL_RANK"] == "0");
    CHECK(e["TRUN_LOCAL_RANK"] == std::to_string(lr));
    CHECK(e["RANK"] == std::to_string(lr));
    CHECK(e["LOCAL_WORLD_SIZE"] == "3");
    CHECK(e["CUDA_VISIBLE_DEVICES"] == kDevice[lr]);
  }
  // Without CUDA_VISIBLE_DEVICES the device is the local rank itself.
  TempDir d2;
  auto r2 = run_trun(job(2, {"--virtual-local-rank"}, {"env", d2.path()}), {},
                     std::chrono::seconds(60), {"CUDA_VISIBLE_DEVICES"});
  REQUIRE(r2.exit_code == 0);
  CHECK(env_of(d2, 0, 1)["CUDA_VISIBLE_DEVICES"] == "1");
  CHECK(env_of(d2, 0, 1)["LOCAL_RANK"] == "0");
}

TEST_CASE("a user's OMP_NUM_THREADS and NCCL settings are kept", "[agent][env]") {
  TempDir d;
  auto r = run_trun(job(2, {}, {"env", d.path()}),
                    {{"OMP_NUM_THREADS", "7"}, {"NCCL_ASYNC_ERROR_HANDLING", "0"}});
  REQUIRE(r.exit_code == 0);
  json e = env_of(d, 0, 1);
  CHECK(e["OMP_NUM_THREADS"] == "7");
  CHECK(e["NCCL_ASYNC_ERROR_HANDLING"] == "0");
  CHECK(r.err.find("OMP_NUM_THREADS") == std::string::npos);
}

TEST_CASE("workers reach the agent's own store at MASTER_ADDR:MASTER_PORT", "[agent][store]") {
  auto r = run_trun(job(4, {}, {"store-check"}));
  INFO(r.err);
  CHECK(r.exit_code == 0);
}

TEST_CASE("two standalone jobs run at the same time without a port clash", "[agent][store]") {
  Child a({trun_binary(), "--standalone", "--nproc-per-node", "2", test_worker(), "store-check",
           "sleep", "0.3"});
  Child b({trun_binary(), "--standalone", "--nproc-per-node", "2", test_worker(), "store-check",
           "sleep", "0.3"});
  REQUIRE(a.wait());
  REQUIRE(b.wait());
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
}

TEST_CASE("static backend: two agents on one host form one job", "[agent][static]") {
  TempDir d;
  // A port that was free a moment ago; node 0 binds it.
  int port = 0;
  {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    socklen_t len = sizeof addr;
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
    close(fd);
  }
  auto node = [&](int rank) {
    return std::vector<std::string>{trun_binary(),
                                    "--nnodes=2",
                                    "--node-rank=" + std::to_string(rank),
                                    "--nproc-per-node=2",
                                    "--master-port=" + std::to_string(port),
                                    "--rdzv-id=job7",
                                    test_worker(),
                                    "env",
                                    d.path() + "/n" + std::to_string(rank),
                                    "store-check"};
  };
  std::filesystem::create_directories(d / "n0");
  std::filesystem::create_directories(d / "n1");
  Child n0(node(0));
  Child n1(node(1));
  REQUIRE(n0.wait());
  REQUIRE(n1.wait());
  INFO(n0.err() << n1.err());
  CHECK(n0.exit_code() == 0);
  CHECK(n1.exit_code() == 0);
  for (int n = 0; n < 2; ++n) {
    for (int lr = 0; lr < 2; ++lr) {
      json e = json::parse(read_file(d.path() + "/n" + std::to_string(n) + "/env_0_" +
                                     std::to_string(lr) + ".json"));
      CHECK(e["RANK"] == std::to_string(2 * n + lr));
      CHECK(e["GROUP_RANK"] == std::to_string(n));
      CHECK(e["WORLD_SIZE"] == "4");
      CHECK(e["GROUP_WORLD_SIZE"] == "2");
      CHECK(e["ROLE_WORLD_SIZE"] == "4");
      CHECK(e["ROLE_RANK"] == std::to_string(2 * n + lr));
      CHECK(e["MASTER_PORT"] == std::to_string(port));
      CHECK(e["TORCHELASTIC_RUN_ID"] == "job7");
    }
  }
}

TEST_CASE("exit codes 0..255 map to the job result and the summary", "[agent][exit]") {
  // Every code is one path (0 succeeds, any other is a failure that names its code), so a sample
  // covers it: the edges, 126..143 (the shell's and 128 + signal number, which trun must report
  // as plain codes, not as signals) and every 5th code (every 10th under ASan+UBSan, 15th under
  // ThreadSanitizer). All 256 took 165 s of the ASan+UBSan step on a slow CI machine, at 0.4-0.6 s
  // per sanitized trun run; every 5th still took 55 s of it.
  std::vector<int> codes;
  const int stride = kThreadSanitizer ? 15 : trun::testing::kSanitizer ? 10 : 5;
  for (int code = 0; code <= 255; ++code)
    if (code % stride == 0 || code <= 3 || (code >= 126 && code <= 143) || code >= 253)
      codes.push_back(code);
  for (int code : codes) {
    auto r = run_trun({"--nproc-per-node=1", test_worker(), "exit", std::to_string(code)});
    INFO("code " << code << "\n" << r.err);
    REQUIRE(r.finished);
    if (code == 0) {
      CHECK(r.exit_code == 0);
      CHECK(r.err.find("FAILED") == std::string::npos);
    } else {
      CHECK(r.exit_code == 1);
      CHECK(r.err.find("/tests/bin/trun_test_worker FAILED") != std::string::npos);
      CHECK(r.err.find("  exitcode  : " + std::to_string(code) + " (pid: ") != std::string::npos);
      CHECK(r.err.find("Root Cause (first observed failure):") != std::string::npos);
    }
  }
}

TEST_CASE("workers killed by signals are reported by signal name", "[agent][exit]") {
  const std::pair<int, const char*> cases[] = {
      {SIGSEGV, "SIGSEGV"}, {SIGKILL, "SIGKILL"}, {SIGABRT, "SIGABRT"}, {SIGTERM, "SIGTERM"},
      {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},   {SIGINT, "SIGINT"},   {SIGUSR1, "SIGUSR1"}};
  for (const auto& [sig, name] : cases) {
    auto r = run_trun(job(2, {}, {"on-rank", "1", "signal", std::to_string(sig), "sleep", "30"}));
    INFO(name << "\n" << r.err);
    REQUIRE(r.finished);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("exitcode  : -" + std::to_string(sig) + " (" + name + ")") !=
          std::string::npos);
    CHECK(r.err.find("Signal " + std::to_string(sig) + " (" + name + ") received by PID") !=
          std::string::npos);
    CHECK(r.err.find("rank      : 1 (local_rank: 1)") != std::string::npos);
  }
}

TEST_CASE("a failure stops the other workers at once", "[agent][restart]") {
  TempDir d;
  auto start = std::chrono::steady_clock::now();
  auto r = run_trun(job(3, {}, {"pidfile", d.path(), "on-rank", "2", "exit", "5", "sleep", "60"}));
  auto took = std::chrono::steady_clock::now() - start;
  CHECK(r.exit_code == 1);
  CHECK(took < std::chrono::seconds(20));  // generous: only to tell "stopped" from "waited 60 s"
  for (int lr = 0; lr < 3; ++lr)
    CHECK_FALSE(pid_alive(read_pid(d / ("pid_0_" + std::to_string(lr)))));
  // Workers the agent stopped are not failures: only rank 2 is listed.
  CHECK(r.err.find("<NO_OTHER_FAILURES>") != std::string::npos);
}

TEST_CASE("restarts up to --max-restarts, then fails with the root cause", "[agent][restart]") {
  TempDir d;
  const std::string own_error = d / "trun_error.json";
  auto r =
      run_trun(job(2, {"--max-restarts", "2"},
                   {"pidfile", d.path(), "on-rank", "1", "error-file", "ValueError: rank one broke",
                    "now", "on-rank", "1", "exit", "3", "sleep", "60"}),
               {{"TORCHELASTIC_ERROR_FILE", own_error}});
  INFO(r.err);
  CHECK(r.exit_code == 1);
  // Rank 1 writes its pid file before failing in each attempt (rank 0 may be stopped first).
  for (int attempt = 0; attempt < 3; ++attempt) {
    CHECK(file_exists(d / ("pid_" + std::to_string(attempt) + "_1")));
  }
  CHECK_FALSE(file_exists(d / "pid_3_1"));
  CHECK(r.err.find("restarting the worker group (1/2 restarts)") != std::string::npos);
  CHECK(r.err.find("restarting the worker group (2/2 restarts)") != std::string::npos);
  CHECK(r.err.find("ValueError: rank one broke") != std::string::npos);
  CHECK(r.err.find("Traceback (most recent call last):") != std::string::npos);
  CHECK(r.err.find("/attempt_2/1/error.json") != std::string::npos);
  // trun's own error file gets the root cause, with the exit code.
  json own = json::parse(read_file(own_error));
  CHECK(own["message"]["message"] == "ValueError: rank one broke");
  CHECK(own["message"]["errorCode"] == 3);
}

TEST_CASE("a restart that succeeds ends the job with 0", "[agent][restart]") {
  TempDir d;
  auto r = run_trun(
      job(2, {"--max-restarts", "3"},
          {"env", d.path(), "on-attempt", "0", "exit", "1", "on-attempt", "1", "exit", "9"}));
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(env_of(d, 2, 0)["TORCHELASTIC_RESTART_COUNT"] == "2");
  CHECK(env_of(d, 2, 1)["TORCHELASTIC_RESTART_COUNT"] == "2");
  CHECK_FALSE(file_exists(d / "env_3_0.json"));
}

TEST_CASE("the root cause is the earliest error file", "[agent][failure]") {
  // Rank 1 fails first, but its error file claims a later time than the one rank 0 writes as it
  // fails while being stopped; the summary's root cause follows the timestamps.
  TempDir d;
  auto r = run_trun(job(2, {}, {"on-rank",
                                "0",
                                "ignore-term",
                                "on-rank",
                                "0",
                                "error-file",
                                "early failure",
                                "1000",
                                "on-rank",
                                "0",
                                "pidfile",
                                d.path(),
                                "on-rank",
                                "1",
                                "wait-file",
                                d / "pid_0_0",
                                "on-rank",
                                "1",
                                "error-file",
                                "late failure",
                                "2000",
                                "on-rank",
                                "1",
                                "exit",
                                "1",
                                "sleep",
                                "0.3",
                                "exit",
                                "1"}));
  CHECK(r.exit_code == 1);
  auto root = r.err.find("Root Cause");
  REQUIRE(root != std::string::npos);
  auto tail = r.err.substr(root);
  CHECK(tail.find("early failure") != std::string::npos);
  CHECK(tail.find("late failure") == std::string::npos);
  CHECK((r.err.find("late failure") < root));
}

TEST_CASE("SIGTERM to trun is forwarded and trun exits 143", "[agent][signals]") {
  TempDir d;
  Child c({trun_binary(), "--standalone", "--nproc-per-node", "2", test_worker(), "trap", d.path(),
           "pidfile", d.path(), "sleep", "60"});
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0") && file_exists(d / "pid_0_1"); }));
  c.signal(SIGTERM);
  REQUIRE(c.wait(std::chrono::seconds(20)));
  CHECK(c.exit_code() == 143);
  CHECK(read_file(d / "sig_0") == std::to_string(SIGTERM));
  CHECK(read_file(d / "sig_1") == std::to_string(SIGTERM));
}

TEST_CASE("SIGINT and SIGHUP are forwarded as themselves", "[agent][signals]") {
  for (int sig : {SIGINT, SIGHUP, SIGQUIT}) {
    TempDir d;
    Child c({trun_binary(), "--nproc-per-node", "1", test_worker(), "trap", d.path(), "pidfile",
             d.path(), "sleep", "60"});
    REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0"); }));
    c.signal(sig);
    REQUIRE(c.wait(std::chrono::seconds(20)));
    CHECK(c.exit_code() == 128 + sig);
    CHECK(read_file(d / "sig_0") == std::to_string(sig));
  }
}

TEST_CASE("SIGUSR1 is forwarded only when listed in --signals-to-handle", "[agent][signals]") {
  TempDir d;
  Child c({trun_binary(), "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1",
           test_worker(), "trap", d.path(), "pidfile", d.path(), "sleep", "60"});
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0") && file_exists(d / "pid_0_1"); }));
  c.signal(SIGUSR1);
  REQUIRE(c.wait(std::chrono::seconds(20)));
  CHECK(c.exit_code() == 128 + SIGUSR1);
  CHECK(read_file(d / "sig_1") == std::to_string(SIGUSR1));
}

TEST_CASE("workers that ignore SIGTERM are killed after --shutdown-timeout", "[agent][signals]") {
  TempDir d;
  Child c({trun_binary(), "--nproc-per-node", "2", "--shutdown-timeout", "0.3", test_worker(),
           "ignore-term", "pidfile", d.path(), "sleep", "60"});
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0") && file_exists(d / "pid_0_1"); }));
  c.signal(SIGTERM);
  REQUIRE(c.wait(std::chrono::seconds(20)));
  CHECK(c.exit_code() == 143);
  CHECK_FALSE(pid_alive(read_pid(d / "pid_0_0")));
  CHECK_FALSE(pid_alive(read_pid(d / "pid_0_1")));
  CHECK(c.err().find("sending SIGKILL") != std::string::npos);
}

TEST_CASE("TORCH_ELASTIC_SHUTDOWN_TIMEOUT applies when --shutdown-timeout is not given",
          "[agent][signals]") {
  // With the variable at 0.3 s the workers are killed long before the 20 s wait; the option,
  // when given, wins over a variable that would make the wait exceed it.
  for (bool with_option : {false, true}) {
    INFO("with the option: " << with_option);
    TempDir d;
    std::vector<std::string> argv{trun_binary(), "--nproc-per-node", "1"};
    if (with_option) argv.insert(argv.end(), {"--shutdown-timeout", "0.3"});
    argv.insert(argv.end(), {test_worker(), "ignore-term", "pidfile", d.path(), "sleep", "60"});
    Child c(argv, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", with_option ? "1000" : "0.3"}});
    REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0"); }));
    c.signal(SIGTERM);
    REQUIRE(c.wait(std::chrono::seconds(20)));
    CHECK(c.exit_code() == 143);
    CHECK_FALSE(pid_alive(read_pid(d / "pid_0_0")));
    CHECK(c.err().find("sending SIGKILL") != std::string::npos);
  }
}

TEST_CASE("signals trun inherited as ignored still work and workers get them at their defaults",
          "[agent][signals]") {
  // env(1) starts trun with SIGCHLD and the stop signals ignored, as a shell does for a
  // background job's SIGINT and SIGQUIT; an ignored disposition survives exec.
  const std::string ignore = "--ignore-signal=CHLD,HUP,INT,QUIT,TERM";
  {
    // Ignored SIGCHLD: the kernel would reap the workers itself and trun would wait forever.
    Child c({"/usr/bin/env", ignore, trun_binary(), "--nproc-per-node", "2", "--no-python",
             "/bin/grep", "SigIgn", "/proc/self/status"});
    REQUIRE(c.wait(std::chrono::seconds(20)));
    INFO(c.out() << c.err());
    CHECK(c.exit_code() == 0);
    // Each worker's ignored-signal mask (bit N-1 for signal N) has none of them.
    std::istringstream lines(c.out());
    std::string line;
    int workers = 0;
    while (std::getline(lines, line)) {
      auto colon = line.find("SigIgn:");
      if (colon == std::string::npos) continue;
      ++workers;
      const unsigned long long mask = std::stoull(line.substr(colon + 7), nullptr, 16);
      for (int sig : {SIGCHLD, SIGHUP, SIGINT, SIGQUIT, SIGTERM}) {
        INFO(line << ": signal " << sig);
        CHECK((mask & (1ULL << (sig - 1))) == 0);
      }
    }
    CHECK(workers == 2);
  }
  {
    // The forwarded SIGINT stops a worker that keeps its inherited dispositions (sleep), long
    // before the shutdown timeout would SIGKILL it.
    // "$$$$": trun, as torchrun, turns $$ in the worker's arguments into $ (agent/worker_env.h).
    TempDir d;
    Child c({"/usr/bin/env", ignore, trun_binary(), "--nproc-per-node", "1", "--shutdown-timeout",
             "600", "--no-python", "/bin/sh", "-c", "echo $$$$ > " + d / "pid; exec sleep 60"});
    REQUIRE(wait_until([&] { return read_file(d / "pid").find('\n') != std::string::npos; }));
    CHECK(std::atoi(read_file(d / "pid").c_str()) > 0);
    c.signal(SIGINT);
    REQUIRE(c.wait(std::chrono::seconds(20)));
    INFO(c.err());
    CHECK(c.exit_code() == 130);
    CHECK(c.err().find("sending SIGKILL") == std::string::npos);
  }
}

TEST_CASE("a grandchild left in a worker's group is stopped when the job ends", "[agent]") {
  TempDir d;
  // The worker exits 0 once its grandchild is up; the grandchild would sleep on.
  auto r = run_trun(job(1, {}, {"grandchild", d.path(), "sleep", "0.3"}));
  CHECK(r.exit_code == 0);
  REQUIRE(file_exists(d / "gc_0_0"));
  CHECK(wait_until([&] { return !pid_alive(read_pid(d / "gc_0_0")); }, std::chrono::seconds(5)));
}

TEST_CASE("SIGKILL of trun leaves no worker or grandchild alive (50 times)", "[agent][kill]") {
  for (int round = 0; round < 50; ++round) {
    TempDir d;
    Child c({trun_binary(), "--nproc-per-node", "2", "--log-dir", d / "logs", test_worker(),
             "grandchild", d.path(), "pidfile", d.path(), "sleep", "60"});
    REQUIRE(wait_until([&] {
      return file_exists(d / "pid_0_0") && file_exists(d / "pid_0_1") &&
             file_exists(d / "gc_0_0") && file_exists(d / "gc_0_1");
    }));
    std::vector<pid_t> pids{read_pid(d / "pid_0_0"), read_pid(d / "pid_0_1"),
                            read_pid(d / "gc_0_0"), read_pid(d / "gc_0_1")};
    c.signal(SIGKILL);
    REQUIRE(c.wait(std::chrono::seconds(10)));
    for (pid_t p : pids) {
      bool gone = wait_until([&] { return !pid_alive(p); }, std::chrono::seconds(5));
      INFO("round " << round << " pid " << p << ": "
                    << read_file("/proc/" + std::to_string(p) + "/stat"));
      CHECK(gone);
    }
  }
}

TEST_CASE("as PID 1 of a pid namespace trun reaps orphans and forwards SIGTERM", "[agent][pid1]") {
  if (geteuid() != 0 || access("/usr/bin/unshare", X_OK) != 0) {
    TRUN_SKIP("needs root and /usr/bin/unshare (util-linux) to create a pid namespace", kSetup);
  }
  {
    // Workers orphan a grandchild; it must be reaped by trun (PID 1 and subreaper).
    Child c({"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", trun_binary(),
             "--nproc-per-node", "2", test_worker(), "orphan-check"});
    REQUIRE(c.wait(std::chrono::seconds(30)));
    INFO(c.err());
    if (c.exit_code() != 0 && c.err().find("unshare failed") != std::string::npos) {
      TRUN_SKIP("unshare cannot create a pid namespace here: " << c.err(), kSetup);
    }
    CHECK(c.exit_code() == 0);
  }
  {
    TempDir d;
    Child c({"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", trun_binary(),
             "--nproc-per-node", "2", test_worker(), "trap", d.path(), "pidfile", d.path(), "sleep",
             "60"});
    REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0") && file_exists(d / "pid_0_1"); }));
    // trun is unshare's only child; signal it directly (unshare does not forward).
    pid_t trun_pid = 0;
    REQUIRE(wait_until([&] {
      std::string children = read_file("/proc/" + std::to_string(c.pid()) + "/task/" +
                                       std::to_string(c.pid()) + "/children");
      trun_pid = static_cast<pid_t>(std::atol(children.c_str()));
      return trun_pid > 0;
    }));
    std::string pid_in_ns = read_file("/proc/" + std::to_string(trun_pid) + "/status");
    CHECK(pid_in_ns.find("NSpid:\t" + std::to_string(trun_pid) + "\t1") != std::string::npos);
    kill(trun_pid, SIGTERM);
    REQUIRE(c.wait(std::chrono::seconds(20)));
    CHECK(c.exit_code() == 143);
    CHECK(read_file(d / "sig_0") == std::to_string(SIGTERM));
    CHECK(read_file(d / "sig_1") == std::to_string(SIGTERM));
  }
}

TEST_CASE("LOGLEVEL sets trun's own log level", "[agent][logs]") {
  auto quiet = run_trun({"--nproc-per-node=1", test_worker()});
  CHECK(quiet.exit_code == 0);
  CHECK(quiet.err.find("rendezvous done") == std::string::npos);
  auto loud = run_trun({"--nproc-per-node=1", test_worker()}, {{"LOGLEVEL", "INFO"}});
  CHECK(loud.exit_code == 0);
  CHECK(loud.err.find("rendezvous done") != std::string::npos);
}

// [no_tsan]: the agent spawns with vfork, whose child reports a failed execve through the memory
// it shares with trun; ThreadSanitizer turns vfork into fork, so in a TSan build that report is
// lost and the worker just exits 1 (no race involved; the plain and ASan builds run this case).
TEST_CASE("a program that cannot be executed fails the job with 127 in the summary",
          "[agent][exit][no_tsan]") {
  TempDir d;
  std::string script = d / "not_really.sh";
  {
    std::ofstream out(script);
    out << "#!/nonexistent/interpreter\n";
  }
  chmod(script.c_str(), 0755);
  auto r = run_trun({"--nproc-per-node=1", script});
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("cannot start worker") != std::string::npos);
  CHECK(r.err.find("exitcode  : 127") != std::string::npos);
}

TEST_CASE("shared-memory segments a job's workers left behind are removed when it ends",
          "[agent][shm]") {
  // A worker that "dies" between creating a segment and sharing it: it leaves one named as
  // libtrun_worker names them. Another job's segment must survive.
  const std::string other = "/dev/shm/trun-some-other-job-r0-pg0-0123456789abcdef";
  { std::ofstream(other) << "x"; }
  auto r = run_trun({"--standalone", "--nproc-per-node", "1", "--no-python", "bash", "-c",
                     "touch /dev/shm/trun-${TORCHELASTIC_RUN_ID}-r0-pg0-00000000deadbeef && "
                     "echo run_id=${TORCHELASTIC_RUN_ID}"});
  REQUIRE(r.exit_code == 0);
  auto at = r.out.find("run_id=");
  REQUIRE(at != std::string::npos);
  std::string run_id = r.out.substr(at + 7, r.out.find('\n', at) - at - 7);
  REQUIRE_FALSE(run_id.empty());
  CHECK_FALSE(std::filesystem::exists("/dev/shm/trun-" + run_id + "-r0-pg0-00000000deadbeef"));
  CHECK_THAT(r.err, Catch::Contains("removed shared-memory segment"));
  CHECK(std::filesystem::exists(other));
  std::filesystem::remove(other);
}
