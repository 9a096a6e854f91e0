// --metrics-port, black-box with real sockets on 127.0.0.1: a scrape after a worker crash and a
// restart, /healthz, and clients that send garbage, too much, or too little (each connection is
// closed without an answer, and the agent and its endpoint go on); a port in use at start; the
// goodput account after a worker's SIGKILL.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"

using namespace trun::testing;
using namespace std::chrono_literals;

namespace {

int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  return fd;
}

// Sends what it can of `data` (the server may close early: errors are ignored).
void send_all(int fd, const std::string& data) {
  size_t done = 0;
  for (int i = 0; i < 100000 && done < data.size(); ++i) {
    ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

struct Reply {
  bool closed = false;  // the server closed the connection within the wait
  std::string data;
};

// Reads until the server closes the connection, or `limit` passes.
Reply read_until_closed(int fd, std::chrono::milliseconds limit = 20s) {
  Reply r;
  const auto end = std::chrono::steady_clock::now() + limit;
  char buf[4096];
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {  // EOF, or a reset (the server closed with unread input)
      r.closed = true;
      break;
    }
    r.data.append(buf, static_cast<size_t>(n));
  }
  return r;
}

Reply request(int port, const std::string& text) {
  int fd = connect_to(port);
  send_all(fd, text);
  Reply r = read_until_closed(fd);
  close(fd);
  return r;
}

Reply get(int port, const std::string& path) {
  return request(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
}

std::string body_of(const Reply& r) {
  const size_t at = r.data.find("\r\n\r\n");
  return at == std::string::npos ? "" : r.data.substr(at + 4);
}

// The port trun printed: "trun: metrics on http://0.0.0.0:PORT/metrics and /healthz".
int printed_port(Child& trun) {
  const std::string marker = "trun: metrics on http://0.0.0.0:";
  REQUIRE(wait_until([&] { return trun.err().find(marker) != std::string::npos; }, 20s));
  const std::string err = trun.err();
  return std::stoi(err.substr(err.find(marker) + marker.size()));
}

// Prometheus text format: every family has HELP and TYPE before its samples, every sample is
// `name{labels} value` with a known family.
void check_exposition(const std::string& text) {
  const std::regex sample(
      R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+0-9.eE]+|[-+]Inf)");
  std::set<std::string> helped, typed;
  for (const auto& line : lines_of(text)) {
    INFO(line);
    if (line.rfind("# HELP ", 0) == 0) {
      helped.insert(line.substr(7, line.find(' ', 7) - 7));
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) {
      const std::string name = line.substr(7, line.find(' ', 7) - 7);
      CHECK(helped.count(name) == 1);
      typed.insert(name);
      continue;
    }
    std::smatch m;
    REQUIRE(std::regex_match(line, m, sample));
    std::string family = m[1];
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (!typed.count(family) && family.size() > s.size() &&
          family.compare(family.size() - s.size(), s.size(), s) == 0) {
        family.resize(family.size() - s.size());
      }
    }
    CHECK(typed.count(family) == 1);
  }
}

}  // namespace

TEST_CASE("the metrics endpoint serves the job's state and survives bad clients",
          "[agent][metrics]") {
  TempDir d;
  // Attempt 0: local rank 0 exits 3; attempt 1 runs until stopped.
  Child trun({trun_binary(), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
              "--metrics-port", "0", test_worker(), "pidfile", d.path(), "on-attempt", "0",
              "on-rank", "0", "exit", "3", "sleep", "60"},
             {}, {"TORCHELASTIC_HEALTH_CHECK_PORT", "LOGLEVEL"});
  const int port = printed_port(trun);
  REQUIRE(
      wait_until([&] { return file_exists(d / "pid_1_0") && file_exists(d / "pid_1_1"); }, 30s));
  INFO(trun.err());
  // The snapshot follows the worker start within the loop's next turn: wait for it, bounded.
  std::string metrics;
  REQUIRE(wait_until(
      [&] {
        metrics = body_of(get(port, "/metrics"));
        return metrics.find("trun_agent_phase{phase=\"running\"} 1") != std::string::npos;
      },
      20s));
  INFO(metrics);
  check_exposition(metrics);
  CHECK_THAT(metrics, Catch::Contains("trun_restarts_total 1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_restarts_left 0\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_worker_exits_total{exit_code=\"3\"} 1\n"));
  // Local rank 1 of attempt 0 did not fail: trun stopped it (SIGTERM) after rank 0's exit.
  CHECK_THAT(metrics, Catch::Contains(
                          "trun_worker_exits_total{signal=\"SIGTERM\",stopped_by=\"trun\"} 1\n"));
  CHECK_THAT(metrics, !Catch::Contains("trun_worker_exits_total{signal=\"SIGTERM\"}"));
  CHECK_THAT(metrics, Catch::Contains("trun_worker_state{local_rank=\"0\",state=\"running\"} 1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_worker_state{local_rank=\"1\",state=\"running\"} 1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_rendezvous_rounds_total 1\n"));
  CHECK_THAT(metrics,
             Catch::Contains("trun_rendezvous_round_duration_seconds_bucket{le=\"+Inf\"} 1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_group_world_size 1\n"));
  // The same version, commit and features as `trun --version` (tests/launcher/version_test.cpp).
  const std::regex build_info(
      "trun_build_info[{]version=\"[0-9]+[.][0-9]+[.][0-9]+\","
      "commit=\"([0-9a-f]{12}(-modified)?|unknown)\",nccl=\"(yes|no)\",libtorch=\"(yes|no)\"[}] 1");
  CHECK(std::regex_search(metrics, build_info));
  CHECK_THAT(metrics, Catch::Contains("trun_seconds_since_last_round "));

  const Reply health = get(port, "/healthz");
  CHECK_THAT(health.data, Catch::StartsWith("HTTP/1.1 200 OK\r\n"));
  CHECK_THAT(body_of(health), Catch::StartsWith("ok: running for "));
  CHECK_THAT(get(port, "/nothing").data, Catch::StartsWith("HTTP/1.1 404 "));
  CHECK_THAT(request(port, "POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n").data,
             Catch::StartsWith("HTTP/1.1 405 "));

  // Garbage: closed, no answer.
  const Reply garbage = request(port, "\x16\x03\x01 this is not HTTP\r\n\r\n");
  CHECK(garbage.closed);
  CHECK(garbage.data.empty());
  // A header far over the limit: closed, no answer.
  const Reply big =
      request(port, "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(200000, 'a') + "\r\n\r\n");
  CHECK(big.closed);
  CHECK(big.data.find("200 OK") == std::string::npos);
  // A client that stops mid-request holds only its own connection: others are served meanwhile,
  // and the server closes the slow one (after its request timeout).
  const int slow = connect_to(port);
  send_all(slow, "GET /metr");
  CHECK_THAT(get(port, "/healthz").data, Catch::StartsWith("HTTP/1.1 200 OK\r\n"));
  const Reply slow_reply = read_until_closed(slow, 30s);
  close(slow);
  CHECK(slow_reply.closed);
  CHECK(slow_reply.data.empty());

  // The agent and its workers are unaffected.
  CHECK(trun.running());
  CHECK_THAT(body_of(get(port, "/metrics")), Catch::Contains("trun_restarts_total 1\n"));
  trun.signal(SIGTERM);
  REQUIRE(trun.wait(30s));
  CHECK(trun.exit_code() == 128 + SIGTERM);
}

TEST_CASE("a metrics port in use stops trun at start with one clear line", "[agent][metrics]") {
  // A listener on 127.0.0.1:P: the endpoint's 0.0.0.0:P cannot bind.
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(listen(fd, 1) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  TempDir d;
  // torchrun's variable, as the option is not given.
  auto r = run_trun({"--standalone", "--nproc-per-node", "1", test_worker(), "pidfile", d.path()},
                    {{"TORCHELASTIC_HEALTH_CHECK_PORT", port}});
  close(fd);
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.err, Catch::Contains("trun: error: cannot serve metrics on port " + port +
                                    ": Address already in use"));
  CHECK_FALSE(file_exists(d / "pid_0_0"));

  auto bad = run_trun({"--standalone", "--metrics-port", "70000", test_worker()});
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.err, Catch::Contains("--metrics-port=70000: expected a port number 0..65535"));
}

TEST_CASE("/healthz answers 200 while the agent waits in a rendezvous", "[agent][metrics]") {
  // One node of two: it waits for the other (the loop is blocked in the rendezvous meanwhile).
  Child trun({trun_binary(), "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-id=metrics-wait",
              "--rdzv-endpoint=127.0.0.1:" + std::to_string(free_port()), "--rdzv-conf",
              "join_timeout=60,progress_interval=0", "--metrics-port", "0", test_worker()},
             {}, {"TORCHELASTIC_HEALTH_CHECK_PORT"});
  const int port = printed_port(trun);
  const Reply health = get(port, "/healthz");
  INFO(health.data);
  CHECK_THAT(health.data, Catch::StartsWith("HTTP/1.1 200 OK\r\n"));
  const std::string body = body_of(health);
  const std::string prefix = "ok: rendezvous in progress for ";
  REQUIRE_THAT(body, Catch::StartsWith(prefix));
  // Counted from the start of this rendezvous, which ends itself at join_timeout.
  CHECK(std::stod(body.substr(prefix.size())) < 60);
  const std::string metrics = body_of(get(port, "/metrics"));
  check_exposition(metrics);
  CHECK_THAT(metrics, Catch::Contains("trun_agent_phase{phase=\"rendezvous\"} 1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_rendezvous_round -1\n"));
  CHECK_THAT(metrics, Catch::Contains("trun_rendezvous_rounds_total 0\n"));
  CHECK(trun.running());
  // A stop signal ends the wait (the rendezvous is left), as torchrun exits 128+N.
  trun.signal(SIGTERM);
  REQUIRE(trun.wait(20s));
  CHECK(trun.exit_code() == 128 + SIGTERM);
}

namespace {

// The value of the sample `name` ("name value" on a line of /metrics), or -1 when it is missing.
double metric(int port, const std::string& name) {
  for (const auto& line : lines_of(body_of(get(port, "/metrics")))) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  return -1;
}

std::vector<std::string> c10d_node(const std::string& ep, const std::string& run,
                                   const std::string& nnodes, const std::string& conf,
                                   const std::string& dir, bool metrics) {
  std::vector<std::string> argv{trun_binary(),         "--nnodes=" + nnodes,
                                "--rdzv-backend=c10d", "--rdzv-endpoint=" + ep,
                                "--rdzv-id=" + run,    "--rdzv-conf=" + conf};
  if (metrics) argv.insert(argv.end(), {"--metrics-port", "0"});
  argv.insert(argv.end(), {test_worker(), "pidfile", dir, "sleep", "60"});
  return argv;
}

}  // namespace

TEST_CASE("/metrics shows the nodes waiting for the next round and counts store requests",
          "[agent][metrics]") {
  TempDir d;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "metrics-waiting-" + std::to_string(getpid());
  // a forms a full group of one node and hosts the store.
  Child a(c10d_node(ep, run, "1", "join_timeout=60", d.path(), true), {},
          {"TORCHELASTIC_HEALTH_CHECK_PORT"});
  const int port = printed_port(a);
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0"); }, 30s));
  REQUIRE(wait_until([&] { return metric(port, "trun_rendezvous_nodes_waiting") == 0; }, 20s));
  const std::string first = body_of(get(port, "/metrics"));
  check_exposition(first);
  const double requests = metric(port, "trun_store_requests_total");
  const double served = metric(port, "trun_store_requests_served_total");
  CHECK(requests > 0);
  CHECK(served > 0);
  CHECK(metric(port, "trun_store_errors_total") == 0);
  // b finds the group full and waits for the next round.
  TempDir db;
  Child b(c10d_node(ep, run, "1", "join_timeout=60", db.path(), false));
  REQUIRE(wait_until([&] { return metric(port, "trun_rendezvous_nodes_waiting") == 1; }, 20s));
  CHECK(metric(port, "trun_store_requests_total") > requests);       // the samples themselves
  CHECK(metric(port, "trun_store_requests_served_total") > served);  // b's requests too
  CHECK_FALSE(file_exists(db / "pid_0_0"));
  // b leaves (a stop signal while it waits): nobody waits any more.
  b.signal(SIGTERM);
  REQUIRE(b.wait(20s));
  CHECK(b.exit_code() == 128 + SIGTERM);
  CHECK(wait_until([&] { return metric(port, "trun_rendezvous_nodes_waiting") == 0; }, 20s));
  a.signal(SIGTERM);
  REQUIRE(a.wait(30s));
  CHECK(a.exit_code() == 128 + SIGTERM);
}

TEST_CASE("/metrics counts the store errors when the store host dies, and no counter goes back",
          "[agent][metrics]") {
  TempDir da, dc;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::string run = "metrics-errors-" + std::to_string(getpid());
  const std::string conf = "join_timeout=60,last_call_timeout=0.5";
  Child a(c10d_node(ep, run, "1:2", conf + ",is_host=true", da.path(), false));
  REQUIRE(wait_until([&] { return file_exists(da / "pid_0_0"); }, 30s));
  // c joins a's group as a client of a's store (the port is a's).
  Child c(c10d_node(ep, run, "1:2", conf, dc.path(), true), {}, {"TORCHELASTIC_HEALTH_CHECK_PORT"});
  const int port = printed_port(c);
  REQUIRE(wait_until([&] { return file_exists(dc / "pid_0_0"); }, 30s));
  REQUIRE(wait_until([&] { return metric(port, "trun_rendezvous_rounds_total") == 1; }, 20s));
  CHECK(metric(port, "trun_store_errors_total") == 0);
  CHECK(metric(port, "trun_store_requests_served_total") == -1);  // c hosts nothing
  const double requests = metric(port, "trun_store_requests_total");
  CHECK(requests > 0);
  a.signal(SIGKILL);
  REQUIRE(a.wait(10s));
  // c loses the store, rejoins hosting one itself, and forms a round alone.
  const bool rejoined =
      wait_until([&] { return metric(port, "trun_rendezvous_rounds_total") == 2; }, 40s);
  INFO(c.err());
  REQUIRE(rejoined);
  CHECK(metric(port, "trun_store_errors_total") >= 1);
  CHECK(metric(port, "trun_store_requests_total") >= requests);
  CHECK(metric(port, "trun_store_requests_served_total") > 0);
  c.signal(SIGTERM);
  REQUIRE(c.wait(30s));
}

TEST_CASE("/metrics moves during the first rendezvous: the nodes joined so far and store requests",
          "[agent][metrics]") {
  // One node of two, hosting the store: its thread waits in the rendezvous the whole time.
  TempDir d;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  Child a(c10d_node(ep, "metrics-first-" + std::to_string(getpid()), "2",
                    "join_timeout=60,progress_interval=0", d.path(), true),
          {}, {"TORCHELASTIC_HEALTH_CHECK_PORT"});
  const int port = printed_port(a);
  // The sampler runs every 2 s; the first samples come while the round still gathers.
  REQUIRE(wait_until([&] { return metric(port, "trun_rendezvous_nodes_waiting") == 1; }, 20s));
  const double requests = metric(port, "trun_store_requests_total");
  const double served = metric(port, "trun_store_requests_served_total");
  CHECK(requests > 0);
  CHECK(served > 0);
  // And it keeps moving: the next samples are published too.
  CHECK(wait_until([&] { return metric(port, "trun_store_requests_total") > requests; }, 20s));
  const std::string body = body_of(get(port, "/metrics"));
  check_exposition(body);
  CHECK_THAT(body, Catch::Contains("trun_agent_phase{phase=\"rendezvous\"} 1\n"));
  CHECK_FALSE(file_exists(d / "pid_0_0"));
  a.signal(SIGTERM);
  REQUIRE(a.wait(30s));
  CHECK(a.exit_code() == 128 + SIGTERM);
}

namespace {

// The value of the sample `name` (with its labels, e.g. `trun_badput_seconds_total{cause="x"}`)
// in a scrape; NaN when absent.
double sample_value(const std::string& metrics, const std::string& name) {
  const size_t at = metrics.find("\n" + name + " ");
  if (at == std::string::npos) return std::nan("");
  return std::stod(metrics.substr(at + name.size() + 2));
}

// The workers among trun's children (those with LOCAL_RANK in their environment), sorted.
std::vector<pid_t> workers_of(pid_t trun) {
  std::vector<pid_t> out;
  for (pid_t p : children_of(trun)) {
    const std::string env = read_file("/proc/" + std::to_string(p) + "/environ");
    if (env.find(std::string("\0LOCAL_RANK=", 12)) != std::string::npos) out.push_back(p);
  }
  return out;
}

const char* const kCauses[] = {"startup",         "detection", "stopping", "rendezvous", "restart",
                               "checkpoint_load", "redone",    "slow",     "other"};

}  // namespace

TEST_CASE("goodput: /metrics, the status record and the event log account for a worker's SIGKILL",
          "[agent][metrics][goodput]") {
  TempDir d;
  // The classic path (the resilient loop's replacement redoes nothing: agent_resilient_test and
  // resilient_test). No periodic checkpoint after step 0: the restarted group resumes from
  // scratch and redoes every step the first one took.
  Child trun({trun_binary(),
              "--standalone",
              "--nproc-per-node",
              "2",
              "--max-restarts",
              "2",
              "--metrics-port",
              "0",
              "--event-log",
              d / "events.jsonl",
              std::string(TRUN_BINARY_DIR) + "/examples/train_mlp",
              "--classic",
              "--ckpt-dir",
              d / "ckpt",
              "--ckpt-every",
              "100000",
              "--epochs",
              "100000",
              "--step-sleep-ms",
              "20"},
             {{"OMP_NUM_THREADS", "1"}}, {"TORCHELASTIC_HEALTH_CHECK_PORT", "LOGLEVEL"});
  const int port = printed_port(trun);
  std::string metrics;
  const auto steps_taken = [&] {
    metrics = body_of(get(port, "/metrics"));
    return sample_value(metrics, "trun_goodput_productive_seconds_total") > 1.0;
  };
  REQUIRE(wait_until(steps_taken, 60s));
  INFO(trun.err());
  std::vector<pid_t> first = workers_of(trun.pid());
  REQUIRE(first.size() == 2);
  REQUIRE(kill(first[1], SIGKILL) == 0);
  // The new group: two other children, and steps again past what was redone.
  REQUIRE(wait_until(
      [&] {
        const auto now = workers_of(trun.pid());
        return now.size() == 2 && now != first &&
               sample_value(body_of(get(port, "/metrics")), "trun_goodput_steps_redone_total") > 0;
      },
      60s));
  std::this_thread::sleep_for(2s);
  metrics = body_of(get(port, "/metrics"));
  INFO(metrics);
  check_exposition(metrics);
  const double wall = sample_value(metrics, "trun_goodput_wall_seconds_total");
  const double productive = sample_value(metrics, "trun_goodput_productive_seconds_total");
  double sum = productive;
  for (const char* c : kCauses) {
    const double v =
        sample_value(metrics, std::string("trun_badput_seconds_total{cause=\"") + c + "\"}");
    INFO(c);
    REQUIRE(v >= 0);
    sum += v;
  }
  CHECK(sum == Approx(wall).epsilon(0.001));
  const double ratio = sample_value(metrics, "trun_goodput_ratio");
  CHECK(ratio == Approx(productive / wall).epsilon(0.01));
  CHECK(ratio > 0.1);
  CHECK(ratio < 1);
  CHECK(sample_value(metrics, "trun_badput_seconds_total{cause=\"stopping\"}") > 0);
  CHECK(sample_value(metrics, "trun_badput_seconds_total{cause=\"restart\"}") > 0);
  CHECK(sample_value(metrics, "trun_badput_seconds_total{cause=\"redone\"}") > 0);
  CHECK(sample_value(metrics, "trun_goodput_step_seconds") >= 0.02);
  trun.signal(SIGTERM);
  REQUIRE(trun.wait(60s));
  // The event log holds the closed intervals, each a real span.
  std::set<std::string> causes;
  for (const auto& line : lines_of(read_file(d / "events.jsonl"))) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || j.value("name", "") != "trun.agent.badput") continue;
    const auto& md = j["metadata"];
    CHECK(md["end_ms"].get<int64_t>() >= md["begin_ms"].get<int64_t>());
    CHECK(md["seconds"].get<double>() >= 0);
    causes.insert(md["cause"].get<std::string>());
  }
  for (const char* c : {"startup", "detection", "stopping", "restart", "redone"}) {
    INFO(c);
    CHECK(causes.count(c) == 1);
  }
  // trun timeline draws them under the node's bar, one strip per interval, with their key.
  const RunResult page = run_trun({"timeline", d / "events.jsonl", "-o", d / "run.html"});
  REQUIRE(page.exit_code == 0);
  const std::string html = read_file(d / "run.html");
  CHECK_THAT(html, Catch::Contains("<g class=\"badput\" data-cause=\"restart\">"));
  CHECK_THAT(html, Catch::Contains("<g class=\"badput\" data-cause=\"stopping\">"));
  CHECK_THAT(html, Catch::Contains("badput under each node's bar:"));
}
