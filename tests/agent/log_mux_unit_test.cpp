// agent/log_mux.h: line prefixes, and set_prefix on real pipes. The rest of the tee and files
// run black-box in logs_test.cpp.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "agent/event_loop.h"
#include "agent/log_mux.h"

using namespace trun::agent;

TEST_CASE("line prefixes follow torchrun's template", "[logs]") {
  CHECK(line_prefix("", "default", 5, 1) == "[default1]:");
  CHECK(line_prefix("${role_name}/${rank}/${local_rank}", "w", 5, 1) == "[w/5/1]:");
  CHECK(line_prefix("${unknown}", "w", 5, 1) == "[${unknown}]:");
}

namespace {

// The whole text of `path` ("" when it cannot be read).
std::string log_mux_file_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `loop` until `done()` or 10 s.
template <typename Done>
bool log_mux_run_until(EventLoop& loop, Done done) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done() && std::chrono::steady_clock::now() < end) {
    loop.run_once(steady_clock().now() + std::chrono::milliseconds(20));
  }
  return done();
}

}  // namespace

TEST_CASE("set_prefix changes a worker's tee'd lines from the next one on, and only its own",
          "[logs]") {
  char tmpl[] = "/tmp/trun-logmux.XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  {
    EventLoop loop;
    LogMux mux(loop);
    // The duplicate file gets every matching tee'd line with its prefix, as the console would.
    mux.duplicate(1, dir + "/dup.log", {"line"});
    const int fd0 = mux.prepare(StreamMode::kTee, 1, dir + "/0.log", "[r2]:", 0);
    const int fd1 = mux.prepare(StreamMode::kTee, 1, dir + "/1.log", "[r3]:", 1);
    REQUIRE(fd0 >= 0);
    REQUIRE(fd1 >= 0);
    // The worker's ends, as a spawned worker would hold them.
    const int w0 = ::dup(fd0), w1 = ::dup(fd1);
    mux.close_child_ends();
    REQUIRE(::write(w0, "line a\n", 7) == 7);
    REQUIRE(::write(w1, "line b\n", 7) == 7);
    CHECK(log_mux_run_until(loop, [&] {
      return log_mux_file_text(dir + "/0.log") == "line a\n" &&
             log_mux_file_text(dir + "/1.log") == "line b\n";
    }));
    mux.set_prefix(0, "[r0]:");
    REQUIRE(::write(w0, "line c\n", 7) == 7);
    REQUIRE(::write(w1, "line d\n", 7) == 7);
    ::close(w0);
    ::close(w1);
    mux.drain();
  }
  const std::string dup = log_mux_file_text(dir + "/dup.log");
  CHECK(dup.find("[r2]:line a\n") != std::string::npos);
  CHECK(dup.find("[r3]:line b\n") != std::string::npos);
  CHECK(dup.find("[r0]:line c\n") != std::string::npos);
  CHECK(dup.find("[r3]:line d\n") != std::string::npos);
  CHECK(log_mux_file_text(dir + "/0.log") == "line a\nline c\n");  // the log file has no prefix
  std::filesystem::remove_all(dir);
}
