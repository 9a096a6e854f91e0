#pragma once
// GlooComm: collectives over Gloo's TCP transport among one process per node (or per rank),
// with trun's Store standing in for Gloo's rendezvous store. Private to libtrun_worker; Gloo
// headers stay in gloo_comm.cpp.
//
// Failures: a peer whose connection closes makes the collective fail at once (Gloo raises an I/O
// error); a stalled peer, at the deadline. Both become CollectiveError/CollectiveTimeoutError.
// abort() shuts down this participant's connections (shutdown(2) on its own sockets, found by
// their local addresses): Gloo's event loop reads end-of-stream and fails the operations pending
// on them, so a collective waiting for a peer fails at once with a CollectiveError naming the
// reason, and each peer reads end-of-stream too. Gloo's Context::closeConnections() is not used:
// it closes the sockets without waking a waiting collective (it runs on to its deadline).
// SIGPIPE: Gloo does not suppress it, so building a GlooComm sets it to SIG_IGN when it still has
// its default action (a dead peer then shows up as an error, not as this process's death).
// Thread safety: one collective at a time; abort() from any thread, also during a collective
// (never concurrently with the destructor).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rendezvous/store/store.h"
#include "worker_sdk/src/backend.h"
#include "worker_sdk/src/cpu/process_memory.h"

namespace trun::worker::detail {

class GlooComm {
 public:
  // Collective among the `size` participants; binds `host` (an address of this machine).
  GlooComm(rendezvous::Store& store, int rank, int size, const std::string& host,
           Deadline deadline);
  ~GlooComm();

  int rank() const { return rank_; }
  int size() const { return size_; }
  void allreduce(void* data, size_t count, DataType dtype, ReduceOp op, Deadline deadline);
  void broadcast(void* data, size_t bytes, int root, Deadline deadline);
  void allgather(const void* send, void* recv, size_t bytes, Deadline deadline);
  void barrier(Deadline deadline);

  // One point-to-point transfer with participant `peer` (!= rank()) of `comm`.
  struct Transfer {
    GlooComm* comm = nullptr;
    bool send = true;
    void* data = nullptr;
    size_t bytes = 0;
    int peer = 0;
    uint32_t tag = 0;
    std::string peer_name;  // for messages, e.g. "rank 3"
    // The peer is a process on this machine: its pid (in this pid namespace), so that the data
    // is read straight from its memory (process_vm_readv) instead of sent over TCP. 0: over
    // TCP. A receive needs it for that; a send, to notice a receiver that died (below).
    int peer_pid = 0;
    // Both processes on one node sharing a segment (ShmComm): a send's own channel (distinct
    // per pending send) and a receive's sender's kCopyChannels channels. With both, a message
    // of at least kSharedCopyMinBytes is copied by the two processes at once (CopyChannel).
    CopyChannel* channel = nullptr;
    int channel_index = 0;  // of `channel` among the sender's
    CopyChannel* peer_channels = nullptr;
    int peer_channel_count = 0;
  };
  // Posts every transfer (on any number of GlooComms), then waits for all, bounded by
  // `deadline`: posting everything first lets a ring exchange over separate communicators
  // complete. Each message carries its length: a receive whose posted size differs fails with
  // CollectiveError naming both sizes. A send completes once the receiver has the data (read
  // directly, see Transfer::peer_pid, or received). A direct read that fails once (EPERM under
  // a seccomp or ptrace policy) makes this GlooComm send data over TCP from then on. Messages
  // between two participants with the same tag match in posting order. Any failure aborts every
  // GlooComm involved (their pending transfers fail, and the peers see closed connections). `what`
  // names the operation in errors.
  static void p2p(const std::vector<Transfer>& transfers, Deadline deadline, const char* what);
  // Makes the running collective (if any) and every later one fail with CollectiveError naming
  // `reason`. Does not block (reads /proc/self/fd); idempotent (the first reason stays).
  void abort(const std::string& reason);

  struct State;  // defined in gloo_comm.cpp

 private:
  std::unique_ptr<State> state_;
  bool direct_read_failed_ = false;  // see p2p()
  int rank_;
  int size_;
};

// The local address to advertise to peers: the one this host uses to reach `peer_host` (no
// packet is sent), 127.0.0.1 when `peer_host` is empty or a loopback name.
std::string local_address_towards(const std::string& peer_host);

}  // namespace trun::worker::detail
