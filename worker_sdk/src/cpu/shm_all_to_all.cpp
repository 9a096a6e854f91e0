// ShmComm::all_to_all_v (shm_comm.h) and its three paths: straight out of the peers' shared
// buffer areas, direct reads of the peers' memory (cross-memory attach), or rounds through the
// staging area (else the slots). Every rank first publishes its sizes and buffer (one small
// allgather), and every rank takes the same path, decided from that table. Members of ShmComm.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/check.h"
#include "worker_sdk/src/cpu/process_memory.h"
#include "worker_sdk/src/cpu/shm_comm.h"
#include "worker_sdk/src/cpu/shm_layout.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker::detail {

namespace {
bool cma_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("TRUN_SHM_CMA");
    return !(v && std::string(v) == "0");
  }();
  return enabled;
}
}  // namespace

int ShmComm::readable_pid(int r) const {
  return cma_enabled() && r != me_ && r >= 0 && r < n_ ? pids_[r] : 0;
}

bool ShmComm::cma_usable() const {
  if (cma_failed_ || !cma_enabled()) return false;
  for (int r = 0; r < n_; ++r)
    if (r != me_ && pids_[r] <= 0) return false;  // another pid namespace: no pid to read from
  return true;
}

std::string ShmComm::read_peer(int r, char* dst, uint64_t remote, size_t bytes) {
  return read_process_memory(pids_[r], "local rank " + std::to_string(r), dst, remote, bytes);
}

// One call's buffers. Large receives are written with non-temporal stores: nothing reads them
// back soon, and the copies are limited by memory bandwidth. So are large sends into the
// staging area (see a2a_rounds).
struct ShmComm::A2aCall {
  const char* in;
  const size_t* send_offsets;
  const size_t* send_bytes;
  char* out;
  const size_t* recv_offsets;
  const size_t* recv_bytes;
  bool stream_in;
  bool stream_out;

  void copy_own_block(int me) const {
    if (send_bytes[me])
      copy_or_stream(stream_out, out + recv_offsets[me], in + send_offsets[me], send_bytes[me]);
  }
};

// Row i: local rank i's send sizes, receive sizes, send offsets, the address of its send
// buffer, whether it can read its peers' memory (cross-memory attach), and where its send
// buffer lies in its shared buffer area (kNotShared: elsewhere).
struct ShmComm::A2aTable {
  int n = 1;
  size_t w = 0;  // row width
  std::vector<uint64_t> rows;
  uint64_t longest = 0;  // the largest block between two different ranks
  bool cma = true;       // every rank can read its peers' memory
  bool shared = true;    // every send buffer lies in its rank's shared buffer area

  uint64_t send_offset(int i, int j) const { return rows[i * w + 2 * n + j]; }
  uint64_t address(int i) const { return rows[i * w + 3 * n]; }
  uint64_t shared_offset(int i) const { return rows[i * w + 3 * n + 2]; }
};

// The staged rounds' geometry: through the staging area when there is one, else through the
// slots; two rounds in flight (each in one half of every rank's part) when the halves are big
// enough.
struct ShmComm::A2aStaging {
  size_t stage_bytes = 0;  // per rank
  int depth = 1;           // rounds in flight
  size_t part = 0;         // stage_bytes / depth
  size_t sub_bytes = 0;    // one pair's share of a part, whole cache lines
};

ShmComm::A2aTable ShmComm::a2a_exchange(const A2aCall& c, Deadline deadline) {
  A2aTable t;
  t.n = n_;
  t.w = 3 * static_cast<size_t>(n_) + 3;
  const size_t w = t.w;
  size_t send_extent = 0;
  for (int j = 0; j < n_; ++j)
    send_extent = std::max(send_extent, c.send_offsets[j] + c.send_bytes[j]);
  std::vector<uint64_t> mine(w);
  t.rows.resize(w * n_);
  for (int j = 0; j < n_; ++j) {
    mine[j] = c.send_bytes[j];
    mine[n_ + j] = c.recv_bytes[j];
    mine[2 * n_ + j] = c.send_offsets[j];
  }
  mine[3 * n_] = reinterpret_cast<uintptr_t>(c.in);
  mine[3 * n_ + 1] = cma_usable() ? 1 : 0;
  mine[3 * n_ + 2] = shared_offset(c.in, send_extent);
  allgather_slots(mine.data(), t.rows.data(), w * sizeof(uint64_t), deadline);
  const std::vector<uint64_t>& table = t.rows;
  for (int i = 0; i < n_; ++i) {
    t.cma = t.cma && table[i * w + 3 * n_ + 1] == 1;
    t.shared = t.shared && table[i * w + 3 * n_ + 2] != kNotShared;
    for (int j = 0; j < n_; ++j) {
      const uint64_t sent = table[i * w + j];           // i -> j, as i says
      const uint64_t expected = table[j * w + n_ + i];  // i -> j, as j says
      if (sent != expected)
        throw CollectiveError("all_to_all on local rank " + std::to_string(me_) + ": local rank " +
                              std::to_string(i) + " sends " + std::to_string(sent) +
                              " bytes to local rank " + std::to_string(j) + ", which expects " +
                              std::to_string(expected));
      if (i != j) t.longest = std::max(t.longest, sent);
    }
  }
  return t;
}

// Every send buffer is a SharedBuffer: each rank copies its blocks straight out of its peers'
// (the table's allgather was the barrier that has them all written), then a barrier keeps every
// send buffer untouched until its readers are done. One copy per byte. (A rank that could not
// map the areas has none of its own, so its row says kNotShared.)
void ShmComm::a2a_from_areas(const A2aCall& c, const A2aTable& t, Deadline deadline) {
  for (int src = 0; src < n_; ++src) {
    if (src == me_ || c.recv_bytes[src] == 0) continue;
    copy_or_stream(c.stream_out, c.out + c.recv_offsets[src],
                   shared_area(src) + t.shared_offset(src) + t.send_offset(src, me_),
                   c.recv_bytes[src]);
  }
  c.copy_own_block(me_);
  arrive_and_wait(deadline, "all_to_all");
}

// One copy per block, straight from each peer's send buffer (process_vm_readv); then an
// allgather of the outcomes, which is also the barrier that keeps every send buffer untouched
// until its readers are done. If any rank failed to read (EPERM under a seccomp or ptrace
// policy, say), all return false (to fall back to the staged rounds), and stop trying for this
// segment.
bool ShmComm::a2a_direct(const A2aCall& c, const A2aTable& t, Deadline deadline) {
  std::string why;
  for (int src = 0; src < n_ && why.empty(); ++src) {
    if (src == me_ || c.recv_bytes[src] == 0) continue;
    const uint64_t remote = t.address(src) + t.send_offset(src, me_);
    why = read_peer(src, c.out + c.recv_offsets[src], remote, c.recv_bytes[src]);
  }
  uint64_t ok = why.empty() ? 1 : 0;
  std::vector<uint64_t> oks(n_);
  allgather_slots(&ok, oks.data(), sizeof ok, deadline);
  if (std::all_of(oks.begin(), oks.end(), [](uint64_t v) { return v == 1; })) return true;
  cma_failed_ = true;
  if (!why.empty())
    std::fprintf(stderr,
                 "[trun.worker] all_to_all: cannot read a local peer's memory (%s); using "
                 "the shared-memory rounds from now on\n",
                 why.c_str());
  return false;
}

ShmComm::A2aStaging ShmComm::a2a_staging() const {
  A2aStaging s;
  s.stage_bytes = a2a_bytes_ ? a2a_bytes_ : slot_bytes_;
  s.depth = s.stage_bytes / 2 / n_ >= kStagedMinSubBytes ? 2 : 1;
  s.part = s.stage_bytes / s.depth;
  s.sub_bytes = (s.part / n_) / kShmLine * kShmLine;
  return s;
}

// A round moves one sub-slot per pair: the sender copies in, the receiver copies out. With two
// rounds in flight, rounds alternate between the halves of each part and one barrier per round
// is enough: a rank writes half h in round r only after the barrier of round r - 1, which every
// rank reaches after it has copied out of half h in round r - 2. With one, a second barrier ends
// each round before the part is written again.
void ShmComm::a2a_rounds(const A2aCall& c, const A2aStaging& s, uint64_t longest,
                         Deadline deadline) {
  TRUN_CHECK_GT(s.sub_bytes, 0u,
                "staging of " << s.stage_bytes << " bytes, " << n_ << " local ranks");
  auto stage = [&](int r) { return a2a_bytes_ ? a2a_ + r * a2a_bytes_ : slot(r); };
  const size_t sub_bytes = s.sub_bytes;
  uint64_t round = 0;
  for (uint64_t off = 0; off < longest; off += sub_bytes, ++round) {
    const size_t h = (round % s.depth) * s.part;
    for (int d = 0; d < n_; ++d) {
      if (d == me_ || c.send_bytes[d] <= off) continue;
      copy_or_stream(c.stream_in, stage(me_) + h + d * sub_bytes, c.in + c.send_offsets[d] + off,
                     std::min<uint64_t>(sub_bytes, c.send_bytes[d] - off));
    }
    arrive_and_wait(deadline, "all_to_all");
    for (int src = 0; src < n_; ++src) {
      if (src == me_ || c.recv_bytes[src] <= off) continue;
      copy_or_stream(c.stream_out, c.out + c.recv_offsets[src] + off,
                     stage(src) + h + me_ * sub_bytes,
                     std::min<uint64_t>(sub_bytes, c.recv_bytes[src] - off));
    }
    if (s.depth == 1) arrive_and_wait(deadline, "all_to_all");
  }
  c.copy_own_block(me_);
  // Nobody returns (and writes its slot for the next collective) while a peer still reads it.
  // The staging area needs no such barrier: the next all_to_all writes it only after its
  // allgather, which nobody passes before every rank has entered it.
  if (s.depth == 2 && round > 0 && !a2a_bytes_) arrive_and_wait(deadline, "all_to_all");
}

void ShmComm::all_to_all_v(const void* send, const size_t* send_offsets, const size_t* send_bytes,
                           void* recv, const size_t* recv_offsets, const size_t* recv_bytes,
                           Deadline deadline) {
  if (n_ == 1 && send_bytes[0] != recv_bytes[0])
    throw CollectiveError("all_to_all: sends " + std::to_string(send_bytes[0]) +
                          " bytes to itself but receives " + std::to_string(recv_bytes[0]));
  size_t total_recv = 0, total_send = 0;
  for (int j = 0; j < n_; ++j) total_recv += recv_bytes[j], total_send += send_bytes[j];
  const A2aCall c{static_cast<const char*>(send),
                  send_offsets,
                  send_bytes,
                  static_cast<char*>(recv),
                  recv_offsets,
                  recv_bytes,
                  /*stream_in=*/total_send >= kStreamMinBytes,
                  /*stream_out=*/total_recv >= kStreamMinBytes};
  if (n_ == 1) {
    c.copy_own_block(me_);
    return;
  }
  // Sizes differ from rank to rank; the table's exchange compares them.
  publish_call({CallKind::kAllToAll, 0xff, 0xff, -1, 0}, true);
  const A2aTable t = a2a_exchange(c, deadline);
  if (t.shared) {
    a2a_from_areas(c, t, deadline);
    return;
  }
  // Staged or direct. A round moves one sub-slot per pair through the staging area (or the
  // slots): the sender copies in, the receiver copies out, both with non-temporal stores when
  // large, so each byte crosses memory once each way and every copy is in user space; a direct
  // read is one copy, but the kernel's (process_vm_readv), which costs about three times the
  // CPU time per byte here. Measured (2 cores, 64 MiB per rank, streamed copies in and out,
  // 16 MiB staging per rank): 4 ranks, rounds 5.5-5.7 GB/s against direct reads' 2.3-2.7;
  // 8 ranks, 1.9-2.6 against 1.3. So rounds wherever sub-slots are at least 256 KiB, and
  // direct reads for smaller ones (many local ranks) or messages that short. Every rank must
  // take the same path: decided from the table, which all share.
  const A2aStaging s = a2a_staging();
  const bool staged = s.sub_bytes >= kStagedMinSubBytes && t.longest >= kStagedMinSubBytes;
  if (t.cma && !staged && t.longest > 0 && a2a_direct(c, t, deadline)) {
    c.copy_own_block(me_);
    return;
  }
  a2a_rounds(c, s, t.longest, deadline);
}

}  // namespace trun::worker::detail
