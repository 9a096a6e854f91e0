#pragma once
// KvState: the store's key-value semantics without I/O (private to store/). The map,
// PyTorch 2.x's queues, and the waits parked on missing keys, with c10d's semantics as trun's
// server implements them. StoreServer feeds it decoded requests (execute) on its event-loop
// thread; InMemoryStore calls the typed operations under its own mutex.
//
// Waiters are opaque ids chosen by the caller (the server's connection ids). A request that must
// wait for keys parks its waiter: KvState keeps the request and the keys it still misses, and when
// the last of them is written it calls the Wake callback with the waiter; the caller then calls
// resume(), which runs the request again. Each park gets a fresh wait id, so a time-out or a
// wake-up meant for an earlier wait of the same waiter is recognised and ignored.
//
// Thread safety: none; one thread at a time (the server's event loop, or under a mutex).
// Re-entrancy: Wake is called from inside execute() and notify(), and may call back into KvState
// (resume, execute for the waiter's next requests), as the server does.

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/wire.h"

namespace trun::store {

class KvState {
 public:
  using Waiter = uint64_t;
  // The waiter's parked wait is complete: every key it missed has been written. Call resume().
  using Wake = std::function<void(Waiter)>;

  // What execute() / resume() did with a request. Reply bytes, if any, went to the `out` buffer.
  struct Outcome {
    enum class Kind : uint8_t {
      kReply,  // answered (possibly with no bytes: SET, MULTI_SET, APPEND, QUEUE_PUSH)
      kPark,   // the waiter now waits for keys; the answer comes through Wake + resume()
      kClose,  // a request the store cannot honour: close the connection, logging `why`
    };
    Kind kind = Kind::kReply;
    uint64_t wait_id = 0;     // kPark: the wait's id, for time_out()
    int64_t timeout_ms = -1;  // kPark: the wait's deadline, in ms from now; -1: none
    std::string why;          // kClose
  };

  explicit KvState(wire::Limits limits = {}, Wake wake = nullptr)
      : limits_(limits), wake_(std::move(wake)) {}

  // --- wire requests (the server) ---

  // Runs one key-value request from `waiter`, appending its reply to *out; values are moved out
  // of `r`. Handles the ops that touch keys or queues; any other (VALIDATE, PING, leases, ...) is
  // the connection's, and here answers kClose.
  // A MULTI_GET whose values total more than limits.max_value_bytes answers kClose (one reply is
  // bounded like one value). A wait timeout over wire::kMaxWaitTimeoutMs means no deadline.
  Outcome execute(Waiter waiter, wire::Request& r, std::string* out);
  // Runs the waiter's parked request again after Wake (its keys exist now, or one was deleted
  // meanwhile and it parks anew). A waiter with no parked request gets kReply and no bytes.
  Outcome resume(Waiter waiter, std::string* out);
  // The wait `wait_id` timed out: if it is still the waiter's parked wait, it ends with
  // TIMED_OUT appended to *out and true; a stale id changes nothing and returns false.
  bool time_out(Waiter waiter, uint64_t wait_id, std::string* out);
  // Drops the waiter's parked wait, if any (CANCEL_WAIT, a closed connection).
  void cancel(Waiter waiter);
  // The waiter's parked request, or null.
  const wire::Request* parked(Waiter waiter) const;
  // The keys the waiter's parked wait registered for (those missing when it parked, each once,
  // in request order); empty when not parked.
  std::vector<std::string> waiting_for(Waiter waiter) const;

  // Wakes the waiters of `key`, in the order they came. With `first_only` (after a queue push)
  // it stops after the first whose wait is then complete: that one pops the element, the rest
  // keep waiting, ahead of any registered meanwhile (PyTorch's wakeupOneWaitingClient, except
  // that woken waiters leave the list). The typed writes below do not call it themselves, so
  // that a caller can answer first and wake afterwards, as the server does.
  void notify(const std::string& key, bool first_only = false);

  // --- typed operations (c10d's semantics; none of them wakes waiters) ---

  void set(const std::string& key, std::string value);
  // False when the result would exceed limits.max_value_bytes: the value stays as it was (a
  // missing key is still created, empty: the server has always done so).
  bool append(const std::string& key, std::string_view value);
  // c10d's compare_set: a key holding `expected`, or missing with `expected` empty, becomes
  // `desired`; returns the value the key holds afterwards, except that a missing key with a
  // non-empty `expected` returns `expected`. *swapped says whether it wrote.
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired, bool* swapped);
  // Adds `delta` to the decimal integer at `key` (0 when missing), wrapping on overflow, and
  // returns the new value; nullopt (nothing changes) when the value is not an integer.
  std::optional<int64_t> add(const std::string& key, int64_t delta);
  // The value at `key`, or null. Valid until the next write.
  const std::string* find(const std::string& key) const;
  // Whether `key` exists; with `queues`, a non-empty queue counts as its key (check and wait,
  // as in PyTorch's libuv server; get and multi_get see only keys).
  bool present(const std::string& key, bool queues) const;
  bool all_present(const std::vector<std::string>& keys, bool queues) const;
  size_t num_keys() const { return data_.size(); }
  bool erase(const std::string& key) { return data_.erase(key) > 0; }
  std::vector<std::string> list_keys() const;  // unordered; the queues are not keys
  void queue_push(const std::string& key, std::string value);
  std::optional<std::string> queue_pop(const std::string& key);  // nullopt when empty
  size_t queue_len(const std::string& key) const;

  const wire::Limits& limits() const { return limits_; }

 private:
  struct Parked {
    uint64_t wait_id = 0;
    size_t remaining = 0;           // missing keys not yet written
    std::vector<std::string> keys;  // the missing keys, registered in waiters_ (or barriers_)
    bool barrier = false;           // a BARRIER arrival: registered in barriers_
    wire::Request request;
  };
  struct BarrierWaiter {
    Waiter waiter = 0;
    uint64_t wait_id = 0;
    int64_t n = 0;  // released when the key's count reaches it
  };
  struct BarrierWaiters {
    std::vector<BarrierWaiter> list;  // in arrival order
    int64_t lowest = INT64_MAX;       // the smallest n in list
  };

  Outcome park(Waiter waiter, std::vector<std::string> missing, wire::Request request,
               int64_t timeout_ms);
  Outcome park_barrier(Waiter waiter, const std::string& key, int64_t n);
  void release_barriers(const std::string& key);
  void remove_barrier_waiter(const std::string& key, Waiter waiter);
  // `key` was written for this entry of its waiter list: true when that completed the wait (the
  // waiter has been woken).
  bool key_ready(Waiter waiter, uint64_t wait_id);
  void remove_waiter(const std::string& key, Waiter waiter);
  Outcome wait_or_get(Waiter waiter, wire::Request& r, std::string* out);

  wire::Limits limits_;
  Wake wake_;
  std::unordered_map<std::string, std::string> data_;
  // FIFOs apart from the key-value map; an empty queue is erased.
  std::unordered_map<std::string, std::deque<std::string>> queues_;
  std::unordered_map<std::string, std::vector<std::pair<Waiter, uint64_t>>> waiters_;
  // BARRIER arrivals waiting for their key's count, apart from waiters_: the arrivals before the
  // n-th write the key too, and must wake its WAITs but not each other.
  std::unordered_map<std::string, BarrierWaiters> barriers_;
  std::unordered_map<Waiter, Parked> parked_;
  uint64_t next_wait_id_ = 1;
};

}  // namespace trun::store
