// A rank program for group_threads_test: builds groups from several threads at once with
// Worker::new_group and checks that each is a working group of its own.
//
//   group_threads_worker THREADS
//
// Every thread calls new_group (CPU backend) at the same moment, then allreduces its group
// number's marker: the k-th group on one rank pairs with the k-th on the others, whichever
// thread built it, so the sum shows that every rank's group k is the same group. Last, rank 0
// checks that the store holds the bootstrap keys of groups 0..THREADS (the default group and one
// per thread): THREADS + 1 distinct numbers were taken. Exit 0 on success, 1 with a message.

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <trun/worker.h>

using namespace trun::worker;

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 4;
  try {
    InitOptions io;
    io.backend = Backend::kCpu;
    io.timeout = std::chrono::seconds(60);
    Worker w = init(io);
    const int world = w.world_size();

    std::atomic<int> ready{0};
    std::mutex mu;
    std::vector<std::string> failures;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        try {
          // Start together, so the new_group calls overlap.
          ready.fetch_add(1);
          while (ready.load() < threads) std::this_thread::yield();
          Worker copy = w;  // copies share the numbering
          std::unique_ptr<ProcessGroup> pg = (t % 2 ? copy : w).new_group(Backend::kCpu);
          if (pg->size() != world || pg->rank() != w.rank())
            throw std::runtime_error("group of size " + std::to_string(pg->size()));
          // Every rank contributes 1 and its rank: the sums prove the group spans all ranks.
          int64_t v[2] = {1, w.rank()};
          pg->allreduce(v, 2, DataType::kInt64, ReduceOp::kSum);
          if (v[0] != world || v[1] != int64_t(world) * (world - 1) / 2)
            throw std::runtime_error("allreduce gave " + std::to_string(v[0]) + ", " +
                                     std::to_string(v[1]));
          pg->barrier();
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu);
          failures.push_back("thread " + std::to_string(t) + ": " + e.what());
        }
      });
    }
    for (auto& th : pool) th.join();
    for (const auto& f : failures) std::fprintf(stderr, "rank %d: %s\n", w.rank(), f.c_str());
    if (!failures.empty()) return 1;

    if (w.store()) {
      // Worker::build_group's prefix: the restart count only in a store that outlives a group.
      const std::string attempt = w.env().use_agent_store || !w.env().store_path.empty()
                                      ? "restart" + std::to_string(w.env().restart_count) + "/"
                                      : "";
      std::vector<std::string> keys;
      for (int k = 0; k <= threads; ++k)
        keys.push_back(attempt + "pg" + std::to_string(k) + "/rank/" + std::to_string(w.rank()));
      for (const auto& key : keys) {
        if (!w.store()->check({key})) {
          std::fprintf(stderr, "rank %d: no key %s\n", w.rank(), key.c_str());
          return 1;
        }
      }
      if (w.store()->check({attempt + "pg" + std::to_string(threads + 1) + "/rank/0"})) {
        std::fprintf(stderr, "rank %d: more groups than calls\n", w.rank());
        return 1;
      }
    }
    w.process_group().barrier();
    std::printf("rank %d: %d concurrent groups ok\n", w.rank(), threads);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "group_threads_worker: %s\n", e.what());
    return 1;
  }
}
