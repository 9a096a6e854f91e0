// ShmComm's collectives through the slots (shm_comm.h): allreduce, broadcast, allgather and
// reduce_scatter, in rounds of at most one slot per rank, with a barrier after each half of a
// round. Members of ShmComm; all_to_all_v is in shm_all_to_all.cpp.

#include <algorithm>
#include <string>

#include "base/check.h"
#include "worker_sdk/src/cpu/shm_comm.h"
#include "worker_sdk/src/cpu/shm_layout.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker::detail {

namespace {

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case 1:
      return "allreduce";
    case 2:
      return "broadcast";
    case 3:
      return "allgather";
    case 4:
      return "reduce_scatter";
    case 5:
      return "all_to_all";
    case 6:
      return "barrier";
  }
  return "collective";
}

// What a rank passed, as in "8 float32 elements (sum)"; "" for the kinds without arguments.
std::string passed(uint32_t shape, int32_t root, uint64_t size) {
  const uint32_t kind = shape & 0xff, dtype = (shape >> 8) & 0xff, op = (shape >> 16) & 0xff;
  std::string elements = std::to_string(size) + " ";
  if (dtype != 0xff) elements += std::string(dtype_name(static_cast<DataType>(dtype))) + " ";
  elements += "elements";
  const std::string reduction =
      op != 0xff ? std::string(" (") + reduce_op_name(static_cast<ReduceOp>(op)) + ")" : "";
  switch (kind) {
    case 1:
      return elements + reduction;
    case 4:
      return elements + " per rank" + reduction;
    case 2:
      return std::to_string(size) + " bytes from local rank " + std::to_string(root);
    case 3:
      return std::to_string(size) + " bytes per rank";
  }
  return "";
}

}  // namespace

void ShmComm::publish_call(const Call& call, bool check) {
  ShmRankState& mine = hdr_->ranks[me_];
  mine.call_number.store(++calls_, std::memory_order_relaxed);
  mine.call_shape.store(
      static_cast<uint32_t>(call.kind) | uint32_t{call.dtype} << 8 | uint32_t{call.op} << 16,
      std::memory_order_relaxed);
  mine.call_root.store(call.root, std::memory_order_relaxed);
  mine.call_size.store(call.size, std::memory_order_relaxed);
  check_pending_ = check;  // the arrival's seq_cst store publishes the fields above
}

void ShmComm::check_calls() {
  // Every rank compares every rank's call with local rank 0's, so all name the same pair.
  const ShmRankState& first = hdr_->ranks[0];
  const uint32_t number = first.call_number.load(std::memory_order_relaxed);
  const uint32_t shape = first.call_shape.load(std::memory_order_relaxed);
  const int32_t root = first.call_root.load(std::memory_order_relaxed);
  const uint64_t size = first.call_size.load(std::memory_order_relaxed);
  for (int r = 1; r < n_; ++r) {
    const ShmRankState& other = hdr_->ranks[r];
    const uint32_t r_number = other.call_number.load(std::memory_order_relaxed);
    const uint32_t r_shape = other.call_shape.load(std::memory_order_relaxed);
    const int32_t r_root = other.call_root.load(std::memory_order_relaxed);
    const uint64_t r_size = other.call_size.load(std::memory_order_relaxed);
    if (r_number == number && r_shape == shape && r_root == root && r_size == size) continue;
    std::string why;
    const std::string rank = "local rank " + std::to_string(r);
    if (r_number == number && (r_shape & 0xff) == (shape & 0xff)) {
      why = std::string(kind_name(shape & 0xff)) + " #" + std::to_string(number) + " of group " +
            group_ + ": " + rank + " passed " + passed(r_shape, r_root, r_size) +
            ", local rank 0 passed " + passed(shape, root, size);
    } else {
      auto entered = [&](uint32_t n, uint32_t sh, int32_t ro, uint64_t sz) {
        std::string p = passed(sh, ro, sz);
        return std::string(kind_name(sh & 0xff)) + " #" + std::to_string(n) +
               (p.empty() ? "" : " of " + p);
      };
      why = "collective #" + std::to_string(number) + " of group " + group_ +
            " differs across local ranks: " + rank + " entered " +
            entered(r_number, r_shape, r_root, r_size) + ", local rank 0 entered " +
            entered(number, shape, root, size);
    }
    // Every rank finds the same pair and throws; the abort also fails a rank that sits in a
    // barrier (which does not check) at its next wait.
    set_abort(why);
    throw CollectiveError(why);
  }
}

void ShmComm::allreduce(void* data, size_t count, DataType dtype, ReduceOp op, Deadline deadline) {
  if (n_ == 1 || count == 0) return;
  publish_call(
      {CallKind::kAllreduce, static_cast<uint8_t>(dtype), static_cast<uint8_t>(op), -1, count},
      true);
  const size_t es = dtype_size(dtype);
  char* buf = static_cast<char*>(data);
  // Slices are whole cache lines so that two ranks never write the same line.
  const size_t line_elems = std::max<size_t>(1, kShmLine / es);
  const size_t slice_cap = (slot_bytes_ / n_) / kShmLine * kShmLine / es;
  // The constructor makes a slot at least one cache line per rank; else this loop never ends.
  TRUN_CHECK_GT(
      slice_cap, 0u,
      "slot of " << slot_bytes_ << " bytes, " << n_ << " local ranks, " << dtype_name(dtype));
  const size_t round_cap = slice_cap * n_;
  // Slice j of every slot sits at a fixed offset: a short last round must not move a slice
  // onto bytes a peer may still be copying out of the previous round.
  const size_t slice_bytes = slice_cap * es;
  for (size_t off = 0; off < count; off += round_cap) {
    const size_t m = std::min(round_cap, count - off);
    size_t per = (m + n_ - 1) / n_;
    per = std::min(slice_cap, (per + line_elems - 1) / line_elems * line_elems);
    auto slice_len = [&](int j) -> size_t {
      size_t b = static_cast<size_t>(j) * per;
      return b >= m ? 0 : std::min(per, m - b);
    };
    char* mine = slot(me_);
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      copy_bytes(mine + j * slice_bytes, buf + (off + j * per) * es, slice_len(j) * es);
    }
    arrive_and_wait(deadline, "allreduce");
    const size_t len = slice_len(me_);
    if (len) {
      // One pass: read every rank's copy of my slice (mine from my buffer), in rank order, and
      // store the result both in my buffer and where my peers will copy it from.
      char* dst = buf + (off + me_ * per) * es;
      for (int j = 0; j < n_; ++j) srcs_[j] = j == me_ ? dst : slot(j) + me_ * slice_bytes;
      void* dsts[2] = {dst, mine + me_ * slice_bytes};  // dst is a source too: first
      reduce_n(dsts, 2, srcs_.data(), n_, len, dtype, op);
    }
    arrive_and_wait(deadline, "allreduce");
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      copy_bytes(buf + (off + j * per) * es, slot(j) + j * slice_bytes, slice_len(j) * es);
    }
  }
  // Nobody may reuse the slots until every rank copied its results out.
  arrive_and_wait(deadline, "allreduce");
}

void ShmComm::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  if (n_ == 1 || bytes == 0) return;
  publish_call({CallKind::kBroadcast, 0xff, 0xff, root, bytes}, true);
  char* buf = static_cast<char*>(data);
  const size_t cap = slot_bytes_ * n_;
  for (size_t off = 0; off < bytes; off += cap) {
    const size_t m = std::min(cap, bytes - off);
    if (me_ == root) copy_bytes(data_, buf + off, m);
    arrive_and_wait(deadline, "broadcast");
    if (me_ != root) copy_bytes(buf + off, data_, m);
    arrive_and_wait(deadline, "broadcast");
  }
}

void ShmComm::allgather(const void* send, void* recv, size_t bytes, Deadline deadline) {
  if (n_ > 1 && bytes > 0) publish_call({CallKind::kAllgather, 0xff, 0xff, -1, bytes}, true);
  allgather_slots(send, recv, bytes, deadline);
}

// allgather without a call of its own (all_to_all_v's exchanges).
void ShmComm::allgather_slots(const void* send, void* recv, size_t bytes, Deadline deadline) {
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (n_ == 1 || bytes == 0) {
    if (bytes) copy_bytes(out, in, bytes);
    return;
  }
  for (size_t off = 0; off < bytes; off += slot_bytes_) {
    const size_t m = std::min(slot_bytes_, bytes - off);
    copy_bytes(slot(me_), in + off, m);
    arrive_and_wait(deadline, "allgather");
    for (int j = 0; j < n_; ++j) copy_bytes(out + j * bytes + off, slot(j), m);
    arrive_and_wait(deadline, "allgather");
  }
}

void ShmComm::reduce_scatter(const void* send, void* recv, size_t count, DataType dtype,
                             ReduceOp op, Deadline deadline) {
  const size_t es = dtype_size(dtype);
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (count == 0) return;
  if (n_ == 1) {
    copy_bytes(out, in, count * es);
    return;
  }
  publish_call(
      {CallKind::kReduceScatter, static_cast<uint8_t>(dtype), static_cast<uint8_t>(op), -1, count},
      true);
  const size_t sub_bytes = (slot_bytes_ / n_) / kShmLine * kShmLine;
  const size_t sub = sub_bytes / es;
  TRUN_CHECK_GT(
      sub, 0u,
      "slot of " << slot_bytes_ << " bytes, " << n_ << " local ranks, " << dtype_name(dtype));
  for (size_t off = 0; off < count; off += sub) {
    const size_t m = std::min(sub, count - off);
    for (int d = 0; d < n_; ++d) {
      if (d == me_) continue;
      copy_bytes(slot(me_) + d * sub_bytes, in + (d * count + off) * es, m * es);
    }
    arrive_and_wait(deadline, "reduce_scatter");
    for (int j = 0; j < n_; ++j)
      srcs_[j] = j == me_ ? in + (me_ * count + off) * es : slot(j) + me_ * sub_bytes;
    void* dst = out + off * es;
    reduce_n(&dst, 1, srcs_.data(), n_, m, dtype, op);
    arrive_and_wait(deadline, "reduce_scatter");
  }
}

}  // namespace trun::worker::detail
