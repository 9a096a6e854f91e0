// allreduce bandwidth of libtrun_worker's CPU backend on one node, next to single-thread memcpy
// bandwidth measured in the same run (the peer PyTorch gloo numbers come from
// allreduce_torch.py; scripts/bench_allreduce.sh runs both and prints the comparison).
//
//   allreduce_bench [--ranks N] [--sizes-mib 1,4,16,64,256] [--p2p-mib M]
//
// Starts a store server, launches N copies of itself as ranks (the environment a trun agent
// would set), and prints one line per size:
//   trun ranks=N size_mib=S algbw_gbps=A busbw_gbps=B cpu_busbw_gbps=C memcpy_gbps=M ...
// algbw = bytes / time of one allreduce (the slowest rank's median), busbw = algbw * 2(n-1)/n.
// With --p2p-mib M, then two more lines (float32, M MiB):
//   trun_all_to_all ranks=N size_mib=M algbw_gbps=A   each rank's M MiB buffer in N blocks, one
//                                                     to every rank (the slowest rank's median)
//   trun_sendrecv ranks=N size_mib=M algbw_gbps=A     ranks paired (0-1, 2-3, ...): the even one
//                                                     sends M MiB, the odd one receives them; the
//                                                     pairs run at the same time
//   trun_all_to_all_shared ... and trun_sendrecv_shared ...: the same, with send buffers from
//                                                     ProcessGroup::shared_buffer (one copy
//                                                     per byte; shared=0 if not in the segment)
// (no busbw: bytes moved per rank are the buffer size in both).
// memcpy is timed by rank 0 just before and just after each size's allreduces (the other ranks
// wait in a barrier), and its median taken over both: on a machine whose memory bandwidth
// drifts from minute to minute, the two figures then come from the same second or two. (Timing
// memcpy between single allreduces was tried: the ranks then sleep in the barrier every time,
// and with more ranks than cores the wake-ups pile them onto one core for the next allreduce.)
// cpu_busbw and cpu_memcpy use CPU time instead of wall-clock time (informative: what the run
// would show on an idle machine with a core per rank). xcore_ns is the round trip of one cache
// line between two threads pinned to the first two CPUs the process may use, also timed by rank
// 0 before and after (informative: on a VM whose vCPUs the host sometimes places on different
// core complexes, it jumps from about 120 ns to about 500 ns, and every multi-rank figure of
// that run drops with it; single-thread memcpy does not notice).

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <trun/worker.h>

#include "store/server.h"

using Clock = std::chrono::steady_clock;
using namespace trun::worker;

namespace {

std::vector<size_t> parse_sizes(const std::string& s) {
  std::vector<size_t> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    out.push_back(std::stoull(s.substr(pos, comma - pos)));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

int iterations_for(size_t bytes) {
  // About 1 GiB of traffic per size, at least 5 and at most 50 timed iterations.
  size_t it = (1ull << 30) / std::max<size_t>(bytes, 1);
  return static_cast<int>(std::clamp<size_t>(it, 5, 50));
}

// CPU seconds of the calling thread / the whole process: on a busy machine wall-clock numbers
// mostly measure the scheduler, CPU time measures the work.
double cpu_seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One timed single-thread memcpy of src into dst: {wall-clock s, thread CPU s}.
std::pair<double, double> time_memcpy(std::vector<char>& dst, std::vector<char>& src, int i) {
  auto t0 = Clock::now();
  double c0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
  std::memcpy(dst.data(), src.data(), src.size());
  double c = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - c0;
  double t = std::chrono::duration<double>(Clock::now() - t0).count();
  src[i % src.size()] = static_cast<char>(dst[(i * 7) % dst.size()] + 1);  // keep the copies live
  return {t, c};
}

// Median round trip (ns) of a cache line bounced between threads pinned to the first two CPUs
// of this process's affinity mask; 0 when it has only one.
double cross_core_round_trip_ns() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < 2) return 0;
  int cpus[2], found = 0;
  for (int c = 0; c < CPU_SETSIZE && found < 2; ++c)
    if (CPU_ISSET(c, &allowed)) cpus[found++] = c;
  auto pin = [](int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
  };
  constexpr int kTrips = 20000, kRounds = 5;
  alignas(64) std::atomic<int> ball{0};
  std::vector<double> ns;
  std::thread echo([&] {
    pin(cpus[1]);
    for (int i = 0; i < kTrips * kRounds; ++i) {
      for (long spin = 0; ball.load(std::memory_order_acquire) != 1 && spin < 100000000; ++spin) {
      }
      ball.store(0, std::memory_order_release);
    }
  });
  std::thread serve([&] {
    pin(cpus[0]);
    for (int r = 0; r < kRounds; ++r) {
      auto t0 = Clock::now();
      for (int i = 0; i < kTrips; ++i) {
        ball.store(1, std::memory_order_release);
        for (long spin = 0; ball.load(std::memory_order_acquire) != 0 && spin < 100000000; ++spin) {
        }
      }
      ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kTrips);
    }
  });
  serve.join();
  echo.join();
  return median(ns);
}

// Median over iterations of the slowest rank's time for `op` (after 2 warm-up calls).
template <typename Op>
double timed(ProcessGroup& pg, int iters, Op op) {
  for (int i = 0; i < 2; ++i) op();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    pg.barrier();
    auto t0 = Clock::now();
    op();
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    pg.allreduce(&dt, 1, DataType::kFloat64, ReduceOp::kMax);
    times.push_back(dt);
  }
  return median(times);
}

void run_p2p(ProcessGroup& pg, size_t mib) {
  const int n = pg.size(), rank = pg.rank();
  const size_t bytes = mib << 20, count = bytes / 4, block = count / n;
  const int iters = iterations_for(bytes);
  std::vector<float> send(block * n, 1.0f), recv(block * n, 0.0f);
  double t =
      timed(pg, iters, [&] { pg.all_to_all(send.data(), recv.data(), block, DataType::kFloat32); });
  if (rank == 0)
    std::printf("trun_all_to_all ranks=%d size_mib=%zu algbw_gbps=%.3f backend=%s\n", n, mib,
                block * n * 4.0 / t / 1e9, pg.backend_description().c_str());
  std::vector<float> buf(count, 1.0f);
  const int peer = rank ^ 1;
  auto time_sendrecv = [&](float* send_buf) {
    return timed(pg, iters, [&] {
      if (peer >= n) return;
      if (rank % 2 == 0)
        pg.send(send_buf, count, DataType::kFloat32, peer);
      else
        pg.recv(buf.data(), count, DataType::kFloat32, peer);
    });
  };
  t = time_sendrecv(buf.data());
  if (rank == 0)
    std::printf("trun_sendrecv ranks=%d size_mib=%zu algbw_gbps=%.3f backend=%s\n", n, mib,
                bytes / t / 1e9, pg.backend_description().c_str());

  // The same with send buffers in the node's shared memory (SharedBuffer).
  SharedBuffer shared = pg.shared_buffer(count * 4);
  std::fill_n(shared.as<float>(), count, 1.0f);
  t = timed(pg, iters,
            [&] { pg.all_to_all(shared.data(), recv.data(), block, DataType::kFloat32); });
  if (rank == 0)
    std::printf("trun_all_to_all_shared ranks=%d size_mib=%zu algbw_gbps=%.3f shared=%d\n", n, mib,
                block * n * 4.0 / t / 1e9, shared.shared() ? 1 : 0);
  t = time_sendrecv(shared.as<float>());
  if (rank == 0)
    std::printf("trun_sendrecv_shared ranks=%d size_mib=%zu algbw_gbps=%.3f shared=%d\n", n, mib,
                bytes / t / 1e9, shared.shared() ? 1 : 0);
  std::fflush(stdout);
}

int run_rank(const std::vector<size_t>& sizes_mib, size_t p2p_mib) {
  Worker w = init();
  ProcessGroup& pg = w.process_group();
  const int n = pg.size();
  const bool timer = pg.rank() == 0;  // rank 0 also times memcpy
  for (size_t mib : sizes_mib) {
    const size_t bytes = mib << 20, count = bytes / 4;
    const int iters = iterations_for(bytes);
    std::vector<float> buf(count, 1.0f);
    std::vector<char> src, dst;
    std::vector<double> mem, mem_cpu, xcore;
    auto time_memcpy_block = [&] {  // rank 0 only; the others wait in the barrier after it
      if (!timer) return;
      if (src.empty()) src.assign(bytes, 1), dst.assign(bytes, 2);
      for (int i = 0; i < iters / 2 + 2; ++i) {
        auto [t, c] = time_memcpy(dst, src, i);
        if (i < 2) continue;  // warm-up
        mem.push_back(t);
        mem_cpu.push_back(c);
      }
      xcore.push_back(cross_core_round_trip_ns());
    };
    time_memcpy_block();
    pg.barrier();
    // Warm-up, which also gives the scheduler time to spread the ranks over the cores again
    // after they slept in the barrier.
    for (int i = 0; i < 3; ++i) pg.allreduce(buf.data(), count, DataType::kFloat32);
    std::vector<double> times, cpu;
    for (int i = 0; i < iters; ++i) {
      pg.barrier();
      auto t0 = Clock::now();
      double c0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
      pg.allreduce(buf.data(), count, DataType::kFloat32);
      double t[2] = {std::chrono::duration<double>(Clock::now() - t0).count(),
                     cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - c0};
      pg.allreduce(t, 2, DataType::kFloat64, ReduceOp::kMax);  // the slowest rank's
      times.push_back(t[0]);
      cpu.push_back(t[1]);
    }
    time_memcpy_block();
    pg.barrier();
    if (timer) {
      double algbw = bytes / median(times) / 1e9;
      double busbw = algbw * 2.0 * (n - 1) / n;
      double cpu_busbw = bytes / median(cpu) / 1e9 * 2.0 * (n - 1) / n;
      std::printf(
          "trun ranks=%d size_mib=%zu algbw_gbps=%.3f busbw_gbps=%.3f cpu_busbw_gbps=%.3f "
          "memcpy_gbps=%.3f cpu_memcpy_gbps=%.3f xcore_ns=%.0f backend=%s\n",
          n, mib, algbw, busbw, cpu_busbw, bytes / median(mem) / 1e9, bytes / median(mem_cpu) / 1e9,
          *std::max_element(xcore.begin(), xcore.end()), pg.backend_description().c_str());
      std::fflush(stdout);
    }
  }
  if (p2p_mib) run_p2p(pg, p2p_mib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 2;
  std::string sizes = "1,4,16,64,256";
  bool worker = false;
  size_t p2p_mib = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--p2p-mib" && i + 1 < argc) {
      p2p_mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--ranks" && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else if (a == "--sizes-mib" && i + 1 < argc) {
      sizes = argv[++i];
    } else if (a == "--worker") {
      worker = true;
    } else {
      std::fprintf(stderr,
                   "usage: allreduce_bench [--ranks N] [--sizes-mib 1,4,...] [--p2p-mib M]\n");
      return 2;
    }
  }
  std::vector<size_t> sizes_mib;
  try {
    sizes_mib = parse_sizes(sizes);
  } catch (const std::exception&) {
    std::fprintf(stderr, "allreduce_bench: bad --sizes-mib '%s'\n", sizes.c_str());
    return 2;
  }
  if (worker) return run_rank(sizes_mib, p2p_mib);
  if (ranks < 1 || ranks > 64) {
    std::fprintf(stderr, "allreduce_bench: --ranks must be in [1, 64]\n");
    return 2;
  }

  trun::store::StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = trun::store::StoreServer::start(so);
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      std::string port = std::to_string(server->port());
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      ::setenv("GROUP_RANK", "0", 1);
      ::setenv("GROUP_WORLD_SIZE", "1", 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);  // the server above
      ::setenv("TORCHELASTIC_RUN_ID", ("bench" + std::to_string(::getppid())).c_str(), 1);
      std::string p2p = std::to_string(p2p_mib);
      ::execl("/proc/self/exe", argv[0], "--worker", "--sizes-mib", sizes.c_str(), "--p2p-mib",
              p2p.c_str(), static_cast<char*>(nullptr));
      std::perror("execl");
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  server->stop();
  if (failed) std::fprintf(stderr, "allreduce_bench: %d rank(s) failed\n", failed);
  return failed ? 1 : 0;
}
