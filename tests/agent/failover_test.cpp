// c10d store failover end to end (issue 15): three trun agents on this machine, each with its own
// loopback address (127.0.0.1..3), the store hosted by the first. When that agent is SIGKILLed the
// other two move the store to one of them and carry on as one group of two without spending a
// restart; the killed node, started again with the endpoint list, joins that store. A round
// formed after an unplanned loss needs a majority of the previous round (split-brain protection),
// and a store that stops on purpose is not retried. Every process is ended by its pid (Child);
// every wait is bounded, generously: these are behaviour checks, not timings.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/rendezvous/test_options.h"

using namespace trun::testing;
using namespace std::chrono_literals;

namespace {

// Short leases and timeouts so that losses are noticed in about a second.
const std::string kConf =
    "last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3,read_timeout=5";

std::string addr(int node) { return "127.0.0." + std::to_string(node + 1); }

// Whether something accepts TCP connections at host:port (one attempt).
bool probe_port(const std::string& host, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
  ::close(fd);
  return ok;
}

// One agent of node `node` (1 worker) that appends its workers' environment to DIR/envlog.
std::vector<std::string> agent(int node, const std::string& endpoint, const std::string& run,
                               const std::string& nnodes, const std::string& dir,
                               const std::string& conf = kConf, int join_timeout = 60) {
  return {trun_binary(),
          "--rdzv-backend=c10d",
          "--rdzv-endpoint=" + endpoint,
          "--rdzv-id=" + run,
          "--nnodes=" + nnodes,
          "--nproc-per-node=1",
          "--max-restarts=0",
          "--local-addr=" + addr(node),
          "--rdzv-conf=" + conf + ",join_timeout=" + std::to_string(join_timeout),
          test_worker(),
          "envlog",
          dir + "/envlog",
          "sleep",
          "300"};
}

using Line = std::map<std::string, std::string>;
std::vector<Line> envlog(const std::string& dir) {
  std::vector<Line> out;
  for (const auto& text : lines_of(read_file(dir + "/envlog"))) {
    Line l;
    std::istringstream in(text);
    for (std::string kv; in >> kv;) {
      auto eq = kv.find('=');
      if (eq != std::string::npos) l[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    out.push_back(l);
  }
  return out;
}
// The last line of each dir, when every dir has one with WORLD_SIZE=world.
std::optional<std::vector<Line>> last_with_world(const std::vector<std::string>& dirs, int world,
                                                 size_t skip = 0) {
  std::vector<Line> last;
  for (const auto& d : dirs) {
    auto lines = envlog(d);
    if (lines.size() <= skip || lines.back()["WORLD_SIZE"] != std::to_string(world)) {
      return std::nullopt;
    }
    last.push_back(lines.back());
  }
  return last;
}
// Dense ranks 0..n-1, one master, restart count `restarts` everywhere.
void check_group(const std::vector<Line>& lines, int restarts) {
  std::set<std::string> ranks, masters;
  for (auto l : lines) {
    ranks.insert(l["RANK"]);
    masters.insert(l["MASTER"]);
    CHECK(l["TORCHELASTIC_RESTART_COUNT"] == std::to_string(restarts));
  }
  std::set<std::string> want;
  for (size_t i = 0; i < lines.size(); ++i) want.insert(std::to_string(i));
  CHECK(ranks == want);
  CHECK(masters.size() == 1);
}

std::string dir_of(const TempDir& d, int node) {
  std::string dir = d / ("n" + std::to_string(node));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE(
    "c10d failover: SIGKILL of the store host leaves one group of the other two, and the "
    "host restarted with the endpoint list joins it",
    "[agent][failover]") {
  TempDir d;
  const std::string run = unique_run_id("fo");
  const int port = free_port();
  const std::string ep = addr(0) + ":" + std::to_string(port);
  const std::vector<std::string> dirs{dir_of(d, 0), dir_of(d, 1), dir_of(d, 2)};
  auto a = std::make_unique<Child>(agent(0, ep, run, "2:3", dirs[0]));
  // The host's store listens before the others start, so that node 0 hosts it.
  REQUIRE(wait_until([&] { return probe_port("127.0.0.1", port); }, 30s));
  Child b(agent(1, ep, run, "2:3", dirs[1]));
  Child c(agent(2, ep, run, "2:3", dirs[2]));
  std::optional<std::vector<Line>> world3;
  REQUIRE(wait_until([&] { return (world3 = last_with_world(dirs, 3)).has_value(); }, 60s));
  check_group(*world3, 0);

  a->signal(SIGKILL);
  REQUIRE(a->wait(10s));
  const size_t before1 = envlog(dirs[1]).size(), before2 = envlog(dirs[2]).size();
  std::optional<std::vector<Line>> world2;
  bool formed = wait_until(
      [&] {
        world2 = last_with_world({dirs[1], dirs[2]}, 2);
        return world2 && envlog(dirs[1]).size() > before1 && envlog(dirs[2]).size() > before2;
      },
      60s);
  INFO("agent b:\n" << b.err() << "\nagent c:\n" << c.err());
  REQUIRE(formed);
  check_group(*world2, 0);
  CHECK(b.running());
  CHECK(c.running());
  const std::string moved = b.err() + c.err();
  CHECK_THAT(moved, Catch::Contains("the rendezvous store moved to"));

  // Node 0 comes back with the list of where the store may be.
  const std::string list =
      ep + "," + addr(1) + ":" + std::to_string(port) + "," + addr(2) + ":" + std::to_string(port);
  const size_t skip0 = envlog(dirs[0]).size();
  a = std::make_unique<Child>(agent(0, list, run, "2:3", dirs[0]));
  bool rejoined = wait_until(
      [&] {
        auto l = last_with_world(dirs, 3);
        return l && envlog(dirs[0]).size() > skip0 && envlog(dirs[1]).size() > before1 + 1;
      },
      60s);
  INFO("agent a (restarted):\n" << a->err());
  REQUIRE(rejoined);
  check_group(*last_with_world(dirs, 3), 0);
  CHECK_THAT(a->err(), Catch::Contains("the store moved to"));
}

TEST_CASE(
    "c10d failover: the survivor of a 2-node job whose store host dies says why it cannot "
    "move the store, retries it until join_timeout and exits 3",
    "[agent][failover]") {
  TempDir d;
  const std::string run = unique_run_id("fo2");
  const int port = free_port();
  const std::string ep = addr(0) + ":" + std::to_string(port);
  const std::vector<std::string> dirs{dir_of(d, 0), dir_of(d, 1)};
  // 2:2: on this one machine the survivor may host the endpoint's address itself when it
  // rejoins (a store host that came back, for all it knows); it must not train alone either way.
  Child a(agent(0, ep, run, "2:2", dirs[0], kConf, 8));
  REQUIRE(wait_until([&] { return probe_port("127.0.0.1", port); }, 30s));
  Child b(agent(1, ep, run, "2:2", dirs[1], kConf, 8));
  REQUIRE(wait_until([&] { return last_with_world(dirs, 2).has_value(); }, 60s));
  a.signal(SIGKILL);
  REQUIRE(a.wait(10s));
  // It died rather than stopped: it may come back, so the survivor tries it for join_timeout.
  const bool ended = b.wait(60s);
  INFO(b.err());
  REQUIRE(ended);
  CHECK(b.exit_code() == 3);
  CHECK_THAT(b.err(), Catch::Contains("cannot move it") && Catch::Contains("majority (2)") &&
                          Catch::Contains("could not rejoin within"));
  CHECK(envlog(dirs[1]).size() == 1);  // no group of one
}

TEST_CASE(
    "c10d quorum: the store host does not carry on alone when 2 of 3 nodes die at once, "
    "unless failover is off",
    "[agent][failover][quorum]") {
  const bool failover = GENERATE(true, false);
  INFO("failover=" << failover);
  TempDir d;
  const std::string run = unique_run_id("q");
  const int port = free_port();
  const std::string ep = addr(0) + ":" + std::to_string(port);
  const std::vector<std::string> dirs{dir_of(d, 0), dir_of(d, 1), dir_of(d, 2)};
  const std::string conf = kConf + ",failover=" + (failover ? "true" : "false");
  Child a(agent(0, ep, run, "1:3", dirs[0], conf));
  REQUIRE(wait_until([&] { return probe_port("127.0.0.1", port); }, 30s));
  auto b = std::make_unique<Child>(agent(1, ep, run, "1:3", dirs[1], conf));
  auto c = std::make_unique<Child>(agent(2, ep, run, "1:3", dirs[2], conf));
  REQUIRE(wait_until([&] { return last_with_world(dirs, 3).has_value(); }, 60s));
  b->signal(SIGKILL);
  c->signal(SIGKILL);
  REQUIRE(b->wait(10s));
  REQUIRE(c->wait(10s));
  b.reset();
  c.reset();
  if (failover) {
    // Held: the waiting line names the majority, and no group of one is formed.
    bool held = wait_until(
        [&] { return a.err().find("waits for a majority of round") != std::string::npos; }, 30s);
    INFO(a.err());
    CHECK(held);
    CHECK_FALSE(last_with_world({dirs[0]}, 1).has_value());
    CHECK(a.running());
  } else {
    bool alone = wait_until([&] { return last_with_world({dirs[0]}, 1).has_value(); }, 30s);
    INFO(a.err());
    CHECK(alone);
  }
}

TEST_CASE(
    "c10d: when the store host leaves on purpose, the other node of a 2-node job moves "
    "the store (failover) or stops at once without retrying it (failover=false)",
    "[agent][failover][gone]") {
  const bool failover = GENERATE(true, false);
  INFO("failover=" << failover);
  TempDir d;
  const std::string run = unique_run_id("gone");
  const int port = free_port();
  const std::string ep = addr(0) + ":" + std::to_string(port);
  const std::vector<std::string> dirs{dir_of(d, 0), dir_of(d, 1)};
  const std::string conf = kConf + ",failover=" + (failover ? "true" : "false");
  Child a(agent(0, ep, run, "1:2", dirs[0], conf));
  REQUIRE(wait_until([&] { return probe_port("127.0.0.1", port); }, 30s));
  Child b(agent(1, ep, run, "1:2", dirs[1], conf));
  REQUIRE(wait_until([&] { return last_with_world(dirs, 2).has_value(); }, 60s));
  const size_t before = envlog(dirs[1]).size();
  a.signal(SIGTERM);
  REQUIRE(a.wait(30s));
  if (failover) {
    bool alone = wait_until(
        [&] { return envlog(dirs[1]).size() > before && last_with_world({dirs[1]}, 1); }, 30s);
    INFO(b.err());
    CHECK(alone);
    CHECK(b.running());
  } else {
    // join_timeout is 60 s: the store is not retried for it.
    REQUIRE(b.wait(30s));
    INFO(b.err());
    CHECK(b.exit_code() == 3);
    CHECK_THAT(b.err(), Catch::Contains("was stopped") || Catch::Contains("stopped on purpose"));
  }
}
