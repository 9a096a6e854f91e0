// agent/health_gate.h: the checks one by one, with real files, directories and processes.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <string>

#include "agent/health_gate.h"
#include "tests/launcher/process_util.h"

using namespace trun::agent;
using namespace std::chrono_literals;

TEST_CASE("the health gate's built-in checks and its command", "[health]") {
  trun::testing::TempDir d;
  HealthOptions o;
  o.shm_dir = d.path();
  SECTION("healthy: space, a writable directory, a command that exits 0 (output kept)") {
    o.shm_bytes_needed = 1024;
    o.writable_dirs = {d.path()};
    o.command = "echo fine; echo also on stderr >&2";
    const HealthReport r = check_node_health(o);
    CHECK(r.healthy);
    CHECK(r.reason.empty());
    CHECK(r.output == "fine\nalso on stderr\n");
  }
  SECTION("not enough free space where the segments go") {
    o.shm_bytes_needed = uint64_t{1} << 62;
    const HealthReport r = check_node_health(o);
    CHECK_FALSE(r.healthy);
    CHECK(r.reason.find(d.path() + " has ") == 0);
    CHECK(r.reason.find("needed for this node's segments") != std::string::npos);
  }
  SECTION("a directory that cannot take a file") {
    o.writable_dirs = {d / "missing"};
    const HealthReport r = check_node_health(o);
    CHECK_FALSE(r.healthy);
    CHECK(r.reason == d / "missing" + " is not writable: No such file or directory");
  }
  SECTION("the first failing check is the reason; the command does not run after it") {
    o.writable_dirs = {d / "missing"};
    o.command = "touch '" + d / "ran" + "'";
    CHECK_FALSE(check_node_health(o).healthy);
    CHECK_FALSE(trun::testing::file_exists(d / "ran"));
  }
  SECTION("built-in checks off: only the command") {
    o.builtin = false;
    o.writable_dirs = {d / "missing"};
    o.command = "exit 0";
    CHECK(check_node_health(o).healthy);
  }
  SECTION("a failing command: its exit code and last line") {
    o.command = "echo first; echo 'disk /scratch is read-only'; exit 5";
    const HealthReport r = check_node_health(o);
    CHECK_FALSE(r.healthy);
    CHECK(r.reason == "--health-check exited with 5: disk /scratch is read-only");
  }
  SECTION("a command killed by a signal") {
    o.command = "kill -9 $$";
    CHECK(check_node_health(o).reason == "--health-check was killed by signal 9");
  }
  SECTION("a command past its timeout is killed with its process group") {
    o.command = "sleep 30 & echo $! > '" + d / "bg.pid" + "'; sleep 30";
    o.timeout = 300ms;
    const auto t0 = std::chrono::steady_clock::now();
    const HealthReport r = check_node_health(o);
    CHECK(r.reason == "--health-check ran past its timeout (0.3 s): killed");
    CHECK(std::chrono::steady_clock::now() - t0 < 20s);
    const pid_t bg = trun::testing::read_pid(d / "bg.pid");
    REQUIRE(bg > 0);
    CHECK(trun::testing::wait_until([&] { return !trun::testing::pid_alive(bg); }, 10s));
  }
  SECTION("a command that leaves a child holding its output open still ends when it exits") {
    o.command = "sleep 30 & echo $! > '" + d / "bg.pid" + "'; echo done";
    o.timeout = 20s;
    const auto t0 = std::chrono::steady_clock::now();
    const HealthReport r = check_node_health(o);
    CHECK(r.healthy);
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
    const pid_t bg = trun::testing::read_pid(d / "bg.pid");
    REQUIRE(bg > 0);
    CHECK(trun::testing::wait_until([&] { return !trun::testing::pid_alive(bg); }, 10s));
  }
  SECTION("a command whose output is large keeps its last 4 KiB") {
    o.command = "i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done";
    const HealthReport r = check_node_health(o);
    CHECK(r.healthy);
    CHECK(r.output.size() == kOutputKeep);
    CHECK(r.output.substr(r.output.size() - 10) == "line 1999\n");
  }
}

TEST_CASE("the health gate's back-off and /dev/shm sizing", "[health]") {
  CHECK(health_retry_delay(1) == 1s);
  CHECK(health_retry_delay(2) == 2s);
  CHECK(health_retry_delay(4) == 8s);
  CHECK(health_retry_delay(7) == 60s);
  CHECK(health_retry_delay(1000) == 60s);
  CHECK(health_retry_delay(3, 3s) == 3s);
  CHECK(shm_bytes_for(1) == 8u << 20);
  CHECK(shm_bytes_for(8) == 32u << 20);
}
