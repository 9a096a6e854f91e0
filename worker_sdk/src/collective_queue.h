#pragma once
// CollectiveQueue: the order in which a ProcessGroup runs its collectives (private to
// libtrun_worker). Asynchronous calls are queued and run one at a time on the group's
// communication thread; a blocking call runs on the caller's thread when nothing is queued or
// running, else it waits its turn behind the work in flight. The first failure breaks the
// group: every later collective fails at once with a CollectiveError naming that cause.
//
// Also Work::State, what a Work handle shares with the queue that completes it.
//
// Thread safety: every member from any thread. The destructor runs what is still queued, then
// joins the communication thread.

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "trun/process_group.h"
#include "worker_sdk/src/backend.h"

namespace trun::worker {

struct Work::State {
  std::string what;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e);
};

}  // namespace trun::worker

namespace trun::worker::detail {

class CollectiveQueue {
 public:
  using Timeout = std::chrono::milliseconds;
  // What one collective runs, bounded by its deadline; throws on failure.
  using Run = std::function<void(Deadline)>;

  // `rank` names this rank in errors; `default_timeout` replaces a timeout <= 0.
  CollectiveQueue(int rank, Timeout default_timeout);
  ~CollectiveQueue();
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // Queues `run` (`what` names it in errors); the Work completes when it has run.
  Work submit(std::string what, Timeout timeout, Run run);
  // Runs `run` in order with the queued work and rethrows its failure: a CollectiveError, or any
  // other exception (a StoreError, say) as a CollectiveError naming `what`.
  void run_now(std::string what, Timeout timeout, Run run);
  // Breaks the group (the first cause is kept).
  void mark_broken(const std::string& cause);
  bool broken() const { return broken_.load(); }

 private:
  struct Task {
    std::shared_ptr<Work::State> state;
    Timeout timeout;
    Run run;
  };

  void loop();
  std::exception_ptr execute(const std::string& what, const Run& run, Timeout timeout,
                             const std::string& cause);
  void done_executing();

  const int rank_;
  const Timeout default_timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::string broken_cause_;  // non-empty once broken
  std::atomic<bool> broken_{false};
  bool executing_ = false;  // a task or an inline collective is running (under mu_)
  std::thread thread_;      // last: started once the rest is ready
};

}  // namespace trun::worker::detail
