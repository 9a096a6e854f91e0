// Every wait that logs or documents a bound ends within it (+1 s), black-box: a c10d agent that
// loses its store, an endpoint whose name does not resolve, a refused port. Each ends with one
// clear line, and the token hint appears only where a token can be the cause. Loopback only.
#include <netdb.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <string>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/skip.h"

using namespace trun::testing;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// How far past its deadline an agent may end here: these tests check that a bound is kept (the
// regressions they guard took 60 s and more), on a 2-core machine that also runs sanitizer builds
// and other tests; 1 s of slack failed under load. Not a speed target (scripts/bench.sh is).
constexpr auto kSlack = 8s;

// What a test does not want from the environment it runs in.
const std::vector<std::string> kTimeoutsUnset{"TORCHELASTIC_ERROR_FILE", "LOGLEVEL",
                                              "OMP_NUM_THREADS", "TRUN_STORE_TOKEN"};

std::vector<std::string> error_lines(const std::string& err) {
  std::vector<std::string> out;
  for (const auto& l : lines_of(err)) {
    if (l.find("trun: error:") != std::string::npos || l.find("trun error:") != std::string::npos) {
      out.push_back(l);
    }
  }
  return out;
}

// `trun store` on a free loopback port, its port once it listens.
uint16_t store_port(Child& store) {
  REQUIRE(wait_until([&] { return store.out().find("listening on") != std::string::npos; }));
  const std::string out = store.out();
  return static_cast<uint16_t>(std::stoi(out.substr(out.rfind(':') + 1)));
}

std::vector<std::string> trun_args(std::vector<std::string> args) {
  args.insert(args.begin(), trun_binary());
  return args;
}

}  // namespace

TEST_CASE("a c10d agent that loses its store exits 3 within its rejoin bound", "[timeouts]") {
  Child store({trun_binary(), "store", "--host", "127.0.0.1", "--port", "0"});
  const std::string endpoint = "127.0.0.1:" + std::to_string(store_port(store));
  TempDir d;
  Child agent(trun_args({"--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint, "--rdzv-conf",
                         "join_timeout=3,is_host=false", test_worker(), "pidfile", d.path(),
                         "sleep", "60"}),
              {}, kTimeoutsUnset);
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0"); }, 20s));
  const pid_t worker = read_pid(d / "pid_0_0");

  store.signal(SIGKILL);
  REQUIRE(store.wait(5s));
  const auto start = Clock::now();
  REQUIRE(agent.wait(30s));
  const auto took = Clock::now() - start;
  INFO(agent.err());
  CHECK(agent.exit_code() == 3);
  // Was 60 s and more: each rejoin retried its connection for read_timeout. The slack over
  // join_timeout is for a loaded machine (sanitizer builds, parallel tests), not a speed target.
  CHECK(took < 3s + kSlack);
  auto errors = error_lines(agent.err());
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("lost the rendezvous store at " + endpoint));
  CHECK_THAT(errors[0], Catch::Contains("could not rejoin within 3 s"));
  CHECK_THAT(agent.err(), !Catch::Contains("TRUN_STORE_TOKEN"));  // the server died: no hint
  CHECK(wait_until([&] { return !pid_alive(worker); }, 5s));
}

TEST_CASE("when the agent hosting the store is killed, the other exits 3 within its bound",
          "[timeouts]") {
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  TempDir d0, d1;
  auto agent_args = [&](const std::string& is_host, const TempDir& d) {
    return trun_args({"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-id=timeouts-host",
                      "--rdzv-endpoint=" + endpoint, "--rdzv-conf",
                      "join_timeout=3,is_host=" + is_host,
                      // A SIGKILLed agent cannot remove a temporary log directory: keep it in d.
                      "--log-dir=" + d.path() + "/trun-logs", test_worker(), "pidfile", d.path(),
                      "sleep", "60"});
  };
  Child host(agent_args("true", d0), {}, kTimeoutsUnset);
  // The host binds first; the other one must not (it would take over the port when it is free).
  std::this_thread::sleep_for(200ms);
  Child other(agent_args("false", d1), {}, kTimeoutsUnset);
  REQUIRE(
      wait_until([&] { return file_exists(d0 / "pid_0_0") && file_exists(d1 / "pid_0_0"); }, 20s));
  const pid_t worker = read_pid(d1 / "pid_0_0");

  host.signal(SIGKILL);
  REQUIRE(host.wait(5s));
  const auto start = Clock::now();
  REQUIRE(other.wait(30s));
  const auto took = Clock::now() - start;
  INFO(other.err());
  CHECK(other.exit_code() == 3);
  CHECK(took < 3s + kSlack);
  auto errors = error_lines(other.err());
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("lost the rendezvous store at " + endpoint));
  CHECK_THAT(other.err(), !Catch::Contains("TRUN_STORE_TOKEN"));
  CHECK(wait_until([&] { return !pid_alive(worker); }, 5s));
  const pid_t orphan = read_pid(d0 / "pid_0_0");  // the killed agent's worker: death signal
  CHECK(wait_until([&] { return !pid_alive(orphan); }, 10s));
}

TEST_CASE("a rendezvous endpoint whose name does not resolve fails at once, naming it",
          "[timeouts]") {
  const std::string host = "no-such-host.invalid";
  TRUN_SKIP_UNLESS_NONAME(host);
  const auto start = Clock::now();
  auto r = run_trun({"--rdzv-backend=c10d", "--rdzv-endpoint=" + host + ":29500", "--rdzv-conf",
                     "join_timeout=30", test_worker()},
                    {}, 60s, {"TRUN_STORE_TOKEN"});
  const auto took = Clock::now() - start;
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 3);
  CHECK(took < 15s);  // well before join_timeout (30 s): the lookup is not retried
  auto lines = lines_of(r.err);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains(host + ":29500"));
  CHECK_THAT(lines[0], Catch::Contains("cannot resolve host"));
}

TEST_CASE("a refused rendezvous port is retried until join_timeout, then one line", "[timeouts]") {
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  const auto start = Clock::now();
  auto r = run_trun({"--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint, "--rdzv-conf",
                     "join_timeout=3,is_host=false", test_worker()},
                    {}, 30s, {"TRUN_STORE_TOKEN"});
  const auto took = Clock::now() - start;
  INFO(r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 3);
  CHECK(took >= 2800ms);  // the server may be starting: it kept trying
  CHECK(took < 3s + kSlack);
  auto lines = lines_of(r.err);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains(endpoint));
  CHECK_THAT(lines[0], Catch::Contains("Connection refused"));
  CHECK_THAT(lines[0], !Catch::Contains("TRUN_STORE_TOKEN"));
}

TEST_CASE("an agent without the store's token is told about TRUN_STORE_TOKEN", "[timeouts]") {
  Child store(
      {trun_binary(), "store", "--host", "127.0.0.1", "--port", "0", "--store-token", "s3cret"});
  const std::string endpoint = "127.0.0.1:" + std::to_string(store_port(store));
  auto none = run_trun({"--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint, "--rdzv-conf",
                        "join_timeout=5,is_host=false", test_worker()},
                       {}, 30s, {"TRUN_STORE_TOKEN"});
  INFO(none.err);
  REQUIRE(none.finished);
  CHECK(none.exit_code == 3);
  CHECK_THAT(none.err, Catch::Contains("TRUN_STORE_TOKEN"));

  auto wrong = run_trun({"--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint, "--rdzv-conf",
                         "join_timeout=5,is_host=false", test_worker()},
                        {{"TRUN_STORE_TOKEN", "guess"}}, 30s);
  INFO(wrong.err);
  REQUIRE(wrong.finished);
  CHECK(wrong.exit_code == 3);
  CHECK_THAT(wrong.err, Catch::Contains("authentication failed"));
  store.signal(SIGTERM);
  CHECK(store.wait(10s));
}
