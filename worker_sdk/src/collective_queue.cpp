// Work and the CollectiveQueue that completes it (collective_queue.h).

#include "worker_sdk/src/collective_queue.h"

#include <utility>

namespace trun::worker {

void Work::State::finish(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu);
    error = std::move(e);
    done = true;
  }
  cv.notify_all();
}

bool Work::is_completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

void Work::wait() const {
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

std::exception_ptr Work::error() const {
  if (!state_) return nullptr;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

}  // namespace trun::worker

namespace trun::worker::detail {

CollectiveQueue::CollectiveQueue(int rank, Timeout default_timeout)
    : rank_(rank), default_timeout_(default_timeout), thread_([this] { loop(); }) {}

CollectiveQueue::~CollectiveQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void CollectiveQueue::loop() {
  for (;;) {
    Task task;
    std::string cause;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !executing_ && (stopping_ || !queue_.empty()); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      executing_ = true;
      cause = broken_cause_;
    }
    // The Work completes before `executing_` clears: a blocking call may then run inline only
    // after every earlier Work reports done.
    task.state->finish(execute(task.state->what, task.run, task.timeout, cause));
    done_executing();
  }
}

// Runs one collective, or fails it at once when the group was broken (`cause`, read when the
// collective was claimed); its failure as the caller sees it (nullptr: success).
std::exception_ptr CollectiveQueue::execute(const std::string& what, const Run& run,
                                            Timeout timeout, const std::string& cause) {
  if (!cause.empty())
    return std::make_exception_ptr(CollectiveError(what + " on rank " + std::to_string(rank_) +
                                                   ": the process group is broken: " + cause));
  try {
    run(Clock::now() + timeout);
    return nullptr;
  } catch (const CollectiveError& e) {
    mark_broken(e.what());
    return std::current_exception();
  } catch (const std::exception& e) {
    // Store errors and the like: same contract for the caller.
    std::string msg = what + " on rank " + std::to_string(rank_) + " failed: " + e.what();
    mark_broken(msg);
    return std::make_exception_ptr(CollectiveError(msg));
  }
}

void CollectiveQueue::done_executing() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    executing_ = false;
  }
  cv_.notify_all();
}

// A blocking collective: run on the calling thread when nothing is queued or running (no
// hand-off to the communication thread and back: tens of microseconds on small buffers),
// else queued behind the work in flight, in order.
void CollectiveQueue::run_now(std::string what, Timeout timeout, Run run) {
  if (timeout.count() <= 0) timeout = default_timeout_;
  std::string cause;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (executing_ || !queue_.empty()) {
      lock.unlock();
      submit(std::move(what), timeout, std::move(run)).wait();
      return;
    }
    executing_ = true;
    cause = broken_cause_;
  }
  std::exception_ptr error = execute(what, run, timeout, cause);
  done_executing();
  if (error) std::rethrow_exception(error);
}

void CollectiveQueue::mark_broken(const std::string& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_cause_.empty()) broken_cause_ = cause;
  broken_ = true;
}

Work CollectiveQueue::submit(std::string what, Timeout timeout, Run run) {
  auto state = std::make_shared<Work::State>();
  state->what = std::move(what);
  if (timeout.count() <= 0) timeout = default_timeout_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Task{state, timeout, std::move(run)});
  }
  cv_.notify_one();
  return Work(state);
}

}  // namespace trun::worker::detail
