// A checkpoint writer for the crash-consistency tests: resumes from DIR's newest valid checkpoint
// (checking that its contents match its step) and saves steps after it, as fast as it can, until
// it has saved MAX_SAVES or is killed.
//
//   ckpt_writer DIR MAX_SAVES [CRASH_PHASE]
//
// With CRASH_PHASE (one of the Checkpointer's phases), it SIGKILLs itself at that phase of its
// first save. Prints "resumed STEP" (or "fresh") first. Exit codes: 0 done, 1 a loaded
// checkpoint had wrong contents, 2 usage, 3 exception.
//
// Environment: TRUN_JOB_ID (the job; the Checkpointer reads it), CKPT_KEEP (keep_last, default
// 2), CKPT_LOCK_WAIT_MS (lock_wait), CKPT_HOLD_PHASE (at that phase of the first save, print
// "holding" and sleep until killed), CKPT_FRESH_START=1 (start_fresh_if_damaged), CKPT_ADOPT=0
// (adopt off: another job's checkpoints are refused instead of continued), CKPT_SET_ASIDE=1
// (set_aside_other_jobs: a fresh start).

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <trun/checkpoint.h>

#include "tests/worker_sdk/checkpoint/ckpt_content.h"

using namespace trun::worker;

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  try {
    const std::string dir = argv[1];
    const int max_saves = std::atoi(argv[2]);
    const std::string crash = argc > 3 ? argv[3] : "";
    auto env = [](const char* name) {
      const char* v = std::getenv(name);
      return std::string(v ? v : "");
    };
    CheckpointerOptions o;
    o.keep_last = env("CKPT_KEEP").empty() ? 2 : std::atoi(env("CKPT_KEEP").c_str());
    if (!env("CKPT_LOCK_WAIT_MS").empty())
      o.lock_wait = std::chrono::milliseconds(std::atoi(env("CKPT_LOCK_WAIT_MS").c_str()));
    o.start_fresh_if_damaged = env("CKPT_FRESH_START") == "1";
    o.adopt = env("CKPT_ADOPT") != "0";
    o.set_aside_other_jobs = env("CKPT_SET_ASIDE") == "1";
    const std::string hold = env("CKPT_HOLD_PHASE");
    if (!crash.empty() || !hold.empty())
      o.on_phase = [crash, hold](const char* phase) {
        if (crash == phase) ::kill(::getpid(), SIGKILL);
        if (hold == phase) {
          std::printf("holding\n");
          std::fflush(stdout);
          for (int i = 0; i < 600; ++i) ::sleep(1);  // until the test kills it
        }
      };
    Checkpointer ck(dir, o);
    uint64_t step = 0;
    if (auto c = ck.load_latest()) {
      std::string why;
      if (!trun::test::check_content(*c, &why)) {
        std::fprintf(stderr, "loaded checkpoint step %llu is wrong: %s\n",
                     static_cast<unsigned long long>(c->step), why.c_str());
        return 1;
      }
      step = c->step;
      std::printf("resumed %llu\n", static_cast<unsigned long long>(step));
    } else {
      std::printf("fresh\n");
    }
    std::fflush(stdout);
    trun::test::ContentBuffers buf;
    for (int i = 0; i < max_saves; ++i) {
      ++step;
      ck.save(trun::test::make_request(step, buf));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exception: %s\n", e.what());
    return 3;
  }
}
