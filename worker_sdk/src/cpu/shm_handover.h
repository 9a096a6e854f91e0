#pragma once
// Handing an unnamed shared-memory segment (a memfd) from local rank 0 to the other ranks of
// its node, over an abstract Unix socket (private to the CPU backend). Local rank 0 listens
// (FdServer) and publishes "<address> <secret>" through the store; each peer connects, shows
// the secret and receives the descriptor (SCM_RIGHTS). Peers must run as the same user (as a
// 0600 segment in /dev/shm would require) and share a network namespace. Errors:
// CollectiveError, CollectiveTimeoutError when local rank 0 waits past the deadline.

#include <string>

#include "worker_sdk/src/backend.h"

namespace trun::worker::detail {

// `bytes` random bytes as lowercase hex (std::random_device).
std::string random_hex(int bytes);

// Local rank 0's side: a listening abstract socket that goes away with the object or the
// process.
class FdServer {
 public:
  explicit FdServer(int backlog);
  ~FdServer();
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

  const std::string& address() const { return address_; }
  const std::string& secret() const { return secret_; }

  // Hands `segment_fd` to `peers` connections that show the secret, or throws at the deadline.
  void serve(int segment_fd, int peers, Deadline deadline);

 private:
  bool hand_over(int c, int segment_fd, Deadline deadline);

  int fd_ = -1;
  std::string address_;
  std::string secret_;
};

// A peer's side: `published` is "<abstract address> <secret>" from the store. Returns the
// segment's descriptor (close-on-exec).
int fetch_segment_fd(const std::string& published, int local_rank, Deadline deadline);

// "WHAT: <strerror(errno)>", for the errors of the shared-memory code's system calls.
std::string errno_text(const char* what);

}  // namespace trun::worker::detail
