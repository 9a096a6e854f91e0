#include "store/lease.h"

namespace trun::store {

void Lease::arm(wire::Request r, KvState& kv) {
  if (!r.keys[0].empty()) {
    kv.set(r.keys[0], r.values[0]);
    kv.notify(r.keys[0]);
  }
  spec_ = std::move(r);
  ttl_ms_ = spec_.number;
  armed_ = true;
}

bool Lease::renew(int64_t ttl_ms) {
  if (armed_ && ttl_ms > 0) ttl_ms_ = ttl_ms;
  return armed_;
}

bool Lease::release() {
  bool was = armed_;
  armed_ = false;
  ++generation_;
  return was;
}

const std::string& Lease::target(const KvState& kv) const {
  const std::string& a_key = spec_.keys[1];
  return !a_key.empty() && !kv.find(a_key) ? a_key : spec_.keys[2];
}

void Lease::fire(KvState& kv) {
  if (!armed_) return;
  armed_ = false;
  ++generation_;
  const std::string& a_key = spec_.keys[1];
  const std::string& b_key = spec_.keys[2];
  if (!a_key.empty() && !kv.find(a_key)) {
    kv.set(a_key, spec_.values[1]);
    kv.notify(a_key);
  } else if (!b_key.empty()) {
    kv.append(b_key, spec_.values[2]);  // over the limit: the key's waiters still wake
    kv.notify(b_key);
  }
}

}  // namespace trun::store
