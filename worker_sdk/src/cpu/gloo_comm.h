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

#include "store/store.h"
#include "worker_sdk/src/backend.h"

namespace trun::worker::detail {

class GlooComm {
 public:
  // Collective among the `size` participants; binds `host` (an address of this machine).
  GlooComm(store::Store& store, int rank, int size, const std::string& host, Deadline deadline);
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
  };
  // Posts every transfer (on any number of GlooComms), then waits for all, bounded by
  // `deadline`: posting everything first lets a ring exchange over separate communicators
  // complete. Each message carries its length: a receive whose posted size differs fails with
  // CollectiveError naming both sizes (the sender waits for the receiver's answer before it
  // sends the data). Messages between two participants with the same tag match in posting
  // order. `between` (may be empty) runs once every header has arrived and been answered,
  // before the sends wait for their answers: the transfers within this node (local_p2p) run
  // there, so that neither kind waits for the other. Any failure, `between`'s too, aborts every
  // GlooComm involved (their pending transfers fail, and the peers see closed connections).
  // `what` names the operation in errors.
  static void p2p(const std::vector<Transfer>& transfers, Deadline deadline, const char* what,
                  const std::function<void()>& between = {});
  // Makes the running collective (if any) and every later one fail with CollectiveError naming
  // `reason`. Does not block (reads /proc/self/fd); idempotent (the first reason stays).
  void abort(const std::string& reason);
  // Why abort() was called; "" when it was not.
  std::string abort_reason() const;

  struct State;  // defined in gloo_comm.cpp

 private:
  std::unique_ptr<State> state_;
  int rank_;
  int size_;
};

// The local address to advertise to peers: the one this host uses to reach `peer_host` (no
// packet is sent), 127.0.0.1 when `peer_host` is empty or a loopback name.
std::string local_address_towards(const std::string& peer_host);

}  // namespace trun::worker::detail
