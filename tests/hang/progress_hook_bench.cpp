// progress_hook_bench [N]: the cost of libtrun_worker's progress hooks on a real board, in
// nanoseconds per call (N calls each, default 10 million): a collective's three (issued,
// started, finished), heartbeat(), a Section, and the same with no board attached (what a worker
// outside trun pays). Prints RESULT lines.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "agent/progress_monitor.h"
#include "base/shm_names.h"
#include "trun/progress.h"
#include "worker_sdk/src/progress/progress.h"

namespace wp = trun::worker::detail::progress;
namespace board = trun::base::progress;

template <typename F>
double ns_per_call(long n, F f) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) f(i);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(n);
}

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::stol(argv[1]) : 10000000;
  auto m = trun::agent::ProgressMonitor::create(
      trun::base::shm_progress_name("hookbench", ::getpid()), 1);
  wp::attach_record_for_testing(m->record_for_testing(0), 0, 0);
  auto g = wp::GroupProgress::make("bench-r0-pg0", 0, 1);
  const double collective = ns_per_call(n, [&](long i) {
    const uint64_t s = g->issue(board::Op::kAllreduce, 1, static_cast<uint64_t>(i));
    g->start(s);
    g->finish(s, true);
  });
  const double heartbeat = ns_per_call(n, [](long) { trun::worker::heartbeat(); });
  const double section = ns_per_call(n / 10, [](long) { trun::worker::Section s("eval"); });
  wp::attach_record_for_testing(nullptr, 0, 0);
  const double detached = ns_per_call(n, [](long) { trun::worker::heartbeat(); });
  std::printf("RESULT progress_hook_collective %.1f ns\n", collective);
  std::printf("RESULT progress_hook_heartbeat %.1f ns\n", heartbeat);
  std::printf("RESULT progress_hook_section %.1f ns\n", section);
  std::printf("RESULT progress_hook_detached %.1f ns\n", detached);
  return 0;
}
