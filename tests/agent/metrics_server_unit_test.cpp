// The endpoint's answers from a snapshot, as pure functions of (snapshot, now): /healthz's
// decisions and the histogram's cumulative buckets. The sockets are in metrics_test.cpp.
#include "agent/metrics_server.h"

#include <catch2/catch.hpp>

using trun::agent::AgentSnapshot;
using trun::agent::MetricsServer;
using namespace std::chrono_literals;

namespace {

const AgentSnapshot::TimePoint t0 = AgentSnapshot::TimePoint() + 1000h;

AgentSnapshot running() {
  AgentSnapshot s;
  s.phase = "running";
  s.phase_since = t0;
  s.heartbeat = t0;
  s.round = 2;
  s.restarts = 1;
  s.max_restarts = 3;
  return s;
}

}  // namespace

TEST_CASE("healthz is 200 while the event loop publishes and 503 once it stops", "[metrics]") {
  AgentSnapshot s = running();
  auto ok = MetricsServer::healthz(s, t0 + 2s);
  CHECK(ok.status == 200);
  CHECK(ok.body == "ok: running for 2 s, round 2, restarts 1/3\n");
  auto stale = MetricsServer::healthz(s, t0 + MetricsServer::kStaleAfter + 1s);
  CHECK(stale.status == 503);
  CHECK(stale.body == "unhealthy: the agent's event loop has not answered for 11 s\n");
  s.phase = "stopping";
  CHECK(MetricsServer::healthz(s, t0 + 20s).status == 503);
}

TEST_CASE("healthz is 200 during a rendezvous and 503 after a final failure", "[metrics]") {
  AgentSnapshot s = running();
  s.phase = "rendezvous";  // the loop is blocked in the rendezvous, which bounds itself
  auto r = MetricsServer::healthz(s, t0 + 60s);
  CHECK(r.status == 200);
  CHECK(r.body == "ok: rendezvous in progress for 60 s\n");
  s.phase = "failed";
  s.last_failure = "rank 1 exited with 3";
  auto f = MetricsServer::healthz(s, t0);
  CHECK(f.status == 503);
  CHECK(f.body ==
        "unhealthy: the worker group failed and no restarts are left: rank 1 exited with 3\n");
}

TEST_CASE("the round duration histogram's buckets are cumulative", "[metrics]") {
  AgentSnapshot s = running();
  s.round_seconds_buckets = {1, 10};
  s.round_seconds_counts = {2, 0, 1};  // two rounds under 1 s, one over 10 s
  s.round_seconds_sum = 31.5;
  const std::string m = MetricsServer::metrics(s, t0).body;
  CHECK_THAT(m, Catch::Contains("trun_rendezvous_round_duration_seconds_bucket{le=\"1\"} 2\n"
                                "trun_rendezvous_round_duration_seconds_bucket{le=\"10\"} 2\n"
                                "trun_rendezvous_round_duration_seconds_bucket{le=\"+Inf\"} 3\n"
                                "trun_rendezvous_round_duration_seconds_sum 31.5\n"
                                "trun_rendezvous_round_duration_seconds_count 3\n"));
  CHECK_THAT(m, Catch::Contains("trun_restarts_left 2\n"));
  CHECK_THAT(m, !Catch::Contains("trun_seconds_since_last_round"));  // no round yet
}
