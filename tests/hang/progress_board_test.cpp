// The progress board end to end: ProgressMonitor (agent/progress_monitor.h) creates and reads it,
// libtrun_worker's side (worker_sdk/src/progress/) writes it, in one process (with a writer
// thread: TSan), against scribbled records, and with real worker processes (tests/hang/
// progress_worker.cpp), one of them stopped with SIGSTOP. Every process is ended by its pid and
// no segment is left in /dev/shm.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "agent/hang_rules.h"
#include "agent/hang_watch.h"
#include "agent/progress_monitor.h"
#include "base/shm_names.h"
#include "tests/launcher/free_port.h"
#include "trun/progress.h"
#include "worker_sdk/src/progress/progress.h"

using namespace trun::agent;
namespace board = trun::base::progress;
namespace wp = trun::worker::detail::progress;

namespace {

bool shm_exists(const std::string& shm_name) {
  return ::access(("/dev/shm" + shm_name).c_str(), F_OK) == 0;
}

int64_t mono_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::string board_name(const std::string& what) {
  return trun::base::shm_progress_name("test-" + what, ::getpid());
}

}  // namespace

TEST_CASE("progress board: created, written by the worker side, read, and unlinked", "[progress]") {
  std::string shm_name;
  {
    auto m = ProgressMonitor::create(board_name("basic"), 2);
    shm_name = m->shm_name();
    CHECK(shm_name.rfind("/trun-progress-", 0) == 0);
    CHECK(shm_exists(shm_name));
    CHECK_FALSE(m->snapshot(0).attached);

    wp::attach_record_for_testing(m->record_for_testing(1), 5, 1);
    wp::init_begin();
    hang::RankProgress r = m->snapshot(1);
    CHECK(r.attached);
    CHECK(r.pid == ::getpid());
    CHECK(r.rank == 5);
    CHECK(r.phase == board::Phase::kInit);
    CHECK(r.starting);
    auto g = wp::GroupProgress::make("run-r0-pg3", 1, 4);
    REQUIRE(g);
    wp::init_end();
    CHECK(m->snapshot(1).starting);  // no progress since init() returned
    const uint64_t s1 = g->issue(board::Op::kAllreduce, 1, 1024);
    g->start(s1);
    g->finish(s1, true);
    const uint64_t s2 = g->issue(board::Op::kBroadcast, 7, 3);
    g->start(s2);
    wp::step();
    {
      trun::worker::Section eval("eval");
      r = m->snapshot(1);
      CHECK(r.phase == board::Phase::kSection);
      CHECK(r.section == "eval");
      CHECK(hang::class_of(r) == (hang::TimeoutClass{hang::TimeoutClass::kSection, "eval"}));
    }
    r = m->snapshot(1);
    CHECK_FALSE(r.starting);
    CHECK(r.phase == board::Phase::kRunning);
    CHECK(r.steps == 1);
    REQUIRE(r.groups.size() == 1);
    const hang::GroupProgress& gp = r.groups[0];
    CHECK(gp.number == 3);
    CHECK(gp.group_rank == 1);
    CHECK(gp.group_size == 4);
    CHECK(gp.issued == 2);
    CHECK(gp.completed == 1);
    REQUIRE(gp.recent.size() == 2);
    CHECK(gp.recent[0].op == board::Op::kAllreduce);
    CHECK(gp.recent[0].state == board::State::kCompleted);
    CHECK(gp.recent[0].count == 1024);
    CHECK(gp.recent[0].finished_ns >= gp.recent[0].started_ns);
    CHECK(gp.recent[1].op == board::Op::kBroadcast);
    CHECK(std::string(board::dtype_name(gp.recent[1].dtype)) == "int8");
    CHECK(gp.recent[1].state == board::State::kStarted);
    CHECK(r.waiting_group() == &gp);
    {
      trun::worker::Section outer("a");
      trun::worker::Section inner("b");
      CHECK(m->snapshot(1).section == "b");
    }
    wp::attach_record_for_testing(nullptr, 0, 0);
    trun::worker::heartbeat();  // detached: nothing, and no crash
    m->reset();
    CHECK_FALSE(m->snapshot(1).attached);
  }
  CHECK_FALSE(shm_exists(shm_name));
}

TEST_CASE("progress board: a child the worker forks reports nothing", "[progress]") {
  auto m = ProgressMonitor::create(board_name("fork"), 1);
  wp::attach_record_for_testing(m->record_for_testing(0), 0, 0);
  const uint64_t before = m->snapshot(0).heartbeat;
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    for (int i = 0; i < 100; ++i) trun::worker::heartbeat();
    ::_exit(trun::worker::progress_reported() ? 1 : 0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(m->snapshot(0).heartbeat == before);
  CHECK(trun::worker::progress_reported());
  wp::attach_record_for_testing(nullptr, 0, 0);
}

TEST_CASE("progress board: the ring keeps the last 16 collectives of each group", "[progress]") {
  auto m = ProgressMonitor::create(board_name("ring"), 1);
  wp::attach_record_for_testing(m->record_for_testing(0), 0, 0);
  auto g = wp::GroupProgress::make("t-r0-pg0", 0, 1);
  for (int i = 0; i < 40; ++i) {
    const uint64_t s = g->issue(board::Op::kAllreduce, 1, static_cast<uint64_t>(i + 1));
    g->start(s);
    g->finish(s, i != 39);
  }
  hang::RankProgress r = m->snapshot(0);
  REQUIRE(r.groups.size() == 1);
  REQUIRE(r.groups[0].recent.size() == 16);
  CHECK(r.groups[0].recent.front().seq == 25);
  CHECK(r.groups[0].recent.back().seq == 40);
  CHECK(r.groups[0].recent.back().state == board::State::kFailed);
  CHECK(r.groups[0].find(24) == nullptr);
  wp::attach_record_for_testing(nullptr, 0, 0);
}

TEST_CASE("progress board: a snapshot of a record being written is never torn", "[progress]") {
  auto m = ProgressMonitor::create(board_name("race"), 1);
  wp::attach_record_for_testing(m->record_for_testing(0), 0, 0);
  auto g = wp::GroupProgress::make("t-r0-pg0", 0, 1);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    // Every entry's count is its seq: a torn entry would show another.
    for (uint64_t i = 0; !stop.load() && i < 2000000; ++i) {
      const uint64_t s = g->issue(board::Op::kAllreduce, 1, i + 1);
      g->start(s);
      g->finish(s, true);
      if (i % 7 == 0) trun::worker::heartbeat();
    }
  });
  int consistent = 0;
  for (int i = 0; i < 3000; ++i) {
    hang::RankProgress r = m->snapshot(0);
    REQUIRE(r.groups.size() == 1);
    const auto& gp = r.groups[0];
    REQUIRE(gp.completed <= gp.issued);
    for (const auto& c : gp.recent) {
      REQUIRE(c.count == c.seq);
      REQUIRE(c.seq <= gp.issued);
      REQUIRE(c.seq + 16 > gp.issued);
    }
    if (!r.moving) ++consistent;
  }
  stop = true;
  writer.join();
  hang::RankProgress r = m->snapshot(0);
  CHECK_FALSE(r.moving);
  CHECK(r.groups[0].issued == r.groups[0].completed);
  WARN("snapshots not marked moving: " << consistent << " of 3000");
  wp::attach_record_for_testing(nullptr, 0, 0);
}

TEST_CASE("progress board: a scribbled record cannot harm the reader", "[progress]") {
  auto m = ProgressMonitor::create(board_name("hostile"), 1);
  board::RankRecord* rec = m->record_for_testing(0);
  std::memset(static_cast<void*>(rec), 0xff, sizeof(*rec));
  rec->pid.store(1);
  rec->phase.store(static_cast<uint32_t>(board::Phase::kSection));
  rec->section.store(3);
  rec->num_sections.store(5);
  hang::RankProgress r = m->snapshot(0);
  CHECK(r.groups.size() == board::kMaxGroups);
  CHECK(r.section.size() == board::kNameMax - 1);  // unterminated: cut
  for (const auto& g : r.groups) {
    CHECK(g.completed <= g.issued);
    for (const auto& c : g.recent) CHECK(c.op == board::Op::kNone);
  }
  rec->phase.store(12345);
  CHECK(m->snapshot(0).phase == board::Phase::kNone);
  CHECK_THROWS_AS(m->snapshot(1), std::out_of_range);
  CHECK_THROWS_AS(ProgressMonitor::create(board_name("x"), 0), std::invalid_argument);
  CHECK_THROWS_AS(ProgressMonitor::create("a/b", 1), std::invalid_argument);
}

TEST_CASE("progress board: the generation, and what each record says of its resilient loop",
          "[progress][resilient]") {
  auto m = ProgressMonitor::create(board_name("resilient"), 2);
  CHECK(m->generation() == 0);
  m->set_generation(3);
  CHECK(m->generation() == 3);
  CHECK(m->member(0).pid == 0);
  CHECK_FALSE(m->member(0).resilient);
  // The worker side: the SDK's declare_resilient and joined_generation.
  wp::attach_record_for_testing(m->record_for_testing(1), 1, 1);
  CHECK_FALSE(m->member(1).resilient);
  wp::declare_resilient();
  wp::joined_generation(3);
  wp::step();
  ProgressMonitor::Member mb = m->member(1);
  CHECK(mb.pid == ::getpid());
  CHECK(mb.resilient);
  CHECK(mb.generation == 3);
  CHECK(mb.steps == 1);
  wp::attach_record_for_testing(nullptr, 0, 0);
  // One record cleared alone (a failed worker's, before its replacement), the other kept.
  board::RankRecord* rec0 = m->record_for_testing(0);
  rec0->pid.store(4242);
  rec0->resilient.store(1);
  m->reset_slot(1);
  CHECK(m->member(1).pid == 0);
  CHECK_FALSE(m->member(1).resilient);
  CHECK(m->member(0).pid == 4242);
  // Untrusted: only 1 is resilient, a negative pid is nobody.
  rec0->resilient.store(7);
  rec0->pid.store(-5);
  CHECK_FALSE(m->member(0).resilient);
  CHECK(m->member(0).pid == 0);
  CHECK_THROWS_AS(m->member(2), std::out_of_range);
  CHECK_THROWS_AS(m->reset_slot(-1), std::out_of_range);
}

TEST_CASE("hang watch: no judging while a group re-forms around a replaced worker",
          "[progress][resilient]") {
  HangWatchOptions o;
  o.poll = std::chrono::milliseconds(5);
  auto monitor = ProgressMonitor::create(board_name("reform"), 2);
  board::RankRecord* failed = monitor->record_for_testing(1);  // mapped while the watch lives
  HangWatch watch(std::move(monitor), o);
  auto polled = [&](uint64_t n) {
    for (int i = 0; i < 20000 && watch.polls() < n; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return watch.polls() >= n;
  };
  watch.begin_group();
  watch.set_generation(1);
  failed->pid.store(4242);  // what the failed worker left
  failed->resilient.store(1);
  REQUIRE(polled(watch.polls() + 2));
  watch.begin_reformation({1});
  CHECK(watch.member(1).pid == 0);
  CHECK_FALSE(watch.member(1).resilient);
  const uint64_t paused = watch.polls();  // a poll under way finished before it returned
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(watch.polls() == paused);
  CHECK_FALSE(watch.take_verdict());
  watch.end_reformation();
  CHECK(polled(paused + 2));
  watch.end_group();
}

TEST_CASE("progress board: boards of agents that are gone are removed, others kept", "[progress]") {
  // A pid that is no process: a child that exited and was reaped.
  pid_t dead = ::fork();
  REQUIRE(dead >= 0);
  if (dead == 0) ::_exit(0);
  REQUIRE(::waitpid(dead, nullptr, 0) == dead);
  const std::string stale = trun::base::shm_progress_name("test-stale", dead);
  const std::string live = trun::base::shm_progress_name("test-live", ::getpid());
  for (const std::string& n : {stale, live}) {
    const int fd = ::shm_open(("/" + n).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    ::close(fd);
  }
  CHECK(ProgressMonitor::remove_stale_boards() >= 1);
  CHECK_FALSE(std::filesystem::exists("/dev/shm/" + stale));
  CHECK(std::filesystem::exists("/dev/shm/" + live));
  ::shm_unlink(("/" + live).c_str());
  ::shm_unlink(("/" + stale).c_str());  // in case the check failed
}

TEST_CASE("progress board: process_state reads /proc", "[progress]") {
  CHECK(ProgressMonitor::process_state(::getpid()) == hang::ProcessState::kRunning);
  CHECK(ProgressMonitor::process_state(0) == hang::ProcessState::kUnknown);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    for (;;) ::pause();
  }
  ::kill(child, SIGSTOP);
  hang::ProcessState s = hang::ProcessState::kUnknown;
  for (int i = 0; i < 500 && s != hang::ProcessState::kStopped; ++i) {
    s = ProgressMonitor::process_state(child);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(s == hang::ProcessState::kStopped);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  CHECK(ProgressMonitor::process_state(child) == hang::ProcessState::kGone);
}

namespace {

// Two progress_worker ranks on this node, reporting to `m`'s board, as trun would start them.
struct Ranks {
  std::vector<pid_t> pids;

  Ranks(const ProgressMonitor& m, const char* mode) {
    const std::string port = std::to_string(trun::testing::free_port());
    std::string program = std::string(TRUN_BINARY_DIR) + "/tests/hang/progress_worker";
    for (int r = 0; r < 2; ++r) {
      std::vector<std::string> env = {"PATH=/usr/bin:/bin",
                                      "RANK=" + std::to_string(r),
                                      "LOCAL_RANK=" + std::to_string(r),
                                      "WORLD_SIZE=2",
                                      "LOCAL_WORLD_SIZE=2",
                                      "GROUP_RANK=0",
                                      "GROUP_WORLD_SIZE=1",
                                      "MASTER_ADDR=127.0.0.1",
                                      "MASTER_PORT=" + port,
                                      "TORCHELASTIC_RUN_ID=hangtest",
                                      std::string(board::kEnvVar) + "=" + m.shm_name()};
      for (const char* keep : {"ASAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS", "LD_LIBRARY_PATH"})
        if (const char* v = std::getenv(keep)) env.push_back(std::string(keep) + "=" + v);
      std::vector<char*> envp;
      for (auto& e : env) envp.push_back(e.data());
      envp.push_back(nullptr);
      std::string arg = mode;
      char* argv[] = {program.data(), arg.data(), nullptr};
      pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        ::execve(argv[0], argv, envp.data());
        ::_exit(127);
      }
      pids.push_back(pid);
    }
  }
  ~Ranks() {
    for (pid_t p : pids) {
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
  }
};

// Polls the board every 100 ms (feeding `rule`) until `done` says so, for at most `limit`.
template <typename Done>
bool poll(const ProgressMonitor& m, hang::TimeoutRule& rule, std::chrono::seconds limit,
          Done done) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    auto snaps = m.snapshot_all("n0");
    rule.update(snaps);
    if (done(snaps)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

bool both_running(const std::vector<hang::RankProgress>& s, uint64_t collectives) {
  for (const auto& r : s)
    if (!r.attached || r.starting || r.groups.empty() || r.groups[0].completed < collectives)
      return false;
  return true;
}

}  // namespace

TEST_CASE("progress board: a SIGSTOPped worker is named, with the collective the other waits in",
          "[progress]") {
  std::string shm_name;
  {
    auto m = ProgressMonitor::create(board_name("stop"), 2);
    shm_name = m->shm_name();
    hang::TimeoutOptions o;
    o.step = hang::ClassPolicy{1, 3, 3, 1800, 0, true};  // 1 s floor: a short test
    hang::TimeoutRule rule(o);
    Ranks ranks(*m, "loop");
    REQUIRE(poll(*m, rule, std::chrono::seconds(120),
                 [](const auto& s) { return both_running(s, 20); }));
    REQUIRE(::kill(ranks.pids[1], SIGSTOP) == 0);
    const int64_t stopped_at = mono_ns();
    hang::Verdict v;
    const bool hung = poll(*m, rule, std::chrono::seconds(120), [&](const auto& s) {
      v = hang::judge(s, rule, mono_ns());
      return v.hung;
    });
    INFO(v.summary);
    REQUIRE(hung);
    // For the record (not asserted): the step class's timeout is max(1 s, 3 x the longest sampled
    // interval), the board is polled every 100 ms.
    WARN("hang found " << static_cast<double>(mono_ns() - stopped_at) / 1e9
                       << " s after SIGSTOP (step timeout " << *rule.timeout_s(hang::TimeoutClass{})
                       << " s): " << v.summary);
    CHECK((v.kind == hang::Verdict::kNeverIssued || v.kind == hang::Verdict::kStopped));
    CHECK(v.culprits == std::vector<int>{1});
    CHECK(v.group == 0);
    CHECK(v.summary.rfind("rank 1 (node n0, pid " + std::to_string(ranks.pids[1]) + ")", 0) == 0);
    CHECK(v.summary.find("allreduce #" + std::to_string(v.seq) + " of group 0") !=
          std::string::npos);
    CHECK(v.summary.find("stopped (SIGSTOP or a debugger)") != std::string::npos);
    CHECK(v.summary.find("rank 0 waits in") != std::string::npos);
    // The snapshot has the collective rank 0 waits in.
    auto snaps = m->snapshot_all("n0");
    REQUIRE(snaps[0].waiting_group());
    const auto* c = snaps[0].waiting_group()->find(snaps[0].waiting_group()->completed + 1);
    REQUIRE(c);
    CHECK(c->op == board::Op::kAllreduce);
    CHECK(c->count == 16);
    CHECK(snaps[1].process == hang::ProcessState::kStopped);
    ::kill(ranks.pids[1], SIGCONT);
  }
  CHECK_FALSE(shm_exists(shm_name));
}

TEST_CASE("progress board: a worker in a Section is timed by the section, not the step",
          "[progress]") {
  auto m = ProgressMonitor::create(board_name("section"), 2);
  hang::TimeoutOptions o;
  o.step = hang::ClassPolicy{1, 3, 3, 1800, 0, true};
  o.sections["eval"] = hang::ClassPolicy{0, 0, 0, 0, 4, true};  // fixed 4 s
  hang::TimeoutRule rule(o);
  Ranks ranks(*m, "section");
  // Rank 1 enters "eval" after 20 collectives; rank 0 then waits in #21.
  hang::Verdict v;
  REQUIRE(poll(*m, rule, std::chrono::seconds(120), [&](const auto& s) {
    return s[1].attached && s[1].phase == board::Phase::kSection && s[0].waiting_group();
  }));
  // 2 s later: over the step's 1 s, within the section's 4 s: not hung, rank 1 named.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  auto snaps = m->snapshot_all("n0");
  v = hang::judge(snaps, rule, mono_ns());
  INFO(v.summary);
  CHECK(v.kind == hang::Verdict::kNeverIssued);
  CHECK(v.culprits == std::vector<int>{1});
  if (hang::class_of(snaps[1]).section == "eval" &&
      (mono_ns() - snaps[1].last_progress_ns) < 4 * 1000000000LL)
    CHECK_FALSE(v.hung);
  CHECK(v.summary.find("; it is in section \"eval\"") != std::string::npos);
  // Past 4 s in the section it is a hang.
  REQUIRE(poll(*m, rule, std::chrono::seconds(60), [&](const auto& s) {
    v = hang::judge(s, rule, mono_ns());
    return v.hung;
  }));
  CHECK(v.culprits == std::vector<int>{1});
}
