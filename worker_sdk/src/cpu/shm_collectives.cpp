// ShmComm's collectives through the slots (shm_comm.h): allreduce, broadcast, allgather and
// reduce_scatter, in rounds of at most one slot per rank, with a barrier after each half of a
// round. Members of ShmComm; all_to_all_v is in shm_all_to_all.cpp.

#include <algorithm>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/rank_list.h"
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

// A call as the segment holds it (ShmRankState's call_* fields).
struct CallSig {
  uint32_t number = 0;
  uint32_t shape = 0;
  int32_t root = 0;
  uint64_t size = 0;
  bool operator==(const CallSig& o) const {
    return number == o.number && shape == o.shape && root == o.root && size == o.size;
  }
  bool operator!=(const CallSig& o) const { return !(*this == o); }
};

CallSig load_call(const ShmRankState& s) {
  return {s.call_number.load(std::memory_order_relaxed),
          s.call_shape.load(std::memory_order_relaxed), s.call_root.load(std::memory_order_relaxed),
          s.call_size.load(std::memory_order_relaxed)};
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
  // Fast path: every rank's call equals local rank 0's.
  const ShmRankState& first = hdr_->ranks[0];
  const CallSig zero = load_call(first);
  for (int r = 1; r < n_; ++r) {
    if (load_call(hdr_->ranks[r]) != zero) {
      mismatch();
    }
  }
}

// The calls differ. Every rank reads the same calls, so every rank names the same ranks: the
// majority's call (in a tie, the side of the lowest local rank) is the expected one, and the
// first rank that differs from it, with every rank that made the same call, is named.
void ShmComm::mismatch() {
  std::vector<CallSig> calls(static_cast<size_t>(n_));
  for (int r = 0; r < n_; ++r) calls[static_cast<size_t>(r)] = load_call(hdr_->ranks[r]);
  size_t majority = 0, best = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    const size_t votes = static_cast<size_t>(std::count(calls.begin(), calls.end(), calls[i]));
    if (votes > best) {
      best = votes;
      majority = i;
    }
  }
  const CallSig& want = calls[majority];
  size_t odd = 0;
  while (odd < calls.size() && calls[odd] == want) ++odd;
  const CallSig& got = calls[odd];
  std::vector<int> odd_ranks, majority_ranks;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (calls[i] == got) odd_ranks.push_back(static_cast<int>(i));
    if (calls[i] == want) majority_ranks.push_back(static_cast<int>(i));
  }
  const std::string who = base::format_rank_list(odd_ranks, "local rank"),
                    others = base::format_rank_list(majority_ranks, "local rank");
  std::string why;
  if (got.number == want.number && (got.shape & 0xff) == (want.shape & 0xff)) {
    why = std::string(kind_name(want.shape & 0xff)) + " #" + std::to_string(want.number) +
          " of group " + group_ + ": " + who + " passed " + passed(got.shape, got.root, got.size) +
          ", where " + others + " passed " + passed(want.shape, want.root, want.size);
  } else {
    auto entered = [](const CallSig& c) {
      std::string p = passed(c.shape, c.root, c.size);
      return std::string(kind_name(c.shape & 0xff)) + " #" + std::to_string(c.number) +
             (p.empty() ? "" : " of " + p);
    };
    why = "collective #" + std::to_string(want.number) + " of group " + group_ +
          " differs across local ranks: " + who + " entered " + entered(got) + ", where " + others +
          " entered " + entered(want);
  }
  // Every rank finds the same ranks and throws; the abort also fails a rank that sits in a
  // barrier (which does not check) at its next wait.
  set_abort(why);
  throw CollectiveError(why);
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
  // The slot lines a rank writes (its copies of the peers' slices, its reduced slice) are read
  // next by a peer, which still holds them from the previous round: plain stores first fetch
  // each line back and invalidate the peer's copy. Non-temporal stores skip that. Measured on
  // this 2-core machine (AMD EPYC VM, cross-core round trip ~500 ns), 64 MiB float allreduce,
  // 2 ranks: copy-in 5.0 -> 1.8 ms, reduce 7.0 -> 3.6 ms per call, 4.2-4.9 -> 7-11 GB/s.
  const bool stream = count * es >= kStreamMinBytes;
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
      copy_or_stream(stream, mine + j * slice_bytes, buf + (off + j * per) * es, slice_len(j) * es);
    }
    arrive_and_wait(deadline, "allreduce");
    const size_t len = slice_len(me_);
    if (len) {
      // One pass: read every rank's copy of my slice (mine from my buffer), in rank order, and
      // store the result both in my buffer and where my peers will copy it from.
      char* dst = buf + (off + me_ * per) * es;
      for (int j = 0; j < n_; ++j) srcs_[j] = j == me_ ? dst : slot(j) + me_ * slice_bytes;
      void* dsts[2] = {dst, mine + me_ * slice_bytes};  // dst is a source too: first
      reduce_n(dsts, 2, srcs_.data(), n_, len, dtype, op, stream);
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
