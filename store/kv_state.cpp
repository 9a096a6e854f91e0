#include "store/kv_state.h"

#include <algorithm>
#include <unordered_set>

#include "base/decimal.h"

namespace trun::store {

using wire::Op;

KvState::Outcome KvState::execute(Waiter waiter, wire::Request& r, std::string* out) {
  wire::Encoder enc(out);
  Outcome done;
  auto close = [](std::string why) {
    Outcome o;
    o.kind = Outcome::Kind::kClose;
    o.why = std::move(why);
    return o;
  };

  switch (r.op) {
    case Op::kSet:
      set(r.keys[0], std::move(r.values[0]));
      notify(r.keys[0]);
      return done;
    case Op::kAppend:
      if (!append(r.keys[0], r.values[0])) {
        return close("append would grow '" + r.keys[0] + "' past the value size limit");
      }
      notify(r.keys[0]);
      return done;
    case Op::kMultiSet:
      // Key by key: the waiters of each key wake before the next key is written.
      for (size_t i = 0; i < r.keys.size(); ++i) {
        set(r.keys[i], std::move(r.values[i]));
        notify(r.keys[i]);
      }
      return done;
    case Op::kCompareSet: {
      bool swapped = false;
      enc.bytes(compare_set(r.keys[0], r.values[0], r.values[1], &swapped));
      if (swapped) notify(r.keys[0]);
      return done;
    }
    case Op::kAdd:
    case Op::kBarrier: {
      // BARRIER counts arrivals in the key's decimal value, as ADD does; the arrival that
      // reaches the world size (r.number) releases everyone waiting on the key.
      const std::string& key = r.keys[0];
      auto value = add(key, r.op == Op::kAdd ? r.number : 1);
      if (!value) {
        return close(std::string(wire::op_name(r.op)) + " on key '" + key +
                     "' whose value is not an integer");
      }
      if (r.op == Op::kAdd) {
        enc.i64(*value);
        notify(key);
        return done;
      }
      // Every arrival writes the key, so it wakes the key's waits (a WAIT or GET on it, and the
      // arrivals parked with a world size the count has now reached), as ADD does.
      notify(key);
      if (*value >= r.number) {
        enc.u8(wire::kWaitStop);
        return done;
      }
      // Wait until the count reaches r.number (park_barrier). A timed-out client sends
      // CANCEL_WAIT, as after a WAIT.
      return park_barrier(waiter, key, r.number);
    }
    case Op::kListKeys:
      enc.i64(static_cast<int64_t>(data_.size()));
      for (const auto& kv : data_) enc.bytes(kv.first);
      return done;
    case Op::kCheck:
      enc.u8(all_present(r.keys, true) ? wire::kCheckReady : wire::kCheckNotReady);
      return done;
    case Op::kNumKeys:
      enc.i64(static_cast<int64_t>(num_keys()));
      return done;
    case Op::kDeleteKey:
      enc.i64(erase(r.keys[0]) ? 1 : 0);
      return done;
    case Op::kQueuePush:
      queue_push(r.keys[0], std::move(r.values[0]));
      notify(r.keys[0], /*first_only=*/true);
      return done;
    case Op::kQueuePop: {
      // The length before the pop, then the front element when there is one.
      size_t n = queue_len(r.keys[0]);
      enc.i64(static_cast<int64_t>(n));
      if (n > 0) enc.bytes(*queue_pop(r.keys[0]));
      return done;
    }
    case Op::kQueueLen:
      enc.i64(static_cast<int64_t>(queue_len(r.keys[0])));
      return done;
    case Op::kWait:
    case Op::kWaitKeys:
    case Op::kGet:
    case Op::kGetWait:
    case Op::kMultiGet:
      return wait_or_get(waiter, r, out);
    default:
      return close(std::string("not a key-value request: ") + wire::op_name(r.op));
  }
}

KvState::Outcome KvState::wait_or_get(Waiter waiter, wire::Request& r, std::string* out) {
  wire::Encoder enc(out);
  if (r.op == Op::kGetWait && r.keys.size() != 1) {  // the decoder refuses it already
    Outcome o;
    o.kind = Outcome::Kind::kClose;
    o.why = "GET_TIMEOUT takes one key, not " + std::to_string(r.keys.size());
    return o;
  }
  std::vector<std::string> missing;
  std::unordered_set<std::string_view> seen;
  // A WAIT is also satisfied by a non-empty queue (queue_pop(block=True) is WAIT + QUEUE_POP).
  const bool queues_count = r.op == Op::kWait || r.op == Op::kWaitKeys;
  for (auto& k : r.keys) {
    if (!present(k, queues_count) && seen.insert(k).second) missing.push_back(k);
  }
  if (!missing.empty()) {
    int64_t timeout_ms = (r.op == Op::kWaitKeys || r.op == Op::kGetWait) ? r.number : -1;
    if (timeout_ms > wire::kMaxWaitTimeoutMs) timeout_ms = -1;  // "forever", not an overflow
    if (timeout_ms == 0) {
      enc.u8(wire::kWaitTimedOut);
      return {};
    }
    return park(waiter, std::move(missing), std::move(r), timeout_ms);
  }
  switch (r.op) {
    case Op::kWait:
    case Op::kWaitKeys:
      enc.u8(wire::kWaitStop);
      break;
    case Op::kGetWait:
      enc.u8(wire::kWaitStop);
      enc.bytes(*find(r.keys[0]));
      break;
    case Op::kGet:
      enc.bytes(*find(r.keys[0]));
      break;
    default: {  // kMultiGet
      uint64_t total = 0;
      for (auto& k : r.keys) total += find(k)->size();
      if (total > limits_.max_value_bytes) {
        Outcome o;
        o.kind = Outcome::Kind::kClose;
        o.why = "MULTI_GET of " + std::to_string(r.keys.size()) + " keys would answer " +
                std::to_string(total) + " bytes of values, more than the limit of " +
                std::to_string(limits_.max_value_bytes) + " (the value size limit)";
        return o;
      }
      for (auto& k : r.keys) enc.bytes(*find(k));
    }
  }
  return {};
}

KvState::Outcome KvState::park(Waiter waiter, std::vector<std::string> missing,
                               wire::Request request, int64_t timeout_ms) {
  cancel(waiter);  // a new wait replaces a pending one (a 1.13 WAIT given up by its client)
  Parked& p = parked_[waiter];
  p.wait_id = next_wait_id_++;
  p.remaining = missing.size();
  p.keys = std::move(missing);
  p.request = std::move(request);
  for (auto& k : p.keys) waiters_[k].emplace_back(waiter, p.wait_id);
  Outcome o;
  o.kind = Outcome::Kind::kPark;
  o.wait_id = p.wait_id;
  o.timeout_ms = timeout_ms;
  return o;
}

// A barrier arrival waits apart from the key's other waiters: a write of the key wakes it only
// once the count there reaches its world size (notify), not at every arrival. Woken, it runs as a
// WAIT on the key, which exists by then: STOP_WAITING.
KvState::Outcome KvState::park_barrier(Waiter waiter, const std::string& key, int64_t n) {
  cancel(waiter);
  Parked& p = parked_[waiter];
  p.wait_id = next_wait_id_++;
  p.remaining = 1;
  p.keys = {key};
  p.barrier = true;
  p.request.op = Op::kWait;
  p.request.keys = {key};
  BarrierWaiters& b = barriers_[key];
  b.list.push_back({waiter, p.wait_id, n});
  b.lowest = std::min(b.lowest, n);
  Outcome o;
  o.kind = Outcome::Kind::kPark;
  o.wait_id = p.wait_id;
  o.timeout_ms = -1;
  return o;
}

// The barrier arrivals parked on `key` whose world size the count there has reached.
void KvState::release_barriers(const std::string& key) {
  auto it = barriers_.find(key);
  if (it == barriers_.end()) return;
  int64_t count = 0;
  const std::string* value = find(key);
  if (!value || !base::parse_decimal(*value, &count) || count < it->second.lowest) return;
  std::vector<BarrierWaiter> ready;
  BarrierWaiters rest;
  for (const auto& w : it->second.list) {
    if (w.n <= count) {
      ready.push_back(w);
    } else {
      rest.list.push_back(w);
      rest.lowest = std::min(rest.lowest, w.n);
    }
  }
  if (rest.list.empty()) {
    barriers_.erase(it);
  } else {
    it->second = std::move(rest);
  }
  // key_ready may run the waiter's next requests, which can touch barriers_ (not `ready`).
  for (const auto& w : ready) key_ready(w.waiter, w.wait_id);
}

KvState::Outcome KvState::resume(Waiter waiter, std::string* out) {
  auto it = parked_.find(waiter);
  if (it == parked_.end()) return {};
  wire::Request request = std::move(it->second.request);
  cancel(waiter);
  return execute(waiter, request, out);
}

bool KvState::time_out(Waiter waiter, uint64_t wait_id, std::string* out) {
  auto it = parked_.find(waiter);
  if (it == parked_.end() || it->second.wait_id != wait_id) return false;
  cancel(waiter);
  wire::Encoder(out).u8(wire::kWaitTimedOut);
  return true;
}

void KvState::cancel(Waiter waiter) {
  auto it = parked_.find(waiter);
  if (it == parked_.end()) return;
  std::vector<std::string> keys = std::move(it->second.keys);
  const bool barrier = it->second.barrier;
  parked_.erase(it);
  for (auto& k : keys) {
    if (barrier) {
      remove_barrier_waiter(k, waiter);
    } else {
      remove_waiter(k, waiter);
    }
  }
}

const wire::Request* KvState::parked(Waiter waiter) const {
  auto it = parked_.find(waiter);
  return it == parked_.end() ? nullptr : &it->second.request;
}

std::vector<std::string> KvState::waiting_for(Waiter waiter) const {
  auto it = parked_.find(waiter);
  return it == parked_.end() ? std::vector<std::string>() : it->second.keys;
}

void KvState::notify(const std::string& key, bool first_only) {
  release_barriers(key);
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  auto list = std::move(it->second);
  waiters_.erase(it);
  for (size_t i = 0; i < list.size(); ++i) {
    // key_ready may run the waiter's next requests, which can touch waiters_ (not `list`).
    if (key_ready(list[i].first, list[i].second) && first_only) {
      if (i + 1 == list.size()) return;
      auto& rest = waiters_[key];
      rest.insert(rest.begin(), list.begin() + i + 1, list.end());
      return;
    }
  }
}

bool KvState::key_ready(Waiter waiter, uint64_t wait_id) {
  auto it = parked_.find(waiter);
  if (it == parked_.end() || it->second.wait_id != wait_id || it->second.remaining == 0) {
    return false;
  }
  if (--it->second.remaining > 0) return false;
  if (wake_) wake_(waiter);  // may erase `it`
  return true;
}

void KvState::remove_waiter(const std::string& key, Waiter waiter) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  auto& list = it->second;
  list.erase(std::remove_if(list.begin(), list.end(),
                            [waiter](const auto& w) { return w.first == waiter; }),
             list.end());
  if (list.empty()) waiters_.erase(it);
}

void KvState::remove_barrier_waiter(const std::string& key, Waiter waiter) {
  auto it = barriers_.find(key);
  if (it == barriers_.end()) return;
  auto& b = it->second;
  b.list.erase(std::remove_if(b.list.begin(), b.list.end(),
                              [waiter](const BarrierWaiter& w) { return w.waiter == waiter; }),
               b.list.end());
  if (b.list.empty()) {
    barriers_.erase(it);
    return;
  }
  b.lowest = INT64_MAX;
  for (const auto& w : b.list) b.lowest = std::min(b.lowest, w.n);
}

void KvState::set(const std::string& key, std::string value) { data_[key] = std::move(value); }

bool KvState::append(const std::string& key, std::string_view value) {
  auto& v = data_[key];
  if (v.size() + value.size() > limits_.max_value_bytes) return false;
  v.append(value);
  return true;
}

std::string KvState::compare_set(const std::string& key, std::string_view expected,
                                 std::string_view desired, bool* swapped) {
  auto it = data_.find(key);
  *swapped = false;
  if (it == data_.end()) {
    if (!expected.empty()) return std::string(expected);
    data_.emplace(key, desired);
  } else if (it->second == expected) {
    it->second = desired;
  } else {
    return it->second;
  }
  *swapped = true;
  return std::string(desired);
}

std::optional<int64_t> KvState::add(const std::string& key, int64_t delta) {
  auto it = data_.find(key);
  int64_t value = 0;
  if (it != data_.end()) {
    const std::string& s = it->second;
    if (!base::parse_decimal(s, &value)) return std::nullopt;
  }
  value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(delta));
  data_[key] = std::to_string(value);
  return value;
}

const std::string* KvState::find(const std::string& key) const {
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

bool KvState::present(const std::string& key, bool queues) const {
  return data_.count(key) || (queues && queues_.count(key));
}

bool KvState::all_present(const std::vector<std::string>& keys, bool queues) const {
  for (auto& k : keys) {
    if (!present(k, queues)) return false;
  }
  return true;
}

std::vector<std::string> KvState::list_keys() const {
  std::vector<std::string> keys;
  keys.reserve(data_.size());
  for (const auto& kv : data_) keys.push_back(kv.first);
  return keys;
}

void KvState::queue_push(const std::string& key, std::string value) {
  queues_[key].push_back(std::move(value));
}

std::optional<std::string> KvState::queue_pop(const std::string& key) {
  auto it = queues_.find(key);
  if (it == queues_.end()) return std::nullopt;
  std::string v = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) queues_.erase(it);
  return v;
}

size_t KvState::queue_len(const std::string& key) const {
  auto it = queues_.find(key);
  return it == queues_.end() ? 0 : it->second.size();
}

}  // namespace trun::store
