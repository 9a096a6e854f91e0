// fuzz-sources: store/kv_state.cpp store/wire.cpp
// libFuzzer target for the store's key-value state (store/kv_state.h): sequences of
// decoded requests from three waiters, with time-outs and cancels in between, executed through
// KvState as the server does (a parked waiter sends nothing until it is answered; Wake resumes it
// at once). Small limits, so that the limit checks are reached often.
//
// Input: a stream of steps. Each step's first byte picks the action (low 2 bits) and the waiter
// (the rest): 0 and 1: decode one 2.x request from the following bytes and execute it; 2: the
// waiter's parked wait times out (with its current id, or a stale one); 3: CANCEL_WAIT.
//
// Invariants checked (abort() on failure, besides the sanitizers):
//  - no lost wake-up: after every step, a parked waiter still misses at least one of its keys
//    in the map (except an unfinished BARRIER, which waits for the next write of its existing
//    key; a queue push wakes only the first waiter);
//  - a parked waiter has a wait id, and waiting_for() names keys that were missing;
//  - replies have the documented shape: GET answers the value the key holds, ADD the value it
//    then holds, CHECK/WAIT single status bytes, MULTI_GET at most the value limit of values;
//  - kClose only for the reasons KvState documents; stale time-outs change nothing;
//  - num_keys() agrees with list_keys(), and no value exceeds the value limit after APPEND.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <string_view>

#include "store/kv_state.h"
#include "store/wire.h"

namespace store = trun::store;
namespace wire = trun::store::wire;
using wire::Op;

namespace {

// Aborts naming the line of the invariant that failed.
void check(bool ok, int line = __builtin_LINE()) {
  if (ok) return;
  std::fprintf(stderr, "kv_sequence_fuzz: invariant at line %d failed\n", line);
  std::abort();
}

constexpr int kWaiters = 3;

struct World {
  wire::Limits limits;
  store::KvState* kv = nullptr;
  std::string out[kWaiters];
  uint64_t wait_id[kWaiters] = {};
  // A BARRIER that did not complete waits for the next write of its key, which exists.
  bool barrier_wait[kWaiters] = {};
  // Keys an unfinished BARRIER counted on: its arrival writes the key without waking the key's
  // waiters (it would release the earlier arrivals, which wait on the same key). A plain WAIT on
  // a barrier's key therefore wakes at the next write, not at the arrival: left out below.
  std::set<std::string> barrier_keys;
  int wakes = 0;
};

uint64_t read_u64(const std::string& s, size_t at) {
  uint64_t v = 0;
  check(s.size() >= at + 8);
  std::memcpy(&v, s.data() + at, 8);
  return v;
}

void after_outcome(World& w, int waiter, const store::KvState::Outcome& o, Op op) {
  switch (o.kind) {
    case store::KvState::Outcome::Kind::kReply:
      break;
    case store::KvState::Outcome::Kind::kPark:
      check(o.wait_id != 0);
      check(w.kv->parked(waiter) != nullptr);
      check(!w.kv->waiting_for(waiter).empty());
      w.wait_id[waiter] = o.wait_id;
      w.barrier_wait[waiter] = op == Op::kBarrier;
      break;
    case store::KvState::Outcome::Kind::kClose:
      check(!o.why.empty());
      check(op == Op::kAppend || op == Op::kAdd || op == Op::kBarrier || op == Op::kMultiGet ||
            op == Op::kValidate || op == Op::kPing || op == Op::kCancelWait ||
            op == Op::kWatchKey || op == Op::kAuthHello || op == Op::kAuthProof ||
            op == Op::kLeaseArm || op == Op::kLeaseRenew || op == Op::kLeaseRelease ||
            op == Op::kLeaseFire);
      w.kv->cancel(waiter);  // the connection closes
      break;
  }
}

void check_state(World& w) {
  check(w.kv->num_keys() == w.kv->list_keys().size());
  for (const auto& k : w.kv->list_keys()) check(w.kv->find(k)->size() <= w.limits.max_value_bytes);
  for (int i = 0; i < kWaiters; ++i) {
    const wire::Request* p = w.kv->parked(i);
    if (!p) {
      check(w.kv->waiting_for(i).empty());
      continue;
    }
    check(!w.kv->waiting_for(i).empty());
    // No lost wake-up: a wait whose keys all exist would have been woken and answered. (Keys
    // only: a queue push wakes the first of a key's waiters, the others wait on.)
    bool on_barrier_key = false;
    for (const auto& k : p->keys) on_barrier_key |= w.barrier_keys.count(k) > 0;
    if (!w.barrier_wait[i] && !on_barrier_key) check(!w.kv->all_present(p->keys, false));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World w;
  w.limits.max_key_bytes = 8;
  w.limits.max_value_bytes = 64;
  w.limits.max_keys_per_request = 4;
  store::KvState kv(w.limits, [&w](store::KvState::Waiter id) {
    // As the server: a woken waiter runs its request again at once.
    ++w.wakes;
    const wire::Request* p = w.kv->parked(id);
    check(p != nullptr);
    const Op op = p->op;
    auto o = w.kv->resume(id, &w.out[id]);
    after_outcome(w, int(id), o, op);
  });
  w.kv = &kv;

  std::string_view in(reinterpret_cast<const char*>(data), size);
  int steps = 0;
  while (!in.empty() && steps++ < 512) {
    const uint8_t step = static_cast<uint8_t>(in[0]);
    in.remove_prefix(1);
    const int waiter = (step >> 2) % kWaiters;
    std::string& out = w.out[waiter];
    switch (step & 3) {
      case 2: {
        // The current wait times out, or a stale id does nothing.
        const bool stale = (step & 0x80) != 0;
        const bool was_parked = kv.parked(waiter) != nullptr;
        const size_t before = out.size();
        bool ended = kv.time_out(waiter, stale ? w.wait_id[waiter] + 1 : w.wait_id[waiter], &out);
        if (stale || !was_parked) check(!ended && out.size() == before);
        if (ended) {
          check(out.size() == before + 1 && uint8_t(out.back()) == wire::kWaitTimedOut);
          check(kv.parked(waiter) == nullptr);
        }
        break;
      }
      case 3:
        kv.cancel(waiter);
        check(kv.parked(waiter) == nullptr);
        break;
      default: {
        wire::Request r;
        auto result = wire::decode(in, wire::Dialect::kV2, w.limits, &r);
        if (result.status != wire::Status::kOk) {
          if (!in.empty()) in.remove_prefix(1);  // skip a byte and try the next step
          break;
        }
        in.remove_prefix(result.consumed);
        if (kv.parked(waiter)) break;  // the server holds requests behind a parked one
        const Op op = r.op;
        const wire::Request copy = r;  // execute moves values out
        const size_t before = out.size();
        auto o = kv.execute(waiter, r, &out);
        if (op == Op::kBarrier) w.barrier_keys.insert(copy.keys[0]);
        std::string reply = out.substr(before);
        after_outcome(w, waiter, o, op);
        if (o.kind != store::KvState::Outcome::Kind::kReply) break;
        switch (op) {
          case Op::kGet:
            // A reply only when the key exists (else it parked); its value as held now, unless a
            // wake-up inside execute changed it (a GET changes nothing).
            check(reply.size() >= 8 && read_u64(reply, 0) == reply.size() - 8);
            check(kv.find(copy.keys[0]) && *kv.find(copy.keys[0]) == reply.substr(8));
            break;
          case Op::kAdd: {
            check(reply.size() == 8);
            int64_t v = int64_t(read_u64(reply, 0));
            check(kv.find(copy.keys[0]) && *kv.find(copy.keys[0]) == std::to_string(v));
            break;
          }
          case Op::kCheck:
            check(reply.size() == 1 && (uint8_t(reply[0]) == wire::kCheckReady ||
                                        uint8_t(reply[0]) == wire::kCheckNotReady));
            break;
          case Op::kWait:
          case Op::kWaitKeys:
            check(reply.size() == 1 && (uint8_t(reply[0]) == wire::kWaitStop ||
                                        uint8_t(reply[0]) == wire::kWaitTimedOut));
            break;
          case Op::kMultiGet: {
            uint64_t values = 0;
            size_t at = 0;
            for (size_t i = 0; i < copy.keys.size(); ++i) {
              uint64_t len = read_u64(reply, at);
              values += len;
              at += 8 + len;
            }
            check(at == reply.size());
            check(values <= w.limits.max_value_bytes);
            break;
          }
          case Op::kSet:
          case Op::kMultiSet:
          case Op::kQueuePush:
            check(reply.empty());
            break;
          default:
            break;
        }
        if (op == Op::kSet) {
          // The value just written, unless a woken waiter's request wrote it meanwhile (only
          // reads run on wake-up), so it holds exactly.
          check(kv.find(copy.keys[0]) && *kv.find(copy.keys[0]) == copy.values[0]);
        }
      }
    }
    check_state(w);
  }
  return 0;
}
