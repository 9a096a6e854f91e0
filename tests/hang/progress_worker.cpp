// A libtrun_worker program for the hang tests (tests/hang/progress_board_test.cpp,
// hang_agent_test.cpp): init(), then an allreduce of 16 floats followed by 20 ms of "user code",
// forever. Prints "ready" once init() returned. The first argument picks a fault of rank 1 after
// 20 iterations (section) or 60 (stop, spin: over a second of steps, so that the agent has seen
// its warm-up intervals):
//   section  it enters trun::worker::Section("eval") and stays in it (sleeping), while the other
//            ranks wait for it in the next allreduce;
//   stop     on attempt 0 (TORCHELASTIC_RESTART_COUNT), it stops itself with SIGSTOP;
//   spin     on attempt 0, it spins in user code.
// With stop or spin, a later attempt runs 40 iterations and exits 0 ("attempt N done"). With
// "slow", every rank sleeps 3 s between init() and its first collective (a model load) and 2 s
// after its second (a slow first step), then runs 40 iterations and exits 0. With "agree", rank 1
// spends each iteration's user code in trun::worker::Section("eval") (200 ms; so only its node
// learns that section's intervals) and on attempt 0 exits 3 after 20 iterations, while the other
// ranks wait in the next allreduce until they are stopped; a later attempt runs 10 iterations and
// exits 0. The tests end the other modes by pid. With PROGRESS_WORKER_IGNORE_TERM=FILE, the first
// process of a world larger than 1 to find FILE absent creates it and ignores SIGTERM once init()
// returned (a program whose stop handler waits on its peers: only SIGKILL ends it); later
// processes do not.

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <trun/progress.h>
#include <trun/worker.h>

namespace {

// Not inlined, so that a stack dump names it.
__attribute__((noinline)) void progress_worker_spin_forever() {
  volatile unsigned long n = 0;
  for (;;) n = n + 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int attempt = restart ? std::atoi(restart) : 0;
  // stop-here: local rank 1 of a node whose environment has PROGRESS_WORKER_STOP_HERE=1 stops
  // itself before its 151st allreduce of attempt 0, about 3 s in (a test sets it for one agent
  // only and starts a spare meanwhile; local rank 0 waits in that allreduce, so the node's own
  // hang watch names it); every attempt is bounded (200 allreduces).
  const bool stop_here = mode == "stop-here";
  const char* here = std::getenv("PROGRESS_WORKER_STOP_HERE");
  const char* local_rank = std::getenv("LOCAL_RANK");
  const bool fault = attempt == 0 && (mode == "stop" || mode == "spin" ||
                                      (stop_here && here && std::string(here) == "1" &&
                                       local_rank && std::string(local_rank) == "1"));
  const bool slow = mode == "slow";
  const bool agree = mode == "agree";
  auto worker = trun::worker::init();
  if (const char* marker = std::getenv("PROGRESS_WORKER_IGNORE_TERM");
      marker && *marker && worker.world_size() > 1) {
    const int fd = ::open(marker, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::close(fd);
      ::signal(SIGTERM, SIG_IGN);
    }
  }
  const bool bounded = ((mode == "stop" || mode == "spin") && attempt > 0) || slow || stop_here ||
                       (agree && (attempt > 0 || worker.rank() == 1));
  const int iterations = agree ? (attempt == 0 ? 20 : 10) : stop_here ? 200 : 40;
  auto& pg = worker.process_group();
  std::printf("ready rank=%d progress=%d\n", worker.rank(), trun::worker::progress_reported());
  std::fflush(stdout);
  std::vector<float> buf(16, 1.0f);
  if (slow) ::sleep(3);
  for (int i = 0; !bounded || i < iterations; ++i) {
    if (slow && i == 2) ::sleep(2);
    if (stop_here && fault && i == 150) ::raise(SIGSTOP);
    if (i == (mode == "section" ? 20 : 60) && worker.rank() == 1) {
      if (mode == "section") {
        trun::worker::Section eval("eval");
        for (;;) ::usleep(100000);
      }
      if (fault && mode == "stop") ::raise(SIGSTOP);
      if (fault && mode == "spin") progress_worker_spin_forever();
    }
    pg.allreduce(buf.data(), buf.size(), trun::worker::DataType::kFloat32);
    if (agree && worker.rank() == 1) {
      trun::worker::Section eval("eval");
      ::usleep(200000);
    } else {
      ::usleep(20000);
    }
  }
  if (agree && attempt == 0 && worker.rank() == 1) {
    std::printf("rank 1 fails on purpose\n");
    std::fflush(stdout);
    return 3;
  }
  std::printf("attempt %d done rank=%d\n", attempt, worker.rank());
  return 0;
}
