// A program for stop_test (trun/stop.h) with real signals:
//
//   stop_worker signals [--ignore-hup]   prints the signals watched ("SIGTERM SIGUSR1"); with
//                                        --ignore-hup, SIGHUP is set to SIG_IGN first
//   stop_worker never-asks               raises SIGTERM without asking for stop signals (dies)
//   stop_worker exit-by-signal           raises SIGTERM (handled), then exit_by_stop_signal()
//   stop_worker twice                    raises SIGTERM, SIGTERM and SIGUSR1 at itself; prints
//                                        "first=SIGTERM callbacks=1 late=1"
//   stop_worker wait FILE                prints "ready", waits for a stop signal, then for FILE
//                                        to exist (the test signals it again meanwhile); prints
//                                        "stopped=SIGx callbacks=N"
//   stop_worker agree STEPS RANK STEP EVERY   a rank of a job: rank RANK raises SIGUSR1 at itself
//                                        at step STEP; StopAgreement(check_every EVERY) decides;
//                                        prints "rank R stopped at step S (SIGx)" and exits 75,
//                                        or "rank R ran STEPS steps" and exits 0
//   stop_worker init-waits               watches the stop signals, then init() for a launcher
//                                        environment whose store never comes (the test signals
//                                        it while init waits): must die by the signal
//   stop_worker bench CALLS              a rank of a job: times CALLS should_stop calls; rank 0
//                                        prints "should_stop: X us per call (world W, CALLS calls,
//                                        slowest rank)"
// Every wait is bounded (30 s); exit 1 with a message on failure.

#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include <trun/stop.h>
#include <trun/worker.h>

using namespace trun::worker;
using namespace std::chrono_literals;

namespace {

bool wait_for(const std::function<bool()>& pred) {
  const auto end = std::chrono::steady_clock::now() + 30s;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

int fail(const std::string& what) {
  std::fprintf(stderr, "stop_worker: %s\n", what.c_str());
  return 1;
}

int run(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "signals") {
    if (argc > 2 && std::string(argv[2]) == "--ignore-hup") ::signal(SIGHUP, SIG_IGN);
    std::string out;
    for (int s : watch_stop_signals()) out += (out.empty() ? "" : " ") + stop_signal_name(s);
    std::printf("%s\n", out.c_str());
    return 0;
  }
  if (mode == "never-asks") {
    ::raise(SIGTERM);
    return fail("still alive after SIGTERM");
  }
  if (mode == "exit-by-signal") {
    ::raise(SIGTERM);  // handled: recorded only
    if (!stop_requested()) return fail("SIGTERM was not recorded");
    exit_by_stop_signal();
  }
  if (mode == "twice") {
    std::atomic<int> calls{0}, late{0}, seen{0};
    on_stop_requested([&](int s) {
      seen = s;
      ++calls;
    });
    ::raise(SIGTERM);
    ::raise(SIGTERM);
    ::raise(SIGUSR1);
    if (!wait_for([&] { return calls.load() > 0; })) return fail("the callback did not run");
    on_stop_requested([&](int) { ++late; });
    if (!wait_for([&] { return late.load() > 0; })) return fail("the late callback did not run");
    std::this_thread::sleep_for(50ms);  // a second run of either would show now
    if (seen.load() != stop_signal()) return fail("the callback saw another signal");
    std::printf("first=%s callbacks=%d late=%d\n", stop_signal_name(stop_signal()).c_str(),
                calls.load(), late.load());
    return 0;
  }
  if (mode == "wait" && argc > 2) {
    const std::string file = argv[2];
    std::atomic<int> calls{0};
    on_stop_requested([&](int) { ++calls; });
    std::printf("ready\n");
    std::fflush(stdout);
    if (!wait_for([] { return stop_requested(); })) return fail("no stop signal");
    struct stat st;
    if (!wait_for([&] { return ::stat(file.c_str(), &st) == 0; })) return fail("no " + file);
    if (!wait_for([&] { return calls.load() > 0; })) return fail("the callback did not run");
    std::printf("stopped=%s callbacks=%d\n", stop_signal_name(stop_signal()).c_str(), calls.load());
    return 0;
  }
  if (mode == "agree" && argc > 5) {
    const uint64_t steps = std::strtoull(argv[2], nullptr, 10);
    const int signal_rank = std::atoi(argv[3]);
    const uint64_t signal_step = std::strtoull(argv[4], nullptr, 10);
    const uint64_t every = std::strtoull(argv[5], nullptr, 10);
    InitOptions io;
    io.backend = Backend::kCpu;
    io.timeout = 60s;
    Worker w = init(io);
    StopAgreement stop(w.process_group(), every);
    for (uint64_t step = 1; step <= steps; ++step) {
      if (w.rank() == signal_rank && step == signal_step) ::raise(SIGUSR1);
      if (stop.should_stop(step)) {
        if (!stop.should_stop(step + 1)) return fail("should_stop went back to false");
        std::printf("rank %d stopped at step %llu (%s)\n", w.rank(),
                    static_cast<unsigned long long>(stop.agreed_step()),
                    stop_signal_name(stop.agreed_signal()).c_str());
        return 75;
      }
    }
    std::printf("rank %d ran %llu steps\n", w.rank(), static_cast<unsigned long long>(steps));
    return 0;
  }
  if (mode == "init-waits") {
    watch_stop_signals();
    InitOptions io;
    io.backend = Backend::kCpu;
    io.timeout = 60s;
    init(io);
    return fail("init() returned without the store");
  }
  if (mode == "bench" && argc > 2) {
    const uint64_t calls = std::strtoull(argv[2], nullptr, 10);
    InitOptions io;
    io.backend = Backend::kCpu;
    io.timeout = 60s;
    Worker w = init(io);
    StopAgreement stop(w.process_group());
    for (uint64_t i = 1; i <= 100; ++i) stop.should_stop(i);  // warm up
    w.process_group().barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 1; i <= calls; ++i)
      if (stop.should_stop(100 + i)) return fail("stopped without a signal");
    double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        static_cast<double>(calls);
    w.process_group().allreduce(&us, 1, DataType::kFloat64, ReduceOp::kMax);
    if (w.rank() == 0)
      std::printf("should_stop: %.2f us per call (world %d, %llu calls, slowest rank)\n", us,
                  w.world_size(), static_cast<unsigned long long>(calls));
    return 0;
  }
  return fail("usage: see tests/worker_sdk/stop_worker.cpp");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
