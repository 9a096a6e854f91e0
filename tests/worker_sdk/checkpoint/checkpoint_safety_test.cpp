// Checkpoints are never lost or mixed: one job per directory, damage that is never silent and
// never destructive, full and read-only storage, and a writer SIGKILLed at every phase under each
// of those conditions.

#include <catch2/catch.hpp>

#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <trun/checkpoint.h>

#include "tests/skip.h"
#include "tests/worker_sdk/checkpoint/ckpt_content.h"
#include "tests/worker_sdk/checkpoint/ckpt_test_util.h"

using namespace trun::worker;
using namespace trun::test;
namespace fs = std::filesystem;

namespace {

constexpr auto kLong = std::chrono::seconds(60);
const char* const kPhases[] = {"data_written", "manifest_written", "synced",
                               "renamed",      "latest_written",   "done"};

// Entries of `dir` whose names start with `prefix`.
std::vector<std::string> entries(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Loads DIR's newest checkpoint as job `job` and checks that it is complete. Returns its step.
uint64_t check_latest(const std::string& dir, const std::string& job) {
  CheckpointerOptions o;
  o.job_id = job;
  o.adopt = false;  // this job's own newest
  Checkpointer reader(dir, o);
  auto c = reader.load_latest();
  REQUIRE(c.has_value());
  std::string why;
  INFO("checkpoint " << c->path << ": " << why);
  REQUIRE(check_content(*c, &why));
  REQUIRE(c->job_id == job);
  return c->step;
}

// Needs root (mount). A kSetup skip: in strict mode (CI) a missing privilege is a failure.
bool can_mount() {
  if (::geteuid() == 0) return true;
  TRUN_SKIP_REPORT("mounting a tmpfs needs root (run as root to test full and read-only disks)",
                   kSetup);
  return false;
}

// A small tmpfs at DIR/mnt, unmounted at the end.
struct Tmpfs {
  std::string path;
  explicit Tmpfs(const std::string& parent, const std::string& size) : path(parent + "/mnt") {
    fs::create_directories(path);
    const std::string opts = "size=" + size;
    REQUIRE(::mount("tmpfs", path.c_str(), "tmpfs", 0, opts.c_str()) == 0);
  }
  void set_read_only(bool ro) {
    const unsigned long flags = MS_REMOUNT | (ro ? MS_RDONLY : 0);
    REQUIRE(::mount("tmpfs", path.c_str(), "tmpfs", flags, nullptr) == 0);
  }
  ~Tmpfs() { ::umount2(path.c_str(), MNT_DETACH); }
};

uint64_t free_bytes(const std::string& path) {
  struct statvfs v {};
  REQUIRE(::statvfs(path.c_str(), &v) == 0);
  return static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
}

// Fills `path` until only about `leave` bytes are free.
void fill(const std::string& path, uint64_t leave) {
  const uint64_t avail = free_bytes(fs::path(path).parent_path().string());
  REQUIRE(avail > leave);
  std::ofstream f(path, std::ios::binary);
  std::vector<char> block(64 * 1024, 'x');
  uint64_t left = avail - leave;
  for (int i = 0; i < 100000 && left > 0; ++i) {
    const uint64_t n = std::min<uint64_t>(left, block.size());
    f.write(block.data(), static_cast<std::streamsize>(n));
    left -= n;
  }
  f.close();
  REQUIRE(f.good());
}

bool exited_with(int st, int code) { return WIFEXITED(st) && WEXITSTATUS(st) == code; }

}  // namespace

TEST_CASE("checkpoint: a second job on a directory is refused with the owner named",
          "[checkpoint][ownership]") {
  TempDir d;
  const std::string dir = d.path + "/ck";
  const Env job_a = {{"TRUN_JOB_ID", "job-a"}};
  int st = 0;
  run_writer(dir, 2, "", kLong, &st, job_a);
  REQUIRE(exited_with(st, 0));

  // Job A runs again and stops inside its next save, holding the lock.
  Env holding = job_a;
  holding.emplace_back("CKPT_HOLD_PHASE", "data_written");
  WriterProcess a(dir, 5, "", holding);
  REQUIRE(a.wait_for_output("holding", kLong));
  const auto steps_before = entries(dir, "step_");

  // Job B: refused at once, naming job, host and pid of the owner.
  std::string out = run_writer(dir, 1, "", kLong, &st, {{"TRUN_JOB_ID", "job-b"}});
  INFO(out);
  REQUIRE(exited_with(st, 3));
  REQUIRE_THAT(out, Catch::Contains("belongs to another job: job 'job-a'") &&
                        Catch::Contains("pid " + std::to_string(a.pid)) &&
                        Catch::Contains("host "));
  // Another process of job A waits for the lock (bounded), then says who holds it.
  out =
      run_writer(dir, 1, "", kLong, &st, {{"TRUN_JOB_ID", "job-a"}, {"CKPT_LOCK_WAIT_MS", "300"}});
  REQUIRE(exited_with(st, 3));
  REQUIRE_THAT(out, Catch::Contains("is still locked by job 'job-a'"));
  // The owner's temporary directory was not touched by anyone.
  REQUIRE(entries(dir, ".tmp-").size() == 1);

  // The owner dies: the kernel drops its lock. A job B that must not continue another job's
  // state (adopt off) is refused, naming job A.
  REQUIRE(WIFSIGNALED(a.wait(std::chrono::microseconds(0))));
  out = run_writer(dir, 1, "", kLong, &st, {{"TRUN_JOB_ID", "job-b"}, {"CKPT_ADOPT", "0"}});
  INFO(out);
  REQUIRE(exited_with(st, 3));
  REQUIRE_THAT(out, Catch::Contains("holds checkpoints of another job ('job-a'"));
  REQUIRE(entries(dir, "step_") == steps_before);

  // The same job takes over: the dead owner's partial files go, training continues.
  out = run_writer(dir, 1, "", kLong, &st, job_a);
  INFO(out);
  REQUIRE(exited_with(st, 0));
  REQUIRE_THAT(out, Catch::Contains("resumed 2"));
  REQUIRE(entries(dir, ".tmp-").empty());
  REQUIRE(check_latest(dir, "job-a") == 3);

  // In one process, two Checkpointers on one directory share the lock.
  CheckpointerOptions o;
  o.job_id = "job-a";
  Checkpointer one(dir, o), two(dir, o);
  REQUIRE(one.load_latest()->step == 3);
}

TEST_CASE("checkpoint: damage is never silent and never destructive", "[checkpoint][damage]") {
  TempDir d;
  const std::string dir = d.path + "/ck";
  CheckpointerOptions o;
  o.job_id = "j";
  o.keep_last = 3;
  ContentBuffers buf;
  {
    Checkpointer ck(dir, o);
    for (uint64_t s : {1, 2, 3}) ck.save(make_request(s, buf));
  }

  SECTION("the newest is damaged: an older one loads, the damaged one is kept aside") {
    flip_byte(dir + "/step_3/data", 4096);
    Checkpointer ck(dir, o);
    auto c = ck.load_latest();
    REQUIRE(c.has_value());
    REQUIRE(c->step == 2);
    const auto damaged = entries(dir, "step_3.damaged-");
    REQUIRE(damaged.size() == 1);
    REQUIRE_THAT(read_file(dir + "/" + damaged[0] + "/REASON"), Catch::Contains("CRC32C mismatch"));
    REQUIRE(read_file(dir + "/latest") == "step_2\n");
    // Saving steps 3..6 (keep 3, so retention runs) never removes the quarantined copy.
    for (uint64_t s : {3, 4, 5, 6}) ck.save(make_request(s, buf));
    REQUIRE(ck.list_steps() == std::vector<uint64_t>{4, 5, 6});
    REQUIRE(entries(dir, "step_3.damaged-") == damaged);
  }
  SECTION("none is readable: refuse, listing each and why; nothing is removed") {
    flip_byte(dir + "/step_1/data", 100);
    REQUIRE(::truncate((dir + "/step_2/data").c_str(), 10) == 0);
    fs::remove(dir + "/step_3/manifest.json");
    Checkpointer ck(dir, o);
    REQUIRE_THROWS_WITH(ck.load_latest(),
                        Catch::Contains("holds 3 checkpoint(s) and none is readable") &&
                            Catch::Contains("step_1: ") && Catch::Contains("CRC32C mismatch") &&
                            Catch::Contains("step_2: ") && Catch::Contains("the manifest says") &&
                            Catch::Contains("step_3: ") &&
                            Catch::Contains("cannot open manifest.json"));
    REQUIRE(ck.list_steps() == std::vector<uint64_t>{1, 2, 3});
    REQUIRE_THROWS_AS(ck.load_latest(), CheckpointError);  // the same again: nothing changed

    // Asking for a fresh start quarantines them all and starts from nothing.
    CheckpointerOptions fresh = o;
    fresh.start_fresh_if_damaged = true;
    Checkpointer ck2(dir, fresh);
    REQUIRE_FALSE(ck2.load_latest().has_value());
    REQUIRE(entries(dir, "step_1.damaged-").size() == 1);
    REQUIRE(entries(dir, "step_2.damaged-").size() == 1);
    REQUIRE(entries(dir, "step_3.damaged-").size() == 1);
    REQUIRE_FALSE(fs::exists(dir + "/latest"));
    ck2.save(make_request(1, buf));
    REQUIRE(ck2.load_latest()->step == 1);
    REQUIRE(entries(dir, "step_1.damaged-").size() == 1);
  }
}

TEST_CASE("checkpoint: with adopt off another job's checkpoints are refused, never replaced",
          "[checkpoint][ownership]") {
  TempDir d;
  const std::string dir = d.path + "/ck";
  ContentBuffers buf;
  CheckpointerOptions a;
  a.job_id = "a";
  a.adopt = false;
  { Checkpointer(dir, a).save(make_request(7, buf)); }
  CheckpointerOptions b;
  b.job_id = "b";
  b.adopt = false;
  {
    Checkpointer ck(dir, b);
    REQUIRE_THROWS_AS(ck.load_latest(), CheckpointOwnerError);
    // Saving the same step number would replace job a's: refused.
    REQUIRE_THROWS_AS(ck.save(make_request(7, buf)), CheckpointOwnerError);
    // Another step is saved beside it; retention leaves job a's alone.
    ck.save(make_request(8, buf));
    ck.save(make_request(9, buf));
  }
  REQUIRE(fs::exists(dir + "/step_7"));
  // Job a still resumes only its own: step 7, not b's newer 9.
  REQUIRE(check_latest(dir, "a") == 7);
  b.adopt = true;
  b.job_id = "c";
  Checkpointer ck(dir, b);
  auto c = ck.load_latest();
  REQUIRE(c.has_value());
  REQUIRE((c->step == 7 || c->step == 9));
}

TEST_CASE("checkpoint: a job run again continues a finished job's checkpoints, saying so",
          "[checkpoint][ownership]") {
  TempDir d;
  const std::string dir = d.path + "/ck";
  int st = 0;
  // Job a (a first SLURM job, say) saves steps 1..3 and ends.
  std::string out = run_writer(dir, 3, "", kLong, &st, {{"TRUN_JOB_ID", "a"}});
  REQUIRE(exited_with(st, 0));
  // Job b (the same training submitted again: a new job id) continues at step 3, in one line.
  out = run_writer(dir, 2, "", kLong, &st, {{"TRUN_JOB_ID", "b"}});
  INFO(out);
  REQUIRE(exited_with(st, 0));
  REQUIRE_THAT(out, Catch::Contains("resumed 3"));
  REQUIRE_THAT(out, Catch::Contains("continuing job 'a' from " + dir +
                                    "/step_3 (its owner is "
                                    "gone); this is job 'b'"));
  REQUIRE(check_latest(dir, "b") == 5);
  // A fresh start (job c) sets b's and a's checkpoints aside, kept and named, and starts over.
  out = run_writer(dir, 1, "", kLong, &st, {{"TRUN_JOB_ID", "c"}, {"CKPT_SET_ASIDE", "1"}});
  INFO(out);
  REQUIRE(exited_with(st, 0));
  REQUIRE_THAT(out, Catch::Contains("fresh"));
  REQUIRE_THAT(out, Catch::Contains("set aside " + dir + "/step_5 as step_5.set-aside-"));
  REQUIRE(entries(dir, "step_5.set-aside-").size() == 1);
  REQUIRE(entries(dir, "step_4.set-aside-").size() == 1);
  REQUIRE(check_latest(dir, "c") == 1);
  // A restart of the fresh job keeps its own progress: set aside is only another job's.
  out = run_writer(dir, 1, "", kLong, &st, {{"TRUN_JOB_ID", "c"}, {"CKPT_SET_ASIDE", "1"}});
  INFO(out);
  REQUIRE(exited_with(st, 0));
  REQUIRE_THAT(out, Catch::Contains("resumed 1"));
  REQUIRE(check_latest(dir, "c") == 2);
}

TEST_CASE("checkpoint: a read-only directory is refused when the Checkpointer is created",
          "[checkpoint][storage]") {
  if (!can_mount()) return;
  TempDir d;
  Tmpfs t(d.path, "4m");
  const std::string dir = t.path + "/ck";
  fs::create_directories(dir);
  t.set_read_only(true);
  REQUIRE_THROWS_WITH(Checkpointer(dir),
                      Catch::Contains("is not writable (Read-only file system)"));
  try {
    Checkpointer c(dir);
  } catch (const CheckpointError& e) {
    REQUIRE(e.error_number() == EROFS);
  }
}

TEST_CASE("checkpoint: a full disk fails a save cleanly and saves again once space is back",
          "[checkpoint][storage]") {
  if (!can_mount()) return;
  TempDir d;
  Tmpfs t(d.path, "6m");
  const std::string dir = t.path + "/ck";
  CheckpointerOptions o;
  o.job_id = "j";
  o.keep_last = 1;
  ContentBuffers buf;
  Checkpointer ck(dir, o);
  ck.save(make_request(1, buf));
  fill(t.path + "/filler", 512 * 1024);
  try {
    ck.save(make_request(2, buf));
    FAIL("the save should not fit");
  } catch (const CheckpointError& e) {
    REQUIRE(e.error_number() == ENOSPC);
  }
  REQUIRE(entries(dir, ".tmp-").empty());  // its partial files are gone
  REQUIRE(ck.load_latest()->step == 1);
  fs::remove(t.path + "/filler");
  ck.save(make_request(2, buf));
  REQUIRE(ck.load_latest()->step == 2);
  REQUIRE(ck.list_steps() == std::vector<uint64_t>{2});
}

TEST_CASE("checkpoint: crash matrix: SIGKILL at every phase x normal, full, read-only, second job",
          "[checkpoint][crash]") {
  if (!can_mount()) return;
  const Env job_a = {{"TRUN_JOB_ID", "a"}, {"CKPT_KEEP", "1"}};
  const uint64_t ckpt_bytes = kWeightNumel * 4 + 64 * 1024;
  for (const char* condition : {"normal", "full", "read-only", "second job"}) {
    for (const char* phase : kPhases) {
      INFO("condition " << condition << ", writer SIGKILLed at " << phase);
      TempDir d;
      Tmpfs t(d.path, "8m");
      const std::string dir = t.path + "/ck";
      int st = 0;
      std::string out = run_writer(dir, 2, "", kLong, &st, job_a);
      REQUIRE(exited_with(st, 0));
      if (std::string(condition) == "full") fill(t.path + "/filler", ckpt_bytes * 3 / 2);

      out = run_writer(dir, 3, phase, kLong, &st, job_a);
      INFO(out);
      REQUIRE(WIFSIGNALED(st));
      const uint64_t after_kill = check_latest(dir, "a");
      REQUIRE((after_kill == 2 || after_kill == 3));
      const auto steps = entries(dir, "step_");

      if (std::string(condition) == "full") {
        // Saves until the disk is full: each failure leaves nothing behind.
        out = run_writer(dir, 3, "", kLong, &st, job_a);
        INFO(out);
        REQUIRE((exited_with(st, 0) ||
                 (exited_with(st, 3) && out.find("No space left") != std::string::npos)));
        REQUIRE(entries(dir, ".tmp-").empty());
        const uint64_t s = check_latest(dir, "a");
        REQUIRE(s >= after_kill);
        fs::remove(t.path + "/filler");
      } else if (std::string(condition) == "read-only") {
        t.set_read_only(true);
        out = run_writer(dir, 1, "", kLong, &st, job_a);
        INFO(out);
        REQUIRE(exited_with(st, 3));
        REQUIRE_THAT(out, Catch::Contains("is not writable (Read-only file system)"));
        REQUIRE(entries(dir, "step_") == steps);
        t.set_read_only(false);
      } else if (std::string(condition) == "second job") {
        out = run_writer(dir, 1, "", kLong, &st, {{"TRUN_JOB_ID", "b"}, {"CKPT_ADOPT", "0"}});
        INFO(out);
        REQUIRE(exited_with(st, 3));
        REQUIRE_THAT(out, Catch::Contains("holds checkpoints of another job ('a'"));
        REQUIRE(entries(dir, "step_") == steps);
      }
      // Job a carries on from where it was, and nothing of a dead writer is left.
      const uint64_t before = check_latest(dir, "a");
      out = run_writer(dir, 1, "", kLong, &st, job_a);
      INFO(out);
      REQUIRE(exited_with(st, 0));
      REQUIRE_THAT(out, Catch::Contains("resumed " + std::to_string(before)));
      REQUIRE(check_latest(dir, "a") == before + 1);
      REQUIRE(entries(dir, ".tmp-").empty());
      REQUIRE(entries(dir, ".latest.tmp-").empty());
      REQUIRE(entries(dir, "step_").size() == 1);  // keep 1
    }
  }
}
