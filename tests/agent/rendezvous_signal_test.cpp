// A stop signal to trun while it waits in the rendezvous for more nodes: it leaves the rendezvous
// (the others see it go) and exits 128+N at once, instead of after the round formed or the join
// timeout (600 s by default: the bounds below are far shorter). Real agents, real signals.
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"

using namespace trun::testing;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> c10d_agent(const std::string& endpoint, const std::string& run_id,
                                    const std::string& dir) {
  std::filesystem::create_directories(dir);
  return {trun_binary(),
          "--nnodes=3",
          "--nproc-per-node=1",
          "--rdzv-backend=c10d",
          "--rdzv-endpoint=" + endpoint,
          "--rdzv-id=" + run_id,
          test_worker(),
          "env",
          dir,
          "sleep",
          "60"};
}

std::string world_size(const std::string& dir) {
  auto env = nlohmann::json::parse(read_file(dir + "/env_0_0.json"), nullptr, false);
  return env.is_object() ? env.value("WORLD_SIZE", "") : "";
}

// Nodes that joined the round being formed, as trun status sees them (-1: no answer yet).
int waiting(const std::string& ep, const std::string& run) {
  RunResult r = run_trun(
      {"status", "--rdzv-backend=c10d", "--rdzv-endpoint=" + ep, "--rdzv-id=" + run, "--json"});
  auto js = nlohmann::json::parse(r.out, nullptr, false);
  return js.is_object() ? js["waiting"].get<int>() : -1;
}

}  // namespace

TEST_CASE(
    "SIGTERM to trun waiting in a c10d rendezvous: it exits 143 and the round forms without it",
    "[agent][signals]") {
  TempDir d;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "sigwait-" + std::to_string(getpid());
  // a hosts the store; b joins and waits with it for a third node.
  Child a(c10d_agent(ep, run, d / "a"), {{"LOGLEVEL", "INFO"}});
  REQUIRE(wait_until([&] { return waiting(ep, run) == 1; }, 20s));
  Child b(c10d_agent(ep, run, d / "b"));
  // b has joined once the store holds its ticket: trun status lists it as waiting.
  REQUIRE(wait_until([&] { return waiting(ep, run) == 2; }, 20s));
  b.signal(SIGTERM);
  REQUIRE(b.wait(20s));
  INFO("agent b:\n" << b.err());
  CHECK(b.exit_code() == 143);
  CHECK(b.err().find("SIGTERM while waiting in the rendezvous") != std::string::npos);
  CHECK(a.running());
  // Two more nodes: the round forms with a, c and e, not with b (a ghost b would make it a, b, c
  // and leave e waiting, so e's workers would never start).
  Child c(c10d_agent(ep, run, d / "c"));
  Child e(c10d_agent(ep, run, d / "e"));
  const bool formed = wait_until(
      [&] {
        return file_exists(d / "a/env_0_0.json") && file_exists(d / "c/env_0_0.json") &&
               file_exists(d / "e/env_0_0.json");
      },
      60s);
  INFO("agent a:\n" << a.err() << "\nagent c:\n" << c.err() << "\nagent e:\n" << e.err());
  REQUIRE(formed);
  CHECK(world_size(d / "a") == "3");
  CHECK(world_size(d / "e") == "3");
  CHECK_FALSE(file_exists(d / "b/env_0_0.json"));
  // a saw b leave its first round.
  CHECK(a.err().find("left before the round completed") != std::string::npos);
  for (Child* x : {&a, &c, &e}) x->signal(SIGINT);
  for (Child* x : {&a, &c, &e}) {
    REQUIRE(x->wait(30s));
    CHECK(x->exit_code() == 130);
  }
}

TEST_CASE("Ctrl-C to trun waiting in a static rendezvous for node 1: it exits 130",
          "[agent][signals]") {
  const std::string port = std::to_string(free_port());
  Child a({trun_binary(), "--nnodes=2", "--node-rank=0", "--master-addr=127.0.0.1",
           "--master-port=" + port, "--rdzv-id=sigwait-static", test_worker(), "sleep", "60"});
  // Node 0 hosts the store and waits in the barrier for node 1 (which never comes): trun status
  // finds the job, no round formed.
  REQUIRE(wait_until(
      [&] {
        RunResult r = run_trun({"status", "--rdzv-backend=static", "--master-port=" + port,
                                "--rdzv-id=sigwait-static", "--json"});
        return r.exit_code == 0 && r.out.find("\"forming\"") != std::string::npos;
      },
      20s));
  a.signal(SIGINT);
  REQUIRE(a.wait(20s));
  INFO(a.err());
  CHECK(a.exit_code() == 130);
  CHECK(a.err().find("SIGINT while waiting in the rendezvous") != std::string::npos);
}

TEST_CASE("SIGTERM to a static node 1 that waits for node 0's store to come up: it exits 143",
          "[agent][signals]") {
  // Node 0 never starts: node 1 retries its connection (for join_timeout, minutes by default).
  Child b({trun_binary(), "--nnodes=2", "--node-rank=1", "--master-addr=127.0.0.1",
           "--master-port=" + std::to_string(free_port()), "--rdzv-id=sigwait-connect",
           "--metrics-port=0", test_worker(), "sleep", "60"},
          {}, {"TORCHELASTIC_HEALTH_CHECK_PORT"});
  // The metrics line comes after trun took over its signals, just before the rendezvous.
  REQUIRE(wait_until([&] { return b.err().find("trun: metrics on") != std::string::npos; }, 20s));
  b.signal(SIGTERM);
  REQUIRE(b.wait(20s));
  INFO(b.err());
  CHECK_FALSE(b.signaled());  // trun exited with 143 itself, not by the default action
  CHECK(b.exit_code() == 143);
  CHECK(b.err().find("SIGTERM while waiting in the rendezvous") != std::string::npos);
}
