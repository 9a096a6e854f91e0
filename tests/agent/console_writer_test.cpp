// agent/console.h: ConsoleWriter on a stalled pipe and on a regular file. The whole binary under
// a stalled console runs black-box in console_test.cpp.
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <regex>

#include "agent/console.h"
#include "tests/launcher/process_util.h"

using namespace trun::agent;
using trun::testing::read_file;
using trun::testing::TempDir;

TEST_CASE("a console writer to a stalled pipe drops whole lines, counts them, and never waits",
          "[console]") {
  int p[2];
  REQUIRE(pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0);  // O_NONBLOCK: for this test's reads only
  fcntl(p[1], F_SETFL, 0);                         // the writer's end blocks, like a terminal
  fcntl(p[1], F_SETPIPE_SZ, 4096);
  const int kTotal = 10000;
  auto line = [](int k) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "line %05d\n", k);
    return std::string(buf);
  };
  std::string received;
  auto read_pipe = [&] {
    char buf[65536];
    for (ssize_t n; (n = read(p[0], buf, sizeof buf)) > 0;) received.append(buf, size_t(n));
  };
  uint64_t dropped = 0;
  {
    ConsoleWriter w(p[1], 64 * 1024);
    REQUIRE(w.threaded());
    // One batch larger than the buffer (only its leading whole lines fit), then single lines:
    // every call returns although nobody reads the pipe.
    std::string batch;
    for (int k = 0; k < 8000; ++k) batch += line(k);
    w.write(batch);
    for (int k = 8000; k < kTotal; ++k) w.write(line(k));
    dropped = w.dropped_lines();
    CHECK(dropped > 0);
    CHECK_FALSE(w.has_room(1024));
    CHECK(trun::testing::wait_until([&] { return w.stalled(std::chrono::milliseconds(20)); },
                                    std::chrono::seconds(10)));
    // Now the reader comes back: what was kept, and a note about the gap, arrive.
    bool flushed = false;
    for (int i = 0; i < 2000 && !flushed; ++i) {
      read_pipe();
      flushed = w.flush(std::chrono::milliseconds(5));
    }
    read_pipe();
    REQUIRE(flushed);
  }
  close(p[0]);
  close(p[1]);
  const std::regex line_re(R"(line ([0-9]{5}))");
  const std::regex note_re(R"(trun: dropped ([0-9]+) console lines here: .*)");
  int last = -1, kept = 0, bad = 0;
  uint64_t noted = 0;
  for (const auto& l : trun::testing::lines_of(received)) {
    std::smatch m;
    if (std::regex_match(l, m, line_re) && std::stoi(m[1]) > last) {
      last = std::stoi(m[1]);
      ++kept;
    } else if (std::regex_match(l, m, note_re)) {
      noted += std::stoull(m[1]);
    } else {
      ++bad;
    }
  }
  CHECK(bad == 0);
  CHECK(received.back() == '\n');
  CHECK(static_cast<uint64_t>(kept) + dropped == kTotal);
  CHECK(noted == dropped);
  CHECK(kept >= 64 * 1024 / 11 - 1);  // the buffer was used before anything was dropped
}

TEST_CASE("a console writer to a regular file writes at once and drops nothing", "[console]") {
  TempDir d;
  const std::string path = d / "console";
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  std::string expected;
  {
    ConsoleWriter w(fd, 16);  // far smaller than what is written: files are not buffered
    CHECK_FALSE(w.threaded());
    for (int k = 0; k < 100; ++k) {
      std::string l = "regular " + std::to_string(k) + "\n";
      w.write(l);
      expected += l;
    }
    CHECK(read_file(path) == expected);  // before any flush
    CHECK(w.dropped_lines() == 0);
    CHECK(w.has_room(1 << 30));
    CHECK_FALSE(w.stalled(std::chrono::milliseconds(0)));
    CHECK(w.flush(std::chrono::milliseconds(0)));
  }
  close(fd);
}
