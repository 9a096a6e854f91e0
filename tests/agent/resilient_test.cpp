// Resilient loops, the agent's side (docs/launcher.md, "Resilient loops: replacing one worker"),
// black-box through the trun binary with real worker processes (resilient_worker: a program that
// writes the progress board as a ResilientLoop does, without libtrun_worker). A failed worker of a
// group whose workers all run resilient loops is replaced alone: the others keep their pids and
// see the new generation on the board. Otherwise (a worker without the loop, no restarts left)
// nothing changes; a group that does not re-form is restarted whole; a signal to trun stops every
// worker, the replacement too.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/launcher/process_util.h"

using namespace trun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

std::string worker() { return std::string(TRUN_BINARY_DIR) + "/tests/agent/resilient_worker"; }

// trun with 4 resilient_workers writing into `d`, an event log and a log directory there.
std::vector<std::string> job(const TempDir& d, int max_restarts,
                             const std::vector<std::string>& extra,
                             const std::vector<std::string>& worker_options = {}) {
  std::vector<std::string> argv{trun_binary(), "--standalone",     "--nproc-per-node",
                                "4",           "--max-restarts",   std::to_string(max_restarts),
                                "--event-log", d / "events.jsonl", "--log-dir",
                                d / "logs"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(worker());
  argv.push_back(d.path());
  argv.insert(argv.end(), worker_options.begin(), worker_options.end());
  return argv;
}

std::string pid_file(const TempDir& d, int generation, int local_rank) {
  return d / ("pid_" + std::to_string(generation) + "_" + std::to_string(local_rank));
}

// The pids of generation `generation`'s workers (local ranks 0..3), once all four wrote theirs.
std::vector<pid_t> wait_pids(const TempDir& d, int generation) {
  REQUIRE(wait_until(
      [&] {
        for (int lr = 0; lr < 4; ++lr) {
          if (!file_exists(pid_file(d, generation, lr))) return false;
        }
        return true;
      },
      60s));
  std::vector<pid_t> pids;
  for (int lr = 0; lr < 4; ++lr) pids.push_back(read_pid(pid_file(d, generation, lr)));
  return pids;
}

std::vector<json> events_named(const std::string& path, const std::string& name) {
  std::vector<json> out;
  for (const auto& line : lines_of(read_file(path))) {
    auto j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("name", "") == name) out.push_back(j);
  }
  return out;
}

bool log_has(const TempDir& d, int local_rank, const std::string& text) {
  return read_file(d / ("log_" + std::to_string(local_rank))).find(text) != std::string::npos;
}

void finish(const TempDir& d) { std::ofstream(d / "finish") << "done\n"; }

// Ends every pid in `pids` still alive (a test that failed half-way): nothing is left behind.
void end_all(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    if (pid_alive(p)) ::kill(p, SIGKILL);
  }
}

// Waits (60 s) for trun to exit; if it does not, ends every pid in `pids` still alive first, so
// that a failing case leaves nothing behind. True when trun exited.
bool wait_or_end(Child& trun, const std::vector<pid_t>& pids) {
  const bool done = trun.wait(60s);
  if (!done) end_all(pids);
  return done;
}

// GET http://127.0.0.1:port/metrics, the body ("" when it cannot be read).
std::string scrape(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return {};
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string data;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    (void)!::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    char buf[4096];
    const auto end = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      data.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  const size_t at = data.find("\r\n\r\n");
  return at == std::string::npos ? "" : data.substr(at + 4);
}

// The port trun printed: "trun: metrics on http://0.0.0.0:PORT/metrics and /healthz".
int printed_port(Child& trun) {
  const std::string marker = "trun: metrics on http://0.0.0.0:";
  REQUIRE(wait_until([&] { return trun.err().find(marker) != std::string::npos; }, 20s));
  const std::string err = trun.err();
  return std::stoi(err.substr(err.find(marker) + marker.size()));
}

}  // namespace

TEST_CASE("a failed worker of resilient loops is replaced alone while the others keep running",
          "[agent][resilient]") {
  TempDir d;
  Child trun(job(d, 3, {"--metrics-port", "0"}), {},
             {"TORCHELASTIC_HEALTH_CHECK_PORT", "LOGLEVEL", "TORCHELASTIC_ERROR_FILE"});
  const int port = printed_port(trun);
  const std::vector<pid_t> first = wait_pids(d, 0);
  std::vector<pid_t> all = first;
  REQUIRE(::kill(first[1], SIGKILL) == 0);

  // The replacement: local rank 1 with TORCHELASTIC_RESTART_COUNT=1; the survivors see
  // generation 1 and "join" it; the agent says the group re-formed.
  const bool reformed = wait_until(
      [&] {
        return file_exists(pid_file(d, 1, 1)) && log_has(d, 0, "joined 1") &&
               log_has(d, 2, "joined 1") && log_has(d, 3, "joined 1") &&
               !events_named(d / "events.jsonl", "trun.agent.reformed").empty();
      },
      60s);
  INFO(trun.err());
  if (file_exists(pid_file(d, 1, 1))) all.push_back(read_pid(pid_file(d, 1, 1)));
  if (!reformed) end_all(all);
  REQUIRE(reformed);
  const pid_t replacement = read_pid(pid_file(d, 1, 1));
  CHECK(replacement != first[1]);
  for (int lr : {0, 2, 3}) {
    CHECK(pid_alive(first[static_cast<size_t>(lr)]));
    CHECK_FALSE(file_exists(pid_file(d, 1, lr)));  // no other new process
    CHECK(log_has(d, lr, "saw generation 1 pid=" + std::to_string(first[static_cast<size_t>(lr)])));
  }
  CHECK(log_has(d, 1, "start pid=" + std::to_string(replacement) + " generation=1"));

  std::string metrics;
  CHECK(wait_until(
      [&] {
        metrics = scrape(port);
        return metrics.find("trun_workers_replaced_total 1\n") != std::string::npos;
      },
      20s));
  INFO(metrics);
  CHECK_THAT(metrics, Catch::Contains("trun_restarts_total 1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_restarts_left 2\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_worker_state{local_rank=\"1\",state=\"running\"} 1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_worker_exits_total{signal=\"SIGKILL\"} 1\n"));

  finish(d);
  REQUIRE(wait_or_end(trun, all));
  const std::string err = trun.err();
  INFO(err);
  CHECK(trun.exit_code() == 0);
  CHECK_THAT(err, Catch::Contains("worker local_rank=1 (rank 1) exited with signal SIGKILL: "
                                  "replacing it alone, the other 3 workers keep running "
                                  "(resilient loop; restart 1/3)"));
  CHECK_THAT(err, Catch::Contains("group re-formed at generation 1 in "));
  CHECK_THAT(err, Catch::Contains("trun: 1 worker was replaced alone while the others kept "
                                  "running (resilient loop):"));
  CHECK_THAT(err, !Catch::Contains("FAILED"));
  CHECK_THAT(err, !Catch::Contains("restarting the worker group"));

  const std::string events = d / "events.jsonl";
  const auto replaced = events_named(events, "trun.agent.worker_replaced");
  REQUIRE(replaced.size() == 1);
  CHECK(replaced[0]["metadata"]["local_rank"] == 1);
  CHECK(replaced[0]["metadata"]["global_rank"] == 1);
  CHECK(replaced[0]["metadata"]["exitcode"] == -9);
  CHECK(replaced[0]["metadata"]["generation"] == 1);
  CHECK(replaced[0]["metadata"]["worker_pid"] == first[1]);
  const auto reformed_events = events_named(events, "trun.agent.reformed");
  REQUIRE(reformed_events.size() == 1);
  CHECK(reformed_events[0]["metadata"]["generation"] == 1);
  CHECK(reformed_events[0]["metadata"]["ms"].get<int64_t>() >= 0);
  CHECK(events_named(events, "trun.agent.worker_started").size() == 5);
  const auto restarts = events_named(events, "trun.agent.restart");
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0]["metadata"]["counted"] == true);
  CHECK(restarts[0]["metadata"]["agent_restarts"] == 1);
  const auto stop = events_named(events, "trun.agent.stop");
  REQUIRE(stop.size() == 1);
  CHECK(stop[0]["metadata"]["state"] == "SUCCEEDED");
  CHECK(stop[0]["metadata"]["agent_restarts"] == 1);
  // The replacement's logs: attempt_1/1 beside the group's attempt_0.
  bool logged = false;
  for (const auto& run : std::filesystem::directory_iterator(d / "logs")) {
    logged = logged || std::filesystem::is_directory(run.path() / "attempt_1" / "1");
    CHECK_FALSE(std::filesystem::exists(run.path() / "attempt_1" / "0"));
  }
  CHECK(logged);
  for (pid_t p : all) CHECK_FALSE(pid_alive(p));
}

TEST_CASE("a replacement that fails again is replaced again, as the next restart",
          "[agent][resilient]") {
  TempDir d;
  Child trun(job(d, 3, {}), {}, {"LOGLEVEL", "TORCHELASTIC_ERROR_FILE"});
  const std::vector<pid_t> first = wait_pids(d, 0);
  std::vector<pid_t> all = first;
  const std::string events = d / "events.jsonl";
  auto reformed_at = [&](int generation) {
    for (const auto& e : events_named(events, "trun.agent.reformed")) {
      if (e["metadata"]["generation"] == generation) return true;
    }
    return false;
  };
  REQUIRE(::kill(first[1], SIGKILL) == 0);
  bool ok = wait_until([&] { return file_exists(pid_file(d, 1, 1)) && reformed_at(1); }, 60s);
  if (file_exists(pid_file(d, 1, 1))) all.push_back(read_pid(pid_file(d, 1, 1)));
  if (!ok) end_all(all);
  REQUIRE(ok);
  REQUIRE(::kill(all.back(), SIGKILL) == 0);
  ok = wait_until([&] { return file_exists(pid_file(d, 2, 1)) && reformed_at(2); }, 60s);
  if (file_exists(pid_file(d, 2, 1))) all.push_back(read_pid(pid_file(d, 2, 1)));
  if (!ok) end_all(all);
  REQUIRE(ok);
  for (int lr : {0, 2, 3}) {
    CHECK(pid_alive(first[static_cast<size_t>(lr)]));
    CHECK(log_has(d, lr, "joined 2"));
  }
  finish(d);
  REQUIRE(wait_or_end(trun, all));
  const std::string err = trun.err();
  INFO(err);
  CHECK(trun.exit_code() == 0);
  CHECK_THAT(err, Catch::Contains("(resilient loop; restart 2/3)"));
  CHECK_THAT(err, Catch::Contains("trun: 2 workers were replaced alone"));
  CHECK(events_named(events, "trun.agent.worker_replaced").size() == 2);
  for (pid_t p : all) CHECK_FALSE(pid_alive(p));
}

TEST_CASE("a group with one worker that runs no resilient loop restarts whole",
          "[agent][resilient]") {
  TempDir d;
  Child trun(job(d, 3, {}, {"not-resilient", "2"}), {}, {"LOGLEVEL", "TORCHELASTIC_ERROR_FILE"});
  const std::vector<pid_t> first = wait_pids(d, 0);
  REQUIRE(::kill(first[1], SIGKILL) == 0);
  const std::vector<pid_t> second = wait_pids(d, 1);
  for (size_t lr = 0; lr < 4; ++lr) {
    CHECK(second[lr] != first[lr]);
    CHECK_FALSE(pid_alive(first[lr]));
  }
  finish(d);
  std::vector<pid_t> all = first;
  all.insert(all.end(), second.begin(), second.end());
  REQUIRE(wait_or_end(trun, all));
  INFO(trun.err());
  CHECK(trun.exit_code() == 0);
  CHECK(events_named(d / "events.jsonl", "trun.agent.worker_replaced").empty());
  CHECK_THAT(trun.err(), Catch::Contains("restarting the worker group (1/3 restarts)"));
  CHECK_THAT(trun.err(), !Catch::Contains("replacing it alone"));
}

TEST_CASE("with no restarts left a failed worker of resilient loops fails the job",
          "[agent][resilient]") {
  TempDir d;
  Child trun(job(d, 0, {}), {}, {"LOGLEVEL", "TORCHELASTIC_ERROR_FILE"});
  const std::vector<pid_t> first = wait_pids(d, 0);
  REQUIRE(::kill(first[1], SIGKILL) == 0);
  REQUIRE(wait_or_end(trun, first));
  INFO(trun.err());
  CHECK(trun.exit_code() == 1);
  CHECK_THAT(trun.err(), Catch::Contains("FAILED"));
  CHECK_THAT(trun.err(), !Catch::Contains("replacing it alone"));
  CHECK(events_named(d / "events.jsonl", "trun.agent.worker_replaced").empty());
  CHECK_FALSE(file_exists(pid_file(d, 1, 1)));
  for (pid_t p : first) CHECK_FALSE(pid_alive(p));
}

TEST_CASE("SIGTERM to trun during or after a replacement stops every worker, the replacement too",
          "[agent][resilient][signal]") {
  TempDir d;
  // During: the survivors never join the new generation, so the group is still re-forming.
  bool during = false;
  SECTION("during the re-formation") { during = true; }
  SECTION("after the re-formation") { during = false; }
  const std::vector<std::string> options =
      during ? std::vector<std::string>{"never-join"} : std::vector<std::string>{};
  Child trun(job(d, 3, {}, options), {}, {"LOGLEVEL", "TORCHELASTIC_ERROR_FILE"});
  const std::vector<pid_t> first = wait_pids(d, 0);
  std::vector<pid_t> all = first;
  REQUIRE(::kill(first[1], SIGKILL) == 0);
  const bool replaced = wait_until(
      [&] {
        return file_exists(pid_file(d, 1, 1)) &&
               (during || !events_named(d / "events.jsonl", "trun.agent.reformed").empty());
      },
      60s);
  if (file_exists(pid_file(d, 1, 1))) all.push_back(read_pid(pid_file(d, 1, 1)));
  if (!replaced) end_all(all);
  REQUIRE(replaced);
  trun.signal(SIGTERM);
  REQUIRE(wait_or_end(trun, all));
  INFO(trun.err());
  CHECK(trun.exit_code() == 128 + SIGTERM);
  CHECK_THAT(trun.err(), Catch::Contains("received SIGTERM"));
  CHECK_THAT(trun.err(), !Catch::Contains("did not re-form"));
  for (pid_t p : all) CHECK_FALSE(pid_alive(p));
  // Every worker was reaped by trun (the killed one, then the four it stopped), none restarted.
  CHECK(events_named(d / "events.jsonl", "trun.agent.worker_exited").size() == 5);
  CHECK(events_named(d / "events.jsonl", "trun.agent.worker_started").size() == 5);
}

TEST_CASE("a group that does not re-form around its replacement is restarted whole",
          "[agent][resilient]") {
  // The survivors never write the new generation; the re-formation is bounded by join_timeout,
  // at least 10 s.
  TempDir d;
  Child trun(job(d, 3, {"--rdzv-conf", "join_timeout=2"}, {"never-join"}), {},
             {"LOGLEVEL", "TORCHELASTIC_ERROR_FILE"});
  const std::vector<pid_t> first = wait_pids(d, 0);
  std::vector<pid_t> all = first;
  REQUIRE(::kill(first[1], SIGKILL) == 0);
  REQUIRE(wait_until([&] { return file_exists(pid_file(d, 1, 1)); }, 60s));
  all.push_back(read_pid(pid_file(d, 1, 1)));
  // The fallback: the whole group again, as restart 2.
  const std::vector<pid_t> third = wait_pids(d, 2);
  all.insert(all.end(), third.begin(), third.end());
  for (size_t lr = 0; lr < 4; ++lr) CHECK_FALSE(pid_alive(first[lr]));
  finish(d);
  REQUIRE(wait_or_end(trun, all));
  const std::string err = trun.err();
  INFO(err);
  CHECK(trun.exit_code() == 0);
  CHECK_THAT(err, Catch::Contains("replacing it alone"));
  CHECK_THAT(err, Catch::Contains("the group did not re-form at generation 1 within "));
  CHECK_THAT(err, Catch::Contains("(local ranks not there: 0,2,3)"));
  CHECK_THAT(err, Catch::Contains("restarting the worker group (2/3 restarts)"));
  // One failure, counted once by the crash-loop guard.
  CHECK_THAT(err, !Catch::Contains("times in a row"));
  const std::string events = d / "events.jsonl";
  CHECK(events_named(events, "trun.agent.reformed").empty());
  CHECK(events_named(events, "trun.agent.reform_timeout").size() == 1);
  const auto stop = events_named(events, "trun.agent.stop");
  REQUIRE(stop.size() == 1);
  CHECK(stop[0]["metadata"]["agent_restarts"] == 2);
  for (pid_t p : all) CHECK_FALSE(pid_alive(p));
}
