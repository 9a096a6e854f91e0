#pragma once
// Private to rendezvous/: the leader of a dynamic-rendezvous round (the node holding ticket 1). It
// decides when the round completes (dynamic_decisions.h: decide_leader, check_quorum), reads the
// members' descriptors, ranks them and writes the result. DynamicRendezvous runs it on the
// joining thread; bench/rdzv_bench runs it for simulated agents.
//
// Thread safety: one lead() at a time; the backend must be usable from the calling thread.

#include <string>
#include <vector>

#include "rendezvous/backend.h"
#include "rendezvous/dynamic_decisions.h"
#include "rendezvous/handler.h"

namespace trun::rendezvous {

class RoundLeader {
 public:
  // Keeps references to all three: they must outlive the leader. `prefix` starts log lines.
  RoundLeader(RendezvousBackend& backend, const dynamic::Keys& keys,
              const RendezvousOptions& options, std::string prefix);

  // Leads round j: returns when its result exists (written here or by someone else: an abort, a
  // close) or at `deadline`; the caller then reads the result like every other node.
  void lead(int64_t j, dynamic::TimePoint deadline);
  // The last quorum check that failed (held.ok is false then), for the caller's timeout message.
  const dynamic::QuorumCheck& held() const { return held_; }

  // Descriptors fetched per MULTI_GET (the store's limit is 65536 keys per request).
  static constexpr size_t kKeysPerRequest = 16384;

 private:
  struct Quorum {
    int64_t round;
    const dynamic::RoundResult* result;
    const std::vector<dynamic::OverRecord>* over;
  };
  dynamic::Duration descriptor_wait() const;
  bool quorum_applies() const;
  std::string quorum_line(int64_t j, int64_t prev) const;
  bool complete(int64_t j, int available, int count, const Quorum* quorum);
  std::vector<std::string> multi_get(const std::vector<std::string>& keys);
  // Round `round`'s result with every member, from Keys::members (a partial result's list).
  dynamic::RoundResult whole_result(int64_t round);

  RendezvousBackend& backend_;
  const dynamic::Keys& keys_;
  const RendezvousOptions& options_;
  std::string prefix_;
  dynamic::QuorumCheck held_;
};

}  // namespace trun::rendezvous
