#pragma once
// ShmComm: collectives among the ranks of one node through one shared-memory segment.
//
// The segment is created by local rank 0 as an unnamed memfd and handed to the other local ranks
// over an abstract Unix socket (address and a secret passed through the store; peers must run as
// the same user): it never appears in any file system, so nothing can be left behind, whenever
// and however the processes die. With TRUN_SHM_NAMED=1 (or a kernel without memfd_create) it is
// "/trun-<tag>-<random>" in /dev/shm instead (base/shm_names.h), unlinked by whichever rank
// maps it last; a trun agent removes the run's leftovers when the job ends.
//
// Each rank owns one slot of `slot_bytes` in it, and (unnamed segments; TRUN_SHM_A2A_BYTES)
// an all_to_all staging area after the slots, whose pages only large all_to_alls touch. Large
// buffers go through in rounds: each rank copies what its peers need into its slot, reduces its
// own slice in one pass over every rank's copy of it, and the peers copy the reduced slices back
// (reduce-scatter + allgather), with two barriers per round. Slots are small (a few MiB for the
// whole segment) so that a round's data stays in the last-level cache.
//
// After the staging areas, each rank owns a shared buffer area (TRUN_SHM_BUFFER_BYTES; unnamed
// segments only) from which ProcessGroup::shared_buffer allocates: address space in every
// rank, pages only where buffers were used. A send buffer there is read by its receivers
// directly (all_to_all, point-to-point): one copy per byte.
//
// Barriers spin briefly, then yield the core (sched_yield) for up to 2 ms (with more ranks than
// cores, the peers being waited for are often queued on this core), then sleep on a futex in the
// segment that the rank completing the barrier wakes. While waiting, a rank checks the
// deadline, the segment's abort flag and (pidfd) whether its peers are still alive: a peer that
// died, aborted or timed out makes every rank of the node fail instead of waiting.
//
// Every collective but barrier publishes what it was passed (its number on this node, kind,
// dtype, op, root, element or byte count) in the rank's state, and every rank compares all
// ranks' after the collective's first barrier, before it reads a peer's data: ranks whose calls
// differ (8 elements here, 16 there) all fail with the same CollectiveError naming both, and
// abort the segment, instead of reducing mismatched buffers. (barrier only publishes: its peers
// may be gone past it; a rank in another collective sees it.)
//
// Thread safety: collectives from one thread at a time; abort() from any thread.
//
// The implementation, by part: shm_comm.cpp (joining the segment), shm_layout.h (what the
// segment holds), shm_segment.h (creating, opening and mapping it), shm_handover.h (passing
// a memfd to the peers), shm_barrier.cpp (barriers, abort, peers' liveness),
// shm_collectives.cpp (the collectives through the slots), shm_all_to_all.cpp and shm_area.h
// (the shared buffer areas' allocator).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "store/store.h"
#include "worker_sdk/src/backend.h"
#include "worker_sdk/src/cpu/process_memory.h"

namespace trun::worker::detail {

struct ShmHeader;
class SharedArea;
struct ShmSegment;

struct ShmOptions {
  store::Store* store = nullptr;  // namespaced for this node of this group
  int local_rank = 0;
  int local_size = 1;
  std::string tag;        // part of the segment name (sanitized here) and of error messages
  size_t slot_bytes = 0;  // 0: TRUN_SHM_SLOT_BYTES, else see default_slot_bytes()
};

class ShmComm {
 public:
  static constexpr int kMaxLocalSize = 512;
  // Collective among the node's ranks; CollectiveError/CollectiveTimeoutError on failure.
  ShmComm(const ShmOptions& options, Deadline deadline);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  int local_rank() const { return me_; }
  int local_size() const { return n_; }
  const std::string& segment_name() const { return name_; }
  // Local rank r's pid when its memory may be read directly (same pid namespace, TRUN_SHM_CMA
  // not 0), else 0.
  int readable_pid(int r) const;
  // Local rank r's pid, 0 for this rank or when it is in another pid namespace.
  int pid(int r) const { return r != me_ && r >= 0 && r < n_ ? pids_[r] : 0; }
  // Local rank r's k-th channel for messages it sends to a local peer (local_p2p, 2 MiB: its
  // pages are touched only when used), k < kCopyChannels; in the segment, zeroed at creation.
  static constexpr int kCopyChannels = 4;
  CopyChannel* copy_channel(int r, int k) const {
    return channels_ + static_cast<size_t>(r) * kCopyChannels + k;
  }

  // In place; op is kSum, kMin or kMax.
  void allreduce(void* data, size_t count, DataType dtype, ReduceOp op, Deadline deadline);
  void broadcast(void* data, size_t bytes, int root, Deadline deadline);
  // recv holds local_size() blocks of `bytes`, in local rank order.
  void allgather(const void* send, void* recv, size_t bytes, Deadline deadline);
  // send holds local_size() blocks of `count` elements, in local rank order.
  void reduce_scatter(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      Deadline deadline);
  // Block j of send (send_bytes[j] bytes at send_offsets[j]) goes to local rank j; block i of
  // recv (recv_bytes[i] at recv_offsets[i]) comes from local rank i. Every rank first publishes
  // its sizes, offsets and send buffer's address (one small allgather), so that a send size
  // that differs from its receive size fails on every rank with the same CollectiveError. When
  // every rank's send buffer lies in its shared buffer area, each rank copies its blocks
  // straight out of its peers' areas and a barrier ends it. Else one of two paths, the same on
  // every rank: rounds of one sub-slot per pair through the
  // staging area (else the slots; one barrier per round, two rounds in flight where the
  // sub-slots allow; large copies in and out with non-temporal stores), when blocks and
  // sub-slots are at least 256 KiB; else each rank reads its blocks straight out of its peers'
  // send buffers (process_vm_readv, large blocks through a bounce buffer) and a second small
  // allgather ends it. Where direct reads are not possible (a peer in another pid namespace,
  // TRUN_SHM_CMA=0, or a read refused once), the rounds.
  void all_to_all_v(const void* send, const size_t* send_offsets, const size_t* send_bytes,
                    void* recv, const size_t* recv_offsets, const size_t* recv_bytes,
                    Deadline deadline);
  void barrier(Deadline deadline);
  // A zero-filled block of this rank's shared buffer area, or nullptr when it has none or no
  // free range is large enough. Any thread. The block keeps the areas mapped.
  std::shared_ptr<SharedBuffer::Block> allocate_shared(size_t bytes);
  static constexpr uint64_t kNotShared = ~uint64_t{0};
  // Offset of [p, p + bytes) in this rank's shared buffer area, kNotShared when not all in it.
  uint64_t shared_offset(const void* p, size_t bytes) const;
  // Local rank r's shared buffer area, as mapped here (nullptr: none, or not mapped here).
  const char* shared_area(int r) const {
    return bufs_ ? bufs_ + static_cast<size_t>(r) * buf_bytes_ : nullptr;
  }
  // Whether local rank r mapped the shared buffer areas (so it can read this rank's).
  bool maps_shared_areas(int r) const;
  void abort(const std::string& reason);
  // Throws the CollectiveError of the segment's abort, if a rank of the node aborted it (for
  // waits outside this class: the point-to-point copy channels).
  void check_aborted(const char* what);

 private:
  char* slot(int r) const { return data_ + static_cast<size_t>(r) * slot_bytes_; }
  // What a rank passed to a collective (shm_collectives.cpp); 0xff: not used by the kind.
  enum class CallKind : uint8_t {
    kAllreduce = 1,
    kBroadcast,
    kAllgather,
    kReduceScatter,
    kAllToAll,
    kBarrier
  };
  struct Call {
    CallKind kind = CallKind::kBarrier;
    uint8_t dtype = 0xff;
    uint8_t op = 0xff;
    int32_t root = -1;
    uint64_t size = 0;
  };
  // Numbers and publishes this rank's call; with `check`, the next barrier compares every
  // rank's (check_calls) once all arrived.
  void publish_call(const Call& call, bool check);
  // CollectiveError (after aborting the segment) if a rank's call differs from local rank 0's.
  void check_calls();
  // check_calls' slow path: names the ranks whose call differs from the majority's, then throws.
  [[noreturn]] void mismatch();
  void allgather_slots(const void* send, void* recv, size_t bytes, Deadline deadline);
  void arrive_and_wait(Deadline deadline, const char* what);
  bool all_arrived(uint32_t target) const;
  void wait_for_all(uint32_t target, Deadline deadline, const char* what);
  [[noreturn]] void fail_aborted(const char* what);
  void check_peers_alive(const char* what);
  void set_abort(const std::string& reason);
  bool cma_usable() const;
  // Copies `bytes` at address `remote` of local rank r's process to dst; "" or why not.
  std::string read_peer(int r, char* dst, uint64_t remote, size_t bytes);

  // The constructor's steps (shm_comm.cpp), after the segment is mapped.
  void adopt_segment(ShmSegment& seg);
  void publish_segment(const ShmSegment& seg, store::Store& store, Deadline deadline);
  void check_segment_header(const ShmSegment& seg);
  void register_rank();
  void tune_waits();
  void watch_peers();

  // all_to_all_v's steps (shm_all_to_all.cpp).
  struct A2aCall;
  struct A2aTable;
  struct A2aStaging;
  A2aTable a2a_exchange(const A2aCall& c, Deadline deadline);
  void a2a_from_areas(const A2aCall& c, const A2aTable& t, Deadline deadline);
  bool a2a_direct(const A2aCall& c, const A2aTable& t, Deadline deadline);
  A2aStaging a2a_staging() const;
  void a2a_rounds(const A2aCall& c, const A2aStaging& s, uint64_t longest, Deadline deadline);

  int me_ = 0;
  int n_ = 1;
  bool named_ = false;  // segment shared by name in /dev/shm (else an unnamed memfd)
  std::string name_;
  size_t slot_bytes_ = 0;
  std::shared_ptr<void> mapping_;  // the segment but the shared buffer areas
  ShmHeader* hdr_ = nullptr;
  char* data_ = nullptr;
  // all_to_all's staging area, a2a_bytes_ per rank after the slots (0: the slots serve).
  size_t a2a_bytes_ = 0;
  char* a2a_ = nullptr;
  // The shared buffer areas, buf_bytes_ per rank after the staging areas (0: none), and the
  // allocator of this rank's.
  size_t buf_bytes_ = 0;
  char* bufs_ = nullptr;                 // nullptr also when they could not be mapped here
  std::shared_ptr<void> areas_mapping_;  // unmaps them with its last holder (SharedBuffers)
  std::shared_ptr<SharedArea> area_;
  std::atomic<bool> area_full_noted_{false};
  CopyChannel* channels_ = nullptr;  // local_size() * kCopyChannels, after the header
  uint32_t seq_ = 0;
  std::string group_;           // ShmOptions::tag, for error messages
  uint32_t calls_ = 0;          // collectives entered (publish_call)
  bool check_pending_ = false;  // the next barrier runs check_calls
  int spin_limit_ = 0;
  bool core_each_ = false;  // this rank may use at least local_size() CPUs
  Clock::duration yield_for_ = std::chrono::milliseconds(2);  // sched_yield phase of a wait
  std::vector<int> pidfds_;  // per local rank; -1 for self or when unavailable
  std::vector<int> pids_;
  std::vector<const void*> srcs_;  // scratch for the reduce step
  bool cma_failed_ = false;        // a cross-memory read failed once: all_to_all uses rounds
};

}  // namespace trun::worker::detail
