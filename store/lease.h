#pragma once
// Lease: one connection's lease (trun extension: LEASE_ARM / LEASE_RENEW / LEASE_RELEASE, see
// wire.h and LeaseSpec in tcp_store.h), private to store/. A notification bound to the
// connection, fired when it closes or its keep-alives stop for a ttl: a_key := a_value when a_key
// is missing, otherwise b_value appended to b_key.
//
// I/O-free: the connection owns the ttl timer. restart() starts a ttl period and returns its
// generation; a timer that expires with current(generation) false is stale (renewed, released or
// fired meanwhile). Thread safety: none (the server's event-loop thread).

#include <cstdint>
#include <string>

#include "store/kv_state.h"
#include "store/wire.h"

namespace trun::store {

class Lease {
 public:
  // LEASE_ARM, its ttl (r.number) already checked to be >= 0: sets keys[0] to values[0] when
  // keys[0] is not empty (waking its waiters), and arms the lease, replacing one armed before.
  // The caller then restart()s the timer.
  void arm(wire::Request r, KvState& kv);
  // LEASE_RENEW (ttl >= 0): a ttl > 0 replaces the lease's. False when none is armed; when it
  // returns true the caller restart()s the timer.
  bool renew(int64_t ttl_ms);
  // LEASE_RELEASE: disarms without firing. False when none was armed.
  bool release();

  bool armed() const { return armed_; }
  int64_t ttl_ms() const { return ttl_ms_; }  // 0: bound to the connection only
  uint64_t restart() { return ++generation_; }
  bool current(uint64_t generation) const { return armed_ && generation_ == generation; }

  // The key fire() writes: a_key when it is named and missing, otherwise b_key.
  const std::string& target(const KvState& kv) const;
  // Disarms and performs the notification, waking the key's waiters (b_value is dropped if the
  // append would pass the value size limit; the waiters wake all the same). Nothing when not
  // armed.
  void fire(KvState& kv);

 private:
  bool armed_ = false;
  wire::Request spec_;  // keys[0..2] / values[0..2]: set, a, b, as sent by LEASE_ARM
  int64_t ttl_ms_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace trun::store
