#include "trun/process_group.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "worker_sdk/src/backend.h"

namespace trun::worker {

using detail::Clock;
using detail::Deadline;

size_t dtype_size(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
  }
  throw std::invalid_argument("unknown DataType " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kCpu:
      return "cpu";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

Backend parse_backend(const std::string& name) {
  std::string s = name;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "auto") return Backend::kAuto;
  if (s == "cpu" || s == "gloo") return Backend::kCpu;
  if (s == "nccl") return Backend::kNccl;
  throw std::invalid_argument("unknown backend '" + name + "' (expected auto, cpu or nccl)");
}

// ---- Work ----

struct Work::State {
  std::string what;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      error = std::move(e);
      done = true;
    }
    cv.notify_all();
  }
};

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

// ---- ProcessGroup ----

struct ProcessGroup::Impl {
  struct Task {
    std::shared_ptr<Work::State> state;
    Timeout timeout;
    std::function<void(Deadline)> run;
  };

  ProcessGroupOptions options;
  Backend kind = Backend::kCpu;
  std::unique_ptr<detail::BackendImpl> backend;
  std::string description;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stopping = false;
  std::string broken_cause;  // non-empty once broken
  std::atomic<bool> broken{false};
  std::thread thread;

  bool executing = false;  // a task or an inline collective is running (under mu)

  void loop() {
    for (;;) {
      Task task;
      std::string cause;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !executing && (stopping || !queue.empty()); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
        executing = true;
        cause = broken_cause;
      }
      // The Work completes before `executing` clears: a blocking call may then run inline only
      // after every earlier Work reports done.
      task.state->finish(execute(task.state->what, task.run, task.timeout, cause));
      done_executing();
    }
  }

  // Runs one collective, or fails it at once when the group was broken (`cause`, read when the
  // collective was claimed); its failure as the caller sees it (nullptr: success).
  std::exception_ptr execute(const std::string& what, const std::function<void(Deadline)>& run,
                             Timeout timeout, const std::string& cause) {
    if (!cause.empty())
      return std::make_exception_ptr(CollectiveError(what + " on rank " +
                                                     std::to_string(options.rank) +
                                                     ": the process group is broken: " + cause));
    try {
      run(Clock::now() + timeout);
      return nullptr;
    } catch (const CollectiveError& e) {
      mark_broken(e.what());
      return std::current_exception();
    } catch (const std::exception& e) {
      // Store errors and the like: same contract for the caller.
      std::string msg = what + " on rank " + std::to_string(options.rank) + " failed: " + e.what();
      mark_broken(msg);
      return std::make_exception_ptr(CollectiveError(msg));
    }
  }

  void done_executing() {
    {
      std::lock_guard<std::mutex> lock(mu);
      executing = false;
    }
    cv.notify_all();
  }

  // A blocking collective: run on the calling thread when nothing is queued or running (no
  // hand-off to the communication thread and back: tens of microseconds on small buffers),
  // else queued behind the work in flight, in order.
  void run_now(std::string what, Timeout timeout, std::function<void(Deadline)> run) {
    if (timeout.count() <= 0) timeout = options.timeout;
    std::string cause;
    {
      std::unique_lock<std::mutex> lock(mu);
      if (executing || !queue.empty()) {
        lock.unlock();
        submit(std::move(what), timeout, std::move(run)).wait();
        return;
      }
      executing = true;
      cause = broken_cause;
    }
    std::exception_ptr error = execute(what, run, timeout, cause);
    done_executing();
    if (error) std::rethrow_exception(error);
  }

  void mark_broken(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mu);
    if (broken_cause.empty()) broken_cause = cause;
    broken = true;
  }

  Work submit(std::string what, Timeout timeout, std::function<void(Deadline)> run) {
    auto state = std::make_shared<Work::State>();
    state->what = std::move(what);
    if (timeout.count() <= 0) timeout = options.timeout;
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(Task{state, timeout, std::move(run)});
    }
    cv.notify_one();
    return Work(state);
  }
};

namespace {

void check_buffer(const void* p, size_t count, const char* what) {
  if (p == nullptr && count > 0)
    throw std::invalid_argument(std::string(what) + ": null buffer with " + std::to_string(count) +
                                " elements");
}

void check_dtype(DataType dtype) { (void)dtype_size(dtype); }

void check_op(ReduceOp op) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg && op != ReduceOp::kMin && op != ReduceOp::kMax)
    throw std::invalid_argument("unknown ReduceOp " + std::to_string(static_cast<int>(op)));
}

void check_no_overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes,
                      const char* what) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  if (a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes)
    throw std::invalid_argument(std::string(what) + ": send and receive buffers overlap");
}

}  // namespace

ProcessGroup::ProcessGroup(ProcessGroupOptions options) : impl_(std::make_unique<Impl>()) {
  auto& o = options;
  if (o.world_size < 1)
    throw std::invalid_argument("ProcessGroup: world_size must be >= 1, got " +
                                std::to_string(o.world_size));
  if (o.rank < 0 || o.rank >= o.world_size)
    throw std::invalid_argument("ProcessGroup: rank " + std::to_string(o.rank) +
                                " is outside [0, " + std::to_string(o.world_size) + ")");
  if (o.world_size > 1 && !o.store)
    throw std::invalid_argument("ProcessGroup: a store is required when world_size > 1");
  if (o.timeout.count() <= 0) throw std::invalid_argument("ProcessGroup: timeout must be positive");
  if ((o.node_rank < 0) != (o.local_rank < 0))
    throw std::invalid_argument(
        "ProcessGroup: node_rank and local_rank must both be set or both be -1");
  const Deadline deadline = Clock::now() + o.timeout;
  Backend kind = o.backend;
  if (kind == Backend::kAuto) kind = nccl_available() ? Backend::kNccl : Backend::kCpu;
  impl_->kind = kind;
  impl_->backend = kind == Backend::kNccl ? detail::make_nccl_backend(o, deadline)
                                          : detail::make_cpu_backend(o, deadline);
  impl_->description = impl_->backend->description();
  impl_->options = std::move(options);
  impl_->thread = std::thread([impl = impl_.get()] { impl->loop(); });
}

ProcessGroup::~ProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

// What each collective runs, validated; shared by the blocking and the asynchronous forms.
namespace {

struct Call {
  std::string what;
  std::function<void(Deadline)> run;
};

Call allreduce_call(detail::BackendImpl* b, void* data, size_t count, DataType dtype, ReduceOp op) {
  check_dtype(dtype);
  check_op(op);
  check_buffer(data, count, "allreduce");
  return {std::string("allreduce(") + dtype_name(dtype) + ", " + std::to_string(count) + ", " +
              reduce_op_name(op) + ")",
          [=](Deadline d) { b->allreduce(data, count, dtype, op, d); }};
}

Call broadcast_call(detail::BackendImpl* b, int world, void* data, size_t count, DataType dtype,
                    int root) {
  check_dtype(dtype);
  check_buffer(data, count, "broadcast");
  if (root < 0 || root >= world)
    throw std::invalid_argument("broadcast: root " + std::to_string(root) + " is outside [0, " +
                                std::to_string(world) + ")");
  return {std::string("broadcast(") + dtype_name(dtype) + ", " + std::to_string(count) + ", root " +
              std::to_string(root) + ")",
          [=](Deadline d) { b->broadcast(data, count, dtype, root, d); }};
}

Call allgather_call(detail::BackendImpl* b, int world, const void* send, void* recv, size_t count,
                    DataType dtype) {
  check_dtype(dtype);
  check_buffer(send, count, "allgather");
  check_buffer(recv, count, "allgather");
  const size_t es = dtype_size(dtype);
  check_no_overlap(send, count * es, recv, count * es * world, "allgather");
  return {std::string("allgather(") + dtype_name(dtype) + ", " + std::to_string(count) + ")",
          [=](Deadline d) { b->allgather(send, recv, count, dtype, d); }};
}

Call reduce_scatter_call(detail::BackendImpl* b, int world, const void* send, void* recv,
                         size_t count, DataType dtype, ReduceOp op) {
  check_dtype(dtype);
  check_op(op);
  check_buffer(send, count, "reduce_scatter");
  check_buffer(recv, count, "reduce_scatter");
  const size_t es = dtype_size(dtype);
  check_no_overlap(send, count * es * world, recv, count * es, "reduce_scatter");
  return {std::string("reduce_scatter(") + dtype_name(dtype) + ", " + std::to_string(count) + ", " +
              reduce_op_name(op) + ")",
          [=](Deadline d) { b->reduce_scatter(send, recv, count, dtype, op, d); }};
}

Call barrier_call(detail::BackendImpl* b) {
  return {"barrier", [=](Deadline d) { b->barrier(d); }};
}

}  // namespace

Work ProcessGroup::allreduce_async(void* data, size_t count, DataType dtype, ReduceOp op,
                                   Timeout timeout) {
  Call c = allreduce_call(impl_->backend.get(), data, count, dtype, op);
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::allreduce(void* data, size_t count, DataType dtype, ReduceOp op,
                             Timeout timeout) {
  Call c = allreduce_call(impl_->backend.get(), data, count, dtype, op);
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::broadcast_async(void* data, size_t count, DataType dtype, int root,
                                   Timeout timeout) {
  Call c = broadcast_call(impl_->backend.get(), size(), data, count, dtype, root);
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::broadcast(void* data, size_t count, DataType dtype, int root, Timeout timeout) {
  Call c = broadcast_call(impl_->backend.get(), size(), data, count, dtype, root);
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::allgather_async(const void* send, void* recv, size_t count, DataType dtype,
                                   Timeout timeout) {
  Call c = allgather_call(impl_->backend.get(), size(), send, recv, count, dtype);
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::allgather(const void* send, void* recv, size_t count, DataType dtype,
                             Timeout timeout) {
  Call c = allgather_call(impl_->backend.get(), size(), send, recv, count, dtype);
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::reduce_scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                                        ReduceOp op, Timeout timeout) {
  Call c = reduce_scatter_call(impl_->backend.get(), size(), send, recv, count, dtype, op);
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::reduce_scatter(const void* send, void* recv, size_t count, DataType dtype,
                                  ReduceOp op, Timeout timeout) {
  Call c = reduce_scatter_call(impl_->backend.get(), size(), send, recv, count, dtype, op);
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::barrier_async(Timeout timeout) {
  Call c = barrier_call(impl_->backend.get());
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::barrier(Timeout timeout) {
  Call c = barrier_call(impl_->backend.get());
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

void ProcessGroup::abort(const std::string& reason) {
  impl_->mark_broken("aborted: " + reason);
  impl_->backend->abort(reason);
}

int ProcessGroup::rank() const { return impl_->options.rank; }
int ProcessGroup::size() const { return impl_->options.world_size; }
Backend ProcessGroup::backend() const { return impl_->kind; }
std::string ProcessGroup::backend_description() const { return impl_->description; }
bool ProcessGroup::broken() const { return impl_->broken.load(); }

}  // namespace trun::worker
