// The CPU backend: shared memory among the ranks of a node (ShmComm), Gloo among nodes
// (GlooComm, one process per node: local rank 0), composed hierarchically:
//   allreduce: node allreduce -> leaders allreduce -> node broadcast
//   broadcast: root's node broadcast -> leaders broadcast -> other nodes broadcast
//   allgather: node allgather -> leaders allgather (padded to the largest node) -> node broadcast
//   reduce_scatter: allreduce of a copy, then each rank keeps its block (single node with ranks
//                   in local order: shared-memory reduce-scatter directly)
//   reduce: allreduce (every rank ends up with the result; costs an allreduce)
//   gather: allgather (non-roots into a scratch buffer; costs an allgather)
//   scatter: broadcast of root's whole buffer, each rank keeps its block (costs a broadcast of
//            size() blocks)
//   all_to_all: single node: shared-memory all-to-all (ShmComm::all_to_all_v); several nodes:
//               point-to-point with every other rank
//   send/recv: Gloo between the two ranks, over a two-rank context that the pair builds the
//              first time they exchange a message (through the store, under "p2p/<lo>-<hi>");
//              on a node, Gloo carries only the headers and the receiver reads the data
//              straight from the sender's memory (process_vm_readv; the segment's barriers are
//              the whole node's, so they cannot serve a pair); a large message is copied by
//              both at once, pipelined through a ring in the segment (CopyChannel)
// Every node's segment and every leader's Gloo context belong to this group only.

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <vector>

#include "store/prefix_store.h"
#include "worker_sdk/src/backend.h"
#include "worker_sdk/src/cpu/gloo_comm.h"
#include "worker_sdk/src/cpu/shm_comm.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker::detail {
namespace {

struct Placement {
  int node = 0;   // dense node index
  int local = 0;  // index within the node, in local_rank order
};

class CpuBackend : public BackendImpl {
 public:
  CpuBackend(const ProcessGroupOptions& o, Deadline deadline)
      : rank_(o.rank), size_(o.world_size), store_(o.store) {
    if (size_ == 1) {
      place_.assign(1, Placement{});
      node_sizes_.assign(1, 1);
      return;
    }
    discover(o, deadline);
    const Placement& me = place_[rank_];
    const int node_size = node_sizes_[me.node];
    if (node_size > 1) {
      auto node_store =
          std::make_shared<store::PrefixStore>("shm/" + std::to_string(me.node), o.store);
      ShmOptions so;
      so.store = node_store.get();
      so.local_rank = me.local;
      so.local_size = node_size;
      so.tag = o.tag + "-n" + std::to_string(me.node);
      shm_ = std::make_unique<ShmComm>(so, deadline);
    }
    host_ = o.gloo_host.empty() ? local_address_towards(o.gloo_peer_hint) : o.gloo_host;
    if (num_nodes() > 1 && me.local == 0) {
      auto gloo_store = std::make_shared<store::PrefixStore>("gloo", o.store);
      gloo_ = std::make_unique<GlooComm>(*gloo_store, me.node, num_nodes(), host_, deadline);
    }
    identity_ = num_nodes() == 1;
    for (int r = 0; r < size_ && identity_; ++r) identity_ = place_[r].local == r;
  }

  std::string description() const override {
    if (size_ == 1) return "cpu(local)";
    bool any_shm = std::any_of(node_sizes_.begin(), node_sizes_.end(), [](int n) { return n > 1; });
    if (num_nodes() == 1) return "cpu(shm)";
    return any_shm ? "cpu(shm+gloo)" : "cpu(gloo)";
  }

  void allreduce(void* data, size_t count, DataType dtype, ReduceOp op,
                 Deadline deadline) override {
    if (count == 0) return;
    ReduceOp base = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    guarded([&] {
      if (shm_) shm_->allreduce(data, count, dtype, base, deadline);
      if (gloo_) gloo_->allreduce(data, count, dtype, base, deadline);
      if (shm_ && num_nodes() > 1) shm_->broadcast(data, count * dtype_size(dtype), 0, deadline);
    });
    if (op == ReduceOp::kAvg) divide(data, count, dtype, size_);
  }

  void broadcast(void* data, size_t count, DataType dtype, int root, Deadline deadline) override {
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0 || size_ == 1) return;
    const Placement& r = place_[root];
    const Placement& me = place_[rank_];
    guarded([&] {
      if (me.node == r.node && shm_) shm_->broadcast(data, bytes, r.local, deadline);
      if (gloo_) gloo_->broadcast(data, bytes, r.node, deadline);
      if (me.node != r.node && shm_) shm_->broadcast(data, bytes, 0, deadline);
    });
  }

  void allgather(const void* send, void* recv, size_t count, DataType dtype,
                 Deadline deadline) override {
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0) return;
    if (size_ == 1) {
      copy_bytes(recv, send, bytes);
      return;
    }
    guarded([&] {
      if (identity_) return shm_->allgather(send, recv, bytes, deadline);
      const Placement& me = place_[rank_];
      const int node_size = node_sizes_[me.node];
      const int max_node = *std::max_element(node_sizes_.begin(), node_sizes_.end());
      std::vector<char> node_buf(bytes * node_size);
      if (shm_)
        shm_->allgather(send, node_buf.data(), bytes, deadline);
      else
        copy_bytes(node_buf.data(), send, bytes);
      char* out = static_cast<char*>(recv);
      if (num_nodes() == 1) {  // ranks not in local order: reorder the node's blocks
        for (int g = 0; g < size_; ++g)
          copy_bytes(out + g * bytes, node_buf.data() + place_[g].local * bytes, bytes);
        return;
      }
      if (me.local == 0) {
        node_buf.resize(bytes * max_node);
        std::vector<char> all(bytes * max_node * num_nodes());
        gloo_->allgather(node_buf.data(), all.data(), bytes * max_node, deadline);
        const size_t stride = bytes * max_node;
        for (int g = 0; g < size_; ++g)
          copy_bytes(out + g * bytes,
                     all.data() + place_[g].node * stride + place_[g].local * bytes, bytes);
      }
      if (shm_) shm_->broadcast(out, bytes * size_, 0, deadline);
    });
  }

  void reduce_scatter(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      Deadline deadline) override {
    const size_t es = dtype_size(dtype);
    if (count == 0) return;
    if (size_ == 1) {
      copy_bytes(recv, send, count * es);
      return;
    }
    ReduceOp base = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    if (identity_) {
      guarded([&] { shm_->reduce_scatter(send, recv, count, dtype, base, deadline); });
    } else {
      std::vector<char> tmp(static_cast<const char*>(send),
                            static_cast<const char*>(send) + count * size_ * es);
      allreduce(tmp.data(), count * size_, dtype, base, deadline);
      copy_bytes(recv, tmp.data() + rank_ * count * es, count * es);
    }
    if (op == ReduceOp::kAvg) divide(recv, count, dtype, size_);
  }

  void barrier(Deadline deadline) override {
    if (size_ == 1) return;
    guarded([&] {
      if (shm_) shm_->barrier(deadline);
      if (gloo_) gloo_->barrier(deadline);
      if (shm_ && num_nodes() > 1) shm_->barrier(deadline);
    });
  }

  void reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root,
              Deadline deadline) override {
    (void)root;
    allreduce(data, count, dtype, op, deadline);
  }

  void gather(const void* send, void* recv, size_t count, DataType dtype, int root,
              Deadline deadline) override {
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0) return;
    if (rank_ == root) return allgather(send, recv, count, dtype, deadline);
    std::vector<char> scratch(bytes * size_);
    allgather(send, scratch.data(), count, dtype, deadline);
  }

  void scatter(const void* send, void* recv, size_t count, DataType dtype, int root,
               Deadline deadline) override {
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0) return;
    if (rank_ == root) {
      // broadcast only reads the root's buffer (shared memory copies it out, Gloo sends it).
      broadcast(const_cast<void*>(send), count * size_, dtype, root, deadline);
      copy_bytes(recv, static_cast<const char*>(send) + rank_ * bytes, bytes);
      return;
    }
    std::vector<char> scratch(bytes * size_);
    broadcast(scratch.data(), count * size_, dtype, root, deadline);
    copy_bytes(recv, scratch.data() + rank_ * bytes, bytes);
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, DataType dtype,
                    Deadline deadline) override {
    const size_t es = dtype_size(dtype);
    std::vector<size_t> soff(size_), sbytes(size_), roff(size_), rbytes(size_);
    size_t so = 0, ro = 0;
    for (int g = 0; g < size_; ++g) {
      soff[g] = so * es;
      sbytes[g] = send_counts[g] * es;
      roff[g] = ro * es;
      rbytes[g] = recv_counts[g] * es;
      so += send_counts[g];
      ro += recv_counts[g];
    }
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    if (size_ > 1 && num_nodes() == 1) {
      // Shared memory, in local rank order.
      std::vector<size_t> lso(size_), lsb(size_), lro(size_), lrb(size_);
      for (int g = 0; g < size_; ++g) {
        const int l = place_[g].local;
        lso[l] = soff[g], lsb[l] = sbytes[g], lro[l] = roff[g], lrb[l] = rbytes[g];
      }
      guarded([&] {
        shm_->all_to_all_v(in, lso.data(), lsb.data(), out, lro.data(), lrb.data(), deadline);
      });
      return;
    }
    if (sbytes[rank_] != rbytes[rank_])
      throw CollectiveError("all_to_all on rank " + std::to_string(rank_) + ": sends " +
                            std::to_string(send_counts[rank_]) +
                            " elements to itself but receives " +
                            std::to_string(recv_counts[rank_]));
    std::vector<P2POp> ops;
    for (int g = 0; g < size_; ++g) {
      if (g == rank_) continue;
      ops.push_back(
          P2POp{P2POp::kSend, const_cast<char*>(in) + soff[g], send_counts[g], dtype, g, 0});
      ops.push_back(P2POp{P2POp::kRecv, out + roff[g], recv_counts[g], dtype, g, 0});
    }
    exchange(ops, kInternalTag, deadline, "all_to_all");
    if (sbytes[rank_]) copy_bytes(out + roff[rank_], in + soff[rank_], sbytes[rank_]);
  }

  void p2p(const std::vector<P2POp>& ops, Deadline deadline) override {
    exchange(
        ops, -1, deadline,
        ops.size() == 1 ? (ops[0].kind == P2POp::kSend ? "send" : "recv") : "batch_isend_irecv");
  }

  std::shared_ptr<SharedBuffer::Block> allocate_shared(size_t bytes) override {
    return shm_ ? shm_->allocate_shared(bytes) : nullptr;
  }

  void abort(const std::string& reason) override {
    if (shm_) shm_->abort(reason);
    if (gloo_) gloo_->abort(reason);
    std::lock_guard<std::mutex> lock(pairs_mu_);
    if (abort_reason_.empty()) abort_reason_ = reason.empty() ? "aborted" : reason;
    for (auto& [peer, comm] : pairs_) comm->abort(reason);
  }

 private:
  int num_nodes() const { return static_cast<int>(node_sizes_.size()); }

  // Tags of the collectives built on point-to-point (user tags are ints >= 0).
  static constexpr int64_t kInternalTag = int64_t{1} << 31;

  // The two-rank Gloo context with `peer`, built on first use (a rendezvous of the two through
  // the store, bounded by `deadline`; abort() does not interrupt it).
  GlooComm* pair(int peer, Deadline deadline) {
    {
      std::lock_guard<std::mutex> lock(pairs_mu_);
      if (!abort_reason_.empty())
        throw CollectiveError("rank " + std::to_string(rank_) + ": aborted: " + abort_reason_);
      if (auto it = pairs_.find(peer); it != pairs_.end()) return it->second.get();
    }
    const int lo = std::min(rank_, peer), hi = std::max(rank_, peer);
    auto pair_store = std::make_shared<store::PrefixStore>(
        "p2p/" + std::to_string(lo) + "-" + std::to_string(hi), store_);
    std::unique_ptr<GlooComm> comm;
    try {
      comm = std::make_unique<GlooComm>(*pair_store, rank_ == lo ? 0 : 1, 2, host_, deadline);
    } catch (const CollectiveTimeoutError& e) {
      throw CollectiveTimeoutError("rank " + std::to_string(rank_) + ": rank " +
                                   std::to_string(peer) +
                                   " did not connect for point-to-point in time: " + e.what());
    } catch (const std::exception& e) {
      throw CollectiveError("rank " + std::to_string(rank_) + ": cannot connect to rank " +
                            std::to_string(peer) + " for point-to-point: " + e.what());
    }
    std::lock_guard<std::mutex> lock(pairs_mu_);
    if (!abort_reason_.empty()) comm->abort(abort_reason_);
    return pairs_.emplace(peer, std::move(comm)).first->second.get();
  }

  // Sends and receives `ops` over the pair contexts, all posted before any is waited for. The
  // pairs are built in increasing peer order: every rank then builds its pairs in increasing
  // (lower rank, higher rank) order, so that the rendezvous of a ring cannot wait in a cycle.
  // tag_base >= 0 replaces each op's tag (internal collectives).
  void exchange(const std::vector<P2POp>& ops, int64_t tag_base, Deadline deadline,
                const char* what) {
    if (ops.empty()) return;
    std::vector<int> peers;
    for (const P2POp& op : ops) peers.push_back(op.peer);
    std::sort(peers.begin(), peers.end());
    peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
    for (int p : peers) pair(p, deadline);
    const std::string full = std::string(what) + " on rank " + std::to_string(rank_);
    // The ranks of this node: through shared memory (local_p2p); the others over TCP.
    std::vector<GlooComm::Transfer> transfers;
    std::vector<LocalTransfer> local;
    std::vector<GlooComm*> local_comms;
    for (const P2POp& op : ops) {
      const bool send = op.kind == P2POp::kSend;
      const size_t bytes = op.count * dtype_size(op.dtype);
      const uint32_t tag = static_cast<uint32_t>(tag_base >= 0 ? tag_base : op.tag);
      const std::string peer_name = "rank " + std::to_string(op.peer);
      if (shm_ && place_[op.peer].node == place_[rank_].node) {
        const int peer = place_[op.peer].local;
        LocalTransfer t;
        t.send = send;
        t.data = op.data;
        t.bytes = bytes;
        t.tag = tag;
        t.peer = peer;
        t.channels = shm_->copy_channel(send ? place_[rank_].local : peer, 0);
        t.channel_count = ShmComm::kCopyChannels;
        t.peer_pid = shm_->pid(peer);
        t.may_read = !send && shm_->readable_pid(peer) > 0;
        if (send) {
          const uint64_t off = shm_->shared_offset(op.data, bytes);
          t.shared =
              bytes && off != ShmComm::kNotShared && shm_->maps_shared_areas(peer) ? off + 1 : 0;
        } else {
          t.peer_area = shm_->shared_area(peer);
        }
        t.peer_name = peer_name;
        t.name = full + ": " + (send ? "send to " : "recv from ") + peer_name;
        local.push_back(std::move(t));
        local_comms.push_back(pair(op.peer, deadline));
        continue;
      }
      GlooComm::Transfer t;
      t.comm = pair(op.peer, deadline);
      t.send = send;
      t.data = op.data;
      t.bytes = bytes;
      t.peer = rank_ < op.peer ? 1 : 0;
      t.tag = tag;
      t.peer_name = peer_name;
      transfers.push_back(std::move(t));
    }
    auto run_local = [&] {
      if (local.empty()) return;
      try {
        local_p2p(
            local, place_[rank_].local, deadline,
            [&] {
              shm_->check_aborted(full.c_str());
              for (GlooComm* c : local_comms)
                if (std::string reason = c->abort_reason(); !reason.empty())
                  throw CollectiveError(full + " failed: aborted: " + reason);
            },
            direct_read_failed_);
      } catch (const std::exception& e) {
        // Later messages with these peers fail at once instead of finding stale channels.
        for (GlooComm* c : local_comms) c->abort(e.what());
        throw;
      }
    };
    // A failure aborts the node's segment (guarded): a local peer of this batch then fails at
    // once, even when the TCP part failed before the local copies began.
    guarded([&] {
      if (transfers.empty()) {
        run_local();
      } else {
        GlooComm::p2p(transfers, deadline, full.c_str(), run_local);
      }
    });
  }

  // A leader whose Gloo step fails tells its node at once, so its local peers do not wait for
  // their deadline.
  template <typename Fn>
  void guarded(Fn&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      if (shm_) shm_->abort(e.what());
      throw;
    }
  }

  // Every rank publishes (node_rank, local_rank); all derive the same layout from the full table.
  void discover(const ProcessGroupOptions& o, Deadline deadline) {
    std::ostringstream mine;
    mine << o.node_rank << ' ' << o.local_rank;
    o.store->set("rank/" + std::to_string(rank_), mine.str());
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r) keys.push_back("rank/" + std::to_string(r));
    o.store->wait(keys, remaining(deadline));
    std::vector<std::string> values = o.store->multi_get(keys);
    std::map<std::string, std::vector<std::pair<int, int>>> nodes;  // node key -> (local, rank)
    for (int r = 0; r < size_; ++r) {
      std::istringstream in(values[r]);
      int node = -1, local = -1;
      if (!(in >> node >> local))
        throw CollectiveError("rank " + std::to_string(r) + " published a malformed placement '" +
                              values[r] + "'");
      // Unknown placement: a node of its own.
      std::string key =
          node >= 0 && local >= 0 ? "n" + std::to_string(node) : "r" + std::to_string(r);
      nodes[key].push_back({node >= 0 && local >= 0 ? local : 0, r});
    }
    place_.assign(size_, Placement{});
    // Dense node indices in order of each node's lowest rank, so they agree everywhere.
    std::vector<std::pair<int, std::vector<std::pair<int, int>>>> ordered;
    for (auto& [key, members] : nodes) {
      std::sort(members.begin(), members.end());
      for (size_t i = 1; i < members.size(); ++i)
        if (members[i].first == members[i - 1].first)
          throw CollectiveError("ranks " + std::to_string(members[i - 1].second) + " and " +
                                std::to_string(members[i].second) + " both claim local rank " +
                                std::to_string(members[i].first) + " of node " + key);
      int lowest = size_;
      for (auto& m : members) lowest = std::min(lowest, m.second);
      ordered.push_back({lowest, members});
    }
    std::sort(ordered.begin(), ordered.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    node_sizes_.clear();
    for (size_t n = 0; n < ordered.size(); ++n) {
      const auto& members = ordered[n].second;
      node_sizes_.push_back(static_cast<int>(members.size()));
      for (size_t i = 0; i < members.size(); ++i)
        place_[members[i].second] = Placement{static_cast<int>(n), static_cast<int>(i)};
    }
  }

  int rank_;
  int size_;
  std::vector<Placement> place_;
  std::vector<int> node_sizes_;
  bool identity_ = false;
  std::unique_ptr<ShmComm> shm_;
  bool direct_read_failed_ = false;  // a read of a local peer's memory was refused once
  std::unique_ptr<GlooComm> gloo_;
  std::shared_ptr<store::Store> store_;
  std::string host_ = "127.0.0.1";
  std::mutex pairs_mu_;
  std::map<int, std::unique_ptr<GlooComm>> pairs_;  // under pairs_mu_; entries never removed
  std::string abort_reason_;                        // under pairs_mu_
};

}  // namespace

std::unique_ptr<BackendImpl> make_cpu_backend(const ProcessGroupOptions& options,
                                              Deadline deadline) {
  return std::make_unique<CpuBackend>(options, deadline);
}

}  // namespace trun::worker::detail
