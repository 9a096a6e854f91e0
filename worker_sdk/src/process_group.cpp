#include "trun/process_group.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <thread>

#include "store/store.h"
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
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool:
      return 1;
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
    case DataType::kInt8:
      return "int8";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kBool:
      return "bool";
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
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
  }
  return "unknown";
}

bool reduce_op_supports(ReduceOp op, DataType dtype) {
  const bool integer = dtype == DataType::kInt32 || dtype == DataType::kInt64 ||
                       dtype == DataType::kInt8 || dtype == DataType::kUInt8;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
    case ReduceOp::kProduct:
      return true;
    case ReduceOp::kAvg:
      return dtype != DataType::kBool;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return integer || dtype == DataType::kBool;
  }
  return false;
}

void reduce_op_check(ReduceOp op, DataType dtype, const char* what) {
  (void)dtype_size(dtype);  // throws for an unknown dtype
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kBxor))
    throw std::invalid_argument(std::string(what) + ": unknown ReduceOp " +
                                std::to_string(static_cast<int>(op)));
  if (!reduce_op_supports(op, dtype))
    throw std::invalid_argument(std::string(what) + ": ReduceOp " + reduce_op_name(op) +
                                " does not apply to " + dtype_name(dtype) +
                                (dtype == DataType::kBool
                                     ? " (avg of booleans is not a boolean)"
                                     : " (bitwise ops take integer or bool elements)"));
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

  bool executing = false;                  // a task or an inline collective is running (under mu)
  std::atomic<int> monitored_barriers{0};  // how many this rank started (their store keys)

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

void check_op(const detail::BackendImpl* b, ReduceOp op, DataType dtype, const char* what) {
  reduce_op_check(op, dtype, what);
  b->check_op(op, dtype, what);
}

void check_root(int root, int world, const char* what) {
  if (root < 0 || root >= world)
    throw std::invalid_argument(std::string(what) + ": root " + std::to_string(root) +
                                " is outside [0, " + std::to_string(world) + ")");
}

void check_peer(int peer, int rank, int world, const char* what) {
  if (peer < 0 || peer >= world)
    throw std::invalid_argument(std::string(what) + ": peer " + std::to_string(peer) +
                                " is outside [0, " + std::to_string(world) + ")");
  if (peer == rank)
    throw std::invalid_argument(std::string(what) + ": peer " + std::to_string(peer) +
                                " is this rank");
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
  check_op(b, op, dtype, "allreduce");
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
  check_op(b, op, dtype, "reduce_scatter");
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

std::string sig(const char* name, DataType dtype, size_t count) {
  return std::string(name) + "(" + dtype_name(dtype) + ", " + std::to_string(count);
}

Call reduce_call(detail::BackendImpl* b, int world, void* data, size_t count, DataType dtype,
                 ReduceOp op, int root) {
  check_op(b, op, dtype, "reduce");
  check_buffer(data, count, "reduce");
  check_root(root, world, "reduce");
  return {sig("reduce", dtype, count) + ", " + reduce_op_name(op) + ", root " +
              std::to_string(root) + ")",
          [=](Deadline d) { b->reduce(data, count, dtype, op, root, d); }};
}

Call gather_call(detail::BackendImpl* b, int rank, int world, const void* send, void* recv,
                 size_t count, DataType dtype, int root) {
  check_dtype(dtype);
  check_root(root, world, "gather");
  check_buffer(send, count, "gather");
  if (rank == root) {
    check_buffer(recv, count, "gather");
    const size_t es = dtype_size(dtype);
    check_no_overlap(send, count * es, recv, count * es * world, "gather");
  }
  return {sig("gather", dtype, count) + ", root " + std::to_string(root) + ")",
          [=](Deadline d) { b->gather(send, recv, count, dtype, root, d); }};
}

Call scatter_call(detail::BackendImpl* b, int rank, int world, const void* send, void* recv,
                  size_t count, DataType dtype, int root) {
  check_dtype(dtype);
  check_root(root, world, "scatter");
  check_buffer(recv, count, "scatter");
  if (rank == root) {
    check_buffer(send, count, "scatter");
    const size_t es = dtype_size(dtype);
    check_no_overlap(send, count * es * world, recv, count * es, "scatter");
  }
  return {sig("scatter", dtype, count) + ", root " + std::to_string(root) + ")",
          [=](Deadline d) { b->scatter(send, recv, count, dtype, root, d); }};
}

Call all_to_all_v_call(detail::BackendImpl* b, int world, const void* send,
                       std::vector<size_t> send_counts, void* recv, std::vector<size_t> recv_counts,
                       DataType dtype, const char* name) {
  check_dtype(dtype);
  for (const auto* v : {&send_counts, &recv_counts})
    if (v->size() != static_cast<size_t>(world))
      throw std::invalid_argument(std::string(name) + ": " +
                                  (v == &send_counts ? "send_counts" : "recv_counts") + " has " +
                                  std::to_string(v->size()) + " entries, the group has " +
                                  std::to_string(world) + " ranks");
  size_t total_send = 0, total_recv = 0;
  for (size_t c : send_counts) total_send += c;
  for (size_t c : recv_counts) total_recv += c;
  check_buffer(send, total_send, name);
  check_buffer(recv, total_recv, name);
  const size_t es = dtype_size(dtype);
  check_no_overlap(send, total_send * es, recv, total_recv * es, name);
  return {sig(name, dtype, total_send) + " sent, " + std::to_string(total_recv) + " received)",
          [=, sc = std::move(send_counts), rc = std::move(recv_counts)](Deadline d) {
            b->all_to_all_v(send, sc, recv, rc, dtype, d);
          }};
}

Call p2p_call(detail::BackendImpl* b, int rank, int world, std::vector<P2POp> ops,
              const char* name) {
  std::string what = name;
  what += "(";
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& op = ops[i];
    const char* kind = op.kind == P2POp::kSend ? "send" : "recv";
    if (op.kind != P2POp::kSend && op.kind != P2POp::kRecv)
      throw std::invalid_argument(what + ": op " + std::to_string(i) + " is neither send nor recv");
    check_dtype(op.dtype);
    check_buffer(op.data, op.count, kind);
    check_peer(op.peer, rank, world, kind);
    if (op.tag < 0)
      throw std::invalid_argument(std::string(kind) + ": tag " + std::to_string(op.tag) +
                                  " is negative");
    if (i) what += ", ";
    what += std::string(kind) + (op.kind == P2POp::kSend ? " to " : " from ") + "rank " +
            std::to_string(op.peer) + " " + dtype_name(op.dtype) + "[" + std::to_string(op.count) +
            "] tag " + std::to_string(op.tag);
  }
  what += ")";
  return {what, [=, ops = std::move(ops)](Deadline d) { b->p2p(ops, d); }};
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

Work ProcessGroup::reduce_async(void* data, size_t count, DataType dtype, ReduceOp op, int root,
                                Timeout timeout) {
  Call c = reduce_call(impl_->backend.get(), size(), data, count, dtype, op, root);
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root,
                          Timeout timeout) {
  Call c = reduce_call(impl_->backend.get(), size(), data, count, dtype, op, root);
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::gather_async(const void* send, void* recv, size_t count, DataType dtype,
                                int root, Timeout timeout) {
  Call c = gather_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root);
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::gather(const void* send, void* recv, size_t count, DataType dtype, int root,
                          Timeout timeout) {
  Call c = gather_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root);
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                                 int root, Timeout timeout) {
  Call c = scatter_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root);
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
                           Timeout timeout) {
  Call c = scatter_call(impl_->backend.get(), rank(), size(), send, recv, count, dtype, root);
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::all_to_all_async(const void* send, void* recv, size_t count, DataType dtype,
                                    Timeout timeout) {
  std::vector<size_t> counts(size(), count);
  Call c = all_to_all_v_call(impl_->backend.get(), size(), send, counts, recv, counts, dtype,
                             "all_to_all");
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::all_to_all(const void* send, void* recv, size_t count, DataType dtype,
                              Timeout timeout) {
  std::vector<size_t> counts(size(), count);
  Call c = all_to_all_v_call(impl_->backend.get(), size(), send, counts, recv, counts, dtype,
                             "all_to_all");
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::all_to_all_v_async(const void* send, const std::vector<size_t>& send_counts,
                                      void* recv, const std::vector<size_t>& recv_counts,
                                      DataType dtype, Timeout timeout) {
  Call c = all_to_all_v_call(impl_->backend.get(), size(), send, send_counts, recv, recv_counts,
                             dtype, "all_to_all_v");
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                                void* recv, const std::vector<size_t>& recv_counts, DataType dtype,
                                Timeout timeout) {
  Call c = all_to_all_v_call(impl_->backend.get(), size(), send, send_counts, recv, recv_counts,
                             dtype, "all_to_all_v");
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

Work ProcessGroup::send_async(const void* data, size_t count, DataType dtype, int peer, int tag,
                              Timeout timeout) {
  return batch_isend_irecv({P2POp{P2POp::kSend, const_cast<void*>(data), count, dtype, peer, tag}},
                           timeout);
}
Work ProcessGroup::recv_async(void* data, size_t count, DataType dtype, int peer, int tag,
                              Timeout timeout) {
  return batch_isend_irecv({P2POp{P2POp::kRecv, data, count, dtype, peer, tag}}, timeout);
}
Work ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops, Timeout timeout) {
  Call c = p2p_call(impl_->backend.get(), rank(), size(), ops, "batch_isend_irecv");
  return impl_->submit(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::send(const void* data, size_t count, DataType dtype, int peer, int tag,
                        Timeout timeout) {
  Call c =
      p2p_call(impl_->backend.get(), rank(), size(),
               {P2POp{P2POp::kSend, const_cast<void*>(data), count, dtype, peer, tag}}, "send");
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}
void ProcessGroup::recv(void* data, size_t count, DataType dtype, int peer, int tag,
                        Timeout timeout) {
  Call c = p2p_call(impl_->backend.get(), rank(), size(),
                    {P2POp{P2POp::kRecv, data, count, dtype, peer, tag}}, "recv");
  impl_->run_now(std::move(c.what), timeout, std::move(c.run));
}

void ProcessGroup::monitored_barrier(Timeout timeout, bool wait_all_ranks) {
  Impl& im = *impl_;
  if (timeout.count() <= 0) timeout = im.options.timeout;
  const int rank = im.options.rank, world = im.options.world_size;
  if (world == 1) return;
  const std::string base = "monitored_barrier/" + std::to_string(im.monitored_barriers++) + "/";
  store::Store& store = *im.options.store;
  std::exception_ptr verdict;
  // Through run_now, so that it runs after the queued work; its failure is returned, not
  // thrown, so that it does not break the group.
  im.run_now("monitored_barrier", timeout + std::chrono::seconds(5), [&](Deadline) {
    const std::string result_key = base + "result";
    const std::string ms = std::to_string(timeout.count()) + " ms";
    try {
      if (rank != 0) {
        store.set(base + "arrived/" + std::to_string(rank), "1");
        // Rank 0 may start up to `timeout` after us and then wait `timeout` itself.
        store.wait({result_key}, 2 * timeout + std::chrono::seconds(1));
      } else {
        std::vector<std::string> keys;
        for (int r = 1; r < world; ++r) keys.push_back(base + "arrived/" + std::to_string(r));
        std::string result = "ok";
        try {
          store.wait(keys, timeout);
        } catch (const store::StoreTimeoutError&) {
          std::vector<int> missing;
          for (int r = 1; r < world; ++r)
            if (!store.check({keys[r - 1]})) missing.push_back(r);
          if (missing.empty()) missing.push_back(-1);  // all arrived just now
          if (missing[0] >= 0) {
            if (!wait_all_ranks) missing.resize(1);
            std::string who = missing.size() == 1 ? "rank " : "ranks ";
            for (size_t i = 0; i < missing.size(); ++i)
              who += (i ? ", " : "") + std::to_string(missing[i]);
            result = who + " did not arrive at monitored_barrier within " + ms + " (rank 0 waited)";
          }
        }
        store.set(result_key, result);
      }
      std::string result = store.get(result_key, std::chrono::seconds(5));
      if (result != "ok") throw CollectiveTimeoutError(result);
    } catch (const CollectiveTimeoutError&) {
      verdict = std::current_exception();
    } catch (const store::StoreTimeoutError&) {
      verdict = std::make_exception_ptr(CollectiveTimeoutError(
          "monitored_barrier on rank " + std::to_string(rank) + ": rank 0 gave no verdict within " +
          std::to_string(2 * timeout.count() + 1000) + " ms (rank 0 did not arrive)"));
    }
  });
  if (verdict) std::rethrow_exception(verdict);
}

void ProcessGroup::abort(const std::string& reason) {
  impl_->mark_broken("aborted: " + reason);
  impl_->backend->abort(reason);
}

int ProcessGroup::rank() const { return impl_->options.rank; }
int ProcessGroup::size() const { return impl_->options.world_size; }
void* SharedBuffer::data() const { return block_ ? block_->data : nullptr; }
size_t SharedBuffer::size() const { return block_ ? block_->size : 0; }
bool SharedBuffer::shared() const { return block_ && block_->shared; }

SharedBuffer ProcessGroup::shared_buffer(size_t bytes) {
  if (impl_->kind == Backend::kNccl)
    throw std::invalid_argument(
        "shared_buffer: an NCCL group's buffers are CUDA device memory; shared buffers are host "
        "memory for the CPU backend");
  if (bytes > static_cast<size_t>(PTRDIFF_MAX))
    throw std::invalid_argument("shared_buffer: " + std::to_string(bytes) +
                                " bytes is more than any buffer can hold");
  if (auto block = impl_->backend->allocate_shared(bytes)) return SharedBuffer(std::move(block));
  // Ordinary memory: page-aligned and zero-filled like the shared kind (fresh anonymous pages,
  // allocated as they are touched).
  const size_t rounded = detail::whole_pages(bytes);
  void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto block = std::make_shared<SharedBuffer::Block>();
  block->data = p;
  block->size = bytes;
  block->release = [p, rounded] { ::munmap(p, rounded); };
  return SharedBuffer(std::move(block));
}

Backend ProcessGroup::backend() const { return impl_->kind; }
std::string ProcessGroup::backend_description() const { return impl_->description; }
bool ProcessGroup::broken() const { return impl_->broken.load(); }

}  // namespace trun::worker
