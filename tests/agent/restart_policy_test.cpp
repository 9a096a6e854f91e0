// The agent's restart policy, driven through its seams (agent/elastic_agent.h): a fake process
// spawner whose workers exit as each case scripts them, and a fake clock that moves only when the
// workers "take time". The rendezvous (--standalone: a real store on 127.0.0.1), the event loop
// and the signalfd are real; no worker process exists.
#include <signal.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <map>

#include "agent/decisions.h"
#include "agent/elastic_agent.h"

using namespace trun::agent;
using namespace std::chrono_literals;

namespace {

// Real steady time plus what the fake workers said they took.
class FakeClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now() + offset_; }
  void sleep_for(Duration d) override { offset_ += d; }
  void advance(Duration d) { offset_ += d; }

 private:
  Duration offset_{0};
};

// How one fake worker behaves: exits at once with `exit_code`, or runs until signalled
// (exit_code < 0), ignoring SIGTERM if `ignores_sigterm`.
struct Script {
  int exit_code = 0;
  bool ignores_sigterm = false;
  bool cannot_start = false;
  // When its exit is reaped, this signal is raised at the agent (as when scancel signals trun and
  // its workers together and the worker's exit is seen first); 0: none.
  int signal_agent_on_reap = 0;
};

class FakeSpawner final : public ProcessSpawner {
 public:
  // script(attempt, local_rank): attempt counts spawn() calls from 0.
  FakeSpawner(FakeClock& clock, std::function<Script(int, int)> script)
      : clock_(clock), script_(std::move(script)) {}

  std::vector<SpawnResult> spawn(const std::vector<SpawnRequest>& requests) override {
    std::vector<SpawnResult> out;
    for (size_t i = 0; i < requests.size(); ++i) {
      const Script s = script_(attempts, static_cast<int>(i));
      restart_counts.push_back(env_value(requests[i].env, "TORCHELASTIC_RESTART_COUNT"));
      if (s.cannot_start) {
        out.push_back({-1, ENOENT, "no such program"});
        continue;
      }
      const pid_t pid = next_pid_++;
      workers_[pid] = {s, true};
      out.push_back({pid, 0, ""});
      if (s.exit_code >= 0) exit(pid, s.exit_code << 8);
    }
    ++attempts;
    return out;
  }

  bool signal_group(pid_t pgid, int sig) override {
    auto it = workers_.find(pgid);
    if (it == workers_.end() || !it->second.alive) return false;
    signals.push_back({sig, clock_.now()});
    if (sig == SIGTERM && it->second.script.ignores_sigterm) {
      clock_.advance(std::chrono::hours(2));  // it takes its time; the deadline must notice
      return true;
    }
    exit(pgid, sig);  // dies of the signal
    return true;
  }

  bool group_alive(pid_t pgid) override {
    auto it = workers_.find(pgid);
    return it != workers_.end() && it->second.alive;
  }
  void forget_group(pid_t pgid) override { ++forgotten; }

  std::vector<ExitStatus> reap(const std::function<bool(pid_t)>& is_worker) override {
    std::vector<ExitStatus> out;
    for (const auto& e : exited_) {
      if (is_worker(e.pid)) out.push_back(e);
      // Pending (the agent blocks it) and not yet read: the agent must notice it before it
      // decides what the exit means.
      if (int sig = workers_[e.pid].script.signal_agent_on_reap) raise(sig);
    }
    exited_.clear();
    return out;
  }

  int attempts = 0;
  int forgotten = 0;
  std::vector<std::string> restart_counts;  // TORCHELASTIC_RESTART_COUNT of every spawn
  std::vector<std::pair<int, Clock::TimePoint>> signals;

 private:
  struct Fake {
    Script script;
    bool alive = false;
  };
  static std::string env_value(const std::vector<std::string>& env, const std::string& key) {
    for (const auto& kv : env) {
      if (kv.compare(0, key.size() + 1, key + "=") == 0) return kv.substr(key.size() + 1);
    }
    return "<unset>";
  }
  void exit(pid_t pid, int status) {
    workers_[pid].alive = false;
    exited_.push_back({pid, status});
    raise(SIGCHLD);  // as the kernel does for a real child (process_spawner.h)
  }

  FakeClock& clock_;
  std::function<Script(int, int)> script_;
  pid_t next_pid_ = 4000000;  // above pid_max's default, so never a real process
  std::map<pid_t, Fake> workers_;
  std::vector<ExitStatus> exited_;
};

LaunchConfig config(int nproc, int max_restarts) {
  LaunchConfig c;
  c.standalone = true;
  c.nproc_per_node = nproc;
  c.max_restarts = max_restarts;
  c.entrypoint = {"/nonexistent/fake-worker"};
  c.entrypoint_name = "fake-worker";
  c.signals_to_handle = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  return c;
}

}  // namespace

TEST_CASE("a failing group is restarted until max_restarts, each attempt told its count",
          "[restart_policy]") {
  FakeClock clock;
  // Local rank 1 fails in the first two attempts; the third succeeds.
  FakeSpawner spawner(clock, [](int attempt, int local_rank) {
    Script s;
    s.exit_code = (attempt < 2 && local_rank == 1) ? 3 : 0;
    if (attempt < 2 && local_rank == 0) s.exit_code = -1;  // runs until stopped
    return s;
  });
  const LaunchConfig c = config(2, 3);
  CHECK(ElasticAgent(c, clock, spawner).run() == kExitSuccess);
  CHECK(spawner.attempts == 3);
  CHECK(spawner.restart_counts == std::vector<std::string>{"0", "0", "1", "1", "2", "2"});
  // The healthy worker of each failed attempt was stopped with SIGTERM, nothing harder.
  REQUIRE(spawner.signals.size() == 2);
  for (const auto& s : spawner.signals) CHECK(s.first == SIGTERM);
}

TEST_CASE("with no restarts left the agent fails with exit 1 after max_restarts + 1 attempts",
          "[restart_policy]") {
  FakeClock clock;
  FakeSpawner spawner(clock, [](int, int) { return Script{1}; });
  const LaunchConfig c = config(1, 2);
  CHECK(ElasticAgent(c, clock, spawner).run() == kExitWorkersFailed);
  CHECK(spawner.attempts == 3);
  CHECK(spawner.restart_counts == std::vector<std::string>{"0", "1", "2"});
}

TEST_CASE("a worker exit seen just before the agent's own SIGTERM is part of the shutdown",
          "[restart_policy]") {
  for (int sig : {SIGTERM, SIGUSR1}) {
    INFO("signal " << sig);
    FakeClock clock;
    // The worker exits 1 on its own handler; the agent's signal is pending when it reaps it.
    FakeSpawner spawner(clock, [sig](int, int) {
      Script s;
      s.exit_code = 1;
      s.signal_agent_on_reap = sig;
      return s;
    });
    LaunchConfig c = config(1, 3);
    c.signals_to_handle.push_back(SIGUSR1);
    CHECK(ElasticAgent(c, clock, spawner).run() == kExitSignalBase + sig);
    CHECK(spawner.attempts == 1);  // not restarted
  }
}

TEST_CASE("a program that cannot start counts as a failed attempt", "[restart_policy]") {
  FakeClock clock;
  FakeSpawner spawner(clock, [](int attempt, int) {
    Script s;
    s.cannot_start = attempt == 0;
    return s;
  });
  const LaunchConfig c = config(1, 1);
  CHECK(ElasticAgent(c, clock, spawner).run() == kExitSuccess);
  CHECK(spawner.attempts == 2);
}

TEST_CASE("a worker that ignores SIGTERM gets SIGKILL once the clock passes the shutdown timeout",
          "[restart_policy]") {
  FakeClock clock;
  // Rank 0 fails at once; rank 1 ignores SIGTERM. No restarts.
  FakeSpawner spawner(clock, [](int, int local_rank) {
    Script s;
    s.exit_code = local_rank == 0 ? 7 : -1;
    s.ignores_sigterm = local_rank == 1;
    return s;
  });
  LaunchConfig c = config(2, 0);
  c.shutdown_timeout = std::chrono::hours(1);  // only the fake clock can get there
  const auto real_start = std::chrono::steady_clock::now();
  CHECK(ElasticAgent(c, clock, spawner).run() == kExitWorkersFailed);
  CHECK(std::chrono::steady_clock::now() - real_start < 60s);  // a guard against hanging only
  REQUIRE(spawner.signals.size() >= 2);
  CHECK(spawner.signals.front().first == SIGTERM);
  CHECK(spawner.signals.back().first == SIGKILL);
  // SIGKILL came no sooner than the timeout after SIGTERM, on the agent's clock.
  CHECK(spawner.signals.back().second - spawner.signals.front().second >= std::chrono::hours(1));
}
