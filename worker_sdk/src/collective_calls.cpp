// The validation and binding of each ProcessGroup collective (collective_calls.h).

#include "worker_sdk/src/collective_calls.h"

#include <cstdint>
#include <stdexcept>
#include <utility>

namespace trun::worker::detail {

namespace {

void check_buffer(const void* p, size_t count, const char* what) {
  if (p == nullptr && count > 0)
    throw std::invalid_argument(std::string(what) + ": null buffer with " + std::to_string(count) +
                                " elements");
}

void check_dtype(DataType dtype) { (void)dtype_size(dtype); }

void check_op(const BackendImpl* b, ReduceOp op, DataType dtype, const char* what) {
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

std::string sig(const char* name, DataType dtype, size_t count) {
  return std::string(name) + "(" + dtype_name(dtype) + ", " + std::to_string(count);
}

}  // namespace

Call allreduce_call(BackendImpl* b, void* data, size_t count, DataType dtype, ReduceOp op) {
  check_dtype(dtype);
  check_op(b, op, dtype, "allreduce");
  check_buffer(data, count, "allreduce");
  return {std::string("allreduce(") + dtype_name(dtype) + ", " + std::to_string(count) + ", " +
              reduce_op_name(op) + ")",
          [=](Deadline d) { b->allreduce(data, count, dtype, op, d); }};
}

Call broadcast_call(BackendImpl* b, int world, void* data, size_t count, DataType dtype, int root) {
  check_dtype(dtype);
  check_buffer(data, count, "broadcast");
  if (root < 0 || root >= world)
    throw std::invalid_argument("broadcast: root " + std::to_string(root) + " is outside [0, " +
                                std::to_string(world) + ")");
  return {std::string("broadcast(") + dtype_name(dtype) + ", " + std::to_string(count) + ", root " +
              std::to_string(root) + ")",
          [=](Deadline d) { b->broadcast(data, count, dtype, root, d); }};
}

Call allgather_call(BackendImpl* b, int world, const void* send, void* recv, size_t count,
                    DataType dtype) {
  check_dtype(dtype);
  check_buffer(send, count, "allgather");
  check_buffer(recv, count, "allgather");
  const size_t es = dtype_size(dtype);
  check_no_overlap(send, count * es, recv, count * es * world, "allgather");
  return {std::string("allgather(") + dtype_name(dtype) + ", " + std::to_string(count) + ")",
          [=](Deadline d) { b->allgather(send, recv, count, dtype, d); }};
}

Call reduce_scatter_call(BackendImpl* b, int world, const void* send, void* recv, size_t count,
                         DataType dtype, ReduceOp op) {
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

Call barrier_call(BackendImpl* b) {
  return {"barrier", [=](Deadline d) { b->barrier(d); }};
}

Call reduce_call(BackendImpl* b, int world, void* data, size_t count, DataType dtype, ReduceOp op,
                 int root) {
  check_op(b, op, dtype, "reduce");
  check_buffer(data, count, "reduce");
  check_root(root, world, "reduce");
  return {sig("reduce", dtype, count) + ", " + reduce_op_name(op) + ", root " +
              std::to_string(root) + ")",
          [=](Deadline d) { b->reduce(data, count, dtype, op, root, d); }};
}

Call gather_call(BackendImpl* b, int rank, int world, const void* send, void* recv, size_t count,
                 DataType dtype, int root) {
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

Call scatter_call(BackendImpl* b, int rank, int world, const void* send, void* recv, size_t count,
                  DataType dtype, int root) {
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

Call all_to_all_v_call(BackendImpl* b, int world, const void* send, std::vector<size_t> send_counts,
                       void* recv, std::vector<size_t> recv_counts, DataType dtype,
                       const char* name) {
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

Call p2p_call(BackendImpl* b, int rank, int world, std::vector<P2POp> ops, const char* name) {
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

}  // namespace trun::worker::detail
